"""The save pipeline: state -> plan -> staged bytes -> files -> commit.

:class:`Saver` runs saves over a :class:`~nostall._comm.Comm`. The first two
phases are collective and the same for synchronous and asynchronous saves:

1. flatten the state and exchange outcomes (every rank raises the same error,
   naming the failing rank, before anything is written);
2. plan (cached while every rank's structure is unchanged).

Then a synchronous save writes the files in the trainer, exchanges outcomes
and checksums, and rank 0 commits. An asynchronous save copies the file images
into the staging area and hands a job to the rank's writer process; the
commit then happens in the background without any collective (docs/protocol.md).

Two variants of the copy (docs/overlap.md): *overlapped*, where a staging
thread copies while training goes on and the caller must wait for it
(``PendingSave.wait_staged``) before mutating the state; and *budgeted*,
where a state larger than the host-memory budget goes through the area in
chunks that the writer writes as they come.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ._comm import Comm
from ._faults import crash_point
from ._tensorbuf import byte_view, host_contiguous
from .background import BackgroundWriter
from .commit import Target
from .errors import CheckpointSaveError, InvalidStateError, describe
from .format import DEFAULT_BLOCK_SIZE, FileRecord, Manifest, PieceRecord, RankRecord, TensorRecord
from .handles import SaveStats
from .model import FlatState, flatten
from .planning import FilePlan, SavePlan, TensorPlan, WriteItem, build_plan, check_objects, local_meta
from .staging import cut_chunks, layout
from .writer import (
    CommitJob, Crcs, FileJob, JobResult, SaveJob, done_record, outcome_record, write_file_image, write_record,
)

log = logging.getLogger("nostall")


def _raise_failures(outcomes: Sequence[Optional[str]], what: str, step: Optional[int], cls: type) -> None:
    failed = [(r, msg) for r, msg in enumerate(outcomes) if msg]
    if not failed:
        return
    where = f"step {step}" if step is not None else "checkpoint"
    details = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
    raise cls(f"{what} of {where} failed on rank(s) {[r for r, _ in failed]}: {details}")


def source_tensor(flat: FlatState, item: WriteItem) -> torch.Tensor:
    """The local tensor holding the bytes of a planned piece."""
    if item.per_rank:
        return flat.per_rank_tensors[item.key]
    return flat.tensors[item.key].data


@dataclass
class Prepared:
    """A save after its collective phases: what to write, and what rank 0 commits."""

    step: Optional[int]
    save_id: str
    flat: FlatState
    plan: SavePlan
    objects: Dict[str, Any]
    per_rank_objects: List[Dict[str, Any]]
    cached: bool
    t0: float
    t_plan: float


@dataclass
class PendingSave:
    """An asynchronous save handed to the writer; completed by :meth:`Saver.complete`."""

    prepared: Prepared
    job: SaveJob
    stall_s: float
    wait_s: float
    stage_s: float
    t_start: float
    failed: Optional[JobResult] = None  # set when staging failed: nothing was submitted
    staging: Optional[threading.Thread] = None  # overlap: the thread still copying
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
            from .errors import CheckpointError

            raise CheckpointError(f"rank {self.job.rank}: staging step {self.job.step} still running after "
                                  f"{timeout:.0f}s")
        self.staging = None


def _renamed_crcs(crcs: Crcs, target: Target) -> Crcs:
    """Checksums keyed by the data files' names in the checkpoint (see Target.data_name)."""
    return {(target.data_name(n), s, e): c for (n, s, e), c in crcs.items()}


def _uploads(target: Target) -> bool:
    """Object-storage targets: each rank stages its files locally, then uploads them."""
    return hasattr(target, "upload")


