"""A nearly full disk: whatever runs out of space, every rank is told what is on disk.

The free space left before a save is swept across the region where the data
files fit but the manifest, `latest`, the done records or the outcome may
not. After each save, on both ranks: the reported outcome equals whether the
step is committed, `latest` never lags a committed step, and once the space
is back the next save works (2 ranks, real gloo, a size-limited tmpfs).
"""

from __future__ import annotations

import os

import pytest

from tests.dist.test_faults import _save_outcome as _outcome
from tests.dist.test_faults import small_fs  # noqa: F401  (the 6 MiB tmpfs fixture)

PAGE = 4096


def _state(step, rank, world):
    import torch

    import nostall

    w = torch.full((64, 1024), float(step * 10 + rank))  # 256 KiB per rank
    return {"w": nostall.ShardedTensor(w, (64 * world, 1024), (64 * rank, 0)), "meta": {"step": step}}


def _sweep(rank, world, root, filler, async_save, spares):
    import torch
    import torch.distributed as dist

    import nostall

    mgr = nostall.CheckpointManager(root, keep_last=1, async_save=async_save, timeout=20)
    assert _outcome(mgr, 1, _state(1, rank, world)) is None
    seen = []
    step = 1
    for spare in spares:
        dist.barrier()
        if rank == 0:  # leave room for the two data files plus `spare` pages
            st = os.statvfs(root)
            need = 2 * ((256 << 10) + PAGE) + spare * PAGE
            with open(filler, "wb") as f:
                f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - need))
        dist.barrier()
        step += 1
        err = _outcome(mgr, step, _state(step, rank, world))
        seen.append((spare, step, err, mgr.steps(), mgr.latest_step()))
        dist.barrier()
        if rank == 0:
            os.unlink(filler)
        dist.barrier()
        step += 1
        ok_again = _outcome(mgr, step, _state(step, rank, world))  # space is back
        assert ok_again is None, f"rank {rank}: after spare={spare}, the save once space was back failed: {ok_again}"
        tmpl = _state(0, rank, world)
        got = mgr.load(tmpl)
        assert got["meta"] == {"step": step} and torch.equal(tmpl["w"].data, _state(step, rank, world)["w"].data)
    mgr.close()
    return seen


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_the_outcome_equals_what_is_committed_on_a_nearly_full_disk(pool2, small_fs, async_save):  # noqa: F811
    root = str(small_fs / "run")
    spares = list(range(-2, 10))
    out = pool2.run(_sweep, root, str(small_fs / "filler"), async_save, spares)
    failed_somewhere = False
    for i, spare in enumerate(spares):
        (_, step, err0, steps0, latest0), (_, _, err1, steps1, latest1) = out[0][i], out[1][i]
        committed = step in steps0
        # (retention of older steps may still be running on rank 0 when rank 1 looks: compare this step only)
        assert (step in steps1) == committed and latest0 == latest1, (spare, out[0][i], out[1][i])
        # every rank is told the truth: success exactly when the step is committed
        assert (err0 is None) == committed and (err1 is None) == committed, (spare, out[0][i], out[1][i])
        # `latest` never lags a committed step
        assert latest0 == max(steps0), (spare, out[0][i])
        failed_somewhere |= not committed
    assert failed_somewhere, "no spare amount made the save fail: the sweep did not reach a full disk"
