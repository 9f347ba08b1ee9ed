"""What a save returns: a handle (future-like) and its statistics."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional

from nostall.errors import CheckpointError

log = logging.getLogger("nostall")

__all__ = ["SaveStats", "SaveHandle"]


def _describe(fn: Callable[..., Any]) -> str:
    """A callback's name for a log record: its qualified name (``on_commit=...`` for a manager's)."""
    if isinstance(fn, OnCommit):
        return f"on_commit={_describe(fn.fn)}"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module != "builtins" else str(name)


class OnCommit:
    """A manager's ``on_commit`` as a done callback: called for a committed save only, and named as
    itself when a wait for it runs out. (For the manager; not part of the user API.)"""

    def __init__(self, fn: Callable[["SaveHandle"], Any]) -> None:
        self.fn = fn

    def __call__(self, handle: "SaveHandle") -> None:
        if handle.exception(0) is None:
            self.fn(handle)


@dataclass(frozen=True)
class SaveStats:
    """Timings (seconds) and sizes of one save, as seen by this rank.

    ``stall_s`` is the time ``save()`` blocked the caller, including
    ``wait_s``, the wait for the previous save to commit. ``plan_s`` (the
    collective planning), ``stage_s`` (copy into the staging area, async only),
    ``write_s`` (data files written and fsynced) and ``commit_s`` (waiting for
    the other ranks and the commit) split the work; ``total_s`` runs from the
    call to the commit. ``bytes_written`` is what this rank wrote (its data
    files, side files included; an incremental save writes only the pieces
    that changed), ``total_bytes`` the size of the whole checkpoint's data as
    planned (what a load of it reads, reused pieces included).

    With overlapped staging (``overlap``), the copy ran after ``save()``
    returned: ``stage_s`` is its duration, ``staged_wait_s`` how long the
    caller then waited for it (``wait_until_staged``, the optimizer hook), and
    ``stall_s`` includes that wait. Under a host-memory budget, ``chunks`` is
    how many pieces the state went through the area in (0: all at once);
    ``staging_bytes`` is the staging area's size (the host memory it held).

    ``final`` says whether these figures are the save's last word. A
    synchronous save's stats, and an asynchronous save's once it is committed
    (``handle.result()`` returned, or in a done callback or ``on_commit``),
    are final: every field is known and never changes again. An asynchronous
    save's handle holds *provisional* stats from the moment ``save()``
    returns until then (``final`` False): ``step``, ``rank``, ``world_size``,
    ``async_save``, ``wait_s``, ``plan_s``, ``total_bytes``, ``plan_cached``,
    ``overlap``, ``chunks`` and ``staging_bytes`` already have their final
    values, and so do ``stall_s`` and ``stage_s`` unless ``overlap`` (the copy
    and the wait for it are still to come); ``bytes_written``, ``write_s``,
    ``commit_s`` and ``total_s`` are None (what is written is known only once
    the writer has written it: an incremental save may reuse most pieces).
    ``handle.stats`` is replaced by the final stats at the commit; a failed
    save has none.
    """

    step: Optional[int]
    rank: int
    world_size: int
    async_save: bool
    stall_s: float
    wait_s: float
    plan_s: float
    stage_s: float
    write_s: Optional[float]
    commit_s: Optional[float]
    total_s: Optional[float]
    bytes_written: Optional[int]
    total_bytes: int
    plan_cached: bool
    overlap: bool = False
    staged_wait_s: float = 0.0
    chunks: int = 0
    staging_bytes: int = 0
    final: bool = True

    @property
    def committed(self) -> bool:
        """The same as ``final``: these are the stats of a committed save."""
        return self.final

    @property
    def write_throughput(self) -> float:
        """This rank's bytes per second of write time (0.0 until final)."""
        return self.bytes_written / self.write_s if self.bytes_written is not None and self.write_s else 0.0

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["write_throughput"] = self.write_throughput
        return d


