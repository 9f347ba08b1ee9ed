"""Planning split by key on real gloo ranks (issue 26): the all-to-all, saves and loads bit-exact, errors alike."""

from __future__ import annotations

import torch

from tests.dist_harness import RankPool


def _value(key, shape, dtype=torch.float32):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) + (sum(map(ord, key)) % 89) * 100).reshape(shape).to(dtype)


def _state(rank, world, zeros=False):
    """FSDP-like, TP-like (copied over 2 groups), replicated, per-rank and tied leaves; 24 keys of each kind, so
    that every rank plans some."""
    import nostall

    def v(key, shape, dtype=torch.float32):
        t = _value(key, shape, dtype)
        return torch.zeros_like(t) if zeros else t

    tp = 2 if world >= 2 else 1
    state = {"fsdp": {}, "tp": {}, "rep": {}}
    for i in range(24):
        k = str(i)
        full = v(f"fsdp{i}", (4 * world, 3))
        state["fsdp"][k] = nostall.ShardedTensor(full[4 * rank: 4 * rank + 4].clone(), (4 * world, 3),
                                                 (4 * rank, 0))
        full = v(f"tp{i}", (5, 2 * tp), torch.bfloat16)
        c = rank % tp
        state["tp"][k] = nostall.ShardedTensor(full[:, 2 * c: 2 * c + 2].clone(), (5, 2 * tp), (0, 2 * c),
                                               replica_id=rank // tp)
        state["rep"][k] = v(f"rep{i}", (7,), torch.float64)
    state["mine"] = nostall.PerRank(torch.zeros(3) if zeros else torch.full((3,), float(rank)))
    return state


def _leaves(state):
    for group in ("fsdp", "tp", "rep"):
        for k, x in state[group].items():
            yield f"{group}/{k}", _plain(x)


def _tied(zeros=False):
    w = torch.zeros(6, 4) if zeros else _value("emb", (6, 4))
    return {"emb": w, "head": w}  # one memory under two keys


def _save_load(rank, world, root, tied):
    import nostall
    from nostall.loading.manifests import read_manifest

    state = _state(rank, world)
    if tied:
        state["net"] = _tied()
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)  # the cached plan
        back = _state(rank, world, zeros=True)
        if tied:
            back["net"] = _tied(zeros=True)
        mgr.load(back, step=2)
        path = mgr.path_for(2)
    same = all(torch.equal(a, b) for (_, a), (_, b) in zip(_leaves(state), _leaves(back)))
    same = same and torch.equal(back["mine"].value, state["mine"].value)
    if tied:
        same = same and torch.equal(back["net"]["emb"], state["net"]["emb"])
        same = same and torch.equal(back["net"]["head"], state["net"]["emb"])
    m = read_manifest(str(path))
    writers = sorted({p.file for t in m.tensors.values() for p in t.pieces})
    return same, writers, m.tensors["net/head"].tied_to if tied else ""


def _plain(x):
    import nostall

    return x.data if isinstance(x, nostall.ShardedTensor) else x


def _exchange(rank, world):
    from nostall.planning.comm import make_comm

    comm = make_comm(None, 60.0, own_group=True)
    try:
        return comm.exchange([(rank, to, "x" * (to * 5000)) for to in range(world)])
    finally:
        comm.close()


def test_exchange_sends_each_rank_its_own(pool4: RankPool):
    out = pool4.run(_exchange)
    for r, got in enumerate(out):
        assert [tuple(g) for g in got] == [(s, r, "x" * (r * 5000)) for s in range(4)]


def test_two_and_four_ranks_save_and_load_bit_exact(pool2: RankPool, pool4: RankPool, tmp_path):
    for pool, world in ((pool2, 2), (pool4, 4)):
        for tied in (False, True):
            out = pool.run(_save_load, str(tmp_path / f"w{world}{tied}"), tied)
            assert [o[0] for o in out] == [True] * world, (world, tied)
            if not tied:  # planners by key: the writers of the saved-once tensors are spread over the ranks
                assert len(out[0][1]) == world
            else:  # planned by rank 0 alone, the tied key saved once, as the key it is tied to
                assert out[0][2] == "net/emb"


def _disagree(rank, world, root):
    import nostall

    state = _state(rank, world)
    if rank == world - 1:
        state["rep"]["5"] = state["rep"]["5"].float()
    with nostall.CheckpointManager(root) as mgr:
        try:
            mgr.save(1, state)
        except nostall.InvalidStateError as e:
            return str(e), mgr.latest_step()
    return "", None


def test_a_header_disagreement_raises_the_same_error_on_every_rank(pool4: RankPool, tmp_path):
    out = pool4.run(_disagree, str(tmp_path / "bad"))
    assert len({o[0] for o in out}) == 1
    assert "key 'rep/5': dtype F64 on rank 0 but F32 on rank 3" in out[0][0]
    assert [o[1] for o in out] == [None] * 4
