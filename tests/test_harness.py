"""Self-tests of the multi-rank harness in tests/dist_harness.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from tests.dist_harness import free_port, run_ranks

# --- rank bodies: module-level so they pickle by reference -------------------


def _allreduce(rank: int, world_size: int, base: float):
    import torch
    import torch.distributed as dist

    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    t = torch.tensor([base + rank, 10.0 * (rank + 1)])
    dist.all_reduce(t)
    return t.tolist(), os.environ.get("OMP_NUM_THREADS"), os.environ.get("NOSTALL_X")


def _raise_on_rank1(rank: int, world_size: int):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def _hang_on_rank1(rank: int, world_size: int, piddir: str):
    Path(piddir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        while True:
            time.sleep(3600)
    return rank


# --- helpers ------------------------------------------------------------------


def _proc_state(pid: int) -> str | None:
    """State letter of pid from /proc (None if the process no longer exists)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Format: "pid (comm) S ppid ..." - comm may contain spaces/parens.
    return stat.rsplit(")", 1)[1].split()[0]


# --- tests --------------------------------------------------------------------


def test_allreduce_two_ranks():
    out = run_ranks(2, _allreduce, 1.0, timeout=60, env={"NOSTALL_X": "yes"})
    expected = [1.0 + 2.0, 10.0 + 20.0]
    assert [o[0] for o in out] == [expected, expected]
    assert all(o[1] == "1" for o in out)  # OMP_NUM_THREADS set in children
    assert all(o[2] == "yes" for o in out)  # env overrides passed through
    assert not mp.active_children()


def test_failing_rank_reports_traceback():
    with pytest.raises(AssertionError) as ei:
        run_ranks(2, _raise_on_rank1, timeout=60)
    msg = str(ei.value)
    assert "rank 1" in msg
    assert "ValueError: boom from rank 1" in msg
    assert "--- rank 0 ---" not in msg  # rank 0 succeeded
    assert not mp.active_children()


def test_hanging_rank_is_killed(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="ranks timed out") as ei:
        run_ranks(2, _hang_on_rank1, str(tmp_path), timeout=15)
    elapsed = time.monotonic() - t0
    assert elapsed < 15 + 10, elapsed
    assert "[1]" in str(ei.value)
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
    for pid in pids:
        # Gone entirely: neither running nor a zombie awaiting reaping.
        assert _proc_state(pid) is None, (pid, _proc_state(pid))
    assert not mp.active_children()


def test_lambda_is_rejected():
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(2, lambda r, n: r, timeout=5)


def test_free_port():
    port = free_port()
    assert 0 < port < 65536
