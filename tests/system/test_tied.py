"""Tied weights (one tensor under two keys, e.g. an embedding and the LM head sharing ``weight``):
saved once, restored tied, verified once, exported the way Hugging Face stores tied weights."""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct

import pytest
import torch
from torch import nn

import nostall
from nostall.loading import engine
from nostall.errors import CheckpointCorruptError
from nostall.interop.export import export
from nostall.loading.verify import check_checkpoint
from nostall.core.model import flatten

VOCAB, DIM = 96, 24
EMB_BYTES = VOCAB * DIM * 4


class TiedNet(nn.Module):
    """An embedding and an output head that share one weight (the tied-LM pattern)."""

    def __init__(self, seed: int = 0, tie: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def data_bytes(path: str) -> int:
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header(path).items() if k != "__metadata__")


def manifest(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def _rewrite_manifest(path: str, edit) -> None:
    doc = manifest(path)
    edit(doc["tensors"])
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(doc, f, sort_keys=True, separators=(",", ":"))


def record_tie(path: str, b: str, a: str) -> None:
    """Check that the manifest names ``a`` as the key ``b`` is saved as (its pieces are ``a``'s)."""
    t = manifest(path)["tensors"]
    assert t[b]["pieces"] == t[a]["pieces"]
    assert t[b].get("tied_to") == a


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k].view(torch.int32), sb[k].view(torch.int32)), k  # bit-exact


def assert_tied(m: TiedNet) -> None:
    assert m.head.weight is m.emb.weight
    assert m.head.weight.data_ptr() == m.emb.weight.data_ptr()


# --------------------------------------------------------------------------- flatten


def test_flatten_ties_only_the_same_memory_and_box():
    w = torch.arange(12.0).reshape(3, 4)
    flat = flatten({
        "a": w, "b": w, "view": w.view(3, 4), "row": w[1:], "t": w.t(), "copy": w.clone(),
        "sa": nostall.ShardedTensor(w, (6, 4), (0, 0)), "sb": nostall.ShardedTensor(w, (6, 4), (0, 0)),
        "sc": nostall.ShardedTensor(w, (6, 4), (3, 0)),  # same memory, another box: a different piece
        "sr": nostall.ShardedTensor(w, (6, 4), (0, 0), replica_id=1),  # same box, but a replica
        "e1": torch.empty(0), "e2": torch.empty(0),
        "pr": nostall.PerRank(w),
    })
    ties = {k: t.tied_to for k, t in flat.tensors.items() if t.tied_to}
    assert ties == {"b": "a", "view": "a", "sb": "sa"}
    assert "pr" in flat.per_rank_tensors


# --------------------------------------------------------------------------- one-shot save / load


def test_tied_weight_written_once_loaded_tied_and_untied(tmp_path, monkeypatch):
    model = TiedNet(seed=1)
    tied_dir, untied_dir = str(tmp_path / "tied"), str(tmp_path / "untied")
    nostall.save(model.state_dict(), tied_dir)
    nostall.save({k: v.clone() for k, v in model.state_dict().items()}, untied_dir)  # same values, no sharing

    # the data file holds the shared weight once: one header entry, EMB_BYTES fewer data bytes
    h = header(os.path.join(tied_dir, "rank0.safetensors"))
    assert sorted(k for k in h if k != "__metadata__") == ["emb.weight", "mid.bias", "mid.weight"]
    assert data_bytes(os.path.join(untied_dir, "rank0.safetensors")) - data_bytes(
        os.path.join(tied_dir, "rank0.safetensors")) == EMB_BYTES
    pieces = {k: t["pieces"] for k, t in manifest(tied_dir)["tensors"].items()}
    assert pieces["head.weight"] == pieces["emb.weight"]

    # into a fresh tied model: bit-exact, still tied, and the shared bytes are read once
    calls = []
    real = engine.execute_all
    monkeypatch.setattr(engine, "execute_all", lambda rs, *a: (calls.extend(r.rec.key for r in rs), real(rs, *a))[1])
    fresh = TiedNet(seed=2)
    nostall.load(fresh.state_dict(), tied_dir)
    assert_same_model(fresh, model)
    assert_tied(fresh)
    assert sorted(calls) == ["emb.weight", "mid.bias", "mid.weight"]
    monkeypatch.setattr(engine, "execute_all", real)

    # into an untied template: both keys get the values
    template = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    nostall.load(template, tied_dir)
    for k, v in model.state_dict().items():
        assert torch.equal(template[k], v), k
    assert template["head.weight"].data_ptr() != template["emb.weight"].data_ptr()

    # an untied checkpoint still loads into a tied model
    fresh2 = TiedNet(seed=3)
    nostall.load(fresh2.state_dict(), untied_dir)
    assert_same_model(fresh2, model)
    assert_tied(fresh2)


