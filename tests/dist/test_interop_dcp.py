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
    from nostall.loading.verify import check_checkpoint

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
    nostall.load({"model": {"w": part}}, dst, strict=False)
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


# --------------------------------------------------------------------------- DCP names of non-tensor values


def _model_and_adamw(lrs, betas, weight_decays, seed=0):
    """A 3-layer model and an AdamW with one param group per layer, after one step (state filled)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    groups = [{"params": list(layer.parameters()), "lr": lr, "betas": b, "weight_decay": wd}
              for layer, lr, b, wd in zip(model, lrs, betas, weight_decays)]
    opt = torch.optim.AdamW(groups)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _no_pre_2_4_fallback(monkeypatch):
    """Make DCP's fallback for pre-2.4 checkpoints (DefaultLoadPlanner.create_local_plan
    re-flattening the state the 2.3 way) fail the load if it is ever taken."""
    from torch.distributed.checkpoint import _nested_dict

    def refuse(*args, **kwargs):
        raise AssertionError("DCP took its fallback for pre-2.4 checkpoints")

    monkeypatch.setattr(_nested_dict, "traverse_state_dict_v_2_3", refuse)


def _dcp_names(state):
    """The names dcp.load asks for: DCP's own flattening of the state."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return set(flatten_state_dict(state)[0])


def _same(a, b, where="") -> None:
    """Equal values of equal types (tensors: equal dtype and elements), recursively."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b) or set(a) == set(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
def test_dcp_reader_offers_flattened_optimizer_names(tmp_path, monkeypatch, tensor_lr):
    """The reader names param_groups' values as torch >= 2.4 flattens them (optim.param_groups.0.lr, ...),
    so dcp.load finds every name directly, and restores lr, betas (a tuple), weight_decay exactly."""
    import torch.distributed.checkpoint as dcp

    import nostall
    import nostall.dcp

    lr0 = torch.tensor(0.01) if tensor_lr else 0.01
    model, opt = _model_and_adamw([lr0, 0.02, 0.003], [(0.9, 0.999), (0.8, 0.95), (0.5, 0.6)], [0.01, 0.1, 0.0])
    saved = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        # tensor-free containers next to the optimizer: with the pre-2.4 names, DCP's fallback asked for
        # 'trainer' as one item, which the reader did not offer
        "trainer": {"epoch": 3, "lr": 0.25, "tags": ["a", "b"], "best": None, "history": [{"loss": 1.5}, {"loss": 0.5}],
                    "grid": [[1, 2], [3]], "mixed": [[{"k": "v"}], [4]], "none_yet": [], "name": "run"},
    }
    root = str(tmp_path / "ck")
    nostall.save(saved, root)
    names = set(nostall.dcp.Reader(root).read_metadata().state_dict_metadata)
    assert names == _dcp_names(saved)
    assert {"optim.param_groups.0.lr", "optim.param_groups.1.betas", "optim.param_groups.2.weight_decay",
            "optim.param_groups.2.params", "trainer.history.1.loss", "trainer.mixed.0.0.k", "trainer.mixed.1",
            "trainer.grid", "trainer.none_yet"} <= names
    assert "optim.param_groups" not in names and "trainer" not in names

    _no_pre_2_4_fallback(monkeypatch)
    lr_fresh = torch.tensor(0.5) if tensor_lr else 0.5
    model2, opt2 = _model_and_adamw([lr_fresh, 0.5, 0.5], [(0.1, 0.2)] * 3, [0.7] * 3, seed=1)
    state = {"model": model2.state_dict(), "optim": opt2.state_dict(),
             "trainer": {"epoch": 0, "lr": 0.0, "tags": [], "best": 1.0, "history": [{"loss": 0.0}, {"loss": 0.0}],
                         "grid": [], "mixed": [[{"k": ""}], []], "none_yet": [1], "name": ""}}
    assert _dcp_names(state) == names  # the same structure asks for the same names: nothing left over
    dcp.load(state, storage_reader=nostall.dcp.Reader(root), no_dist=True)
    _same(state["optim"]["param_groups"], saved["optim"]["param_groups"], "param_groups")
    _same(state["optim"]["state"], saved["optim"]["state"], "state")
    _same(state["model"], saved["model"], "model")
    _same(state["trainer"], saved["trainer"], "trainer")
    # and into the fresh optimizer itself
    opt2.load_state_dict(state["optim"])
    for got, want in zip(opt2.param_groups, opt.param_groups):
        for k in ("lr", "betas", "weight_decay", "eps"):
            _same(got[k], want[k], k)


def test_dcp_reader_get_state_dict_output(tmp_path, monkeypatch):
    """get_state_dict(model, optimizer) output (optimizer state keyed by parameter name) saved with
    nostall loads through dcp.load into a fresh model's and optimizer's, every name found directly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import nostall
    import nostall.dcp

    model, opt = _model_and_adamw([0.01, 0.02, 0.003], [(0.9, 0.999), (0.8, 0.95), (0.5, 0.6)], [0.01, 0.1, 0.0])
    msd, osd = get_state_dict(model, opt)
    assert "0.weight" in osd["state"] and osd["param_groups"][0]["params"] == ["0.weight", "0.bias"]
    saved = {"model": msd, "optim": osd}
    root = str(tmp_path / "ck")
    nostall.save(saved, root)
    names = set(nostall.dcp.Reader(root).read_metadata().state_dict_metadata)
    assert names == _dcp_names(saved)
    assert {"optim.param_groups.1.lr", "optim.param_groups.1.params", "optim.state.0.weight.exp_avg"} <= names

    _no_pre_2_4_fallback(monkeypatch)
    model2, opt2 = _model_and_adamw([0.5] * 3, [(0.1, 0.2)] * 3, [0.7] * 3, seed=1)
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, storage_reader=nostall.dcp.Reader(root), no_dist=True)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _same(opt2.state_dict(), opt.state_dict(), "optimizer")
    _same(model2.state_dict(), model.state_dict(), "model")


def test_dcp_leaves_follow_dcp_flattening():
    """dcp_leaves names a JSON value's items as DCP's own flattening of the same value does."""
    from nostall.dcp import dcp_leaves

    value = {"a": [{"x": 1}, {"y": [1, 2]}, 3], "b": [[1, 2], [3]], "c": [[{"z": None}], [4]], "d": [], "e": {},
             "f": "s", "g": [1.5, None, "t"], "h": {"i": {"j": [[[{"k": 0}]]]}}, "1": True}
    leaves = dcp_leaves("top", value)
    assert set(leaves) == _dcp_names({"top": value})
    assert leaves["top.a.2"] == 3 and leaves["top.b"] == [[1, 2], [3]] and leaves["top.d"] == []
    assert leaves["top.h.i.j.0.0.0.k"] == 0 and leaves["top.1"] is True
    assert not any(k.startswith("top.e") for k in leaves)  # an empty dict has no item (DCP saves none either)


def test_dcp_reader_refuses_duplicate_names(tmp_path):
    """Two values that DCP would name alike are refused (DCP itself refuses such a state)."""
    import nostall
    import nostall.dcp
    from nostall.errors import CheckpointLoadError

    root = str(tmp_path / "ck")
    nostall.save({"t": {"a.b": 1, "a": {"b": 2}}}, root)
    with pytest.raises(CheckpointLoadError, match="'t.a.b' comes twice from 't'"):
        nostall.dcp.Reader(root).read_metadata()
    with pytest.raises(ValueError, match="'t.a.b'"):
        nostall.dcp.dcp_leaves("t", {"a.b": 1, "a": {"b": 2}})
