"""Issue 27: the version handshake between a trainer and its background writer.

A writer's first message says which nostall code it runs (its version and a
hash of the package's source files, :func:`nostall.saving.writer.code_token`);
the trainer passes its own in the writer's environment. A writer of other
code is refused on both sides: the trainer reads the writer's first message
before the save's collective rounds (waiting for it, bounded, at the first
save) and reports the refusal there, so that the save fails on every rank
alike with :class:`~nostall.WriterVersionError`, a ``CheckpointSaveError``
naming the rank, both versions and the fix (tests/dist/test_version_ranks.py:
two ranks); the writer also refuses any job it gets itself, writing nothing.
The token is computed when the saving layer is imported: a package changed on
disk after that is caught at the first save. The test makes the writer claim other code
with ``NOSTALL_TEST_WRITER_CODE`` (read only in a writer process:
``nostall.core.faults.code_token_override``).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import nostall
from nostall.core.faults import TOKEN_ENV
from nostall import WriterVersionError
from nostall.saving.writer import code_token
from tests.dist_harness import process_alive

BOUND_S = 60.0  # only a hang reaches it




def test_the_token_names_the_version_and_the_code_and_is_computed_once():
    token = code_token()
    version, _, digest = token.partition("+")
    assert version == nostall.__version__ and len(digest) == 16 and int(digest, 16) >= 0
    assert code_token() == token


def test_the_override_acts_only_in_a_writer_process(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "0.0.0+other")
    assert code_token() != "0.0.0+other"  # this process is a trainer


def test_a_writer_of_the_same_code_serves(tmp_path):
    with nostall.CheckpointManager(tmp_path / "run", async_save=True, timeout=BOUND_S) as mgr:
        mgr.save(1, {"w": torch.arange(10.0)}).result()
        assert mgr.steps() == [1]


def test_a_writer_of_other_code_is_refused_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "0.0.0+0123456789abcdef")
    root = tmp_path / "run"
    state = {"w": torch.arange(1000.0)}
    mgr = nostall.CheckpointManager(root, async_save=True, timeout=BOUND_S)
    writer = mgr.writer_pid
    try:
        with pytest.raises(WriterVersionError) as e1:  # the first save too: it waits for the writer's hello
            mgr.save(1, state)
        err = e1.value
        assert isinstance(err, nostall.CheckpointSaveError)
        msg = str(err)
        assert "rank(s) [0]" in msg and f"process {writer}" in msg and f"pid {os.getpid()}" in msg
        assert "0.0.0+0123456789abcdef" in msg and code_token() in msg
        assert "Restart the job" in msg
        with pytest.raises(WriterVersionError):  # refused every time, never used
            mgr.save(3, state)
        assert mgr.steps() == [] and not os.path.exists(root / "step_1")
    finally:
        mgr.close()
    deadline = time.monotonic() + BOUND_S
    while process_alive(writer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(writer)
    monkeypatch.delenv(TOKEN_ENV)
    with nostall.CheckpointManager(root, async_save=True, timeout=BOUND_S) as mgr:  # a writer of this code
        mgr.save(1, state).result()
        assert mgr.steps() == [1]


_LATE = """
import os, sys, torch
import nostall
from nostall.saving import writer  # the saving layer: the trainer's code token is computed now
with open(os.path.join(os.path.dirname(nostall.__file__), "saving", "commit.py"), "a") as f:
    f.write("\\n# upgraded under the running trainer\\n")
with nostall.CheckpointManager(sys.argv[1], async_save=True, timeout=60) as mgr:
    try:
        mgr.save(1, {"w": torch.zeros(10)}).result()
        print("SAVED", mgr.steps())
    except nostall.WriterVersionError as e:
        print("REFUSED", e)
"""


def test_a_package_changed_after_import_is_caught(tmp_path):
    """The trainer imported nostall's saving layer, then the package changed on disk (an upgrade under the running
    job), then the first manager started its writer: the writer runs the new code, the trainer the old, and the
    first save is refused (a copy of the package, changed by the child process)."""
    import shutil
    import subprocess
    import sys

    pkg = tmp_path / "pkg"
    shutil.copytree(os.path.dirname(nostall.__file__), pkg / "nostall",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(pkg))
    env.pop(TOKEN_ENV, None)
    out = subprocess.run([sys.executable, "-c", _LATE, str(tmp_path / "run")], env=env, capture_output=True,
                         text=True, timeout=BOUND_S * 2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED" in out.stdout and "SAVED" not in out.stdout, out.stdout + out.stderr[-3000:]
