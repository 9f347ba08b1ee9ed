"""torchrun entry point of the reference trainer.

    torchrun --standalone --nproc-per-node 2 -m nostall.tools.reference.train \\
        --loop sft --steps 40 --ckpt-interval 8 --async-save --resume latest --ckpt-dir ckpts

Each rank joins the gloo group torchrun set up, trains, and rank 0 prints the
losses and, once each save has committed, what it blocked training for (from
the save's handle; the library's own INFO records are left out). ``--history FILE`` writes
rank 0's :class:`RunResult` as JSON.

On several hosts (docs/topologies.md), ``--ckpt-dir`` is a directory every
host shares, or an object-storage URL (``s3://bucket/run``, with
``--storage-options`` as JSON and ``--local-staging-dir`` on each host's own
disk). ``--timeout`` bounds every checkpoint wait and ``--pg-timeout`` every
collective of the training process group, so a job whose peer host died ends
instead of hanging.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
from typing import List, Optional

import torch
import torch.distributed as dist

from nostall.tools.reference.model import GPTConfig
from nostall.tools.reference.trainer import LOOPS, RunResult, TrainConfig, Trainer


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nostall.tools.reference.train", description=__doc__.splitlines()[0])
    p.add_argument("--loop", choices=LOOPS, default="sft")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stop-after", type=int, default=None, help="end the run after this step (simulated preemption)")
    p.add_argument("--ckpt-dir", default="checkpoints")
    p.add_argument("--ckpt-interval", type=int, default=10, help="save every N steps (0: never)")
    p.add_argument("--save-at", type=int, nargs="*", default=[], help="extra steps to save at")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--overlap", action="store_true", help="async saves: copy while the next forward/backward runs")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--resume", default="none", help="none | latest | a checkpoint directory")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (DP = world / TP)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--measure-sync-save", action="store_true", help="time one sync save of the final state")
    p.add_argument("--history", default=None, help="write rank 0's run record (JSON) here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds: bound of every checkpoint wait")
    p.add_argument("--pg-timeout", type=float, default=300.0,
                   help="seconds: bound of the training process group's start-up and collectives")
    p.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                   help="fsspec options when --ckpt-dir is a URL (s3://...)")
    p.add_argument("--local-staging-dir", default=None,
                   help="object storage: this host's local scratch for the files before upload (default: under TMPDIR)")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        loop=a.loop, steps=a.steps, stop_after=a.stop_after, ckpt_dir=a.ckpt_dir, ckpt_interval=a.ckpt_interval,
        save_at=tuple(a.save_at), async_save=a.async_save, overlap=a.overlap, keep_last=a.keep_last, resume=a.resume,
        tp=a.tp,
        seed=a.seed, global_batch=a.global_batch,
        model=GPTConfig(seq_len=a.seq_len, d_model=a.d_model, n_head=a.heads, n_layer=a.layers),
        measure_sync_save=a.measure_sync_save, timeout=a.timeout, storage_options=a.storage_options,
        local_staging_dir=a.local_staging_dir,
    )


def train(cfg: TrainConfig) -> RunResult:
    """Run one reference training run on this rank (process group already initialised)."""
    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.close()


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # ranks share the cores; also keeps CPU results reproducible
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout,
                        format=f"[rank {rank}] %(message)s")
    # the trainer reports each save once, from its handle: the library's own per-save records stay out
    logging.getLogger("nostall").setLevel(logging.WARNING)
    logging.getLogger("nostall.reference").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    try:
        result = train(config_from_args(args))
        if rank == 0 and args.history:
            result.write_json(args.history)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
