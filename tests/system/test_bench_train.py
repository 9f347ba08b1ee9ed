"""``nostall bench train``'s smoke configuration: it runs, verifies every checkpoint, and its output is well formed.

No timing is asserted: only the shape of the figures, the verification counts, the table and the plot.
"""

from __future__ import annotations

import glob
import json
import math

from nostall.tools.bench import train as bench_train


def _finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def _bench_dirs():
    return set(glob.glob("/dev/shm/nostall-bench-*"))


def test_bench_train_smoke(tmp_path, capsys):
    before = _bench_dirs()
    js, png = tmp_path / "bt.json", tmp_path / "bt.png"
    rc = bench_train.main(["--ranks", "2", "--mb-per-rank", "4", "--steps", "5", "--every", "2", "--reps", "1",
                           "--compute-ms", "10", "--dir", str(tmp_path / "run"), "--json", str(js), "--plot",
                           str(png), "--quiet"])
    assert rc == 0
    table = capsys.readouterr().out
    out = json.loads(js.read_text())

    c = out["config"]
    assert c["ranks"] == 2 and c["bytes_per_rank"] > 0 and c["steps"] == 5 and c["every"] == 2
    assert c["save_steps"] == [2, 4] and c["saves_per_run"] == 2  # never on the last step
    assert c["compute"] == ["device", "host"] and c["host_passes"] >= 1
    assert set(out) >= {"config", "machine", "copy_floor_s", "summary", "ratios", "verified", "mismatches", "runs",
                        "walls", "saturated", "host_busy_cores"}
    assert _finite(out["copy_floor_s"]["median"])

    # every checkpoint of every run loaded back and equal to the state at its save: step 0 and each save,
    # per rank and compute model; nostall_memory: what its run holds (step 0, persistent; the memory tier's
    # newest, step 4, restored by load() from memory: --persist-every defaults to 10 x --every)
    assert out["mismatches"] == []
    assert out["verified"] == {name: 2 * 2 * (2 if name == "nostall_memory" else 1 + 2)
                               for name in bench_train.SYSTEMS}
    assert c["persist_every"] == 20
    assert c["memory_holders_stopped"] == [] and _bench_dirs() == before  # every holder left, its directory gone

    for compute in ("device", "host"):
        s = out["summary"][compute]
        assert set(s) == {"baseline", *bench_train.SYSTEMS}
        assert _finite(s["baseline"]["wall_s"]["median"]) and _finite(s["baseline"]["after_save_p99_s"])
        assert 0 <= s["baseline"]["machine_busy"]["median"] <= 1
        for name in bench_train.SYSTEMS:
            r = s[name]
            for field in ("overhead_per_save_s", "loss_pct", "loss_every20_pct", "wait_previous_s", "call_s",
                          "before_step_s", "drain_s"):
                assert r[field]["min"] <= r[field]["median"] <= r[field]["max"], (compute, name, field)
            for field in ("save_step_p50_s", "save_step_p99_s", "after_save_p50_s", "after_save_p99_s"):
                assert _finite(r[field]) and r[field] > 0, (compute, name, field)
            assert r["verified"] == (2 if name == "nostall_memory" else 3)  # rank 0's, in its one run
        assert "staged_wait_s" in s["nostall_overlap"]
        assert _finite(s["baseline"]["step_p99_s"])
        for name in bench_train.SYSTEMS:  # steps while a background save is in flight: nostall's async saves only
            r = s[name]
            background = name in ("nostall_async", "nostall_overlap", "nostall_async_capped", "nostall_memory")
            assert _finite(r["in_flight_p50_s"]) == background, (compute, name)
            if background:  # the step after each save overlaps its writer's window, at least
                assert r["in_flight_p50_s"] <= r["in_flight_p99_s"] and r["in_flight_steps_per_save"]["min"] >= 1
                assert _finite(r["interference_per_save_s"]["median"]) and _finite(r["quiet_p50_s"])
        rs = out["ratios"][compute]
        assert {"nostall_async / copy_floor", "nostall_async / dcp_best_async", "nostall_overlap / nostall_async",
                "nostall_sync / dcp_sync", "nostall_memory / nostall_async",
                "nostall_memory call / copy_floor"} <= set(rs)
        run = out["runs"][compute]["nostall_overlap"][0]
        assert len(run["step_s"]) == 5 and [d["step"] for d in run["saves"]] == [2, 4]
        assert len(run["step_t0_s"]) == 5 and all(d["write_s"] > 0 and d["t_call_s"] > 0 for d in run["saves"])

    assert "== device compute" in table and "== host compute" in table and "nostall_overlap" in table
    assert "mismatches: 0" in table and "in flight" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # each run's directory deleted


