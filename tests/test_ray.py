"""The reference trainer over Ray actors: exact resume per loop, the generic Worker's save/load.

Starts a local Ray instance on 127.0.0.1 for this module and stops it after;
skipped (with the reason) only when Ray is missing or cannot start here.
"""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'nostall[ray]')")

from nostall.integrations.ray import Worker, WorkerDispatch  # noqa: E402
from tests.test_reference import N, _cfg  # noqa: E402


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
    from nostall.reference.ray_train import TrainerWorker

    d = WorkerDispatch.start(TrainerWorker, 2, num_cpus=1, master_addr="127.0.0.1", timeout=120)
    try:
        yield d
    finally:
        d.shutdown()
    # the actors are gone once shut down
    assert d.actors == []


@pytest.mark.parametrize("loop", ["sft", "sync_rl", "async_rl"])
def test_ray_exact_resume(trainers, tmp_path, loop):
    from nostall.reference.ray_train import run

    full = run(trainers, _cfg(loop=loop, tp=2, ckpt_dir=str(tmp_path / "a"), async_save=True))
    run(trainers, _cfg(loop=loop, tp=2, ckpt_dir=str(tmp_path / "b"), async_save=True, stop_after=N + 1))
    second = run(trainers, _cfg(loop=loop, tp=2, ckpt_dir=str(tmp_path / "b"), async_save=True, resume="latest"))
    assert second.resumed_from == N
    assert sorted(second.losses) == list(range(N + 1, 2 * N + 1))
    for s, v in second.losses.items():
        assert v == full.losses[s], f"{loop}: step {s}: {v!r} after resume, {full.losses[s]!r} uninterrupted"
    assert [s["step"] for s in full.saves] == [2, 4, 6, 8]
    assert sorted(os.listdir(tmp_path / "a")) == [".tmp", "latest", "step_6", "step_8"]


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
