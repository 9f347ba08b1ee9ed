"""The reference trainer over Ray actors: exact resume per loop, the generic Worker's save/load.

Starts a local Ray instance on 127.0.0.1 for this module and stops it after;
skipped (with the reason) only when Ray is missing or cannot start here.
"""

from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'nostall[ray]')")

from nostall.integrations import CheckpointingMixin  # noqa: E402
from nostall.integrations.ray import Worker, WorkerDispatch  # noqa: E402
from tests.system.test_reference import N, _cfg  # noqa: E402


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    try:
        ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    except Exception as e:  # pragma: no cover - depends on the sandbox
        pytest.skip(f"Ray cannot start here: {e}")
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def trainers(ray_local):
    from nostall.tools.reference.ray_train import TrainerWorker

    d = WorkerDispatch.start(TrainerWorker, 2, num_cpus=1, master_addr="127.0.0.1", timeout=120)
    try:
        yield d
    finally:
        d.shutdown()
    # the actors are gone once shut down
    assert d.actors == []


@pytest.mark.parametrize("loop", ["sft", "sync_rl", "async_rl"])
def test_ray_exact_resume(trainers, tmp_path, loop):
    from nostall.tools.reference.ray_train import run

    full = run(trainers, _cfg(loop=loop, tp=2, ckpt_dir=str(tmp_path / "a"), async_save=True))
    run(trainers, _cfg(loop=loop, tp=2, ckpt_dir=str(tmp_path / "b"), async_save=True, stop_after=N + 1))
    second = run(trainers, _cfg(loop=loop, tp=2, ckpt_dir=str(tmp_path / "b"), async_save=True, resume="latest"))
    assert second.resumed_from == N
    assert sorted(second.losses) == list(range(N + 1, 2 * N + 1))
    for s, v in second.losses.items():
        assert v == full.losses[s], f"{loop}: step {s}: {v!r} after resume, {full.losses[s]!r} uninterrupted"
    assert [s["step"] for s in full.saves] == [2, 4, 6, 8]
    assert sorted(os.listdir(tmp_path / "a")) == [".tmp", "latest", "step_6", "step_8", "trainer_marker.json"]


class _LinearWorker(Worker):
    """The generic Worker path: a plain model, optimizer and counters, no reference trainer."""

    def __init__(self, rank, world_size, seed):
        super().__init__(rank, world_size)
        self.seed = seed
        self.counter = 0

    def build(self, async_save):
        import torch

        from nostall.integrations import ParallelLayout, Strategy

        torch.manual_seed(self.seed)
        self.model = torch.nn.Linear(8, 4)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.strategy = Strategy(ParallelLayout(dp_rank=self.rank, dp_size=self.world_size), async_save=async_save)

    def step(self):
        import torch
        import torch.distributed as dist

        loss = self.model(torch.ones(2, 8)).pow(2).sum()
        loss.backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.counter += 1

    def extra_state(self):
        return {"counter": self.counter}

    def load_extra_state(self, extra):
        self.counter = extra["counter"]

    def weights(self):
        return [p.detach().clone() for p in self.model.parameters()]

    def scramble(self):
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(7.0)
        self.counter = -1


def test_generic_worker_dispatch_save_load(ray_local, tmp_path):
    import torch

    d = WorkerDispatch.start(_LinearWorker, 2, 0, num_cpus=1, master_addr="127.0.0.1", timeout=120)
    try:
        d.call("build", True)
        for _ in range(3):
            d.call("step")
        saved = d.call("weights")
        # the driver's own state goes into the same commit (rank 0's part)
        out = d.save_checkpoint(str(tmp_path), 3, driver_state={"position": 17, "seen": torch.arange(3)})
        assert [o["rank"] for o in out] == [0, 1]
        d.call("scramble")
        # load finalizes the pending async save first, then restores weights, momentum and counters
        assert d.load_checkpoint(str(tmp_path)) == [3, 3]
        got = d.driver_state()
        assert got["position"] == 17 and torch.equal(got["seen"], torch.arange(3))
        for before, after in zip(saved, d.call("weights")):
            assert all(torch.equal(a, b) for a, b in zip(before, after))
        d.call("step")
        assert os.path.isfile(tmp_path / "step_3" / "manifest.json")
    finally:
        d.shutdown()


# --------------------------------------------------------------------------- the seam of a stack's strategy class

MARKER = "latest_ckpt_global_step.txt"


