"""Crash consistency: SIGKILL at every phase of a save, 50+ trials, nothing committed is ever lost.

``NOSTALL_CRASH_TRIALS=500 make test PYTEST_ARGS="-k crash"`` is the soak mode
(figures in docs/reliability.md); CI runs the default count.
"""

from __future__ import annotations

import os

import pytest

from tests.crash_harness import (
    COMMIT_POINTS, REMOTE_COMMIT_POINTS, REMOTE_WRITER_POINTS, TRAINER_POINTS, WRITER_POINTS, Dest, run_trials,
)


TRIALS = int(os.environ.get("NOSTALL_CRASH_TRIALS", "52"))


@pytest.mark.timeout(max(300, 4 * TRIALS))
def test_crash_consistency_trials(capsys, tmp_path):
    n = TRIALS
    seed = int(os.environ.get("NOSTALL_CRASH_SEED", "20261201"))
    report = run_trials(n, seed)
    with capsys.disabled():
        print("\n" + report.summary())
    (tmp_path / "crash-report.json").write_text(report.as_json())
    bad = "\n".join(f"trial {t.index} ({t.mode} {t.target}, {t.detail}): {t.problems}" for t in report.failures)
    assert not report.failures, f"{report.summary()}\n{bad}\nfull report: {tmp_path / 'crash-report.json'}"
    assert len(report.trials) == n and n >= 50
    covered = {t.detail.split(" at ")[0] for t in report.trials if t.mode == "point" and t.hit}
    assert covered >= set(TRAINER_POINTS + WRITER_POINTS + COMMIT_POINTS + ("written",))
    # most trials really crashed something mid-job (a kill can land after a job already finished)
    assert sum(t.hit for t in report.trials) >= 0.7 * n
    # the run made progress across the crashes: training resumed and committed new checkpoints
    assert report.trials[-1].latest_after and report.trials[-1].latest_after > 3 * len(report.trials) // 4


S3_TRIALS = int(os.environ.get("NOSTALL_S3_CRASH_TRIALS", "18"))


@pytest.mark.timeout(max(300, 8 * S3_TRIALS))
def test_crash_consistency_trials_on_object_storage(capsys, tmp_path, s3):
    """The same trials with an s3:// root (a real S3-compatible server on loopback): kills mid-upload too."""
    n = S3_TRIALS
    bucket = s3.make_bucket("crash")
    dest = Dest(f"s3://{bucket}/run", s3.storage_options, timeout=3.0)
    report = run_trials(n, int(os.environ.get("NOSTALL_CRASH_SEED", "20261201")), dest)
    with capsys.disabled():
        print("\n" + report.summary())
    (tmp_path / "crash-report.json").write_text(report.as_json())
    bad = "\n".join(f"trial {t.index} ({t.mode} {t.target}, {t.detail}): {t.problems}" for t in report.failures)
    assert not report.failures, f"{report.summary()}\n{bad}\nfull report: {tmp_path / 'crash-report.json'}"
    covered = {t.detail.split(" at ")[0] for t in report.trials if t.mode == "point" and t.hit}
    assert covered >= set(TRAINER_POINTS + REMOTE_WRITER_POINTS + REMOTE_COMMIT_POINTS + ("written",))
    assert report.trials[-1].latest_after and report.trials[-1].latest_after > len(report.trials) // 2
