"""Multi-rank save/load on real gloo groups: layouts, resharding, dedupe, balance."""

from __future__ import annotations

import json
import os

import pytest
import torch

# Global tensors of the synthetic model; values depend only on the key and the
# global index, so any rank in any layout can compute what it must hold.
GLOBAL = {
    "model/col.weight": ((24, 8), torch.float32, 0),  # column-parallel: sharded on dim 0
    "model/row.weight": ((8, 24), torch.float32, 1),  # row-parallel: sharded on dim 1
    "optim/col.exp_avg": ((24, 8), torch.bfloat16, 0),
    "model/embed": ((12, 5), torch.float64, 0),
}
REPLICATED = {
    "model/norm.weight": ((8,), torch.float32),
    "model/big_bias": ((1000,), torch.float32),
    "optim/step": ((), torch.int64),
}


def full_value(key: str, shape, dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    base = (sum(map(ord, key)) % 97) * 1000
    return (torch.arange(n, dtype=torch.float64) + base).reshape(shape).to(dtype)


def split(n: int, parts: int, i: int):
    """Megatron-like even split of n over parts; returns (offset, size)."""
    size = -(-n // parts)
    off = min(i * size, n)
    return off, max(0, min(size, n - off))


def make_state(rank: int, world: int, tp: int, *, zeros: bool = False, plain: bool = False):
    """State of one rank with TP=tp, DP=world//tp. zeros: a load template.

    plain: every tensor as a full plain tensor (a 'consolidated' template).
    """
    import nostall

    tp_rank, dp_rank = rank % tp, rank // tp
    state = {"model": {}, "optim": {"state": {}}}
    for key, (gshape, dtype, dim) in GLOBAL.items():
        full = full_value(key, gshape, dtype)
        if zeros:
            full = torch.zeros_like(full)
        group, name = key.split("/")
        if plain:
            leaf = full.clone()
        else:
            off, size = split(gshape[dim], tp, tp_rank)
            local = full.narrow(dim, off, size).clone()
            offset = [0] * len(gshape)
            offset[dim] = off
            leaf = nostall.ShardedTensor(local, gshape, offset, replica_id=dp_rank)
        if group == "model":
            state["model"][name] = leaf
        else:
            state["optim"]["state"][name] = leaf
    for key, (shape, dtype) in REPLICATED.items():
        v = full_value(key, shape, dtype)
        group, name = key.split("/")
        (state["model"] if group == "model" else state["optim"])[name] = torch.zeros_like(v) if zeros else v
    state["trainer"] = {"step": 0 if zeros else 123, "lr": 0.0 if zeros else 3e-4, "tags": [] if zeros else ["a", "b"]}
    state["rng"] = nostall.PerRank(torch.zeros(4, dtype=torch.uint8) if zeros else torch.full((4,), rank, dtype=torch.uint8))
    state["loader"] = nostall.PerRank({"pos": -1 if zeros else rank * 10})
    return state


def check_state(state, rank: int, world: int, tp: int, *, per_rank: bool, plain: bool = False):
    import nostall

    dp_rank = rank // tp
    tp_rank = rank % tp
    for key, (gshape, dtype, dim) in GLOBAL.items():
        group, name = key.split("/")
        leaf = state["model"][name] if group == "model" else state["optim"]["state"][name]
        full = full_value(key, gshape, dtype)
        if plain:
            assert torch.equal(leaf, full), key
            continue
        assert isinstance(leaf, nostall.ShardedTensor)
        off, size = split(gshape[dim], tp, tp_rank)
        assert torch.equal(leaf.data, full.narrow(dim, off, size)), (key, rank)
    for key, (shape, dtype) in REPLICATED.items():
        group, name = key.split("/")
        v = (state["model"] if group == "model" else state["optim"])[name]
        assert torch.equal(v, full_value(key, shape, dtype)), key
    assert state["trainer"] == {"step": 123, "lr": 3e-4, "tags": ["a", "b"]}
    if per_rank:
        assert torch.equal(state["rng"], torch.full((4,), rank, dtype=torch.uint8))
        assert state["loader"] == {"pos": rank * 10}
    del dp_rank


def _save(rank, world, root, tp, step=1, keep_last=None):
    import nostall

    with nostall.CheckpointManager(root, keep_last=keep_last) as mgr:
        h = mgr.save(step, make_state(rank, world, tp))
        st = h.result(timeout=1)
        h2 = mgr.save(step + 1, make_state(rank, world, tp))
        return {"bytes": st.bytes_written, "cached": (st.plan_cached, h2.result().plan_cached),
                "latest": mgr.latest_step()}


def _load(rank, world, root, tp, plain=False):
    import nostall

    with nostall.CheckpointManager(root) as mgr:
        same_world = json.load(open(os.path.join(mgr.path_for(mgr.latest_step()), "manifest.json")))["world_size"] == world
        tmpl = make_state(rank, world, tp, zeros=True, plain=plain)
        restored = mgr.load(tmpl, per_rank="error" if same_world else "skip")
        check_state(restored, rank, world, tp, per_rank=same_world, plain=plain)
        # in place: the template's tensors hold the values too
        check_state({**tmpl, "trainer": restored["trainer"]}, rank, world, tp, per_rank=False, plain=plain)
    return True


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2), (4, 4)])
def test_roundtrip_same_layout(tmp_path, rank_pools, world, tp):
    pool = rank_pools.get(world)
    out = pool.run(_save, str(tmp_path), tp)
    assert all(o["latest"] == 2 for o in out)
    assert all(o["cached"] == (False, True) for o in out)
    assert pool.run(_load, str(tmp_path), tp) == [True] * world


