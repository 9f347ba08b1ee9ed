"""Export at save time on 2 ranks against ``nostall convert --to safetensors`` on one process, same state,
same run; and the stall of an async save with and without the export.

    .venv/bin/python benchmarks/export_at_save.py --mb-per-rank 256 --saves 4

Two gloo ranks hold a model-like state (``--tensors`` weights of 1024 float32 columns, each split by rows
over the ranks, FSDP-style) and save it asynchronously ``2 x --saves`` times, alternating a save that
exports (``HFExport``) and one that does not, ``--gap`` seconds apart (the training between saves: long
enough for the export to finish). Reported: the export's time on rank 0 (from its start, within ~50 ms of
the commit, until the export is visible: both ranks' files, the index, the rename), the median stall with
and without export (rank 0 and rank 1), then, in fresh processes on the same committed checkpoints (page
cache as warm), the offline export (``nostall.interop.export.export``, the code behind ``nostall convert
--to safetensors``, timed around the call), each rank's share of the export alone (``HFExport.run`` for rank 1
then rank 0, one process: the work split without the two ranks competing for the machine) and the whole CLI
(``nostall convert``, process start included); and the same export run by both ranks at once after
the saves, away from any save (what two ranks get from the machine). ``--export-dir /dev/shm`` puts both
exports in memory (the disk out of the comparison). Ratios are within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _rank(rank: int, world: int, init: str, root: str, hf: str, mb: int, tensors: int, saves: int, gap: float,
          out: str) -> None:
    import shutil

    import torch
    import torch.distributed as dist

    import nostall
    from nostall.interop.hf_export import HFExport

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    cols = 1024
    rows = max(world, mb * (1 << 20) // 4 // cols // tensors * world)  # global rows per tensor
    per = rows // world
    weights = {f"layers.{i}.weight": torch.randn(per, cols) for i in range(tensors)}
    state = {"model": {k: nostall.ShardedTensor(v, (per * world, cols), (per * rank, 0)) for k, v in weights.items()}}
    res: dict = {"stall_export": [], "stall_plain": [], "export_s": [], "files": [], "export_wait_after_gap_s": [],
                 "cpu_export": [], "cpu_plain": []}
    with nostall.CheckpointManager(root, async_save=True, timeout=600, keep_last=None,
                                   export=HFExport(os.path.join(hf, "step_{step}"))) as mgr:
        mgr.prepare(state)
        mgr.save(0, state, export=False).result()  # warm-up (writer, area)
        for i in range(1, 2 * saves + 1):
            for w in weights.values():
                w.add_(1.0)
            exporting = i % 2 == 0
            c = time.process_time()  # this process's CPU, all threads: the save, then the export in the gap
            h = mgr.save(i, state, export=None if exporting else False)
            time.sleep(gap)
            res["stall_export" if exporting else "stall_plain"].append(h.stats.stall_s)
            if not exporting:
                h.result()
            if exporting:
                t = time.perf_counter()
                o = mgr.export_result()
                res["export_wait_after_gap_s"].append(time.perf_counter() - t)  # ~0: it finished in the gap
                res["export_s"].append(o.seconds)
                res["files"].append(o.files)
                if rank == 0:
                    shutil.rmtree(o.path or "")  # measured: make room (the export may be in tmpfs)
            res["cpu_export" if exporting else "cpu_plain"].append(time.process_time() - c)
    # the same shares again, both ranks at once but away from any save: what the machine gives two ranks
    from nostall.core.exports import ExportJob

    res["later_parallel_s"] = []
    for i in range(2, 2 * saves + 1, 2):
        dist.barrier()
        t = time.perf_counter()
        o = HFExport(os.path.join(hf, "again_{step}")).run(ExportJob(os.path.join(root, f"step_{i}"), i, rank, world,
                                                                     600.0))
        res["later_parallel_s"].append(time.perf_counter() - t)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(o.path or "")
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


PARTS = """
import sys, time, json
from nostall.core.exports import ExportJob
from nostall.interop.hf_export import HFExport
src, dst = sys.argv[1], sys.argv[2]
out = []
for rank in (1, 0):  # each rank's share alone, one after the other (rank 0 last: it publishes)
    t = time.perf_counter()
    HFExport(dst).run(ExportJob(src, None, rank, 2, 600.0))
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""

