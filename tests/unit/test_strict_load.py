"""Loads are strict both ways by default (torch's ``load_state_dict(strict=True)``): a template key the
checkpoint lacks and a checkpoint key the template lacks are errors naming them; ``strict=False`` loads
the keys both hold and reports the others."""

from __future__ import annotations

import logging

import pytest
import torch

import nostall
from nostall.core.model import PerRank, ShardedTensor


def _mlp(layers: int, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


def _mgr(root) -> nostall.CheckpointManager:
    return nostall.CheckpointManager(str(root), async_save=False)


# --------------------------------------------------------------------------- the three cases of a new user


def test_two_layer_checkpoint_into_one_layer_model_is_refused(tmp_path):
    with _mgr(tmp_path) as mgr:
        mgr.save(1, model=_mlp(2))
        small = _mlp(1, seed=7)
        before = {k: v.clone() for k, v in small.state_dict().items()}
        with pytest.raises(nostall.CheckpointLoadError) as e:
            mgr.load(model=small)
    msg = str(e.value)
    assert "'model/1.weight'" in msg and "'model/1.bias'" in msg and "(2 in all)" in msg
    assert "unexpected" in msg and "strict=False" in msg and str(tmp_path / "step_1") in msg
    for k, v in small.state_dict().items():  # refused before anything was read
        assert torch.equal(v, before[k])


def test_manager_state_load_of_a_subset_is_refused(tmp_path):
    with _mgr(tmp_path) as mgr:
        mgr.save(1, {"a": torch.ones(3), "b": torch.full((2,), 2.0)})
        with pytest.raises(nostall.CheckpointLoadError, match=r"unexpected key\(s\).*\['b'\] \(1 in all\)"):
            mgr.load({"a": torch.zeros(3)})


def test_saved_json_value_left_out_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    nostall.save({"w": torch.ones(2), "meta": {"epoch": 3, "name": "run"}}, path)
    with pytest.raises(nostall.CheckpointLoadError, match=r"\['meta'\]"):
        nostall.load({"w": torch.zeros(2)}, path)


# --------------------------------------------------------------------------- strict=False: values and reports


def test_state_api_not_strict_loads_shared_keys_and_logs_both_lists(tmp_path, caplog):
    path = str(tmp_path / "ck")
    nostall.save({"w": torch.arange(3.0), "meta": {"epoch": 3}, "gone": torch.ones(5)}, path)
    template = {"w": torch.zeros(3), "meta": {"epoch": 0}, "new": torch.full((2,), 9.0), "note": "mine"}
    with caplog.at_level(logging.WARNING, logger="nostall"):
        restored = nostall.load(template, path, strict=False)
    assert torch.equal(restored["w"], torch.arange(3.0)) and torch.equal(template["w"], torch.arange(3.0))
    assert restored["meta"] == {"epoch": 3}
    assert torch.equal(restored["new"], torch.full((2,), 9.0))  # missing: the template's value comes back
    assert restored["note"] == "mine"
    assert "gone" not in restored
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "strict=False" in logged and "'new'" in logged and "'note'" in logged and "'gone'" in logged


def test_state_api_missing_key_is_refused_and_named(tmp_path):
    path = str(tmp_path / "ck")
    nostall.save({"w": torch.ones(2)}, path)
    with pytest.raises(nostall.CheckpointLoadError, match=r"missing key\(s\).*\['extra_w'\]") as e:
        nostall.load({"w": torch.zeros(2), "extra_w": torch.zeros(2)}, path)
    assert "unexpected key(s), in the checkpoint" not in str(e.value)


def test_both_ways_in_one_error(tmp_path):
    path = str(tmp_path / "ck")
    nostall.save({"a": torch.ones(2), "b": torch.ones(2)}, path)
    with pytest.raises(nostall.CheckpointLoadError) as e:
        nostall.load({"a": torch.zeros(2), "c": torch.zeros(2)}, path)
    msg = str(e.value)
    assert "missing key(s), in the template but not in the checkpoint: ['c']" in msg
    assert "unexpected key(s), in the checkpoint but not in the template: ['b']" in msg


def test_many_keys_are_listed_with_their_count(tmp_path):
    path = str(tmp_path / "ck")
    nostall.save({f"t{i}": torch.ones(1) for i in range(12)}, path)
    with pytest.raises(nostall.CheckpointLoadError, match=r", \.\.\.\] \(11 in all\)"):
        nostall.load({"t0": torch.zeros(1)}, path)


def test_training_api_not_strict_reports_keys(tmp_path, caplog):
    big = _mlp(2)
    with _mgr(tmp_path) as mgr:
        mgr.save(1, model=big)
        small = _mlp(1, seed=7)
        with caplog.at_level(logging.WARNING, logger="nostall"):
            loaded = mgr.load(model=small, strict=False)
        assert loaded.missing_keys == []
        assert sorted(loaded.unexpected_keys) == ["model/1.bias", "model/1.weight"]
        assert torch.equal(small[0].weight, big[0].weight) and torch.equal(small[0].bias, big[0].bias)
        assert "model/1.weight" in caplog.text

        # the other way: a 1-layer checkpoint into a 2-layer model
        mgr.save(2, model=_mlp(1, seed=3))
        two = _mlp(2, seed=9)
        kept = two[1].weight.detach().clone()
        with pytest.raises(nostall.CheckpointLoadError, match=r"missing key\(s\).*'model/1.weight'"):
            mgr.load(model=two)
        loaded = mgr.load(model=two, strict=False)
        assert loaded.missing_keys == ["model/1.weight", "model/1.bias"] and loaded.unexpected_keys == []
        assert torch.equal(two[1].weight, kept) and torch.equal(two[0].weight, _mlp(1, seed=3)[0].weight)


def test_strict_success_reports_empty_lists(tmp_path):
    model = _mlp(2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, opt)
    with _mgr(tmp_path) as mgr:
        mgr.save(1, model=model, optimizer=opt, extra={"epoch": 1, "pos": PerRank(5)})
        fresh = _mlp(2, seed=1)
        loaded = mgr.load(model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=0.1))
    assert loaded.missing_keys == [] and loaded.unexpected_keys == []
    assert loaded.extra == {"epoch": 1, "pos": 5}


