"""Crash consistency: SIGKILL at every phase of a save, then random kills; nothing committed is ever lost.

The default run covers every crash point once (17 trials) and then 18
random kills (35 trials; ``NOSTALL_CRASH_TRIALS=52`` runs the former default).
``NOSTALL_CRASH_TRIALS=500 make test PYTEST_ARGS="-k crash"`` is the soak mode
(figures in docs/reliability.md); CI runs the default count. On object storage,
``NOSTALL_S3_CRASH_TRIALS`` sets the count (default 18: every crash point, one
kill) and ``NOSTALL_S3_CRASH_STEPS`` the saves per job (default 3, the fewest
that reach retention; 5 as on a local root for the full run). The verdicts do
not depend on the machine's speed (``make test-burn`` runs them beside
CPU burners): kills are timed on this machine's own save time and always hit
a running job (see tests/crash_harness.py).

Incremental mode (``incremental=True``; a mostly frozen state, so later saves
reference each job's first one, which retention then retires while it is
read; ``full_every`` on every other job): every crash point, plus
``NOSTALL_INC_CRASH_KILLS`` random kills (default 5) on a local root, every
crash point on object storage. ``NOSTALL_CRASH_TRIALS`` /
``NOSTALL_S3_CRASH_TRIALS`` set their counts too when given. Besides the
checks above: every committed checkpoint loads bit-exactly, nothing the job
saw committed is lost, no referenced file is ever missing, and after an
uncrashed final job no retired file is left that nothing reads.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest

from tests.crash_harness import Dest, Report, expected_points, run_trials


TRIALS = int(os.environ.get("NOSTALL_CRASH_TRIALS", "35"))
MIN_KILLS = 18  # random kills after the crash points (a smaller NOSTALL_CRASH_TRIALS fails the test)


def _check(report: Report, tmp_path, remote: bool) -> None:
    """The verdicts every run shares (the report's problems: losses, wrong loads, missing references,
    hangs...), and that every crash point was reached and every kill hit."""
    (tmp_path / "crash-report.json").write_text(report.as_json())
    where = f"full report: {tmp_path / 'crash-report.json'}"
    bad = "\n".join(f"trial {t.index} ({t.mode} {t.target}, {t.detail}): {t.problems}" for t in report.failures)
    assert not report.failures, f"{report.summary()}\n{bad}\n{where}"
    # every crash point was reached (one trial each), and every kill hit a running job
    covered = {t.label for t in report.trials if t.mode == "point" and t.hit}
    not_reached = set(expected_points(remote, len(report.trials))) - covered
    assert not not_reached, f"{report.summary()}\nnot reached: {sorted(not_reached)}\n{where}"
    missed = [f"trial {t.index} ({t.mode} {t.target}, {t.detail})" for t in report.trials if not t.hit]
    assert not missed, f"{report.summary()}\nno crash in: {missed}\n{where}"
    # kills are timed on this machine's save time: most land while the victim's rank is saving
    kills = [t for t in report.trials if t.mode == "kill"]
    assert sum(t.mid_save for t in kills) >= len(kills) // 2, f"{report.summary()}\n{where}"


@pytest.mark.timeout(max(300, 4 * TRIALS))
def test_crash_consistency_trials(capsys, tmp_path):
    n = TRIALS
    seed = int(os.environ.get("NOSTALL_CRASH_SEED", "20261201"))
    report = run_trials(n, seed)
    with capsys.disabled():
        print("\n" + report.summary())
    _check(report, tmp_path, remote=False)
    assert len(report.trials) == n and n - len(expected_points(False)) >= MIN_KILLS
    # the run made progress across the crashes: training resumed and committed new checkpoints
    assert report.trials[-1].latest_after and report.trials[-1].latest_after > 3 * len(report.trials) // 4


S3_TRIALS = int(os.environ.get("NOSTALL_S3_CRASH_TRIALS", "18"))
S3_STEPS = int(os.environ.get("NOSTALL_S3_CRASH_STEPS", "3"))  # saves per job (local roots: 5)


@pytest.mark.timeout(max(300, 8 * S3_TRIALS))
def test_crash_consistency_trials_on_object_storage(capsys, tmp_path, s3):
    """The same trials with an s3:// root (a real S3-compatible server on loopback): kills mid-upload too."""
    n = S3_TRIALS
    bucket = s3.make_bucket("crash")
    dest = Dest(f"s3://{bucket}/run", s3.storage_options, timeout=3.0, steps_per_job=S3_STEPS)
    report = run_trials(n, int(os.environ.get("NOSTALL_CRASH_SEED", "20261201")), dest)
    with capsys.disabled():
        print("\n" + report.summary())
    _check(report, tmp_path, remote=True)
    assert report.trials[-1].latest_after and report.trials[-1].latest_after > len(report.trials) // 2


INC_KILLS = int(os.environ.get("NOSTALL_INC_CRASH_KILLS", "5"))


def _trials(env: str, default: int) -> int:
    given: Optional[str] = os.environ.get(env)
    return int(given) if given else default


INC_TRIALS = _trials("NOSTALL_CRASH_TRIALS", len(expected_points(False)) + INC_KILLS)


def _check_incremental(report: Report) -> None:
    # the mode did what it is for: saves referenced earlier checkpoints, retention retired one still read
    assert any(t.references for t in report.trials), report.summary()
    assert any(t.retired for t in report.trials), report.summary()
    assert report.final is not None and not report.final.problems, report.summary()


@pytest.mark.timeout(max(300, 5 * INC_TRIALS))
def test_crash_consistency_trials_incremental(capsys, tmp_path):
    """Incremental saves: each job's later saves read the frozen part from its first checkpoint, which
    keep_last=2 retires while they read it; full_every=3 on every other job makes it unread (collected)."""
    n = INC_TRIALS
    dest = Dest(str(tmp_path / "run"), incremental=True, full_every=3)
    report = run_trials(n, int(os.environ.get("NOSTALL_CRASH_SEED", "20261201")), dest)
    with capsys.disabled():
        print("\n" + report.summary())
    _check(report, tmp_path, remote=False)
    _check_incremental(report)
    assert len(report.trials) == n
    assert report.trials[-1].latest_after and report.trials[-1].latest_after > 3 * len(report.trials) // 4


S3_INC_TRIALS = _trials("NOSTALL_S3_CRASH_TRIALS", len(expected_points(True)))


@pytest.mark.timeout(max(300, 8 * S3_INC_TRIALS))
def test_crash_consistency_trials_incremental_on_object_storage(capsys, tmp_path, s3):
    """Incremental saves on an s3:// root: retired manifests and kept files on object storage."""
    n = S3_INC_TRIALS
    bucket = s3.make_bucket("crash-inc")
    dest = Dest(f"s3://{bucket}/run", s3.storage_options, timeout=3.0, steps_per_job=S3_STEPS, incremental=True,
                full_every=2 if S3_STEPS < 5 else 3)
    report = run_trials(n, int(os.environ.get("NOSTALL_CRASH_SEED", "20261201")), dest)
    with capsys.disabled():
        print("\n" + report.summary())
    _check(report, tmp_path, remote=True)
    _check_incremental(report)
    assert report.trials[-1].latest_after and report.trials[-1].latest_after > len(report.trials) // 2
