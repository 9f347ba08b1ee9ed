"""The save pipeline: state -> plan -> bytes -> files -> commit.

:class:`Saver` runs one synchronous save over a :class:`~nostall._comm.Comm`.
Every phase that can fail on one rank is followed by an exchange of outcomes,
so that every rank raises the same clear error (naming the failing rank) and
nothing is committed unless every rank succeeded.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._comm import Comm
from .commit import Target
from .errors import CheckpointError, CheckpointSaveError, InvalidStateError
from .format import DEFAULT_BLOCK_SIZE, FileRecord, Manifest, PieceRecord, RankRecord, TensorRecord
from .handles import SaveStats
from .model import flatten
from .planning import SavePlan, TensorPlan, build_plan, check_objects, local_meta
from .writer import WriteResult, source_tensor, write_files

log = logging.getLogger("nostall")


def _describe(e: BaseException) -> str:
    if isinstance(e, CheckpointError):
        return str(e)
    if isinstance(e, OSError):
        return f"{type(e).__name__}: {e}"
    return f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"


def _raise_failures(outcomes: Sequence[Optional[str]], what: str, step: Optional[int], cls: type) -> None:
    failed = [(r, msg) for r, msg in enumerate(outcomes) if msg]
    if not failed:
        return
    where = f"step {step}" if step is not None else "checkpoint"
    details = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
    raise cls(f"{what} of {where} failed on rank(s) {[r for r, _ in failed]}: {details}")


class Saver:
    """Runs saves over one Comm, caching the plan while the structure is unchanged."""

    def __init__(self, comm: Comm, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.comm = comm
        self.block_size = block_size
        self._plan: Optional[SavePlan] = None

    def save(self, state: Any, target: Target, step: Optional[int]) -> SaveStats:
        comm = self.comm
        t0 = time.perf_counter()

        # 1. flatten locally; rank 0 checks the destination; exchange outcomes
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
        if state_err is None and comm.rank == 0:
            try:
                target.prepare()
            except (OSError, CheckpointError) as e:
                target_err = f"cannot save to {target.final}: {_describe(e)}"
        objs = (flat.objects, flat.per_rank_objects) if flat is not None else ({}, {})
        round1 = comm.all_gather((state_err, target_err, sig, objs, step))
        _raise_failures([r[0] for r in round1], "save", step, InvalidStateError)
        _raise_failures([r[1] for r in round1], "save", step, CheckpointSaveError)
        if len({r[4] for r in round1}) > 1:
            raise InvalidStateError(
                "ranks disagree on the step being saved: " + ", ".join(f"rank {i}: {r[4]}" for i, r in enumerate(round1))
            )
        assert flat is not None and meta is not None

        # 2. plan (cached while every rank's structure is unchanged); same result on every rank
        sigs = tuple(r[2] for r in round1)
        cached = self._plan is not None and self._plan.signatures == sigs
        if cached:
            plan = self._plan
        else:
            self._plan = None
            plan = build_plan(comm.all_gather(meta))
            self._plan = plan
        objects = check_objects([r[3][0] for r in round1])
        per_rank_objects = [r[3][1] for r in round1]
        t_plan = time.perf_counter()

        # 3. write this rank's files
        result: Optional[WriteResult] = None
        err = None
        try:
            target.open_staging()
            result = write_files(
                plan.files_of(comm.rank),
                target.staging,
                lambda item: source_tensor(flat, item),
                comm.rank,
                self.block_size,
            )
        except Exception as e:
            err = f"writing into {target.staging}: {_describe(e)}"
            log.error("rank %d: save of step %s failed: %s", comm.rank, step, err)
        t_write = time.perf_counter()
        outcomes = comm.all_gather((err, result.crcs if result else None))
        write_errors = [o[0] for o in outcomes]

        # 4. rank 0 commits once every rank succeeded (or cleans up), then tells everyone
        commit_err: Optional[str] = None
        if comm.rank == 0:
            if any(write_errors):
                target.abort()
            else:
                try:
                    manifest = build_manifest(
                        plan, [o[1] for o in outcomes], objects, per_rank_objects, step, self.block_size
                    )
                    target.commit(manifest)
                except Exception as e:
                    commit_err = f"commit of {target.final}: {_describe(e)}"
                    log.error("save of step %s: %s", step, commit_err)
                    target.abort()
        commit_err = comm.broadcast(commit_err, src=0)
        _raise_failures(write_errors, "save", step, CheckpointSaveError)
        if commit_err:
            raise CheckpointSaveError(f"save of step {step} failed on rank 0: {commit_err}")
        t_end = time.perf_counter()
        stats = SaveStats(
            step=step,
            rank=comm.rank,
            world_size=comm.size,
            stall_s=t_end - t0,
            plan_s=t_plan - t0,
            write_s=t_write - t_plan,
            commit_s=t_end - t_write,
            total_s=t_end - t0,
            bytes_written=result.nbytes if result else 0,
            total_bytes=sum(f.size for f in plan.files.values()),
            plan_cached=cached,
        )
        log.info(
            "rank %d: saved step %s to %s: %.1f MB this rank, %.3fs (plan %.3fs%s, write %.3fs, commit %.3fs)",
            comm.rank, step, target.final, stats.bytes_written / 1e6, stats.total_s, stats.plan_s,
            " cached" if cached else "", stats.write_s, stats.commit_s,
        )
        return stats


def build_manifest(
    plan: SavePlan,
    crcs_by_rank: Sequence[Dict[Tuple[str, bool, Tuple[int, ...]], Tuple[int, ...]]],
    objects: Dict[str, Any],
    per_rank_objects: Sequence[Dict[str, Any]],
    step: Optional[int],
    block_size: int,
) -> bytes:
    """The manifest of a fully written plan (rank 0)."""

    def record(tp: TensorPlan, per_rank: bool) -> TensorRecord:
        pieces = []
        for p in tp.pieces:
            crcs = crcs_by_rank[p.owner][(tp.key, per_rank, p.offset)]
            pieces.append(PieceRecord(p.offset, p.shape, p.file, p.start, p.end, crcs))
        return TensorRecord(tp.key, tp.dtype, tp.shape, tp.sharded, tuple(pieces))

    m = Manifest(
        step=step,
        world_size=plan.world_size,
        block_size=block_size,
        files={n: FileRecord(n, f.rank, f.size) for n, f in plan.files.items()},
        tensors={k: record(t, False) for k, t in plan.tensors.items()},
        objects=objects,
        per_rank=tuple(
            RankRecord({k: record(t, True) for k, t in plan.per_rank[r].items()}, dict(per_rank_objects[r]))
            for r in range(plan.world_size)
        ),
    )
    return m.to_json_bytes()
