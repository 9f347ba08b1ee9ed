"""The save pipeline: state -> plan -> staged bytes -> files -> commit.

:class:`Saver` runs saves over a :class:`~nostall.planning.comm.Comm`. The first two
phases are collective and the same for synchronous and asynchronous saves:

1. flatten the state and exchange outcomes (every rank raises the same error,
   naming the failing rank, before anything is written); rank 0 draws the
   save's id and makes its staging directory on the root;
2. plan (cached while every rank's structure is unchanged).

Then both run the same save job (:func:`nostall.saving.commit.run_job`): a
synchronous save inline, its bytes read straight from the tensors and the
ranks meeting through collectives (:class:`CollectiveBarrier`); an
asynchronous one in the rank's writer process, after :class:`HostCopy` copied
the file images into the staging area (the rank's shared host memory,
:mod:`nostall.saving.area`), the ranks meeting through records on the root
(docs/protocol.md).

:class:`HostCopy` holds the three ways of copying (docs/overlap.md), each a
method: :meth:`~HostCopy.whole` (all of it before ``save()`` returns, or in a
thread while training goes on: *overlapped*, the job handed over first and
the writer writing each chunk as it is staged), :meth:`~HostCopy.chunked` (a
state larger than the host-memory budget goes through the area in chunks
that the writer writes as they come), and :meth:`~HostCopy.fail`, the
failure path shared by all three.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from nostall.planning import replicas
from nostall.saving import side_files
from nostall.planning.comm import Comm
from nostall.core.faults import Faults, crash_point
from nostall.core.tensorbuf import byte_view, host_contiguous
from nostall.saving.background import BackgroundWriter
from nostall.saving.commit import Barrier, run_job
from nostall.saving.datafiles import History, write_files
from nostall.errors import CheckpointError, CheckpointSaveError, CheckpointTimeoutError, InvalidStateError, describe
from nostall.core.format import FileRecord, Manifest, RankRecord, TensorRecord, data_file_name, gc_paused
from nostall.handles import SaveStats
from nostall.core.jobs import Destination, Done, FileJob, JobResult, Outcome, SaveJob
from nostall.core.model import FlatState, flatten
from nostall.options import Options
from nostall.saving.side_files import SideFiles
from nostall.planning.plan import file_job, FilePlan, Layout, RankPlan, WriteItem, local_meta
from nostall.planning.rounds import Report, Rounds
from nostall.saving.area import cut_chunks, layout

log = logging.getLogger("nostall")


def source_tensor(flat: FlatState, item: WriteItem) -> torch.Tensor:
    """The local tensor holding the bytes of a planned piece."""
    if item.per_rank:
        return flat.per_rank_tensors[item.key]
    return flat.tensors[item.key].data


def _file_jobs(files: Sequence[FilePlan], offsets: Optional[Sequence[int]] = None) -> Tuple[FileJob, ...]:
    return tuple(file_job(f, offsets[i] if offsets else 0) for i, f in enumerate(files))


class CollectiveBarrier(Barrier):
    """Synchronous saves: the ranks meet through collectives over the manager's group."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def gather(self, job: SaveJob, mine: Done, deadline: float) -> Dict[int, Done]:
        got = self.comm.gather(mine)  # every rank's on rank 0 only
        return dict(enumerate(got)) if got is not None else {}

    def announce(self, job: SaveJob, outcome: Outcome, deadline: float) -> None:
        self.comm.broadcast(outcome, src=0)

    def await_outcome(self, job: SaveJob, deadline: float) -> Outcome:
        outcome = self.comm.broadcast(None, src=0)
        assert isinstance(outcome, Outcome)
        return outcome


@dataclass(frozen=True)
class RankZeroOnly:
    """A top-level value of a state that only rank 0 of the group may give (``driver=``).

    Rank 0's value is saved; given on another rank, the save fails on every
    rank, naming it: a value that one rank alone passes would otherwise be
    saved (or not) depending on which rank it was, silently.
    """

    value: Any
    what: str  # how the caller gave it, for the error: "driver="


