"""Side files (``save(..., files=...)``): committed with the checkpoint, checksummed in the manifest,
checked by ``nostall verify``, listed by ``nostall inspect``, carried by ``nostall convert --to safetensors``
(``huggingface/`` at the top level) so that ``from_pretrained(<export>)`` works with no extra step."""

from __future__ import annotations

import json
import os
import pathlib

import crc32c
import pytest
import torch

import nostall
from nostall.storage import files as storage
from nostall.tools.cli import main as cli_main
from nostall.errors import CheckpointCorruptError, CheckpointSaveError, InvalidStateError
from nostall.interop.export import export
from nostall.loading.manifests import read_manifest
from nostall.loading.verify import check_checkpoint

CONFIG = {"model_type": "toy", "hidden": 8, "names": ["a", "b"]}
CONFIG_BYTES = (json.dumps(CONFIG, indent=2, sort_keys=True) + "\n").encode()


def _state(step: int = 1) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8) + step, "b": torch.full((4,), float(step)),
            "meta": {"step": step}}


def _tokenizer_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "tok"
    (d / "sub").mkdir(parents=True)
    (d / "tokenizer.json").write_text('{"vocab": {"hi": 0}}\n')
    (d / "sub" / "merges.txt").write_bytes(b"h i\n")
    return d


def _files(tmp_path: pathlib.Path) -> dict:
    return {"huggingface/config.json": CONFIG, "huggingface": _tokenizer_dir(tmp_path), "note.txt": "hi",
            "raw.bin": b"\x00\xff\x01"}


EXPECTED = {
    "huggingface/config.json": CONFIG_BYTES,
    "huggingface/tokenizer.json": b'{"vocab": {"hi": 0}}\n',
    "huggingface/sub/merges.txt": b"h i\n",
    "note.txt": b"hi",
    "raw.bin": b"\x00\xff\x01",
}


def _saved(tmp_path: pathlib.Path, async_save: bool = False) -> str:
    root = str(tmp_path / "run")
    mgr = nostall.CheckpointManager(root, async_save=async_save)
    try:
        mgr.save(1, _state(), files=_files(tmp_path))
        mgr.finalize_pending_saves()
    finally:
        mgr.close()
    return os.path.join(root, "step_1")


def _on_disk(ckpt: str) -> dict:
    out = {}
    for dirpath, _, names in os.walk(ckpt):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), ckpt).replace(os.sep, "/")
            if rel != "manifest.json" and not rel.endswith(".safetensors"):
                out[rel] = pathlib.Path(dirpath, n).read_bytes()
    return out


# --------------------------------------------------------------------------- saving, local


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_side_files_committed_with_the_checkpoint(tmp_path, async_save):
    ckpt = _saved(tmp_path, async_save)
    assert _on_disk(ckpt) == EXPECTED
    raw = json.loads(pathlib.Path(ckpt, "manifest.json").read_bytes())
    assert raw["side_files"] == {n: {"size": len(b), "crc32c": crc32c.crc32c(b)} for n, b in EXPECTED.items()}
    m = read_manifest(ckpt)
    assert sorted(m.side_files) == sorted(EXPECTED)
    report = check_checkpoint(ckpt)
    assert report.ok, report.problems
    assert report.side_files == len(EXPECTED)
    got = nostall.load(_state(0), ckpt)
    assert torch.equal(got["w"], _state(1)["w"]) and got["meta"] == {"step": 1}


def test_no_side_files_no_field(tmp_path):
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, _state())
    raw = json.loads(pathlib.Path(root, "step_1", "manifest.json").read_bytes())
    assert "side_files" not in raw
    assert check_checkpoint(os.path.join(root, "step_1")).side_files == 0


# --------------------------------------------------------------------------- verify


def test_verify_reports_every_damaged_side_file_and_tensors_still_load(tmp_path, capsys):
    ckpt = _saved(tmp_path)
    p = pathlib.Path(ckpt)
    (p / "note.txt").write_bytes(b"HI")  # same size, other bytes
    (p / "raw.bin").write_bytes(b"\x00")  # truncated
    (p / "huggingface" / "tokenizer.json").unlink()  # missing
    real = tmp_path / "elsewhere.json"
    real.write_bytes(CONFIG_BYTES)
    (p / "huggingface" / "config.json").unlink()
    (p / "huggingface" / "config.json").symlink_to(real)  # right content, but a link: never followed
    (p / "huggingface" / "sub").rename(tmp_path / "sub")
    (p / "huggingface" / "sub").symlink_to(tmp_path / "sub")  # a linked directory on the way
    report = check_checkpoint(ckpt)
    assert not report.ok and len(report.problems) == 5, report.problems
    by_file = {n: [q for q in report.problems if os.path.join(*n.split("/")) in q] for n in EXPECTED}
    assert all(len(v) == 1 for v in by_file.values()), report.problems
    assert "checksum mismatch" in by_file["note.txt"][0]
    assert "2 bytes" not in by_file["raw.bin"][0] and "the manifest says 3" in by_file["raw.bin"][0]
    assert "missing" in by_file["huggingface/tokenizer.json"][0]
    assert "symbolic link" in by_file["huggingface/config.json"][0]
    assert "symbolic link" in by_file["huggingface/sub/merges.txt"][0]
    # the tensors do not depend on side files
    got = nostall.load(_state(0), ckpt)
    assert torch.equal(got["w"], _state(1)["w"])
    capsys.readouterr()
    assert cli_main(["verify", ckpt]) == 1
    err = capsys.readouterr().err
    assert "5 problem(s)" in err and "note.txt" in err
    assert cli_main(["verify", "--json", ckpt]) == 1
    assert len(json.loads(capsys.readouterr().out)["problems"]) == 5


