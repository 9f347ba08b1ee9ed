"""The export at save time, run off the training thread: one export at a time per manager, each in a
thread of its own that starts once its save is committed (docs/interop.md, "Exporting at save time").

The manager starts a run with each save that exports (:meth:`ExportRuns.start`), tells it the save's
outcome when it learns it (:meth:`ExportRuns.settled`), and waits for it, bounded, before the next save,
load, finalize and close (:meth:`ExportRuns.wait`). The thread looks for the commit itself (``peek``,
never blocking the manager) so that an asynchronous save's export starts within about 50 ms of its
commit, whoever else looks. A failure is logged (ERROR, the ``nostall`` logger) and kept as the run's
outcome; it never reaches the checkpoint. No torch here: the target brings its own.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from nostall.core.exports import CheckpointExportError, ExportJob, ExportOutcome, ExportTarget

log = logging.getLogger("nostall")

__all__ = ["ExportRuns"]

POLL_S = 0.05
CANCEL_GRACE_S = 10.0  # how long a wait that ran out waits more for the cancelled run to clean up


class _Run:
    """One rank's share of one export, in its thread."""

    def __init__(self, target: ExportTarget, job: ExportJob, committed: Optional[bool],
                 peek: Callable[[], Any], commit_wait_s: float) -> None:
        self.target = target
        self.job = job
        self.ok: Optional[bool] = committed  # the save's outcome: None until known
        self.settled = threading.Event()
        if committed is not None:
            self.settled.set()
        self.peek = peek
        self.commit_wait_s = commit_wait_s
        self.done = threading.Event()
        self.outcome: Optional[ExportOutcome] = None
        self.thread = threading.Thread(target=self._main, name=f"nostall-export-{job.step}", daemon=True)

    def _fail(self, message: str, level: int = logging.ERROR) -> ExportOutcome:
        log.log(level, "%s", message)
        return ExportOutcome(self.job.step, self.job.rank, error=CheckpointExportError(message))

    def _await_commit(self) -> Optional[ExportOutcome]:
        """Wait (bounded) until the save's outcome is known; an outcome when there is nothing to export."""
        job = self.job
        deadline = time.monotonic() + self.commit_wait_s
        while not self.settled.wait(POLL_S):
            if job.cancel.is_set():
                return self._fail(f"rank {job.rank}: export of step {job.step} cancelled before its save "
                                  "was committed", logging.WARNING)
            try:
                if self.peek() is False:  # the manager closed without an outcome
                    return self._fail(f"rank {job.rank}: export of step {job.step} not run: the manager "
                                      "closed before its save was committed", logging.WARNING)
            except Exception as e:  # looking is best effort: the manager's next call settles it
                log.debug("rank %d: looking for the commit of step %s: %s", job.rank, job.step, e)
            if time.monotonic() > deadline:
                return self._fail(f"rank {job.rank}: export of step {job.step} not run: its save's outcome "
                                  f"was not known within {self.commit_wait_s:.0f}s")
        if job.cancel.is_set():
            return self._fail(f"rank {job.rank}: export of step {job.step} cancelled before it started",
                              logging.WARNING)
        if not self.ok:
            return self._fail(f"rank {job.rank}: export of step {job.step} not run: its save failed",
                              logging.INFO)
        return None

    def _main(self) -> None:
        job = self.job
        try:
            outcome = self._await_commit()
            if outcome is None:
                outcome = self.target.run(job)
                if job.rank == 0:
                    log.info("exported step %s to %s on %d rank(s) in %.2fs (this rank: %d file(s))", job.step,
                             outcome.path, job.world_size, outcome.seconds, len(outcome.files))
        except CheckpointExportError as e:
            outcome = ExportOutcome(job.step, job.rank, error=e)
            log.error("%s", e)
        except BaseException as e:  # anything else is a bug or an interruption: still an export's failure
            outcome = self._fail(f"rank {job.rank}: export of step {job.step} failed: {type(e).__name__}: {e} "
                                 f"(the checkpoint {job.checkpoint} is committed and unaffected)")
            if not isinstance(e, Exception):
                log.debug("rank %d: the export thread of step %s was interrupted", job.rank, job.step)
        self.outcome = outcome
        self.done.set()


class ExportRuns:
    """A manager's exports at save time: at most one at a time."""

    def __init__(self) -> None:
        self._run: Optional[_Run] = None
        self.last: Optional[ExportOutcome] = None  # the outcome of the latest export waited for

    def start(self, target: ExportTarget, job: ExportJob, committed: Optional[bool], peek: Callable[[], Any],
              commit_wait_s: float) -> None:
        """Start the export of a save (the previous one must have been waited for): at once when
        ``committed`` is True, else once :meth:`settled` says so (or ``peek`` settles it)."""
        assert self._run is None or self._run.done.is_set(), "the previous export was not waited for"
        if self._run is not None:
            self.last = self._run.outcome
        self._run = _Run(target, job, committed, peek, commit_wait_s)
        self._run.thread.start()

    def settled(self, ok: bool) -> None:
        """The pending save's outcome: committed (``ok``) or failed. Never blocks."""
        run = self._run
        if run is not None and not run.settled.is_set():
            run.ok = ok
            run.settled.set()

    def pending(self) -> bool:
        """An export started and not waited for yet."""
        return self._run is not None

    def wait(self, timeout: float, cancel: bool = True) -> Optional[ExportOutcome]:
        """Wait (bounded by ``timeout``) for the export in flight, if any, and return its outcome. One still
        running then is cancelled (it stops at its next region and removes what it wrote) and reported as
        failed; or, without ``cancel``, left running (None returned, :meth:`pending` stays True)."""
        run = self._run
        if run is None:
            return None
        if not run.done.wait(max(0.0, timeout)):
            if not cancel:
                return None
            run.job.cancel.set()
            run.settled.set()  # a run still waiting for its commit stops too
            run.done.wait(min(CANCEL_GRACE_S, max(1.0, timeout)))
            msg = (f"rank {run.job.rank}: export of step {run.job.step} did not finish within {timeout:.0f}s: "
                   f"cancelled (its files removed; the checkpoint {run.job.checkpoint} is committed and "
                   "unaffected). Raise the manager's timeout, or export less often (save(..., export=False))")
            log.error("%s", msg)
            outcome = ExportOutcome(run.job.step, run.job.rank, error=CheckpointExportError(msg))
            if not run.done.is_set():
                log.error("rank %d: the export thread of step %s still runs after its cancellation; left to "
                          "finish on its own", run.job.rank, run.job.step)
        else:
            assert run.outcome is not None
            outcome = run.outcome
        self._run = None
        self.last = outcome
        return outcome

    def close(self, timeout: float) -> None:
        """Wait for (then cancel) the export in flight; bounded."""
        self.wait(timeout)
