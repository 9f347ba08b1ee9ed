"""Megatron-core adapter: real megatron-core ShardedTensor / ShardedObject / factories
round-tripped through nostall, across tensor-, pipeline- (layers) and data-parallel
layouts, including flattened ranges (the distributed optimizer's layout)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing.mapping",
                    reason="megatron-core is not installed (pip install 'nostall[megatron]')")

L = 3  # layers, stacked on a prepended axis
EMB = "embedding.word_embeddings.weight"
QKV = "decoder.layers.self_attention.linear_qkv.weight"
FC1 = "decoder.final_fc1.weight"  # SwiGLU-style factory: rows [W; V]
NORM = "decoder.final_layernorm.weight"
OPT = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"
SHAPES = {EMB: (16, 8), QKV: (12, 8), FC1: (16, 4), NORM: (8,)}
# data-parallel split points of each flattened chunk, as fractions of its elements
SPLIT_A = {1: [0.0, 1.0], 2: [0.0, 0.3, 1.0], 3: [0.0, 0.2, 0.7, 1.0]}
SPLIT_B = {1: [0.0, 1.0], 2: [0.0, 0.5, 1.0], 3: [0.0, 0.45, 0.5, 1.0]}


def full(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    base = (sum(map(ord, key)) % 89) * 1000
    return (torch.arange(n, dtype=torch.float64) + base).reshape(shape).to(dtype)


def _ranges(n: int, dp: int, split):
    cuts = [int(round(f * n)) for f in split[dp]]
    return [(cuts[i], cuts[i + 1]) for i in range(dp)]


def make_state(rank: int, tp: int, dp: int, *, zeros: bool = False, split=SPLIT_A, objects: bool = True):
    """The sharded state dict of `rank` in a TP x DP layout (rank = dp_rank * tp + tp_rank)."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory)

    tp_rank, dp_rank = rank % tp, rank // tp
    world = tp * dp

    def local(t):
        return torch.zeros_like(t) if zeros else t.clone()

    sd = {}
    emb = full(EMB, SHAPES[EMB]).chunk(tp)[tp_rank]
    sd[EMB] = ShardedTensor.from_rank_offsets(EMB, local(emb), (0, tp_rank, tp), replica_id=dp_rank)
    qkv_full = full(QKV, (L,) + SHAPES[QKV])
    for layer in range(L):
        part = qkv_full[layer].chunk(tp)[tp_rank]
        sd[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"] = ShardedTensor.from_rank_offsets(
            QKV, local(part), (0, layer, L), (1, tp_rank, tp), replica_id=dp_rank, prepend_axis_num=1)
        # distributed optimizer: this DP rank's range of the flattened TP chunk of the layer
        exp_avg = full(OPT, (L,) + SHAPES[QKV])[layer].chunk(tp)[tp_rank]
        a, b = _ranges(exp_avg.numel(), dp, split)[dp_rank]
        st = ShardedTensor.from_rank_offsets(OPT, local(exp_avg), (0, layer, L), (1, tp_rank, tp),
                                             replica_id=0, prepend_axis_num=1)
        # megatron-core <= 0.15 builds these with from_rank_offsets_flat; >= 0.16 refuses
        # flattened_range at construction, so set it the way those versions left it
        st.data = st.data.flatten()[a:b]
        st.flattened_range = slice(a, b)
        sd[f"optimizer.state.{layer}.exp_avg"] = st
    w, v = full(FC1, SHAPES[FC1]).chunk(2)
    fc1_local = torch.cat([w.chunk(tp)[tp_rank], v.chunk(tp)[tp_rank]])

    def build(key, data, replica_id, flattened_range):
        wl, vl = data.chunk(2)
        return {"w": ShardedTensor.from_rank_offsets(key, wl, (0, tp_rank, 2 * tp), replica_id=replica_id),
                "v": ShardedTensor.from_rank_offsets(key, vl, (0, tp + tp_rank, 2 * tp), replica_id=replica_id)}

    def merge(sub):
        return torch.cat([sub["w"], sub["v"]])

    sd[FC1] = ShardedTensorFactory(FC1, local(fc1_local), build, merge, replica_id=dp_rank)
    sd[NORM] = ShardedTensor.from_rank_offsets(NORM, local(full(NORM, SHAPES[NORM])), replica_id=rank)
    if objects:
        sd["rng_state"] = ShardedObject("rng_state", None if zeros else {"seed": 1000 + rank, "pair": (rank, 1)},
                                        (world,), (rank,), replica_id=0)
        sd["data_loader"] = ShardedObject("data_loader", (0, 0) if zeros else (7, 8), (1,), (0,), replica_id=rank)
    sd["local_only"] = LocalNonpersistentObject(f"local-{rank}")
    if not zeros:
        sd["iteration"] = 42
        sd["args"] = {"lr": 0.5, "names": ["a", "b"]}
        sd["common_tensor"] = torch.arange(5)
    return sd


