"""Time until durable of overlapped saves against plain async ones (2 CPU gloo ranks, device-like compute).

    .venv/bin/python benchmarks/overlap_durable.py --mb-per-rank 256 --saves 5

Each rank holds a ``ShardedTensor`` state of ``--mb-per-rank`` MiB (28 tensors: four large, 24 small) and two
managers, ``async_save=True`` with and without ``overlap=True``, each prepared and saved once first. Then
``--saves`` saves of each kind, alternated (ABAB, then BABA): ``save()``, a ``--compute-ms`` sleep (the next
forward/backward on a device: the host CPU idle), ``wait_until_staged()`` (the optimizer step), ``result()``.
Prints, as JSON, rank 0's times from the call to durable, their medians, and the ratio overlapped / plain
async. A/B against another tree: run it with ``PYTHONPATH=<tree>/src``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from typing import Any, Dict, List


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, root: str, args: Dict[str, Any], q: Any) -> None:
    import torch
    import torch.distributed as dist

    import nostall

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    n = args["mb"] * (1 << 20) // 4
    g = torch.Generator().manual_seed(rank)
    sizes = [n // 4, n // 8, n // 8, n // 8] + [n // 64] * 24
    state = {f"t{i}": nostall.ShardedTensor(torch.randn(k, generator=g), (world * k,), (rank * k,))
             for i, k in enumerate(sizes)}
    out: Dict[str, List[float]] = {"async": [], "overlap": []}
    mgrs = {m: nostall.CheckpointManager(os.path.join(root, m), async_save=True, overlap=m == "overlap", keep_last=1)
            for m in out}
    for mgr in mgrs.values():
        mgr.prepare(state)
        mgr.save(0, state).result()
    for k in range(1, args["saves"] + 1):
        for m in (["async", "overlap"] if k % 2 else ["overlap", "async"]):
            mgr = mgrs[m]
            dist.barrier()
            t0 = time.perf_counter()
            h = mgr.save(k, state)
            time.sleep(args["compute_ms"] / 1e3)
            mgr.wait_until_staged()
            h.result()
            out[m].append(time.perf_counter() - t0)
    for mgr in mgrs.values():
        mgr.close()
    dist.destroy_process_group()
    if rank == 0:
        q.put(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb-per-rank", type=int, default=256)
    ap.add_argument("--saves", type=int, default=5, help="saves of each kind (default: 5)")
    ap.add_argument("--compute-ms", type=float, default=150.0, help="the sleep after save() (default: 150)")
    ap.add_argument("--dir", default=None, help="where to save (default: a temporary directory, removed)")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(prefix="nostall-overlap-durable-", dir=a.dir)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = {"mb": a.mb_per_rank, "saves": a.saves, "compute_ms": a.compute_ms}
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, root, args, q)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        out = q.get(timeout=1800)
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(json.dumps({"until_durable_s": out, "median_s": med, "overlap / async": med["overlap"] / med["async"]}))


if __name__ == "__main__":
    main()
