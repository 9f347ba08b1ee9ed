"""Preemption (issue 27): the preemption signal, ``mgr.preempted``, the grace period, handler chaining.

Each case runs a child interpreter (its own main thread and signal handlers)
and asserts what it printed, its exit status and what the root holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import nostall

_PRELUDE = """
import logging, os, sys, time, signal, threading, torch, nostall
logging.basicConfig(level=logging.INFO)
root = sys.argv[1]
def state(step):
    return {"w": torch.arange(50000, dtype=torch.float32) * step, "step": step}
def say(*words):
    print(*words, flush=True)
"""


def _run(tmp_path, body: str, *, signal_after: str = "", hang_guard: float = 120.0):
    """Run ``body`` in a child; when it prints ``signal_after``, send it SIGTERM. Returns (rc, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath("src")] + sys.path))
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(body)
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        if signal_after:
            for line in p.stdout:  # type: ignore[union-attr]
                lines.append(line)
                if line.strip() == signal_after:
                    p.send_signal(signal.SIGTERM)
                    break
        out, err = p.communicate(timeout=hang_guard)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, "".join(lines) + out, err


def _committed(tmp_path):
    return nostall.CheckpointManager(str(tmp_path / "run"), read_only=True)


def _loads_step(mgr, step):
    t = {"w": torch.zeros(50000), "step": 0}
    assert mgr.load(t, step)["step"] == step
    assert torch.equal(t["w"], torch.arange(50000, dtype=torch.float32) * step)


def test_flag_mode_sets_preempted_and_the_loop_saves_last(tmp_path):
    rc, out, err = _run(tmp_path, """
        with nostall.CheckpointManager(root, async_save=True, exit_on_preemption=False) as mgr:
            mgr.save(1, state(1)).result()
            mgr._faults.writer_delay_s = 1.0
            mgr.save(2, state(2))               # pending when the signal comes
            say("saved")
            step = 2
            while not mgr.preempted:            # the training loop
                time.sleep(0.01)
            say("preempted", mgr.preempted)
            mgr._faults.writer_delay_s = 0.0
            mgr.save(3, state(3))               # the last save, after the signal
        say("closed", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    """, signal_after="saved")
    assert rc == 0, err
    assert "preempted True" in out and "closed True" in out
    assert "preempted (SIGTERM received" in err  # logged once the manager is called again
    with _committed(tmp_path) as mgr:
        assert mgr.steps() == [1, 2, 3] and mgr.latest_step() == 3
        _loads_step(mgr, 2)
        _loads_step(mgr, 3)


def test_exit_mode_lets_a_save_in_progress_finish_then_exits(tmp_path):
    # The signal lands while save(2) copies into host memory (stage_delay_s): the save completes on return,
    # then the exit is raised, and the with block commits it.
    rc, out, err = _run(tmp_path, """
        with nostall.CheckpointManager(root, async_save=True) as mgr:
            mgr.save(1, state(1)).result()
            mgr._faults.stage_delay_s = 1.0
            def signal_inside_save():
                deadline = time.monotonic() + 60
                while mgr._preemption.shield == 0 and time.monotonic() < deadline:
                    time.sleep(0.001)
                os.kill(os.getpid(), signal.SIGTERM)      # while the main thread is inside save()
            threading.Thread(target=signal_inside_save, daemon=True).start()
            try:
                mgr.save(2, state(2))
            except SystemExit as e:
                say("exit raised after the save", e.code, mgr._pending is not None, mgr.preempted)
                raise
            say("not reached")
    """)
    assert rc == 143, err
    assert "exit raised after the save 143 True True" in out and "not reached" not in out
    with _committed(tmp_path) as mgr:
        assert mgr.latest_step() == 2
        _loads_step(mgr, 2)


def test_a_save_not_committed_within_the_grace_period_is_given_up(tmp_path):
    # The writer would take 1000 s: close() stops waiting after grace_s (2 s), not after timeout (600 s).
    rc, out, err = _run(tmp_path, """
        with nostall.CheckpointManager(root, async_save=True, grace_s=2) as mgr:
            mgr.save(1, state(1)).result()
            mgr._faults.writer_delay_s = 1000.0
            mgr.save(2, state(2))
            say("saved")
            time.sleep(600)
    """, signal_after="saved", hang_guard=300)
    assert rc == 143, err
    assert "preempted" in err and "step 2" in err
    with _committed(tmp_path) as mgr:
        assert mgr.latest_step() == 1
        _loads_step(mgr, 1)


def test_a_handler_installed_before_is_called_and_decides(tmp_path):
    rc, out, err = _run(tmp_path, """
        seen = []
        def mine(signum, frame):
            seen.append(signum)
        signal.signal(signal.SIGTERM, mine)
        a = nostall.CheckpointManager(root + "/a")
        b = nostall.CheckpointManager(root + "/b", exit_on_preemption=True)   # chained in front of a's
        assert not a.preempted and not b.preempted
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        say("after", seen, a.preempted, b.preempted)        # mine decided: no exit
        a.close()                                            # out of order: b's handler stays, a's goes inactive
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        say("again", seen)
        b.close()
        say("restored", signal.getsignal(signal.SIGTERM) is mine)
    """)
    assert rc == 0, err
    assert "after [15] True True" in out
    assert "again [15, 15]" in out
    assert "restored True" in out


def test_no_handler_where_the_signal_is_ignored_or_off(tmp_path):
    rc, out, err = _run(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with nostall.CheckpointManager(root + "/a") as a:
            say("ignored", signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with nostall.CheckpointManager(root + "/b", preemption_signal=None) as b, \\
                nostall.CheckpointManager(root + "/c", read_only=True) as c:
            say("off", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, b.preempted, c.preempted)
        with nostall.CheckpointManager(root + "/d", preemption_signal=signal.SIGUSR1,
                                       exit_on_preemption=False) as d:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.1)
            say("usr1", d.preempted, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        say("usr1 restored", signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL)
    """)
    assert rc == 0, err
    assert "ignored True" in out and "off True False False" in out
    assert "usr1 True True" in out and "usr1 restored True" in out


@pytest.mark.parametrize("bad", [{"preemption_signal": signal.SIGKILL}, {"preemption_signal": 0},
                                 {"preemption_signal": "SIGTERM"}, {"grace_s": 0}, {"grace_s": -1.0}])
def test_bad_preemption_options_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        nostall.Options(**bad)
