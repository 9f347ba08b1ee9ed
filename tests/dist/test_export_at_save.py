"""Hugging Face export at save time (docs/interop.md, "Exporting at save time"): 2 gloo ranks save a real
GPT-2's weights sharded FSDP-style; each rank writes its share of the export from the committed checkpoint;
``from_pretrained`` gives the same logits; the tensors equal the offline ``nostall convert``'s; a failure or
a crash mid-export leaves no visible export and the checkpoint loadable."""

from __future__ import annotations

import json
import os

import pytest
import torch

import nostall
from nostall.core.exports import CheckpointExportError
from nostall.interop.hf_export import STAGE_TAG, HFExport, assign_files
from tests.dist_harness import run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _model():
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _sharded(model, rank, world):
    """FSDP-like: every weight split by rows over the ranks (views of the model's own, so the tied LM head
    and embedding stay one piece)."""
    out = {}
    for name, t in model.state_dict().items():
        rows = t.shape[0]
        per = -(-rows // world)
        lo, hi = min(rank * per, rows), min((rank + 1) * per, rows)
        out[name] = nostall.ShardedTensor(t[lo:hi], tuple(t.shape), (lo,) + (0,) * (t.dim() - 1))
    return {"model": out, "trainer": {"epoch": 1}}


def _files(model):
    return {"huggingface/config.json": model.config.to_dict()}


def _save_and_export(rank, world, root, hf, async_save, steps):
    model = _model()
    outcomes = []
    with nostall.CheckpointManager(root, async_save=async_save, timeout=60,
                                   export=HFExport(os.path.join(hf, "step_{step}"))) as mgr:
        for step in steps:
            h = mgr.save(step, _sharded(model, rank, world), files=_files(model))
            assert h.stats.stall_s >= 0
            o = mgr.export_result()
            outcomes.append({"files": o.files, "published": o.published, "path": o.path, "bytes": o.bytes})
    return outcomes


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            for k, v in load_file(os.path.join(folder, f)).items():
                assert k not in out, k
                out[k] = v
    return out


def _logits(model):
    ids = torch.arange(12).unsqueeze(0) % 128
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_export_at_save_loads_with_from_pretrained_and_equals_the_offline_export(pool2, tmp_path, async_save):
    from nostall.interop.export import export

    root, hf = str(tmp_path / "run"), str(tmp_path / "hf")
    outcomes = pool2.run(_save_and_export, root, hf, async_save, [3, 6])
    for i, step in enumerate([3, 6]):
        dst = os.path.join(hf, f"step_{step}")
        by_rank = [o[i] for o in outcomes]
        assert by_rank[0]["published"] and by_rank[0]["path"] == dst and not by_rank[1]["published"]
        assert by_rank[0]["files"] and by_rank[1]["files"], by_rank  # each rank wrote its share
        listing = sorted(os.listdir(dst))
        weights = sorted(f for r in by_rank for f in r["files"])
        assert listing == sorted([".nostall-export.json", "config.json", "model.safetensors.index.json"] + weights)
        index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))
        assert sorted(set(index["weight_map"].values())) == weights
        again = transformers.GPT2LMHeadModel.from_pretrained(dst).eval()
        assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()  # re-tied
        assert torch.equal(_logits(again), _logits(_model()))
        offline = str(tmp_path / f"offline_{step}")
        export(os.path.join(root, f"step_{step}"), offline, keys=["model"], strip_prefix="model")
        a, b = _tensors(dst), _tensors(offline)
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert sorted(os.listdir(hf)) == ["step_3", "step_6"]  # no staging directory left


def _fail_export(rank, world, root, hf, bad_rank, async_save):
    model = _model()
    out = {}
    with nostall.CheckpointManager(root, async_save=async_save, timeout=60,
                                   export=HFExport(os.path.join(hf, "step_{step}"))) as mgr:
        if rank == bad_rank:
            mgr._faults.export_fault = "eio"  # mid-file: after the first region of this rank's first file
        mgr.save(1, _sharded(model, rank, world), files=_files(model))
        try:
            mgr.export_result()
            out["error"] = None
        except CheckpointExportError as e:
            out["error"] = str(e)
        out["listing"] = sorted(os.listdir(hf)) if os.path.isdir(hf) else []
        mgr._faults.export_fault = None
        mgr.save(2, _sharded(model, rank, world), files=_files(model))  # the next save exports again
        out["next"] = mgr.export_result().published
        whole = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
        nostall.load(whole, mgr.path_for(1), strict=False)
        out["loaded"] = all(torch.equal(whole["model"][k], v) for k, v in model.state_dict().items())
    return out


