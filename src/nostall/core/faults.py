"""Test-only fault injection: one object, inert unless a test arms it.

:class:`Faults` is the single place where tests reach into a save: a
manager owns one (``mgr._faults``), and it travels with every save job to
the writer process, so the same knobs act on synchronous and asynchronous
saves. Production code only ever *asks* it (``faults.check("latest")``);
nothing in a production type is a test field.

Crash points: ``NOSTALL_TEST_CRASH="<role>:<point>:<step>"`` makes a process
of that role (``trainer``, or ``writer`` for the background writer, whose
environment sets ``NOSTALL_PROCESS_ROLE=writer``) SIGKILL itself when it
reaches ``point`` during the save of ``step``. The crash-consistency tests
set it in one rank's environment to stop a process at an exact phase of a
save. The points, in the order a save reaches them:

``planned``, ``staged`` (trainer, async), ``write.start``, ``write.done`` (whoever writes), ``upload.done``,
``commit.ready``, ``commit.manifest``, ``commit.renamed``, ``retain.moved``
(whoever commits: rank 0's writer for async saves, rank 0's trainer for sync
ones); then, with an export at save time (in each rank's trainer),
``export.written`` (a rank's files are written, its done mark not yet) and
``export.publish`` (rank 0, everything written, before the rename into place).
A malformed value is refused (``ValueError``) when a :class:`Faults` is made,
that is where a manager (or a saver, or a storage root) starts: :func:`check_env`.

This module does not import torch.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

ENV = "NOSTALL_TEST_CRASH"
ROLE_ENV = "NOSTALL_PROCESS_ROLE"


TOKEN_ENV = "NOSTALL_TEST_WRITER_CODE"
"""A test's stand-in for the code token of a writer process (:func:`code_token_override`)."""


def code_token_override() -> str:
    """In a writer process, ``NOSTALL_TEST_WRITER_CODE`` when set: the code token it then claims to run, so that a
    test shows a trainer a writer of other code (the version handshake). "" otherwise (always in a trainer)."""
    if os.environ.get(ROLE_ENV) != "writer":
        return ""
    return os.environ.get(TOKEN_ENV, "")


ROLES = ("trainer", "writer")
POINTS = ("planned", "staged", "write.start", "write.done", "upload.done", "commit.ready", "commit.manifest",
          "commit.renamed", "retain.moved", "export.written", "export.publish")


def _parse(spec: str) -> Tuple[str, str, str]:
    """``<role>:<point>:<step>``, checked: a ``ValueError`` naming the variable otherwise."""
    parts = spec.split(":")
    if (len(parts) != 3 or parts[0] not in ROLES or parts[1] not in POINTS
            or not (parts[2].isdigit() or parts[2] == "None")):
        raise ValueError(f"{ENV}={spec!r} is not <role>:<point>:<step> (role one of {', '.join(ROLES)}; "
                         f"point one of {', '.join(POINTS)}; step a non-negative integer or None)")
    return parts[0], parts[1], parts[2]


def check_env() -> None:
    """Refuse a malformed ``NOSTALL_TEST_CRASH`` at once (where a manager or writer starts), not mid-save."""
    spec = os.environ.get(ENV)
    if spec:
        _parse(spec)


def crash_point(point: str, step: Optional[int]) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    role, name, at = _parse(spec)
    if name == point and str(step) == at and os.environ.get(ROLE_ENV, "trainer") == role:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Faults:
    """What a test asks to go wrong (nothing, by default). Picklable.

    ``writer_delay_s``: the writing of a save's files sleeps this long first.
    ``writer_fault``: ``"enospc"`` fails the writing of the files like a full disk.
    ``stage_delay_s``: the copy into host memory (async saves) sleeps this long (before each chunk, when the
    copy goes in chunks: a budget's, or an overlapped save's streamed ones).
    ``export_fault``: ``"eio"`` fails an export at save time like an I/O error, after the first region of this
    rank's first file is written.
    ``fail``: storage operation -> errno, raised as ``OSError`` when the
    operation runs (operations: ``"latest"``, ``"outcome"``, ``"manifest"``,
    ``"record"``); ``fail_times`` limits how often (default: every time).
    ``writer_gate``: a file's path: the writing of a save's files waits until it exists (bounded by the
    save's deadline), so that a test holds a writer (an orphan finishing its job) as long as it needs.
    """

    writer_delay_s: float = 0.0
    writer_fault: Optional[str] = None
    stage_delay_s: float = 0.0
    export_fault: Optional[str] = None
    fail: Dict[str, int] = field(default_factory=dict)
    fail_times: Dict[str, int] = field(default_factory=dict)
    writer_gate: str = ""

    def __post_init__(self) -> None:
        check_env()  # a malformed NOSTALL_TEST_CRASH fails where a manager starts, not mid-save

    def check(self, op: str, path: str = "") -> None:
        """Raise the ``OSError`` armed for ``op``, if any."""
        code = self.fail.get(op)
        if code is None:
            return
        left = self.fail_times.get(op)
        if left is not None:
            if left <= 0:
                return
            self.fail_times[op] = left - 1
        raise OSError(code, f"{os.strerror(code)} (test fault on {op})", path)

    def wait_gate(self, deadline: float) -> None:
        """Wait until the armed ``writer_gate`` file exists; ``TimeoutError`` past ``deadline`` (monotonic)."""
        while self.writer_gate and not os.path.exists(self.writer_gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test's gate {self.writer_gate} did not open (test fault)")
            time.sleep(0.05)

    def check_export(self, name: str) -> None:
        """An export at save time wrote a region of file entry ``name``: the armed fault."""
        if self.export_fault == "eio":
            raise OSError(errno.EIO, "Input/output error (test fault)", name)

    def check_write(self, path: str) -> None:
        """The writing of a save's files: the armed delay and fault."""
        if self.writer_fault == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device (test fault)", path)