def _rank_zero_only(state: Any, rank: int) -> Any:
    """``state`` with its :class:`RankZeroOnly` values unwrapped (rank 0), or InvalidStateError (another rank)."""
    if not isinstance(state, Mapping):
        return state
    given = [v for v in state.values() if isinstance(v, RankZeroOnly)]  # a few top-level keys: no cost
    if not given:
        return state
    if rank != 0:
        what = given[0].what
        raise InvalidStateError(f"{what} was given on rank {rank}, but only rank 0 gives it (state saved once for "
                                f"the whole job, such as the job driver's): pass {what} on rank 0 alone (None on "
                                "the other ranks)")
    return {k: v.value if isinstance(v, RankZeroOnly) else v for k, v in state.items()}


@dataclass
class Prepared:
    """A save after its collective phases: what to write, and what rank 0 commits."""

    dest: Destination
    flat: FlatState
    mine: RankPlan  # this rank's share of the plan
    layout: Optional[Layout]  # rank 0: the plan's headers and files (the manifest's skeleton)
    objects: Dict[str, Any]  # rank 0: merged from every rank
    per_rank_objects: List[Dict[str, Any]]  # rank 0: every rank's
    cached: bool
    t0: float
    t_plan: float
    side_files: SideFiles = ()  # rank 0's, committed with the checkpoint

    @property
    def step(self) -> Optional[int]:
        return self.dest.step


@dataclass
class PendingSave:
    """An asynchronous save handed to the writer; completed by :meth:`Saver.complete`."""

    prepared: Prepared
    job: SaveJob
    t_start: float
    stall_s: float = 0.0
    stage_s: float = 0.0
    failed: Optional[JobResult] = None  # set when staging failed: nothing was submitted
    staging: Optional[threading.Thread] = None  # overlap: the thread still copying (HostCopy's)
    staged_wait_s: float = 0.0  # overlap: how long the caller waited for the copy
    chunks: int = 0  # budget: chunks the state went through the area in (0: all at once)
    staging_bytes: int = 0  # size of the staging area used
    overlap: bool = False  # the copy ran in a thread after save() returned

    def wait_staged(self, timeout: float) -> None:
        """Block until the copy into host memory is done (overlap); bounded."""
        t = self.staging
        if t is None:
            return
        t0 = time.perf_counter()
        t.join(timeout)
        self.staged_wait_s += time.perf_counter() - t0
        if t.is_alive():
            raise CheckpointError(f"rank {self.job.rank}: staging step {self.job.step} still running after "
                                  f"{timeout:.0f}s")
        self.staging = None


