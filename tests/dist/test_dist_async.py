"""Asynchronous saves on real gloo groups: byte identity, overlap, failures, lifecycle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.dist_harness import run_ranks


def _state(rank: int, scale: float = 1.0):
    import nostall

    g = torch.Generator().manual_seed(7)
    full = torch.randn(64, 32, generator=g) * scale
    return {
        "model": {
            "w": nostall.ShardedTensor(full[32 * rank : 32 * (rank + 1)].clone(), (64, 32), (32 * rank, 0)),
            "b": torch.randn(300, generator=g) * scale,  # replicated
            "h": torch.arange(10, dtype=torch.bfloat16) * scale,
        },
        "trainer": {"step": 3, "lr": 0.5},
        "rng": nostall.PerRank(torch.full((5,), rank, dtype=torch.uint8)),
    }


def _template(rank: int):
    import nostall

    return {
        "model": {
            "w": nostall.ShardedTensor(torch.zeros(32, 32), (64, 32), (32 * rank, 0)),
            "b": torch.zeros(300),
            "h": torch.zeros(10, dtype=torch.bfloat16),
        },
        "trainer": {},
        "rng": nostall.PerRank(torch.zeros(5, dtype=torch.uint8)),
    }


def _same(a, b) -> None:
    assert torch.equal(a["model"]["w"].data, b["model"]["w"].data)
    assert torch.equal(a["model"]["b"], b["model"]["b"])
    assert torch.equal(a["model"]["h"], b["model"]["h"])


# --------------------------------------------------------------------------- byte identity


def _sync_and_async(rank, world, root):
    import nostall

    with nostall.CheckpointManager(os.path.join(root, "async"), async_save=True, keep_last=2) as a:
        for step in (1, 2, 3):
            h = a.save(step, _state(rank, step))
        assert h.result().async_save
    with nostall.CheckpointManager(os.path.join(root, "sync")) as s:
        s.save(3, _state(rank, 3))
    return True


def test_async_is_byte_identical_to_sync(tmp_path):
    run_ranks(2, _sync_and_async, str(tmp_path))
    a, s = tmp_path / "async" / "step_3", tmp_path / "sync" / "step_3"
    names = sorted(os.listdir(s))
    assert names == sorted(os.listdir(a)) == ["manifest.json", "rank0.safetensors", "rank1.safetensors"]
    for n in names:
        assert (a / n).read_bytes() == (s / n).read_bytes(), n
    assert sorted(n for n in os.listdir(tmp_path / "async") if n.startswith("step_")) == ["step_2", "step_3"]
    assert (tmp_path / "async" / "latest").read_text().strip() == "3"


# --------------------------------------------------------------------------- overlap with training


def _train_while_writing(rank, world, root):
    import nostall

    with nostall.CheckpointManager(root, async_save=True) as mgr:
        mgr._faults.writer_delay_s = 1.5
        state = _state(rank)
        expected = _template(rank)
        for k in ("w",):
            expected["model"][k].data.copy_(state["model"][k].data)
        h = mgr.save(1, state)
        returned_pending = not h.done() and mgr.latest_step() is None
        # training goes on and mutates the state in place while the writer writes
        steps = 0
        while not h.done():
            state["model"]["w"].data.add_(1.0)
            state["model"]["b"].mul_(2.0)
            steps += 1
            time.sleep(0.05)
        h.result()
        assert mgr.latest_step() == 1
        restored = mgr.load(_template(rank))
        assert torch.equal(restored["model"]["w"].data, expected["model"]["w"].data)  # values at save time
        assert torch.equal(restored["model"]["b"], _state(rank)["model"]["b"])
        assert restored["trainer"] == {"step": 3, "lr": 0.5}
        assert torch.equal(restored["rng"], torch.full((5,), rank, dtype=torch.uint8))
        return returned_pending, steps


def test_training_continues_while_the_write_completes(tmp_path):
    out = run_ranks(2, _train_while_writing, str(tmp_path))
    for returned_pending, steps in out:
        assert returned_pending
        assert steps >= 5


# --------------------------------------------------------------------------- failures


def _kill_writer(rank, world, root, victim):
    import nostall

    with nostall.CheckpointManager(root, async_save=True, timeout=60) as mgr:
        mgr.save(1, _state(rank)).result()
        mgr._faults.writer_delay_s = 3.0
        h = mgr.save(2, _state(rank, 2.0))
        pid = mgr.writer_pid
        if rank == victim:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            mgr.finalize_pending_saves()
            raise AssertionError("finalize should have raised")
        except nostall.CheckpointSaveError as e:
            msg = str(e)
        elapsed = time.monotonic() - t0
        assert "step 2" in msg and f"rank {victim}" in msg and "writer" in msg, msg
        assert isinstance(h.exception(), nostall.CheckpointSaveError)
        assert mgr.latest_step() == 1
        assert not os.path.exists(os.path.join(root, "step_2"))
        restored = mgr.load(_template(rank))
        _same(restored, _state(rank))
        # a new writer serves the next save
        mgr._faults.writer_delay_s = 0.0
        mgr.save(3, _state(rank, 3.0)).result()
        assert mgr.latest_step() == 3
        assert (mgr.writer_pid != pid) == (rank == victim)
        gone = rank != victim or not os.path.exists(f"/proc/{pid}")
        return elapsed, gone


@pytest.mark.parametrize("victim", [1, 0])
def test_writer_killed_every_rank_raises_quickly(tmp_path, victim):
    out = run_ranks(2, _kill_writer, str(tmp_path), victim, timeout=90)
    for elapsed, gone in out:
        assert elapsed < 20, elapsed  # noticed in seconds, not after the 60 s timeout
        assert gone


def _enospc(rank, world, root):
    import nostall

    with nostall.CheckpointManager(root, async_save=True) as mgr:
        mgr.save(1, _state(rank)).result()
        if rank == 1:
            mgr._faults.writer_fault = "enospc"
        mgr.save(2, _state(rank, 2.0))
        try:
            mgr.save(3, _state(rank, 3.0))  # raises the failure of step 2
            raise AssertionError("save should have raised")
        except nostall.CheckpointSaveError as e:
            msg = str(e)
        assert "step 2" in msg and "rank 1" in msg and "No space left" in msg, msg
        assert mgr.steps() == [1]
        mgr._faults.writer_fault = None
        mgr.save(3, _state(rank, 3.0)).result()
        assert mgr.steps() == [1, 3]
    # errors="log": the failure is logged, training goes on
    with nostall.CheckpointManager(root, async_save=True, errors="log") as mgr:
        if rank == 0:
            mgr._faults.writer_fault = "enospc"
        h = mgr.save(4, _state(rank))
        mgr.finalize_pending_saves()  # does not raise
        assert isinstance(h.exception(), nostall.CheckpointSaveError)
        mgr._faults.writer_fault = None
        mgr.save(5, _state(rank)).result()
        assert mgr.steps() == [1, 3, 5]
    return msg


def test_write_failure_is_reported_on_every_rank(tmp_path):
    out = run_ranks(2, _enospc, str(tmp_path))
    assert "rank 1" in out[0] and "rank 1" in out[1]


# --------------------------------------------------------------------------- lifecycle


def _rss_kb(pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _reuse(rank, world, root):
    import nostall

    big = {"w": nostall.ShardedTensor(torch.randn(2048, 1024), (4096, 1024), (2048 * rank, 0)), "b": torch.ones(1000)}
    with nostall.CheckpointManager(root, async_save=True, keep_last=1) as mgr:
        mgr.prepare(big)
        gen = mgr._writer.area.generation
        rss = []
        for step in range(20):
            big["w"].data.add_(1.0)
            mgr.save(step, big)
            rss.append((_rss_kb(), _rss_kb(str(mgr.writer_pid))))
        mgr.finalize_pending_saves()
        assert mgr._writer.area.generation == gen == 1  # one area, allocated once, reused
        t = {"w": nostall.ShardedTensor(torch.zeros(2048, 1024), (4096, 1024), (2048 * rank, 0)), "b": torch.zeros(1000)}
        mgr.load(t)
        assert torch.equal(t["w"].data, big["w"].data)
    return rss


def test_staging_area_is_reused(tmp_path):
    for rss in run_ranks(2, _reuse, str(tmp_path)):
        # after warm-up, neither the trainer nor its writer grows (8 MiB of data per save)
        trainer = [r[0] for r in rss]
        writer = [r[1] for r in rss]
        assert max(trainer[5:]) - trainer[5] < 16 * 1024, trainer
        assert max(writer[5:]) - writer[5] < 16 * 1024, writer


def _finalize_on_one_rank(rank, world, root):
    import nostall

    mgr = nostall.CheckpointManager(root, async_save=True)
    mgr._faults.writer_delay_s = 0.5
    mgr.save(1, _state(rank))
    if rank == 1:
        mgr.finalize_pending_saves()  # no other rank calls it: must not deadlock
        mgr.finalize_pending_saves()  # and again
        done = mgr.latest_step()
    else:
        done = None
        time.sleep(2.0)
    mgr.close()
    return done


def test_finalize_on_a_single_rank_returns(tmp_path):
    assert run_ranks(2, _finalize_on_one_rank, str(tmp_path))[1] == 1


def _mixed(rank, world, root):
    import nostall

    with nostall.CheckpointManager(root, async_save=True) as mgr:
        mgr._faults.writer_delay_s = 1.0
        h1 = mgr.save(1, _state(rank))
        h2 = mgr.save(2, _state(rank, 2.0), async_save=False)  # must not orphan step 1
        assert h1.done() and h2.done()
        assert mgr.steps() == [1, 2]
        assert not h2.result().async_save and h1.result().async_save
    return True


def test_sync_save_after_async_does_not_orphan_it(tmp_path):
    run_ranks(2, _mixed, str(tmp_path))


# --------------------------------------------------------------------------- process exit

_SCRIPT = """
import os, sys, time, signal, torch, nostall
root, how = sys.argv[1], sys.argv[2]
state = {"w": torch.arange(100000, dtype=torch.float32), "step": 7}
mgr = nostall.CheckpointManager(root, async_save=True)
mgr._faults.writer_delay_s = 1.0
print("writer", mgr.writer_pid, flush=True)
if how == "context":
    with mgr:
        mgr.save(7, state)
elif how == "close":
    mgr.save(7, state)
    mgr.close()
elif how == "exit":
    mgr.save(7, state)          # interpreter exit: atexit drains
elif how == "sigterm":
    mgr.save(7, state)
    print("saved", flush=True)
    time.sleep(60)
assert mgr.latest_step() in (None, 7)
"""


@pytest.mark.parametrize("how", ["context", "close", "exit", "sigterm"])
def test_final_checkpoint_is_complete_at_exit(tmp_path, how):
    import nostall

    root = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath("src")] + sys.path))
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_SCRIPT), str(root), how],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    writer_pid = int(p.stdout.readline().split()[1])
    if how == "sigterm":
        assert p.stdout.readline().strip() == "saved"
        p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == (143 if how == "sigterm" else 0), err
    mgr = nostall.CheckpointManager(root)
    assert mgr.latest_step() == 7
    from nostall.tools.cli import main as cli_main

    assert cli_main(["verify", str(root)]) == 0
    t = {"w": torch.zeros(100000), "step": 0}
    assert mgr.load(t)["step"] == 7 and torch.equal(t["w"], torch.arange(100000, dtype=torch.float32))
    mgr.close()
    # the writer is gone (not orphaned, not a zombie of ours)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{writer_pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{writer_pid}")
