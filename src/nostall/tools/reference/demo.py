"""The main job: train with async checkpoints on 2 CPU ranks, stop, resume, compare.

``python -m nostall.tools.reference.demo`` (``make demo``):

1. ``torchrun`` runs the reference trainer (a GPT with TP=2 over 2 gloo ranks)
   saving every ``--interval`` steps in the background (``async_save``), and
   stops after step ``--stop`` as a preempted job would: the steps after its
   last checkpoint are lost. At the end it times one synchronous save of the
   same state, for comparison.
2. A new ``torchrun`` job, from freshly initialised weights, resumes from the
   latest checkpoint and trains to ``--steps``.
3. The steps both runs trained are compared bit for bit; the loss curve and
   what each save blocked training for are printed (``--plot`` draws them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

_TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def _torchrun(nproc: int, args: List[str], timeout: float) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = _TORCHRUN + [str(nproc), "-m", "nostall.tools.reference.train"] + args
    print("$ torchrun --standalone --nproc-per-node", nproc, "-m nostall.tools.reference.train", " ".join(args),
          flush=True)
    proc = subprocess.run(cmd, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"demo: the training job failed (exit status {proc.returncode})")


def _load(path: str) -> Dict[str, Any]:
    with open(path) as f:
        h = json.load(f)
    h["losses"] = {int(k): v for k, v in h["losses"].items()}
    return h


def plot(first: Dict[str, Any], second: Dict[str, Any], stop: int, path: str) -> None:
    """Loss curves with checkpoint, stop and resume points, and per-save stalls (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    s1, s2 = sorted(first["losses"]), sorted(second["losses"])
    ax.plot(s1, [first["losses"][s] for s in s1], "-", color="tab:blue", label="run 1 (stopped)")
    ax.plot(s2, [second["losses"][s] for s in s2], "--", color="tab:orange", label="run 2 (resumed)")
    for i, rec in enumerate(first["saves"] + second["saves"]):
        ax.axvline(rec["step"], color="grey", lw=0.6, ls=":", label="checkpoint" if i == 0 else None)
    ax.axvline(stop, color="tab:red", lw=1.2, label=f"stop (step {stop})")
    ax.axvline(second["resumed_from"], color="tab:green", lw=1.2, label=f"resume (step {second['resumed_from']})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Reference GPT, TP=2 on 2 CPU ranks")
    ax.legend(fontsize=8)
    saves = first["saves"] + second["saves"]
    labels = [f"{r['step']}" for r in saves] + ["sync"]
    values = [r["stall_s"] * 1e3 for r in saves] + [(first["sync_save_stall_s"] or 0) * 1e3]
    colors = ["tab:blue"] * len(first["saves"]) + ["tab:orange"] * len(second["saves"]) + ["tab:red"]
    bx.bar(labels, values, color=colors)
    bx.set_xlabel("async save at step / a synchronous save")
    bx.set_ylabel("training blocked (ms, rank 0)")
    bx.set_title("Stall per save")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nostall.tools.reference.demo", description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="demo-checkpoints", help="checkpoint root (emptied first)")
    p.add_argument("--loop", default="sft", choices=["sft", "sync_rl", "async_rl"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stop", type=int, default=26, help="the first run stops after this step")
    p.add_argument("--interval", type=int, default=8, help="save every N steps")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the losses and stalls into this file")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--overlap", action="store_true",
                   help="overlapped staging: the copy runs during the next forward/backward")
    a = p.parse_args(argv)
    if not 0 < a.interval <= a.stop < a.steps or a.stop % a.interval == 0:
        p.error("need 0 < --interval <= --stop < --steps, --stop not a multiple of --interval "
                "(so that some steps are trained by both runs)")
    return a


def _run_both(a: argparse.Namespace, root: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Run 1 (stopped after ``--stop``), then run 2 (resumed from its latest checkpoint): their histories."""
    h1, h2 = os.path.join(root, "run1.json"), os.path.join(root, "run2.json")
    common = ["--loop", a.loop, "--steps", str(a.steps), "--ckpt-dir", os.path.join(root, "ckpts"),
              "--ckpt-interval", str(a.interval), "--async-save", "--keep-last", "2", "--tp", "2",
              "--d-model", str(a.d_model), "--layers", str(a.layers), "--heads", str(a.heads),
              "--seq-len", str(a.seq_len)] + (["--overlap"] if a.overlap else [])
    print(f"== run 1: train to step {a.stop}, saving every {a.interval} steps in the background, then stop")
    _torchrun(2, common + ["--stop-after", str(a.stop), "--measure-sync-save", "--history", h1], a.timeout)
    print("== run 2: new processes, fresh weights, resume from the latest checkpoint")
    _torchrun(2, common + ["--resume", "latest", "--history", h2], a.timeout)
    return _load(h1), _load(h2)


def _compare_losses(first: Dict[str, Any], second: Dict[str, Any]) -> bool:
    """Print the losses of the steps both runs trained; whether they are identical."""
    both = [s for s in sorted(second["losses"]) if s in first["losses"]]
    print(f"\n== run 2 resumed from step {second['resumed_from']}; steps {both[0]}-{both[-1]} were trained by "
          "both runs:")
    same = True
    for s in both:
        eq = first["losses"][s] == second["losses"][s]
        same &= eq
        print(f"   step {s:3d}: run 1 {first['losses'][s]:.9f}  run 2 {second['losses'][s]:.9f}  "
              f"{'identical' if eq else 'DIFFERENT'}")
    curve = {**first["losses"], **second["losses"]}
    marks = " ".join(f"{s}:{curve[s]:.3f}" for s in sorted(curve) if s % 4 == 0 or s == max(curve))
    print(f"   loss curve: {marks}")
    return same


def _print_stalls(first: Dict[str, Any], second: Dict[str, Any], mode: str) -> None:
    """The async saves' stalls in one line (each save's own is in the runs' output), beside the sync one."""
    async_stalls = sorted(r["stall_s"] for r in first["saves"] + second["saves"])
    sync = first["sync_save_stall_s"]
    median = async_stalls[len(async_stalls) // 2]
    print(f"\n== training blocked on rank 0 (from the save handles): {len(async_stalls)} {mode} saves, median "
          f"{median * 1e3:.1f} ms [{async_stalls[0] * 1e3:.1f}-{async_stalls[-1] * 1e3:.1f}]; "
          f"a synchronous save of the same state (not kept): {sync * 1e3:.1f} ms ({sync / median:.1f}x the median)")


def console_script() -> str:
    """The ``nostall`` console script beside this interpreter (a venv's bin/), relative to the working
    directory when it is below it; plain ``nostall`` when there is none."""
    script = os.path.join(os.path.dirname(sys.executable), "nostall")
    if not os.path.exists(script):
        return "nostall"
    rel = os.path.relpath(script)
    return rel if not rel.startswith("..") else script


def main(argv: Optional[List[str]] = None) -> int:
    a = _args(argv)
    root = os.path.abspath(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(root + "-sync-reference", ignore_errors=True)
    os.makedirs(root)
    first, second = _run_both(a, root)
    same = _compare_losses(first, second)
    _print_stalls(first, second, "overlap" if a.overlap else "async")
    if a.plot:
        plot(first, second, a.stop, a.plot)
        print(f"   plot: {a.plot}")
    ckpts = os.path.join(root, "ckpts")
    cli = console_script()
    print(f"\ncheckpoints: {ckpts}  (try: {cli} ls {ckpts}; {cli} inspect {ckpts})")
    if not same:
        print("demo: the resumed run did NOT reproduce the first run's losses", file=sys.stderr)
        return 1
    print("demo: OK, the resumed run reproduces the interrupted one bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