class HostCopy:
    """The copy of one asynchronous save into the staging area, and its hand-over to the writer.

    One of :meth:`whole` or :meth:`chunked` runs (in a thread when
    overlapped); any failure goes through :meth:`fail`.
    """

    def __init__(self, pending: PendingSave, writer: BackgroundWriter, files: Sequence[FilePlan],
                 budget: Optional[int], faults: Faults) -> None:
        self.pending = pending
        self.writer = writer
        self.files = files
        self.budget = budget
        self.faults = faults
        self.t0 = time.perf_counter()

    def source(self, item: WriteItem) -> torch.Tensor:
        return source_tensor(self.pending.prepared.flat, item)

    def whole(self, now: Optional[Callable[[WriteItem], bool]]) -> Optional[Callable[[], None]]:
        """Copy the headers and the items ``now`` selects (all when None); returns the rest of the work,
        or None when it failed.

        The rest, when items are left (overlapped): hand the job over first, then copy the others chunk by
        chunk in area order, telling the writer after each how far the area is staged (a *streamed* job):
        the write starts with the first chunk. Otherwise: hand the job over.
        """
        job, area = self.pending.job, self.writer.area
        try:
            area.record_fences([self.source(i) for f in self.files for i in f.items])
            jobs, rest = area.stage(self.files, self.source, now, cap=self.budget, block_size=job.block_size,
                                    whole_pieces=job.incremental)
        except BaseException as e:
            self.fail(e)
            return None
        job.files = jobs
        job.chunked = job.streamed = bool(rest)
        self.pending.staging_bytes = area.size

        def finish() -> None:
            submitted = False
            try:
                if not rest:
                    if self.faults.stage_delay_s:  # (a sleep of 0 still hands the GIL to any other thread)
                        time.sleep(self.faults.stage_delay_s)
                    crash_point("staged", job.step)
                self.writer.submit(job)
                submitted = True
                for k, chunk in enumerate(rest):
                    if self.faults.stage_delay_s:
                        time.sleep(self.faults.stage_delay_s)
                    area.copy_chunk(chunk, self.source)
                    self.writer.send_staged(k, chunk.upto)
                if rest:
                    crash_point("staged", job.step)
            except BaseException as e:
                if submitted:
                    self.abort(e)
                else:
                    self.fail(e)
            finally:
                self.pending.stage_s = time.perf_counter() - self.t0

        return finish

    def chunked(self) -> None:
        """Copy the file images through the two halves of a budget-sized area, chunk by chunk."""
        job, writer, budget = self.pending.job, self.writer, self.budget
        assert budget is not None
        submitted = False
        try:
            area = writer.area
            area.record_fences([self.source(i) for f in self.files for i in f.items])
            area.ensure(budget, cap=budget)
            chunks = cut_chunks(self.files, area.half_size, job.block_size)
            self.pending.chunks, self.pending.staging_bytes = len(chunks), area.size
            job.files = _file_jobs(self.files)
            job.chunked = True
            writer.submit(job)
            submitted = True
            deadline = time.monotonic() + job.timeout
            for k, cuts in enumerate(chunks):
                if self.faults.stage_delay_s:
                    time.sleep(self.faults.stage_delay_s)
                if k >= 2 and not writer.wait_chunk_done(k - 2, deadline):
                    return  # the writer failed the job; its result tells why
                writer.send_chunk(k, area.stage_chunk(cuts, k % 2, self.files, self.source))
            crash_point("staged", job.step)
        except BaseException as e:
            if submitted:
                self.abort(e)
            else:
                self.fail(e)
        finally:
            self.pending.stage_s = time.perf_counter() - self.t0

    def abort(self, e: BaseException) -> None:
        """The copy failed after the job was handed over (chunked or streamed): the writer fails the job and
        reports, as for a failed write (a writer that died is noticed by the wait for its result).
        SystemExit and KeyboardInterrupt are let through."""
        job = self.pending.job
        log.error("rank %d: staging step %s failed: %s", job.rank, job.step, describe(e))
        self.writer.abort_chunks(f"rank {job.rank}: {describe(e)}")
        if not isinstance(e, Exception):
            raise e

    def fail(self, e: BaseException) -> None:
        """Nothing reached the writer: record the failure so that no rank waits for this one.

        It is reported like any other failure of this save, by the next
        ``save()`` / ``finalize_pending_saves()`` on every rank.
        SystemExit and KeyboardInterrupt are recorded, then let through.
        """
        job = self.pending.job
        dest, root = job.dest, job.dest.root
        msg = f"rank {job.rank}: staging step {job.step} failed: {describe(e)}"
        log.error("%s", msg)
        deadline = time.monotonic() + job.timeout
        try:
            root.write_done(dest, job.rank, Done(False, error=msg), deadline)
            if job.rank == 0:
                root.abort(dest)
                root.write_outcome(dest, Outcome(False, msg), deadline)
        except Exception as e2:
            log.error("rank %d: could not record the failure: %s", job.rank, e2)
        self.pending.failed = JobResult(job.save_id, False, msg)
        if not isinstance(e, Exception):
            raise e


