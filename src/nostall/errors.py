"""Exceptions raised by nostall.

Every error the library raises on purpose is a :class:`CheckpointError`, so a
training loop can catch the whole family with one ``except`` clause while still
telling save failures, load failures and corruption apart.
"""

from __future__ import annotations

import os
import traceback

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "WriterVersionError",
    "InvalidStateError",
    "CheckpointLoadError",
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
]


class CheckpointError(Exception):
    """Base class of every error raised by nostall."""


class CheckpointSaveError(CheckpointError):
    """A save did not commit. The previous checkpoint is untouched."""


class CheckpointTimeoutError(CheckpointSaveError, TimeoutError):
    """Another rank did not reach a save's collective step within the manager's ``timeout``.

    Usually a rank that calls ``save()`` late (uneven work before the save) or
    is stuck; raise ``timeout`` if such delays are legitimate. Nothing was
    committed; a CheckpointManager's next ``save()`` (on every rank) works again.
    """


class WriterVersionError(CheckpointSaveError):
    """A rank's background writer runs other nostall code than its trainer (the package was reinstalled or
    upgraded under the running job): it is refused and writes nothing. Raised on every rank alike by the save
    that meets it, naming the rank(s); restart the job so that every process runs the same code
    (docs/protocol.md, "Which code")."""


class InvalidStateError(CheckpointSaveError, ValueError):
    """The state handed to ``save`` is not valid (unsupported leaf, bad shards...).

    Raised on every rank, before anything is written.
    """


class CheckpointLoadError(CheckpointError):
    """A checkpoint could not be loaded into the given template."""


class CheckpointNotFoundError(CheckpointLoadError, FileNotFoundError):
    """No committed checkpoint exists where one was asked for."""


class CheckpointCorruptError(CheckpointLoadError):
    """Stored bytes or metadata do not match what the manifest promises."""


def describe(e: BaseException) -> str:
    """One line (or a short trace, for unexpected errors) saying what went wrong."""
    if isinstance(e, CheckpointError):
        return str(e)
    if isinstance(e, (OSError, TimeoutError)):
        return f"{type(e).__name__}: {e}"
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"
