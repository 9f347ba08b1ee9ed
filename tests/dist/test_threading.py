"""The threading contract: a manager used from several threads at once.

The contract (CheckpointManager docstring, docs/integration.md): every
method may be called from any thread; calls are serialised by the manager;
collective calls (save, prepare) are made in the same order on every rank;
a tensor passed to save() may change once save() returns.
"""

from __future__ import annotations

import os
import subprocess
import sys


def _threads_body(rank, world_size, root):
    import threading

    import torch

    import nostall

    mgr = nostall.CheckpointManager(root, async_save=True, timeout=60)  # created on the main thread
    w = torch.zeros(64, 1024)
    expected = {}
    handles = []
    errors = []
    stop = threading.Event()

    def trainer():  # saves from a thread other than the manager's creator, mutating right after
        try:
            for step in range(1, 9):
                w.fill_(step * 10 + rank)
                expected[step] = w.clone()
                handles.append(mgr.save(step, {"w": nostall.ShardedTensor(w, (64 * world_size, 1024), (64 * rank, 0))}))
                w.fill_(-1.0)  # allowed: save() returned, the data is staged
        except BaseException as e:
            errors.append(e)
        finally:
            stop.set()

    def monitor():  # polls and finalizes concurrently
        try:
            while not stop.is_set():
                for h in list(handles):
                    h.done()
                mgr.latest_step()
                mgr.stats()
                mgr.finalize_pending_saves()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=trainer), threading.Thread(target=monitor), threading.Thread(target=monitor)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    mgr.finalize_pending_saves()
    assert [h.result().step for h in handles] == list(range(1, 9))
    assert mgr.steps() == list(range(1, 9))
    for step, want in expected.items():
        got = torch.empty(64, 1024)
        mgr.load({"w": nostall.ShardedTensor(got, (64 * world_size, 1024), (64 * rank, 0))}, step)
        assert torch.equal(got, want), step
    mgr.close()
    return len(handles)


def test_manager_used_from_several_threads(pool2, tmp_path):
    assert pool2.run(_threads_body, str(tmp_path)) == [8, 8]


def test_demo_main_job_smoke(tmp_path):
    """The README's main command, shrunk: two torchrun jobs, resume, bitwise comparison, plot."""
    out = tmp_path / "demo"
    png = tmp_path / "demo.png"
    proc = subprocess.run(
        [sys.executable, "-m", "nostall.tools.reference.demo", "--dir", str(out), "--steps", "9", "--stop", "5",
         "--interval", "3", "--d-model", "32", "--layers", "1", "--heads", "4", "--seq-len", "16",
         "--plot", str(png)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reproduces the interrupted one bit for bit" in proc.stdout
    assert "steps 4-5 were trained by both runs" in proc.stdout
    assert png.stat().st_size > 10_000
    assert sorted(os.listdir(out / "ckpts")) == [".tmp", "latest", "step_6", "step_9", "trainer_marker.json"]
    assert not os.path.exists(str(out) + "-sync-reference")
