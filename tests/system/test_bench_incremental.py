"""``nostall bench incremental``'s smoke configuration: it runs, its incremental checkpoints load bit-exactly,
the LoRA-shaped incremental saves write fewer bytes than full ones, and its output is well formed.

No timing is asserted: only byte counts, the shape of the figures, the verification, the table and the plot.
"""

from __future__ import annotations

import json
import math

from nostall.tools.bench import incremental as bi


def _finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def test_bench_incremental_smoke(tmp_path, capsys):
    js, png = tmp_path / "bi.json", tmp_path / "bi.png"
    rc = bi.main(["--ranks", "2", "--mb-per-rank", "4", "--reps", "1", "--saves", "2", "--dir",
                  str(tmp_path / "run"), "--json", str(js), "--plot", str(png), "--quiet"])
    assert rc == 0
    table = capsys.readouterr().out
    out = json.loads(js.read_text())

    assert set(out) >= {"config", "machine", "states", "hash", "summary", "goals", "verified",
                        "verification_passed", "mismatches", "runs"}
    c = out["config"]
    assert c["ranks"] == 2 and c["reps"] == 1 and c["saves"] == 2 and c["bytes_per_rank"] > 0
    assert c["systems"] == list(bi.SYSTEMS) and c["states"] == list(bi.STATES)

    lora, every = out["states"]["lora"], out["states"]["everything"]
    assert lora["bytes"] == every["bytes"] == 2 * c["bytes_per_rank"]
    assert every["changed_bytes_per_save"] == every["bytes"]
    assert 0 < lora["changed_bytes_per_save"] < 0.15 * lora["bytes"]  # the adapter and its moments: ~10%

    assert _finite(out["hash"]["s"]) and out["hash"]["s"] > 0 and out["hash"]["algorithm"] == "xxh3-128"

    for kind in bi.STATES:
        for system in bi.SYSTEMS:
            r = out["summary"][kind][system]
            assert r["saves"] == 2, (kind, system)
            for field in ("stall_s", "durable_s", "bytes_written", "disk_bytes"):
                assert r[field]["min"] <= r[field]["median"] <= r[field]["max"], (kind, system, field)
            (run,) = out["runs"][kind][system]
            assert [s["step"] for s in run["saves"]] == [1, 2] and run["first"]["step"] == 0
            # the first save of every system writes the whole state
            assert run["first"]["bytes_written"] >= lora["bytes"]

    # byte counts, not times: full saves write every byte; LoRA-shaped incremental ones only the changed pieces
    for mode in ("async", "sync"):
        full = out["runs"]["lora"][f"full_{mode}"][0]["saves"]
        inc = out["runs"]["lora"][f"incremental_{mode}"][0]["saves"]
        for f, i in zip(full, inc):
            assert f["bytes_written"] >= lora["bytes"]
            assert lora["changed_bytes_per_save"] <= i["bytes_written"] < f["bytes_written"]
            assert i["disk_bytes"] == i["bytes_written"]  # what the stats say is what the files hold
        # everything changed: an incremental save writes it all too
        assert out["runs"]["everything"][f"incremental_{mode}"][0]["saves"][-1]["bytes_written"] >= every["bytes"]
        g = out["goals"][f"lora incremental_{mode}: bytes written per save / bytes changed"]
        assert _finite(g["value"]) and g["value"] >= 1.0
        assert set(out["goals"][f"everything until durable: incremental_{mode} / full_{mode}"]) >= {
            "value", "difference_s", "hash_s", "met"}

    # the last checkpoint of every incremental run loaded bit-exactly
    assert out["verification_passed"] is True and out["mismatches"] == []
    assert out["verified"] == {f"{k}/{s}": [True] for k in bi.STATES for s in bi.SYSTEMS if s.startswith("incr")}
    assert "verification:" in table and "passed" in table and "incremental_async" in table
    assert png.stat().st_size > 0


def test_layer_sizes_split():
    base, adapter = bi.layer_sizes(256)
    per_rank = 256 * 2**20
    base_bytes = bi.LAYERS * base * bi.COLS * 4
    moving = 3 * 2 * bi.LAYERS * adapter * bi.COLS * 4  # two adapter matrices per layer, each with two moments
    assert abs(base_bytes / per_rank - 0.9) < 0.01 and abs(moving / per_rank - 0.1) < 0.01