def test_verify_passes_and_reads_shared_bytes_once(tmp_path):
    model = TiedNet(seed=4)
    path = str(tmp_path / "ck")
    nostall.save(model.state_dict(), path)
    rep = check_checkpoint(path)
    assert rep.ok, rep.problems
    assert rep.bytes == data_bytes(os.path.join(path, "rank0.safetensors"))

    # damage the shared weight: reported once (under the key that owns the bytes), not twice
    start, _ = manifest(path)["tensors"]["emb.weight"]["pieces"][0]["byte_range"]
    with open(os.path.join(path, "rank0.safetensors"), "r+b") as f:
        f.seek(start)
        b = f.read(1)
        f.seek(start)
        f.write(bytes([b[0] ^ 0xFF]))
    rep = check_checkpoint(path)
    assert len(rep.problems) == 1 and "'emb.weight'" in rep.problems[0], rep.problems


def test_manifest_names_the_key_a_tied_key_is_saved_as(tmp_path):
    path = str(tmp_path / "ck")
    nostall.save(TiedNet().state_dict(), path)
    t = manifest(path)["tensors"]
    assert t["head.weight"].get("tied_to") == "emb.weight"
    assert "tied_to" not in t["emb.weight"] and "tied_to" not in t["mid.weight"]
    # nostall inspect shows the tie and counts the bytes once
    from nostall.tools.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", "--json", path]) == 0
    rows = {r["key"]: r for r in json.loads(out.getvalue())["tensors"]}
    assert rows["head.weight"]["tied_to"] == "emb.weight" and rows["head.weight"]["bytes"] == 0
    assert rows["emb.weight"]["bytes"] > 0 and rows["emb.weight"]["tied_to"] is None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", path]) == 0
    assert "tied to emb.weight" in out.getvalue()


# --------------------------------------------------------------------------- the manifest field




def test_tied_to_field_parsed_and_validated(tmp_path):
    from nostall.loading.manifests import read_manifest

    model = TiedNet(seed=5)
    path = str(tmp_path / "ck")
    nostall.save({"model": model.state_dict(), "other": torch.ones(VOCAB, DIM)}, path)
    _rewrite_manifest(path, lambda t: t["model/head.weight"].update(tied_to="model/emb.weight"))
    m = read_manifest(path)
    assert m.tensors["model/head.weight"].tied_to == "model/emb.weight"
    assert m.tensors["model/emb.weight"].tied_to == ""
    assert b'"tied_to":"model/emb.weight"' in m.to_json_bytes()  # encoded back
    fresh = TiedNet(seed=6)
    nostall.load({"model": fresh.state_dict(), "other": torch.zeros(VOCAB, DIM)}, path)
    assert_same_model(fresh, model)

    bad = {
        "model/nope": "no such global tensor",
        "model/head.weight": "tied to itself",
        "model/mid.weight": "F32 [24, 24]",  # another shape
        "other": "their pieces differ",  # same dtype and shape, other bytes
        "": "non-empty string",
    }
    for target, why in bad.items():
        _rewrite_manifest(path, lambda t, target=target: t["model/head.weight"].update(tied_to=target))
        with pytest.raises(CheckpointCorruptError) as e:
            read_manifest(path)
        assert "model/head.weight" in str(e.value) and why in str(e.value), (target, str(e.value))
        if target:
            assert target in str(e.value)

    # a chain (the target is itself tied) is refused, naming both keys
    def chain(t):
        t["model/head.weight"]["tied_to"] = "model/emb.weight"
        t["model/emb.weight"]["tied_to"] = "model/head.weight"

    _rewrite_manifest(path, chain)
    with pytest.raises(CheckpointCorruptError, match="itself tied"):
        read_manifest(path)


