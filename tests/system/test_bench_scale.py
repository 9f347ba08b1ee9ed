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
    """Each rank's metadata message in the gather: encode_meta's bytes, pickled (as Comm.gather sends them)."""
    import pickle

    from nostall.planning.plan import encode_meta

    return [len(pickle.dumps(encode_meta(bench_scale.synthetic_meta(r, ranks, tensors)),
                             protocol=pickle.HIGHEST_PROTOCOL)) for r in range(ranks)]


def _check_byte_counts(p):
    """The plan exchange's and the commit's byte counts are in the JSON and follow the protocol of
    planning/rounds.py over planning/comm.py: gathers to rank 0, answers from it."""
    ex, world = p["exchange"], p["ranks"]
    steps = ex["steps"]
    assert list(steps) == ["reports", "answer", "metadata", "shares", "digests", "verdict"]
    meta = steps["metadata"]
    pickles = _sent_pickles(world, p["tensors"])
    assert meta["longest_pickle"] == max(pickles)
    tails = [n for n in pickles[1:] if n > SLOT - 8]
    assert meta["point_to_point"] == len(tails)
    # a gather: rank 0 receives every other rank's slot and its long pickle whole; sends nothing
    assert meta["rank0"] == {"sent_bytes": 0, "received_bytes": (world - 1) * SLOT + sum(tails),
                             "messages": 0}
    longest_other = max(pickles[1:])
    assert meta["other"]["sent_bytes"] == SLOT + (longest_other if longest_other > SLOT - 8 else 0)
    for name in ("reports", "metadata", "digests"):  # gathers: a non-zero rank receives nothing
        assert steps[name]["kind"] == "gather" and steps[name]["other"]["received_bytes"] == 0
        assert steps[name]["rank0"]["sent_bytes"] == 0
    for name in ("answer", "verdict"):  # broadcasts of one slot: each rank receives it, rank 0 sends it to each
        assert steps[name]["other"] == {"sent_bytes": 0, "received_bytes": SLOT, "messages": 1}
        assert steps[name]["rank0"]["sent_bytes"] == (world - 1) * SLOT
    shares = steps["shares"]  # a scatter: each rank its own share, a slot (it fits)
    assert shares["kind"] == "scatter" and shares["longest_pickle"] <= SLOT - 8
    assert shares["other"]["received_bytes"] == SLOT and shares["rank0"]["sent_bytes"] == (world - 1) * SLOT
    # in all: a non-zero rank sends its own messages and receives three slots
    other, rank0 = ex["other"], ex["rank0"]
    assert other["received_bytes"] == 3 * SLOT
    assert other["sent_bytes"] <= sum(s["other"]["sent_bytes"] for s in steps.values())
    assert other["sent_bytes"] >= 3 * SLOT + (min(pickles[1:]) if min(pickles[1:]) > SLOT - 8 else 0)
    assert rank0["received_bytes"] == sum(s["rank0"]["received_bytes"] for s in steps.values())
    assert rank0["sent_bytes"] == sum(s["rank0"]["sent_bytes"] for s in steps.values())
    assert rank0["received_bytes"] >= (world - 1) * 3 * SLOT + sum(tails)
    assert ex["own_pickles"]["largest"]["metadata"] == max(pickles)
    assert 0 < ex["own_pickles"]["largest"]["share"] < ex["own_pickles"]["largest"]["metadata"]
    commit = p["commit"]
    assert commit["async"]["rank0_reads_bytes"] == commit["done_json_bytes"]["total"] > 0
    assert commit["async"]["other_reads_bytes"] > 0
    sync = commit["sync"]  # the done records gathered to rank 0, the outcome broadcast
    assert sync["other"]["received_bytes"] == SLOT and sync["other"]["sent_bytes"] >= SLOT
    assert sync["rank0"]["received_bytes"] >= (world - 1) * SLOT


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
        assert _finite([p["signature_s"], p["skeleton_s"], p["with_crcs_s"], p["encode_s"]]
                       + [p[f] for f in bench_scale.RANK0_TIMES if f != "plan_s"])
        other = p["other"]
        assert other["rank"] == p["ranks"] - 1 and 0 < other["owned_pieces"] <= p["tensors"]
        assert _finite([other[f] for f in ("signature_s", "encode_s", "own_files_s", "own_files_owned_s",
                                           "share_decode_s", "thread_s")])
        _check_byte_counts(p)
        assert p["computed"] == {}
    rows = {r["key"]: r for r in out["projection"]}
    assert set(rows) == {k for k, _, _ in projection.ROWS}  # the load part ran: its row too
    assert {int(r) for r in rows["exchange_received_other"]["cells"]} == {4, 8}  # the largest tensor count's points
    assert rows["manifest_read"]["cells"]["8"]["value"] == planning[-1]["manifest_bytes"]
    # a shared load: a non-zero rank receives the head and its share, less than the whole manifest at 8 ranks too
    sl = planning[-1]["shared_load"]
    assert rows["shared_received"]["cells"]["8"]["value"] == sl["head_bytes"] + sl["share_bytes"] > 0
    assert sl["share_bytes"] < planning[-1]["manifest_bytes"] and sl["storage_reads_after"] == 1

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
    assert "planning at a first save from synthetic metadata" in table
    assert "many small tensors" in table and "pieces" in table
    for part in bench_scale.PARTS:
        assert (tmp_path / f"p-{part}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --project: the projection of earlier runs' JSON, nothing run
    assert bench_scale.main(["--project", f"{js},{js}"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("| per rank, 20 tensors a rank | 4 ranks | 8 ranks |")
    assert "a non-zero rank" in printed and "rank 0 receives" in printed
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


def test_collective_bytes_follow_the_comm_protocol():
    """gather: a slot from each rank, a long pickle whole after it, nothing back to a non-zero rank; broadcast:
    a slot (and the pickle when long) to each rank; scatter: each rank's own slot and long pickle only."""
    g = exchange.gather([10, 200, SLOT, 30])
    assert g["sent"] == [0, SLOT, 2 * SLOT, SLOT] and g["received"] == [4 * SLOT, 0, 0, 0]
    assert g["point_to_point"] == 1 and g["messages"] == [0, 1, 2, 1]
    b = exchange.broadcast(SLOT, 3)
    assert b["received"] == [0, 2 * SLOT, 2 * SLOT] and b["sent"] == [4 * SLOT, 0, 0]
    assert exchange.broadcast(10, 3)["received"] == [0, SLOT, SLOT]
    s = exchange.scatter([SLOT, 10, SLOT + 1])
    assert s["received"] == [0, SLOT, 2 * SLOT + 1] and s["sent"] == [3 * SLOT + 1, 0, 0]
    total = exchange.summarize({"g": g, "b": exchange.broadcast(10, 4)}, own=[1, 2, 3, 4])
    assert total["rank0"] == {"sent_bytes": 3 * SLOT, "received_bytes": 4 * SLOT, "messages": 3}
    assert total["other"]["sent_bytes"] == 2 * SLOT and total["other"]["rank_sending_most"] == 2
    assert total["other"]["received_bytes"] == SLOT and total["other"]["own_metadata_bytes"] == 4


def test_messages_are_the_real_objects():
    """The exchange's messages are what planning/rounds.py sends: a Report, encode_meta's bytes, a share that
    own_files accepts, the digests of the keys the share names."""
    import pickle

    from nostall.planning import replicas
    from nostall.planning.plan import decode_meta, encode_meta, own_files, owned_pieces
    from nostall.planning.rounds import Report

    metas = bench_scale.synthetic_metas(16, 10)
    assert isinstance(exchange.report(3), Report) and exchange.report(3).holds == ""
    plan = build_plan([decode_meta(encode_meta(m)) for m in metas])
    copies = replicas.copies_of(replicas.shared_keys(metas), 16)
    owned = owned_pieces(plan, metas[5], 5)
    index = {t.key: i for i, t in enumerate(metas[5].tensors)}
    (plan_id, got, idx, total), check = pickle.loads(pickle.dumps(exchange.share(owned, [index[k] for k in copies[5]],
                                                                                 123, True)))
    assert own_files(metas[5], 5, 16, got) == tuple(plan.files_of(5)) and check is True
    assert set(exchange.digests_message(metas[5], idx, 7)) == set(copies[5]) != set()


def test_unmeasured_points_count_the_same_bytes():
    """A point whose rank 0 planning is computed counts the same bytes as a measured one (shares from
    shared_keys over metadata made on the fly, owned flags of the same length)."""
    measured = bench_scale._planning_point(16, 10, 1, True)
    streamed = bench_scale._planning_point(16, 10, 1, False)
    assert streamed["exchange"] == measured["exchange"] and streamed["pieces"] == measured["pieces"]
    assert "own_files_owned_s" in measured["other"] and "own_files_owned_s" not in streamed["other"]


def test_points_above_measure_up_to_are_computed_and_labelled(tmp_path):
    """Above --measure-up-to rank 0's planning, the manifest and the commit figures are computed (and say how);
    a non-zero rank's work and the byte counts of the plan exchange are still measured; the distinct boxes are
    the plan's pieces. A non-zero rank's bytes do not grow with the ranks; rank 0's do."""
    out = bench_scale.run_scale(["planning"], [4, 8, 16, 32], [10], reps=1, root=str(tmp_path), measure_up_to=8)
    p4, p8, p16, p32 = out["planning"]
    assert all("through the 4 and 8-rank points" in p32["computed"][f] for f in bench_scale.COMPUTED_TIMES)
    assert "as at 8 ranks" in p32["computed"]["commit"]  # from the measured points only
    assert p4["computed"] == p8["computed"] == {}
    computed = {"manifest_bytes", "parse_memory_estimate", "commit"}
    assert set(p16["computed"]) == set(bench_scale.COMPUTED_TIMES) | computed
    assert all("power law" in p16["computed"][f] for f in bench_scale.COMPUTED_TIMES)
    assert _finite(p16["plan_s"] + p16["parse_s"]) and p16["manifest_bytes"] > p8["manifest_bytes"]
    assert _finite([p16["other"]["thread_s"]])
    _check_byte_counts(p16)  # its commit scaled from the 8-rank point
    assert p16["commit"]["async"]["rank0_reads_bytes"] == p8["commit"]["async"]["rank0_reads_bytes"] * 2
    assert p16["commit"]["sync"]["other"] == p8["commit"]["sync"]["other"]
    assert p16["pieces"] == bench_scale.distinct_pieces(bench_scale.synthetic_metas(16, 10))
    plan = build_plan(bench_scale.synthetic_metas(16, 10))
    assert p16["pieces"] == sum(len(t.pieces) for t in plan.tensors.values()) + sum(len(d) for d in plan.per_rank)
    for a, b in ((p4, p8), (p8, p16)):
        assert a["exchange"]["other"]["received_bytes"] == b["exchange"]["other"]["received_bytes"]
        assert a["exchange"]["rank0"]["received_bytes"] < b["exchange"]["rank0"]["received_bytes"]
        # the goal of issue 26: a non-zero rank receives at most 2 x its own metadata + 64 KiB
        o = b["exchange"]["other"]
        assert o["received_bytes"] <= 2 * o["own_metadata_bytes"] + 64 * 1024
    rows = {r["key"]: r for r in out["projection"]}
    assert "load_share" not in rows  # no load part: no load figure
    assert rows["plan_thread_rank0"]["cells"][16]["how"].startswith("computed")
    assert rows["plan_thread_other"]["cells"][16]["how"].startswith("measured")
    assert rows["exchange_sent_other"]["cells"][16]["how"] == projection.COUNTED
    assert rows["exchange_received_rank0"]["cells"][16]["value"] == p16["exchange"]["rank0"]["received_bytes"]
