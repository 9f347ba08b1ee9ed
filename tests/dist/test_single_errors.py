"""Bad inputs, load mismatches, corruption, the CLI, and hostile checkpoints (one process)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

import nostall
from nostall.tools.cli import main as cli_main

SRC = str(Path(__file__).resolve().parents[2] / "src")  # tests/dist/ -> the repository


def good_state() -> Dict[str, Any]:
    return {
        "w": torch.arange(48, dtype=torch.float32).reshape(8, 6),
        "opt": {"state": {0: {"m": torch.arange(5, dtype=torch.int64)}}, "param_groups": [{"lr": 0.1}]},
        "epoch": 3,
        "rng": nostall.PerRank(torch.arange(4, dtype=torch.uint8)),
    }


def good_template() -> Dict[str, Any]:
    return {
        "w": torch.zeros(8, 6),
        "opt": {"state": {0: {"m": torch.zeros(5, dtype=torch.int64)}}, "param_groups": None},
        "epoch": None,
        "rng": nostall.PerRank(torch.zeros(4, dtype=torch.uint8)),
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    nostall.save(good_state(), str(path))
    return path


def manifest(path: Path) -> Dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def write_manifest(path: Path, doc: Dict[str, Any]) -> None:
    (path / "manifest.json").write_text(json.dumps(doc))


def piece(path: Path, key: str = "w") -> Dict[str, Any]:
    return manifest(path)["tensors"][key]["pieces"][0]


def flip_byte(path: Path, key: str = "w", where: float = 0.5) -> int:
    """Flip one byte inside ``key``'s data; returns the absolute file offset."""
    p = piece(path, key)
    start, end = p["byte_range"]
    pos = start + int((end - start) * where)
    f = path / p["file"]
    raw = bytearray(f.read_bytes())
    raw[pos] ^= 0xFF
    f.write_bytes(bytes(raw))
    return pos


# --------------------------------------------------------------------------- invalid states


class Custom:
    pass


def _numpy_array():
    np = pytest.importorskip("numpy")
    return np.zeros(3)


BAD_STATES = {
    "object": (lambda: {"w": torch.ones(2), "bad": object()}, ["'bad'"]),
    "custom_class": (lambda: {"w": torch.ones(2), "cfg": {"obj": Custom()}}, ["'cfg/obj'", "Custom"]),
    "numpy_array": (lambda: {"w": torch.ones(2), "arr": _numpy_array()}, ["'arr'", "ndarray"]),
    "set": (lambda: {"w": torch.ones(2), "s": {1, 2}}, ["'s'", "set"]),
    "deep_in_json": (lambda: {"w": torch.ones(2), "cfg": {"a": [1, {"b": b"bytes"}]}}, ["'cfg/a/1/b'", "bytes"]),
    "tuple_key_with_tensor": (lambda: {"m": {(1, 2): torch.ones(1)}}, ["'m'", "tuple"]),
    "tuple_key_json": (lambda: {"w": torch.ones(2), "m": {(1, 2): 3}}, ["'m'", "tuple"]),
    "bool_key_with_tensor": (lambda: {"m": {True: torch.ones(1)}}, ["'m'", "bool"]),
    "int_and_str_key_clash": (lambda: {"m": {0: torch.ones(1), "0": torch.ones(1)}}, ["'m/0'", "twice"]),
    "partial_sharded": (
        lambda: {"w": nostall.ShardedTensor(torch.zeros(2, 6), (8, 6), (0, 0))},
        ["'w'", "12 of 48"],
    ),
    "sharded_without_main_replica": (
        lambda: {"w": nostall.ShardedTensor(torch.zeros(8, 6), (8, 6), (0, 0), replica_id=1)},
        ["'w'", "replica_id"],
    ),
    "per_rank_in_per_rank": (lambda: {"r": nostall.PerRank({"inner": nostall.PerRank(1)})}, ["'r/inner'"]),
    "sharded_in_per_rank": (
        lambda: {"r": nostall.PerRank(nostall.ShardedTensor(torch.zeros(2), (2,), (0,)))},
        ["'r'", "ShardedTensor"],
    ),
    "object_in_per_rank": (lambda: {"r": nostall.PerRank({"x": object()})}, ["'r/x'"]),
    "complex64": (lambda: {"w": torch.ones(2), "c": torch.zeros(3, dtype=torch.complex64)}, ["'c'", "complex64"]),
    "complex_sharded": (
        lambda: {"c": nostall.ShardedTensor(torch.zeros(3, dtype=torch.complex128), (3,), (0,))},
        ["'c'", "complex128"],
    ),
    "complex_in_per_rank": (lambda: {"r": nostall.PerRank(torch.zeros(1, dtype=torch.complex64))}, ["'r'"]),
    "int_keys_in_json_leaf_with_tensor": (lambda: {"w": torch.ones(2), "x": {1: 2}}, ["'x'", "int"]),
    "int_keys_in_json_only_state": (lambda: {"x": {1: 2}}, ["key 'x'", "int"]),
    "top_level_list": (lambda: [torch.ones(2)], ["dict"]),
}