class Saver:
    """Runs saves over one Comm, caching the plan while the structure is unchanged."""

    def __init__(self, comm: Comm, block_size: int = DEFAULT_BLOCK_SIZE, timeout: float = 600.0) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {block_size!r}")
        self.comm = comm
        self.block_size = block_size
        self.timeout = timeout
        self._plan: Optional[SavePlan] = None
        self.test_writer_delay_s = 0.0  # test hook: slows the background writer down
        self.test_writer_fault: Optional[str] = None  # test hook: see SaveJob.test_fault
        self.test_stage_delay_s = 0.0  # test hook: slows the (overlapped) copy into host memory down

    # ------------------------------------------------------------------ collective phases
    def prepare(self, state: Any, target: Target, step: Optional[int], t0: Optional[float] = None) -> Prepared:
        comm = self.comm
        t0 = time.perf_counter() if t0 is None else t0
        state_err: Optional[str] = None
        target_err: Optional[str] = None
        flat = meta = None
        sig = ""
        try:
            flat = flatten(state)
            meta = local_meta(flat)
            sig = meta.signature()
        except InvalidStateError as e:
            state_err = str(e)
        except Exception as e:  # anything else must reach the other ranks too
            state_err = f"unexpected error while inspecting the state: {describe(e)}"
        if state_err is None and comm.rank == 0:
            try:
                target.prepare()
            except Exception as e:  # a storage back end may raise its own types: all must reach every rank
                target_err = f"cannot save to {target.final}: {describe(e)}"
        made_staging = comm.rank == 0 and state_err is None and target_err is None
        try:
            return self._plan_round(state_err, target_err, sig, flat, meta, step, t0)
        except (InvalidStateError, CheckpointSaveError):
            # raised alike on every rank (from the exchanged outcomes): the others raise only
            # once rank 0 has removed this save's staging directory
            if made_staging:
                target.abort()
            if comm.size > 1:
                comm.broadcast(None)
            raise
        except BaseException:
            if made_staging:
                target.abort()
            raise

    def _plan_round(self, state_err: Optional[str], target_err: Optional[str], sig: str, flat: Optional[FlatState],
                    meta: Any, step: Optional[int], t0: float) -> Prepared:
        """Exchange every rank's outcome and signature; plan (or reuse the cached plan)."""
        comm = self.comm
        objs = (flat.objects, flat.per_rank_objects) if flat is not None else ({}, {})
        save_id = uuid.uuid4().hex if comm.rank == 0 else ""
        round1 = comm.all_gather((state_err, target_err, sig, objs, step, save_id))
        _raise_failures([r[0] for r in round1], "save", step, InvalidStateError)
        _raise_failures([r[1] for r in round1], "save", step, CheckpointSaveError)
        if len({r[4] for r in round1}) > 1:
            raise InvalidStateError(
                "ranks disagree on the step being saved: " + ", ".join(f"rank {i}: {r[4]}" for i, r in enumerate(round1))
            )
        assert flat is not None and meta is not None
        sigs = tuple(r[2] for r in round1)
        cached = self._plan is not None and self._plan.signatures == sigs
        if cached:
            plan = self._plan
        else:
            self._plan = None
            plan = build_plan(comm.all_gather(meta))
            self._plan = plan
        assert plan is not None
        objects = check_objects([r[3][0] for r in round1])
        return Prepared(
            step, round1[0][5], flat, plan, objects, [r[3][1] for r in round1], cached, t0, time.perf_counter()
        )

    def _skeleton(self, p: Prepared, target: Target) -> Manifest:
        return manifest_skeleton(p.plan, p.objects, p.per_rank_objects, p.step, self.block_size).renamed(
            target.data_name)

    # ------------------------------------------------------------------ synchronous
    def save(self, state: Any, target: Target, step: Optional[int], t_call: Optional[float] = None) -> SaveStats:
        """A synchronous save; returns once committed (collective).

        ``t_call``: when the caller's ``save()`` began (before waiting for a
        previous save), for the stall figure.
        """
        comm = self.comm
        t_start = time.perf_counter()
        p = self.prepare(state, target, step, t_call)
        target.save_id = p.save_id
        crash_point("planned", step)
        crcs: Optional[Crcs] = None
        nbytes = 0
        err = None
        try:
            target.open_staging()
            crcs = {}
            for fp in p.plan.files_of(comm.rank):
                crcs.update(
                    write_file_image(
                        os.path.join(target.staging, fp.name), fp.header, _tensor_parts(fp, p.flat),
                        fp.size, self.block_size, fp.name,
                    )
                )
                nbytes += fp.size
            if _uploads(target):
                target.upload([fp.name for fp in p.plan.files_of(comm.rank)])
        except Exception as e:
            err = f"writing into {target.staging}: {describe(e)}"
            log.error("rank %d: save of step %s failed: %s", comm.rank, step, err)
        t_write = time.perf_counter()
        crash_point("written", step)
        outcomes = comm.all_gather((err, crcs))
        write_errors = [o[0] for o in outcomes]

        commit_err: Optional[str] = None
        if comm.rank == 0:
            if any(write_errors):
                target.abort()
            else:
                try:
                    merged: Crcs = {}
                    for o in outcomes:
                        merged.update(o[1])
                    crash_point("commit.ready", step)
                    target.publish(self._skeleton(p, target).with_crcs(_renamed_crcs(merged, target)).to_json_bytes(),
                                   {target.data_name(n): size for n, size in p.plan.file_sizes().items()})
                except Exception as e:
                    commit_err = f"commit of {target.final}: {describe(e)}"
                    log.error("save of step %s: %s", step, commit_err)
                    target.abort()
        commit_err = comm.broadcast(commit_err, src=0)
        if comm.rank == 0 and not commit_err and not any(write_errors):
            target.retain()  # after every rank knows the outcome
        _raise_failures(write_errors, "save", step, CheckpointSaveError)
        if commit_err:
            raise CheckpointSaveError(f"save of step {step} failed on rank 0: {commit_err}")
        t_end = time.perf_counter()
        stats = SaveStats(
            step=step, rank=comm.rank, world_size=comm.size, async_save=False,
            stall_s=t_end - p.t0, wait_s=t_start - p.t0, plan_s=p.t_plan - t_start, stage_s=0.0,
            write_s=t_write - p.t_plan,
            commit_s=t_end - t_write, total_s=t_end - p.t0, bytes_written=nbytes,
            total_bytes=sum(f.size for f in p.plan.files.values()), plan_cached=p.cached,
        )
        _log_stats(stats, target.final)
        return stats

    # ------------------------------------------------------------------ asynchronous
    def save_async(self, state: Any, target: Target, step: Optional[int], records_prefix: str,
                   writer: BackgroundWriter, t_call: Optional[float] = None, *, overlap: bool = False,
                   budget: Optional[int] = None, stage_now: Optional[Callable[[str], bool]] = None,
                   ) -> PendingSave:
        """Stage this rank's data and hand it to the writer (collective up to the plan).

        The per-save records (done and outcome) go to ``records_prefix + save_id``.
        ``overlap``: the copy runs in a thread after this returns, except the
        keys ``stage_now`` selects; wait with :meth:`PendingSave.wait_staged`
        before changing the state. ``budget``: the staging area's size limit in
        bytes; a rank's state larger than that goes through it in chunks.
        """
        comm = self.comm
        t_start = time.perf_counter()
        p = self.prepare(state, target, step, t_call)
        target.save_id = p.save_id
        crash_point("planned", step)
        records = records_prefix + p.save_id
        writer.ensure_alive()
        files = p.plan.files_of(comm.rank)
        job = SaveJob(
            save_id=p.save_id, step=step, rank=comm.rank, world_size=comm.size, staging=target.staging,
            records=records, files=(), block_size=self.block_size, timeout=self.timeout,
            commit=CommitJob(self._skeleton(p, target), target) if comm.rank == 0 else None,
            writers=tuple(range(comm.size)), test_delay_s=self.test_writer_delay_s,
            test_fault=self.test_writer_fault,
            upload=target if _uploads(target) else None, storage_options=getattr(target, "storage_options", None),
        )
        if budget is not None:
            budget -= budget % mmap.PAGESIZE  # the area is mapped (and resident) in whole pages
        chunked = budget is not None and layout(files)[1] > budget
        if chunked and stage_now is not None:
            overlap = False  # the selected keys cannot be copied ahead of the chunks: copy all of it now
        t_stage = time.perf_counter()
        pending = PendingSave(p, job, stall_s=0.0, wait_s=t_start - p.t0, stage_s=0.0, t_start=t_start)

        delay = self.test_stage_delay_s

        def source(item: WriteItem) -> torch.Tensor:
            return source_tensor(p.flat, item)

        def fail(e: BaseException) -> None:
            # Nothing reaches the writer: record the failure so that no rank waits
            # for us; it is reported like any other failure of this save, by the
            # next save() / finalize_pending_saves() on every rank.
            msg = f"rank {comm.rank}: staging step {step} failed: {describe(e)}"
            log.error("%s", msg)
            try:
                so = job.storage_options
                write_record(done_record(records, comm.rank), {"ok": False, "error": msg}, so)
                if comm.rank == 0:
                    target.abort()
                    write_record(outcome_record(records), {"ok": False, "error": msg}, so)
            except OSError as e2:
                log.error("rank %d: could not record the failure: %s", comm.rank, e2)
            pending.failed = JobResult(p.save_id, False, msg)

        def finish_whole(rest: Callable[[], None]) -> None:
            try:
                time.sleep(delay)
                rest()
                crash_point("staged", step)
                writer.submit(job)
            except BaseException as e:
                fail(e)
                if not isinstance(e, Exception):
                    raise  # SystemExit, KeyboardInterrupt: recorded, now let it through
            finally:
                pending.stage_s = time.perf_counter() - t_stage

        def run_chunks() -> None:
            submitted = False
            try:
                area = writer.area
                area.ensure(budget, cap=budget)
                chunks = cut_chunks(files, area.half_size, self.block_size)
                pending.chunks, pending.staging_bytes = len(chunks), area.size
                job.files = tuple(FileJob(f.name, 0, f.size, len(f.header), tuple((i.start, i.end) for i in f.items))
                                  for f in files)
                job.chunked = True
                writer.submit(job)
                submitted = True
                deadline = time.monotonic() + self.timeout
                for k, cuts in enumerate(chunks):
                    time.sleep(delay)
                    if k >= 2 and not writer.wait_chunk_done(k - 2, deadline):
                        return  # the writer failed the job; its result tells why
                    writer.send_chunk(k, area.stage_chunk(cuts, k % 2, files, source))
                crash_point("staged", step)
            except BaseException as e:
                if submitted:  # the writer fails the job and reports, as for a failed write
                    log.error("rank %d: staging step %s failed: %s", comm.rank, step, describe(e))
                    writer.abort_chunks(f"rank {comm.rank}: {describe(e)}")
                else:
                    fail(e)
                if not isinstance(e, Exception):
                    raise
            finally:
                pending.stage_s = time.perf_counter() - t_stage

        try:
            writer.area.record_fences([source(i) for f in files for i in f.items])
            if chunked:
                work: Callable[[], None] = run_chunks
            else:
                now: Optional[Callable[[WriteItem], bool]] = None  # everything before returning
                if overlap:
                    now = (lambda item: stage_now(item.key)) if stage_now is not None else (lambda item: False)
                jobs, rest = writer.area.stage(files, source, now, cap=budget)
                job.files = jobs
                pending.staging_bytes = writer.area.size
                work = lambda: finish_whole(rest)  # noqa: E731
        except BaseException as e:
            fail(e)
            if not isinstance(e, Exception):
                raise
            work = None  # type: ignore[assignment]
        pending.overlap = overlap and work is not None
        if work is not None:
            if overlap:
                pending.staging = threading.Thread(target=work, name=f"nostall-staging-{comm.rank}", daemon=True)
                pending.staging.start()
            else:
                work()
        pending.stall_s = time.perf_counter() - p.t0
        if not overlap:
            pending.stage_s = time.perf_counter() - t_stage
        return pending

    def complete(self, pending: PendingSave, result: JobResult, final: str) -> SaveStats:
        """Stats of a finished asynchronous save, or its error."""
        p = pending.prepared
        if not result.ok:
            prefix = f"save of step {p.step} failed"
            error = result.error or "unknown error"
            raise CheckpointSaveError(error if error.startswith(prefix) else f"{prefix}: {error}")
        t_end = time.perf_counter()
        stats = SaveStats(
            step=p.step, rank=self.comm.rank, world_size=self.comm.size, async_save=True,
            stall_s=pending.stall_s + pending.staged_wait_s, wait_s=pending.wait_s,
            plan_s=p.t_plan - pending.t_start, stage_s=pending.stage_s,
            write_s=result.write_s, commit_s=result.commit_s, total_s=t_end - p.t0,
            bytes_written=result.bytes_written,
            total_bytes=sum(f.size for f in p.plan.files.values()), plan_cached=p.cached,
            overlap=pending.overlap, staged_wait_s=pending.staged_wait_s,
            chunks=pending.chunks, staging_bytes=pending.staging_bytes,
        )
        _log_stats(stats, final)
        return stats


