"""Strategy in one process: what it saves, what it restores, and its errors."""

from __future__ import annotations

import random

import pytest
import torch

import nostall
from nostall.integrations import ParallelLayout, Strategy, mark_tensor_parallel, model_state


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, n):
    for _ in range(n):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def test_roundtrip_restores_model_optimizer_scheduler_rng_and_extra(tmp_path):
    model, opt, sched = _setup()
    _train(model, opt, sched, 3)
    with Strategy(async_save=True) as s:
        s.save_checkpoint(str(tmp_path), 3, model, opt, sched, extra={"samples": 12, "loader": [1, 2]})
        after_save = (torch.rand(3), random.random())
        # training goes on and changes everything
        _train(model, opt, sched, 2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2, sched2 = _setup(seed=1)  # different weights, empty optimizer state
    with Strategy() as s:
        loaded = s.load_checkpoint(str(tmp_path), model2, opt2, sched2)
        assert (torch.rand(3).tolist(), random.random()) == (after_save[0].tolist(), after_save[1])
    assert loaded.step == 3 and loaded.extra == {"samples": 12, "loader": [1, 2]} and loaded.rng_restored
    assert loaded.saved_layout == {"tp_size": 1, "dp_size": 1, "world_size": 1}
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["betas"] == (0.8, 0.9)
    # continuing from the checkpoint repeats the original run's steps 4-5 exactly
    torch.manual_seed(123)
    _train(model2, opt2, sched2, 2)
    model3, opt3, sched3 = _setup()
    _train(model3, opt3, sched3, 3)
    torch.manual_seed(123)
    _train(model3, opt3, sched3, 2)
    for k, v in model3.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), k
    assert not torch.equal(model2.state_dict()["0.weight"], want["0.weight"])  # seeds differ from the first run


def test_tp_marked_parameters_become_sharded_tensors():
    lin = torch.nn.Linear(4, 6)
    mark_tensor_parallel(lin.weight, 0)
    st = model_state(lin, ParallelLayout(tp_rank=1, tp_size=2, dp_rank=1, dp_size=2))
    w = st["weight"]
    assert isinstance(w, nostall.ShardedTensor)
    assert w.global_shape == (12, 4) and w.global_offset == (6, 0) and w.replica_id == 1
    assert isinstance(st["bias"], torch.Tensor)  # unmarked: replicated


def test_load_from_a_checkpoint_directory_and_by_step(tmp_path):
    model, opt, sched = _setup()
    with Strategy(keep_last=None) as s:
        for step in (1, 2):
            _train(model, opt, sched, 1)
            s.save_checkpoint(str(tmp_path), step, model, opt, sched, extra={"at": step})
        assert s.latest_step(str(tmp_path)) == 2
        assert s.load_checkpoint(str(tmp_path / "step_1"), model, opt, sched).extra == {"at": 1}
        assert s.load_checkpoint(str(tmp_path), model, opt, sched, step=2).step == 2
        with pytest.raises(nostall.CheckpointNotFoundError, match="step 7"):
            s.load_checkpoint(str(tmp_path), model, step=7)


def test_errors_name_what_is_wrong(tmp_path):
    model, opt, sched = _setup()
    with Strategy() as s:
        with pytest.raises(nostall.CheckpointNotFoundError, match="no committed checkpoint"):
            s.load_checkpoint(str(tmp_path / "none"), model)
        # an optimizer holding a parameter the model does not have
        stray = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1)
        with pytest.raises(nostall.InvalidStateError, match="not in the model"):
            s.save_checkpoint(str(tmp_path), 1, model, stray)
        # optimizer state of a tensor-parallel parameter whose sharding cannot be derived from it
        # (a replicated parameter's state of any shape is replicated too)
        _train(model, opt, sched, 1)
        opt.state[model[0].weight]["odd"] = torch.zeros(5)
        mark_tensor_parallel(model[0].weight, 0)
        with pytest.raises(nostall.InvalidStateError, match="'odd' of parameter '0.weight'"):
            s.save_checkpoint(str(tmp_path), 1, model, opt)
        del opt.state[model[0].weight]["odd"]
        del model[0].weight.tensor_model_parallel
        s.save_checkpoint(str(tmp_path), 1, model, opt)  # no scheduler
        with pytest.raises(nostall.CheckpointLoadError, match="no scheduler state"):
            s.load_checkpoint(str(tmp_path), model, opt, sched)
        # an optimizer whose groups hold other parameters than at save time
        split = torch.optim.AdamW([{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}])
        with pytest.raises(nostall.CheckpointLoadError):
            s.load_checkpoint(str(tmp_path), model, split)
        assert s.latest_step(str(tmp_path)) == 1  # nothing already saved was lost


def test_overlap_attaches_the_optimizer_and_copies_buffers_before_returning(tmp_path, staging_gate):
    """With overlap, the next forward (BatchNorm statistics) and step (weights) change nothing saved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(8, 6)).sum().backward()
    opt.step()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    with Strategy(async_save=True, overlap=True) as s:
        mgr = s.manager(str(tmp_path))
        mgr._faults.stage_delay_s = 1.0  # the copy is held (the gate) while training goes on
        h = s.save_checkpoint(str(tmp_path), 1, model, opt)
        model(torch.randn(8, 6)).sum().backward()  # forward changes running_mean/var in place
        staging_gate.release()
        opt.step()  # waits for the copy (attached), then changes the weights
        assert h.result().staged_wait_s > 0
        assert len(opt._optimizer_step_pre_hooks) == 1
    assert not torch.equal(model.state_dict()["1.running_mean"], at_save["1.running_mean"])
    model2 = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 3))
    with Strategy() as s:
        s.load_checkpoint(str(tmp_path), model2)
    for k, v in at_save.items():
        assert torch.equal(model2.state_dict()[k], v), k
