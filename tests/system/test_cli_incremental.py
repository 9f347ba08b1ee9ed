"""The command line and the interop readers on incremental checkpoints (issue 19): ``nostall copy``
(a self-contained copy, local and s3), ``inspect`` / ``verify`` / ``ls`` of a checkpoint that reads
files of earlier ones, safetensors export, ``dcp.load`` through ``nostall.dcp.Reader`` and the
Megatron adapter. Real files, the real CLI entry point; no timing."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import nostall
from nostall.tools.cli import main as cli_main
from nostall.interop.copy import copy_checkpoint
from nostall.core.format import MANIFEST_NAME, Manifest
from nostall.loading.manifests import read_manifest

FROZEN = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))  # 256 KiB, never changes


def _state(step: int) -> dict:
    return {
        "model": {"frozen": FROZEN, "tied": FROZEN, "head": torch.full((16,), float(step))},
        "opt": {"m": torch.full((8,), float(step), dtype=torch.bfloat16)},
        "step": step,
        "pos": nostall.PerRank(torch.full((3,), step)),
    }


def _template() -> dict:
    return {
        "model": {"frozen": torch.empty(64, 1024), "tied": torch.empty(64, 1024), "head": torch.empty(16)},
        "opt": {"m": torch.empty(8, dtype=torch.bfloat16)},
        "step": 0,
        "pos": nostall.PerRank(torch.empty(3, dtype=torch.int64)),
    }


def _check(loaded: dict, step: int) -> None:
    want = _state(step)
    assert torch.equal(loaded["model"]["frozen"], FROZEN)
    assert torch.equal(loaded["model"]["tied"], FROZEN)
    assert torch.equal(loaded["model"]["head"], want["model"]["head"])
    assert torch.equal(loaded["opt"]["m"], want["opt"]["m"])
    assert loaded["step"] == step
    pos = loaded["pos"].value if isinstance(loaded["pos"], nostall.PerRank) else loaded["pos"]
    assert torch.equal(pos, torch.full((3,), step))


@pytest.fixture
def inc_root(tmp_path) -> str:
    """An incremental run root: steps 2 and 3 retained, both reading 'frozen' from step 1's file; step 1
    itself was deleted by retention (its directory holds only the retired manifest and that file)."""
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root, incremental=True, keep_last=2) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s), files={"config.json": {"step": s}})
    assert sorted(os.listdir(root)) == [".tmp", "latest", "step_1", "step_2", "step_3"]
    assert MANIFEST_NAME not in os.listdir(os.path.join(root, "step_1"))  # retired, not a checkpoint
    assert read_manifest(os.path.join(root, "step_3")).references
    return root


def _out(capsys) -> str:
    return capsys.readouterr().out


def _leftovers(parent: str, name: str) -> list:
    return [n for n in os.listdir(parent) if n.startswith(f".{name}.nostall")]


# --------------------------------------------------------------------------- copy


def test_copy_is_self_contained_and_loads_bit_exactly(inc_root, tmp_path, capsys):
    src = os.path.join(inc_root, "step_3")
    m = read_manifest(src)
    dst = str(tmp_path / "handoff")
    assert cli_main(["copy", "--json", inc_root, dst]) == 0  # a run root: its latest
    rep = json.loads(_out(capsys))
    assert rep["src"] == src and rep["dst"] == dst
    assert [n.split("/")[0] for n in rep["referenced"]] == ["step_1"]
    assert rep["referenced_bytes"] == FROZEN.numel() * 4  # tied key counted once
    assert rep["bytes"] == rep["own_bytes"] + rep["referenced_bytes"] == (64 * 1024 + 16) * 4 + 8 * 2 + 3 * 8

    c = read_manifest(dst)
    assert c.references == {} and c.version == 1  # no references, no digests: readable by every nostall
    assert sorted(os.listdir(dst)) == ["config.json", MANIFEST_NAME, "rank0.safetensors"]
    assert c.all_files() == c.files and set(c.files) == {"rank0.safetensors"}
    # exactly the pieces' bytes: no stale piece of step 1's file came along
    data = os.path.join(dst, "rank0.safetensors")
    with open(data, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    assert os.path.getsize(data) - 8 - header_len == rep["bytes"]
    # checksums unchanged, key by key (pieces moved, their block checksums did not)
    for k, t in m.tensors.items():
        assert [p.crc32c for p in c.tensors[k].pieces] == [p.crc32c for p in t.pieces]
        assert c.tensors[k].tied_to == t.tied_to
    assert [p.crc32c for p in c.per_rank[0].tensors["pos"].pieces] == \
           [p.crc32c for p in m.per_rank[0].tensors["pos"].pieces]
    assert c.objects == m.objects and c.step == 3 and set(c.side_files) == {"config.json"}

    assert cli_main(["verify", dst]) == 0
    assert "every checksum matches" in _out(capsys)
    shutil.rmtree(inc_root)  # the copy needs nothing of its root
    _check(nostall.load(_template(), dst), 3)
    assert json.loads(open(os.path.join(dst, "config.json")).read()) == {"step": 3}


def test_the_copy_is_plain_safetensors(inc_root, tmp_path):
    from safetensors.torch import load_file

    dst = str(tmp_path / "c")
    copy_checkpoint(os.path.join(inc_root, "step_2"), dst)
    got = load_file(os.path.join(dst, "rank0.safetensors"))
    assert torch.equal(got["model/frozen"], FROZEN)  # entries named as a save names them
    assert torch.equal(got["model/head"], torch.full((16,), 2.0))
    assert torch.equal(got["pos"], torch.full((3,), 2))


def test_copy_of_a_checkpoint_with_no_file_of_its_own(tmp_path, capsys):
    """Nothing changed between two saves: the second checkpoint reads every piece from the first."""
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root, incremental=True) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(1))
    m = read_manifest(os.path.join(root, "step_2"))
    assert m.files == {} and m.references
    dst = str(tmp_path / "c")
    assert cli_main(["copy", os.path.join(root, "step_2"), dst]) == 0
    assert "of earlier checkpoints" in _out(capsys)
    assert cli_main(["verify", dst]) == 0
    _check(nostall.load(_template(), dst), 1)


def test_copy_of_a_full_checkpoint_is_a_plain_copy(tmp_path, capsys):
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(5, _state(5))
    dst = str(tmp_path / "c")
    assert cli_main(["copy", "--json", root, dst]) == 0
    rep = json.loads(_out(capsys))
    assert rep["referenced"] == [] and rep["referenced_bytes"] == 0
    src_m, c = read_manifest(os.path.join(root, "step_5")), read_manifest(dst)
    assert {k: [p.crc32c for p in t.pieces] for k, t in src_m.tensors.items()} == \
           {k: [p.crc32c for p in t.pieces] for k, t in c.tensors.items()}
    assert cli_main(["verify", dst]) == 0
    _check(nostall.load(_template(), dst), 5)


def test_copy_refuses_what_is_not_its_to_write(inc_root, tmp_path, capsys):
    src = os.path.join(inc_root, "step_3")
    # a directory that is not a checkpoint
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert cli_main(["copy", src, str(other)]) == 1
    err = capsys.readouterr().err
    assert "is not a nostall checkpoint" in err and str(other) in err and len(err.strip().splitlines()) == 1
    assert os.listdir(other) == ["notes.txt"]
    # a file, a symbolic link
    (tmp_path / "file").write_text("x")
    assert cli_main(["copy", src, str(tmp_path / "file")]) == 1
    assert "not a directory" in capsys.readouterr().err
    os.symlink(str(tmp_path / "elsewhere"), str(tmp_path / "link"))
    assert cli_main(["copy", src, str(tmp_path / "link")]) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "elsewhere")
    # itself
    assert cli_main(["copy", src, src]) == 1
    assert "is the checkpoint being copied" in capsys.readouterr().err
    # a checkpoint: only with --overwrite; an empty directory is fine
    dst = tmp_path / "c"
    dst.mkdir()
    assert cli_main(["copy", src, str(dst)]) == 0
    assert cli_main(["copy", os.path.join(inc_root, "step_2"), str(dst)]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert read_manifest(str(dst)).step == 3
    assert cli_main(["copy", "--overwrite", os.path.join(inc_root, "step_2"), str(dst)]) == 0
    assert read_manifest(str(dst)).step == 2
    assert cli_main(["verify", str(dst)]) == 0
    _check(nostall.load(_template(), str(dst)), 2)
    assert _leftovers(str(tmp_path), "c") == [] and _leftovers(str(tmp_path), "other") == []


def test_copy_of_a_damaged_chain_commits_nothing(inc_root, tmp_path, capsys):
    ref = next(iter(read_manifest(os.path.join(inc_root, "step_3")).references))
    path = os.path.join(inc_root, ref)
    with open(path, "r+b") as f:  # one byte of 'frozen' in step 1's file
        f.seek(os.path.getsize(path) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    dst = str(tmp_path / "c")
    assert cli_main(["copy", inc_root, dst]) == 1
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and path in err and "nostall verify" in err
    assert not os.path.exists(dst) and _leftovers(str(tmp_path), "c") == []
    # verify says the same, naming the referenced file it checked
    assert cli_main(["verify", "--json", inc_root]) == 1
    out = json.loads(_out(capsys))
    assert out["referenced"] == [ref] and any(path in p for p in out["problems"])

    os.unlink(path)  # gone: the copy names the file and what to do
    assert cli_main(["copy", inc_root, dst]) == 1
    err = capsys.readouterr().err
    assert "data file missing" in err and path in err and not os.path.exists(dst)


# --------------------------------------------------------------------------- inspect, verify, ls


def test_inspect_shows_own_and_referenced_bytes_per_file(inc_root, capsys):
    m = read_manifest(os.path.join(inc_root, "step_3"))
    (own,) = m.files
    (ref,) = m.references
    assert cli_main(["inspect", "--json", inc_root]) == 0
    s = json.loads(_out(capsys))
    assert s["incremental"] is True
    assert s["referenced_bytes"] == FROZEN.numel() * 4
    assert s["own_bytes"] == 16 * 4 + 8 * 2 + 3 * 8
    assert [f["name"] for f in s["files"]] == [own] and s["files"][0]["tensor_bytes"] == s["own_bytes"]
    assert s["references"] == [{"name": ref, "checkpoint": "step_1", "rank": 0, "size": m.references[ref].size,
                                "tensor_bytes": FROZEN.numel() * 4}]
    assert {p["file"] for p in next(t for t in s["tensors"] if t["key"] == "model/frozen")["pieces"]} == {ref}
    assert cli_main(["inspect", inc_root]) == 0
    text = _out(capsys)
    assert ref in text and own in text and "read from 1 file(s) of earlier checkpoint(s) (step_1)" in text


def test_inspect_of_a_full_checkpoint_is_as_before(tmp_path, capsys):
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
    assert cli_main(["inspect", "--json", root]) == 0
    s = json.loads(_out(capsys))
    assert s["incremental"] is False and s["references"] == [] and s["referenced_bytes"] == 0
    assert cli_main(["inspect", root]) == 0
    assert "incremental" not in _out(capsys)


def test_verify_names_the_referenced_files_it_checked(inc_root, capsys):
    (ref,) = read_manifest(os.path.join(inc_root, "step_3")).references
    assert cli_main(["verify", inc_root]) == 0
    out = _out(capsys)
    assert out.startswith(f"OK  {os.path.join(inc_root, 'step_3')}: 2 file(s) (1 of them of earlier checkpoints")
    assert ref in out
    assert cli_main(["verify", "--json", inc_root]) == 0
    v = json.loads(_out(capsys))
    assert v["ok"] and v["files"] == 2 and v["referenced"] == [ref]


def test_ls_lists_no_retired_step(inc_root, capsys):
    assert any(n.startswith(".retired-") for n in os.listdir(os.path.join(inc_root, "step_1")))
    assert cli_main(["ls", "--json", inc_root]) == 0
    out = json.loads(_out(capsys))
    assert [e["step"] for e in out["checkpoints"]] == [2, 3] and out["latest"] == 3
    assert all(e["references"] == ["step_1"] and e["referenced_bytes"] == FROZEN.numel() * 4
               for e in out["checkpoints"])
    assert cli_main(["ls", inc_root]) == 0
    text = _out(capsys)
    assert "2 committed checkpoint(s)" in text and "  step_1 " not in text and "reads 256.0 KiB from step_1" in text


# --------------------------------------------------------------------------- object storage


def test_copy_to_s3_and_back(inc_root, tmp_path, s3, capsys):
    bucket = s3.make_bucket("inccopy")
    so = json.dumps(s3.storage_options)
    url = f"s3://{bucket}/models/step_3"
    assert cli_main(["copy", inc_root, url, "--storage-options", so]) == 0
    assert "of earlier checkpoints" in _out(capsys)
    fs = s3.filesystem()
    names = sorted(os.path.basename(p) for p in fs.ls(f"{bucket}/models/step_3"))
    assert MANIFEST_NAME in names and len(names) == 3  # manifest, one data file, the side file
    raw = fs.cat_file(f"{bucket}/models/step_3/{MANIFEST_NAME}")
    assert Manifest.from_json_bytes(raw, url).references == {}
    assert cli_main(["verify", url, "--storage-options", so]) == 0
    _check(nostall.load(_template(), url, storage_options=s3.storage_options), 3)
    # refused again without --overwrite; a prefix holding other objects is refused
    assert cli_main(["copy", inc_root, url, "--storage-options", so]) == 1
    assert "--overwrite" in capsys.readouterr().err
    fs.pipe_file(f"{bucket}/other/readme.txt", b"not a checkpoint")
    assert cli_main(["copy", inc_root, f"s3://{bucket}/other", "--storage-options", so]) == 1
    assert "is not a nostall checkpoint" in capsys.readouterr().err

    back = str(tmp_path / "back")
    assert cli_main(["copy", url, back, "--storage-options", so]) == 0
    assert cli_main(["verify", back]) == 0
    _check(nostall.load(_template(), back), 3)


# --------------------------------------------------------------------------- interop readers


def test_export_of_an_incremental_checkpoint_to_safetensors(inc_root, tmp_path, capsys):
    from safetensors.torch import load_file

    out = str(tmp_path / "hf")
    assert cli_main(["convert", "--json", "--keys", "model", "--strip-prefix", "model", inc_root, out]) == 0
    rep = json.loads(_out(capsys))
    got = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(got["frozen"], FROZEN)  # read from step 1's file
    assert torch.equal(got["head"], torch.full((16,), 3.0))
    assert rep["tied"] == {"tied": "frozen"}  # stored once, as safetensors exports tie weights


def test_dcp_load_of_an_incremental_checkpoint(inc_root):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"frozen": torch.zeros(64, 1024), "head": torch.zeros(16)},
             "opt": {"m": torch.zeros(8, dtype=torch.bfloat16)}}
    dcp.load(state, storage_reader=nostall.dcp.Reader(os.path.join(inc_root, "step_2")), no_dist=True)
    assert torch.equal(state["model"]["frozen"], FROZEN)
    assert torch.equal(state["model"]["head"], torch.full((16,), 2.0))
    assert torch.equal(state["opt"]["m"], torch.full((8,), 2.0, dtype=torch.bfloat16))


def test_megatron_load_of_an_incremental_checkpoint(tmp_path):
    pytest.importorskip("megatron.core.dist_checkpointing.mapping", reason="megatron-core is not installed")
    from nostall.interop import megatron
    from tests.system.test_interop_megatron import check_loaded, make_state

    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root, incremental=True) as mgr:
        megatron.save(make_state(0, 1, 1), mgr, step=1)
        megatron.save(make_state(0, 1, 1), mgr, step=2)
        assert read_manifest(mgr.path_for(2)).references  # unchanged: read from step 1
        check_loaded(megatron.load(make_state(0, 1, 1, zeros=True), mgr, step=2), 0, 1, 1)
