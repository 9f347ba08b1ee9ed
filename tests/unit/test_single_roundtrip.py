"""Single-process round trips: every kind of leaf, resharding, safetensors, determinism.

torch.distributed is never initialised here: nostall runs with its one-rank Comm.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

import nostall

NAN_PAYLOAD = torch.tensor([0x7FC00123, 0x7F800001 | 0x400000], dtype=torch.int32).view(torch.float32)

_INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (so NaN payloads and -0.0 compare exactly)."""
    t = t.detach().contiguous()
    if t.dtype in _INT_VIEW:
        return t.view(_INT_VIEW[t.dtype])
    return t


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    assert tuple(a.shape) == tuple(b.shape), (what, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b)), what


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def make_state() -> Dict[str, Any]:
    g = _gen()
    big = torch.randn(6, 10, generator=g)
    base = torch.randn(7, 5, generator=g, dtype=torch.float64)
    return {
        "dtypes": {
            "f32": torch.randn(5, 7, generator=g),
            "f16": torch.randn(4, 3, generator=g).to(torch.float16),
            "bf16": torch.randn(3, 9, generator=g).to(torch.bfloat16),
            "f64": torch.randn(11, generator=g, dtype=torch.float64),
            "i8": torch.randint(-128, 128, (13,), generator=g, dtype=torch.int8),
            "i16": torch.randint(-(2**15), 2**15, (2, 5), generator=g, dtype=torch.int16),
            "i32": torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=g, dtype=torch.int32),
            "i64": torch.tensor([-(2**63), 2**63 - 1, 0, 2**40 + 7], dtype=torch.int64),
            "u8": torch.randint(0, 256, (17,), generator=g, dtype=torch.uint8),
            "bool": torch.rand(3, 7, generator=g) > 0.5,
            "nan_inf": torch.cat([NAN_PAYLOAD, torch.tensor([math.inf, -math.inf, -0.0, 1.5])]),
        },
        "scalar_f": torch.tensor(3.25),
        "scalar_i": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty2d": torch.empty(3, 0, dtype=torch.int32),
        "transposed": big.t(),  # (10, 6), non-contiguous
        "sliced": base[1:6:2, ::2],  # non-contiguous, storage offset != 0
        "strided1d": torch.arange(40, dtype=torch.int16)[3::4],
        "narrowed": big[2:4],  # contiguous view with a storage offset
        "sharded": nostall.ShardedTensor(torch.randn(4, 3, generator=g), (4, 3), (0, 0)),
        "optim": {
            "state": {
                0: {"exp_avg": torch.randn(5, generator=g), "step": torch.tensor(10.0)},
                1: {"exp_avg": torch.randn(2, 2, generator=g), "step": torch.tensor(10.0)},
            },
            "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.999), "foreach": None}],
        },
        "list": [torch.arange(4), 5, "s", [torch.ones(2, dtype=torch.bool), None]],
        "tuple_t": (torch.full((2,), 9.0), "x"),
        "json": {
            "int": 3,
            "big_int": 2**62 + 1,
            "float": 0.25,
            "nan": math.nan,
            "inf": math.inf,
            "ninf": -math.inf,
            "str": "héllo/~0 \"quoted\"",
            "t": True,
            "f": False,
            "none": None,
            "nested": {"a": [1, [2, {"b": None}]], "c": {"d": "e"}},
            "tup": (1, 2, (3, "4")),
            "empty_list": [],
            "empty_dict": {},
        },
        "epoch": 4,
        "rng": nostall.PerRank(torch.get_rng_state()),
        "loader": nostall.PerRank({"epoch": 3, "t": torch.arange(3)}),
    }


