"""The benchmark's smoke configuration: it runs and produces well-formed output (figures not asserted)."""

from __future__ import annotations

import glob
import json
import math
import os

from nostall.tools.bench import compare as bench
from nostall.tools.bench import restore as restore_section


def _bench_dirs():
    return set(glob.glob("/dev/shm/nostall-bench-*"))


def test_bench_smoke(tmp_path):
    shm_before = _bench_dirs()
    out = bench.run_bench(ranks=2, mb=2, reps=1, systems=list(bench.SYSTEMS), root=str(tmp_path / "run"),
                          small_mb=[1], small_reps=2, restore=True)
    assert set(out) >= {"config", "machine", "systems", "loads", "training"}
    assert out["config"]["ranks"] == 2 and out["config"]["bytes_per_rank"] > 0
    assert set(out["systems"]) == set(bench.SYSTEMS) | set(bench.LIMITS)
    for name, r in out["systems"].items():
        for field in ("stall_s", "commit_s", "throughput_gbps", "rss_mb"):
            assert len(r[field]) == 1 and all(math.isfinite(x) and x >= 0 for x in r[field]), (name, field)
        assert r["first_save"]["commit_s"] >= r["first_save"]["stall_s"] >= 0
        assert r["commit_s"][0] >= r["stall_s"][0]
    small = out["small"]["1"]  # the small-state rows: nostall's async stall beside DCP's and the copy floor
    assert small["bytes"] > 0
    for field in ("copy", "nostall_async", "dcp_async_thread"):
        assert len(small[field]) == 2 and all(math.isfinite(x) and x >= 0 for x in small[field]), field
    assert out["interrupted"] is False
    assert set(out["loads"]) == {"nostall", "dcp", "read_floor"}
    assert {"baseline_step_s", "nostall_async", "nostall_overlap", "dcp_async_thread",
            "dcp_async_process"} <= set(out["training"])
    during, before = out["systems"]["nostall_overlap"]["compute_ms"][0]
    assert during > 0 and before > 0
    # the restore section: fresh processes restored the memory snapshot, 0 bytes from the persistent root,
    # every load equal to the saved state; its holder left by itself and its directory is gone
    r = out["restore"]
    assert r["problems"] == [] and r["holders_stopped"] == []
    for rank in ("0", "1"):
        assert r["restored"][rank] == {"tier": "memory", "step": restore_section.PERSIST + 1,
                                       "persistent_bytes_read": 0, "fell_back": None}
        assert r["bytes_per_rank"][rank] > 0
        for name in ("memory_first", "memory", "persistent", "dcp"):  # what each load's read calls returned
            assert r["read_bytes"][rank][name] >= r["bytes_per_rank"][rank], (rank, name)
    assert set(r["seconds"]) == set(restore_section.SYSTEMS)
    assert all(len(r["seconds"][s]) == 1 for s in restore_section.SYSTEMS)  # the first load, then reps=1 round
    assert all(x > 0 for xs in r["seconds"].values() for x in xs)
    assert all(math.isfinite(v) and v > 0 for v in r["over_memcpy"].values())
    assert all(math.isfinite(v) and v > 0 for v in r["over_dcp"].values())
    assert r["startup_s"]["total_s"] >= r["startup_s"]["manager_s"] > 0
    assert not os.path.exists(r["memory_dir"]) and _bench_dirs() == shm_before
    json.dumps(out)  # JSON-able
    table = bench.format_table(out)
    assert "restore after a trainer crash" in table and "DCP load of the same state" in table
    assert "nostall_async" in table and "dcp_sync" in table and "nostall_overlap stall / nostall_async" in table
    assert "small states, async stall" in table and "  1.0 MiB" in table
    png = tmp_path / "p.png"
    bench.plot(out, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_remote_destination(tmp_path, s3):
    """--remote adds nostall_async_remote (an s3:// save on the loopback server) and removes its prefix after."""
    bucket = s3.make_bucket("bench")
    out = bench.run_bench(ranks=2, mb=2, reps=1, systems=["nostall_async"], root=str(tmp_path / "run"), loads=False,
                          train=False, remote=f"s3://{bucket}/b", storage_options=s3.storage_options)
    assert out["restore"] == {}
    r = out["systems"][bench.REMOTE]
    assert len(r["stall_s"]) == 1 and r["commit_s"][0] >= r["stall_s"][0] > 0
    assert f"{bench.REMOTE} stall / nostall_async stall" in bench.format_table(out)
    assert s3.filesystem().ls(bucket, refresh=True) == []  # the bench's prefix is gone


def test_memory_dir_stops_a_holder_left_behind_and_removes_itself():
    """A bench's tier directory (common.MemoryDir): a holder no manager released (a crashed run) is stopped by
    close(), which names it, and the directory is gone; a holder of another directory is never touched."""
    from nostall.memory.rendezvous import base_dir, ensure_holder
    from nostall.tools.bench.common import MemoryDir
    from tests.dist_harness import process_alive

    other = MemoryDir()  # another job's tier, here a second directory: its holder must survive the first's close()
    md = MemoryDir()
    links = []
    try:
        for d in (md, other):
            link, proc = ensure_holder(base_dir(d.path), ("a" if d is md else "b") * 20, 600.0, 30.0)
            link.ask({"op": "attach", "rank": 0}, 30.0)
            links.append((link, proc))
            link.close()  # left without a release, as by a crashed trainer: the holder waits (idle_s 600)
        mine, theirs = links[0][0].pid, links[1][0].pid
        assert md.holders() == [mine] and other.holders() == [theirs]
        md.close()
        assert md.signalled == [mine] and not os.path.exists(md.path)
        links[0][1].wait(10)  # (started by this process: reaped here)
        assert not process_alive(mine) and process_alive(theirs)
    finally:
        other.close()
        md.close()
        for _, proc in links:
            if proc is not None:
                proc.wait(10)
    assert other.signalled == [theirs] and not os.path.exists(other.path)
