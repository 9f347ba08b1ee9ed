"""The save job and the commit routine: written once, run by every kind of save.

:func:`run_job` is one rank's part of one save: write its files into the
save's staging directory, upload them (object storage), report them, and, on the
committing rank, decide and commit. A synchronous save runs it inline in the
trainer; an asynchronous one in the rank's background writer process; the
interop writers run it with a world of one. Only the barrier between the
ranks differs (:class:`Barrier`): collectives over the manager's group for a
synchronous save, records on the root for a background one.

:func:`commit` is the commit protocol itself (docs/protocol.md)::

    check the data files -> prepare `latest` -> publish the manifest (the commit point)
        -> move `latest` (or take the commit back and fail) -> outcome -> retention, sweep

and :func:`recover` finishes a save whose writer died, through the same
steps. :func:`steps_to_delete` is the retention policy: a pure function.

This module does not import torch (it runs in the writer process).
"""

from __future__ import annotations

import logging
import itertools
import time
from dataclasses import replace
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from nostall.core.faults import crash_point
from nostall.errors import CheckpointSaveError, describe
from nostall.saving.datafiles import History, Writer
from nostall.core.format import FileRecord
from nostall.core.jobs import Done, JobResult, Outcome, PieceWhat, PlannedPiece, SaveJob, Written
from nostall.saving import side_files

log = logging.getLogger("nostall")

COMMIT_SLACK_S = 60.0  # ranks other than 0 wait this much longer than rank 0 for the outcome


def steps_to_delete(committed: Sequence[int], keep_last: Optional[int], just_committed: int) -> List[int]:
    """Retention: the committed steps to delete once ``just_committed`` is committed.

    Keeps the newest ``keep_last`` (None: all), never the step just committed
    nor the highest one.

    >>> steps_to_delete([1, 2, 3, 4], 2, 4)
    [1, 2]
    >>> steps_to_delete([1, 5, 9], 1, 3)   # after resuming from step 1 and saving 3
    [1, 5]
    """
    if keep_last is None:
        return []
    steps = sorted(committed)
    keep = set(steps[-keep_last:]) | {just_committed}
    if steps:
        keep.add(steps[-1])
    return [s for s in steps if s not in keep]


# --------------------------------------------------------------------------- barriers


class Barrier:
    """How the ranks of one save meet: every rank reports, rank 0 decides, every rank learns.

    ``begin`` is called by every rank before it writes; ``gather`` by every
    rank once written (rank 0 gets every rank's record, or what arrived
    before a failure or the deadline); then rank 0 calls ``announce`` and
    every other rank ``await_outcome``.
    """

    def begin(self, job: SaveJob) -> None:
        """Before writing: whatever reporting a failure later must not need (space, say)."""

    def gather(self, job: SaveJob, mine: Done, deadline: float) -> Dict[int, Done]:
        raise NotImplementedError

    def announce(self, job: SaveJob, outcome: Outcome, deadline: float) -> None:
        raise NotImplementedError

    def await_outcome(self, job: SaveJob, deadline: float) -> Outcome:
        raise NotImplementedError


class SoloBarrier(Barrier):
    """A world of one (the interop writers): nothing to wait for."""

    def gather(self, job: SaveJob, mine: Done, deadline: float) -> Dict[int, Done]:
        return {0: mine}

    def announce(self, job: SaveJob, outcome: Outcome, deadline: float) -> None:
        pass

    def await_outcome(self, job: SaveJob, deadline: float) -> Outcome:  # pragma: no cover - rank 0 only
        raise AssertionError("a world of one has no other rank")


def poll_until(deadline: float, what: str, check: Callable[[], Optional[object]], max_delay: float = 0.1) -> object:
    """Call ``check`` until it returns non-None; bounded by ``deadline`` (``time.monotonic()``).

    Backs off to ``max_delay`` between looks, so that many ranks polling a
    shared filesystem stay cheap for its metadata server.
    """
    delay = 0.005
    while True:
        v = check()
        if v is not None:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, max_delay)