def test_verify_refuses_a_fifo_without_blocking(tmp_path):
    ckpt = _saved(tmp_path)
    target = os.path.join(ckpt, "note.txt")
    os.unlink(target)
    os.mkfifo(target)
    report = check_checkpoint(ckpt)
    assert len(report.problems) == 1 and "FIFO" in report.problems[0] and "note.txt" in report.problems[0]


def test_verify_refuses_a_side_file_bigger_than_the_manifest_says(tmp_path):
    ckpt = _saved(tmp_path)
    with open(os.path.join(ckpt, "note.txt"), "ab") as f:
        f.write(b"!" * 100)
    (problem,) = check_checkpoint(ckpt).problems
    assert "note.txt" in problem and "102 bytes" in problem and "says 2" in problem


# --------------------------------------------------------------------------- inspect


def test_inspect_lists_side_files(tmp_path, capsys):
    ckpt = _saved(tmp_path)
    capsys.readouterr()
    assert cli_main(["inspect", "--json", ckpt]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["side_files"] == [{"name": n, "size": len(b)} for n, b in sorted(EXPECTED.items())]
    assert cli_main(["inspect", ckpt]) == 0
    out = capsys.readouterr().out
    assert f"side files  {len(EXPECTED)} file(s)" in out
    for n in EXPECTED:
        assert f"  {n}" in out
    plain = str(tmp_path / "plain")
    nostall.save(_state(), plain)
    assert cli_main(["inspect", "--json", plain]) == 0
    assert json.loads(capsys.readouterr().out)["side_files"] == []
    assert cli_main(["inspect", plain]) == 0
    assert "side files" not in capsys.readouterr().out


# --------------------------------------------------------------------------- refused at save time


@pytest.mark.parametrize("name,value,says", [
    ("../escape.txt", "x", "'../escape.txt'"),
    (".hidden", "x", "'.hidden'"),
    ("a//b", "x", "'a//b'"),
    ("/abs", "x", "'/abs'"),
    ("manifest.json", "x", "'manifest.json'"),
    ("rank0.safetensors", "x", "'rank0.safetensors'"),
    ("sp ace.txt", "x", "'sp ace.txt'"),
    ("n.txt", 3, "'n.txt'"),
    ("n.json", {"x": float("nan")}, "'n.json'"),
])
def test_bad_side_files_refused_and_nothing_committed(tmp_path, name, value, says):
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, _state())
        with pytest.raises(InvalidStateError, match="side file") as ei:
            mgr.save(2, _state(2), files={name: value})
        assert says in str(ei.value)
        assert mgr.steps() == [1] and mgr.latest_step() == 1
        mgr.save(3, _state(3), files={"ok.txt": "fine"})  # the manager goes on
    assert pathlib.Path(root, "step_3", "ok.txt").read_bytes() == b"fine"


def _two_ranks_side_files(rank, world, root):
    import torch

    import nostall
    from nostall.errors import InvalidStateError

    state = {"w": torch.full((4,), 2.0), "mine": nostall.PerRank({"rank": rank})}
    mgr = nostall.CheckpointManager(root)
    try:
        refused = None
        bad = {"../up.txt": "x"} if rank == 0 else {"fine.txt": "x"}
        try:
            mgr.save(1, state, files=bad)
        except InvalidStateError as e:
            refused = str(e)
        # only rank 0's files are saved (rank 1's bad name is not even looked at)
        mine = {"who.txt": f"rank {rank}"} if rank == 0 else {"who.txt": "rank 1", "../extra.txt": "y"}
        mgr.save(2, state, files=mine)
        return refused, mgr.steps()
    finally:
        mgr.close()