def _assert_nothing_committed(root: Path) -> None:
    if not root.exists():
        return
    names = os.listdir(root)
    assert not [n for n in names if n.startswith("step_")], names
    assert "latest" not in names
    if (root / ".tmp").exists():
        assert [n for n in os.listdir(root / ".tmp") if n != ".lock"] == []


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_invalid_state_rejected_by_manager(tmp_path: Path, case: str) -> None:
    make, needles = BAD_STATES[case]
    state = make()
    mgr = nostall.CheckpointManager(tmp_path / "run")
    with pytest.raises(nostall.InvalidStateError) as ei:
        mgr.save(1, state)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, nostall.CheckpointSaveError)
    _assert_nothing_committed(tmp_path / "run")
    assert mgr.steps() == [] and mgr.latest_step() is None
    assert mgr.stats() == []


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_invalid_state_rejected_by_one_shot_save(tmp_path: Path, case: str) -> None:
    make, needles = BAD_STATES[case]
    state = make()
    with pytest.raises(nostall.InvalidStateError) as ei:
        nostall.save(state, str(tmp_path / "c"))
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))
    assert os.listdir(tmp_path) == []  # no checkpoint, no staging directory


def test_invalid_state_keeps_previous_checkpoint(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(1, good_state())
    with pytest.raises(nostall.InvalidStateError):
        mgr.save(2, {"w": torch.zeros(2, dtype=torch.complex64)})
    assert mgr.steps() == [1]
    assert not (tmp_path / "step_2").exists()
    assert (tmp_path / "latest").read_text().strip() == "1"
    out = mgr.load(good_template())
    assert torch.equal(out["w"], good_state()["w"])


def test_int_keys_are_allowed_in_dicts_holding_tensors(tmp_path: Path) -> None:
    state = {"s": {0: torch.ones(2), 7: {"x": torch.zeros(1), "n": 5}}}
    nostall.save(state, str(tmp_path / "c"))
    keys = set(manifest(tmp_path / "c")["tensors"])
    assert keys == {"s/0", "s/7/x"}
    assert set(manifest(tmp_path / "c")["objects"]) == {"s/7/n"}
    out = nostall.load({"s": {0: torch.empty(2), 7: {"x": torch.empty(1), "n": None}}}, str(tmp_path / "c"))
    assert list(out["s"]) == [0, 7] and out["s"][7]["n"] == 5


def test_keys_are_escaped(tmp_path: Path) -> None:
    state = {"a/b": torch.ones(1), "c~d": {"e/f": torch.zeros(1)}}
    nostall.save(state, str(tmp_path / "c"))
    assert set(manifest(tmp_path / "c")["tensors"]) == {"a~1b", "c~0d/e~1f"}
    out = nostall.load({"a/b": torch.empty(1), "c~d": {"e/f": torch.empty(1)}}, str(tmp_path / "c"))
    assert torch.equal(out["a/b"], torch.ones(1)) and torch.equal(out["c~d"]["e/f"], torch.zeros(1))


# --------------------------------------------------------------------------- ShardedTensor


@pytest.mark.parametrize(
    "shape,gshape,goff",
    [
        ((2, 3), (4, 3), (3, 0)),  # runs past the end on dim 0
        ((2, 3), (4, 3), (0, 1)),  # runs past the end on dim 1
        ((2, 3), (4, 3), (-1, 0)),  # negative offset
        ((5,), (4,), (0,)),  # bigger than the whole
        ((1,), (4,), (4,)),  # starts at the end
    ],
)
def test_sharded_tensor_rejects_offsets_outside(shape, gshape, goff) -> None:
    with pytest.raises(ValueError, match="outside"):
        nostall.ShardedTensor(torch.zeros(shape), gshape, goff)


@pytest.mark.parametrize(
    "shape,gshape,goff",
    [((2, 3), (4,), (0, 0)), ((2, 3), (4, 3), (0,)), ((2,), (4, 3), (0, 0)), ((), (1,), (0,))],
)
def test_sharded_tensor_rejects_dim_mismatch(shape, gshape, goff) -> None:
    with pytest.raises(ValueError, match="dims"):
        nostall.ShardedTensor(torch.zeros(shape), gshape, goff)


def test_sharded_tensor_accepts_valid_boxes() -> None:
    st = nostall.ShardedTensor(torch.zeros(2, 3), [4, 6], [2, 3])
    assert st.global_shape == (4, 6) and st.global_offset == (2, 3)
    assert st.is_main_replica
    assert not nostall.ShardedTensor(torch.zeros(1), (1,), (0,), replica_id=(0, 1)).is_main_replica
    with pytest.raises(TypeError):
        nostall.ShardedTensor([1.0, 2.0], (2,), (0,))


# --------------------------------------------------------------------------- load mismatches


def test_load_key_missing(ckpt: Path) -> None:
    tpl = good_template()
    tpl["extra"] = torch.zeros(2)
    with pytest.raises(nostall.CheckpointLoadError, match="'extra'"):
        nostall.load(tpl, str(ckpt))


def test_load_nested_key_missing(ckpt: Path) -> None:
    tpl = good_template()
    tpl["opt"]["state"][1] = {"m": torch.zeros(5, dtype=torch.int64)}
    with pytest.raises(nostall.CheckpointLoadError, match="'opt/state/1/m'"):
        nostall.load(tpl, str(ckpt))


def test_load_dtype_mismatch(ckpt: Path) -> None:
    tpl = good_template()
    tpl["w"] = torch.zeros(8, 6, dtype=torch.float64)
    with pytest.raises(nostall.CheckpointLoadError, match="'w'") as ei:
        nostall.load(tpl, str(ckpt))
    assert "float64" in str(ei.value) and "float32" in str(ei.value)
    assert not isinstance(ei.value, nostall.CheckpointCorruptError)
    assert torch.equal(tpl["w"], torch.zeros(8, 6, dtype=torch.float64))


def test_load_shape_mismatch(ckpt: Path) -> None:
    tpl = good_template()
    tpl["w"] = torch.zeros(6, 8)
    with pytest.raises(nostall.CheckpointLoadError, match="'w'") as ei:
        nostall.load(tpl, str(ckpt))
    assert "[8, 6]" in str(ei.value) and "[6, 8]" in str(ei.value)


def test_load_sharded_global_shape_mismatch(ckpt: Path) -> None:
    tpl = good_template()
    tpl["w"] = nostall.ShardedTensor(torch.zeros(2, 6), (9, 6), (0, 0))
    with pytest.raises(nostall.CheckpointLoadError, match="'w'") as ei:
        nostall.load(tpl, str(ckpt))
    assert "[9, 6]" in str(ei.value)


def test_load_json_key_missing(ckpt: Path) -> None:
    tpl = good_template()
    tpl["lr_schedule"] = {"last": 0}
    with pytest.raises(nostall.CheckpointLoadError, match="'lr_schedule'"):
        nostall.load(tpl, str(ckpt))


def test_load_per_rank_key_missing(ckpt: Path) -> None:
    tpl = good_template()
    tpl["rng"] = nostall.PerRank({"t": torch.zeros(4, dtype=torch.uint8)})
    with pytest.raises(nostall.CheckpointLoadError, match="'rng/t'"):
        nostall.load(tpl, str(ckpt))


def test_load_bad_per_rank_mode(ckpt: Path) -> None:
    with pytest.raises(ValueError):
        nostall.load(good_template(), str(ckpt), per_rank="maybe")


def test_load_subset_of_keys(ckpt: Path) -> None:
    with pytest.raises(nostall.CheckpointLoadError, match="unexpected key"):
        nostall.load({"w": torch.zeros(8, 6)}, str(ckpt))  # strict by default, as load_state_dict
    out = nostall.load({"w": torch.zeros(8, 6)}, str(ckpt), strict=False)
    assert torch.equal(out["w"], good_state()["w"])


def test_load_nonexistent_path(tmp_path: Path) -> None:
    with pytest.raises(nostall.CheckpointNotFoundError):
        nostall.load(good_template(), str(tmp_path / "nope"))
    assert issubclass(nostall.CheckpointNotFoundError, FileNotFoundError)


# --------------------------------------------------------------------------- corruption


def test_flipped_byte_is_detected(ckpt: Path) -> None:
    flip_byte(ckpt, "w")
    tpl = good_template()
    with pytest.raises(nostall.CheckpointCorruptError, match=r"rank0\.safetensors") as ei:
        nostall.load(tpl, str(ckpt))
    assert "'w'" in str(ei.value)


@pytest.mark.parametrize("where", [0.0, 0.999])
def test_flipped_byte_detected_in_partial_load(tmp_path: Path, where: float) -> None:
    n = 100_000
    mgr = nostall.CheckpointManager(tmp_path, block_size=4096)
    mgr.save(1, {"big": torch.arange(n, dtype=torch.float32)})
    flip_byte(tmp_path / "step_1", "big", where)
    off = int(n * where)
    lo = max(0, off - 10)
    tpl = nostall.ShardedTensor(torch.zeros(20), (n,), (lo,))
    with pytest.raises(nostall.CheckpointCorruptError, match=r"rank0\.safetensors"):
        mgr.load({"big": tpl})


def test_flipped_byte_with_verify_false_loads_the_stored_bytes(ckpt: Path) -> None:
    pos = flip_byte(ckpt, "w")
    p = piece(ckpt, "w")
    idx = (pos - p["byte_range"][0]) // 4
    out = nostall.load(good_template(), str(ckpt), verify=False)
    expect = good_state()["w"].flatten()
    got = out["w"].flatten()
    assert not torch.equal(got[idx].view(torch.int32), expect[idx].view(torch.int32))
    mask = torch.ones(48, dtype=torch.bool)
    mask[idx] = False
    assert torch.equal(got[mask], expect[mask])
    # other keys are unaffected and still verified
    assert torch.equal(out["opt"]["state"][0]["m"], torch.arange(5))


def test_flipped_byte_through_manager(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(1, good_state())
    flip_byte(tmp_path / "step_1", "opt/state/0/m")
    with pytest.raises(nostall.CheckpointCorruptError, match=r"rank0\.safetensors"):
        mgr.load(good_template())
    mgr.load(good_template(), verify=False)


@pytest.mark.parametrize("cut", [1, 100, "header"])
def test_truncated_data_file(ckpt: Path, cut) -> None:
    f = ckpt / "rank0.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:7] if cut == "header" else raw[:-cut])
    for verify in (True, False):
        with pytest.raises(nostall.CheckpointCorruptError, match=r"rank0\.safetensors"):
            nostall.load(good_template(), str(ckpt), verify=verify)


def test_grown_data_file(ckpt: Path) -> None:
    f = ckpt / "rank0.safetensors"
    f.write_bytes(f.read_bytes() + b"\x00" * 8)
    with pytest.raises(nostall.CheckpointCorruptError, match=r"rank0\.safetensors"):
        nostall.load(good_template(), str(ckpt))


def test_missing_data_file(ckpt: Path) -> None:
    (ckpt / "rank0.safetensors").unlink()
    with pytest.raises(nostall.CheckpointCorruptError, match=r"rank0\.safetensors"):
        nostall.load(good_template(), str(ckpt))


def test_missing_manifest_is_not_found(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(1, good_state())
    mgr.save(2, good_state())
    (tmp_path / "step_2" / "manifest.json").unlink()
    assert mgr.steps() == [1] and mgr.latest_step() == 1
    with pytest.raises(nostall.CheckpointNotFoundError, match="manifest"):
        mgr.load(good_template(), step=2)
    with pytest.raises(nostall.CheckpointNotFoundError, match="manifest"):
        nostall.load(good_template(), str(tmp_path / "step_2"))
    mgr.load(good_template())  # falls back to step 1


@pytest.mark.parametrize(
    "content",
    [b"\x00\xffgarbage{{", b"", b"[1, 2, 3]", b'{"format": "other"}', "truncated", "no_tensors_key"],
)
def test_bad_manifest_is_corrupt(ckpt: Path, content) -> None:
    mpath = ckpt / "manifest.json"
    raw = mpath.read_bytes()
    if content == "truncated":
        content = raw[: len(raw) // 2]
    elif content == "no_tensors_key":
        doc = json.loads(raw)
        del doc["tensors"]
        content = json.dumps(doc).encode()
    mpath.write_bytes(content)
    with pytest.raises(nostall.CheckpointCorruptError, match=r"manifest\.json"):
        nostall.load(good_template(), str(ckpt))


def test_newer_format_version_is_refused(ckpt: Path) -> None:
    doc = manifest(ckpt)
    doc["version"] = 999
    write_manifest(ckpt, doc)
    with pytest.raises(nostall.CheckpointCorruptError, match="version"):
        nostall.load(good_template(), str(ckpt))


def test_byte_range_outside_file(ckpt: Path) -> None:
    doc = manifest(ckpt)
    size = doc["files"]["rank0.safetensors"]["size"]
    p = doc["tensors"]["w"]["pieces"][0]
    n = p["byte_range"][1] - p["byte_range"][0]
    p["byte_range"] = [size, size + n]
    write_manifest(ckpt, doc)
    with pytest.raises(nostall.CheckpointCorruptError, match="'w'"):
        nostall.load(good_template(), str(ckpt))


def test_byte_range_outside_real_file_even_if_manifest_size_agrees(ckpt: Path) -> None:
    doc = manifest(ckpt)
    size = doc["files"]["rank0.safetensors"]["size"]
    p = doc["tensors"]["w"]["pieces"][0]
    n = p["byte_range"][1] - p["byte_range"][0]
    p["byte_range"] = [size, size + n]
    doc["files"]["rank0.safetensors"]["size"] = size + n
    write_manifest(ckpt, doc)
    with pytest.raises(nostall.CheckpointCorruptError, match=r"rank0\.safetensors"):
        nostall.load(good_template(), str(ckpt), verify=False)


def test_byte_range_of_wrong_length(ckpt: Path) -> None:
    doc = manifest(ckpt)
    p = doc["tensors"]["w"]["pieces"][0]
    p["byte_range"][1] -= 4
    write_manifest(ckpt, doc)
    with pytest.raises(nostall.CheckpointCorruptError, match="'w'"):
        nostall.load(good_template(), str(ckpt))


@pytest.mark.parametrize("name", ["../evil", ".hidden", "manifest.json", "a/b"])
def test_manifest_data_file_names_are_confined(ckpt: Path, name: str) -> None:
    doc = manifest(ckpt)
    doc["files"][name] = doc["files"].pop("rank0.safetensors")
    for t in doc["tensors"].values():
        for p in t["pieces"]:
            p["file"] = name
    write_manifest(ckpt, doc)
    with pytest.raises(nostall.CheckpointCorruptError, match="file name"):
        nostall.load(good_template(), str(ckpt))


def test_manifest_pieces_must_cover_the_tensor(ckpt: Path) -> None:
    """A manifest that lists no piece for part of a tensor cannot silently leave
    the template's old values in place."""
    doc = manifest(ckpt)
    doc["tensors"]["w"]["pieces"] = []
    write_manifest(ckpt, doc)
    tpl = good_template()
    tpl["w"].fill_(-1.0)
    with pytest.raises(nostall.CheckpointCorruptError, match="'w'"):
        nostall.load(tpl, str(ckpt))


# --------------------------------------------------------------------------- CLI


def test_cli_verify_ok(ckpt: Path, capsys) -> None:
    assert cli_main(["verify", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and str(ckpt) in out


def _corrupt(ckpt: Path, how: str) -> str:
    if how == "flip":
        flip_byte(ckpt, "w")
        return "rank0.safetensors"
    if how == "flip_per_rank":
        flip_byte_per_rank(ckpt)
        return "rank0.safetensors"
    if how == "truncate":
        f = ckpt / "rank0.safetensors"
        f.write_bytes(f.read_bytes()[:-10])
        return "rank0.safetensors"
    if how == "missing_manifest":
        (ckpt / "manifest.json").unlink()
        return "manifest.json"
    if how == "garbage_manifest":
        (ckpt / "manifest.json").write_bytes(b"{not json")
        return "manifest.json"
    if how == "header_dtype":
        tamper_header_dtype(ckpt)
        return "rank0.safetensors"
    raise AssertionError(how)


def flip_byte_per_rank(ckpt: Path) -> None:
    p = manifest(ckpt)["per_rank"][0]["tensors"]["rng"]["pieces"][0]
    f = ckpt / p["file"]
    raw = bytearray(f.read_bytes())
    raw[p["byte_range"][0]] ^= 0x01
    f.write_bytes(bytes(raw))


def tamper_header_dtype(ckpt: Path, new_dtype: str = "O") -> None:
    """Rewrite the safetensors header: ``w`` claims dtype ``new_dtype`` (same header length)."""
    f = ckpt / "rank0.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["w"]["dtype"] = new_dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    f.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])
    assert f.stat().st_size == len(raw)


@pytest.mark.parametrize(
    "how", ["flip", "flip_per_rank", "truncate", "missing_manifest", "garbage_manifest", "header_dtype"]
)
def test_cli_verify_detects_damage(ckpt: Path, capsys, how: str) -> None:
    bad = _corrupt(ckpt, how)
    assert cli_main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert bad in err, err
    assert "FAILED" in err


def test_cli_verify_run_root_uses_newest_step(tmp_path: Path, capsys) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(1, good_state())
    mgr.save(2, good_state())
    flip_byte(tmp_path / "step_1", "w")  # only the older one is damaged
    assert cli_main(["verify", str(tmp_path)]) == 0
    assert "step_2" in capsys.readouterr().out
    flip_byte(tmp_path / "step_2", "w")
    assert cli_main(["verify", str(tmp_path)]) == 1
    assert "step_2" in capsys.readouterr().err


def test_cli_verify_empty_root_fails(tmp_path: Path, capsys) -> None:
    assert cli_main(["verify", str(tmp_path)]) == 1
    assert "manifest.json" in capsys.readouterr().err


def test_cli_inspect_text(ckpt: Path, capsys) -> None:
    assert cli_main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    for needle in ("w", "[8, 6]", "F32", "opt/state/0/m", "[5]", "I64", "epoch", "rank0.safetensors", "rng"):
        assert needle in out, (needle, out)


def test_cli_inspect_json(tmp_path: Path, capsys) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(3, good_state())
    mgr.save(5, good_state())
    assert cli_main(["inspect", "--json", str(tmp_path / "step_3")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 3 and doc["world_size"] == 1
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert set(tensors) == {"w", "opt/state/0/m"}
    assert tensors["w"]["shape"] == [8, 6] and tensors["w"]["dtype"] == "F32"
    assert tensors["w"]["bytes"] == 8 * 6 * 4
    assert tensors["opt/state/0/m"]["dtype"] == "I64"
    assert set(doc["objects"]) == {"epoch", "opt/param_groups"}
    assert doc["per_rank"] == [{"tensors": ["rng"], "objects": []}]
    # the run root resolves to the newest step
    assert cli_main(["inspect", "--json", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 5
    assert doc["path"] == str(tmp_path / "step_5")


def test_cli_inspect_missing(tmp_path: Path, capsys) -> None:
    assert cli_main(["inspect", str(tmp_path / "nope")]) == 1
    assert "nope" in capsys.readouterr().err


def test_cli_module_entry_point(ckpt: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run(
        [sys.executable, "-m", "nostall", "verify", str(ckpt)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout and str(ckpt) in r.stdout


# --------------------------------------------------------------------------- hostile checkpoints


class _Marker:
    """Unpickling this creates the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _payload(marker: Path) -> bytes:
    return pickle.dumps(_Marker(str(marker)))


def test_pickle_payload_is_live(tmp_path: Path) -> None:
    """Sanity check of the payload used below: unpickling it does create the marker."""
    marker = tmp_path / "sanity"
    f = pickle.loads(_payload(marker))
    f.close()
    assert marker.exists()


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch):
    def refuse(*a, **k):
        raise AssertionError("nostall unpickled something")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)


def test_pickle_files_in_checkpoint_are_ignored(ckpt: Path, tmp_path: Path, no_unpickling) -> None:
    marker = tmp_path / "PWNED"
    (ckpt / ".metadata").write_bytes(_payload(marker))
    (ckpt / "__0_0.distcp").write_bytes(_payload(marker))
    (ckpt / "model.pt").write_bytes(_payload(marker))
    out = nostall.load(good_template(), str(ckpt))
    assert torch.equal(out["w"], good_state()["w"])
    assert cli_main(["verify", str(ckpt)]) == 0
    assert cli_main(["inspect", str(ckpt)]) == 0
    assert not marker.exists()


def test_data_file_replaced_by_pickle(ckpt: Path, tmp_path: Path, no_unpickling) -> None:
    marker = tmp_path / "PWNED"
    f = ckpt / "rank0.safetensors"
    size = f.stat().st_size
    payload = _payload(marker)
    assert len(payload) <= size
    f.write_bytes(payload + b"." * (size - len(payload)))  # same size: only checksums can tell
    with pytest.raises(nostall.CheckpointCorruptError):
        nostall.load(good_template(), str(ckpt))
    assert cli_main(["verify", str(ckpt)]) == 1
    assert not marker.exists()


def test_data_header_claiming_object_dtype(ckpt: Path, tmp_path: Path, no_unpickling) -> None:
    tamper_header_dtype(ckpt, "O")
    # the manifest rules on load: the header is either ignored or reported as corrupt
    try:
        out = nostall.load(good_template(), str(ckpt))
    except nostall.CheckpointCorruptError:
        pass
    else:
        assert torch.equal(out["w"], good_state()["w"])
    assert cli_main(["verify", str(ckpt)]) == 1


@pytest.mark.parametrize("dtype", ["O", "object", "__reduce__", "PICKLE"])
def test_manifest_with_unknown_dtype(ckpt: Path, no_unpickling, dtype: str) -> None:
    doc = manifest(ckpt)
    doc["tensors"]["w"]["dtype"] = dtype
    write_manifest(ckpt, doc)
    with pytest.raises(nostall.CheckpointCorruptError, match="dtype"):
        nostall.load(good_template(), str(ckpt))


def test_manifest_objects_are_plain_data(ckpt: Path, tmp_path: Path, no_unpickling) -> None:
    marker = tmp_path / "PWNED"
    doc = manifest(ckpt)
    evil = {"py/reduce": [{"py/function": "builtins.open"}, [str(marker), "w"]], "__reduce__": "open"}
    doc["objects"]["epoch"] = evil
    doc["objects"]["opt/param_groups"] = _payload(marker).decode("latin-1")
    write_manifest(ckpt, doc)
    out = nostall.load(good_template(), str(ckpt))
    assert out["epoch"] == evil
    assert out["opt"]["param_groups"] == _payload(marker).decode("latin-1")
    assert not marker.exists()


def test_verify_reports_every_problem_not_only_the_first(tmp_path: Path, capsys) -> None:
    """Two damaged tensors in one file and a missing file of another rank: all three are reported."""
    ckpt = tmp_path / "multi"
    nostall.save(good_state(), str(ckpt))
    flip_byte(ckpt, "w")
    flip_byte(ckpt, "opt/state/0/m")
    doc = manifest(ckpt)
    doc["files"]["rank7.safetensors"] = {"rank": 0, "size": 64}
    write_manifest(ckpt, doc)
    assert cli_main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "3 problem(s)" in err
    assert "key 'w'" in err and "key 'opt/state/0/m'" in err
    assert "rank7.safetensors: data file missing" in err


def test_symlinked_data_file_is_refused(ckpt: Path, tmp_path: Path) -> None:
    """A data file replaced by a symlink (to a file outside the checkpoint) is never read."""
    outside = tmp_path / "outside.bin"
    data = ckpt / "rank0.safetensors"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)
    with pytest.raises(nostall.CheckpointCorruptError, match="symbolic link"):
        nostall.load(good_template(), str(ckpt))


def test_symlinked_manifest_is_refused(ckpt: Path, tmp_path: Path) -> None:
    outside = tmp_path / "manifest-elsewhere.json"
    outside.write_bytes((ckpt / "manifest.json").read_bytes())
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").symlink_to(outside)
    with pytest.raises(nostall.CheckpointLoadError, match="symbolic link"):
        nostall.load(good_template(), str(ckpt))


def test_huge_declared_header_is_refused_before_reading(ckpt: Path, monkeypatch) -> None:
    """A header length of 2**40 bytes is rejected without allocating it."""
    from nostall.storage import files as storage

    f = ckpt / "rank0.safetensors"
    raw = bytearray(f.read_bytes())
    raw[:8] = (1 << 40).to_bytes(8, "little")
    f.write_bytes(bytes(raw))
    asked = []
    real = storage.read_exact
    monkeypatch.setattr(storage, "read_exact", lambda fd, off, n, p, into=None: asked.append(n) or real(fd, off, n, p, into))
    report = __import__("nostall.loading.verify", fromlist=["x"]).check_checkpoint(str(ckpt))
    assert any("header length" in p for p in report.problems)
    assert max(asked) < 1 << 21


def test_huge_manifest_is_refused_before_reading(ckpt: Path, monkeypatch) -> None:
    from nostall.core import format as fmt
    from nostall.storage import posix

    monkeypatch.setattr(posix, "MAX_MANIFEST_BYTES", 100)
    assert (ckpt / "manifest.json").stat().st_size > 100
    with pytest.raises(nostall.CheckpointLoadError, match="more than the 100 accepted"):
        nostall.load(good_template(), str(ckpt))
    assert fmt.MAX_MANIFEST_BYTES >= 1 << 30
