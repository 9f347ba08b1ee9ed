"""Test-only crash points: nothing happens unless ``NOSTALL_TEST_CRASH`` is set.

``NOSTALL_TEST_CRASH="<role>:<point>:<step>"`` makes a process of that role
(``trainer``, or ``writer`` for the background writer, whose environment sets
``NOSTALL_PROCESS_ROLE=writer``) SIGKILL itself when it reaches ``point``
during the save of ``step``. The crash-consistency tests set it in one rank's
environment to stop a process at an exact phase of a save. The points, in
the order a save reaches them:

``planned``, ``staged`` (trainer, async), ``written`` (trainer, sync),
``write.start``, ``write.done`` (writer), ``commit.ready``,
``commit.manifest``, ``commit.renamed``, ``retain.moved`` (whoever commits:
rank 0's writer for async saves, rank 0's trainer for sync ones).
"""

from __future__ import annotations

import os
import signal
from typing import Optional

ENV = "NOSTALL_TEST_CRASH"
ROLE_ENV = "NOSTALL_PROCESS_ROLE"


def crash_point(point: str, step: Optional[int]) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    role, name, at = spec.split(":")
    if name == point and str(step) == at and os.environ.get(ROLE_ENV, "trainer") == role:
        os.kill(os.getpid(), signal.SIGKILL)