# --------------------------------------------------------------------------- the manager


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_saves_tied_once_and_restores_tied(tmp_path, async_save):
    model = TiedNet(seed=7)
    root = str(tmp_path / "run")
    with nostall.CheckpointManager(root, async_save=async_save) as mgr:
        mgr.save(3, {"model": model.state_dict(), "trainer": {"step": 3}})
        mgr.finalize_pending_saves()
        step_dir = mgr.path_for(3)
        h = header(os.path.join(step_dir, "rank0.safetensors"))
        assert sorted(k for k in h if k != "__metadata__") == ["model/emb.weight", "model/mid.bias",
                                                                "model/mid.weight"]
        fresh = TiedNet(seed=8)
        restored = mgr.load({"model": fresh.state_dict(), "trainer": {"step": 0}})
    assert restored["trainer"] == {"step": 3}
    assert_same_model(fresh, model)
    assert_tied(fresh)
    assert check_checkpoint(step_dir).ok


# --------------------------------------------------------------------------- export


def test_export_safetensors_keeps_one_name_like_hugging_face(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model

    model = TiedNet(seed=9)
    path = str(tmp_path / "ck")
    nostall.save({"model": model.state_dict()}, path)
    record_tie(path, "model/head.weight", "model/emb.weight")
    out = str(tmp_path / "hf")
    rep = export(path, out, strip_prefix="model")
    assert rep.tied == {"head.weight": "emb.weight"}
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(sd) == ["emb.weight", "mid.bias", "mid.weight"]
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "head.weight": "emb.weight"}  # as safetensors' save_model records

    # plain torch: load_state_dict without the dropped name, then the model's own tie covers it
    fresh = TiedNet(seed=10)
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    assert missing == ["head.weight"] and unexpected == []
    assert_same_model(fresh, model)
    assert_tied(fresh)
    # an untied model re-tied after loading, as a Hugging Face model's tie_weights() does
    untied = TiedNet(seed=11, tie=False)
    untied.load_state_dict(sd, strict=False)
    untied.head.weight = untied.emb.weight
    assert_same_model(untied, model)
    # safetensors' own loader for shared tensors accepts the file strictly
    fresh2 = TiedNet(seed=12)
    missing, unexpected = load_model(fresh2, os.path.join(out, "model.safetensors"))
    assert not missing and not unexpected
    assert_same_model(fresh2, model)

    # sharded export: the dropped name is not in the index either
    out2 = str(tmp_path / "hf2")
    export(path, out2, strip_prefix="model", max_shard_size=EMB_BYTES)
    with open(os.path.join(out2, "model.safetensors.index.json")) as f:
        assert sorted(json.load(f)["weight_map"]) == ["emb.weight", "mid.bias", "mid.weight"]

    # exporting the tied key alone writes it under its own name
    out3 = str(tmp_path / "hf3")
    rep3 = export(path, out3, keys=["model/head.weight"], strip_prefix="model")
    assert rep3.tied == {}
    assert torch.equal(load_file(os.path.join(out3, "model.safetensors"))["head.weight"], model.head.weight)


def test_export_torch_shares_one_storage(tmp_path):
    model = TiedNet(seed=13)
    path = str(tmp_path / "ck")
    nostall.save(model.state_dict(), path)
    record_tie(path, "head.weight", "emb.weight")
    dst = str(tmp_path / "m.pt")
    export(path, dst, to="torch")
    sd = torch.load(dst, weights_only=True)
    assert sorted(sd) == ["emb.weight", "head.weight", "mid.bias", "mid.weight"]
    assert sd["head.weight"].untyped_storage().data_ptr() == sd["emb.weight"].untyped_storage().data_ptr()
    fresh = TiedNet(seed=14)
    fresh.load_state_dict(sd)
    assert_same_model(fresh, model)
    assert os.path.getsize(dst) < EMB_BYTES * 2  # the shared weight is stored once


# --------------------------------------------------------------------------- a real GPT-2