class Saver:
    """Runs saves over one Comm, caching the plan while the structure is unchanged."""

    def __init__(self, comm: Comm, options: Options, faults: Optional[Faults] = None) -> None:
        self.comm = comm
        self.options = options
        self.faults = faults if faults is not None else Faults()
        self._rounds = Rounds(comm)  # the collective phases, and the plan they keep
        self._history = History()  # synchronous saves' memory of this rank's last committed save (incremental)
        self._base: Tuple[str, str] = ("", "")  # (save id, checkpoint name) of the last committed incremental save
        self._chain = 0  # saves in the current chain (Options.full_every)
        self._records: Optional[Tuple[Layout, Records]] = None  # rank 0: the cached plan's tensor records
        self._last_records: Optional[Destination] = None  # the last async save (the next job drops its records)
        self.root_locked = False  # rank 0's writer holds the root's lock (set at the root's claim: SaveJob.root_locked)

    # ------------------------------------------------------------------ collective phases
    def plan(self, state: Any) -> RankPlan:
        """Plan ``state`` without saving it (collective): this rank's share of the plan."""
        return self._prepare(state, None, None, time.perf_counter(), records=False).mine

    def _prepare(self, state: Any, template: Optional[Destination], step: Optional[int], t0: float,
                 records: bool, given: Optional[Mapping[str, Any]] = None, refused: Optional[str] = None) -> Prepared:
        """The collective phases; ``refused``: why this rank's writer is refused (it fails the save on every rank
        alike, :class:`~nostall.errors.WriterVersionError`)."""
        comm = self.comm
        state_err: Optional[str] = None
        target_err: Optional[str] = None
        flat = meta = None
        sig = ""
        side: SideFiles = ()
        try:
            flat = flatten(_rank_zero_only(state, comm.rank))
            meta = local_meta(flat)
            sig = meta.signature()
            if given and comm.rank == 0:  # rank 0's are saved: its problems reach every rank below
                side = side_files.collect(given, reserved=[data_file_name(r) for r in range(comm.size)])
        except InvalidStateError as e:
            state_err = str(e)
        except Exception as e:  # anything else must reach the other ranks too
            state_err = f"unexpected error while inspecting the state: {describe(e)}"
        save_id = uuid.uuid4().hex if comm.rank == 0 else ""
        dest = replace(template, save_id=save_id) if template is not None else None
        made = False
        if state_err is None and refused is None and comm.rank == 0 and dest is not None:
            try:
                dest.root.make_staging(dest)
                made = True
                if records:
                    dest.root.make_records(dest)
            except Exception as e:  # a storage back end may raise its own types: all must reach every rank
                target_err = f"cannot save to {dest.path}: {describe(e)}"
        try:
            agreed, prepared = self._plan_round(state_err, target_err, sig, flat, meta, step, save_id, dest, t0,
                                                refused)
        except BaseException:  # a collective failed: the other ranks see it fail too
            if made:
                assert dest is not None
                dest.root.abort(dest)
                dest.root.drop_records(save_id)
            raise
        if agreed is not None:
            # raised alike on every rank (from the exchanged outcomes): the others raise only
            # once rank 0 has removed this save's staging directory
            if made:
                assert dest is not None
                dest.root.abort(dest)
                dest.root.drop_records(save_id)
            if comm.size > 1:
                comm.broadcast(None)
            raise agreed
        assert prepared is not None
        prepared.side_files = side
        return prepared

    def _plan_round(self, state_err: Optional[str], target_err: Optional[str], sig: str, flat: Optional[FlatState],
                    meta: Any, step: Optional[int], save_id: str, dest: Optional[Destination],
                    t0: float, refused: Optional[str] = None) -> Tuple[Optional[Exception], Optional[Prepared]]:
        """The collective phases (:mod:`nostall.planning.rounds`): outcomes, plan (or the held one), replicas.

        Returns the error every rank raises alike, or the prepared save.
        """
        rounds = self._rounds
        objs = (flat.objects, flat.per_rank_objects) if flat is not None else ({}, {})
        report = Report(state_err, target_err, rounds.holds(sig), objs[0], objs[1], step, refused)
        error, agreed = rounds.run(report, meta,
                                   lambda keys: replicas.digests(flat, keys),  # type: ignore[arg-type]
                                   self.options.check_replicas, save_id)
        if error is not None:
            return error, None
        assert flat is not None and agreed is not None
        if dest is None:  # planning only
            dest = Destination(None, "", step, "")
        return None, Prepared(replace(dest, save_id=agreed.save_id), flat, agreed.mine, agreed.layout, agreed.objects,
                              agreed.per_rank_objects, agreed.cached, t0, time.perf_counter())

    def _job(self, p: Prepared, files: Tuple[FileJob, ...]) -> SaveJob:
        incremental = self.options.incremental and p.dest.move_latest  # only in a root whose steps a manager owns
        dest = replace(p.dest, tagged=True) if incremental else p.dest  # names an earlier manifest never used
        manifest = None
        if self.comm.rank == 0:
            root = dest.root
            # no pieces here: the commit assembles them from the done records (Manifest.with_pieces)
            assert p.layout is not None
            if self._records is None or self._records[0] is not p.layout:
                self._records = (p.layout, tensor_records(p.layout))
            manifest = replace(manifest_skeleton(p.layout, p.objects, p.per_rank_objects, p.step,
                                                 self.options.block_size, self._records[1]),
                               side_files={n: replace(r, stored="" if root.data_name(dest, n) == n
                                                      else root.data_name(dest, n))
                                           for n, r in side_files.records(p.side_files).items()})
        base_id, base_name = self._base
        full = (not base_id or base_name == dest.name
                or (self.options.full_every is not None and self._chain >= self.options.full_every))
        return SaveJob(dest, self.comm.rank, self.comm.size, files, self.options.block_size, self.options.timeout,
                       manifest=manifest, faults=self.faults, side_files=p.side_files, incremental=incremental,
                       base="" if full or not incremental else base_id, root_locked=self.root_locked)

    def _committed(self, job: SaveJob) -> None:
        """``job`` committed: the next incremental save may reuse its pieces."""
        if job.incremental:
            self._chain = self._chain + 1 if job.base else 1
            self._base = (job.save_id, job.dest.name)

    def _failed(self, job: SaveJob) -> None:
        """``job`` failed (as this rank sees it): the next incremental save writes everything. What it
        reused may be why it failed (a file of the chain deleted by hand: every later save on the same base
        would fail the same way), and after a timeout another rank may have seen it commit."""
        if job.incremental:
            self._base = ("", "")
            self._chain = 0


    # ------------------------------------------------------------------ synchronous
    @gc_paused()  # a save makes ~7 short-lived objects a tensor: collections of them were most of many small
    # tensors' stall (10,000: ~100 minor and a full one every other save); reference counting frees them
    def save(self, state: Any, template: Destination, t_call: Optional[float] = None,
             side: Optional[Mapping[str, Any]] = None) -> SaveStats:
        """A synchronous save; returns once committed (collective).

        ``template``: where it goes (its ``save_id`` is drawn here).
        ``t_call``: when the caller's ``save()`` began (before waiting for a
        previous save), for the stall figure. ``side``: side files (rank 0's
        are committed with the checkpoint, see :mod:`nostall.saving.side_files`).
        """
        comm = self.comm
        t_start = time.perf_counter()
        p = self._prepare(state, template, template.step, t_call if t_call is not None else t_start, records=False,
                          given=side)
        crash_point("planned", p.step)
        files = p.mine.files
        job = self._job(p, _file_jobs(files))

        def source(i: int, f: FileJob) -> Tuple[memoryview, Iterator[Tuple[int, memoryview]]]:
            return memoryview(files[i].header), _tensor_parts(files[i], p.flat)

        result = run_job(job, write_files(source), CollectiveBarrier(comm), self._history)
        if not result.ok:
            self._failed(job)
            raise _failure(p.step, result)
        self._committed(job)
        t_end = time.perf_counter()
        stats = SaveStats(
            step=p.step, rank=comm.rank, world_size=comm.size, async_save=False,
            stall_s=t_end - p.t0, wait_s=t_start - p.t0, plan_s=p.t_plan - t_start, stage_s=0.0,
            write_s=result.write_s, commit_s=result.commit_s, total_s=t_end - p.t0,
            bytes_written=result.bytes_written, total_bytes=p.mine.total_bytes,
            plan_cached=p.cached,
        )
        _log_stats(stats, p.dest.path)
        return stats

    # ------------------------------------------------------------------ asynchronous
    @gc_paused()  # (as save)
    def save_async(self, state: Any, template: Destination, writer: BackgroundWriter, t_call: Optional[float] = None,
                   *, overlap: bool = False, stage_now: Optional[Callable[[str], bool]] = None,
                   side: Optional[Mapping[str, Any]] = None) -> PendingSave:
        """Stage this rank's data and hand it to the writer (collective up to the plan).

        ``overlap``: the copy runs in a thread after this returns, except the
        keys ``stage_now`` selects; wait with :meth:`PendingSave.wait_staged`
        before changing the state. Under the options' staging budget, a
        rank's state larger than that goes through the area in chunks.
        """
        t_start = time.perf_counter()
        writer.ensure_alive()
        p = self._prepare(state, template, template.step, t_call if t_call is not None else t_start, records=True,
                          given=side, refused=writer.refusal())
        crash_point("planned", p.step)
        writer.ensure_alive()
        files = p.mine.files
        job = replace(self._job(p, ()), max_write_rate=self.options.max_write_rate,
                      drop_records=self._last_records if self.comm.rank == 0 else None)
        self._last_records = job.dest
        pending = PendingSave(p, job, t_start=t_start)
        budget = self.options.staging_budget_bytes
        copy = HostCopy(pending, writer, files, budget, self.faults)
        chunked = budget is not None and layout(files)[1] > budget
        if chunked and stage_now is not None:
            overlap = False  # the selected keys cannot be copied ahead of the chunks: copy all of it now
        work: Optional[Callable[[], None]]
        if chunked:
            work = copy.chunked
        else:
            now: Optional[Callable[[WriteItem], bool]] = None  # everything before returning
            if overlap:
                now = (lambda item: stage_now(item.key)) if stage_now is not None else (lambda item: False)
            work = copy.whole(now)
        pending.overlap = overlap and work is not None
        if work is not None:
            if pending.overlap:
                pending.staging = threading.Thread(target=work, name=f"nostall-staging-{self.comm.rank}", daemon=True)
                pending.staging.start()
            else:
                work()
        pending.stall_s = time.perf_counter() - p.t0
        if not pending.overlap:
            pending.stage_s = time.perf_counter() - copy.t0
        return pending

    def staged_stats(self, pending: PendingSave) -> SaveStats:
        """The provisional stats of an asynchronous save when ``save()`` returns (``final`` False: what is
        written, and the write and commit, are still to come)."""
        p = pending.prepared
        return SaveStats(
            step=p.step, rank=self.comm.rank, world_size=self.comm.size, async_save=True,
            stall_s=pending.stall_s, wait_s=pending.t_start - p.t0, plan_s=p.t_plan - pending.t_start,
            stage_s=pending.stage_s, write_s=None, commit_s=None, total_s=None, bytes_written=None,
            total_bytes=p.mine.total_bytes, plan_cached=p.cached,
            overlap=pending.overlap, chunks=pending.chunks, staging_bytes=pending.staging_bytes, final=False,
        )

    def complete(self, pending: PendingSave, result: JobResult) -> SaveStats:
        """Stats of a finished asynchronous save, or its error."""
        p = pending.prepared
        if not result.ok:
            self._failed(pending.job)
            raise _failure(p.step, result)
        self._committed(pending.job)
        t_end = time.perf_counter()
        stats = SaveStats(
            step=p.step, rank=self.comm.rank, world_size=self.comm.size, async_save=True,
            stall_s=pending.stall_s + pending.staged_wait_s, wait_s=pending.t_start - p.t0,
            plan_s=p.t_plan - pending.t_start, stage_s=pending.stage_s,
            write_s=result.write_s, commit_s=result.commit_s, total_s=t_end - p.t0,
            bytes_written=result.bytes_written,
            total_bytes=p.mine.total_bytes, plan_cached=p.cached,
            overlap=pending.overlap, staged_wait_s=pending.staged_wait_s,
            chunks=pending.chunks, staging_bytes=pending.staging_bytes,
        )
        _log_stats(stats, p.dest.path)
        return stats


