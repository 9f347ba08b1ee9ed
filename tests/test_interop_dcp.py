"""PyTorch DCP interop: nostall checkpoints loaded through dcp.load with a nostall.dcp.Reader
(on other world sizes, into DTensors), and DCP checkpoints imported into the nostall format."""

from __future__ import annotations

import json
import os

import pytest
import torch

ROWS = (10, 6)  # 10 rows: uneven over 4 ranks


def full(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    base = (sum(map(ord, key)) % 89) * 1000
    return (torch.arange(n, dtype=torch.float64) + base).reshape(shape).to(dtype)


def _nostall_save_rows(rank, world, root):
    """nostall save on `world` ranks: row shards, a replicated tensor, JSON, a per-rank value."""
    import nostall

    w = full("w", ROWS)
    size = -(-ROWS[0] // world)
    lo, hi = rank * size, min(ROWS[0], (rank + 1) * size)
    state = {
        "model": {"w": nostall.ShardedTensor(w[lo:hi].clone(), ROWS, (lo, 0)),
                  "bias": full("bias", (6,), torch.bfloat16), "empty": torch.zeros(0, 3)},
        "optim": {"step": torch.tensor(7), "state": [full("m0", (3,)), full("m1", (2, 2))]},
        "trainer": {"epoch": 2, "lr": 0.25, "tags": ["a"]},
        "rng": nostall.PerRank(torch.full((3,), rank, dtype=torch.uint8)),
    }
    nostall.save(state, root)
    return True


def _template(plain: bool = True):
    return {
        "model": {"w": torch.zeros(ROWS), "bias": torch.zeros(6, dtype=torch.bfloat16), "empty": torch.ones(0, 3)},
        "optim": {"step": torch.tensor(0), "state": [torch.zeros(3), torch.zeros(2, 2)]},
        "trainer": {"epoch": 0, "lr": 0.0, "tags": []},
    }


def _check(state):
    assert torch.equal(state["model"]["bias"], full("bias", (6,), torch.bfloat16))
    assert torch.equal(state["optim"]["step"], torch.tensor(7))
    assert torch.equal(state["optim"]["state"][0], full("m0", (3,)))
    assert torch.equal(state["optim"]["state"][1], full("m1", (2, 2)))
    assert state["trainer"] == {"epoch": 2, "lr": 0.25, "tags": ["a"]}


def _dcp_load_dtensor(rank, world, root):
    """dcp.load on `world` ranks into DTensors sharded on rows, then on columns."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import nostall.dcp

    mesh = init_device_mesh("cpu", (world,))
    for placement in (Shard(0), Shard(1)):
        state = _template()
        state["model"]["w"] = distribute_tensor(torch.zeros(ROWS), mesh, [placement])
        dcp.load(state, storage_reader=nostall.dcp.Reader(root))
        assert torch.equal(state["model"]["w"].full_tensor(), full("w", ROWS)), placement
        _check(state)
    return True


def test_nostall_to_dcp_reader_other_world_sizes(tmp_path, pool2, pool4):
    import torch.distributed.checkpoint as dcp

    import nostall.dcp

    root = str(tmp_path / "ck")
    assert pool2.run(_nostall_save_rows, root) == [True, True]
    assert len(json.load(open(os.path.join(root, "manifest.json")))["tensors"]["model/w"]["pieces"]) == 2
    # 1 process (no process group): plain full tensors
    state = _template()
    dcp.load(state, storage_reader=nostall.dcp.Reader(root), no_dist=True)
    assert torch.equal(state["model"]["w"], full("w", ROWS))
    _check(state)
    # the path given as DCP's checkpoint_id instead
    state = _template()
    dcp.load(state, checkpoint_id=root, storage_reader=nostall.dcp.Reader(), no_dist=True)
    assert torch.equal(state["model"]["w"], full("w", ROWS))
    # 4 ranks, DTensor shards on rows and on columns
    assert pool4.run(_dcp_load_dtensor, root) == [True] * 4


def _why(e: BaseException) -> str:
    """DCP wraps each rank's exception in a CheckpointException: its text and the ranks' errors."""
    return f"{e} {getattr(e, 'failures', '')}"


def test_dcp_reader_errors(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    import nostall
    import nostall.dcp

    root = str(tmp_path / "ck")
    nostall.save({"w": full("w", (64, 64))}, root, block_size=4096)
    assert nostall.dcp.Reader.validate_checkpoint_id(root)
    assert not nostall.dcp.Reader.validate_checkpoint_id(str(tmp_path))
    with pytest.raises(CheckpointException) as e:
        dcp.load({"missing": torch.zeros(2)}, storage_reader=nostall.dcp.Reader(root), no_dist=True)
    assert "Missing key in checkpoint state_dict: missing" in _why(e.value)
    m = json.load(open(os.path.join(root, "manifest.json")))
    start = m["tensors"]["w"]["pieces"][0]["byte_range"][0]
    with open(os.path.join(root, "rank0.safetensors"), "r+b") as f:  # corrupt one byte of the 3rd block
        f.seek(start + 2 * 4096 + 5)
        b = f.read(1)
        f.seek(start + 2 * 4096 + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CheckpointException) as e:
        dcp.load({"w": torch.zeros(64, 64)}, storage_reader=nostall.dcp.Reader(root), no_dist=True)
    assert "CheckpointCorruptError" in _why(e.value) and "checksum mismatch" in _why(e.value)


def _dcp_save_dtensor(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {
        "model": {"w": distribute_tensor(full("w", ROWS), mesh, [Shard(0)]),
                  "emb": distribute_tensor(full("emb", (4, 8), torch.bfloat16), mesh, [Shard(1)]),
                  "bias": full("bias", (6,))},
        "optim": {"state": [full("m0", (3,)), full("m1", (2, 2))], "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "step": 11,
    }
    dcp.save(state, checkpoint_id=root)
    return True


def test_dcp_import_to_nostall(tmp_path, pool2):
    import nostall
    from nostall.interop.dcp import import_dcp

    src, dst = str(tmp_path / "dcp"), str(tmp_path / "ns")
    assert pool2.run(_dcp_save_dtensor, src) == [True, True]
    seen = []
    m = import_dcp(src, dst, block_size=4096, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert len(m.tensors["model/w"].pieces) == 2  # DCP chunks kept as pieces
    assert m.world_size == 1
    assert nostall.CheckpointManager  # noqa: B018  (package imports)
    from nostall.loading import check_checkpoint

    assert check_checkpoint(dst).ok
    tmpl = {
        "model": {"w": torch.zeros(ROWS), "emb": torch.zeros(4, 8, dtype=torch.bfloat16), "bias": torch.zeros(6)},
        "optim": {"state": [torch.zeros(3), torch.zeros(2, 2)], "param_groups": None},
        "step": 0,
    }
    out = nostall.load(tmpl, dst)
    assert torch.equal(out["model"]["w"], full("w", ROWS))
    assert torch.equal(out["model"]["emb"], full("emb", (4, 8), torch.bfloat16))
    assert torch.equal(out["model"]["bias"], full("bias", (6,)))
    assert torch.equal(out["optim"]["state"][1], full("m1", (2, 2)))
    assert out["optim"]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert out["step"] == 11
    # a region of the imported tensor, as a shard
    part = nostall.ShardedTensor(torch.zeros(3, 6), ROWS, (4, 0))
    nostall.load({"model": {"w": part}}, dst)
    assert torch.equal(part.data, full("w", ROWS)[4:7])


def test_dcp_import_refuses_non_json_values(tmp_path):
    import torch.distributed.checkpoint as dcp

    from nostall.errors import CheckpointLoadError
    from nostall.interop.dcp import import_dcp

    src = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(3), "odd": {1, 2}}, checkpoint_id=src, no_dist=True)
    with pytest.raises(CheckpointLoadError, match="'odd'"):
        import_dcp(src, str(tmp_path / "ns"))
    assert not os.path.exists(tmp_path / "ns")
    m = import_dcp(src, str(tmp_path / "ns"), unsupported_objects="skip")
    assert list(m.tensors) == ["w"] and m.objects == {}
