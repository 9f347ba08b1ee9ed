"""Planning split by key (issue 26): planners by key hash, and the manifest's pieces assembled from the dones."""

from __future__ import annotations

from collections import Counter

import pytest

from nostall.core.format import Manifest, PieceRecord, Placed
from nostall.errors import InvalidStateError
from nostall.planning import planners
from nostall.planning.comm import Comm
from nostall.planning.plan import Layout, RankMeta, TensorMeta, build_plan, layout_of, own_files
from nostall.saving.saver import manifest_skeleton
from nostall.tools.bench.scale import synthetic_metas

SIZES = [(1, 5), (2, 10), (3, 7), (8, 20), (16, 40)]


def _distributed(metas):
    planned, shares = planners.in_one_process(metas)
    world = len(metas)
    files = [own_files(m, r, world, shares[r][0]) for r, m in enumerate(metas)]
    return planned, shares, files


BS = 1 << 20


def _crcs(n):
    return (1,) * max(0, -(-n // BS))


def _written(files):
    """Every piece of ``files`` as the done records report it once written (checksums of 1)."""
    return [(f.rank, it.key, f.rank if it.per_rank else -1, it.offset, it.shape,
             Placed(f.name, it.start, it.end, _crcs(it.end - it.start)))
            for fs in files for f in fs for it in f.items]


def _sizes(files):
    from nostall.core.format import FileRecord

    return {f.name: FileRecord(f.name, f.rank, f.size) for fs in files for f in fs}


def _loads(files):
    load = Counter()
    for fs in files:
        for f in fs:
            load[f.rank] += sum(it.end - it.start for it in f.items if not it.per_rank)
    return load


@pytest.mark.parametrize("ranks,tensors", SIZES)
def test_every_distinct_piece_is_written_once_by_one_of_its_holders(ranks, tensors):
    metas = synthetic_metas(ranks, tensors)
    _, _, files = _distributed(metas)
    written = Counter((it.key, it.offset, it.shape) for fs in files for f in fs for it in f.items if not it.per_rank)
    central = build_plan(metas)
    expected = {(k, p.offset, p.shape) for k, t in central.tensors.items() if not t.tied_to for p in t.pieces}
    assert set(written) == expected
    assert set(written.values()) == {1}
    holders = {}
    for r, m in enumerate(metas):
        for t in m.tensors:
            holders.setdefault((t.key, t.offset, t.shape), set()).add(r)
    for fs in files:
        for f in fs:
            for it in f.items:
                if not it.per_rank:
                    assert f.rank in holders[(it.key, it.offset, it.shape)]
    # every rank's per-rank tensors in its own file
    for r, m in enumerate(metas):
        own = {it.key for f in files[r] for it in f.items if it.per_rank}
        assert own == {k for k, _, _ in m.per_rank}


@pytest.mark.parametrize("ranks,tensors", SIZES)
def test_the_bytes_per_rank_are_balanced(ranks, tensors):
    # the bound: no rank writes more than the mean plus the largest piece its planners could not split
    metas = synthetic_metas(ranks, tensors)
    _, _, files = _distributed(metas)
    load = _loads(files)
    total = sum(load.values())
    largest = max(it.end - it.start for fs in files for f in fs for it in f.items)
    assert max(load.values()) <= total / ranks + 2 * largest
    # and no worse than twice what one central planner gives
    central = _loads([build_plan(metas).files.values()])
    assert max(load.values()) <= 2 * max(central.values())


@pytest.mark.parametrize("ranks,tensors", SIZES)
def test_the_manifest_assembled_from_the_dones_has_the_central_plans_records(ranks, tensors):
    metas = synthetic_metas(ranks, tensors)
    central = build_plan(metas)
    # the central plan's own files, assembled at the commit, give exactly the records the plan has
    skel = manifest_skeleton(layout_of(central), {}, [{} for _ in metas], 1, BS)
    m = skel.with_pieces(_written([central.files.values()]), _sizes([central.files.values()]))
    for k, t in central.tensors.items():
        assert m.tensors[k].pieces == tuple(PieceRecord(p.offset, p.shape, p.file, p.start, p.end, _crcs(p.end - p.start))
                                            for p in t.pieces)
    for r in range(ranks):
        for k, t in central.per_rank[r].items():
            p = t.pieces[0]
            assert m.per_rank[r].tensors[k].pieces == (PieceRecord(p.offset, p.shape, p.file, p.start, p.end, _crcs(p.end - p.start)),)
    # the distributed plan: the same keys, headers and boxes (its writers may differ)
    planned, _, files = _distributed(metas)
    headers = {}
    for p in planned:
        headers.update(p.headers)
    layout = Layout(ranks, headers, [m.per_rank for m in metas],
                    {f.name: (f.rank, f.size) for fs in files for f in fs})
    d = manifest_skeleton(layout, {}, [{} for _ in metas], 1, BS).with_pieces(_written(files), _sizes(files))
    assert Manifest.from_json_bytes(d.to_json_bytes(), "d")  # a valid manifest
    assert d.tensors.keys() == m.tensors.keys()
    for k, t in m.tensors.items():
        got = d.tensors[k]
        assert (got.dtype, got.shape, got.sharded, got.tied_to) == (t.dtype, t.shape, t.sharded, t.tied_to)
        assert [(p.offset, p.shape) for p in got.pieces] == [(p.offset, p.shape) for p in t.pieces]
    assert [sorted(r.tensors) for r in d.per_rank] == [sorted(r.tensors) for r in m.per_rank]


def _t(key, gshape, off, shape, sharded=True, main=True, tied="", dtype="F32"):
    return TensorMeta(key, dtype, gshape, off, shape, sharded, main, tied)


def _many(keys, bad):
    """4 ranks holding halves of ``keys`` (FSDP-like over ranks 0-1, copies on 2-3); ``bad(r, t)`` spoils one."""
    metas = []
    for r in range(4):
        ts = tuple(bad(r, _t(k, (4, 2), (2 * (r % 2), 0), (2, 2), main=r < 2)) for k in keys)
        metas.append(RankMeta(ts, ()))
    return metas


KEYS = [f"k{i}" for i in range(12)]


@pytest.mark.parametrize("what,bad,needle", [
    ("dtype", lambda r, t: _t(t.key, t.global_shape, t.offset, t.shape, dtype="BF16", main=t.main)
     if (r, t.key) == (3, "k5") else t, "dtype F32 on rank 0 but BF16 on rank 3"),
    ("gap", lambda r, t: _t(t.key, t.global_shape, t.offset, (1, 2), main=t.main)
     if t.key == "k7" and r % 2 == 1 else t, "'k7'"),
    ("overlap", lambda r, t: _t(t.key, t.global_shape, (1, 0), t.shape, main=t.main)
     if t.key == "k2" and r % 2 == 1 else t, "'k2'"),
    ("two mains", lambda r, t: _t(t.key, t.global_shape, t.offset, t.shape, main=True)
     if t.key == "k9" else t, "'k9'"),
])
def test_an_invalid_key_raises_the_central_plans_error(what, bad, needle):
    metas = _many(KEYS, bad)
    with pytest.raises(InvalidStateError) as central:
        build_plan(metas)
    with pytest.raises(InvalidStateError) as split:
        planners.in_one_process(metas)
    assert str(split.value) == str(central.value)
    assert needle in str(split.value)
    # found by that key's planner alone: every other planner is content
    routed = [planners.route(m, 4, False) for m in metas]
    errors = [planners.plan_keys([routed[r][0][p] for r in range(4)], p).error for p in range(4)]
    key = needle.strip("'") if needle.startswith("'") else "k5"
    assert [e is not None for e in errors] == [p == planners.planner_of(key, 4) for p in range(4)]


def test_a_per_rank_key_that_is_a_tensor_elsewhere_is_refused():
    metas = [RankMeta((_t("x", (2,), (0,), (2,), sharded=False),), ()), RankMeta((), (("x", "F32", (2,)),))]
    with pytest.raises(InvalidStateError, match="'x' is a PerRank value on some ranks and a tensor on others"):
        planners.in_one_process(metas)


def test_ties_route_every_key_to_planner_zero_and_are_saved_once():
    metas = [RankMeta((_t("emb", (5, 2), (0, 0), (5, 2), sharded=False),
                       _t("head", (5, 2), (0, 0), (5, 2), sharded=False, tied="emb"),
                       *(_t(f"w{i}", (4,), (2 * r, ), (2,)) for i in range(8))), ()) for r in range(2)]
    parts, _ = planners.route(metas[0], 2, True)
    assert parts[0] is not None and parts[1] is None
    planned, shares, files = _distributed(metas)
    assert planned[0].headers["head"][3] == "emb"
    written = [it.key for fs in files for f in fs for it in f.items]
    assert written.count("emb") == 1 and "head" not in written


def test_replica_groups_and_copies_come_from_the_planners():
    metas = synthetic_metas(16, 20)
    from nostall.planning import replicas

    planned, shares, _ = _distributed(metas)
    shared = {}
    for p in planned:
        shared.update(p.shared)
    assert shared == replicas.shared_keys(metas)
    want = replicas.copies_of(shared, 16)
    for r, m in enumerate(metas):
        assert sorted(m.tensors[i].key for i in shares[r][1]) == sorted(want[r])


def test_the_commit_refuses_pieces_the_plan_did_not_give():
    metas = synthetic_metas(2, 4)
    central = build_plan(metas)
    skel = manifest_skeleton(layout_of(central), {}, [{}, {}], 1, BS)
    written = _written([central.files.values()])
    stray = (1, "no/such/key", -1, (0,), (2,), Placed("rank1.safetensors", 0, 8, (1,)))
    with pytest.raises(ValueError, match="rank 1 wrote a piece .* of key 'no/such/key', which the plan does not"):
        skel.with_pieces(written + [stray], _sizes([central.files.values()]))
    with pytest.raises(ValueError, match="'rng/torch': the pieces ranks \\[0, 1\\] wrote do not cover it exactly"):
        skel.with_pieces(written + [(1, "rng/torch", 0, (0,), (5056,), Placed("rank1.safetensors", 0, 1, ()))],
                         _sizes([central.files.values()]))
    from nostall.core.jobs import Done

    other = Done(True, {("rank1.safetensors", 0, 1): Placed("rank1.safetensors", 0, 1, ())}, rank=1,
                 what={("rank1.safetensors", 0, 1): [("rng/torch", 0, (0,), (5056,))]})
    with pytest.raises(ValueError, match="rank 1 wrote per-rank tensor 'rng/torch' of rank 0"):
        list(other.pieces())
    missing = [w for w in written if not (w[1] == "model/layers/0/fsdp.weight" and w[0] == 1)]
    with pytest.raises(ValueError, match="key 'model/layers/0/fsdp.weight': the pieces ranks .* do not cover it"):
        skel.with_pieces(missing, _sizes([central.files.values()]))
    twice = written + [w for w in written if w[1] == "model/layers/0/norm.weight"]
    with pytest.raises(ValueError, match="key 'model/layers/0/norm.weight'"):
        skel.with_pieces(twice, _sizes([central.files.values()]))


def test_a_done_record_keeps_what_each_piece_is_through_json():
    from nostall.core.jobs import Done

    d = Done(True, {("f", 8, 8): Placed("f", 8, 8, ()), ("f", 8, 16): Placed("f", 8, 16, (3,), "ab")},
             rank=2, what={("f", 8, 8): [("e1", -1, (0,), (0,)), ("e2", 2, (0,), (0,))],
                           ("f", 8, 16): [("w", -1, (4, 0), (2, 1))]})
    back = Done.from_doc(d.to_doc())
    assert back == d
    assert sorted(p[1] for p in back.pieces()) == ["e1", "e2", "w"]


def test_one_rank_exchange_is_a_plain_call():
    assert Comm().exchange(["x"]) == ["x"]