OFFLINE = """
import sys, time, shutil, json
from nostall.interop.export import export
src, dst = sys.argv[1], sys.argv[2]
t, c = time.perf_counter(), time.process_time()
export(src, dst, keys=["model"], strip_prefix="model")
print(json.dumps([time.perf_counter() - t, time.process_time() - c]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb-per-rank", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--saves", type=int, default=4, help="saves with export (as many without)")
    ap.add_argument("--gap", type=float, default=4.0, help="seconds of 'training' after each save")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--export-dir", default=None,
                    help="where both exports go (default: beside the checkpoints; /dev/shm takes the disk out)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import multiprocessing as mp

    base = tempfile.mkdtemp(prefix="nostall-export-bench-", dir=a.dir)
    try:
        ebase = tempfile.mkdtemp(prefix="nostall-export-bench-", dir=a.export_dir) if a.export_dir else base
        root, hf, out = os.path.join(base, "run"), os.path.join(ebase, "hf"), os.path.join(base, "res")
        init = os.path.join(base, "init")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, 2, init, root, hf, a.mb_per_rank, a.tensors, a.saves, a.gap,
                                                 out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(3600)
            if p.exitcode != 0:
                raise SystemExit(f"a rank failed (exit code {p.exitcode})")
        ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
        steps = [i for i in range(1, 2 * a.saves + 1) if i % 2 == 0]
        offline, offline_cpu, cli, parts = [], [], [], []
        for step in steps:
            src, dst = os.path.join(root, f"step_{step}"), os.path.join(ebase, f"offline_{step}")
            r = subprocess.run([sys.executable, "-c", OFFLINE, src, dst], check=True, capture_output=True, text=True)
            wall, cpu = json.loads(r.stdout.strip().splitlines()[-1])
            offline.append(wall)
            offline_cpu.append(cpu)
            shutil.rmtree(dst)
            r = subprocess.run([sys.executable, "-c", PARTS, src, dst], check=True, capture_output=True, text=True)
            parts.append(json.loads(r.stdout.strip().splitlines()[-1]))
            shutil.rmtree(dst)
            t = time.perf_counter()
            subprocess.run([os.path.join(os.path.dirname(sys.executable), "nostall"), "convert", src, dst, "--to",
                            "safetensors", "--keys", "model", "--strip-prefix", "model", "--no-progress"],
                           check=True, capture_output=True)
            cli.append(time.perf_counter() - t)
            shutil.rmtree(dst)
        med = statistics.median
        doc = {
            "mb_per_rank": a.mb_per_rank, "tensors": a.tensors, "saves": a.saves, "gap_s": a.gap,
            "export_at_save_s": ranks[0]["export_s"], "offline_export_s": offline, "cli_convert_s": cli,
            "cpu_export_s": [r["cpu_export"] for r in ranks], "cpu_plain_s": [r["cpu_plain"] for r in ranks],
            "offline_cpu_s": offline_cpu,
            "export_wait_after_gap_s": [r["export_wait_after_gap_s"] for r in ranks],
            "files_rank0": ranks[0]["files"][0], "files_rank1": ranks[1]["files"][0],
            "stall_export_s": [r["stall_export"] for r in ranks], "stall_plain_s": [r["stall_plain"] for r in ranks],
        }
        ratio = med(ranks[0]["export_s"]) / med(offline)
        print(f"state: 2 ranks x {a.mb_per_rank} MiB, {a.tensors} tensors; {a.saves} saves with export, "
              f"{a.saves} without; exports to {'the checkpoints disk' if ebase == base else a.export_dir}")
        print(f"export at save time (2 ranks), median {med(ranks[0]['export_s']):.3f} s "
              f"(runs {', '.join(f'{x:.3f}' for x in ranks[0]['export_s'])})")
        print(f"offline export (1 process, the call), median {med(offline):.3f} s "
              f"(runs {', '.join(f'{x:.3f}' for x in offline)}); ratio {ratio:.2f}")
        lp = ranks[0]["later_parallel_s"]
        print(f"the same export on both ranks at once, later, away from any save: median {med(lp):.3f} s "
              f"(runs {', '.join(f'{x:.3f}' for x in lp)}); ratio {med(lp) / med(offline):.2f}")
        doc["later_parallel_s"] = lp
        p1, p0 = med([p[0] for p in parts]), med([p[1] for p in parts])
        print(f"each rank's share alone (one process, one after the other): rank 0 {p0:.3f} s, rank 1 {p1:.3f} s; "
              f"ratio to the offline export {max(p0, p1) / med(offline):.2f} (the larger)")
        doc["parts_alone_s"] = parts
        cpu_each = [med(r["cpu_export"]) - med(r["cpu_plain"]) for r in ranks]
        print(f"CPU time of the export (a rank's CPU over a save with export minus one without, medians): "
              f"{cpu_each[0]:.3f} / {cpu_each[1]:.3f} s; offline export {med(offline_cpu):.3f} s; ratio (the busier "
              f"rank) {max(cpu_each) / med(offline_cpu):.2f}")
        print(f"nostall convert CLI (1 process, start included), median {med(cli):.3f} s; "
              f"ratio {med(ranks[0]['export_s']) / med(cli):.2f}")
        print(f"waited for the export after the gap: max {max(max(r['export_wait_after_gap_s']) for r in ranks):.3f} s")
        for r in range(2):
            se, sp = med(ranks[r]["stall_export"]), med(ranks[r]["stall_plain"])
            print(f"rank {r}: stall with export {se * 1e3:.1f} ms, without {sp * 1e3:.1f} ms (ratio {se / sp:.2f}); "
                  f"runs with {[round(x * 1e3, 1) for x in ranks[r]['stall_export']]}, "
                  f"without {[round(x * 1e3, 1) for x in ranks[r]['stall_plain']]}")
        doc["ratio_export_vs_offline"] = ratio
        if a.json:
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=2)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if a.export_dir:
            shutil.rmtree(ebase, ignore_errors=True)


if __name__ == "__main__":
    main()
