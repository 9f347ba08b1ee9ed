"""``nostall bench scale`` at tiny sizes: it runs and its output has the documented shape (figures not asserted)."""

from __future__ import annotations

import hashlib
import json
import math

from nostall.tools.bench import scale as bench_scale
from nostall.planning.plan import build_plan


def _finite(xs):
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in xs)


def test_bench_scale_smoke(tmp_path, capsys):
    js, prefix = tmp_path / "scale.json", tmp_path / "p"
    rc = bench_scale.main(["--ranks", "4,8", "--tensors", "10,20", "--moe-tensors", "4,12", "--pieces", "2,4",
                           "--load-mb", "1", "--load-tensors", "2", "--reps", "1", "--dir", str(tmp_path / "run"),
                           "--json", str(js), "--plot", str(prefix), "--quiet"])
    assert rc == 0
    out = json.loads(js.read_text())
    assert set(out) >= {"config", "machine", "date", "planning", "moe", "load"}

    planning = out["planning"]
    assert [(p["ranks"], p["tensors"]) for p in planning] == [(4, 10), (8, 10), (4, 20), (8, 20)]
    for p in planning:
        assert len(p["plan_s"]) == 1 and _finite(p["plan_s"] + p["parse_s"])
        assert p["pieces"] > p["tensors"] and p["files"] == p["ranks"] and p["manifest_bytes"] > 0
        assert _finite([p["signature_s"], p["gather_decode_s"], p["skeleton_s"], p["with_crcs_s"], p["encode_s"]])

    moe = out["moe"]
    assert moe["ranks"] == 2 and [p["tensors"] for p in moe["points"]] == [4, 12]
    for p in moe["points"]:
        for field in ("stall_s", "plan_s", "stage_s", "copy_floor_s", "slowest_rank_stall_s", "parse_s"):
            assert len(p[field]) == 1 and _finite(p[field]), field
        assert set(p["breakdown"]) == {"flatten_s", "local_meta_s", "signature_s", "gather_s", "build_plan_s"}
        assert p["bytes_per_rank"] > 0 and p["manifest_bytes"] > 0 and p["plan_cached"] is True
        assert p["first_save"]["stall_s"] >= 0

    assert [p["pieces"] for p in out["load"]] == [2, 4]
    for p in out["load"]:
        for field in ("raw_read_s", "full_s", "resharded_s", "same_layout_rank_s", "raw_read_rank_s", "parse_s"):
            assert len(p[field]) == 1 and _finite(p[field]), field
        assert p["bytes"] == p["rank_bytes"] * p["pieces"]

    table = capsys.readouterr().out
    assert "planning from synthetic metadata" in table and "many small tensors" in table and "pieces" in table
    for part in bench_scale.PARTS:
        assert (tmp_path / f"p-{part}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_paths_prefix_or_directory(tmp_path):
    assert bench_scale.plot_paths(str(tmp_path))["moe"] == str(tmp_path / "scale-moe.png")
    assert bench_scale.plot_paths(str(tmp_path / "x"))["load"] == str(tmp_path / "x-load.png")


def test_synthetic_metadata_plans_and_signature_is_the_repr_digest():
    """The synthetic layout is valid; RankMeta.signature (built without the dataclass repr) is still the
    SHA-256 of repr((tensors, per_rank)), and a gathered copy keeps it."""
    import pickle

    metas = bench_scale.synthetic_metas(16, 10)
    plan = build_plan(metas)
    assert plan.world_size == 16 and len(plan.files) == 16
    for m in metas[:3] + [type(metas[0])(metas[0].tensors[:1], ())]:
        assert m.signature() == hashlib.sha256(repr((m.tensors, m.per_rank)).encode()).hexdigest()
        assert pickle.loads(pickle.dumps(m)).signature() == m.signature()
        assert pickle.loads(pickle.dumps(m)) == m
