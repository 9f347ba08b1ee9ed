"""What a save returns: a handle (future-like) and its statistics."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Optional

from .errors import CheckpointError

__all__ = ["SaveStats", "SaveHandle"]


@dataclass(frozen=True)
class SaveStats:
    """Timings (seconds) and sizes of one save, as seen by this rank.

    ``stall_s`` is the time ``save()`` blocked the caller, including
    ``wait_s``, the wait for the previous save to commit. ``plan_s`` (the
    collective planning), ``stage_s`` (copy into the staging area, async only),
    ``write_s`` (data files written and fsynced) and ``commit_s`` (waiting for
    the other ranks and the commit) split the work; ``total_s`` runs from the
    call to the commit. ``bytes_written`` is this rank's share,
    ``total_bytes`` the whole checkpoint's data files.

    With overlapped staging (``overlap``), the copy ran after ``save()``
    returned: ``stage_s`` is its duration, ``staged_wait_s`` how long the
    caller then waited for it (``wait_until_staged``, the optimizer hook), and
    ``stall_s`` includes that wait. Under a host-memory budget, ``chunks`` is
    how many pieces the state went through the area in (0: all at once);
    ``staging_bytes`` is the staging area's size (the host memory it held).
    """

    step: Optional[int]
    rank: int
    world_size: int
    async_save: bool
    stall_s: float
    wait_s: float
    plan_s: float
    stage_s: float
    write_s: float
    commit_s: float
    total_s: float
    bytes_written: int
    total_bytes: int
    plan_cached: bool
    overlap: bool = False
    staged_wait_s: float = 0.0
    chunks: int = 0
    staging_bytes: int = 0

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

    def __init__(
        self,
        step: Optional[int],
        path: str,
        driver: Optional[Callable[[Optional[float]], None]] = None,
        peek: Optional[Callable[[], None]] = None,
        reported: Optional[Callable[[BaseException], None]] = None,
    ) -> None:
        self.step = step
        self.path = path
        # async saves: wait (bounded) for the outcome / look without waiting / error seen by the caller
        self._driver = driver
        self._peek = peek
        self._reported = reported
        self._done = threading.Event()
        self._stats: Optional[SaveStats] = None
        self._error: Optional[BaseException] = None

    def _set_result(self, stats: SaveStats) -> None:
        self._stats = stats
        self._done.set()

    def _set_exception(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def _settle(self, timeout: Optional[float]) -> None:
        if self._done.is_set():
            return
        if self._driver is not None:
            try:
                self._driver(timeout)
            except CheckpointError:
                pass  # still pending (checked below)
        if not self._done.wait(0 if self._driver is not None else timeout):
            raise CheckpointError(f"save of step {self.step} not finished within {timeout}s")

    def done(self) -> bool:
        """True once the checkpoint is committed or the save failed. Never blocks."""
        if not self._done.is_set() and self._peek is not None:
            self._peek()
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> SaveStats:
        """Wait (bounded by ``timeout``, default: the manager's) for the commit and
        return the stats, or raise the save's error."""
        self._settle(timeout)
        if self._error is not None:
            if self._reported is not None:
                self._reported(self._error)
            raise self._error
        assert self._stats is not None
        return self._stats

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Wait like :meth:`result`; the save's error, or None if it committed."""
        self._settle(timeout)
        return self._error

    @property
    def stats(self) -> Optional[SaveStats]:
        """The stats once the save succeeded, else None."""
        return self._stats

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error else "committed")
        return f"SaveHandle(step={self.step}, path={self.path!r}, {state})"
