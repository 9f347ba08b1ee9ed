"""Strict loads on 2 gloo ranks: DTensor keys, PerRank entries that differ per rank, another world size."""

from __future__ import annotations

import torch

from tests.dist_harness import RankPool


def _save_and_load(rank, world, root):
    import nostall
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(32.0).reshape(8, 4)
    # rank 0's PerRank value holds a tensor more than rank 1's: each rank's entries are its own
    mine = {"gen": torch.full((2,), float(rank))}
    if rank == 0:
        mine["aux"] = torch.ones(3)
    nostall.save({"emb": distribute_tensor(full, mesh, [Shard(0)]),
                  "head": distribute_tensor(full * 2, mesh, [Shard(0)]), "pos": nostall.PerRank(mine)}, root)

    def zeros() -> DTensor:
        return distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])

    out = {}
    try:
        nostall.load({"emb": zeros(), "pos": nostall.PerRank({"gen": torch.zeros(2), "aux": torch.zeros(3)})}, root)
        out["no_head"] = None
    except nostall.CheckpointLoadError as e:
        out["no_head"] = str(e)
    try:
        nostall.load({"emb": zeros(), "head": zeros(), "pos": nostall.PerRank({"gen": torch.zeros(2)})}, root)
        out["per_rank"] = None
    except nostall.CheckpointLoadError as e:
        out["per_rank"] = str(e)
    emb = zeros()
    nostall.load({"emb": emb}, root, strict=False)
    out["emb_equal"] = torch.equal(emb.to_local(), full[4 * rank: 4 * rank + 4])
    return out


def test_strict_loads_on_two_ranks(pool2: RankPool, tmp_path):
    import nostall

    root = str(tmp_path / "ck")
    out = pool2.run(_save_and_load, root)
    for o in out:
        assert o["no_head"] is not None and "unexpected key(s)" in o["no_head"] and "['head']" in o["no_head"]
        assert o["emb_equal"]
    # rank 0 saved pos/aux, which its template leaves out; rank 1 saved none
    assert out[0]["per_rank"] is not None and "['pos/aux']" in out[0]["per_rank"]
    assert out[1]["per_rank"] is None
    # on another world size PerRank entries cannot be restored, so leaving them out is no error
    emb, head = torch.zeros(8, 4), torch.zeros(8, 4)
    nostall.load({"emb": emb, "head": head}, root)
    assert torch.equal(head, torch.arange(32.0).reshape(8, 4) * 2)