def make_template(state: Any) -> Any:
    """Same structure as ``state``: tensors zeroed (same layout), JSON leaves None."""
    if isinstance(state, nostall.PerRank):
        return nostall.PerRank(make_template(state.value))
    if isinstance(state, nostall.ShardedTensor):
        return nostall.ShardedTensor(torch.zeros_like(state.data), state.global_shape, state.global_offset)
    if isinstance(state, torch.Tensor):
        if state.dim() == 2 and not state.is_contiguous() and state.stride() == (1, state.shape[0]):
            # a transposed template: filled through a non-contiguous view
            return torch.zeros(state.shape[1], state.shape[0], dtype=state.dtype).t()
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        if not _has_tensor(state):
            return None
        return {k: make_template(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        if not _has_tensor(state):
            return None
        out = [make_template(v) for v in state]
        return tuple(out) if isinstance(state, tuple) else out
    return None


def _has_tensor(v: Any) -> bool:
    if isinstance(v, (torch.Tensor, nostall.ShardedTensor, nostall.PerRank)):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x) for x in v)
    return False


def tensor_leaves(state: Any, prefix: str = "") -> Dict[str, torch.Tensor]:
    """key -> tensor (global value) for every tensor in ``state`` (keys as nostall makes them)."""
    out: Dict[str, torch.Tensor] = {}

    def rec(v: Any, key: str) -> None:
        if isinstance(v, nostall.PerRank):
            rec(v.value, key)
        elif isinstance(v, nostall.ShardedTensor):
            out[key] = v.data
        elif isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                rec(x, f"{key}/{k}" if key else str(k))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                rec(x, f"{key}/{i}" if key else str(i))

    rec(state, prefix)
    return out


