"""Self-tests of the multi-rank harness in tests/dist_harness.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from tests.dist_harness import POOL_PROCESS_PREFIX, RankPools, free_port, run_ranks

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


def _sleep_on_rank1(rank: int, world_size: int, piddir: str):
    Path(piddir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(1000)
    return rank


def _rank_info(rank: int, world_size: int, delay: float):
    import torch.distributed as dist

    # Higher ranks finish first: results must still come back ordered by rank.
    time.sleep(delay * (world_size - 1 - rank))
    return rank, dist.get_rank(), dist.get_world_size(), os.getpid(), os.environ.get("OMP_NUM_THREADS")


def _fail_rank1_others_wait(rank: int, world_size: int):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("rank 1 gives up before the collective")
    dist.all_reduce(torch.ones(1))  # blocks: rank 1 never joins
    return rank


def _destroy_default_group(rank: int, world_size: int):
    import torch.distributed as dist

    dist.destroy_process_group()
    return rank


def _sys_exit(rank: int, world_size: int):
    import sys

    sys.exit(3)


def _desync(rank: int, world_size: int):
    import torch
    import torch.distributed as dist

    if rank == 0:
        # Enqueued on rank 0 only, then both ranks fail "cleanly": the pool's
        # default group is now out of step and must not be reused.
        dist.all_reduce(torch.ones(1), async_op=True)
    raise ValueError(f"rank {rank} failed")


def _leave_groups_behind(rank: int, world_size: int):
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    before = len(c10d._world.pg_map)
    g = dist.new_group(backend="gloo")  # never destroyed
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    mesh = init_device_mesh("cpu", (2, world_size // 2))  # 2-D: sub-groups
    row = torch.ones(1)
    dist.all_reduce(row, group=mesh.get_group(1))
    return before, t.item(), row.item()


# --- helpers ------------------------------------------------------------------


def _proc_state(pid: int) -> str | None:
    """State letter of pid from /proc (None if the process no longer exists)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Format: "pid (comm) S ppid ..." - comm may contain spaces/parens.
    return stat.rsplit(")", 1)[1].split()[0]


def _run_ranks_children() -> list:
    """Live children other than the session's rank-pool workers (reaps zombies)."""
    return [p for p in mp.active_children() if not p.name.startswith(POOL_PROCESS_PREFIX)]


# --- tests --------------------------------------------------------------------


def test_allreduce_two_ranks():
    out = run_ranks(2, _allreduce, 1.0, timeout=60, env={"NOSTALL_X": "yes"})
    expected = [1.0 + 2.0, 10.0 + 20.0]
    assert [o[0] for o in out] == [expected, expected]
    assert all(o[1] == "1" for o in out)  # OMP_NUM_THREADS set in children
    assert all(o[2] == "yes" for o in out)  # env overrides passed through
    assert not _run_ranks_children()


def test_failing_rank_reports_traceback():
    with pytest.raises(AssertionError) as ei:
        run_ranks(2, _raise_on_rank1, timeout=60)
    msg = str(ei.value)
    assert "rank 1" in msg
    assert "ValueError: boom from rank 1" in msg
    assert "--- rank 0 ---" not in msg  # rank 0 succeeded
    assert not _run_ranks_children()


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
    assert not _run_ranks_children()


def test_lambda_is_rejected():
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(2, lambda r, n: r, timeout=5)


def test_free_port():
    port = free_port()
    assert 0 < port < 65536


# --- persistent rank pool -----------------------------------------------------


def test_pool_lambda_is_rejected(pool2):
    with pytest.raises(TypeError, match="module-level"):
        pool2.run(lambda r, n: r, timeout=5)


def test_pool_results_ordered_by_rank(pool4):
    out = pool4.run(_rank_info, 0.2, timeout=60)
    assert [o[:3] for o in out] == [(r, r, 4) for r in range(4)]
    assert [o[3] for o in out] == pool4.pids
    assert all(o[4] == "1" for o in out)  # OMP_NUM_THREADS set in the workers
    # the same workers run the next job
    assert [o[3] for o in pool4.run(_rank_info, 0.0)] == pool4.pids


