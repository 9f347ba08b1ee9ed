"""Edge layouts on real gloo groups: empty shards (FSDP2 with more ranks than rows)."""

from __future__ import annotations

import os

import torch

from tests.dist_harness import run_ranks


def _empty_shards(rank, world, root):
    import nostall
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    small = torch.arange(6.0).reshape(2, 3)  # 2 rows over 4 ranks: ranks 2 and 3 hold nothing
    dt = distribute_tensor(small, mesh, [Shard(0)])
    rows = 1 if rank == 0 else 0
    st = nostall.ShardedTensor(torch.ones(rows, 4) * 7, (1, 4), (rank if rows else 1, 0))
    nostall.save({"dt": dt, "st": st}, os.path.join(root, "ck"))
    # load back into a replicated full tensor and into the same layout
    full = {"dt": torch.zeros(2, 3), "st": torch.zeros(1, 4)}
    nostall.load(full, os.path.join(root, "ck"))
    assert torch.equal(full["dt"], small) and torch.equal(full["st"], torch.ones(1, 4) * 7)
    dt2 = distribute_tensor(torch.zeros(2, 3), mesh, [Shard(0)])
    nostall.load({"dt": dt2, "st": nostall.ShardedTensor(torch.zeros(rows, 4), (1, 4), (rank if rows else 1, 0))},
                 os.path.join(root, "ck"))
    assert torch.equal(dt2.full_tensor(), small)
    return True


def test_empty_shards_are_saved_and_loaded(tmp_path):
    assert run_ranks(4, _empty_shards, str(tmp_path)) == [True] * 4


def _strided(rank, world, root):
    """FSDP2 over TP on the same dim (torchtitan 2-D): a _StridedShard placement."""
    import nostall
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_coordinate()
    full = torch.arange(16.0).reshape(8, 2)
    # TP shards rows in two halves; FSDP then splits each half in two
    local = full[tp * 4 + dp * 2 : tp * 4 + dp * 2 + 2].clone()
    dt = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2), Shard(0)], shape=(8, 2), stride=(2, 1))
    assert torch.equal(dt.full_tensor(), full)  # the layout is what FSDP2+TP builds
    nostall.save({"w": dt}, os.path.join(root, "ck"))
    out = {"w": torch.zeros(8, 2)}
    nostall.load(out, os.path.join(root, "ck"))
    assert torch.equal(out["w"], full)
    back = DTensor.from_local(torch.zeros(2, 2), mesh, [_StridedShard(0, split_factor=2), Shard(0)], shape=(8, 2), stride=(2, 1))
    nostall.load({"w": back}, os.path.join(root, "ck"))
    assert torch.equal(back.to_local(), local)
    return True


def test_fsdp2_over_tp_strided_shards(tmp_path):
    assert run_ranks(4, _strided, str(tmp_path)) == [True] * 4
