"""Replica checks on real gloo ranks: a tensor saved once for several ranks must be the same on all of them."""

from __future__ import annotations


import torch

from tests.dist_harness import RankPool


def _expect_refused(mgr, step, state, *needles):
    import nostall

    try:
        mgr.save(step, state)
    except nostall.InvalidStateError as e:
        for n in needles:
            assert n in str(e), (n, str(e))
        return str(e)
    raise AssertionError("the save was not refused")


def _tp_optimizer_as_plain_state_dict(rank, world, root):
    """The README's old pattern: ShardedTensor weights next to optimizer.state_dict() of a TP model."""
    import nostall

    torch.manual_seed(rank)  # each rank's shard differs, so does its exp_avg
    w = torch.nn.Parameter(torch.randn(2, 3))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.randn(2, 3)
    opt.step()
    state = {"model": {"w": nostall.ShardedTensor(w.detach(), (2 * world, 3), (2 * rank, 0))},
             "optim": opt.state_dict()}
    with nostall.CheckpointManager(root) as mgr:
        msg = _expect_refused(mgr, 1, state, "'optim/state/0/exp_avg'", "ranks 0 and 1", "ShardedTensor",
                              "PerRank", "model=")
        nothing = mgr.latest_step()
    with nostall.CheckpointManager(root, check_replicas=False) as mgr:
        mgr.save(2, state)  # turned off: saved (one rank's optimizer state), as the caller asked
        saved = mgr.latest_step()
    return msg, nothing, saved


def test_differing_replicated_optimizer_state_is_refused_on_every_rank(pool2: RankPool, tmp_path):
    out = pool2.run(_tp_optimizer_as_plain_state_dict, str(tmp_path / "run"))
    assert out[0][0] == out[1][0]  # the same error on every rank
    assert [o[1] for o in out] == [None, None]  # nothing committed
    assert [o[2] for o in out] == [2, 2]


def _checked_when(rank, world, root):
    import nostall

    results = []
    same = {"w": torch.ones(3), "s": nostall.ShardedTensor(torch.ones(2), (2,), (0,), replica_id=rank)}
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, same)
        # the plan is unchanged: by default not checked again (the check costs a pass over the bytes)
        mgr.save(2, {"w": torch.full((3,), float(rank)), "s": same["s"]})
        results.append(mgr.latest_step())
        # a changed plan is checked again
        results.append(_expect_refused(mgr, 3, {"w": torch.full((3,), float(rank)), "s": same["s"],
                                                "new": torch.zeros(1)}, "'w'"))
        # after a refusal the same structure is checked again, not taken from the plan cache
        results.append(_expect_refused(mgr, 3, {"w": torch.full((3,), float(rank)), "s": same["s"],
                                                "new": torch.zeros(1)}, "'w'"))
        # ShardedTensor copies (replica_id != 0) are replicas too
        diff = {"w": torch.ones(3), "s": nostall.ShardedTensor(torch.full((2,), float(rank)), (2,), (0,),
                                                               replica_id=rank), "new": torch.zeros(1)}
        results.append(_expect_refused(mgr, 3, diff, "'s'", "ranks 0 and 1"))
        results.append(mgr.latest_step())
    with nostall.CheckpointManager(root, check_replicas=True) as mgr:
        mgr.save(4, same)
        results.append(_expect_refused(mgr, 5, {"w": torch.full((3,), float(rank)), "s": same["s"]}, "'w'"))
    return results


def test_replicas_are_checked_on_first_save_plan_change_and_always_when_asked(pool2: RankPool, tmp_path):
    out = pool2.run(_checked_when, str(tmp_path / "run"))
    assert out[0] == out[1]
    assert out[0][0] == 2 and out[0][4] == 2


def _nested_differently(rank, world, root):
    import nostall

    with nostall.CheckpointManager(root) as mgr:
        # rank 0's extra holds a tensor (saved entry by entry), rank 1's is one JSON value: refused
        extra = {"worker": {"n": 1}, "seen": torch.arange(2)} if rank == 0 else {"worker": {"n": 1}}
        msg = _expect_refused(mgr, 1, {"extra": extra}, "'extra'", "same structure")
        # rank 0 alone holding a key of its own is fine (a driver's state)
        mgr.save(2, {"extra": {"worker": {"n": 1}}, **({"driver": {"pos": 3, "t": torch.ones(1)}} if rank == 0 else {})})
        got = nostall.load({"driver": {"pos": None, "t": torch.zeros(1)}}, mgr.path_for(2), strict=False)
    return msg, got["driver"]["pos"], float(got["driver"]["t"])


def test_a_value_under_another_ranks_value_is_refused(pool2: RankPool, tmp_path):
    out = pool2.run(_nested_differently, str(tmp_path / "run"))
    assert out[0][0] == out[1][0]
    assert [o[1:] for o in out] == [(3, 1.0), (3, 1.0)]