class RecordBarrier(Barrier):
    """Background saves: done records and the outcome on the root, polled (no collective)."""

    def begin(self, job: SaveJob) -> None:
        job.dest.root.reserve_done(job.dest, job.rank)

    def gather(self, job: SaveJob, mine: Done, deadline: float) -> Dict[int, Done]:
        root = job.dest.root
        root.write_done(job.dest, job.rank, mine, deadline)
        if job.rank != 0:
            return {}
        got: Dict[int, Done] = {}
        delay = 0.005
        while len(got) < job.world_size:
            got.update(root.read_dones(job.dest, [r for r in range(job.world_size) if r not in got]))
            if any(not d.ok for d in got.values()) or len(got) == job.world_size:
                break  # a failure: no need to wait for the rest
            if time.monotonic() > deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.1, root.poll_max_s)
        return got

    def announce(self, job: SaveJob, outcome: Outcome, deadline: float) -> None:
        job.dest.root.write_outcome(job.dest, outcome, deadline)

    def await_outcome(self, job: SaveJob, deadline: float) -> Outcome:
        root = job.dest.root
        found = poll_until(deadline + COMMIT_SLACK_S, f"rank 0 to commit step {job.step}",
                           lambda: root.read_outcome(job.dest), max_delay=root.poll_max_s)
        assert isinstance(found, Outcome)
        return found


# --------------------------------------------------------------------------- the routine


def _manifest(job: SaveJob, dones: Iterable[Done]) -> Tuple[bytes, Dict[str, FileRecord]]:
    """The manifest ``job`` commits, from every rank's done record, and every data file it names
    (own ones, and ``<checkpoint>/<file>`` of earlier checkpoints)."""
    assert job.manifest is not None
    dones = list(dones)
    files: Dict[str, FileRecord] = {}
    for d in dones:
        files.update(d.files)
    pieces = itertools.chain.from_iterable(d.pieces(own_only=job.world_size > 1) for d in dones)
    return job.manifest.with_pieces(pieces, files).to_json_bytes(), files


def commit(job: SaveJob, dones: Iterable[Done]) -> None:
    """Rank 0: commit the save of ``job`` once every rank's data is durable.

    Raises before the commit point (nothing visible; the caller aborts) and
    when ``latest`` cannot move (the commit is then taken back, so that what
    is on disk equals what the caller is told).
    """
    dest, root = job.dest, job.dest.root
    assert job.manifest is not None
    raw, files = _manifest(job, dones)
    root.check_files(dest, {**{n: f.size for n, f in files.items() if "/" not in n},
                            **{f.file: f.size for f in job.manifest.side_files.values()}},
                     {n: f.size for n, f in files.items() if "/" in n})
    above: List[int] = []
    if dest.move_latest:
        root.prepare_latest(dest)  # needs space: fails here, before the commit point, on a full disk
        # listing the steps refuses a linked one (PosixRoot): before the commit point too
        above = [s for s in root.steps() if dest.step is not None and s > dest.step]
    crash_point("commit.ready", dest.step)
    root.publish(dest, raw)
    if not dest.move_latest:
        return
    if above:
        log.warning("committed step %s while step(s) %s from an earlier run exist under %s; `latest` now "
                    "names %s, and those steps are replaced as training reaches them", dest.step, above, root.url,
                    dest.step)
    try:
        root.move_latest(dest)
    except Exception as e:
        # `latest` must never lag a committed step without an error: take the commit back
        try:
            root.unpublish(dest)
        except Exception as e2:
            raise CheckpointSaveError(
                f"{dest.path} is committed but `latest` could not be moved to it ({describe(e)}), and taking the "
                f"commit back failed too ({describe(e2)}): `latest` still names the previous step; fix the "
                f"cause, then save again"
            ) from e
        raise CheckpointSaveError(f"`latest` could not be moved to step {dest.step} ({describe(e)}); the commit "
                                  "was taken back and the previous checkpoint stays latest") from e


def _decide(job: SaveJob, dones: Dict[int, Done]) -> Outcome:
    """Rank 0: commit if every rank succeeded, else abort; the save's outcome."""
    failures = [d.error for _, d in sorted(dones.items()) if not d.ok]
    missing = [r for r in range(job.world_size) if r not in dones]
    if missing and not failures:
        failures.append(f"rank(s) {missing} did not finish writing within {job.timeout:.0f}s")
    if not failures:
        try:
            commit(job, dones.values())
            return Outcome(True)
        except Exception as e:
            failures.append(f"rank 0: commit of {job.dest.path} failed: {describe(e)}")
    try:
        job.dest.root.abort(job.dest)
    except Exception as e:
        log.warning("could not remove the staging directory of step %s: %s", job.step, e)
    return Outcome(False, f"save of step {job.step} failed: " + "; ".join(failures))


def _after_commit(job: SaveJob) -> None:
    """Rank 0, once every rank can know the outcome: retention, then the sweep. Never raises.

    Only in a root whose step layout a manager owns (its saves move ``latest``): a one-shot save or
    a directory its caller names shares its parent with whatever else the caller keeps there (another
    manager's save in flight, say), so nothing there is deleted.
    """
    dest, root = job.dest, job.dest.root
    if not dest.move_latest or dest.step is None:
        return
    try:
        doomed = steps_to_delete(root.steps(), dest.keep_last, dest.step)
        if doomed:
            # a file that a retained checkpoint reads (an incremental save's reference) is never deleted
            live = root.referenced(skip=doomed)
            for s in doomed:
                root.delete_step(s, dest.step, live)
            root.collect(live)
    except Exception as e:  # the checkpoint is committed; retention is best effort
        log.warning("retention after step %s failed: %s", dest.step, e)
    root.sweep(dest)