def test_gpt2_tied_lm_head(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    path = str(tmp_path / "ck")
    nostall.save(model.state_dict(), path)
    h = header(os.path.join(path, "rank0.safetensors"))
    assert "transformer.wte.weight" in h and "lm_head.weight" not in h
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(cfg).eval()
    nostall.load(fresh.state_dict(), path)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert check_checkpoint(path).ok
    record_tie(path, "lm_head.weight", "transformer.wte.weight")
    out = str(tmp_path / "hf")
    export(path, out)
    cfg.save_pretrained(out)
    again = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


# --------------------------------------------------------------------------- two real ranks


def _save_two_ranks(rank, world, root, tie_on):
    """Replicated emb/head (tied on the ranks in ``tie_on``) and a sharded pair tied the same way."""
    w = (torch.arange(VOCAB * DIM, dtype=torch.float32).reshape(VOCAB, DIM) / 7).clone()
    half = VOCAB // world
    shard = w[rank * half:(rank + 1) * half].clone()
    tie = rank in tie_on
    state = {
        "emb": w, "head": w if tie else w.clone(),
        "s_emb": nostall.ShardedTensor(shard, (VOCAB, DIM), (rank * half, 0)),
        "s_head": nostall.ShardedTensor(shard if tie else shard.clone(), (VOCAB, DIM), (rank * half, 0)),
    }
    nostall.save(state, root)
    return True


def _load_two_ranks(rank, world, root):
    w = torch.arange(VOCAB * DIM, dtype=torch.float32).reshape(VOCAB, DIM) / 7
    half = VOCAB // world
    t = {"emb": torch.zeros(VOCAB, DIM), "head": torch.zeros(VOCAB, DIM),
         "s_emb": nostall.ShardedTensor(torch.zeros(half, DIM), (VOCAB, DIM), (rank * half, 0)),
         "s_head": nostall.ShardedTensor(torch.zeros(half, DIM), (VOCAB, DIM), (rank * half, 0))}
    nostall.load(t, root)
    assert torch.equal(t["emb"], w) and torch.equal(t["head"], w)
    assert torch.equal(t["s_emb"].data, w[rank * half:(rank + 1) * half])
    assert torch.equal(t["s_head"].data, w[rank * half:(rank + 1) * half])
    return True


def _stored_keys(path: str) -> list:
    keys = []
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            keys += [k for k in header(os.path.join(path, name)) if k != "__metadata__"]
    return sorted(keys)


def test_two_ranks_tie_only_when_every_holder_agrees(tmp_path, pool2):
    agree, disagree = str(tmp_path / "agree"), str(tmp_path / "disagree")
    assert pool2.run(_save_two_ranks, agree, (0, 1)) == [True, True]
    assert pool2.run(_save_two_ranks, disagree, (0,)) == [True, True]

    # every rank ties: the replicated pair is stored once, each shard of the sharded pair once
    assert _stored_keys(agree) == ["emb", "s_emb@0,0", "s_emb@48,0"]
    t = manifest(agree)["tensors"]
    assert t["head"]["pieces"] == t["emb"]["pieces"] and t["s_head"]["pieces"] == t["s_emb"]["pieces"]
    # rank 1 holds an untied copy: written as ordinary tensors, still correct
    assert _stored_keys(disagree) == ["emb", "head", "s_emb@0,0", "s_emb@48,0", "s_head@0,0", "s_head@48,0"]
    t = manifest(disagree)["tensors"]
    assert "tied_to" not in t["head"] and t["head"]["pieces"] != t["emb"]["pieces"]

    for root in (agree, disagree):
        assert check_checkpoint(root).ok
        assert pool2.run(_load_two_ranks, root) == [True, True]
        # and into one process (another world size)
        assert _load_two_ranks(0, 1, root)


def _dtensor_tied(rank, world, root):
    """A DTensor under two keys (FSDP2/TP-style tied weight): saved once; loaded into a tied DTensor pair."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(VOCAB * DIM, dtype=torch.float32).reshape(VOCAB, DIM) / 3
    dt = distribute_tensor(w, mesh, [Shard(0)])
    nostall.save({"emb": dt, "head": dt}, root)
    fresh = distribute_tensor(torch.zeros(VOCAB, DIM), mesh, [Shard(0)])
    calls = []
    real = engine.execute_all
    engine.execute_all = lambda rs, *a: (calls.extend(r.rec.key for r in rs), real(rs, *a))[1]
    try:
        nostall.load({"emb": fresh, "head": fresh}, root)
    finally:
        engine.execute_all = real
    assert torch.equal(fresh.full_tensor(), w)
    return sorted(calls)


def test_dtensor_tied_saved_once(tmp_path, pool2):
    root = str(tmp_path / "dt")
    assert pool2.run(_dtensor_tied, root) == [["emb"], ["emb"]]  # each rank reads its shard once
    assert _stored_keys(root) == ["emb@0,0", "emb@48,0"]
    t = manifest(root)["tensors"]
    assert t["head"]["pieces"] == t["emb"]["pieces"]
    assert check_checkpoint(root).ok
