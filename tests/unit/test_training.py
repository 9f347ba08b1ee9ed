"""The two-call training API on one process: what it saves, restores and refuses."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import nostall
from nostall.integrations import mark_tensor_parallel


def _objects(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, n=2):
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()


def test_keys_and_fresh_optimizer_restore(tmp_path):
    model, opt, sched = _objects()
    _train(model, opt, sched)
    with nostall.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(2, model=model, optimizer=opt, scheduler=sched, extra={"epoch": 3})
    from nostall.loading.manifests import read_manifest

    man = read_manifest(str(tmp_path / "step_2"))
    assert "model/0.weight" in man.tensors and "optimizer/state/0.weight/exp_avg" in man.tensors
    assert man.objects["extra"] == {"epoch": 3}

    fresh, fopt, fsched = _objects(seed=1)
    assert not fopt.state
    with nostall.CheckpointManager(str(tmp_path)) as mgr:
        resumed = mgr.load(model=fresh, optimizer=fopt, scheduler=fsched)
    assert resumed.step == 2 and resumed.extra == {"epoch": 3} and not resumed.rng_restored
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][k], fopt.state[b][k])
    assert fopt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.025
    assert fopt.param_groups[0]["betas"] == (0.8, 0.9)  # a tuple again, as the optimizer holds it
    assert fsched.state_dict() == sched.state_dict()
    # the resumed optimizer steps exactly like the original one
    torch.manual_seed(5)
    _train(model, opt, sched, 1)
    torch.manual_seed(5)
    _train(fresh, fopt, fsched, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_prepare_takes_the_training_objects(tmp_path):
    model, opt, sched = _objects()
    _train(model, opt, sched, 1)
    with nostall.CheckpointManager(str(tmp_path), async_save=True) as mgr:
        mgr.prepare(model=model, optimizer=opt, scheduler=sched)
        assert mgr.save(1, model=model, optimizer=opt, scheduler=sched).result().plan_cached


def test_existing_optimizer_state_is_filled_in_place(tmp_path):
    model, opt, sched = _objects()
    _train(model, opt, sched)
    with nostall.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, model=model, optimizer=opt)
        other, oopt, _ = _objects(seed=3)
        _train(other, oopt, torch.optim.lr_scheduler.StepLR(oopt, 1))
        before = {id(p): oopt.state[p]["exp_avg"].data_ptr() for p in other.parameters()}
        mgr.load(model=other, optimizer=oopt)
    for p, q in zip(model.parameters(), other.parameters()):
        assert oopt.state[q]["exp_avg"].data_ptr() == before[id(q)]
        assert torch.equal(opt.state[p]["exp_avg"], oopt.state[q]["exp_avg"])


def test_rng_states_round_trip(tmp_path):
    model, _, _ = _objects()
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    with nostall.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, model=model, rng=True)
        expect = (torch.rand(3), random.random(), np.random.rand())
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        resumed = mgr.load(model=model)
    assert resumed.rng_restored
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expect[0]) and got[1:] == expect[1:]


def test_wrappers_are_looked_through(tmp_path):
    model, opt, _ = _objects()
    compiled = torch.compile(model)  # not run: only its wrapper's names matter
    with nostall.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, model=compiled, optimizer=opt)
    from nostall.loading.manifests import read_manifest

    assert "model/0.weight" in read_manifest(str(tmp_path / "step_1")).tensors


def test_refusals_name_the_fix(tmp_path):
    model, opt, sched = _objects()
    with nostall.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(TypeError, match="either a state or training objects"):
            mgr.save(1, {"w": torch.ones(1)}, model=model)
        with pytest.raises(TypeError, match="nothing to save"):
            mgr.save(1)
        with pytest.raises(nostall.InvalidStateError, match="without model"):
            mgr.save(1, optimizer=opt)
        mgr.save(1, model=model)  # no optimizer, no scheduler
        with pytest.raises(nostall.CheckpointLoadError, match="no optimizer state"):
            mgr.load(model=model, optimizer=opt)
        with pytest.raises(nostall.CheckpointLoadError, match="no scheduler state"):
            mgr.load(model=model, scheduler=sched)
        mgr.save(2, model=model, extra={"t": torch.ones(2), "n": 1, "loader": nostall.PerRank({"pos": 7}),
                                        "/odd~": nostall.PerRank(torch.arange(3))})
        got = mgr.load(model=model).extra  # no template needed: everything under extra, as saved
        assert got["n"] == 1 and got["loader"] == {"pos": 7} and torch.equal(got["t"], torch.ones(2))
        assert torch.equal(got["/odd~"], torch.arange(3))
        tmpl = {"t": torch.zeros(2), "n": None, "loader": nostall.PerRank(None),
                "/odd~": nostall.PerRank(torch.zeros(3, dtype=torch.int64))}
        assert mgr.load(model=model, extra=tmpl).extra["loader"] == {"pos": 7}
        # a Megatron-style tensor-parallel parameter needs the layout
        mark_tensor_parallel(model[0].weight, 0)
        with pytest.raises(nostall.InvalidStateError, match="layout=nostall.ParallelLayout"):
            mgr.save(3, model=model)
        mgr.save(3, model=model, layout=nostall.ParallelLayout())
        assert mgr.steps() == [1, 2, 3]


def test_a_multi_rank_launch_without_a_process_group_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(nostall.CheckpointError, match="WORLD_SIZE=2.*init_process_group"):
        nostall.CheckpointManager(str(tmp_path))
    with pytest.raises(nostall.CheckpointError, match="init_process_group"):
        nostall.save({"w": torch.ones(1)}, str(tmp_path / "c"))
    with pytest.raises(nostall.CheckpointError, match="init_process_group"):
        nostall.load({"w": torch.ones(1)}, str(tmp_path / "c"))


def test_errors_for_a_run_root_given_as_a_checkpoint_and_an_empty_optimizer_template(tmp_path):
    from nostall.loading.manifests import read_manifest

    root = str(tmp_path / "run")
    model, opt, sched = _objects()
    _train(model, opt, sched, 1)
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(2, {"w": torch.ones(2)})
        mgr.save(4, {"optim": opt.state_dict()})
        fresh = torch.optim.AdamW(_objects(seed=2)[0].parameters())
        with pytest.raises(nostall.CheckpointLoadError, match="holds tensors under it.*load\\(model=..., optimizer=...\\)"):
            mgr.load({"optim": fresh.state_dict()})
    with pytest.raises(nostall.CheckpointNotFoundError, match=r"is a run root \(committed steps: 2, 4\).*step_4"):
        read_manifest(root)
