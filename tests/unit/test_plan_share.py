"""Each rank lays out its own data file from its share of the plan: the file must be the one the whole plan has."""

from __future__ import annotations

import pytest

from nostall.planning.plan import RankMeta, TensorMeta, build_plan, decode_meta, encode_meta, own_files, owned_pieces
from nostall.planning import replicas
from nostall.tools.bench.scale import synthetic_metas


def _check(metas):
    plan = build_plan(metas)
    world = len(metas)
    for r, m in enumerate(metas):
        mine = own_files(m, r, world, owned_pieces(plan, m, r))
        assert mine == tuple(plan.files_of(r)), r


@pytest.mark.parametrize("ranks,tensors", [(1, 5), (2, 10), (8, 20), (16, 7)])
def test_own_files_equal_the_plans_on_fsdp_tp_and_replicated_metadata(ranks, tensors):
    _check(synthetic_metas(ranks, tensors))


def _t(key, gshape, off, shape, sharded=True, main=True, tied=""):
    return TensorMeta(key, "F32", gshape, off, shape, sharded, main, tied)


def test_own_files_with_ties_empty_shards_per_rank_values_and_odd_names():
    # rank 2 holds an empty shard; 'head' is tied to 'emb'; '__metadata__' is a key; keys in no order
    metas = []
    for r in range(3):
        rows = (0, 2) if r == 0 else ((2, 2) if r == 1 else (4, 0))
        ts = (
            _t("z/last", (4, 3), (rows[0], 0), (rows[1], 3)),
            _t("emb", (5, 2), (0, 0), (5, 2), sharded=False),
            _t("head", (5, 2), (0, 0), (5, 2), sharded=False, tied="emb"),
            _t("__metadata__", (2,), (0,), (2,), sharded=False),
            _t("a/tp", (2, 6), (0, 2 * r), (2, 2)),
            _t("dp/copy", (3, 3), (0, 0), (3, 3), main=(r == 1)),
        )
        metas.append(RankMeta(ts, ((f"rng{r}", "U8", (7,)),) if r != 1 else ()))
    _check(metas)


def test_a_rank_with_nothing_to_write_has_no_file():
    metas = [RankMeta((_t("w", (4,), (0,), (4,), sharded=False),), ()) for _ in range(2)]
    plan = build_plan(metas)
    files = [own_files(m, r, 2, owned_pieces(plan, m, r)) for r, m in enumerate(metas)]
    assert sorted(len(f) for f in files) == [0, 1]


def test_metadata_columns_round_trip_and_are_smaller_than_pickled_dataclasses():
    import pickle

    m = synthetic_metas(64, 100)[3]
    assert decode_meta(encode_meta(m)) == m
    assert decode_meta(encode_meta(m)).signature() == m.signature()
    assert len(encode_meta(m)) < len(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)) * 0.7


def test_copies_of_names_each_ranks_replicated_keys():
    metas = synthetic_metas(16, 10)
    shared = replicas.shared_keys(metas)
    copies = replicas.copies_of(shared, 16)
    for r in range(16):
        assert copies[r] == [k for k, groups in shared.items() for ranks in groups if r in ranks]


def test_replica_check_compares_every_box_of_a_key_copied_across_groups():
    # a TP weight (column halves over ranks 0-1) copied to ranks 2-3: both halves' copies are compared
    def tp(r):
        return RankMeta((TensorMeta("w", "F32", (2, 4), (0, 2 * (r % 2)), (2, 2), True, r < 2),), ())

    shared = replicas.shared_keys([tp(r) for r in range(4)])
    assert shared == {"w": ((0, 2), (1, 3))}
    # the second half's copies differ: found (the check used to keep only one box per key)
    problem = replicas.disagreements(shared, [{"w": 1}, {"w": 2}, {"w": 1}, {"w": 9}])
    assert problem is not None and "ranks 1 and 3" in problem
    assert replicas.disagreements(shared, [{"w": 1}, {"w": 2}, {"w": 1}, {"w": 2}]) is None


@pytest.mark.parametrize("ranks,tensors", [(1, 5), (2, 10), (8, 20), (16, 7)])
def test_shared_keys_equal_the_one_pass_scan_in_any_key_order(ranks, tensors):
    metas = synthetic_metas(ranks, tensors)
    assert replicas.shared_keys(metas) == replicas.scan_shared_keys(metas)
    assert list(replicas.shared_keys(metas)) == list(replicas.scan_shared_keys(metas))  # same key order
    # one rank listing its keys in another order takes the general path: the same answer
    shuffled = [RankMeta(tuple(reversed(metas[0].tensors)), metas[0].per_rank)] + list(metas[1:])
    assert replicas.shared_keys(shuffled) == replicas.scan_shared_keys(metas)
    # a TP weight copied across DP groups, mixed with a key every rank holds alone
    tp = [RankMeta((TensorMeta("w", "F32", (2, 4), (0, 2 * (r % 2)), (2, 2), True, r < 2),
                    TensorMeta("e", "F32", (4,), (r,), (1,), True, True)), ()) for r in range(4)]
    assert replicas.shared_keys(tp) == replicas.scan_shared_keys(tp) == {"w": ((0, 2), (1, 3))}