def _failure(step: Optional[int], result: JobResult) -> CheckpointSaveError:
    """The error a failed save raises: a timeout when a wait ran out."""
    prefix = f"save of step {step} failed"
    error = result.error or "unknown error"
    cls = CheckpointTimeoutError if result.timed_out else CheckpointSaveError
    return cls(error if error.startswith(prefix) else f"{prefix}: {error}")


def _log_stats(s: SaveStats, final: str) -> None:
    log.info(
        "rank %d: %s step %s to %s: %.1f MB this rank, blocked %.3fs (plan %.3fs%s, stage %.3fs), "
        "write %.3fs, commit %.3fs",
        s.rank, "saved" if not s.async_save else "committed async save of", s.step, final,
        (s.bytes_written or 0) / 1e6, s.stall_s, s.plan_s, " cached" if s.plan_cached else "", s.stage_s,
        s.write_s, s.commit_s,
    )


def _tensor_parts(fp: FilePlan, flat: FlatState) -> Iterator[Tuple[int, memoryview]]:
    """(start, bytes) of each piece of a planned file, straight from the tensors."""
    for item in fp.items:
        t = host_contiguous(source_tensor(flat, item))
        buf = byte_view(t)
        if len(buf) != item.end - item.start:
            raise RuntimeError(f"key {item.key!r}: tensor has {len(buf)} bytes, "
                               f"the plan expects {item.end - item.start}")
        yield item.start, buf
        del buf, t