def test_pool_leftover_groups_are_destroyed(pool4):
    for _ in range(3):  # repeatedly: new_group + a 2x2 DeviceMesh per job
        out = pool4.run(_leave_groups_behind, timeout=60)
        assert out == [(1, 4.0, 2.0)] * 4  # only the default group at job start


def test_pool_error_keeps_workers(pool2):
    pids = pool2.run(_rank_info, 0.0)
    pids = [o[3] for o in pids]
    with pytest.raises(AssertionError) as ei:
        pool2.run(_raise_on_rank1, timeout=60)
    msg = str(ei.value)
    assert "--- rank 1 ---" in msg and "ValueError: boom from rank 1" in msg
    assert "Traceback" in msg
    assert "--- rank 0 ---" not in msg  # rank 0 succeeded
    assert pool2.alive and pool2.pids == pids
    out = pool2.run(_allreduce, 1.0, timeout=60)
    assert [o[0] for o in out] == [[3.0, 30.0]] * 2
    assert pool2.pids == pids


def _assert_gone(pids):
    for pid in pids:
        # Gone entirely: neither running nor a zombie awaiting reaping.
        assert _proc_state(pid) is None, (pid, _proc_state(pid))


def test_pool_hanging_rank_kills_pool(pool2, tmp_path):
    pool2.run(_rank_info, 0.0)  # warm: the timeout below is the job's alone
    starts = pool2.starts
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="ranks timed out") as ei:
        pool2.run(_sleep_on_rank1, str(tmp_path), timeout=10)
    assert time.monotonic() - t0 < 10 + 10
    assert "ranks [1]" in str(ei.value)
    old = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
    assert not pool2.alive and pool2.pids == []
    _assert_gone(old)
    # the next job transparently runs on a fresh set of workers
    out = pool2.run(_allreduce, 1.0, timeout=120)
    assert [o[0] for o in out] == [[3.0, 30.0]] * 2
    assert pool2.starts == starts + 1 and not set(pool2.pids) & set(old)
    _assert_gone(old)


def test_pool_failure_grace_kills_stuck_ranks(pool2):
    old = pool2.pids
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="did not report within") as ei:
        pool2.run(_fail_rank1_others_wait, timeout=120)
    # well before the 60 s gloo timeout that rank 0 would otherwise wait out
    assert time.monotonic() - t0 < 30
    assert "rank 1 gives up" in str(ei.value)
    _assert_gone(old)
    assert pool2.run(_rank_info, 0.0)[1][:3] == (1, 1, 2)


@pytest.mark.parametrize(
    "body,why",
    [(_destroy_default_group, "destroyed the default process group"), (_sys_exit, "raised SystemExit")],
)
def test_pool_unusable_workers_restart(pool2, body, why):
    pool2.run(_rank_info, 0.0)
    old = pool2.pids
    with pytest.raises(AssertionError, match=why):
        pool2.run(body, timeout=60)
    _assert_gone(old)
    out = pool2.run(_allreduce, 1.0, timeout=120)
    assert [o[0] for o in out] == [[3.0, 30.0]] * 2
    assert not set(pool2.pids) & set(old)


def test_rank_pools_cap_and_close():
    pools = RankPools(max_alive=1)
    try:
        p1 = pools.get(1)
        assert p1.run(_rank_info, 0.0)[0][:3] == (0, 0, 1)
        old = p1.pids
        p2 = pools.get(2)  # closes p1 first: only one set of workers at a time
        assert p1.pids == [] and not p1.alive
        _assert_gone(old)
        assert pools.get(2) is p2
        assert [o[:3] for o in p2.run(_rank_info, 0.0)] == [(0, 0, 2), (1, 1, 2)]
        survivors = p2.pids
    finally:
        pools.close()
    assert p2.pids == []
    _assert_gone(survivors)


def test_pool_out_of_step_ranks_restart(pool2):
    pool2.run(_rank_info, 0.0)
    old = pool2.pids
    with pytest.raises(AssertionError, match="out of step") as ei:
        pool2.run(_desync, timeout=60)
    assert "rank 0 failed" in str(ei.value) and "rank 1 failed" in str(ei.value)
    _assert_gone(old)
    out = pool2.run(_allreduce, 1.0, timeout=120)
    assert [o[0] for o in out] == [[3.0, 30.0]] * 2
