"""Issue 27: the version handshake between a trainer and its background writer.

A writer's first message says which nostall code it runs (its version and a
hash of the package's source files, :func:`nostall.saving.writer.code_token`);
the trainer passes its own in the writer's environment. A writer of other
code is refused on both sides: it writes nothing (every job it gets fails
through the protocol, so no rank waits), and the trainer raises
:class:`~nostall.saving.writer.WriterVersionError`, a ``CheckpointSaveError``
naming both versions and the fix. The test makes the writer claim other code
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
from nostall.saving.writer import WriterVersionError, code_token

BOUND_S = 60.0  # only a hang reaches it


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


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
        try:
            mgr.save(1, state).result(timeout=BOUND_S)
            pytest.fail("a save went through a writer of other code")
        except WriterVersionError as e:  # the writer's first message was read before the save
            err = e
        except nostall.CheckpointSaveError as e:  # the job reached the writer first: it refused it
            assert "0.0.0+0123456789abcdef" in str(e) and code_token() in str(e)
            with pytest.raises(WriterVersionError) as e2:  # its first message is read by now
                mgr.save(2, state)
            err = e2.value
        assert isinstance(err, nostall.CheckpointSaveError)
        msg = str(err)
        assert "rank 0" in msg and f"process {writer}" in msg and f"pid {os.getpid()}" in msg
        assert "0.0.0+0123456789abcdef" in msg and code_token() in msg
        assert "Restart the job" in msg
        with pytest.raises(WriterVersionError):  # refused every time, never used
            mgr.save(3, state)
        assert mgr.steps() == [] and not os.path.exists(root / "step_1")
    finally:
        mgr.close()
    deadline = time.monotonic() + BOUND_S
    while not _gone(writer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(writer)
    monkeypatch.delenv(TOKEN_ENV)
    with nostall.CheckpointManager(root, async_save=True, timeout=BOUND_S) as mgr:  # a writer of this code
        mgr.save(1, state).result()
        assert mgr.steps() == [1]
