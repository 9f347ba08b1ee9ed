"""How long does a save block training? Sync vs async vs a plain memory copy.

    .venv/bin/python benchmarks/stall.py [--ranks 2] [--mb 512] [--reps 5] [--dir DIR]

Each rank holds ``--mb`` MB of state (sharded and replicated tensors of mixed
sizes). Interleaved repetitions on the same state, in one run:

* copy:  ``copy_`` of the rank's tensors into an already-touched buffer (the
  floor for any stall that takes a copy);
* sync:  ``CheckpointManager.save`` (returns after the commit);
* async: ``CheckpointManager(async_save=True).save`` stall, i.e. the time the
  call blocks (the previous save is finalized before the timer starts), and
  the time until the checkpoint is committed.

Prints medians (min-max) per rank 0 and the ratios that matter.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def make_state(rank: int, world: int, mb: int):
    import nostall

    per = mb * (1 << 20) // 4  # float32 elements per rank
    sizes = [per // 4, per // 8, per // 8, per // 8] + [per // 64] * 24  # mixed sizes, sum = per
    state = {"model": {}, "optim": {}}
    for i, n in enumerate(sizes):
        t = torch.randn(n)
        if i % 5 == 4:  # replicated on every rank: written once, by one rank
            state["model"][f"rep{i}"] = t
        else:
            state["model"][f"w{i}"] = nostall.ShardedTensor(t, (n * world,), (n * rank,))
    return state


def _tensors(state):
    out = []
    for v in state["model"].values():
        out.append(v.data if hasattr(v, "global_shape") else v)
    return out


def _worker(rank, world, init, root, mb, reps, q):
    import nostall

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    state = make_state(rank, world, mb)
    tensors = _tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.zero_()
    res = {"copy": [], "sync": [], "async_stall": [], "async_total": [], "async_first_stall": None, "bytes": nbytes}
    sync = nostall.CheckpointManager(os.path.join(root, "sync"), keep_last=1)
    asy = nostall.CheckpointManager(os.path.join(root, "async"), keep_last=1, async_save=True)
    for rep in range(reps + 1):
        # plain copy into a touched buffer
        dist.barrier()
        t0 = time.perf_counter()
        pos = 0
        for t in tensors:
            n = t.numel() * 4
            buf[pos : pos + n].view(torch.float32).copy_(t)
            pos += n
        if rep:
            res["copy"].append(time.perf_counter() - t0)
        # sync save
        dist.barrier()
        h = sync.save(rep, state)
        if rep:
            res["sync"].append(h.stats.stall_s)
        # async save: stall, then time to commit
        asy.finalize_pending_saves()
        dist.barrier()
        t0 = time.perf_counter()
        h = asy.save(rep, state)
        stall = time.perf_counter() - t0
        st = h.result()
        if rep:
            res["async_stall"].append(stall)
            res["async_total"].append(st.total_s)
        else:
            res["async_first_stall"] = stall
            res["async_first"] = st.as_dict()
    sync.close()
    asy.close()
    q.put((rank, res))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mb", type=int, default=512, help="MB of state per rank")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="nostall-bench-")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    pc = mp.start_processes(_worker, args=(args.ranks, init, root, args.mb, args.reps, q), nprocs=args.ranks,
                            join=False, start_method="spawn")
    results = {}
    try:
        while len(results) < args.ranks:
            rank, res = q.get(timeout=1800)
            results[rank] = res
        pc.join(60)
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.kill()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    def fmt(xs):
        return f"{statistics.median(xs) * 1e3:8.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"

    r0 = results[0]
    gb = r0["bytes"] / 1e9
    print(f"{args.ranks} ranks x {r0['bytes'] / 2**20:.0f} MiB, {args.reps} repetitions, medians (min-max), rank 0")
    print(f"  plain copy into a touched buffer   {fmt(r0['copy'])}   {gb / statistics.median(r0['copy']):.1f} GB/s")
    print(f"  sync save (blocks until committed) {fmt(r0['sync'])}")
    f = r0["async_first"]
    print(f"  async save: first save stall       {r0['async_first_stall'] * 1e3:8.1f} ms "
          f"(plan {f['plan_s'] * 1e3:.0f} ms, allocate+stage {f['stage_s'] * 1e3:.0f} ms)")
    print(f"  async save: steady-state stall     {fmt(r0['async_stall'])}")
    print(f"  async save: time to commit         {fmt(r0['async_total'])}")
    ms = statistics.median
    print(f"  ratios: async stall / sync save = {ms(r0['async_stall']) / ms(r0['sync']):.3f}; "
          f"async stall / plain copy = {ms(r0['async_stall']) / ms(r0['copy']):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "mb": args.mb, "reps": args.reps, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