class SaveHandle:
    """The outcome of one ``save()``, in the manner of ``concurrent.futures.Future``.

    Example::

        handle = mgr.save(step, model=model, optimizer=optimizer)   # async_save=True
        print(f"blocked {handle.stats.stall_s * 1e3:.0f} ms")      # known at once
        handle.add_done_callback(lambda h: print("committed", h.path) if h.exception() is None else None)
        handle.result()                                              # waits for the commit, then retention (bounded)
    """

    def __init__(
        self,
        step: Optional[int],
        path: str,
        driver: Optional[Callable[[Optional[float]], None]] = None,
        peek: Optional[Callable[[], Optional[bool]]] = None,
        reported: Optional[Callable[[BaseException], None]] = None,
        staged: Optional[SaveStats] = None,
    ) -> None:
        self.step = step
        self.path = path
        # async saves: wait (bounded) for the outcome / look without waiting / error seen by the caller
        self._driver = driver
        self._peek = peek
        self._reported = reported
        self._done = threading.Event()
        self._stats: Optional[SaveStats] = staged
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._callbacks: List[Callable[["SaveHandle"], Any]] = []
        # the callback each thread runs now (a stack: one may add another, run at once), so that a wait for
        # them skips the waiting thread's own and a report names the one that overran
        self._active: Dict[int, List[Callable[["SaveHandle"], Any]]] = {}
        self._changed = threading.Condition(self._lock)  # notified when a thread finishes running callbacks
        self._watcher: Optional[threading.Thread] = None

    def _set_result(self, stats: SaveStats) -> None:
        self._stats = stats
        self._finish()

    def _set_exception(self, error: BaseException) -> None:
        self._error = error
        self._finish()

    def _finish(self) -> None:
        self._done.set()  # callbacks run later, outside the manager's lock (_run_callbacks)

    def _run_callbacks(self) -> None:
        """Run the callbacks due, in this thread. Never called with the manager's lock held (a callback may
        call the manager)."""
        me = threading.get_ident()
        with self._lock:
            if not self._done.is_set() or not self._callbacks:
                return
            callbacks, self._callbacks = self._callbacks, []
            stack = self._active.setdefault(me, [])
            stack.append(callbacks[0])
        try:
            for fn in callbacks:
                stack[-1] = fn
                self._call(fn)
        finally:
            with self._lock:
                stack.pop()
                if not stack:
                    del self._active[me]
                self._changed.notify_all()

    def _quiet(self, strict: bool = False) -> bool:
        """No callback is due or running (with ``_lock`` held), the calling thread's own running ones
        aside unless ``strict``. A save with no outcome yet has none due."""
        me = None if strict else threading.get_ident()
        return not (self._done.is_set() and self._callbacks) and all(t == me for t in self._active)

    def _callbacks_quiet(self, strict: bool = False) -> bool:
        """See ``_quiet``: for the manager, which waits at close() for the handles that are not, and
        forgets (``strict``) the done ones that are."""
        with self._lock:
            return self._quiet(strict) and (not strict or self._done.is_set())

    def _wait_callbacks(self, deadline: float) -> List[str]:
        """Wait until no callback is due or running in another thread, or until ``deadline``
        (``time.monotonic()``); the names of those still due or running then (empty: none).

        Only waits: the callbacks due are run by the handle's watcher thread (a new one if it ended),
        so that a callback that never returns does not take the waiting thread with it."""
        with self._lock:
            if self._done.is_set() and self._callbacks and (self._watcher is None or not self._watcher.is_alive()):
                self._watcher = threading.Thread(target=self._run_callbacks, name=f"nostall-handle-{self.step}",
                                                 daemon=True)
                self._watcher.start()
            self._changed.wait_for(self._quiet, max(0.0, deadline - time.monotonic()))
            if self._quiet():
                return []
            me = threading.get_ident()
            late = [_describe(stack[-1]) for t, stack in self._active.items() if t != me and stack]
            if self._done.is_set():
                late += [f"{_describe(fn)} (not started)" for fn in self._callbacks]
            return late

    def _finish_callbacks(self, timeout: float) -> None:
        """Run the callbacks due, and wait (bounded) for any another thread is running now."""
        self._run_callbacks()
        late = self._wait_callbacks(time.monotonic() + timeout)
        if late:
            log.warning("the done callback %s of the save of step %s still runs after %.0fs",
                        ", ".join(late), self.step, timeout)

    def _call(self, fn: Callable[["SaveHandle"], Any]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("a done callback (%s) of the save of step %s raised", _describe(fn), self.step)

    def add_done_callback(self, fn: Callable[["SaveHandle"], Any]) -> None:
        """Call ``fn(handle)`` once the save is committed or failed (at once if it already is).

        As in ``concurrent.futures``: callbacks run in the order added, in
        the thread that learns the outcome (a watcher thread of this handle,
        which looks about every 50 ms, or a caller of ``result()``, ``done()``,
        the next ``save()`` or ``finalize_pending_saves()``); an exception a
        callback raises is logged and ignored. A failed save's error is
        ``handle.exception()`` inside the callback; it is still raised by
        the manager's next call, as for any failed save.

        A callback never runs with the manager's lock held: it may call the
        manager (``save``, ``load``, ``finalize_pending_saves``), also while
        ``close()`` waits for it. ``close()`` and the manager's exit handler
        wait for running callbacks, bounded by their timeout; one still
        running then is logged as an error (at exit, the interpreter then
        cuts it off).
        """
        self._add_callback(fn, run=True)

    def _add_callback(self, fn: Callable[["SaveHandle"], Any], run: bool) -> None:
        """add_done_callback; ``run`` False: leave a callback due now to the caller, who holds the
        manager's lock and runs it (``_run_callbacks``) once it released it."""
        with self._lock:
            self._callbacks.append(fn)
            if not self._done.is_set() and self._watcher is None and self._peek is not None:
                self._watcher = threading.Thread(target=self._watch, name=f"nostall-handle-{self.step}",
                                                 daemon=True)
                self._watcher.start()
        if run:
            self._run_callbacks()

    def _watch(self) -> None:
        """Look for the outcome without blocking anyone, until it is known or nobody can learn it."""
        peek = self._peek
        assert peek is not None
        while not self._done.wait(0.05):
            try:
                if peek() is False:
                    break  # the manager closed without an outcome for this save
            except Exception:
                log.exception("watching the save of step %s failed", self.step)
                break
        self._run_callbacks()

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
        self._run_callbacks()

    def done(self) -> bool:
        """True once the checkpoint is committed or the save failed. Never blocks; looks for the outcome."""
        if not self._done.is_set() and self._peek is not None:
            self._peek()
        if self._done.is_set():
            self._run_callbacks()
            return True
        return False

    def result(self, timeout: Optional[float] = None) -> SaveStats:
        """Wait (bounded by ``timeout``, default: the manager's) for the commit and
        return the stats, or raise the save's error.

        For an asynchronous save it then also waits, up to ``timeout`` again,
        for what the writer does after the commit: on rank 0, retention
        (deleting the checkpoints ``keep_last`` drops) and the sweep of
        leftovers, so that once it returns the root holds what ``keep_last``
        says. Retention still running after that is logged, not raised: the
        checkpoint is committed."""
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
        """This rank's stats: final once committed (``stats.final``, the same object a done
        callback and ``result()`` see); for an asynchronous save still in flight, the
        provisional figures known since ``save()`` returned (``stats.final`` is False, see
        :class:`SaveStats` for which fields are known then); None for a save that failed."""
        return None if self._error is not None else self._stats

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error else "committed")
        return f"SaveHandle(step={self.step}, path={self.path!r}, {state})"