def test_two_ranks_refused_on_every_rank_and_only_rank0_files_saved(tmp_path, pool2):
    root = str(tmp_path / "run")
    out = pool2.run(_two_ranks_side_files, root)
    for refused, steps in out:
        assert refused is not None and "'../up.txt'" in refused, refused
        assert steps == [2]
    ckpt = os.path.join(root, "step_2")
    assert _on_disk(ckpt) == {"who.txt": b"rank 0"}
    assert check_checkpoint(ckpt).ok


def test_a_side_file_that_cannot_be_written_fails_the_save_cleanly(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    real = storage.write_file

    def failing(path, chunks):
        if os.path.basename(path) == "note.txt":
            raise OSError(28, "No space left on device (test)", path)
        return real(path, chunks)

    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, _state(), files={"note.txt": "one"})
        monkeypatch.setattr(storage, "write_file", failing)
        with pytest.raises(CheckpointSaveError, match="No space left"):
            mgr.save(2, _state(2), files={"huggingface/config.json": CONFIG, "note.txt": "two"})
        monkeypatch.undo()
        assert mgr.steps() == [1] and mgr.latest_step() == 1
        assert not os.path.exists(os.path.join(root, "step_2"))
        leftovers = [os.path.join(d, n) for d, _, ns in os.walk(os.path.join(root, ".tmp")) for n in ns
                     if n in ("note.txt", "config.json")]
        assert leftovers == []
        got = mgr.load(_state(0))
        assert torch.equal(got["w"], _state(1)["w"])
        assert pathlib.Path(root, "step_1", "note.txt").read_bytes() == b"one"
        mgr.save(2, _state(2), files={"note.txt": "two"})
    assert pathlib.Path(root, "step_2", "note.txt").read_bytes() == b"two"
    assert check_checkpoint(os.path.join(root, "step_2")).ok


# --------------------------------------------------------------------------- export


def test_export_carries_side_files_huggingface_at_top_level(tmp_path, capsys):
    ckpt = _saved(tmp_path)
    dst = str(tmp_path / "hf")
    capsys.readouterr()
    assert cli_main(["convert", ckpt, dst, "--to", "safetensors", "--keys", "w", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    got = _on_disk(dst)
    assert got == {"config.json": CONFIG_BYTES, "tokenizer.json": EXPECTED["huggingface/tokenizer.json"],
                   "sub/merges.txt": b"h i\n", "note.txt": b"hi", "raw.bin": b"\x00\xff\x01"}
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors", "note.txt", "raw.bin", "sub",
                                       "tokenizer.json"]
    assert sorted(os.path.relpath(p, dst) for p in result["side_files"]) == sorted(
        ["config.json", "tokenizer.json", os.path.join("sub", "merges.txt"), "note.txt", "raw.bin"])
    # sharded: the index is still the export's, side files beside it
    dst2 = str(tmp_path / "hf2")
    rep = export(ckpt, dst2, max_shard_size=64)
    assert len(rep.files) == 3 and os.path.exists(os.path.join(dst2, "config.json"))


def test_export_refuses_a_damaged_side_file_and_leaves_nothing(tmp_path):
    ckpt = _saved(tmp_path)
    pathlib.Path(ckpt, "huggingface", "config.json").write_bytes(CONFIG_BYTES.replace(b"toy", b"TOY"))
    dst = tmp_path / "hf"
    with pytest.raises(CheckpointCorruptError, match="config.json.*checksum mismatch"):
        export(ckpt, str(dst))
    assert not dst.exists()
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointCorruptError, match="config.json"):
        export(ckpt, str(dst), overwrite=True)
    assert sorted(os.listdir(dst)) == ["keep.txt"]


@pytest.mark.parametrize("name,clash", [
    ("huggingface/model.safetensors", "'model.safetensors'"),
    ("model.safetensors.index.json", "'model.safetensors.index.json'"),
    ("huggingface/model.safetensors/x.txt", "'model.safetensors'"),
])
def test_export_refuses_a_side_file_on_a_weights_name(tmp_path, name, clash):
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, _state(), files={name: "x"})
    dst = tmp_path / "hf"
    with pytest.raises(CheckpointSaveError) as ei:
        export(os.path.join(root, "step_1"), str(dst))
    assert repr(name) in str(ei.value) and clash in str(ei.value)
    assert not dst.exists()


def test_export_refuses_two_side_files_landing_on_one_name(tmp_path):
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, _state(), files={"config.json": "{}", "huggingface/config.json": "{}"})
    with pytest.raises(CheckpointSaveError, match="'config.json' and 'huggingface/config.json'"):
        export(os.path.join(root, "step_1"), str(tmp_path / "hf"))