class _StackStrategy(CheckpointingMixin):
    """A stack's own strategy class (nothing of a stack imported): the seam comes from the mixin,
    the trainer's "latest step" marker is written in the commit callback."""

    def __init__(self, run, rank, world_size):
        import nostall

        self.run, self.rank = run, rank
        self.init_checkpointing(async_save=True, layout=nostall.ParallelLayout(dp_rank=rank, dp_size=world_size))

    def huggingface_files(self, model, tokenizer):
        return {"huggingface/config.json": {"model_type": "tiny-dp", "hidden_size": 16},
                "huggingface/generation_config.json": {"max_new_tokens": 4}}

    def on_checkpoint_committed(self, handle):
        if self.rank != 0:
            return
        step = os.path.basename(os.path.dirname(handle.path)).rpartition("_")[2]  # <run>/global_step_<N>/policy
        tmp = os.path.join(self.run, MARKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(step)
        os.replace(tmp, os.path.join(self.run, MARKER))

    def close(self):  # the stack's own teardown (Worker.shutdown calls it)
        self.close_checkpointing()


class _SeamWorker(Worker):
    """A data-parallel rank whose strategy is the stack's class; saves and loads go through the seam."""

    def __init__(self, rank, world_size, run):
        super().__init__(rank, world_size)
        self.run = run

    def build(self, seed):
        """(Re)build model, optimizer and scheduler; the checkpointing strategy is made once (collective)."""
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        torch.manual_seed(100 + self.rank)  # each rank's dropout stream (saved and restored per rank)
        if getattr(self, "strategy", None) is None:
            self.strategy = _StackStrategy(self.run, self.rank, self.world_size)

    def step(self, position):
        """Train on this rank's half of the global batch that starts at sample ``position``."""
        import torch
        import torch.distributed as dist

        g = torch.Generator().manual_seed(position * self.world_size + self.rank)
        x = torch.randn(4, 8, generator=g)
        h = torch.nn.functional.dropout(self.model[0](x), 0.25, training=True)
        loss = self.model[2](torch.relu(h)).pow(2).mean()
        loss.backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= self.world_size
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return loss.item()

    def save_checkpoint(self, ckpt_dir, step, async_save=None, driver_state=None):
        # exactly as the stack's trainer calls its strategy (WorkerDispatch hands driver_state to rank 0 only)
        handle = self.strategy.save_checkpoint(self.model, ckpt_dir, self.rank, self.optimizer, self.scheduler, None,
                                               driver_state=driver_state)
        return {"rank": self.rank, "step": step, "committed": handle.done()}

    def load_checkpoint(self, ckpt_dir, step=None):
        got, states = self.strategy.load_checkpoint(self.model, ckpt_dir, self.optimizer, self.scheduler)
        self.loaded_driver_state = states["driver"]
        return got, states["rng_restored"]

    def snapshot(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {"params": {n: p.detach().clone() for n, p in self.model.named_parameters()},
                "optimizer": {names[id(p)]: {k: v.clone() for k, v in st.items()}
                              for p, st in self.optimizer.state.items()},
                "lr": self.optimizer.param_groups[0]["lr"], "scheduler": self.scheduler.state_dict()}


def test_stack_strategy_class_under_ray_preempted_and_resumed_from_its_marker(ray_local, tmp_path):
    """2 Ray actors whose strategy inherits CheckpointingMixin: async saves into global_step_<N>/policy, the
    marker moved only by the commit callback, the driver's data position in the same commit; the actors
    are killed (preemption) and fresh ones resume from the marker bit for bit."""
    import json

    import torch

    from nostall.tools.cli import main as cli_main

    run, batch, steps, save_every = str(tmp_path / "run"), 8, 6, 2
    os.makedirs(run)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(5))  # the driver's shuffled data order
    d = WorkerDispatch.start(_SeamWorker, 2, run, num_cpus=1, master_addr="127.0.0.1", timeout=120)
    try:
        # the uninterrupted run, for reference
        d.call("build", 0)
        for i in range(steps):
            d.call("step", i * batch)
        reference = d.call("snapshot")
        # the run that is preempted: saves every 2 steps (async), trains step 5, then its actors die
        d.call("build", 0)
        position = 0
        for step in range(1, 5 + 1):
            d.call("step", position)
            position += batch
            if step % save_every == 0:
                out = d.save_checkpoint(os.path.join(run, f"global_step_{step}", "policy"), step,
                                        driver_state={"position": position, "order": order})
                assert [o["rank"] for o in out] == [0, 1]
        # step 4's commit moves the marker from the handle's watcher thread: no finalize, no close
        deadline = time.monotonic() + 120  # a hang guard, not a speed check
        while not (os.path.exists(os.path.join(run, MARKER)) and open(os.path.join(run, MARKER)).read() == "4"):
            assert time.monotonic() < deadline, "the step-4 commit never moved the marker"
            time.sleep(0.05)
    finally:
        d.kill()  # preempted: no finalize, no shutdown

    policy = os.path.join(run, "global_step_4", "policy")
    manifest = json.load(open(os.path.join(policy, "manifest.json")))
    assert manifest["step"] is None
    assert {"huggingface/config.json", "huggingface/generation_config.json"} <= set(manifest["side_files"])
    assert json.load(open(os.path.join(policy, "huggingface", "config.json")))["model_type"] == "tiny-dp"
    export = str(tmp_path / "export")  # the Hugging Face files land at the export's top level
    assert cli_main(["convert", policy, export, "--to", "safetensors", "--keys", "model", "--strip-prefix",
                     "model"]) == 0
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(os.listdir(export))

    # fresh actors, other weights: everything comes from the checkpoint the marker names
    d = WorkerDispatch.start(_SeamWorker, 2, run, num_cpus=1, master_addr="127.0.0.1", timeout=120)
    try:
        d.call("build", 123)
        at = int(open(os.path.join(run, MARKER)).read())
        assert at == 4
        loaded = d.load_checkpoint(os.path.join(run, f"global_step_{at}", "policy"))
        assert loaded == [(policy, True), (policy, True)]  # the same world size: RNG states restored
        driver = d.driver_state()
        assert driver["position"] == at * batch and torch.equal(driver["order"], order)
        position = driver["position"]
        for _step in range(at + 1, steps + 1):
            d.call("step", position)
            position += batch
        resumed = d.call("snapshot")
    finally:
        d.shutdown()
    for rank in range(2):
        got, want = resumed[rank], reference[rank]
        assert got["lr"] == want["lr"] and got["scheduler"] == want["scheduler"]
        assert sorted(got["params"]) == sorted(want["params"])
        for n, p in want["params"].items():
            assert torch.equal(got["params"][n], p), (rank, n)
        assert sorted(got["optimizer"]) == sorted(want["optimizer"])
        for n, st in want["optimizer"].items():
            for k, v in st.items():
                assert torch.equal(got["optimizer"][n][k], v), (rank, n, k)
