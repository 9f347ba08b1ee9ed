"""The contract of an export at save time: what a manager hands the exporter after each commit.

A manager with ``Options.export`` set runs, after each committed save, the
target's :meth:`ExportTarget.run` on every rank, off the training thread
(:mod:`nostall.saving.exports`). The target itself lives above the API
(``nostall.interop.hf_export.HFExport``); the manager knows only this
contract. No torch here.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from nostall.core.faults import Faults
from nostall.errors import CheckpointSaveError

__all__ = ["ExportTarget", "ExportJob", "ExportOutcome", "CheckpointExportError"]


class CheckpointExportError(CheckpointSaveError):
    """An export at save time failed (the checkpoint it read stays committed and loadable)."""


@dataclass
class ExportJob:
    """One rank's share of the export of one committed checkpoint."""

    checkpoint: str  # the committed checkpoint's location
    step: Optional[int]
    rank: int
    world_size: int
    timeout: float  # bound of every wait (rank 0 waiting for the others' parts)
    faults: Faults = field(default_factory=Faults)
    storage_options: Optional[Dict[str, Any]] = None  # the checkpoint's (an object-storage root)
    cancel: threading.Event = field(default_factory=threading.Event)  # set: stop at the next region, clean up


@dataclass
class ExportOutcome:
    """What one rank's share of an export did. ``error``: why it failed (None: it did its part, and on
    rank 0 the export is published at ``path``)."""

    step: Optional[int]
    rank: int
    path: Optional[str] = None  # the export's directory (None: not known, e.g. the save failed)
    files: List[str] = field(default_factory=list)  # the weights files this rank wrote (names)
    bytes: int = 0  # tensor bytes this rank wrote
    seconds: float = 0.0  # from the start of this rank's part to its end (rank 0: to the publish)
    published: bool = False  # rank 0: the export is visible at ``path``
    error: Optional[CheckpointExportError] = None

    @property
    def ok(self) -> bool:
        return self.error is None


class ExportTarget(abc.ABC):
    """Where and how a manager exports each committed checkpoint (``Options.export``)."""

    @abc.abstractmethod
    def check_step(self, step: Optional[int]) -> None:
        """Refuse (``ValueError``) a save whose step the destination cannot name; called by ``save()``."""

    @abc.abstractmethod
    def run(self, job: ExportJob) -> ExportOutcome:
        """This rank's share of the export of ``job.checkpoint``; raises :class:`CheckpointExportError`."""

    def describe(self) -> Any:
        """A short description for log records."""
        return repr(self)
