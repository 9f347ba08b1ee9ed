"""Export to safetensors / torch.save: consolidated full tensors from sharded checkpoints,
file sharding with an index, key selection, dtype casts, region-by-region streaming, and
the memory limit measured on a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch

import nostall
from nostall.errors import CheckpointLoadError, CheckpointSaveError
from nostall.interop.export import export


def full(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    base = (sum(map(ord, key)) % 89) * 1000
    return (torch.arange(n, dtype=torch.float64) + base).reshape(shape).to(dtype)


COLS = (12, 40)  # sharded on columns over the ranks


def _save_sharded(rank, world, root):
    size = COLS[1] // world
    state = {
        "model": {"col.weight": nostall.ShardedTensor(full("col", COLS)[:, rank * size:(rank + 1) * size].clone(),
                                                      COLS, (0, rank * size)),
                  "norm": full("norm", (40,), torch.bfloat16),
                  "ids": torch.arange(30, dtype=torch.int64)},
        "optim": {"exp_avg": nostall.ShardedTensor(full("ea", (8, 8))[rank * 4:(rank + 1) * 4].clone(), (8, 8),
                                                   (rank * 4, 0))},
        "trainer": {"step": 3},
    }
    nostall.save(state, root, block_size=256)
    return True


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory, rank_pools):
    root = str(tmp_path_factory.mktemp("exp") / "ck")
    assert rank_pools.get(2).run(_save_sharded, root) == [True, True]
    return root


def test_safetensors_sharded_files_index_and_values(sharded_ckpt, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = str(tmp_path / "hf")
    rep = export(sharded_ckpt, out, max_shard_size=1200)
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) == 2 and all(f.startswith("model-0000") for f in shards)  # col.weight alone: 1920 B
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    want = {"model.col.weight": full("col", COLS), "model.norm": full("norm", (40,), torch.bfloat16),
            "model.ids": torch.arange(30), "optim.exp_avg": full("ea", (8, 8))}
    assert set(index["weight_map"]) == set(want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values()) == rep.bytes
    got = {}
    for f in shards:
        with safe_open(os.path.join(out, f), framework="pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            for k in sf.keys():
                assert index["weight_map"][k] == f
        got.update(load_file(os.path.join(out, f)))
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    for f in shards:  # no file over the limit unless it holds one tensor bigger than it
        size = os.path.getsize(os.path.join(out, f))
        assert size <= 1200 + 1024 or len(load_file(os.path.join(out, f))) == 1


def test_select_keys_strip_prefix_cast_single_file(sharded_ckpt, tmp_path):
    from safetensors.torch import load_file

    out = str(tmp_path / "m")
    export(sharded_ckpt, out, keys=["model"], strip_prefix="model", dtype="bf16")
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # one file: no index
    got = load_file(os.path.join(out, "model.safetensors"))
    assert set(got) == {"col.weight", "norm", "ids"}
    assert torch.equal(got["col.weight"], full("col", COLS).to(torch.bfloat16))
    assert got["ids"].dtype == torch.int64  # casts apply to floating point only
    out2 = str(tmp_path / "g")
    export(sharded_ckpt, out2, keys=["*/exp_avg"], separator="/")
    assert set(load_file(os.path.join(out2, "model.safetensors"))) == {"optim/exp_avg"}
    with pytest.raises(CheckpointLoadError, match="matches"):
        export(sharded_ckpt, str(tmp_path / "none"), keys=["nope"])
    with pytest.raises(CheckpointSaveError, match="not empty"):
        export(sharded_ckpt, out)


def test_torch_file(sharded_ckpt, tmp_path):
    out = str(tmp_path / "m.pt")
    export(sharded_ckpt, out, to="torch", dtype="fp64")
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["model.col.weight"], full("col", COLS).double())
    assert torch.equal(got["model.norm"], full("norm", (40,), torch.bfloat16).double())
    assert torch.equal(got["model.ids"], torch.arange(30))
    assert zipfile.ZipFile(out).testzip() is None  # every record's CRC is right
    mm = torch.load(out, weights_only=True, mmap=True)
    assert torch.equal(mm["optim.exp_avg"], full("ea", (8, 8)).double())


def test_streams_regions_smaller_than_a_row(tmp_path):
    """A limit far below one row: the tensor is written element runs at a time, still exact."""
    from safetensors.torch import load_file

    src = str(tmp_path / "ck")
    t = full("t", (3, 5, 7), torch.float64)
    nostall.save({"t": t, "u": full("u", (9,), torch.float16)}, src, block_size=8)
    rep = export(src, str(tmp_path / "o"), memory_limit=96)
    assert torch.equal(load_file(os.path.join(tmp_path / "o", "model.safetensors"))["t"], t)
    assert rep.peak_buffer_bytes <= 96
    export(src, str(tmp_path / "o.pt"), to="torch", memory_limit=96, dtype="fp32")
    assert torch.equal(torch.load(str(tmp_path / "o.pt"), weights_only=True)["t"], t.float())
    with pytest.raises(CheckpointLoadError, match="too small"):
        export(src, str(tmp_path / "x"), memory_limit=20)
    assert not os.path.exists(tmp_path / "x")


_MEASURE = r"""
import json, os, resource, sys
import torch
from nostall.interop.export import export

def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:  # Linux: VmHWM := VmRSS
        f.write("5")

src, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
res = {}
for to, dst in (("safetensors", out + "/st"), ("torch", out + "/m.pt")):
    reset_peak()
    base = rss("VmRSS")
    rep = export(src, dst, to=to, memory_limit=limit)
    res[to] = {"delta": rss("VmHWM") - base, "peak_buffer": rep.peak_buffer_bytes}
print(json.dumps(res))
"""


def _measure(src: str, out: str, limit: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _MEASURE, src, out, str(limit)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_export_larger_than_memory_limit_stays_within_it(tmp_path):
    """96 MiB of tensors (one of 64 MiB) exported with a 16 MiB limit: the exporting
    process's resident memory grows by less than the limit (plus a little slack), while the
    same export with an unbounded limit grows by at least the biggest tensor -- so the
    measurement does see the buffers."""
    src = str(tmp_path / "big")
    big = torch.arange(4096 * 4096, dtype=torch.float32).reshape(4096, 4096)
    nostall.save({"model": {"big": big, "mid": torch.ones(2048, 2048, dtype=torch.float64)}}, src,
                 block_size=1 << 20)
    del big
    limit = 16 << 20
    slack = 6 << 20
    (tmp_path / "b").mkdir()
    bounded = _measure(src, str(tmp_path / "b"), limit)
    for to, r in bounded.items():
        assert r["peak_buffer"] <= limit, (to, r)
        assert r["delta"] <= limit + slack, (to, r)
    (tmp_path / "u").mkdir()
    unbounded = _measure(src, str(tmp_path / "u"), 1 << 30)
    for to, r in unbounded.items():
        assert r["delta"] >= 64 << 20, (to, r)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "b" / "st" / "model.safetensors"), framework="pt") as f:
        row = f.get_slice("model.big")[4095:4096]
    assert torch.equal(row, torch.arange(4095 * 4096, 4096 * 4096, dtype=torch.float32).reshape(1, 4096))