@pytest.mark.parametrize("bad_rank,async_save", [(1, True), (0, False)], ids=["rank1-async", "rank0-sync"])
def test_a_failure_mid_export_leaves_no_export_and_the_checkpoint_loadable(pool2, tmp_path, bad_rank, async_save):
    root, hf = str(tmp_path / "run"), str(tmp_path / "hf")
    out = pool2.run(_fail_export, root, hf, bad_rank, async_save)
    err0 = out[0]["error"]
    assert err0 is not None and "step 1" in err0 and "rank" in err0, out
    if bad_rank == 1:
        assert "rank 1's part failed" in err0 and "model-0000" in err0, err0  # names the rank and the file
    else:
        assert "Input/output error" in err0 and "model-0000" in err0, err0
    assert out[bad_rank]["error"] is not None
    assert not os.path.exists(os.path.join(hf, "step_1"))
    assert sorted(os.listdir(hf)) == ["step_2"], os.listdir(hf)  # the failed one's staging directory is gone
    assert out[0]["next"] and all(o["loaded"] for o in out)
    assert nostall.CheckpointManager(root, read_only=True).steps() == [1, 2]


def _existing_destination(rank, world, root, hf):
    model = _model()
    with nostall.CheckpointManager(root, timeout=60, export=HFExport(os.path.join(hf, "step_{step}"))) as mgr:
        mgr.save(4, _sharded(model, rank, world))
        try:
            mgr.export_result()
            return None
        except CheckpointExportError as e:
            return str(e)


def test_an_existing_destination_is_never_replaced(pool2, tmp_path):
    root, hf = str(tmp_path / "run"), tmp_path / "hf"
    (hf / "step_4").mkdir(parents=True)
    (hf / "step_4" / "mine.txt").write_text("the user's")
    errors = pool2.run(_existing_destination, root, str(hf))
    assert all(e is not None and "exists" in e for e in errors), errors
    assert sorted(os.listdir(hf)) == ["step_4"] and os.listdir(hf / "step_4") == ["mine.txt"]


def _crash_at_publish(rank, world, root, hf):
    model = _model()
    with nostall.CheckpointManager(root, async_save=True, timeout=30,
                                   export=HFExport(os.path.join(hf, "step_{step}"))) as mgr:
        mgr.save(7, _sharded(model, rank, world), files=_files(model))
        mgr.export_result()  # rank 0 is killed (SIGKILL) just before the rename into place
    return rank


def test_a_crash_before_the_publish_leaves_no_visible_export(tmp_path):
    root, hf = str(tmp_path / "run"), str(tmp_path / "hf")
    with pytest.raises(AssertionError):
        run_ranks(2, _crash_at_publish, root, hf, env={"NOSTALL_TEST_CRASH": "trainer:export.publish:7"},
                  timeout=240, grace=30)
    left = os.listdir(hf)
    assert not os.path.exists(os.path.join(hf, "step_7"))
    assert len(left) == 1 and left[0].startswith(".step_7" + STAGE_TAG), left  # hidden, swept by the next one
    model = _model()
    whole = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    nostall.load(whole, root, strict=False)  # the committed checkpoint is untouched
    assert all(torch.equal(whole["model"][k], v) for k, v in model.state_dict().items())


def test_files_are_dealt_largest_first_to_the_least_loaded_rank():
    assert assign_files([10, 30, 20, 5], 2) == [1, 0, 1, 0]
    assert assign_files([4, 4, 4, 4], 2) == [0, 1, 0, 1]
    assert assign_files([7], 3) == [0]


