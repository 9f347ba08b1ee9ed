"""A save's collective phases before any byte moves: every rank reports to rank 0, rank 0 answers.

Nothing here is all-gathered, so what a rank other than 0 sends, receives
and computes follows its own share of the state, not the job's
(docs/protocol.md, "Planning"). Each phase is a gather to rank 0 and an
answer from it, which every rank then acts on alike:

1. **outcomes** (every save): each rank's problems (its state, the
   destination), the id of the plan it holds (none when its structure
   changed), its JSON objects and step go to rank 0, which answers with the
   error every rank raises, or the save id and whether the held plan stands;
2. **metadata** (the first save, or when some rank's structure changed): each
   rank's compact metadata (:func:`~nostall.planning.plan.encode_meta`) goes to
   rank 0, which plans the whole save (:func:`~nostall.planning.plan.build_plan`)
   and sends each rank its share: which of its pieces it writes (a byte each),
   the keys it checksums for the replica check (by index), the plan's id and
   total size; the rank lays out its own file from it
   (:func:`~nostall.planning.plan.own_files`, :class:`~nostall.planning.plan.RankPlan`);
3. **replicas** (the first save of a plan, or every save when asked): each
   rank's checksums of the copies it holds go to rank 0, which answers with the
   verdict (:mod:`nostall.planning.replicas`).

Rank 0 alone holds the whole plan (for the manifest) and every rank's
objects. An error found on rank 0 travels as ``(kind, message)`` and is raised
alike on every rank.

With one rank, each gather and answer is a plain call (:class:`~nostall.planning.comm.Comm`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from nostall.errors import CheckpointSaveError, InvalidStateError, WriterVersionError, describe
from nostall.planning import replicas
from nostall.planning.comm import Comm
from nostall.core.format import gc_paused
from nostall.planning.plan import (RankMeta, RankPlan, SavePlan, build_plan, check_objects, decode_meta, encode_meta,
                                   own_files, owned_pieces)

__all__ = ["Report", "Agreed", "Rounds"]

_KINDS: Dict[str, type] = {"state": InvalidStateError, "save": CheckpointSaveError, "version": WriterVersionError}
_Error = Optional[Tuple[str, str]]  # (kind, message): an error raised alike on every rank


@dataclass
class Report:
    """What one rank tells rank 0 at the start of a save."""

    state_error: Optional[str]  # its state cannot be saved (why)
    target_error: Optional[str]  # the destination cannot be written (rank 0's)
    holds: str  # the id of the plan this rank holds for its current structure ("" when none)
    objects: Dict[str, Any]  # its JSON values saved once for all ranks
    per_rank_objects: Dict[str, Any]  # its JSON values of its own
    step: Optional[int]
    writer_error: Optional[str] = None  # its background writer is refused (runs other code): why


@dataclass
class Agreed:
    """A save every rank agreed on: this rank's share, and on rank 0 the whole plan and every rank's objects."""

    save_id: str
    mine: RankPlan
    cached: bool  # the plan was the one held from an earlier save
    plan: Optional[SavePlan] = None  # rank 0
    objects: Dict[str, Any] = field(default_factory=dict)  # rank 0: merged
    per_rank_objects: List[Dict[str, Any]] = field(default_factory=list)  # rank 0: each rank's


def failures(outcomes: Sequence[Optional[str]], what: str, step: Optional[int]) -> Optional[str]:
    """The message naming every rank whose outcome is an error message, or None."""
    failed = [(r, msg) for r, msg in enumerate(outcomes) if msg]
    if not failed:
        return None
    where = f"step {step}" if step is not None else "checkpoint"
    details = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
    return f"{what} of {where} failed on rank(s) {[r for r, _ in failed]}: {details}"


class Rounds:
    """The collective phases of one rank's saves over ``comm``, keeping the plan while the structure holds."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._mine: Optional[RankPlan] = None  # this rank's share of the plan it holds
        self._mine_sig = ""  # this rank's metadata signature when it got that share
        self._plan: Optional[SavePlan] = None  # rank 0: the whole plan
        self._shared: Dict[str, Tuple[Tuple[int, ...], ...]] = {}  # rank 0: keys several ranks hold copies of
        self._objects: Dict[str, Any] = {}  # rank 0: this save's merged objects
        self._reports: Sequence[Report] = ()  # rank 0: this save's reports

    def holds(self, signature: str) -> str:
        """The id of the plan this rank holds for metadata of ``signature`` ("" when none)."""
        return self._mine.plan_id if self._mine is not None and self._mine_sig == signature else ""

    def forget(self) -> None:
        """Plan afresh at the next save (and check the replicas again)."""
        self._mine = None
        self._plan = None

    def run(self, report: Report, meta: RankMeta,
            digests: Callable[[Sequence[str]], Dict[str, int]], check: Optional[bool],
            save_id: str) -> Tuple[Optional[Exception], Optional[Agreed]]:
        """The three phases (collective). Returns the error every rank raises alike, or the agreed save.

        ``meta``: this rank's metadata (sent only when rank 0 asks for it); ``digests``
        checksums the given keys of this rank's state; ``check``: the replica check's option (None:
        on a new plan only); ``save_id``: rank 0's id for this save.
        """
        comm = self.comm
        reports = comm.gather(report)
        answer: Any = None
        if comm.rank == 0:
            assert reports is not None
            try:
                answer = self._answer_reports(reports, check, save_id)
            except Exception as e:  # the others wait for this answer: it must reach them
                answer = ("save", f"rank 0: deciding on the save failed: {describe(e)}"), "", False, False
        error, save_id, replan, check_now = comm.broadcast(answer)
        if error is not None:
            return _raise(error), None
        cached = not replan
        if replan:
            share = self._replan(meta, check)
            if isinstance(share, Exception):
                return share, None
            check_now = share
            self._mine_sig = meta.signature()
        mine = self._mine
        assert mine is not None
        if check_now:
            error = self._check_replicas(mine, digests)
            if error is not None:
                self.forget()  # the next save checks again, even with the same structure
                return _raise(error), None
        agreed = Agreed(save_id, mine, cached)
        if comm.rank == 0:
            assert reports is not None
            agreed.plan = self._plan
            agreed.objects = self._objects
            agreed.per_rank_objects = [r.per_rank_objects for r in reports]
        return None, agreed

    # ------------------------------------------------------------------ rank 0's side
    def _answer_reports(self, reports: Sequence[Report], check: Optional[bool], save_id: str) -> Any:
        """Rank 0: (error, save id, replan, check replicas now) from every rank's report."""
        step = reports[0].step
        msg = failures([r.state_error for r in reports], "save", step)
        if msg is not None:
            return ("state", msg), "", False, False
        msg = failures([r.writer_error for r in reports], "save", step)
        if msg is not None:
            return ("version", msg), "", False, False
        msg = failures([r.target_error for r in reports], "save", step)
        if msg is not None:
            return ("save", msg), "", False, False
        if len({r.step for r in reports}) > 1:
            return ("state", "ranks disagree on the step being saved: "
                    + ", ".join(f"rank {i}: {r.step}" for i, r in enumerate(reports))), "", False, False
        self._objects, self._reports = {}, reports
        held = self._mine.plan_id if self._mine is not None else ""
        replan = self._plan is None or not held or any(r.holds != held for r in reports)
        if replan:  # the objects are checked against the new plan's keys (_plan_all)
            return None, save_id, True, False
        assert self._plan is not None
        try:
            self._objects = check_objects([r.objects for r in reports], self._plan.tensors)
        except InvalidStateError as e:
            return ("state", str(e)), "", False, False
        return None, save_id, False, bool(self._shared) and bool(check)

    def _plan_all(self, blobs: Sequence[Any], check: Optional[bool]) -> List[Any]:
        """Rank 0: plan from every rank's metadata; each rank's answer: its share and whether to check
        the replicas now, or the error every rank raises."""
        failed = [b for b in blobs if isinstance(b, str)]
        if failed:
            return [("save", "; ".join(failed))] * len(blobs)
        try:
            with gc_paused():
                metas = [decode_meta(b) for b in blobs]
                plan = build_plan(metas)
                objects = check_objects([r.objects for r in self._reports], plan.tensors)
                shared = replicas.shared_keys(metas)
                copies = replicas.copies_of(shared, len(metas))
                plan_id = uuid.uuid4().hex
                total = sum(f.size for f in plan.files.values())
                index = [{k: i for i, k in enumerate(t.key for t in m.tensors)} if copies[r] else {}
                         for r, m in enumerate(metas)]
                shares = [(plan_id, owned_pieces(plan, m, r), tuple(index[r][k] for k in copies[r]), total)
                          for r, m in enumerate(metas)]
                if own_files(metas[0], 0, len(metas), shares[0][1]) != tuple(plan.files_of(0)):
                    # every rank lays out its own file: rank 0's, checked against the plan, proves the rule
                    raise AssertionError("rank 0's file laid out from its share differs from the plan's")
        except InvalidStateError as e:  # computed from every rank's metadata: every rank raises it
            return [("state", str(e))] * len(blobs)
        except Exception as e:  # anything else must reach the other ranks too
            return [("save", f"rank 0: planning failed: {describe(e)}")] * len(blobs)
        self._plan, self._shared, self._objects = plan, shared, objects
        check_now = bool(shared) and check is not False
        return [(s, check_now) for s in shares]

    # ------------------------------------------------------------------ every rank
    def _replan(self, meta: RankMeta, check: Optional[bool]) -> Any:
        """The metadata phase: this rank's metadata to rank 0, its share back, its file laid out. Returns
        whether to check the replicas now, or the error every rank raises."""
        comm = self.comm
        self.forget()
        blob: Any
        try:
            blob = encode_meta(meta)
        except Exception as e:  # the others must not wait for this rank's metadata
            blob = f"rank {comm.rank}: encoding its metadata failed: {describe(e)}"
        blobs = comm.gather(blob)
        answers = self._plan_all(blobs, check) if blobs is not None else None
        got = comm.scatter(answers)
        if isinstance(got[0], str):  # (kind, message)
            self._plan = None
            return _raise(got)
        (plan_id, owned, copies, total), check_now = got
        files = own_files(meta, comm.rank, comm.size, owned)
        self._mine = RankPlan(plan_id, comm.rank, comm.size, files, total,
                              tuple(meta.tensors[i].key for i in copies))
        return check_now

    def _check_replicas(self, mine: RankPlan, digests: Callable[[Sequence[str]], Dict[str, int]]) -> _Error:
        """The replica phase: this rank's checksums to rank 0, the verdict back."""
        comm = self.comm
        sums: Any
        try:
            sums = digests(mine.copies)
        except Exception as e:  # the others must not wait for this rank's checksums
            sums = f"rank {comm.rank}: checksumming its replicated tensors failed: {describe(e)}"
        gathered = comm.gather(sums)
        verdict: _Error = None
        if gathered is not None:
            failed = [g for g in gathered if isinstance(g, str)]
            problem = "; ".join(failed) if failed else replicas.disagreements(self._shared, gathered)
            verdict = ("state", problem) if problem is not None else None
        return comm.broadcast(verdict)  # type: ignore[no-any-return]


def _raise(error: Tuple[str, str]) -> Exception:
    """The exception of an error that travelled as ``(kind, message)``."""
    kind, msg = error
    cls = _KINDS.get(kind, CheckpointSaveError)
    e: Exception = cls(msg)
    return e
