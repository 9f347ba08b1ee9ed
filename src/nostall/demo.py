"""The main job: a small tensor-parallel training run that checkpoints, stops and resumes.

``python -m nostall.demo`` (or ``make demo``) launches 2 CPU ranks (gloo). Each
rank holds half of a column-parallel and a row-parallel linear layer (Megatron
style), replicated norm and head layers, AdamW state sharded like the weights,
its RNG state and the data-loader position. The run:

1. trains steps 1..14, saving every 4 steps asynchronously (keep_last=2),
   then stops (the processes exit; steps 13-14 are lost);
2. a new set of processes, with freshly initialised weights, resumes from the
   latest checkpoint (step 12) and trains to step 20;
3. the losses of steps 13 and 14 of both runs are compared: they are equal bit
   for bit, because the whole training state came back.

What each save cost is printed. Checkpoints stay in ``--dir`` for
``nostall inspect`` / ``nostall verify``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nostall

HIDDEN, FFN, BATCH = 64, 256, 32


class _AllReduceForward(torch.autograd.Function):
    """Sum partial outputs over the TP group; identity backward (row-parallel output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


class _AllReduceBackward(torch.autograd.Function):
    """Identity forward; sum input gradients over the TP group (column-parallel input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        g = g.clone()
        dist.all_reduce(g)
        return g


class TPBlock(torch.nn.Module):
    """norm -> column-parallel up projection -> gelu -> row-parallel down projection -> head."""

    def __init__(self, tp_rank: int, tp: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        up = torch.randn(FFN, HIDDEN, generator=g) / HIDDEN**0.5
        down = torch.randn(HIDDEN, FFN, generator=g) / FFN**0.5
        self.tp_rank, self.tp = tp_rank, tp
        self.shard = FFN // tp
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Parameter(up[tp_rank * self.shard : (tp_rank + 1) * self.shard].clone())
        self.down = torch.nn.Parameter(down[:, tp_rank * self.shard : (tp_rank + 1) * self.shard].clone())
        self.head = torch.nn.Linear(HIDDEN, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, HIDDEN, generator=g) / HIDDEN**0.5)
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _AllReduceBackward.apply(self.norm(x))
        h = torch.nn.functional.gelu(h @ self.up.t())
        h = _AllReduceForward.apply(h @ self.down.t())
        return self.head(x + h)

    def sharding(self) -> Dict[str, Any]:
        """Global shape and offset of each tensor-parallel parameter."""
        return {
            "up": ((FFN, HIDDEN), (self.tp_rank * self.shard, 0)),
            "down": ((HIDDEN, FFN), (0, self.tp_rank * self.shard)),
        }


def batch(step: int) -> Any:
    """The data loader: batch ``step`` of a fixed synthetic regression task."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, HIDDEN, generator=g)
    y = torch.sin(x[:, :8].sum(dim=1, keepdim=True)) + 0.1 * torch.randn(BATCH, 1, generator=g)
    return x, y


def checkpoint_state(model: TPBlock, opt: torch.optim.Optimizer, step: int) -> Dict[str, Any]:
    """The whole training state, with TP parameters and their Adam moments as ShardedTensors."""
    sharding = model.sharding()
    params = dict(model.named_parameters())
    model_state: Dict[str, Any] = {}
    optim_state: Dict[str, Any] = {}
    for name, p in params.items():
        st = opt.state.get(p, {})
        if name in sharding:
            gshape, off = sharding[name]
            model_state[name] = nostall.ShardedTensor(p.data, gshape, off)
            optim_state[name] = {k: nostall.ShardedTensor(st[k], gshape, off) if k != "step" else st[k]
                                 for k in ("exp_avg", "exp_avg_sq", "step") if k in st}
        else:
            model_state[name] = p.data
            optim_state[name] = {k: st[k] for k in ("exp_avg", "exp_avg_sq", "step") if k in st}
    return {
        "model": model_state,
        "optim": optim_state,
        "trainer": {"step": step, "lr": opt.param_groups[0]["lr"]},
        "rng": nostall.PerRank(torch.get_rng_state()),
        "loader": nostall.PerRank({"next_batch": step + 1}),
    }


def _worker(rank: int, world: int, init: str, root: str, phase: str, until: int, every: int,
            results: Any) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(rank)
        seed = 1 if phase == "first" else 2  # the resumed run starts from other weights
        model = TPBlock(rank, world, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        # materialise the optimizer state so that the template has every tensor
        for p in model.parameters():
            st = opt.state[p]
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        losses: Dict[int, float] = {}
        saves: List[Dict[str, Any]] = []
        mgr = nostall.CheckpointManager(root, keep_last=2, async_save=True)
        with mgr:
            start = 1
            if phase == "resume":
                step0 = mgr.latest_step()
                t0 = time.perf_counter()
                restored = mgr.load(checkpoint_state(model, opt, 0))
                load_s = time.perf_counter() - t0
                torch.set_rng_state(restored["rng"])
                start = restored["loader"]["next_batch"]
                if rank == 0:
                    results.put(("load", step0, load_s))
            for step in range(start, until + 1):
                x, y = batch(step)
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses[step] = loss.item()
                if step % every == 0:
                    # returns once the state is in host memory; written in the background
                    mgr.save(step, checkpoint_state(model, opt, step))
        # leaving the block finalized the last save: it is committed
        saves = [s.as_dict() for s in mgr.stats()]
        results.put(("rank", rank, losses, saves))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, root: str, phase: str, until: int, every: int) -> Dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx_procs = mp.start_processes(_worker, args=(world, init, root, phase, until, every, q), nprocs=world,
                                   join=False, start_method="spawn")
    out: Dict[str, Any] = {"ranks": {}}
    try:
        deadline = time.monotonic() + 600
        while not ctx_procs.join(timeout=1):
            if time.monotonic() > deadline:
                raise RuntimeError(f"demo phase {phase!r} did not finish in 600 s")
    finally:
        for p in ctx_procs.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    while not q.empty():
        item = q.get()
        if item[0] == "rank":
            out["ranks"][item[1]] = {"losses": item[2], "saves": item[3]}
        else:
            out["load"] = item[1:]
    return out


def _print_saves(saves: List[Dict[str, Any]]) -> None:
    for s in saves:
        print(f"    save step {s['step']:>3}: blocked training {s['stall_s'] * 1e3:6.1f} ms "
              f"(plan {s['plan_s'] * 1e3:.1f} ms{' cached' if s['plan_cached'] else ''}, "
              f"copy to host {s['stage_s'] * 1e3:.1f} ms); in the background: write {s['write_s'] * 1e3:.1f} ms, "
              f"commit {s['commit_s'] * 1e3:.1f} ms; {s['total_bytes'] / 1e6:.2f} MB")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nostall.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="demo_out", help="checkpoint root (emptied first; default: ./demo_out)")
    ap.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks (default 2)")
    ap.add_argument("--every", type=int, default=4, help="save every N steps (default 4)")
    ap.add_argument("--crash-at", type=int, default=14, help="the first run stops after this step")
    ap.add_argument("--steps", type=int, default=20, help="the resumed run trains up to this step")
    args = ap.parse_args(argv)
    if FFN % args.ranks:
        ap.error(f"--ranks must divide {FFN}")
    root = os.path.abspath(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    print(f"nostall demo: {args.ranks} CPU ranks (tensor parallel), checkpoints in {root}")

    print(f"\n[1] training steps 1..{args.crash_at}, saving every {args.every} steps in the background (keep_last=2)")
    first = _launch(args.ranks, root, "first", args.crash_at, args.every)
    _print_saves(first["ranks"][0]["saves"])
    latest = nostall.CheckpointManager(root).latest_step()
    print(f"    ...the run stops after step {args.crash_at}; latest committed checkpoint: step {latest}; "
          f"on disk: {sorted(n for n in os.listdir(root) if n.startswith('step_'))}")

    print(f"\n[2] new processes, different initial weights; resume from the latest checkpoint, train to step {args.steps}")
    second = _launch(args.ranks, root, "resume", args.steps, args.every)
    step0, load_s = second["load"]
    print(f"    loaded step {step0} in {load_s * 1e3:.1f} ms")
    _print_saves(second["ranks"][0]["saves"])

    print("\n[3] loss per step (first run | resumed run)")
    a, b = first["ranks"][0]["losses"], second["ranks"][0]["losses"]
    ok = True
    for step in range(1, args.steps + 1):
        la, lb = a.get(step), b.get(step)
        mark = ""
        if la is not None and lb is not None:
            same = la == lb
            ok = ok and same
            mark = "  identical" if same else "  DIFFERENT"
        fa = f"{la:.6f}" if la is not None else "-"
        fb = f"{lb:.6f}" if lb is not None else "-"
        print(f"    step {step:>3}: {fa:>10} | {fb:>10}{mark}")
    overlap = sorted(set(a) & set(b))
    if not overlap:
        print("no overlapping steps to compare (use --crash-at beyond a save step)")
        return 1
    print(f"\nsteps {overlap[0]}..{overlap[-1]} were trained twice (before the stop, and after resuming): "
          f"{'the losses are bit-identical, training continued from the same state' if ok else 'MISMATCH'}")
    from .loading import verify_checkpoint

    nfiles, nbytes = verify_checkpoint(os.path.join(root, f"step_{args.steps - args.steps % args.every}"))
    print(f"verify: {nfiles} data files, {nbytes} bytes, all checksums match. Try: nostall inspect {args.dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
