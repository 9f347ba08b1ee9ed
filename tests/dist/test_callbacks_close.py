"""Commit callbacks at close() and at exit (issue 24, defects 3 and 4).

A commit callback (``on_commit``, ``SaveHandle.add_done_callback``) either
finishes or is reported: close() and interpreter exit wait for it (bounded),
never while holding the manager's lock, so a callback may itself call the
manager (save, load, finalize_pending_saves); one that outlives close()'s bound
is logged as an error naming its step and itself. Single process, real async
saves; the bounds here only break on a hang.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import nostall

BOUND = 60.0  # generous: only a hang (or a wait for a 120 s timeout) goes past it


def _state(v: float):
    return {"w": torch.full((64, 64), float(v)), "n": {"step": int(v)}}


def _tmpl():
    return {"w": torch.zeros(64, 64), "n": {}}


def _committed(root) -> list:
    with nostall.CheckpointManager(root, read_only=True) as reader:
        return reader.steps()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@pytest.mark.parametrize("how", ["on_commit", "add_done_callback"])
def test_close_waits_for_a_callback_running_in_the_watcher(tmp_path, how):
    marker = str(tmp_path / "uploaded")
    started = threading.Event()

    def upload(h):  # a callback that takes a while (uploading a marker, say)
        started.set()
        time.sleep(1.0)
        _write(marker, str(h.step))

    root = str(tmp_path / "ckpts")
    mgr = nostall.CheckpointManager(root, async_save=True, timeout=120,
                                    on_commit=upload if how == "on_commit" else None)
    h = mgr.save(1, _state(1))
    if how == "add_done_callback":
        h.add_done_callback(upload)
    assert started.wait(BOUND), "the callback did not start"
    t0 = time.monotonic()
    mgr.close()
    assert os.path.exists(marker), "close() returned while the commit callback was still running"
    assert open(marker).read() == "1"
    assert time.monotonic() - t0 < BOUND


def test_a_callback_may_save_when_close_settles_its_save(tmp_path):
    """close() right after save(): close settles the save, the callback saves again: not deadlocked, not lost."""
    root = str(tmp_path / "ckpts")
    outcome: dict = {}

    def on_commit(h):
        if h.step == 1:
            try:
                outcome["handle"] = mgr.save(2, _state(2))
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                outcome["error"] = e

    mgr = nostall.CheckpointManager(root, async_save=True, timeout=120, on_commit=on_commit)
    mgr.save(1, _state(1))
    t0 = time.monotonic()
    mgr.close()
    took = time.monotonic() - t0
    assert "error" not in outcome, outcome
    assert took < BOUND, f"close() took {took:.0f}s: it waited for a callback blocked on the manager"
    assert _committed(root) == [1, 2]
    assert outcome["handle"].done() and outcome["handle"].exception() is None
    with nostall.CheckpointManager(root, read_only=True) as reader:
        assert reader.load(_tmpl(), step=2)["n"] == {"step": 2}


def test_a_callback_may_save_after_close_began(tmp_path):
    """The callback runs on when close() begins, then saves: close() waits for it and commits its save."""
    root = str(tmp_path / "ckpts")
    started = threading.Event()
    outcome: dict = {}

    def on_commit(h):
        if h.step != 1:
            outcome["second"] = h.step
            return
        started.set()
        time.sleep(0.5)  # close() has begun by now (on a fast machine; the outcome is the same either way)
        try:
            outcome["handle"] = mgr.save(2, _state(2))
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e

    mgr = nostall.CheckpointManager(root, async_save=True, timeout=120, on_commit=on_commit)
    mgr.save(1, _state(1))
    assert started.wait(BOUND)
    t0 = time.monotonic()
    mgr.close()
    assert time.monotonic() - t0 < BOUND
    assert "error" not in outcome, outcome
    assert outcome.get("second") == 2, "the on_commit of the callback's own save did not run before close returned"
    assert _committed(root) == [1, 2]


def test_a_callback_may_load_and_finalize_while_close_waits(tmp_path):
    root = str(tmp_path / "ckpts")
    seen = str(tmp_path / "seen")
    started = threading.Event()
    errors: list = []

    def on_commit(h):
        started.set()
        time.sleep(0.5)
        try:
            mgr.finalize_pending_saves()
            out = mgr.load(_tmpl(), step=h.step)
            _write(seen, f"{out['n']['step']} {float(out['w'][0, 0])}")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    mgr = nostall.CheckpointManager(root, async_save=True, timeout=120, on_commit=on_commit)
    mgr.save(7, _state(7))
    assert started.wait(BOUND)
    t0 = time.monotonic()
    mgr.close()
    assert time.monotonic() - t0 < BOUND
    assert not errors, errors
    assert open(seen).read() == "7 7.0"


def test_a_callback_may_call_the_manager_while_the_next_save_runs(tmp_path):
    """The next save() does not hold the manager's lock while a commit callback of the previous save runs."""
    root = str(tmp_path / "ckpts")
    loaded: list = []
    errors: list = []

    def on_commit(h):
        try:
            if h.step == 1:
                loaded.append(mgr.load(_tmpl(), step=1)["n"]["step"])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t0 = time.monotonic()
    mgr = nostall.CheckpointManager(root, async_save=True, timeout=120, on_commit=on_commit)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    mgr.close()
    assert time.monotonic() - t0 < BOUND
    assert not errors, errors
    assert loaded == [1]
    assert _committed(root) == [1, 2]


