"""The strategy seam of SkyRL-style stacks, through its exact signatures, on 2 real gloo ranks.

A tiny tensor-parallel trainer (2 ranks, Megatron-style split weights) whose
strategy class inherits ``CheckpointingMixin``: saves into per-step
directories ``<run>/global_step_<N>/policy`` (async), its marker and its
retention done in the commit callback, preempted, resumed in fresh processes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_harness import run_ranks

MARKER = "latest_ckpt_global_step.txt"


def _build(rank: int, world: int, seed: int):
    from nostall.integrations import mark_tensor_parallel

    torch.manual_seed(seed)
    full_up, full_down = torch.randn(16, 6), torch.randn(6, 16)  # the same on every rank
    up = torch.nn.Parameter(full_up[rank * 8:(rank + 1) * 8].clone())   # column-parallel: rows split
    down = torch.nn.Parameter(full_down[:, rank * 8:(rank + 1) * 8].clone())  # row-parallel: columns split
    mark_tensor_parallel(up, 0)
    mark_tensor_parallel(down, 1)
    model = torch.nn.Module()
    model.up, model.down = up, down
    model.norm = torch.nn.Parameter(torch.ones(6))  # replicated
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _step(model, opt, sched, step: int) -> float:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(4, 6, generator=g)
    h = torch.relu(x @ model.up.t())                 # this rank's 8 hidden units
    y = h @ model.down.t()                           # partial sums of the output
    dist.all_reduce(y)  # (forward only: the gradients below stay each rank's own shard's)
    loss = ((y * model.norm) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    dist.all_reduce(model.norm.grad)
    model.norm.grad /= 2
    opt.step()
    sched.step()
    return loss.item()


def _strategy_class():
    import nostall
    from nostall.integrations import CheckpointingMixin

    class StackStrategy(CheckpointingMixin):  # the stack's own class; nothing of the stack imported
        def __init__(self, run: str, rank: int, world: int, async_save: bool, keep: int = 1) -> None:
            self.run, self.rank, self.keep = run, rank, keep
            self.init_checkpointing(async_save=async_save,
                                    layout=nostall.ParallelLayout(tp_rank=rank, tp_size=world, dp_rank=0, dp_size=1))

        def huggingface_files(self, model, tokenizer):
            return {"huggingface/config.json": {"model_type": "tiny-tp", "hidden": 16}}

        def on_checkpoint_committed(self, handle):
            # the trainer's marker and retention: only once the checkpoint is durable
            if self.rank != 0:
                return
            step = int(os.path.basename(os.path.dirname(handle.path)).rpartition("_")[2])
            with open(os.path.join(self.run, MARKER + ".tmp"), "w") as f:
                f.write(str(step))
            os.replace(os.path.join(self.run, MARKER + ".tmp"), os.path.join(self.run, MARKER))
            steps = sorted(int(n.rpartition("_")[2]) for n in os.listdir(self.run) if n.startswith("global_step_"))
            for old in steps[:-self.keep]:
                import shutil

                shutil.rmtree(os.path.join(self.run, f"global_step_{old}"))

    return StackStrategy


def _train_and_save(rank, world, run, async_save, steps, save_every, fail_at, last_save=None):
    strategy = _strategy_class()(run, rank, world, async_save)
    model, opt, sched = _build(rank, world, seed=0)
    losses = {}
    for step in range(1, steps + 1):
        losses[step] = _step(model, opt, sched, step)
        if step % save_every == 0 and (last_save is None or step <= last_save):
            if step == fail_at:
                strategy.checkpoint_manager._faults.writer_fault = "enospc"
            ckpt = os.path.join(run, f"global_step_{step}", "policy")
            try:
                strategy.save_checkpoint(model, ckpt, 0, opt, sched)
                strategy.finalize_pending_saves() if step == fail_at else None
            except Exception as e:
                losses[f"error@{step}"] = type(e).__name__
            strategy.checkpoint_manager._faults.writer_fault = None
    try:
        strategy.finalize_pending_saves()
    finally:
        strategy.close_checkpointing()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, opt.param_groups[0]["lr"]


def _resume(rank, world, run, async_save, steps):
    strategy = _strategy_class()(run, rank, world, async_save)
    model, opt, sched = _build(rank, world, seed=123)  # other weights: the load must replace them
    with open(os.path.join(run, MARKER)) as f:
        at = int(f.read())
    ckpt_dir, states = strategy.load_checkpoint(model, os.path.join(run, f"global_step_{at}", "policy"), opt, sched)
    lr_after_load = opt.param_groups[0]["lr"]
    losses = {step: _step(model, opt, sched, step) for step in range(at + 1, steps + 1)}
    strategy.close_checkpointing()
    return at, ckpt_dir, states, lr_after_load, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_seam_saves_per_step_dirs_marks_on_commit_and_resumes_bit_exactly(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(run)
    async_save = True
    # trains 8 steps, saving after steps 2, 4 and 6: steps 7 and 8 are the uninterrupted reference
    full = run_ranks(2, _train_and_save, run, async_save, 8, 2, -1, 6)
    # no save may have failed: an exception stored under error@<step> is a failure, not a detail
    assert [[k for k in o[0] if str(k).startswith("error@")] for o in full] == [[], []], [o[0] for o in full]
    # retention in the commit callback kept only the newest; the marker names it
    assert sorted(os.listdir(run)) == ["global_step_6", MARKER]
    assert open(os.path.join(run, MARKER)).read() == "6"
    policy = os.path.join(run, "global_step_6", "policy")
    assert json.load(open(os.path.join(policy, "huggingface", "config.json"))) == {"hidden": 16, "model_type": "tiny-tp"}
    manifest = json.load(open(os.path.join(policy, "manifest.json")))
    assert manifest["step"] is None and "huggingface/config.json" in manifest["side_files"]
    assert manifest["tensors"]["model/up"]["shape"] == [16, 6] and manifest["tensors"]["model/down"]["shape"] == [6, 16]

    # preempted after step 6's save: a new job trains 7..8 from it
    out = run_ranks(2, _resume, run, async_save, 8)
    for rank in range(2):
        at, ckpt_dir, states, lr, losses, params = out[rank]
        assert at == 6 and ckpt_dir == policy and states["rng_restored"] is True
        assert lr == 0.05 * (1.0 / (1 + 6))  # the scheduler's lr after 6 steps (base lr x lambda), restored
        assert losses == {7: full[rank][0][7], 8: full[rank][0][8]}
        for n, p in params.items():
            assert torch.equal(p, full[rank][1][n]), (rank, n)


def test_a_failed_save_leaves_the_previous_checkpoint_and_marker(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(run)
    out = run_ranks(2, _train_and_save, run, True, 4, 2, 4)  # step 4's write fails (a full disk)
    assert all(o[0].get("error@4") == "CheckpointSaveError" for o in out)
    assert open(os.path.join(run, MARKER)).read() == "2"  # the callback never ran for step 4
    assert os.path.exists(os.path.join(run, "global_step_2", "policy", "manifest.json"))
    assert not os.path.exists(os.path.join(run, "global_step_4", "policy"))
    resumed = run_ranks(2, _resume, run, True, 4)
    assert all(r[0] == 2 for r in resumed)