def test_bench_train_memory_tier_with_a_persistent_save_in_the_run(tmp_path, capsys):
    """nostall_memory with --persist-every 4: step 4 goes to the persistent root, 2 and 6 to memory; the run
    ends holding 0 and 4 (persistent) and 6 (the memory tier's newest, restored by load() from memory)."""
    before = _bench_dirs()
    js = tmp_path / "bt.json"
    rc = bench_train.main(["--ranks", "2", "--mb-per-rank", "4", "--steps", "7", "--every", "2", "--reps", "1",
                           "--compute-ms", "10", "--compute", "device", "--systems", "nostall_memory,nostall_async",
                           "--persist-every", "4", "--dir", str(tmp_path / "run"), "--json", str(js), "--quiet"])
    assert rc == 0
    out = json.loads(js.read_text())
    assert out["config"]["save_steps"] == [2, 4, 6] and out["config"]["persist_every"] == 4
    assert out["mismatches"] == [] and out["verified"] == {"nostall_memory": 2 * 3, "nostall_async": 2 * 4}
    s = out["summary"]["device"]["nostall_memory"]
    assert _finite(s["loss_pct"]["median"]) and s["call_s"]["median"] > 0
    assert [d["step"] for d in out["runs"]["device"]["nostall_memory"][0]["saves"]] == [2, 4, 6]
    assert out["config"]["memory_holders_stopped"] == [] and _bench_dirs() == before
    assert "nostall_memory" in capsys.readouterr().out


def test_bench_train_rejects_a_run_without_a_step_after_its_save():
    try:
        bench_train.run_bench(steps=3, every=3)
    except ValueError as e:
        assert "--every" in str(e)
    else:
        raise AssertionError("run_bench accepted --steps 3 --every 3")


def test_verify_reports_a_checkpoint_that_differs_from_the_state_at_its_save():
    """The verification itself: a changed byte, or a wrong saved step, is a mismatch naming the step."""
    from types import SimpleNamespace

    import torch

    tensors = [torch.arange(8, dtype=torch.float32), torch.ones(2, 3)]
    st = SimpleNamespace(torch=torch, tensors=tensors)
    st.digests = lambda ts=None: bench_train._State.digests(st, ts)  # type: ignore[arg-type]
    rank = object.__new__(bench_train._Rank)
    rank.rank, rank.st, rank.save_steps = 0, st, [2, 4]
    rank.ref = {0: st.digests(), 2: st.digests(), 4: st.digests()}

    class Fake(bench_train._System):
        name = "fake"

        def load_into(self, step, template):
            got = [t.clone() for t in tensors]
            if step == 2:
                got[1][1, 2] += 1  # one element of one tensor
            return got, (step if step != 4 else 5)

    n, bad = rank.verify(Fake(rank), {"model": {}, "step": 0})
    assert n == 3
    assert len(bad) == 2
    assert "step 2" in bad[0] and "1 tensor(s) differ" in bad[0] and "#1" in bad[0]
    assert "step 4" in bad[1] and "saved step value 5" in bad[1]


def test_in_flight_splits_a_runs_steps_by_the_saves_writer_windows():
    """Steps overlapping [call, call + call_s + write_s + commit_s] are in flight; the saving steps are in neither."""
    run = {"step_s": [1.0] * 6, "step_t0_s": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
           "saves": [{"step": 2, "t_call_s": 1.9, "call_s": 0.05, "write_s": 1.5, "commit_s": 0.1}]}
    busy, quiet, counts = bench_train.in_flight(run)
    assert counts == [2] and len(busy) == 2 and len(quiet) == 3  # steps 3 and 4 in flight; 1, 5, 6 quiet
    assert bench_train.in_flight({"step_s": [1.0], "step_t0_s": [0.0], "saves": [{"step": 1, "t_call_s": 0.5,
                                                                                    "call_s": 0.1}]}) == ([], [], [])
