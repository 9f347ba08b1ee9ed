"""Loads from copies that lack data files (issue 27) against a load of the whole checkpoint, 2 gloo ranks.

    .venv/bin/python benchmarks/partial_loads.py --mb 64 --rounds 3

Each rank saves ``--mb`` MiB (a row-sharded weight), then every round times, interleaved, three loads of
that checkpoint through the manager (each rank loads its own rows, every byte's checksum verified; each
variant first in turn):

* ``whole``: the checkpoint where it was saved (the baseline: each rank reads its file);
* ``copies``: each rank its own complete copy (``own_copies=True``: what the manifest digest and each file's
  open and size check add);
* ``peer``: rank 1's copy holds only the manifest (a replacement host), so rank 0 reads rank 1's bytes for
  it from its copy and sends them over the group.

Prints one JSON object: per variant and rank the best time and its bytes read / received, and each
variant's slowest rank as a ratio of the baseline's. The memory tier's restore across hosts is a ``peer``
load (``Tiers.restore``'s ``load_partial``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List

ROWS = 1024


def _rank(rank: int, world: int, base: str, mb: int, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import nostall
    from nostall.manager import _training

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{base}/rendezvous", rank=rank, world_size=world)
    cols = (mb << 20) // 4 // ROWS * world
    rows = ROWS // world
    w = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + rank

    def load(mgr: Any, path: str, own_copies: bool) -> Any:
        extra = {"w": nostall.ShardedTensor(torch.empty(rows, cols), (ROWS, cols), (rows * rank, 0))}
        training = _training(None, None, None, None, False, extra, None, "load")
        dist.barrier()
        t0 = time.perf_counter()
        with mgr._lock:  # internal: the memory tier's restore calls it so
            got = mgr._load_locked(training, None, path, None, True, True, "error", own_copies)
        seconds = time.perf_counter() - t0
        assert torch.equal(got.extra["w"].data, w), "a load was not bit-exact"
        return seconds, got.bytes_read, got.bytes_received

    with nostall.CheckpointManager(f"{base}/ck", timeout=300) as mgr:
        mgr.save(1, extra={"w": nostall.ShardedTensor(w, (ROWS, cols), (rows * rank, 0))})
        whole = mgr.path_for(1)
        full = f"{base}/full{rank}/step_1"
        bare = f"{base}/bare{rank}/step_1"
        shutil.copytree(whole, full)
        os.makedirs(bare)
        shutil.copy(os.path.join(whole, "manifest.json"), bare)
        variants = {"whole": (whole, False), "copies": (full, True),
                    "peer": (bare if rank == 1 else full, True)}
        times: Dict[str, List[Any]] = {k: [] for k in variants}
        names = list(variants)
        for i in range(rounds):
            for name in names[i % 3:] + names[:i % 3]:  # each variant first in turn
                path, own = variants[name]
                times[name].append(load(mgr, path, own))
    with open(f"{out}.{rank}", "w") as f:
        json.dump({k: min(v) for k, v in times.items()}, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=64, help="MiB saved by each rank (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three loads, the best taken (default 3)")
    p.add_argument("--dir", default=None, help="where the checkpoint and its copies go (default: a temp dir)")
    args = p.parse_args()
    import torch.multiprocessing as mp

    base = tempfile.mkdtemp(prefix="nostall-partial-", dir=args.dir)
    try:
        out = os.path.join(base, "result")
        mp.spawn(_rank, args=(2, base, args.mb, args.rounds, out), nprocs=2, join=True)
        ranks = []
        for r in range(2):
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    slowest = {k: max(r[k][0] for r in ranks) for k in ranks[0]}
    print(json.dumps({
        "mb_per_rank": args.mb, "rounds": args.rounds,
        "per_rank": [{k: {"seconds": round(v[0], 4), "bytes_read": v[1], "bytes_received": v[2]}
                      for k, v in r.items()} for r in ranks],
        "slowest_rank_vs_whole": {k: round(v / slowest["whole"], 3) for k, v in slowest.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