def run_job(job: SaveJob, write: Writer, barrier: Barrier, history: Optional[History] = None,
            later: Optional[List[Callable[[], None]]] = None) -> JobResult:
    """One rank's part of one save: write, report, and (rank 0) commit; never raises.

    ``write`` writes the job's files into the staging directory it is given
    and says what it wrote. ``history``: this rank's memory of its last
    committed save, in the process running its saves (incremental saves
    reuse its pieces; it is updated once this save commits). ``later``: rank
    0's retention and sweep after a commit are appended there instead of run
    (where the root allows it, :attr:`~nostall.storage.root.Root.retention_beside_next_save`),
    for a caller that reports the result first (the background writer: the
    trainers learn of the commit without waiting for deletions).
    """
    t0 = time.perf_counter()
    deadline = time.monotonic() + job.timeout
    res = JobResult(job.save_id, ok=False)
    mine, written = _write_part(job, write, barrier, history, res, deadline)
    res.write_s = time.perf_counter() - t0
    crash_point("write.done", job.step)
    t1 = time.perf_counter()
    outcome = _settle(job, mine, barrier, deadline, res, later)
    res.commit_s = time.perf_counter() - t1
    res.ok = outcome.ok
    if history is not None and outcome.ok and mine.ok:
        history.committed(job, mine.placed, mine.files, written.ids)
    if not res.ok:
        if mine.ok:  # a failed write already removed its files
            job.dest.root.remove_own_files(job.dest, job.rank, _own_names(job))
        res.error = outcome.error or "unknown error"
        if not mine.ok and mine.error not in res.error:
            res.error = f"{mine.error}; {res.error}"
    return res


def _own_names(job: SaveJob) -> List[str]:
    """The files this rank writes into the save's staging directory: its data files, and (rank 0)
    the side files written with them."""
    return [f.name for f in job.files] + [n for n, _ in job.side_files]


def _drop_previous_records(job: SaveJob) -> None:
    """Remove the previous save's records, if the job says so. Never raises.

    Every rank was done with them before this save's plan; leftovers are only space (the next
    claim's sweep removes them).
    """
    if job.drop_records is None:
        return
    try:
        job.drop_records.root.drop_records(job.drop_records.save_id)
    except Exception as e:
        log.warning("could not remove the records of save %s: %s", job.drop_records.save_id, describe(e))


def _write_part(job: SaveJob, write: Writer, barrier: Barrier, history: Optional[History], res: JobResult,
                deadline: float) -> Tuple[Done, Written]:
    """Write and upload this rank's files; its done record, and what was written. Never raises.

    A failure becomes a failed done record (reported like a success, so that rank 0 stops
    waiting), and this rank's files are removed at once: on a full disk, the done record needs
    the space. Sets ``res.bytes_written``.
    """
    dest, root = job.dest, job.dest.root
    try:
        if job.faults.writer_delay_s:
            time.sleep(job.faults.writer_delay_s)
        job.faults.wait_gate(deadline)
        _drop_previous_records(job)
        barrier.begin(job)
        staging = root.open_staging(dest, job.rank)
        job.faults.check_write(staging)
        crash_point("write.start", job.step)
        written = write(job, staging, history.base_for(job) if history is not None else None)
        side_files.write(staging, job.side_files)
        own = [f.name for f in job.files if f.name in written.files]  # an incremental save may leave a file out
        res.bytes_written = sum(written.files[n].size for n in own) + sum(len(b) for _, b in job.side_files)
        root.upload(dest, job.rank, own + [n for n, _ in job.side_files], deadline)

        def stored(n: str) -> str:  # own files by their stored names; earlier checkpoints' as they are
            return n if "/" in n else root.data_name(dest, n)

        # keyed by the planned pieces, placed in the stored files; beside each, what it is (the manifest's
        # piece records are assembled from these at the commit, Manifest.with_pieces)
        what: Dict[PlannedPiece, List[PieceWhat]] = {}
        for f in job.files:
            for (s, e), w in zip(f.pieces, f.what):
                what.setdefault((f.name, s, e), []).append(w)
        return Done(True, {k: replace(p, file=stored(p.file)) for k, p in written.placed.items()},
                    {stored(n): replace(f, name=stored(n)) for n, f in written.files.items()}, rank=job.rank,
                    what={k: what[k] for k in written.placed if k in what}), written
    except Exception as e:
        mine = Done(False, error=f"rank {job.rank}: writing step {job.step}: {describe(e)}")
        log.error("%s", mine.error)
        root.remove_own_files(dest, job.rank, _own_names(job))
        return mine, Written()


