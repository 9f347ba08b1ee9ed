"""A save whose metadata collective fails (a rank late by more than ``timeout``) costs that save only.

Real gloo groups, 2 ranks: the late save raises on every rank (a
CheckpointTimeoutError, a kind of CheckpointSaveError, on the rank that waited),
and the next save of the same CheckpointManager works on every rank.
"""

from __future__ import annotations

import time

import torch

from tests.dist_harness import run_ranks

TIMEOUT = 4.0
# The late rank starts its save this long after the others: more than TIMEOUT, so the others
# time out; less than 2 * TIMEOUT by a wide margin, so that it joins their next save's
# replacement of the broken group, which waits up to TIMEOUT for it.
LATE_S = TIMEOUT + 1.5


def _state(rank: int, step: int):
    import nostall

    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "w": torch.randn(16, generator=torch.Generator().manual_seed(step)),  # replicated
        "s": nostall.ShardedTensor(torch.randn(3, 5, generator=g), (6, 5), (3 * rank, 0)),
        "r": nostall.PerRank({"rank": rank, "step": step}),
    }


def _late_save(mgr, rank: int, late_rank: int, step: int) -> tuple:
    """Save ``step`` with ``late_rank`` arriving LATE_S late; (error type, message, seconds) or None."""
    import nostall

    if rank == late_rank:
        time.sleep(LATE_S)
    t0 = time.monotonic()
    try:
        mgr.save(step, _state(rank, step))
        mgr.finalize_pending_saves()
    except nostall.CheckpointSaveError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return None


def _check_loads(mgr, rank: int, step: int) -> None:
    import nostall

    want = _state(rank, step)
    t = {"w": torch.zeros(16), "s": nostall.ShardedTensor(torch.zeros(3, 5), (6, 5), (3 * rank, 0)),
         "r": nostall.PerRank({})}
    out = mgr.load(t, step)
    assert torch.equal(t["w"], want["w"]), step
    assert torch.equal(t["s"].data, want["s"].data), step
    assert out["r"] == {"rank": rank, "step": step}, out["r"]


def _late_rank_job(rank, world, root, async_save, late_ranks):
    import nostall

    results = []
    with nostall.CheckpointManager(root, timeout=TIMEOUT, async_save=async_save) as mgr:
        step = 1
        mgr.save(step, _state(rank, step))
        mgr.finalize_pending_saves()
        done = [step]
        for late in late_ranks:
            failed = _late_save(mgr, rank, late, step + 1)
            t0 = time.monotonic()
            mgr.save(step + 2, _state(rank, step + 2))  # the same manager: must work on every rank
            mgr.finalize_pending_saves()
            results.append((failed, time.monotonic() - t0))
            step += 2
            done.append(step)
        assert mgr.steps() == done, (mgr.steps(), done)
        for s in done:
            _check_loads(mgr, rank, s)
    return results


def _check_failures(out, late_ranks) -> None:
    for i, late in enumerate(late_ranks):
        waited = 1 - late  # 2 ranks
        assert out[waited][i][0] is not None and out[late][i][0] is not None, ("a late save did not fail", out)
        (name_w, msg_w, _), _ = out[waited][i]
        (name_l, msg_l, _), _ = out[late][i]
        # the rank that waited timed out: it says so, and how to fix it
        assert name_w == "CheckpointTimeoutError", (name_w, msg_w)
        for needle in (f"rank {waited}", "metadata ", f"{TIMEOUT:g}s", "raise the timeout", "late"):
            assert needle in msg_w, (needle, msg_w)
        # the late rank found the group closed by its peer (or timed out itself)
        assert name_l in ("CheckpointSaveError", "CheckpointTimeoutError"), (name_l, msg_l)
        assert f"rank {late}" in msg_l, msg_l


def test_a_late_rank_costs_one_sync_save_not_the_manager(pool2, tmp_path):
    # rank 1 late, then (on the replacement group) rank 0 late
    late_ranks = [1, 0]
    out = pool2.run(_late_rank_job, str(tmp_path), False, late_ranks, timeout=120)
    _check_failures(out, late_ranks)


def test_a_late_rank_costs_one_async_save_not_the_manager(tmp_path):
    late_ranks = [1]
    out = run_ranks(2, _late_rank_job, str(tmp_path), True, late_ranks, timeout=120)
    _check_failures(out, late_ranks)


def test_timeout_error_is_a_save_error():
    import nostall

    assert issubclass(nostall.CheckpointTimeoutError, nostall.CheckpointSaveError)
    assert issubclass(nostall.CheckpointTimeoutError, TimeoutError)
    assert "CheckpointTimeoutError" in nostall.__all__
    e = nostall.CheckpointTimeoutError("rank 0: late")
    assert str(e) == "rank 0: late"
