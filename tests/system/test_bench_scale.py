"""``nostall bench scale`` at tiny sizes: it runs and its output has the documented shape (figures not asserted)."""

from __future__ import annotations

import hashlib
import json
import math

from nostall.planning.comm import SLOT
from nostall.tools.bench import exchange, projection
from nostall.tools.bench import scale as bench_scale
from nostall.planning.plan import build_plan


def _finite(xs):
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in xs)


def _sent_pickles(ranks, tensors):
    """Each rank's metadata pickle, its signature computed first (as a save sends it)."""
    import pickle

    out = []
    for r in range(ranks):
        m = bench_scale.synthetic_meta(r, ranks, tensors)
        m.signature()
        out.append(len(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)))
    return out


def _check_byte_counts(p):
    """The plan exchange's and the commit's byte counts are in the JSON, consistent with the pickles."""
    ex = p["exchange"]
    meta = ex["steps"]["metadata"]
    assert meta["longest_pickle"] == max(_sent_pickles(p["ranks"], p["tensors"]))
    assert meta["message_bytes"] == SLOT + (meta["longest_pickle"] if meta["longest_pickle"] > SLOT - 8 else 0)
    for step in ex["steps"].values():
        assert step["received_bytes"] == (p["ranks"] - 1) * step["message_bytes"] > 0
    assert ex["per_rank"]["sent_bytes"] == sum(s["sent_bytes"] for s in ex["steps"].values())
    assert ex["per_rank"]["received_bytes"] == sum(s["received_bytes"] for s in ex["steps"].values())
    assert ex["own_pickles"]["rank0"]["round1"] > ex["own_pickles"]["rank0"]["digests"] >= 0
    commit = p["commit"]
    assert commit["async"]["rank0_reads_bytes"] == commit["done_json_bytes"]["total"] > 0
    assert commit["sync"]["gather"]["received_bytes"] > 0 and commit["async"]["other_reads_bytes"] > 0


def test_bench_scale_smoke(tmp_path, capsys):
    js, prefix = tmp_path / "scale.json", tmp_path / "p"
    rc = bench_scale.main(["--ranks", "4,8", "--tensors", "10,20", "--moe-tensors", "4,12", "--pieces", "2,4,8",
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
        assert _finite([p["signature_s"], p["gather_decode_s"], p["skeleton_s"], p["with_crcs_s"], p["encode_s"],
                        p["shared_keys_s"]])
        _check_byte_counts(p)
        assert p["computed"] == {}
    rows = {r["key"]: r for r in out["projection"]}
    assert set(rows) == {k for k, _, _ in projection.ROWS}  # the load part ran: its row too
    assert {int(r) for r in rows["exchange_received"]["cells"]} == {4, 8}  # the largest tensor count's points
    assert rows["manifest_read"]["cells"]["8"]["value"] == planning[-1]["manifest_bytes"]

    moe = out["moe"]
    assert moe["ranks"] == 2 and [p["tensors"] for p in moe["points"]] == [4, 12]
    for p in moe["points"]:
        for field in ("stall_s", "plan_s", "stage_s", "copy_floor_s", "slowest_rank_stall_s", "parse_s"):
            assert len(p[field]) == 1 and _finite(p[field]), field
        assert set(p["breakdown"]) == {"flatten_s", "local_meta_s", "signature_s", "gather_s", "build_plan_s"}
        assert p["bytes_per_rank"] > 0 and p["manifest_bytes"] > 0 and p["plan_cached"] is True
        assert p["first_save"]["stall_s"] >= 0

    assert [p["pieces"] for p in out["load"]] == [2, 4, 8]
    for p in out["load"]:
        for field in ("raw_read_s", "full_s", "resharded_s", "same_layout_rank_s", "raw_read_rank_s", "parse_s"):
            assert len(p[field]) == 1 and _finite(p[field]), field
        assert p["bytes"] == p["rank_bytes"] * p["pieces"]

    table = capsys.readouterr().out
    assert "planning from synthetic metadata" in table and "many small tensors" in table and "pieces" in table
    for part in bench_scale.PARTS:
        assert (tmp_path / f"p-{part}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --project: the projection of earlier runs' JSON, nothing run
    assert bench_scale.main(["--project", f"{js},{js}"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("| per rank, 20 tensors a rank | 4 ranks | 8 ranks |")
    assert printed.count("\n| ") == len(projection.ROWS)  # a line per row


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


def test_all_gather_bytes_follow_the_comm_protocol():
    """One slot each when every pickle fits; else a second message each, padded to the longest pickle."""
    small = exchange.all_gather([10, 200, 30])
    assert small["collectives"] == 1 and small["message_bytes"] == SLOT and small["received_bytes"] == 2 * SLOT
    big = exchange.all_gather([10, SLOT, 30, 40])
    assert big["collectives"] == 2 and big["message_bytes"] == 2 * SLOT
    assert big["sent_bytes"] == 2 * SLOT and big["received_bytes"] == big["ring_sent_bytes"] == 3 * 2 * SLOT


def test_points_above_measure_up_to_are_computed_and_labelled(tmp_path):
    """Above --measure-up-to the plan, manifest and commit figures are computed (and say how); the byte counts
    of the plan exchange are still counted; the distinct boxes are the plan's pieces."""
    out = bench_scale.run_scale(["planning"], [4, 8, 16], [10], reps=1, root=str(tmp_path), measure_up_to=8)
    p4, p8, p16 = out["planning"]
    assert p4["computed"] == p8["computed"] == {}
    computed = {"manifest_bytes", "parse_memory_estimate", "commit"}
    assert set(p16["computed"]) == set(bench_scale.COMPUTED_TIMES) | computed
    assert all("power law" in p16["computed"][f] for f in bench_scale.COMPUTED_TIMES)
    assert _finite(p16["plan_s"] + p16["parse_s"]) and p16["manifest_bytes"] > p8["manifest_bytes"]
    _check_byte_counts({**p16, "commit": p8["commit"]})
    assert p16["commit"]["async"]["rank0_reads_bytes"] == p8["commit"]["async"]["rank0_reads_bytes"] * 2
    assert p16["pieces"] == bench_scale.distinct_pieces(bench_scale.synthetic_metas(16, 10))
    plan = build_plan(bench_scale.synthetic_metas(16, 10))
    assert p16["pieces"] == sum(len(t.pieces) for t in plan.tensors.values()) + sum(len(d) for d in plan.per_rank)
    rows = {r["key"]: r for r in out["projection"]}
    assert "load_share" not in rows  # no load part: no load figure
    assert rows["plan_thread_other"]["cells"][16]["how"].startswith("computed")
    assert rows["exchange_sent"]["cells"][16]["how"] == projection.COUNTED