# --------------------------------------------------------------------------- what the training API checks


def test_objects_not_given_are_not_loaded_and_not_an_error(tmp_path):
    model = _mlp(2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    _train(model, opt)
    with _mgr(tmp_path) as mgr:
        mgr.save(1, model=model, optimizer=opt, scheduler=sched, rng=True, extra={"epoch": 1}, driver={"pos": 4})
        fresh = _mlp(2, seed=5)
        loaded = mgr.load(model=fresh, rng=False)  # model alone, as model.load_state_dict(ckpt["model"])
    assert loaded.missing_keys == [] and loaded.unexpected_keys == []
    assert torch.equal(fresh[1].weight, model[1].weight)
    assert loaded.extra == {"epoch": 1} and loaded.driver == {"pos": 4} and not loaded.rng_restored


def test_optimizer_state_of_a_parameter_the_model_lacks(tmp_path):
    big = _mlp(2)
    opt = torch.optim.AdamW(big.parameters(), lr=0.1)
    _train(big, opt)
    with _mgr(tmp_path) as mgr:
        mgr.save(1, model=big, optimizer=opt)
        small = _mlp(1)
        with pytest.raises(nostall.CheckpointLoadError) as e:
            mgr.load(model=small, optimizer=torch.optim.AdamW(small.parameters(), lr=0.1))
    msg = str(e.value)
    # model/1.{weight,bias} and three states (exp_avg, exp_avg_sq, step) of each of those parameters
    assert "'model/1.weight'" in msg and "'optimizer/state/1.bias/exp_avg'" in msg and "(8 in all)" in msg


def test_extra_template_is_checked(tmp_path):
    with _mgr(tmp_path) as mgr:
        mgr.save(1, model=_mlp(1), extra={"t": torch.ones(2), "u": torch.ones(3)})
        with pytest.raises(nostall.CheckpointLoadError, match=r"\['extra/u'\]"):
            mgr.load(model=_mlp(1), extra={"t": torch.zeros(2)})
        loaded = mgr.load(model=_mlp(1), extra={"t": torch.zeros(2)}, strict=False)
        assert loaded.unexpected_keys == ["extra/u"] and torch.equal(loaded.extra["t"], torch.ones(2))
        loaded = mgr.load(model=_mlp(1))  # no template: the saved extra comes back whole
        assert set(loaded.extra) == {"t", "u"}


# --------------------------------------------------------------------------- structures


def test_nested_dicts_and_lists(tmp_path):
    path = str(tmp_path / "ck")
    state = {"enc": {"layers": [torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)], "cfg": {"d": 4}}}
    nostall.save(state, path)
    template = {"enc": {"layers": [torch.zeros(2), torch.zeros(2)], "cfg": {"d": 0}}}
    with pytest.raises(nostall.CheckpointLoadError, match=r"\['enc/layers/2'\]"):
        nostall.load(template, path)
    restored = nostall.load(template, path, strict=False)
    assert torch.equal(restored["enc"]["layers"][1], torch.full((2,), 2.0)) and restored["enc"]["cfg"] == {"d": 4}
    # the whole of it, as saved: no error
    full = nostall.load({"enc": {"layers": [torch.zeros(2) for _ in range(3)], "cfg": None}}, path)
    assert full["enc"]["cfg"] == {"d": 4}


