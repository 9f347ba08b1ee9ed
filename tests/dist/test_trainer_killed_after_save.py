"""Issue 27: a trainer SIGKILLed right after ``save()`` returned (async): is the staged snapshot persisted?

Every rank's snapshot of step 2 is staged and handed to its background
writer whole, then every trainer SIGKILLs itself at once (as an OOM killer,
or a ``kill -9`` of the trainer's pid, would). Each writer, now an orphan,
finishes the job it was handed whole (rank 0's holding the root's lock,
which its trainer shared with it) and exits: step 2 is committed and loads
bit-exact, and no writer is left (docs/protocol.md, "Lifetime").
``test_nothing_half_committed_and_no_writer_left`` checks what must hold
whatever the outcome; ``tests/dist/test_orphan_writer.py`` the cases where an
orphan must not finish (a job not handed over whole) and a restarted job
that waits for an orphan.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

import nostall
from tests.dist_harness import run_ranks, process_alive

_N = 40000


def _state(step: int, rank: int):
    return {"w": nostall.ShardedTensor(torch.arange(_N, dtype=torch.float32) + step * 1000 + rank * _N,
                                       (2 * _N,), (rank * _N,)),
            "b": torch.full((100,), float(step)), "step": step}


def _save_then_die(rank, world, root, out_dir):
    with nostall.CheckpointManager(root, async_save=True, timeout=20) as mgr:
        mgr.save(1, _state(1, rank)).result()
        mgr._faults.writer_delay_s = 2.0  # the writer cannot have committed step 2 before the kill
        mgr.save(2, _state(2, rank))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"writer": mgr.writer_pid, "trainer": os.getpid()}, f)
        os.kill(os.getpid(), signal.SIGKILL)




@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killed")
    root, out = str(tmp / "run"), str(tmp / "out")
    os.makedirs(out)
    with pytest.raises(AssertionError, match="without reporting"):
        run_ranks(2, _save_then_die, root, out, timeout=120, grace=30)
    pids = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    # Wait (bounded) for the writers: an orphan that finishes its job would commit meanwhile.
    deadline = time.monotonic() + 60
    while not all(not process_alive(p["writer"]) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return root, pids


def _expected(step: int):
    return {"w": torch.cat([_state(step, r)["w"].data for r in range(2)]), "b": torch.full((100,), float(step)),
            "step": step}


def _load_latest(root):
    with nostall.CheckpointManager(root, read_only=True) as mgr:
        t = {"w": torch.zeros(2 * _N), "b": torch.zeros(100), "step": 0}
        got = mgr.load(t)
        exp = _expected(got["step"])
        assert torch.equal(t["w"], exp["w"]) and torch.equal(t["b"], exp["b"])
        return mgr.latest_step(), mgr.steps()


def test_nothing_half_committed_and_no_writer_left(killed):
    root, pids = killed
    assert all(not process_alive(p["writer"]) for p in pids)  # no writer outlives its trainer (or its bounded last job)
    latest, steps = _load_latest(root)  # latest loads bit-exact
    assert steps == list(range(1, latest + 1))
    if latest == 1:  # today: step 2 lost whole
        assert not os.path.exists(os.path.join(root, "step_2"))


def test_a_snapshot_staged_on_every_rank_is_still_persisted(killed):
    root, _ = killed
    latest, _ = _load_latest(root)
    assert latest == 2