def check_loaded(out, rank: int, tp: int, dp: int, *, split=SPLIT_A, objects: bool = True):
    tp_rank, dp_rank = rank % tp, rank // tp
    assert torch.equal(out[EMB], full(EMB, SHAPES[EMB]).chunk(tp)[tp_rank]), (rank, EMB)
    for layer in range(L):
        want = full(QKV, (L,) + SHAPES[QKV])[layer].chunk(tp)[tp_rank]
        assert torch.equal(out[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"], want), (rank, layer)
        chunk = full(OPT, (L,) + SHAPES[QKV])[layer].chunk(tp)[tp_rank]
        a, b = _ranges(chunk.numel(), dp, split)[dp_rank]
        assert torch.equal(out[f"optimizer.state.{layer}.exp_avg"], chunk.flatten()[a:b]), (rank, layer, a, b)
    w, v = full(FC1, SHAPES[FC1]).chunk(2)
    assert torch.equal(out[FC1], torch.cat([w.chunk(tp)[tp_rank], v.chunk(tp)[tp_rank]])), rank
    assert torch.equal(out[NORM], full(NORM, SHAPES[NORM]))
    if objects:
        assert out["rng_state"] == {"seed": 1000 + rank, "pair": [rank, 1]}
        assert out["data_loader"] == (7, 8)  # restored as the template's tuple
    assert out["local_only"] == f"local-{rank}"
    assert out["iteration"] == 42 and out["args"] == {"lr": 0.5, "names": ["a", "b"]}
    assert torch.equal(out["common_tensor"], torch.arange(5))


def _save_and_reload(rank, world, root, tp):
    from nostall.interop import megatron

    dp = world // tp
    megatron.save(make_state(rank, tp, dp), root)
    tmpl = make_state(rank, tp, dp, zeros=True)
    out = megatron.load(tmpl, root)
    check_loaded(out, rank, tp, dp)
    # loaded in place: the template's tensors hold the values
    assert torch.equal(tmpl[EMB].data, out[EMB])
    return True


def test_megatron_roundtrip_tp2_dp2_then_other_layouts(tmp_path, pool4):
    """Saved on 4 ranks (TP=2 x DP=2, 3 layers on a prepended axis, a factory, flattened
    optimizer ranges); loaded back on the same layout, then on TP=1/DP=1, TP=1 x DP=3,
    TP=4 and TP=2 x DP=2 with another data-parallel split."""
    import json

    from nostall.interop import megatron

    root = str(tmp_path / "mg")
    assert pool4.run(_save_and_reload, root, 2) == [True] * 4
    m = json.load(open(os.path.join(root, "manifest.json")))
    # one tensor per layer, TP-sharded; a flattened state is stored as grid + (chunk elements,)
    assert m["tensors"][f"{QKV}/1"]["shape"] == [12, 8]
    assert m["tensors"][f"{OPT}/2"]["shape"] == [2, 1, 48]  # grid (2, 1) x 6*8 elements
    assert len(m["tensors"][f"{OPT}/2"]["pieces"]) == 4  # 2 TP chunks x 2 DP ranges
    assert sorted(k for k in m["tensors"] if k.startswith(FC1)) == [f"{FC1}/@0,0", f"{FC1}/@12,0",
                                                                    f"{FC1}/@4,0", f"{FC1}/@8,0"]
    # loads are not collective: emulate every rank of other layouts in this process
    for tp, dp, split in [(1, 1, SPLIT_A), (1, 3, SPLIT_B), (4, 1, SPLIT_A), (2, 2, SPLIT_B)]:
        for rank in range(tp * dp):
            same_world = tp * dp == 4
            tmpl = make_state(rank, tp, dp, zeros=True, split=split, objects=same_world)
            out = megatron.load(tmpl, root)
            check_loaded(out, rank, tp, dp, split=split, objects=same_world)


def test_megatron_single_process_and_full_template(tmp_path):
    """World size 1: every layer and both factory boxes on one rank; loaded as TP=2 ranks
    and into plain full-size (non-flattened) optimizer templates."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from nostall.interop import megatron

    root = str(tmp_path / "one")
    stats = megatron.save(make_state(0, 1, 1), root)
    assert stats.bytes_written > 0
    for rank in range(2):
        check_loaded(megatron.load(make_state(rank, 2, 1, zeros=True, objects=False), root), rank, 2, 1,
                     objects=False)
    # the optimizer state of layer 1 as one full, un-flattened tensor
    t = ShardedTensor.from_rank_offsets(OPT, torch.zeros(SHAPES[QKV]), (0, 1, L), prepend_axis_num=1)
    out = megatron.load({"x": t}, root)
    assert torch.equal(out["x"], full(OPT, (L,) + SHAPES[QKV])[1])


def test_megatron_errors(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    import nostall
    from nostall.interop import megatron

    bad = {"o": ShardedObject("o", object(), (1,), (0,))}
    with pytest.raises(nostall.InvalidStateError, match="ShardedObject 'o/shard_0_1'.*not JSON"):
        megatron.save(bad, str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()
    root = str(tmp_path / "ok")
    megatron.save({"t": ShardedTensor.from_rank_offsets("t", torch.ones(4))}, root)
    with pytest.raises(nostall.CheckpointLoadError, match="'missing': not in the checkpoint"):
        megatron.load({"m": ShardedTensor.from_rank_offsets("missing", torch.ones(4))}, root)
    with pytest.raises(nostall.CheckpointLoadError, match="holds torch.float32"):
        megatron.load({"t": ShardedTensor.from_rank_offsets("t", torch.ones(4, dtype=torch.float64))}, root)
    with pytest.raises(nostall.CheckpointLoadError, match=r"global shape \[4\]"):
        megatron.load({"t": ShardedTensor.from_rank_offsets("t", torch.ones(5))}, root)
    with pytest.raises(ValueError, match="strategy"):
        megatron.save({}, root, sharded_strategy=("torch_dist", 1))


def test_megatron_manager_and_torch_dist_import(tmp_path):
    """Through a CheckpointManager; and a torch_dist-style DCP checkpoint (one global,
    stacked tensor per Megatron key) imported and loaded with the adapter."""
    import torch.distributed.checkpoint as dcp

    import nostall
    from nostall.interop import megatron
    from nostall.interop.dcp import import_dcp

    with nostall.CheckpointManager(str(tmp_path / "run")) as mgr:
        megatron.save(make_state(0, 1, 1), mgr, step=5)
        out = megatron.load(make_state(0, 1, 1, zeros=True), mgr)
    check_loaded(out, 0, 1, 1)

    dcp.save({QKV: full(QKV, (L,) + SHAPES[QKV]), EMB: full(EMB, SHAPES[EMB])}, checkpoint_id=str(tmp_path / "td"))
    import_dcp(str(tmp_path / "td"), str(tmp_path / "imported"))
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for tp in (1, 2):
        for tp_rank in range(tp):
            for layer in range(L):
                want = full(QKV, (L,) + SHAPES[QKV])[layer].chunk(tp)[tp_rank]
                st = ShardedTensor.from_rank_offsets(QKV, torch.zeros_like(want), (0, layer, L), (1, tp_rank, tp),
                                                     prepend_axis_num=1)
                st2 = ShardedTensor.from_rank_offsets(EMB, torch.zeros(8, 8), (0, 1, 2))
                out = megatron.load({"q": st, "e": st2}, str(tmp_path / "imported"))
                assert torch.equal(out["q"], want)
                assert torch.equal(out["e"], full(EMB, SHAPES[EMB])[8:])


def test_megatron_load_into_no_grad_views_of_a_parameter(tmp_path):
    """Megatron's factories split a parameter under no_grad; the loader narrows and fills
    those views (stored boxes other than the template's) without autograd's view error."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from nostall.interop import megatron

    full_w = full("w", (8, 4))
    root = str(tmp_path / "boxes")
    # two boxes of one tensor on one rank: stored as boxes (rows 0:4 and 4:8)
    megatron.save({"a": ShardedTensor.from_rank_offsets("w", full_w[:4].clone(), (0, 0, 2)),
                   "b": ShardedTensor.from_rank_offsets("w", full_w[4:].clone(), (0, 1, 2))}, root)
    param = torch.nn.Parameter(torch.zeros(4, 4))
    with torch.no_grad():  # as Megatron's SwiGLU factory does: rows 2:4 and 4:6 of the tensor
        lo, hi = param.chunk(2)
    tmpl = {"lo": ShardedTensor.from_rank_offsets("w", lo, (0, 1, 4)),
            "hi": ShardedTensor.from_rank_offsets("w", hi, (0, 2, 4))}
    out = megatron.load(tmpl, root)
    assert torch.equal(param.detach(), full_w[2:6])
    assert torch.equal(out["lo"], full_w[2:4]) and torch.equal(out["hi"], full_w[4:6])


def test_megatron_torch_dist_objects_without_layout_record(tmp_path):
    """An imported torch_dist checkpoint (no layout record) holds each ShardedObject as the
    list of its values under its unique key; anything else there is refused by name."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    import nostall
    from nostall.interop import megatron
    from nostall.interop.dcp import import_dcp

    dcp.save({"rng/shard_0_1": [{"seed": 7, "pair": [1, 2]}], "bad/shard_0_1": {"not": "a list"},
              "t": torch.ones(2)}, checkpoint_id=str(tmp_path / "td"))
    import_dcp(str(tmp_path / "td"), str(tmp_path / "imported"))
    out = megatron.load({"rng": ShardedObject("rng", {"seed": 0, "pair": (0, 0)}, (1,), (0,))},
                        str(tmp_path / "imported"))
    assert out["rng"] == {"seed": 7, "pair": (1, 2)}  # shaped like the template (a tuple)
    with pytest.raises(nostall.CheckpointLoadError, match="'bad/shard_0_1'.*not torch_dist's list"):
        megatron.load({"b": ShardedObject("bad", None, (1,), (0,))}, str(tmp_path / "imported"))
    with pytest.raises(nostall.CheckpointLoadError, match="'gone/shard_0_1': not in the checkpoint"):
        megatron.load({"g": ShardedObject("gone", None, (1,), (0,))}, str(tmp_path / "imported"))
