"""The command line: ls of a run root, verify/inspect --json, and convert (DCP import,
safetensors / torch export, chained) with its progress bar."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import nostall
from nostall.tools.cli import main as cli_main


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_ls_lists_steps_sizes_dates_and_latest(tmp_path, capsys):
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root) as mgr:
        for step in (1, 5):
            mgr.save(step, {"w": torch.ones(100 * step), "trainer": {"step": step}})
    assert cli_main(["ls", "--json", root]) == 0
    out = _json(capsys)
    assert out["latest"] == 5
    steps = out["checkpoints"]
    assert [c["step"] for c in steps] == [1, 5]
    assert [c["latest"] for c in steps] == [False, True]
    for c in steps:
        files = json.load(open(os.path.join(c["path"], "manifest.json")))["files"]
        assert c["bytes"] == sum(f["size"] for f in files.values()) > 0
        assert c["tensors"] == 1 and c["world_size"] == 1
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", c["modified"])
    assert cli_main(["ls", root]) == 0
    text = capsys.readouterr().out
    assert "step_1" in text and "step_5" in text and "<- latest" in text.splitlines()[-1]
    # a one-shot checkpoint directory lists itself; an empty root lists nothing; a missing one fails
    nostall.save({"w": torch.ones(3)}, str(tmp_path / "one"))
    assert cli_main(["ls", "--json", str(tmp_path / "one")]) == 0
    assert [c["step"] for c in _json(capsys)["checkpoints"]] == [None]
    (tmp_path / "empty").mkdir()
    assert cli_main(["ls", "--json", str(tmp_path / "empty")]) == 0
    assert _json(capsys)["checkpoints"] == []
    assert cli_main(["ls", str(tmp_path / "nope")]) == 1


def test_verify_json(tmp_path, capsys):
    root = str(tmp_path / "ck")
    nostall.save({"w": torch.arange(1000.0)}, root, block_size=512)
    assert cli_main(["verify", "--json", root]) == 0
    out = _json(capsys)
    assert out["ok"] is True and out["problems"] == [] and out["bytes"] == 4000
    path = os.path.join(root, "rank0.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 0xFF
    open(path, "wb").write(bytes(data))
    assert cli_main(["verify", "--json", root]) == 1
    out = _json(capsys)
    assert out["ok"] is False and len(out["problems"]) == 1 and "checksum mismatch" in out["problems"][0]


def test_convert_dcp_to_nostall_to_safetensors_and_torch(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    src = str(tmp_path / "dcp")
    state = {"model": {"w": torch.arange(60.0).reshape(6, 10), "b": torch.ones(4, dtype=torch.bfloat16)},
             "optim": {"m": torch.zeros(3)}, "step": 9}
    dcp.save(state, checkpoint_id=src, no_dist=True)

    ns = str(tmp_path / "ns")
    assert cli_main(["convert", "--from", "dcp", src, ns, "--json"]) == 0
    out = _json(capsys)
    assert out["to"] == "nostall" and out["tensors"] == 3 and out["objects"] == 1
    assert cli_main(["inspect", "--json", ns]) == 0
    assert sorted(t["key"] for t in _json(capsys)["tensors"]) == ["model/b", "model/w", "optim/m"]
    assert nostall.load({"step": 0}, ns, strict=False) == {"step": 9}

    hf = str(tmp_path / "hf")
    assert cli_main(["convert", ns, hf, "--to", "safetensors", "--keys", "model", "--strip-prefix", "model",
                     "--dtype", "fp16", "--memory-limit", "1MiB", "--progress"]) == 0
    captured = capsys.readouterr()
    assert "100.0%" in captured.err and "export [" in captured.err
    assert "wrote 1 file(s), 2 tensor(s)" in captured.out
    got = load_file(os.path.join(hf, "model.safetensors"))
    assert torch.equal(got["w"], state["model"]["w"].half()) and torch.equal(got["b"], state["model"]["b"].half())

    # DCP straight to one torch.save file (through a temporary nostall checkpoint)
    pt = str(tmp_path / "out" / "model.pt")
    assert cli_main(["convert", "--from", "dcp", src, pt, "--to", "torch", "--json", "--no-progress"]) == 0
    out = _json(capsys)
    assert out["files"] == [pt] and out["tensors"] == 3
    assert sorted(os.listdir(tmp_path / "out")) == ["model.pt"]  # the temporary checkpoint is gone
    got = torch.load(pt, weights_only=True)
    assert torch.equal(got["model.w"], state["model"]["w"]) and torch.equal(got["optim.m"], state["optim"]["m"])


def test_convert_errors(tmp_path, capsys):
    root = str(tmp_path / "ck")
    nostall.save({"w": torch.ones(3)}, root)
    assert cli_main(["convert", root, str(tmp_path / "x"), "--to", "nostall"]) == 1
    assert "--to safetensors or --to torch" in capsys.readouterr().err
    assert cli_main(["convert", "--from", "dcp", root, str(tmp_path / "y")]) == 1
    assert "not a DCP checkpoint" in capsys.readouterr().err
    assert cli_main(["convert", root, str(tmp_path / "z"), "--memory-limit", "lots"]) == 1
    assert "not a size" in capsys.readouterr().err


def test_console_entry_point(tmp_path):
    """`python -m nostall convert` end to end, in a fresh interpreter."""
    root = str(tmp_path / "ck")
    nostall.save({"model": {"w": torch.arange(12.0).reshape(3, 4)}}, root)
    proc = subprocess.run([sys.executable, "-m", "nostall", "convert", root, str(tmp_path / "o.pt"), "--to", "torch",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensors"] == 1
    assert torch.equal(torch.load(str(tmp_path / "o.pt"), weights_only=True)["model.w"],
                       torch.arange(12.0).reshape(3, 4))


# --------------------------------------------------------------------------- --block-size


def test_convert_block_size_must_pass_the_one_rule(tmp_path, capsys):
    """--block-size 1000 was accepted (the manifest only asks for a multiple of 8) and gave a checkpoint
    whose pieces over 64 MiB did not verify: the loader's read windows are not a multiple of 1000.
    The rule (nostall.options.check_block_size) refuses it as a usage error; an accepted value converts
    a piece bigger than a read window into a checkpoint that loads and verifies."""
    import torch.distributed.checkpoint as dcp

    from nostall.options import check_block_size

    src = str(tmp_path / "dcp")
    w = torch.arange((64 << 20) // 4 + 3 * 1024, dtype=torch.float32)  # 64 MiB + 12 KiB: over one read window
    dcp.save({"w": w, "step": 3}, checkpoint_id=src, no_dist=True)
    for bad in ("1000", "0", "4", "12288", "2GiB", "-4096", "lots"):
        try:
            cli_main(["convert", "--from", "dcp", src, str(tmp_path / f"bad{bad}"), "--block-size", bad])
        except SystemExit as e:
            assert e.code == 2, bad
        else:
            raise AssertionError(f"--block-size {bad} was accepted")
        err = capsys.readouterr().err
        assert "argument --block-size:" in err, err
        if bad not in ("-4096", "lots"):  # those are not sizes at all
            with pytest.raises(ValueError) as rule:
                check_block_size(2 << 30 if bad == "2GiB" else int(bad))
            assert str(rule.value).split(", got")[0] in err, err  # the rule's own words
        assert not os.path.exists(tmp_path / f"bad{bad}")
    # the API refuses it too, before writing anything
    from nostall.interop.dcp import import_dcp

    with pytest.raises(ValueError, match="power of two"):
        import_dcp(src, str(tmp_path / "api"), block_size=1000)
    assert not os.path.exists(tmp_path / "api")

    ns = str(tmp_path / "ns")
    assert cli_main(["convert", "--from", "dcp", src, ns, "--block-size", "4KiB", "--json"]) == 0
    assert _json(capsys)["tensors"] == 1
    assert json.load(open(os.path.join(ns, "manifest.json")))["checksum"]["block_size"] == 4096
    got = torch.zeros_like(w)
    assert nostall.load({"w": got, "step": None}, ns) == {"w": got, "step": 3}
    assert torch.equal(got, w)
    del got
    assert cli_main(["verify", ns]) == 0, capsys.readouterr()
    proc = subprocess.run([sys.executable, "-m", "nostall", "verify", "--json", ns], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"] is True, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- a failed export cleans up after itself


def _three_tensors(root: str) -> dict:
    state = {"a": torch.arange(4096.0), "b": torch.arange(4096.0) * 2, "c": torch.arange(4096.0) * 3}
    nostall.save(state, root, block_size=4096)
    return state


def _corrupt(root: str, key: str) -> None:
    """Flip one byte in the middle of ``key``'s bytes in its data file."""
    from nostall.loading.manifests import read_manifest

    p = read_manifest(root).tensors[key].pieces[0]
    path = os.path.join(root, p.file)
    data = bytearray(open(path, "rb").read())
    data[(p.start + p.end) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _tree(path) -> dict:
    """Every file under ``path`` (relative name -> bytes), directories included as None."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), path)] = None
        for f in files:
            full = os.path.join(dirpath, f)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_failed_export_removes_exactly_what_it_created_and_a_rerun_works(tmp_path, capsys, to):
    """A source corrupted in its last tensor fails the export after the first files were written
    (safetensors: one shard per tensor). The export's own files -- temporaries, finished shards,
    directories it made -- are gone; everything that was there before is untouched; a rerun works."""
    ck = str(tmp_path / "ck")
    state = _three_tensors(ck)
    _corrupt(ck, "c")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("not the export's")
    dst = str(out / "new" / "deeper" / ("hf" if to == "safetensors" else "model.pt"))
    opts = ["--to", to, "--max-shard-size", "16KiB", "--memory-limit", "64KiB"]
    before = _tree(out)
    assert cli_main(["convert", ck, dst] + opts) == 1
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "'c'" in err, err
    assert _tree(out) == before  # not a byte more, not a byte less

    # into an existing empty directory: it stays, empty
    (out / "empty").mkdir()
    dst2 = str(out / "empty" / ("" if to == "safetensors" else "model.pt"))
    assert cli_main(["convert", ck, dst2] + opts) == 1
    capsys.readouterr()
    assert os.listdir(out / "empty") == []

    # --overwrite into a directory holding an older export and other files: all of them untouched
    if to == "safetensors":
        (out / "old").mkdir()
        (out / "old" / "model-00001-of-00003.safetensors").write_bytes(b"older export")
        (out / "old" / "notes.md").write_text("mine")
        dst3 = str(out / "old")
    else:
        (out / "old.pt").write_bytes(b"older export")
        dst3 = str(out / "old.pt")
    before = _tree(out)
    assert cli_main(["convert", ck, dst3, "--overwrite"] + opts) == 1
    capsys.readouterr()
    assert _tree(out) == before

    # the source repaired: the same command now works, into the same destinations
    _three_tensors(ck + "2")
    os.replace(os.path.join(ck + "2", "rank0.safetensors"), os.path.join(ck, "rank0.safetensors"))
    assert cli_main(["convert", ck, dst] + opts) == 0
    assert cli_main(["convert", ck, dst2] + opts) == 0
    capsys.readouterr()
    if to == "safetensors":
        from safetensors.torch import load_file

        names = sorted(os.listdir(dst))
        assert names == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                         "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
        got = {}
        for n in names[:3]:
            got.update(load_file(os.path.join(dst, n)))
        assert not [n for n in os.listdir(dst2) if n.endswith(".partial")]
    else:
        got = torch.load(dst, weights_only=True)
        assert sorted(os.listdir(os.path.dirname(dst))) == ["model.pt"]
    assert sorted(got) == ["a", "b", "c"] and all(torch.equal(got[k], state[k]) for k in state)


def test_export_interrupted_after_its_first_file_leaves_nothing(tmp_path, monkeypatch):
    """The writer itself fails (here: raises after the first shard is complete, as a full disk or a
    KeyboardInterrupt would): the finished shard and the temporary one are both removed."""
    from nostall.errors import CheckpointSaveError
    from nostall.interop import export as export_mod

    ck = str(tmp_path / "ck")
    _three_tensors(ck)
    real_write = export_mod._Streamer.write
    calls = []

    def write(self, item, write_at):
        calls.append(item.key)
        if len(calls) == 2:
            real_write(self, item, lambda pos, data: write_at(pos, data[: len(data) // 2]))
            raise KeyboardInterrupt
        real_write(self, item, write_at)

    monkeypatch.setattr(export_mod._Streamer, "write", write)
    dst = tmp_path / "hf"
    with pytest.raises(KeyboardInterrupt):
        export_mod.export(ck, str(dst), max_shard_size=16 << 10)
    assert calls == ["a", "b"] and not dst.exists()
    monkeypatch.setattr(export_mod._Streamer, "write", real_write)
    rep = export_mod.export(ck, str(dst), max_shard_size=16 << 10)
    assert len(rep.files) == 4 and sorted(os.listdir(dst)) == sorted(os.path.basename(f) for f in rep.files)
    with pytest.raises(CheckpointSaveError, match="not empty"):
        export_mod.export(ck, str(dst), max_shard_size=16 << 10)


def test_failed_dcp_to_torch_conversion_removes_the_directories_it_made(tmp_path, capsys, monkeypatch):
    """DCP -> torch goes through a temporary checkpoint beside the destination; when the export fails,
    that checkpoint and the parent directories the conversion made are gone."""
    import torch.distributed.checkpoint as dcp

    from nostall.interop import export as export_mod

    src = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(100.0)}, checkpoint_id=src, no_dist=True)

    def fail(self, item, write_at):
        raise OSError(28, "No space left on device (test)")

    monkeypatch.setattr(export_mod._Streamer, "write", fail)
    dst = tmp_path / "a" / "b" / "model.pt"
    assert cli_main(["convert", "--from", "dcp", src, str(dst), "--to", "torch"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["dcp"]
