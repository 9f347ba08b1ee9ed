"""The command line's torch-free commands: ``nostall --version``, ``ls``, ``inspect``, ``verify`` and ``copy``
run in a fresh interpreter without torch ever being imported (only ``convert`` and ``bench`` need it).

The checkpoints are made here (with torch); each command runs through ``nostall.tools.cli.main`` in one child
interpreter, which reports, after each, its exit status, output and whether ``torch`` is in ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

import nostall
from nostall.core.format import MANIFEST_NAME

_CHILD = r"""
import contextlib, io, json, sys
from nostall.tools.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # --version: argparse exits
            rc = e.code
    results.append({"argv": argv, "rc": rc, "out": out.getvalue(), "err": err.getvalue(),
                    "torch": "torch" in sys.modules})
print(json.dumps(results))
"""


def _run_commands(commands: List[List[str]]) -> List[Dict[str, Any]]:
    """Run ``commands`` through ``nostall.tools.cli.main`` in one fresh interpreter, in order."""
    env = {k: v for k, v in os.environ.items() if k != "NOSTALL_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(commands)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    results: List[Dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:  # the first command that imports torch is named
        assert r["torch"] is False, f"nostall {' '.join(r['argv'])} imported torch"
    return results


def _incremental_run(root: Path) -> Dict[str, torch.Tensor]:
    """A run root with two steps, the second incremental (it reads 'frozen' from step 1's files)."""
    frozen = torch.arange(4096, dtype=torch.float32)
    with nostall.CheckpointManager(str(root), incremental=True, async_save=False) as mgr:
        mgr.save(1, {"frozen": frozen, "w": torch.zeros(64)})
        mgr.save(2, {"frozen": frozen, "w": torch.ones(64)})
    return {"frozen": frozen, "w": torch.ones(64)}


def test_version_ls_inspect_verify_copy_never_import_torch(tmp_path: Path) -> None:
    root = tmp_path / "run"
    expect = _incremental_run(root)
    dst = tmp_path / "copy"
    results = _run_commands([
        ["--version"],
        ["ls", "--json", str(root)],
        ["inspect", "--json", str(root)],
        ["verify", "--json", str(root)],
        ["copy", "--json", "--no-progress", str(root), str(dst)],
        ["verify", str(dst)],
        ["ls", str(root)],
        ["inspect", str(root / "step_1")],
    ])
    version, ls, inspect, verify, copy, verify_copy, ls_text, inspect_text = results
    assert version["rc"] == 0 and version["out"].strip() == f"nostall {nostall.__version__}"

    assert ls["rc"] == 0, ls["err"]
    listed = json.loads(ls["out"])
    assert listed["latest"] == 2 and [c["step"] for c in listed["checkpoints"]] == [1, 2]
    assert listed["checkpoints"][1]["references"] == ["step_1"]

    assert inspect["rc"] == 0, inspect["err"]
    shown = json.loads(inspect["out"])
    assert shown["step"] == 2 and shown["ok"] is True and shown["incremental"] is True
    assert sorted(t["key"] for t in shown["tensors"]) == ["frozen", "w"]

    assert verify["rc"] == 0, verify["err"]
    checked = json.loads(verify["out"])
    assert checked["ok"] is True and checked["problems"] == [] and checked["referenced"]
    assert checked["bytes"] == sum(t.numel() * 4 for t in expect.values())

    assert copy["rc"] == 0, copy["err"]
    copied = json.loads(copy["out"])
    assert copied["referenced"] and copied["bytes"] == checked["bytes"]
    assert verify_copy["rc"] == 0 and verify_copy["out"].startswith(f"OK  {dst}")
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    assert not manifest.get("references")  # self-contained

    assert ls_text["rc"] == 0 and "step_2" in ls_text["out"] and "<- latest" in ls_text["out"]
    assert inspect_text["rc"] == 0 and "step        1" in inspect_text["out"]

    # what the torch-free commands saw is what a load (with torch) reads
    loaded = nostall.load({k: torch.empty_like(v) for k, v in expect.items()}, str(dst))
    assert all(torch.equal(loaded[k], v) for k, v in expect.items())


def test_failing_commands_stay_torch_free_and_say_why(tmp_path: Path) -> None:
    """A damaged checkpoint and a missing path: the exit status and message, still without torch."""
    root = tmp_path / "run"
    _incremental_run(root)
    manifest = json.loads((root / "step_1" / MANIFEST_NAME).read_text())
    (piece,) = manifest["tensors"]["frozen"]["pieces"]  # the piece step 2 reads from step 1's file
    data = root / "step_1" / piece["file"]
    raw = bytearray(data.read_bytes())
    raw[piece["byte_range"][0] + 100] ^= 0xFF  # a checksum mismatch
    data.write_bytes(bytes(raw))
    missing = tmp_path / "nothing" / "here"
    verify, verify_2, inspect_missing, ls_missing = _run_commands([
        ["verify", str(root / "step_1")],
        ["verify", "--json", str(root)],  # step 2 reads step 1's damaged file
        ["inspect", str(missing)],
        ["ls", str(missing)],
    ])
    assert verify["rc"] == 1 and "checksum mismatch" in verify["err"]
    assert verify_2["rc"] == 1 and json.loads(verify_2["out"])["ok"] is False
    assert inspect_missing["rc"] == 1 and f"{missing}: no such directory" in inspect_missing["err"]
    assert ls_missing["rc"] == 1 and f"{missing}: no such directory" in ls_missing["err"]
