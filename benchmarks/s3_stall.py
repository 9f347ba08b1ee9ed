"""Stall of an async save to s3:// against the same save to a local directory (2 CPU ranks).

    .venv/bin/python benchmarks/s3_stall.py --mb-per-rank 64 --saves 5

Starts an S3-compatible server (moto's server mode) on 127.0.0.1. It then
runs 2 gloo ranks that each prepare a manager and save ``--saves`` times, ``--gap`` seconds apart,
once to a local root and once to ``s3://``, asynchronously. It prints the
median stall per destination (rank 0), its parts, and their ratio. Needs
the test extras (moto, s3fs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, init: str, roots: list, so: dict, mb: int, saves: int, out: str,
          gap: float) -> None:
    import torch
    import torch.distributed as dist

    import nostall

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    n = mb * (1 << 20) // 4
    w = torch.randn(n)
    state = {"w": nostall.ShardedTensor(w, (n * world,), (n * rank,))}
    results = {}
    for root in roots:
        mgr = nostall.CheckpointManager(root, keep_last=2, async_save=True, storage_options=so, timeout=300)
        mgr.prepare(state)
        handles = []
        for step in range(1, saves + 1):
            w.add_(1.0)
            handles.append(mgr.save(step, state))
            time.sleep(gap)  # training, long enough for the previous save to commit
        mgr.finalize_pending_saves()
        stats = [h.result() for h in handles]
        results[root] = {"stall": [s.stall_s for s in stats], "total": [s.total_s for s in stats],
                         "wait": [s.wait_s for s in stats], "plan": [s.plan_s for s in stats],
                         "stage": [s.stage_s for s in stats]}
        mgr.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb-per-rank", type=int, default=64)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--gap", type=float, default=3.0, help="seconds of 'training' between saves")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        import boto3

        boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="x",
                     aws_secret_access_key="x").create_bucket(Bucket="bench")
        so = {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"}}
        with tempfile.TemporaryDirectory() as tmp:
            roots = [os.path.join(tmp, "local"), "s3://bench/run"]
            out = os.path.join(tmp, "out.json")
            mp.start_processes(_rank, args=(2, os.path.join(tmp, "init"), roots, so, a.mb_per_rank, a.saves, out,
                                                  a.gap),
                               nprocs=2, start_method="spawn")
            with open(out) as f:
                res = json.load(f)
    finally:
        server.terminate()
        server.wait(10)
    local, s3 = res[roots[0]], res["s3://bench/run"]
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    print(f"2 ranks x {a.mb_per_rank} MiB, {a.saves} async saves each (rank 0, medians)")
    for name, r in (("local", local), ("s3://", s3)):
        print(f"  {name:6s}  stall {ms(r['stall']):7.1f} ms (plan {ms(r['plan']):6.1f}, stage {ms(r['stage']):6.1f}, "
              f"waiting for the previous save {ms(r['wait']):6.1f})")
    print(f"  s3 stall / local stall = {statistics.median(s3['stall']) / statistics.median(local['stall']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