def test_a_callback_past_the_close_bound_is_logged_and_its_late_call_fails_at_once(tmp_path, caplog):
    root = str(tmp_path / "ckpts")
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    late: list = []

    def slow_marker_upload(h):
        started.set()
        release.wait(BOUND)
        t = time.monotonic()
        try:
            mgr.save(2, _state(2))
        except nostall.CheckpointError as e:
            late.append((e, time.monotonic() - t))
        finally:
            finished.set()

    mgr = nostall.CheckpointManager(root, async_save=True, timeout=120, on_commit=slow_marker_upload)
    mgr.save(1, _state(1))
    assert started.wait(BOUND)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="nostall"):
        mgr.close(timeout=1.0)
    assert time.monotonic() - t0 < BOUND
    errors = [r for r in caplog.records if r.name == "nostall" and r.levelno >= logging.ERROR]
    assert any("step 1" in r.getMessage() and "slow_marker_upload" in r.getMessage() for r in errors), \
        [r.getMessage() for r in caplog.records]
    release.set()
    assert finished.wait(BOUND)
    assert len(late) == 1, late
    error, took = late[0]
    assert "closed" in str(error) and took < BOUND
    assert _committed(root) == [1]


def test_close_from_inside_a_callback_does_not_wait_for_itself(tmp_path):
    root = str(tmp_path / "ckpts")
    done = threading.Event()
    took: list = []

    def on_commit(h):
        t = time.monotonic()
        mgr.close()
        took.append(time.monotonic() - t)
        done.set()

    mgr = nostall.CheckpointManager(root, async_save=True, timeout=120, on_commit=on_commit)
    mgr.save(1, _state(1))
    assert done.wait(BOUND)
    assert took[0] < BOUND
    mgr.close()  # idempotent
    assert _committed(root) == [1]
    with pytest.raises(nostall.CheckpointError, match="closed"):
        mgr.save(2, _state(2))


_EXIT_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    import torch, nostall

    root, out = sys.argv[1], sys.argv[2]
    started = threading.Event()

    def on_commit(h):
        if h.step == 1:
            started.set()
            time.sleep(1.0)          # still running when the interpreter exits
            mgr.save(2, {"w": torch.full((8,), 2.0)})
        with open(f"{out}/marker{h.step}", "w") as f:
            f.write(str(h.step))

    mgr = nostall.CheckpointManager(root, async_save=True, timeout=120, on_commit=on_commit)
    mgr.save(1, {"w": torch.full((8,), 1.0)})
    assert started.wait(60)
    # no close(): the interpreter exits with the callback running
""")


def test_a_callback_running_at_exit_is_waited_for(tmp_path):
    root, out = str(tmp_path / "ckpts"), str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, root, out], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert os.path.exists(os.path.join(out, "marker1")), proc.stderr
    assert os.path.exists(os.path.join(out, "marker2")), proc.stderr
    assert _committed(root) == [1, 2]