def json_equal(a: Any, b: Any) -> bool:
    """Equality where tuples equal lists and NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _save(kind: str, tmp_path: Path, state: Any) -> Any:
    """Save with the manager or the one-shot API; returns a loader(template, **kw)."""
    if kind == "manager":
        mgr = nostall.CheckpointManager(tmp_path / "run")
        mgr.save(1, state)
        return lambda tpl, **kw: mgr.load(tpl, **kw)
    path = tmp_path / "ckpt"
    nostall.save(state, str(path))
    return lambda tpl, **kw: nostall.load(tpl, str(path), **kw)


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("kind", ["manager", "oneshot"])
def test_round_trip_every_leaf_kind(tmp_path: Path, kind: str) -> None:
    state = make_state()
    load = _save(kind, tmp_path, state)
    template = make_template(state)
    tpl_tensors = tensor_leaves(template)
    restored = load(template)

    # every tensor is bit-identical and was filled in place (same object as the template's)
    saved = tensor_leaves(state)
    got = tensor_leaves(restored)
    assert saved.keys() == got.keys() == tpl_tensors.keys()
    for k in saved:
        assert got[k] is tpl_tensors[k], k
        assert_bits_equal(got[k], saved[k], k)

    # containers: ShardedTensor object returned as is, tuples with tensors stay tuples
    assert restored["sharded"] is template["sharded"]
    assert isinstance(restored["tuple_t"], tuple)
    assert restored["tuple_t"][1] == "x"
    assert restored["transposed"].stride() == template["transposed"].stride()

    # int dict keys are preserved, JSON leaves come back as saved (tuples as lists)
    assert set(restored["optim"]["state"]) == {0, 1}
    assert restored["optim"]["param_groups"] == [
        {"lr": 0.1, "params": [0, 1], "betas": [0.9, 0.999], "foreach": None}
    ]
    assert restored["list"][1:3] == [5, "s"]
    assert restored["list"][3][1] is None
    assert restored["epoch"] == 4
    assert json_equal(restored["json"], state["json"])
    assert restored["json"]["tup"] == [1, 2, [3, "4"]]
    assert math.isnan(restored["json"]["nan"])
    assert restored["json"]["inf"] == math.inf and restored["json"]["ninf"] == -math.inf
    assert restored["json"]["big_int"] == 2**62 + 1 and isinstance(restored["json"]["big_int"], int)

    # PerRank values come back unwrapped
    assert not isinstance(restored["rng"], nostall.PerRank)
    assert isinstance(restored["rng"], torch.Tensor)
    assert torch.equal(restored["rng"], state["rng"].value)
    assert restored["rng"] is template["rng"].value
    assert restored["loader"]["epoch"] == 3
    assert torch.equal(restored["loader"]["t"], torch.arange(3))
    assert restored["loader"]["t"] is template["loader"].value["t"]


@pytest.mark.parametrize("kind", ["manager", "oneshot"])
def test_round_trip_per_rank_rng_state_restores_rng(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(99)
    state = {"rng": nostall.PerRank(torch.get_rng_state()), "w": torch.zeros(2)}
    expected = torch.rand(8)
    load = _save(kind, tmp_path, state)
    torch.manual_seed(0)
    restored = load({"rng": nostall.PerRank(torch.empty_like(state["rng"].value)), "w": torch.empty(2)})
    torch.set_rng_state(restored["rng"])
    assert torch.equal(torch.rand(8), expected)


@pytest.mark.parametrize("kind", ["manager", "oneshot"])
def test_round_trip_nn_module_state_dict_in_place(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    src.train()
    src(torch.randn(8, 4))  # moves BatchNorm running stats and num_batches_tracked
    opt = torch.optim.Adam(src.parameters(), lr=0.01)
    src(torch.randn(8, 4)).sum().backward()
    opt.step()
    state = {"model": src.state_dict(), "optim": opt.state_dict(), "step": 1}
    load = _save(kind, tmp_path, state)

    torch.manual_seed(1)
    dst = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    dst_opt = torch.optim.Adam(dst.parameters(), lr=0.5)
    dst(torch.randn(8, 4)).sum().backward()
    dst_opt.step()  # creates optimizer state of the right structure
    ptrs = {n: p.data_ptr() for n, p in dst.named_parameters()}
    params = dict(dst.named_parameters())
    sd = dst.state_dict()
    for n, p in src.named_parameters():
        assert not torch.equal(p, params[n])

    restored = load({"model": sd, "optim": dst_opt.state_dict(), "step": 0})
    for n, p in src.state_dict().items():
        assert torch.equal(dst.state_dict()[n], p), n
        assert restored["model"][n] is sd[n]
    for n, p in dst.named_parameters():
        assert p.data_ptr() == ptrs[n] and p is params[n]  # filled in place
    assert restored["step"] == 1
    dst_opt.load_state_dict(restored["optim"])
    assert dst_opt.param_groups[0]["lr"] == 0.01
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(dst_opt.state_dict()["state"][i][k], v), (i, k)


def test_load_into_noncontiguous_template_writes_through_to_base(tmp_path: Path) -> None:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    nostall.save({"w": w, "v": torch.arange(5.0)}, str(tmp_path / "c"))
    base = torch.zeros(6, 4)
    vbase = torch.full((10,), -1.0)
    restored = nostall.load({"w": base.t(), "v": vbase[::2]}, str(tmp_path / "c"))
    assert torch.equal(base, w.t())
    assert torch.equal(vbase[::2], torch.arange(5.0))
    assert torch.equal(vbase[1::2], torch.full((5,), -1.0))  # nothing written between the strides
    assert torch.equal(restored["w"], w)


# --------------------------------------------------------------------------- resharding


def _full_8x6(dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(48, dtype=torch.float64).reshape(8, 6) * 1.5 - 20).to(dtype)


SUB_BOXES = [
    ("rows2-5_cols1-4", (2, 1), (4, 3)),
    ("single_row", (5, 0), (1, 6)),
    ("single_col", (0, 4), (8, 1)),
    ("corner_element", (7, 5), (1, 1)),
    ("whole", (0, 0), (8, 6)),
]


@pytest.mark.parametrize("saved_as", ["sharded", "plain"])
@pytest.mark.parametrize("block_size", [8, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.float64])
def test_reshard_8x6_into_sub_boxes(tmp_path: Path, dtype: torch.dtype, block_size: int, saved_as: str) -> None:
    full = _full_8x6(dtype)
    leaf = nostall.ShardedTensor(full.clone(), (8, 6), (0, 0)) if saved_as == "sharded" else full.clone()
    mgr = nostall.CheckpointManager(tmp_path, block_size=block_size)
    mgr.save(0, {"w": leaf})
    for name, off, shape in SUB_BOXES:
        tpl = nostall.ShardedTensor(torch.full(shape, 99, dtype=dtype), (8, 6), off)
        out = mgr.load({"w": tpl})
        expect = full[off[0] : off[0] + shape[0], off[1] : off[1] + shape[1]]
        assert out["w"] is tpl
        assert torch.equal(tpl.data, expect), name
    plain = torch.zeros(8, 6, dtype=dtype)
    mgr.load({"w": plain})
    assert torch.equal(plain, full)


def test_reshard_large_1d_middle_slice(tmp_path: Path) -> None:
    n = 3_000_000
    full = torch.arange(n, dtype=torch.float32)
    mgr = nostall.CheckpointManager(tmp_path, block_size=4096)
    mgr.save(7, {"big": nostall.ShardedTensor(full, (n,), (0,))})
    for off, length in [(1_234_567, 1_000_001), (1023, 1), (n - 5, 5), (0, 1024)]:
        tpl = nostall.ShardedTensor(torch.zeros(length), (n,), (off,))
        mgr.load({"big": tpl})
        assert torch.equal(tpl.data, full[off : off + length]), (off, length)
    whole = torch.zeros(n)
    mgr.load({"big": whole})
    assert torch.equal(whole, full)


# --------------------------------------------------------------------------- safetensors


def _data_files(path: Path):
    files = sorted(path.glob("*.safetensors"))
    assert files, f"no data files in {path}"
    return files


@pytest.mark.parametrize("kind", ["manager", "oneshot"])
def test_data_files_are_readable_safetensors(tmp_path: Path, kind: str) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    state = make_state()
    if kind == "manager":
        mgr = nostall.CheckpointManager(tmp_path / "run")
        ckpt = Path(mgr.save(3, state).path)
    else:
        ckpt = tmp_path / "ckpt"
        nostall.save(state, str(ckpt))
    expected = {k: v.contiguous() for k, v in tensor_leaves(state).items()}

    seen: Dict[str, torch.Tensor] = {}
    for f in _data_files(ckpt):
        loaded = safetensors_torch.load_file(str(f))
        with safe_open(str(f), framework="pt") as sf:
            assert sorted(sf.keys()) == sorted(loaded)
            meta = sf.metadata()
            assert meta is not None and meta.get("format") == "nostall"
            for name in sf.keys():
                assert_bits_equal(sf.get_tensor(name), loaded[name], name)
        for name, t in loaded.items():
            assert name not in seen, f"{name} stored twice"
            seen[name] = t
    assert sorted(seen) == sorted(expected)
    for k, t in expected.items():
        assert_bits_equal(seen[k], t, k)


def test_data_file_with_key_named_dunder_metadata(tmp_path: Path) -> None:
    """A tensor key that collides with the safetensors ``__metadata__`` entry.

    Either save rejects the key up front, or the checkpoint is a valid
    safetensors file that ``nostall verify`` accepts and that loads back.
    """
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from nostall.tools.cli import main

    state = {"__metadata__": torch.arange(4.0), "w": torch.ones(3)}
    path = tmp_path / "c"
    try:
        nostall.save(state, str(path))
    except nostall.InvalidStateError as e:
        assert "__metadata__" in str(e)
        return
    assert main(["verify", str(path)]) == 0
    for f in _data_files(path):
        loaded = safetensors_torch.load_file(str(f))
        assert torch.equal(loaded["w"], state["w"])
    tpl = {"__metadata__": torch.zeros(4), "w": torch.zeros(3)}
    nostall.load(tpl, str(path))
    assert torch.equal(tpl["__metadata__"], state["__metadata__"])


# --------------------------------------------------------------------------- determinism


def _tree_bytes(root: Path) -> Dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_saving_twice_gives_byte_identical_directories(tmp_path: Path) -> None:
    state = make_state()
    nostall.save(state, str(tmp_path / "a"))
    nostall.save(state, str(tmp_path / "b"))
    a, b = _tree_bytes(tmp_path / "a"), _tree_bytes(tmp_path / "b")
    assert "manifest.json" in a
    assert any(n.endswith(".safetensors") for n in a)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name


def test_resaving_one_shot_path_replaces_it(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    nostall.save({"w": torch.zeros(3), "n": 1}, path)
    nostall.save({"w": torch.ones(3), "n": 2}, path)
    out = nostall.load({"w": torch.empty(3), "n": None}, path)
    assert torch.equal(out["w"], torch.ones(3)) and out["n"] == 2
    assert sorted(os.listdir(path)) == ["manifest.json", "rank0.safetensors"]
