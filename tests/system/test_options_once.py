"""Options entered once (issue 25): defaults only in ``Options``; a setting given twice is refused.

``CheckpointManager``, ``Strategy`` and ``nostall.save`` take each setting
as a keyword argument defaulting to ``NOT_GIVEN``, or (the first two) all of
them as ``options=``; a setting given both ways raises ``TypeError`` naming
it, as Python does for an argument given twice.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import nostall
from nostall import CheckpointManager
from nostall.integrations import CheckpointingMixin, Strategy
from nostall.options import NOT_GIVEN, Options

SETTINGS = [f.name for f in dataclasses.fields(Options)]


@pytest.mark.parametrize("where", [CheckpointManager.__init__, Strategy.__init__])
def test_every_setting_is_a_keyword_whose_default_is_not_given(where):
    params = inspect.signature(where).parameters
    for name in SETTINGS:
        assert name in params, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default is NOT_GIVEN, name  # the default lives in Options only
    assert params["options"].default is None


def test_manager_defaults_are_options_defaults(tmp_path):
    with CheckpointManager(str(tmp_path / "a")) as mgr:
        assert mgr.options == Options()
    with CheckpointManager(str(tmp_path / "b"), keep_last=2, block_size=4096) as mgr:
        assert mgr.options == Options(keep_last=2, block_size=4096)


def test_manager_options_are_honoured(tmp_path):
    opts = Options(keep_last=1, block_size=4096)
    with CheckpointManager(str(tmp_path), options=opts) as mgr:
        assert mgr.options is opts and mgr.keep_last == 1
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((4,), float(step))})
        assert mgr.steps() == [3]


@pytest.mark.parametrize("given", [{"keep_last": 2}, {"keep_last": None}, {"async_save": False},
                                   {"timeout": 30.0, "block_size": 4096}])
def test_manager_refuses_a_setting_given_beside_options(tmp_path, given):
    with pytest.raises(TypeError) as e:
        CheckpointManager(str(tmp_path), options=Options(), **given)
    for name in given:
        assert name in str(e.value)
    assert "options=" in str(e.value) and "CheckpointManager()" in str(e.value)
    # nothing was started or claimed: a manager of the same root can be created at once
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"w": torch.ones(2)})


def test_non_settings_beside_options_are_fine_and_unknown_keywords_raise_as_python_does(tmp_path):
    calls = []
    with CheckpointManager(str(tmp_path), options=Options(keep_last=3), on_commit=calls.append,
                           process_group=None) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    assert [h.step for h in calls] == [1]
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_lats'"):
        CheckpointManager(str(tmp_path), keep_lats=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_lats'"):
        Strategy(keep_lats=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="must be a nostall.Options"):
        CheckpointManager(str(tmp_path), options={"keep_last": 2})  # type: ignore[arg-type]


def test_read_only_with_options_still_never_starts_a_writer(tmp_path):
    with CheckpointManager(str(tmp_path), options=Options(async_save=True), read_only=True) as mgr:
        assert not mgr.async_save and mgr.writer_pid is None


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_strategy_options_are_honoured(tmp_path):
    opts = Options(keep_last=1, block_size=4096, check_replicas=True, max_write_rate=1 << 30)
    model, opt = _model()
    with Strategy(options=opts) as s:
        assert s.options is opts
        for step in (1, 2):
            s.save_checkpoint(str(tmp_path), step, model, opt)
        mgr = s.manager(str(tmp_path))
        assert mgr.options is opts  # every setting reaches the manager, not only those Strategy used to take
        assert mgr.steps() == [2]  # keep_last from options=
    model2 = torch.nn.Linear(4, 3)
    with Strategy() as s:
        assert s.load_checkpoint(str(tmp_path), model2).step == 2
    assert torch.equal(model2.weight, model.weight)


def test_strategy_takes_every_setting_as_a_keyword(tmp_path):
    with Strategy(block_size=4096, incremental=True, full_every=3, fallback_sync=True, check_replicas=False,
                  staging_budget_bytes=1 << 20, max_write_rate=1 << 21) as s:
        assert s.options == Options(block_size=4096, incremental=True, full_every=3, fallback_sync=True,
                                    check_replicas=False, staging_budget_bytes=1 << 20, max_write_rate=1 << 21)
        model, opt = _model()
        s.save_checkpoint(str(tmp_path), 1, model, opt)
        assert s.manager(str(tmp_path)).options is s.options


@pytest.mark.parametrize("given", [{"keep_last": 2}, {"async_save": True}, {"storage_options": {}},
                                   {"overlap": False, "timeout": 5}])
def test_strategy_refuses_a_setting_given_beside_options(given):
    with pytest.raises(TypeError) as e:
        Strategy(options=Options(), **given)
    for name in given:
        assert name in str(e.value)
    assert "Strategy()" in str(e.value)


def test_seam_takes_async_save_from_options_unless_given(tmp_path):
    class Stack(CheckpointingMixin):
        pass

    a, b = Stack(), Stack()
    try:
        assert a.init_checkpointing(options=Options(async_save=True, keep_last=2)).async_save
        assert a.checkpoint_manager.keep_last is None  # the stack owns retention
        assert not b.init_checkpointing(async_save=False, options=Options(async_save=True)).async_save
    finally:
        a.close_checkpointing()
        b.close_checkpointing()


def test_save_defaults_are_options_defaults():
    params = inspect.signature(nostall.save).parameters
    for name in ("timeout", "block_size", "storage_options"):
        assert params[name].default is NOT_GIVEN, name


def test_save_with_storage_options_reaches_an_s3_server(s3, tmp_path):
    s3.make_bucket("once")
    state = {"w": torch.arange(1000, dtype=torch.float32), "meta": {"at": 7}}
    url = "s3://once/run/step_7"
    stats = nostall.save(state, url, storage_options=s3.storage_options, block_size=4096)
    assert stats.bytes_written > 0
    fs = s3.filesystem()
    assert fs.exists("once/run/step_7/manifest.json")
    # what landed in the bucket is a whole checkpoint: copied down, it loads and verifies
    for key in fs.ls("once/run/step_7", detail=False):
        fs.get_file(key, str(tmp_path / key.rsplit("/", 1)[1]))
    got = nostall.load({"w": torch.zeros(1000), "meta": None}, str(tmp_path))
    assert torch.equal(got["w"], state["w"]) and got["meta"] == {"at": 7}