def _settle(job: SaveJob, mine: Done, barrier: Barrier, deadline: float, res: JobResult,
            later: Optional[List[Callable[[], None]]]) -> Outcome:
    """Report this rank's part and learn the save's outcome. Never raises.

    Rank 0 gathers every rank's report, decides (commits or aborts) and announces the outcome,
    even when its own report failed, so that nobody waits in vain; retention follows once the
    other ranks can know the outcome (or goes to ``later``). Another rank waits for rank 0's
    outcome. Sets ``res.timed_out`` when a wait timed out.
    """
    try:
        dones: Optional[Dict[int, Done]] = barrier.gather(job, mine, deadline)
        gather_error = ""
    except Exception as e:
        dones, gather_error = None, f"rank {job.rank}: reporting its part of step {job.step}: {describe(e)}"
        res.timed_out = isinstance(e, TimeoutError)
        log.error("%s", gather_error)
    if job.rank == 0:
        outcome = _decide(job, dones if dones is not None else {0: Done(False, error=gather_error)})
        try:
            barrier.announce(job, outcome, deadline + COMMIT_SLACK_S / 4)
        except Exception as e:  # what rank 0 reports stays what is on disk; the others time out
            log.error("rank 0: announcing the outcome of step %s failed: %s", job.step, describe(e))
        if outcome.ok:  # after the other ranks can know the outcome
            if later is not None and job.dest.root.retention_beside_next_save:
                later.append(lambda: _after_commit(job))
            else:
                _after_commit(job)
        return outcome
    if dones is None:
        return Outcome(False, gather_error)
    try:
        return barrier.await_outcome(job, deadline)
    except Exception as e:
        res.timed_out = isinstance(e, TimeoutError)
        return Outcome(False, f"rank {job.rank}: waiting for rank 0's outcome of step {job.step}: {describe(e)}")


def _committed_here(job: SaveJob) -> bool:
    """Did the commit point of ``job`` pass? True only if the checkpoint in place holds exactly
    the manifest this job commits (an older checkpoint of the same step does not count)."""
    assert job.manifest is not None
    dones = job.dest.root.read_dones(job.dest, range(job.world_size))
    if len(dones) != job.world_size or not all(d.ok for d in dones.values()):
        return False
    try:
        expected, _ = _manifest(job, dones.values())
    except ValueError:
        return False
    return job.dest.root.manifest_bytes(job.dest.name) == expected


def recover(job: SaveJob, why: str, timeout: float) -> JobResult:
    """The trainer's side, after its writer died with ``job`` in flight: settle the job for everyone.

    Records a failed done record for this rank (so that rank 0 stops waiting)
    unless one is there; rank 0 then decides: committed if the checkpoint in
    place is this save's (its writer died past the commit point: ``latest``
    and retention are finished here), else aborted. Other ranks wait for
    rank 0's outcome.
    """
    dest, root = job.dest, job.dest.root
    res = JobResult(job.save_id, False, why)
    deadline = time.monotonic() + timeout
    try:
        if job.rank not in root.read_dones(dest, [job.rank]):
            root.write_done(dest, job.rank, Done(False, error=why), deadline)
        if job.rank == 0:
            outcome = root.read_outcome(dest)
            if outcome is None:
                if _committed_here(job):
                    outcome = Outcome(True)
                    if dest.move_latest:
                        try:
                            root.move_latest(dest)
                        except Exception as e:
                            root.unpublish(dest)
                            outcome = Outcome(False, f"save of step {job.step} failed: {why}; `latest` could "
                                                     f"not be moved ({describe(e)}), the commit was taken back")
                else:
                    root.abort(dest)
                    outcome = Outcome(False, f"save of step {job.step} failed: {why}")
                root.write_outcome(dest, outcome, deadline)
                if outcome.ok:
                    _after_commit(job)
        else:
            try:
                found = poll_until(deadline, "rank 0's outcome", lambda: root.read_outcome(dest), max_delay=0.5)
                assert isinstance(found, Outcome)
                outcome = found
            except TimeoutError:
                outcome = Outcome(False, f"{why}; rank 0 did not record an outcome either")
        res.ok = outcome.ok
        res.error = None if outcome.ok else (outcome.error if why in outcome.error else f"{why}; {outcome.error}")
    except Exception as e:
        res.error = f"{why}; recording the failure also failed: {describe(e)}"
    return res
