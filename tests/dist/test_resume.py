"""The two-call training API resumes bit-exactly, on real gloo ranks (no mocks).

``mgr.save(step, model=, optimizer=, scheduler=, rng=True, extra=)`` and
``mgr.load(model=, optimizer=, scheduler=)`` on five setups (one rank, DDP,
FSDP2 ``fully_shard``, DTensor tensor parallelism, Megatron-style tensor
parallelism with ``mark_tensor_parallel`` + ``ParallelLayout``): a run
resumed in fresh processes, from a model initialised differently, a fresh
optimizer and a fresh scheduler, repeats the uninterrupted run's losses and
ends with its parameters and optimizer state, bit for bit.

Then two silent-loss regressions of the state-dict approach (each rank's own
optimizer state under Megatron TP; the objects read afresh at every save),
and the handle of an asynchronous save (stats at return, done callbacks).

The rank-side code is in tests/resume_helpers.py.
"""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch

import nostall
from tests import resume_helpers as H
from tests.dist_harness import run_ranks

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
JOB_TIMEOUT = 300.0  # a bound for a hang, not a performance threshold


def _manifest(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def _full_shapes(kind: str) -> dict:
    """The global shapes of the model's tensors (whatever the split over ranks)."""
    if kind == "megatron_tp":
        return {"norm.weight": [H.D_IN], "norm.bias": [H.D_IN], "fc1.weight": [H.HIDDEN, H.D_IN],
                "fc1.bias": [H.HIDDEN], "fc2.weight": [H.D_OUT, H.HIDDEN], "fc2.bias": [H.D_OUT]}
    last = 3 if kind in ("single", "ddp") else 2  # after the dropout, or not
    return {"0.weight": [H.HIDDEN, H.D_IN], "0.bias": [H.HIDDEN],
            f"{last}.weight": [H.D_OUT, H.HIDDEN], f"{last}.bias": [H.D_OUT]}


# --------------------------------------------------------------------------- 1. resume == uninterrupted


@pytest.fixture(scope="module")
def resumed(request, rank_pools, tmp_path_factory):
    """kind -> (roots, reference, resumes), or the exception its runs raised.

    Each kind's reference run (its pool) saves every step into two roots, a synchronous manager's and
    then an asynchronous one's. Then one set of fresh interpreters per world size (a fresh process
    group; other weights, other RNG seeds, fresh optimizer and scheduler) resumes every kind of that
    size from each of its roots in turn, each time into a fresh model; none of them ran a reference.
    Should that set fail, every kind of it fails with that first failure; each kind is then resumed
    again in fresh processes of its own only to add, to that failure, whether it fails alone too.
    """
    kinds = [k for k in H.KINDS if any(getattr(item, "originalname", None) == "test_resume_equals_uninterrupted"
                                       and item.callspec.params["kind"] == k for item in request.session.items)]
    out: dict = {}
    roots: dict = {}
    refs: dict = {}
    for kind in kinds:
        d = tmp_path_factory.mktemp(f"resume-{kind}")
        roots[kind] = {False: str(d / "ckpts-sync"), True: str(d / "ckpts-async")}
        try:
            refs[kind] = rank_pools.get(H.WORLD[kind]).run(
                H.reference_job, kind, [(roots[kind][False], False), (roots[kind][True], True)], timeout=JOB_TIMEOUT)
        except AssertionError as e:
            out[kind] = e
    for world in sorted({H.WORLD[k] for k in refs}):
        group = [k for k in refs if H.WORLD[k] == world]
        plans = [(k, [roots[k][False], roots[k][True]]) for k in group]
        try:
            res = run_ranks(world, H.resume_kinds_job, plans, timeout=JOB_TIMEOUT)
            for i, k in enumerate(group):
                out[k] = (roots[k], refs[k], [res[rank][i] for rank in range(world)])
        except AssertionError as first:
            # the combined run's failure is kept: every kind of the set fails with it; each kind is
            # rerun alone only to say, beside it, whether it also fails alone (and how)
            for k, k_roots in plans:
                try:
                    run_ranks(world, H.resume_each_job, k, k_roots, timeout=JOB_TIMEOUT)
                    alone = "alone, this kind resumed without an error"
                except AssertionError as e:
                    alone = f"alone, this kind failed too: {e}"
                out[k] = AssertionError(f"resuming kinds {group} together in one set of processes failed: "
                                        f"{first}\n({alone})")
    return out


@pytest.mark.parametrize("kind", H.KINDS)
def test_resume_equals_uninterrupted(resumed, kind):
    """Train 1..6 saving after 2 and 4; resume from 4 in fresh processes: steps 5-6 repeat bit for bit.

    Synchronous and asynchronous saves at once (see the ``resumed`` fixture); each root is checked on its own.
    """
    if isinstance(resumed[kind], BaseException):
        raise resumed[kind]
    roots, ref, both = resumed[kind]
    for i, async_save in enumerate((False, True)):
        _check_resume(kind, async_save, roots[async_save], ref, [both[rank][i] for rank in range(H.WORLD[kind])])


def _check_resume(kind: str, async_save: bool, root: str, ref: list, res: list) -> None:
    world = H.WORLD[kind]
    s = H.RESUME_STEP
    problems = []
    for rank in range(world):
        r, q = ref[rank], res[rank]
        at = r["saved"][s]
        tag = f"rank {rank}"
        if not q["is_loaded_checkpoint"]:
            problems.append(f"{tag}: load returned a {q['type']}, not a nostall.LoadedCheckpoint")
        if q["step"] != s:
            problems.append(f"{tag}: resumed.step={q['step']!r}, want {s} (the latest)")
        if q["path"] != q["path_for_step"]:
            problems.append(f"{tag}: resumed.path={q['path']!r}, want {q['path_for_step']!r}")
        if os.path.dirname(q["path"]) != os.path.normpath(root):
            problems.append(f"{tag}: resumed.path={q['path']!r}, not under {root!r}")
        want_extra = {"epoch": s // 3, "loader": rank * 1000 + s}
        if q["extra"] != want_extra:
            problems.append(f"{tag}: resumed.extra={q['extra']!r}, want {want_extra!r}")
        if q["rng_restored"] is not True:
            problems.append(f"{tag}: resumed.rng_restored={q['rng_restored']!r}")
        # the fresh model really started elsewhere (else the test would prove nothing)
        if not H.diff(q["before"], at["params"]):
            problems.append(f"{tag}: the fresh model already equals the saved one")
        # right after the load: the state of step s
        problems += [f"{tag} after load: param {d}" for d in H.diff(q["loaded"]["params"], at["params"])]
        problems += [f"{tag} after load: optimizer state {d}" for d in H.diff(q["loaded"]["opt"], at["opt"])]
        if not at["opt"] or len(at["opt"]) != len(at["params"]):
            problems.append(f"{tag}: the reference's optimizer state holds {sorted(at['opt'])}")
        for key in ("lrs", "last_lr", "last_epoch"):
            if q["loaded"][key] != at[key]:
                problems.append(f"{tag} after load: {key}={q['loaded'][key]!r}, want {at[key]!r}")
        problems += [f"{tag} after load: param_groups {d}" for d in H.diff(q["loaded"]["groups"], at["groups"])]
        # steps s+1.. repeat the uninterrupted run
        want_losses = {k: v for k, v in r["losses"].items() if k > s}
        if q["losses"] != want_losses:
            problems.append(f"{tag}: losses after resume {q['losses']} != uninterrupted {want_losses}")
        problems += [f"{tag} at the end: {d}" for d in H.diff(q["final"], r["final"])]
    assert not problems, f"{kind} ({'async' if async_save else 'sync'}):\n" + "\n".join(problems)

    # the checkpoint is keyed by the inner module's names (DDP unwrapped: no 'module.' prefix), holds
    # every tensor at its global shape, and each optimizer state tensor under its parameter's name,
    # shaped (and so split) like the parameter
    m = _manifest(res[0]["path"])
    shapes = {k: v["shape"] for k, v in m["tensors"].items()}
    model_keys = {k[len("model/"):] for k in shapes if k.startswith("model/")}
    assert model_keys == set(ref[0]["final"]["params"]), sorted(shapes)
    assert {k[len("model/"):]: v for k, v in shapes.items() if k.startswith("model/")} == _full_shapes(kind)
    for name in model_keys:
        for k in ("exp_avg", "exp_avg_sq"):
            assert shapes.get(f"optimizer/state/{name}/{k}") == shapes[f"model/{name}"], (name, k, sorted(shapes))
    assert {"step_2", "step_4"} <= set(os.listdir(root))


# --------------------------------------------------------------------------- 2. silent-loss regressions


@pytest.mark.parametrize("async_save", MODES)
def test_megatron_tp_each_rank_gets_its_own_optimizer_state(tmp_path, pool2, async_save):
    """Megatron-style TP: every rank's exp_avg / exp_avg_sq come back as that rank saved them.

    With ``optimizer.state_dict()`` saved beside ShardedTensor weights, the
    per-rank state tensors were plain (\"replicated\") tensors: one rank's copy
    was written and every rank loaded it.
    """
    root = str(tmp_path / "ckpts")
    step = 2
    ref = pool2.run(H.reference_job, "megatron_tp", root, async_save, step, (step,), timeout=JOB_TIMEOUT)
    res = pool2.run(H.resume_job, "megatron_tp", root, None, step, timeout=JOB_TIMEOUT)
    saved = [ref[r]["saved"][step]["opt"] for r in range(2)]
    # the ranks' values differ for every TP-split parameter (else the test would prove nothing)
    for name in ("fc1.weight", "fc1.bias", "fc2.weight"):
        for k in ("exp_avg", "exp_avg_sq"):
            assert not torch.equal(saved[0][name][k], saved[1][name][k]), (name, k)
    # and the replicated parameters' state is the same on both ranks
    for name in ("fc2.bias", "norm.weight", "norm.bias"):
        assert not H.diff(saved[0][name], saved[1][name]), name
    for rank in range(2):
        got = res[rank]["loaded"]["opt"]
        problems = H.diff(got, saved[rank])
        other = H.diff(got, saved[1 - rank])
        assert not problems, f"rank {rank}'s optimizer state after load differs from what it saved:\n" + "\n".join(
            problems) + ("\n(it equals rank %d's)" % (1 - rank) if not other else "")
        assert not H.diff(res[rank]["loaded"]["params"], ref[rank]["saved"][step]["params"]), rank


@pytest.mark.parametrize("async_save", MODES)
def test_each_save_reads_the_objects_afresh(tmp_path, async_save):
    """Save 1, train and change the learning rate, save 2 with the very same call.

    Each checkpoint holds its own step's learning rate, scheduler and tensors.
    A state dict built once (``{"optim": optimizer.state_dict(), ...}``)
    kept step 1's param_groups and scheduler in checkpoint 2.
    """
    root = str(tmp_path / "ckpts")
    H.seed_all(5)
    s = H.build("single", 0, 1, H.REF_INIT)
    same_call = dict(model=s.model, optimizer=s.optimizer, scheduler=s.scheduler, rng=True)
    want = {}
    with nostall.CheckpointManager(root, keep_last=None, async_save=async_save) as mgr:
        H.train_step(s)
        mgr.save(1, **same_call)
        want[1] = H.snapshot(s)
        H.train_step(s)
        s.optimizer.param_groups[0]["lr"] = 0.0123  # changed by hand, not by the scheduler
        s.optimizer.param_groups[1]["weight_decay"] = 0.05
        mgr.save(2, **same_call)
        want[2] = H.snapshot(s)
        H.train_step(s)  # training goes on (async: while step 2 is written)
    assert want[2]["lrs"][0] == 0.0123 and want[1]["lrs"][0] != 0.0123
    assert H.diff(want[1]["opt"], want[2]["opt"])  # the state tensors changed between the saves
    for step in (2, 1):
        fresh = H.build("single", 0, 1, H.RESUME_INIT)
        with nostall.CheckpointManager(root) as mgr:
            resumed = mgr.load(step=step, model=fresh.model, optimizer=fresh.optimizer, scheduler=fresh.scheduler)
        assert resumed.step == step
        got = H.snapshot(fresh)
        problems = H.diff(got, want[step])
        assert not problems, f"checkpoint {step}:\n" + "\n".join(problems)
        assert fresh.optimizer.param_groups[0]["lr"] == want[step]["lrs"][0]


@pytest.mark.parametrize("async_save", MODES)
def test_a_save_before_the_first_step_then_after_it(tmp_path, async_save):
    """Save 0 with a fresh optimizer (no state yet), then 1 with the same call: 1 holds the state created since.

    Both load into a fresh optimizer: checkpoint 0 with its (empty) state and its param_groups.
    """
    root = str(tmp_path / "ckpts")
    H.seed_all(6)
    s = H.build("single", 0, 1, H.REF_INIT)
    same_call = dict(model=s.model, optimizer=s.optimizer, scheduler=s.scheduler)
    want = {}
    with nostall.CheckpointManager(root, keep_last=None, async_save=async_save) as mgr:
        mgr.save(0, **same_call)
        want[0] = H.snapshot(s)
        H.train_step(s)
        mgr.save(1, **same_call)
        want[1] = H.snapshot(s)
    assert not want[0]["opt"] and want[1]["opt"]
    for step in (1, 0):
        fresh = H.build("single", 0, 1, H.RESUME_INIT)
        with nostall.CheckpointManager(root) as mgr:
            mgr.load(step=step, model=fresh.model, optimizer=fresh.optimizer, scheduler=fresh.scheduler)
        problems = H.diff(H.snapshot(fresh), want[step])
        assert not problems, f"checkpoint {step}:\n" + "\n".join(problems)


# --------------------------------------------------------------------------- 3. the handle of a save


class _CallbackBoom(RuntimeError):
    pass


def test_async_handle_has_stats_at_once_and_runs_done_callbacks_once(tmp_path, caplog):
    root = str(tmp_path / "ckpts")
    H.seed_all(7)
    s = H.build("single", 0, 1, H.REF_INIT)
    H.train_step(s)
    objects = dict(model=s.model, optimizer=s.optimizer, scheduler=s.scheduler, rng=True)
    calls = []
    fired = threading.Event()

    def on_done(h):
        # what the callback sees: the save is over and committed
        calls.append((h, h.done(), h.exception(), os.path.isfile(os.path.join(h.path, "manifest.json"))))
        fired.set()

    def boom(h):
        raise _CallbackBoom(f"callback of step {h.step}")

    with caplog.at_level(logging.DEBUG, logger="nostall"):
        with nostall.CheckpointManager(root, keep_last=3, async_save=True) as mgr:
            h = mgr.save(1, **objects)
            st = h.stats  # before result(): known since save() returned
            assert st is not None, "handle.stats is None right after an async save"
            assert isinstance(st.stall_s, float) and st.stall_s > 0, st
            h.add_done_callback(boom)  # raises: logged, nothing else
            h.add_done_callback(on_done)
            # nothing else is called: the handle learns the outcome by itself
            assert fired.wait(JOB_TIMEOUT), "the done callback did not run within the bound"
            final = h.result()
            assert final.stall_s == st.stall_s  # the stall was known at return and stays what it was
            assert len(calls) == 1 and calls[0] == (h, True, None, True), calls
            # on a handle that is done: at once, in the calling thread
            late = []
            h.add_done_callback(lambda x: late.append((x, threading.current_thread())))
            assert late == [(h, threading.current_thread())]
            # the raising callback broke nothing: the manager saves and loads on
            s.optimizer.param_groups[0]["lr"] = 0.0321
            H.train_step(s)
            h2 = mgr.save(2, **objects)
            h2.result()
            fresh = H.build("single", 0, 1, H.RESUME_INIT)
            assert mgr.load(model=fresh.model, optimizer=fresh.optimizer, scheduler=fresh.scheduler).step == 2
            assert not H.diff(H.snapshot(fresh)["params"], H.snapshot(s)["params"])
            assert mgr.steps() == [1, 2]
    assert len(calls) == 1 and len(late) == 1  # exactly once, whatever came after
    logged = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], _CallbackBoom)]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]
    assert logged[0].levelno >= logging.WARNING


def test_sync_handle_is_done_and_runs_a_callback_at_once(tmp_path):
    H.seed_all(8)
    s = H.build("single", 0, 1, H.REF_INIT)
    H.train_step(s)
    with nostall.CheckpointManager(str(tmp_path / "ckpts"), async_save=False) as mgr:
        h = mgr.save(1, model=s.model, optimizer=s.optimizer)
        assert h.done() and h.stats is not None and h.stats.stall_s > 0
        seen = []
        h.add_done_callback(seen.append)
        assert seen == [h]