def test_torch_export_leaves_side_files_out(tmp_path):
    ckpt = _saved(tmp_path)
    out = str(tmp_path / "w.pt")
    rep = export(ckpt, out, to="torch")
    assert rep.side_files == [] and rep.side_files_skipped == sorted(EXPECTED)
    assert sorted(os.listdir(tmp_path)) == sorted(["run", "tok", "w.pt"])
    assert torch.equal(torch.load(out, weights_only=True)["w"], _state(1)["w"])


# --------------------------------------------------------------------------- object storage


def test_side_files_on_object_storage(s3, tmp_path, capsys):
    bucket = s3.make_bucket("side-files")
    root = f"s3://{bucket}/run"
    so = s3.storage_options
    with nostall.CheckpointManager(root, storage_options=so, async_save=True, timeout=60,
                                   local_staging_dir=str(tmp_path / "staging")) as mgr:
        mgr.save(1, _state(), files=_files(tmp_path))
        mgr.finalize_pending_saves()
    url = f"{root}/step_1"
    fs = s3.filesystem()
    stored = {n: r["stored"] for n, r in json.loads(fs.cat_file(f"{bucket}/run/step_1/manifest.json"))
              ["side_files"].items()}
    for name, data in EXPECTED.items():  # tagged with the save, as data files are; the export restores the name
        assert stored[name] != name and stored[name].rpartition("/")[0] == name.rpartition("/")[0]
        assert fs.cat_file(f"{bucket}/run/step_1/{stored[name]}") == data
    report = check_checkpoint(url, so)
    assert report.ok and report.side_files == len(EXPECTED), report.problems
    capsys.readouterr()
    assert cli_main(["inspect", "--json", "--storage-options", json.dumps(so), url]) == 0
    assert [f["name"] for f in json.loads(capsys.readouterr().out)["side_files"]] == sorted(EXPECTED)
    dst = str(tmp_path / "hf")
    export(url, dst, storage_options=so)
    assert pathlib.Path(dst, "config.json").read_bytes() == CONFIG_BYTES
    fs.pipe(f"{bucket}/run/step_1/{stored['note.txt']}", b"HI")
    fs.rm(f"{bucket}/run/step_1/{stored['huggingface/tokenizer.json']}")
    problems = check_checkpoint(url, so).problems
    assert len(problems) == 2, problems
    assert any("note.txt" in p and "checksum mismatch" in p for p in problems)
    assert any("tokenizer.json" in p and "missing" in p for p in problems)
    got = nostall.load(_state(0), url, storage_options=so)
    assert torch.equal(got["w"], _state(1)["w"])


# --------------------------------------------------------------------------- a real GPT-2, end to end


@pytest.mark.parametrize("how", ["dict", "directory"])
def test_gpt2_from_pretrained_of_the_export(tmp_path, how, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    if how == "dict":
        files = {"huggingface/config.json": model.config.to_dict()}
    else:
        hf = tmp_path / "hfcfg"
        model.config.save_pretrained(hf)
        files = {"huggingface": hf}
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(5, model=model, files=files)
    ckpt = os.path.join(root, "step_5")
    assert check_checkpoint(ckpt).ok
    dst = str(tmp_path / "export")
    assert cli_main(["convert", root, dst, "--to", "safetensors", "--keys", "model", "--strip-prefix", "model"]) == 0
    assert {"config.json", "model.safetensors"} <= set(os.listdir(dst))
    again = transformers.GPT2LMHeadModel.from_pretrained(dst).eval()  # no extra step
    assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_a_failed_resave_on_object_storage_leaves_the_committed_side_files(s3, tmp_path):
    import errno

    bucket = s3.make_bucket("side-resave")
    url = f"s3://{bucket}/run/global_step_1/policy"
    so = s3.storage_options
    with nostall.CheckpointManager(None, storage_options=so, async_save=True, timeout=60,
                                   local_staging_dir=str(tmp_path / "staging")) as mgr:
        mgr.save(1, _state(), path=url, files={"note.txt": "one"})
        mgr.finalize_pending_saves()
        mgr._faults.fail = {"manifest": errno.EIO}  # the re-save fails at its commit point
        mgr.save(1, _state(), path=url, files={"note.txt": "two"})
        with pytest.raises(nostall.CheckpointSaveError):
            mgr.finalize_pending_saves()
    report = check_checkpoint(url, so)
    assert report.ok and report.side_files == 1, report.problems


def test_a_name_given_twice_is_refused_and_hidden_entries_are_left_out(tmp_path):
    from nostall.saving.side_files import collect

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / ".gitattributes").write_text("*")
    assert [n for n, _ in collect({"huggingface": d})] == ["huggingface/config.json"]
    with pytest.raises(nostall.InvalidStateError, match="given twice.*'huggingface/config.json'.*'huggingface'"):
        collect({"huggingface/config.json": {"a": 1}, "huggingface": d})
