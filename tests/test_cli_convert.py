"""The command line: ls of a run root, verify/inspect --json, and convert (DCP import,
safetensors / torch export, chained) with its progress bar."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch

import nostall
from nostall.cli import main as cli_main


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
    assert nostall.load({"step": 0}, ns) == {"step": 9}

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