Records = Tuple[Dict[str, TensorRecord], List[Dict[str, TensorRecord]]]
"""A plan's tensor records without pieces (their headers): global, and per rank."""


def tensor_records(layout: Layout) -> Records:
    """The tensor records of a plan's ``layout`` without pieces: O(keys). The commit puts in each record's
    pieces from the ranks' done records (:meth:`~nostall.core.format.Manifest.with_pieces`)."""
    tensors = {k: TensorRecord(k, dtype, shape, sharded, (), tied)
               for k, (dtype, shape, sharded, tied) in layout.tensors.items()}
    return (tensors, [{k: TensorRecord(k, code, shape, False, ()) for k, code, shape in layout.per_rank[r]}
                      for r in range(layout.world_size)])


def manifest_skeleton(
    layout: Layout, objects: Dict[str, Any], per_rank_objects: Sequence[Dict[str, Any]], step: Optional[int],
    block_size: int, records: Optional[Records] = None,
) -> Manifest:
    """The manifest of a plan without pieces (the commit assembles them, ``Manifest.with_pieces``).

    ``records``: the layout's :func:`tensor_records`, when the caller keeps them (a cached plan's saves).
    """
    tensors, per_rank = records if records is not None else tensor_records(layout)
    return Manifest(
        step=step,
        world_size=layout.world_size,
        block_size=block_size,
        files={n: FileRecord(n, r, size) for n, (r, size) in layout.files.items()},
        tensors=tensors,
        objects=objects,
        per_rank=tuple(RankRecord(per_rank[r], dict(per_rank_objects[r])) for r in range(layout.world_size)),
    )