def test_reshard_2_to_1_and_1_to_2_and_2_to_4(tmp_path, pool2, pool4):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    pool2.run(_save, str(a), 2)
    # 2 -> 1: one rank loads everything as full plain tensors, and as TP=1 shards
    _load(0, 1, str(a), 1, True)
    _load(0, 1, str(a), 1, False)
    # 2 -> 4 with TP=4, and TP=2 x DP=2
    assert pool4.run(_load, str(a), 4) == [True] * 4
    assert pool4.run(_load, str(a), 2) == [True] * 4
    # 1 -> 2
    _save(0, 1, str(b), 1)
    assert pool2.run(_load, str(b), 2) == [True] * 2
    # 4 (TP2 x DP2) -> 2 (TP2): replicas were deduplicated on save
    pool4.run(_save, str(c), 2)
    assert pool2.run(_load, str(c), 2) == [True] * 2


def _save_dp(rank, world, root):
    """Pure data parallel: everything replicated on every rank."""
    import nostall

    state = {f"p{i}": full_value(f"p{i}", (1000 * (i + 1),), torch.float32) for i in range(12)}
    state["s"] = nostall.ShardedTensor(full_value("s", (64, 4), torch.float32), (64, 4), (0, 0), replica_id=rank)
    nostall.save(state, root)
    return True


def test_replicas_written_once_and_balanced(tmp_path, pool4):
    from safetensors.torch import load_file

    root = str(tmp_path / "ck")
    pool4.run(_save_dp, root)
    m = json.load(open(os.path.join(root, "manifest.json")))
    # every tensor is stored exactly once
    for key, t in m["tensors"].items():
        assert len(t["pieces"]) == 1, key
    seen = {}
    for name in os.listdir(root):
        if name.endswith(".safetensors"):
            for k, v in load_file(os.path.join(root, name)).items():
                assert k not in seen, f"{k} written twice"
                seen[k] = v
    assert set(seen) == set(m["tensors"])
    for k, v in seen.items():
        shape = tuple(m["tensors"][k]["shape"])
        assert torch.equal(v, full_value(k, shape, torch.float32)), k
    # bytes balanced: greedy largest-first gives max - min <= the largest piece
    per_rank = [0] * 4
    for name, f in m["files"].items():
        per_rank[f["rank"]] += f["size"]
    largest = max(t["pieces"][0]["byte_range"][1] - t["pieces"][0]["byte_range"][0] for t in m["tensors"].values())
    assert min(per_rank) > 0, per_rank
    assert max(per_rank) - min(per_rank) <= largest + 4096, per_rank


def _save_dtensor(rank, world, root, mesh_shape):
    import nostall
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    full = full_value("dt", (10, 6), torch.float32)  # 10 rows: uneven over 4
    placements = [Shard(0)] if len(mesh_shape) == 1 else [Replicate(), Shard(1)]
    dt = distribute_tensor(full, mesh, placements)
    rep = distribute_tensor(full_value("rep", (5,), torch.float32), mesh, [Replicate()] * len(mesh_shape))
    nostall.save({"dt": dt, "rep": rep}, root)
    m = json.load(open(os.path.join(root, "manifest.json")))
    return len(m["tensors"]["dt"]["pieces"]), len(m["tensors"]["rep"]["pieces"])


def _load_dtensor(rank, world, root, mesh_shape):
    import nostall
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(1)] if len(mesh_shape) == 1 else [Shard(0), Shard(1)]
    dt = distribute_tensor(torch.zeros(10, 6), mesh, placements)
    rep = distribute_tensor(torch.zeros(5), mesh, [Replicate()] * len(mesh_shape))
    nostall.load({"dt": dt, "rep": rep}, root)
    assert torch.equal(dt.full_tensor(), full_value("dt", (10, 6), torch.float32))
    assert torch.equal(rep.full_tensor(), full_value("rep", (5,), torch.float32))
    return True


def test_dtensor_roundtrip_and_reshard(tmp_path, pool2, pool4):
    root = str(tmp_path / "dt")
    # 4 ranks, 1-D mesh, Shard(0) of 10 rows: uneven pieces; replicated DTensor stored once
    assert pool4.run(_save_dtensor, root, (4,)) == [(4, 1)] * 4
    # load on a 2x2 mesh sharded on both dims, and on 2 ranks sharded on dim 1
    assert pool4.run(_load_dtensor, root, (2, 2)) == [True] * 4
    assert pool2.run(_load_dtensor, root, (2,)) == [True] * 2
    root2 = str(tmp_path / "dt2")
    # 2x2 mesh with Replicate on the first dim: replicas deduplicated
    assert pool4.run(_save_dtensor, root2, (2, 2)) == [(2, 1)] * 4
    assert pool2.run(_load_dtensor, root2, (2,)) == [True] * 2


def _byte_identical(rank, world, root):
    import nostall

    for name in ("x", "y"):
        nostall.save(make_state(rank, world, 2), os.path.join(root, name))
    with nostall.CheckpointManager(os.path.join(root, "m")) as mgr:
        mgr.save(5, make_state(rank, world, 2))
    return True


def test_resave_is_byte_identical(tmp_path, pool2):
    pool2.run(_byte_identical, str(tmp_path))
    x, y = tmp_path / "x", tmp_path / "y"
    names = sorted(os.listdir(x))
    assert names == sorted(os.listdir(y)) and "manifest.json" in names and len(names) == 3
    for n in names:
        assert (x / n).read_bytes() == (y / n).read_bytes(), n
    # the managed save's data files are the same bytes too
    for n in names:
        if n.endswith(".safetensors"):
            assert (tmp_path / "m" / "step_5" / n).read_bytes() == (x / n).read_bytes()
