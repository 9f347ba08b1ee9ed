"""What a save returns: a handle (future-like) and its statistics."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

from .errors import CheckpointError

__all__ = ["SaveStats", "SaveHandle"]


@dataclass(frozen=True)
class SaveStats:
    """Timings (seconds) and sizes of one save, as seen by this rank.

    ``stall_s`` is the time ``save()`` blocked the caller; ``plan_s``,
    ``write_s`` and ``commit_s`` split the work (``commit_s`` includes waiting
    for the other ranks). ``bytes_written`` is this rank's share,
    ``total_bytes`` the whole checkpoint's tensor data.
    """

    step: Optional[int]
    rank: int
    world_size: int
    stall_s: float
    plan_s: float
    write_s: float
    commit_s: float
    total_s: float
    bytes_written: int
    total_bytes: int
    plan_cached: bool

    @property
    def write_throughput(self) -> float:
        """This rank's bytes per second of write time."""
        return self.bytes_written / self.write_s if self.write_s > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["write_throughput"] = self.write_throughput
        return d


class SaveHandle:
    """The outcome of one ``save()``, in the manner of ``concurrent.futures.Future``."""

    def __init__(self, step: Optional[int], path: str) -> None:
        self.step = step
        self.path = path
        self._done = threading.Event()
        self._stats: Optional[SaveStats] = None
        self._error: Optional[BaseException] = None

    def _set_result(self, stats: SaveStats) -> None:
        self._stats = stats
        self._done.set()

    def _set_exception(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def done(self) -> bool:
        """True once the checkpoint is committed or the save failed."""
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> SaveStats:
        """Wait (bounded by ``timeout``) and return the stats, or raise the save's error."""
        if not self._done.wait(timeout):
            raise CheckpointError(f"save of step {self.step} not finished within {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._stats is not None
        return self._stats

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if not self._done.wait(timeout):
            raise CheckpointError(f"save of step {self.step} not finished within {timeout}s")
        return self._error

    @property
    def stats(self) -> Optional[SaveStats]:
        """The stats once the save succeeded, else None."""
        return self._stats

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        return f"SaveHandle(step={self.step}, path={self.path!r}, {state})"
