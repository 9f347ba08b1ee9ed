"""Bad inputs and failures on real gloo groups: every rank raises, nothing is committed."""

from __future__ import annotations

import errno
import os

import torch
import torch.distributed as dist

from tests.dist_harness import run_ranks


def _expect(fn, exc_name: str, *needles: str) -> str:
    import nostall

    try:
        fn()
    except getattr(nostall, exc_name) as e:
        msg = str(e)
        for n in needles:
            assert n in msg, (n, msg)
        return msg
    raise AssertionError(f"expected {exc_name}")


def _bad_states(rank, world, root):
    import nostall

    results = []
    with nostall.CheckpointManager(root) as mgr:
        good = {"w": torch.ones(4), "s": nostall.ShardedTensor(torch.full((2,), float(rank)), (4,), (2 * rank,))}
        mgr.save(1, good)

        # an unsupported leaf on rank 1 only: both ranks raise, naming rank 1 and the key
        bad = dict(good, extra=object() if rank == 1 else 0)
        results.append(_expect(lambda: mgr.save(2, bad), "InvalidStateError", "rank 1", "'extra'"))

        # overlapping shards
        ov = {"s": nostall.ShardedTensor(torch.zeros(3), (4,), (rank,))}
        results.append(_expect(lambda: mgr.save(3, ov), "InvalidStateError", "'s'", "overlap"))

        # incomplete cover
        inc = {"s": nostall.ShardedTensor(torch.zeros(1), (4,), (rank,))}
        results.append(_expect(lambda: mgr.save(4, inc), "InvalidStateError", "'s'", "cover"))

        # replicated tensor with different shapes on the two ranks
        rep = {"w": torch.zeros(4 + rank)}
        results.append(_expect(lambda: mgr.save(5, rep), "InvalidStateError", "'w'", "shape"))

        # two main copies of the same piece
        dup = {"s": nostall.ShardedTensor(torch.zeros(4), (4,), (0,), replica_id=0)}
        results.append(_expect(lambda: mgr.save(6, dup), "InvalidStateError", "'s'", "replica_id"))

        # replicated JSON values that differ
        js = {"w": torch.ones(4), "lr": 0.1 * (rank + 1)}
        results.append(_expect(lambda: mgr.save(7, js), "InvalidStateError", "'lr'", "PerRank"))

        # ranks disagree on the step
        results.append(_expect(lambda: mgr.save(8 + rank, good), "InvalidStateError", "step"))

        # nothing of the failed saves is on disk, step 1 is still latest and loads
        assert mgr.steps() == [1], mgr.steps()
        assert open(os.path.join(root, "latest")).read().strip() == "1"
        assert [n for n in os.listdir(os.path.join(root, ".tmp")) if n != ".lock"] == []
        t = {"w": torch.zeros(4), "s": nostall.ShardedTensor(torch.zeros(2), (4,), (2 * rank,))}
        mgr.load(t)
        assert torch.equal(t["s"].data, torch.full((2,), float(rank)))
        dist.barrier()  # every rank has looked before rank 0 starts the next save's staging
        # and the manager still works
        mgr.save(9, good)
        assert mgr.steps() == [1, 9]
    return results


def test_bad_inputs_raise_on_every_rank_and_commit_nothing(tmp_path):
    out = run_ranks(2, _bad_states, str(tmp_path))
    # both ranks raised the same errors
    assert out[0] == out[1]


def _write_fails_on_rank1(rank, world, root):
    import nostall
    from nostall.storage import files as storage

    real = storage.FileWriter.write
    with nostall.CheckpointManager(root) as mgr:
        state = {"w": torch.arange(1000.0), "s": nostall.ShardedTensor(torch.ones(8) * rank, (16,), (8 * rank,))}
        mgr.save(1, state)

        def enospc(self, chunk):
            raise OSError(errno.ENOSPC, "No space left on device", self.path)

        if rank == 1:
            storage.FileWriter.write = enospc  # type: ignore[method-assign]
        try:
            msg = _expect(lambda: mgr.save(2, state), "CheckpointSaveError", "rank 1", "No space left", "step 2")
        finally:
            storage.FileWriter.write = real  # type: ignore[method-assign]
        assert mgr.steps() == [1] and mgr.latest_step() == 1
        assert not os.path.exists(os.path.join(root, "step_2"))
        assert not os.path.exists(os.path.join(root, ".tmp", "step_2"))
        t = {"w": torch.zeros(1000), "s": nostall.ShardedTensor(torch.zeros(8), (16,), (8 * rank,))}
        mgr.load(t)
        assert torch.equal(t["s"].data, torch.ones(8) * rank)
        dist.barrier()  # every rank has looked before rank 0 starts the next save's staging
        mgr.save(2, state)  # space is back
        assert mgr.latest_step() == 2
    return msg


def test_write_failure_on_one_rank(tmp_path):
    out = run_ranks(2, _write_fails_on_rank1, str(tmp_path))
    assert out[0] == out[1]


def _retention_dist(rank, world, root):
    import torch.distributed as dist

    import nostall

    with nostall.CheckpointManager(root, keep_last=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"s": nostall.ShardedTensor(torch.full((3,), float(step)), (6,), (3 * rank,))})
        dist.barrier()  # rank 0 applies retention after every rank knows the outcome
        return mgr.steps()


def test_retention_keeps_last_n(tmp_path):
    assert run_ranks(2, _retention_dist, str(tmp_path)) == [[4, 5], [4, 5]]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_4", "step_5"]


def _second_manager(rank, world_size, root):
    import os

    import nostall

    first = nostall.CheckpointManager(root)
    try:
        nostall.CheckpointManager(root)
    except nostall.CheckpointSaveError as e:
        msg = str(e)
    else:
        raise AssertionError("a second manager on a held root was accepted")
    reader = nostall.CheckpointManager(root, read_only=True)
    reader.close()
    first.close()
    nostall.CheckpointManager(root).close()  # free again once the holder closed
    return msg, os.getpid()


def test_second_job_on_the_same_root_is_refused_on_every_rank(pool2, tmp_path):
    out = pool2.run(_second_manager, str(tmp_path))
    holder_pid = out[0][1]
    for msg, _ in out:
        assert "in use by another CheckpointManager" in msg and f"pid {holder_pid} on host" in msg
