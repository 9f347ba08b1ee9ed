"""Exceptions raised by nostall.

Every error the library raises on purpose is a :class:`CheckpointError`, so a
training loop can catch the whole family with one ``except`` clause while still
telling save failures, load failures and corruption apart.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "InvalidStateError",
    "CheckpointLoadError",
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
]


class CheckpointError(Exception):
    """Base class of every error raised by nostall."""


class CheckpointSaveError(CheckpointError):
    """A save did not commit. The previous checkpoint is untouched."""


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