def _log_stats(s: SaveStats, final: str) -> None:
    log.info(
        "rank %d: %s step %s to %s: %.1f MB this rank, blocked %.3fs (plan %.3fs%s, stage %.3fs), "
        "write %.3fs, commit %.3fs",
        s.rank, "saved" if not s.async_save else "committed async save of", s.step, final,
        s.bytes_written / 1e6, s.stall_s, s.plan_s, " cached" if s.plan_cached else "", s.stage_s,
        s.write_s, s.commit_s,
    )


def _tensor_parts(fp: FilePlan, flat: FlatState) -> Iterator[Tuple[int, memoryview]]:
    """(start, bytes) of each piece of a planned file, straight from the tensors."""
    for item in fp.items:
        t = host_contiguous(source_tensor(flat, item))
        buf = byte_view(t)
        if len(buf) != item.end - item.start:
            raise RuntimeError(f"key {item.key!r}: tensor has {len(buf)} bytes, the plan expects {item.end - item.start}")
        yield item.start, buf
        del buf, t


def manifest_skeleton(
    plan: SavePlan, objects: Dict[str, Any], per_rank_objects: Sequence[Dict[str, Any]], step: Optional[int],
    block_size: int,
) -> Manifest:
    """The manifest of a plan, without checksums (filled in by ``Manifest.with_crcs``)."""

    def record(tp: TensorPlan) -> TensorRecord:
        pieces = tuple(PieceRecord(p.offset, p.shape, p.file, p.start, p.end, ()) for p in tp.pieces)
        return TensorRecord(tp.key, tp.dtype, tp.shape, tp.sharded, pieces)

    return Manifest(
        step=step,
        world_size=plan.world_size,
        block_size=block_size,
        files={n: FileRecord(n, f.rank, f.size) for n, f in plan.files.items()},
        tensors={k: record(t) for k, t in plan.tensors.items()},
        objects=objects,
        per_rank=tuple(
            RankRecord({k: record(t) for k, t in plan.per_rank[r].items()}, dict(per_rank_objects[r]))
            for r in range(plan.world_size)
        ),
    )