def test_per_rank_entries(tmp_path):
    path = str(tmp_path / "ck")
    nostall.save({"w": torch.ones(2), "r": PerRank({"pos": 7, "gen": torch.arange(3), "aux": torch.ones(2)})}, path)

    def gen() -> torch.Tensor:
        return torch.zeros(3, dtype=torch.long)

    with pytest.raises(nostall.CheckpointLoadError, match=r"\['r/aux', 'r/gen', 'r/pos'\]"):
        nostall.load({"w": torch.zeros(2)}, path)
    with pytest.raises(nostall.CheckpointLoadError, match=r"unexpected.*\['r/aux'\]"):
        nostall.load({"w": torch.zeros(2), "r": PerRank({"pos": 0, "gen": gen()})}, path)
    with pytest.raises(nostall.CheckpointLoadError, match=r"missing.*\['r/more'\]"):
        nostall.load({"w": torch.zeros(2), "r": PerRank({"pos": 0, "gen": gen(), "aux": torch.zeros(2),
                                                          "more": 1})}, path)
    restored = nostall.load({"w": torch.zeros(2), "r": PerRank({"pos": 0, "gen": gen(), "more": 1})}, path,
                            strict=False)
    assert restored["r"]["pos"] == 7 and restored["r"]["more"] == 1 and "aux" not in restored["r"]
    assert torch.equal(restored["r"]["gen"], torch.arange(3))
    whole = nostall.load({"w": torch.zeros(2), "r": PerRank({"pos": 0, "gen": gen(), "aux": torch.zeros(2)})}, path)
    assert whole["r"]["pos"] == 7 and torch.equal(whole["r"]["aux"], torch.ones(2))


def test_sharded_tensors(tmp_path):
    path = str(tmp_path / "ck")
    full = torch.arange(16.0).reshape(4, 4)
    nostall.save({"s": ShardedTensor(full.clone(), (4, 4), (0, 0)), "t": ShardedTensor(full.clone(), (4, 4), (0, 0))},
                 path)
    half = ShardedTensor(torch.zeros(2, 4), (4, 4), (2, 0))  # another sharding of the same key: no mismatch
    with pytest.raises(nostall.CheckpointLoadError, match=r"\['t'\]"):
        nostall.load({"s": half}, path)
    nostall.load({"s": half}, path, strict=False)
    assert torch.equal(half.data, full[2:])


def test_tied_weights(tmp_path):
    path = str(tmp_path / "ck")
    w = torch.arange(6.0).reshape(2, 3)
    nostall.save({"embed": w, "head": w, "other": torch.ones(1)}, path)
    # a key tied to a loaded one is reached through its tie, whichever of the two the template names
    for name in ("embed", "head"):
        dest = torch.zeros(2, 3)
        nostall.load({name: dest, "other": torch.zeros(1)}, path)
        assert torch.equal(dest, w)
    with pytest.raises(nostall.CheckpointLoadError, match=r"\['other'\]"):
        nostall.load({"embed": torch.zeros(2, 3)}, path)


def test_tied_model_parameters(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(0)
    model = Tied()
    with _mgr(tmp_path) as mgr:
        mgr.save(1, model=model)
        torch.manual_seed(1)
        other = Tied()
        loaded = mgr.load(model=other)
    assert loaded.unexpected_keys == [] and torch.equal(other.head.weight, model.embed.weight)


def test_dtype_mismatch_is_an_error_even_when_not_strict(tmp_path):
    path = str(tmp_path / "ck")
    nostall.save({"w": torch.ones(2)}, path)
    with pytest.raises(nostall.CheckpointLoadError, match="the checkpoint holds torch.float32"):
        nostall.load({"w": torch.zeros(2, dtype=torch.float64)}, path, strict=False)


def test_megatron_strict_values_not_honoured_are_refused(tmp_path):
    from nostall.interop import megatron

    path = str(tmp_path / "ck")
    nostall.save({"w": torch.ones(1)}, path)
    for value in ("log_all", "ignore_all", "return_unexpected", "raise_all"):
        with pytest.raises(ValueError, match=f"strict='{value}' is not supported.*RAISE_UNEXPECTED"):
            megatron.load({}, path, strict=value)
