"""A manager dropped (garbage-collected) while an async save is in flight: the save is not lost.

The exit handler holds a manager while it has a pending save, so dropping the last reference
does not collect it; at exit the save is finalized (committed, ``latest`` moved) like any other.
"""

from __future__ import annotations

import subprocess
import sys

import torch

import nostall

_SCRIPT = """
import gc, sys, weakref, torch, nostall
mgr = nostall.CheckpointManager(sys.argv[1], async_save=True, timeout=60)
mgr.save(1, {"w": torch.arange(1 << 20, dtype=torch.float32)})
ref = weakref.ref(mgr)
del mgr
gc.collect()
print("alive" if ref() is not None else "collected", flush=True)
"""


def test_dropped_manager_commits_its_pending_save_at_exit(tmp_path):
    root = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(root)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["alive"]  # held while the save is pending
    assert (root / "step_1" / "manifest.json").is_file()
    with nostall.CheckpointManager(str(root), read_only=True) as mgr:
        assert mgr.latest_step() == 1
    out = nostall.load({"w": torch.zeros(1 << 20)}, str(root / "step_1"))
    assert torch.equal(out["w"], torch.arange(1 << 20, dtype=torch.float32))