def test_export_options_are_checked_where_they_are_made():
    with pytest.raises(ValueError, match="URL"):
        HFExport("s3://bucket/hf/{step}")
    with pytest.raises(ValueError, match="only the field"):
        HFExport("hf/{stp}")
    with pytest.raises(ValueError, match="dtype"):
        HFExport("hf/{step}", dtype="fp7")
    with pytest.raises(ValueError, match="names the step"):
        HFExport("hf/{step}").check_step(None)
    with pytest.raises(ValueError, match="export"):
        nostall.Options(export="hf/{step}")
    assert nostall.Options(export=HFExport("hf/{step}")).export == HFExport("hf/{step}")


def test_shard_groups_cut_near_equal_shares_only_when_asked():
    from types import SimpleNamespace

    from nostall.interop.export import shard_groups

    items = [SimpleNamespace(nbytes=n) for n in (10, 10, 10, 10, 40, 5, 5)]  # 90 bytes
    sizes = lambda groups: [sum(i.nbytes for i in g) for g in groups]  # noqa: E731
    assert sizes(shard_groups(items, 1000)) == [90]  # the offline export: cut by max_shard_size only
    assert sizes(shard_groups(items, 50)) == [40, 50]
    assert sizes(shard_groups(items, 1000, min_files=2)) == [40, 50]
    assert sizes(shard_groups(items, 1000, min_files=3)) == [30, 50, 10]  # a cut where a middle passes 30, 60
    assert sizes(shard_groups(items[:1], 1000, min_files=4)) == [10]
    assert shard_groups([], 1000, min_files=2) == []


def _back_to_back(rank, world, root, hf):
    model = _model()
    with nostall.CheckpointManager(root, async_save=True, timeout=60, keep_last=1,
                                   export=HFExport(os.path.join(hf, "step_{step}"))) as mgr:
        for step in (1, 2, 3):  # no wait in between: each save waits for the previous export first
            mgr.save(step, _sharded(model, rank, world), files=_files(model))
        mgr.save(4, _sharded(model, rank, world), export=False)
    return mgr.steps()


def test_back_to_back_saves_each_export_and_close_finishes_the_last(pool2, tmp_path):
    """keep_last=1 deletes each checkpoint once the next commits: an export never reads a checkpoint that
    retention is deleting, because the next save waits for it."""
    root, hf = str(tmp_path / "run"), str(tmp_path / "hf")
    assert pool2.run(_back_to_back, root, hf) == [[4], [4]]
    assert sorted(os.listdir(hf)) == ["step_1", "step_2", "step_3"]
    for step in (1, 2, 3):
        again = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(hf, f"step_{step}")).eval()
        assert torch.equal(_logits(again), _logits(_model()))


def _rank1_dies_mid_export(rank, world, root, hf, report):
    model = _model()
    with nostall.CheckpointManager(root, async_save=True, timeout=8,
                                   export=HFExport(os.path.join(hf, "step_{step}"))) as mgr:
        if rank == 1:  # killed once its files are written, before it says so
            os.environ["NOSTALL_TEST_CRASH"] = "trainer:export.written:7"
        mgr.save(7, _sharded(model, rank, world), files=_files(model))
        try:
            mgr.export_result(timeout=60)
            error = None
        except CheckpointExportError as e:
            error = str(e)
        with open(report, "w") as f:
            json.dump({"error": error, "listing": sorted(os.listdir(hf))}, f)
    return rank


def test_a_rank_that_dies_mid_export_fails_it_within_the_timeout_and_leaves_nothing(tmp_path):
    root, hf, report = str(tmp_path / "run"), str(tmp_path / "hf"), str(tmp_path / "report.json")
    with pytest.raises(AssertionError):
        run_ranks(2, _rank1_dies_mid_export, root, hf, report, timeout=240, grace=90)
    got = json.load(open(report))
    assert got["error"] is not None and "rank(s) [1] did not come within 8s" in got["error"], got
    assert got["listing"] == [] and os.listdir(hf) == []  # rank 1's finished files went with the staging directory
    model = _model()
    whole = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    nostall.load(whole, root, strict=False)
    assert all(torch.equal(whole["model"][k], v) for k, v in model.state_dict().items())
