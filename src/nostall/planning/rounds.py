"""A save's collective phases before any byte moves.

Nothing here is all-gathered, and nothing makes a rank receive the job's
metadata: what a rank sends, receives and computes follows its own share of
the state (docs/protocol.md, "Planning"). Every rank then acts alike on what
it got:

1. **outcomes** (every save): each rank's problems (its state, the
   destination), the id of the plan it holds (none when its structure
   changed), whether it ties keys, its JSON objects and step go to rank 0,
   which answers with the error every rank raises, or the save id, whether
   the held plan stands and whether planning is central (some rank ties keys);
2. **metadata** (the first save, or when some rank's structure changed): each
   key saved once for all ranks has a planner (:mod:`nostall.planning.planners`);
   each rank sends each planner its part of its metadata, every planner plans
   its keys and answers each rank which of the pieces it sent it writes and
   which it checksums (two all-to-alls, :meth:`~nostall.planning.comm.Comm.exchange`);
   each rank lays out its own file (:func:`~nostall.planning.plan.own_files`);
   the planners' errors and headers, each rank's errors, per-rank tensors and
   file go to rank 0 (one gather), which answers the plan's id and total size,
   or the first error (a broadcast);
3. **replicas** (the first save of a plan, or every save when asked): each
   rank's checksums of its copies go to the keys' planners (an all-to-all),
   whose verdicts go to rank 0, which broadcasts the first
   (:mod:`nostall.planning.replicas`).

Rank 0 keeps the plan's :class:`~nostall.planning.plan.Layout` (headers and
files, for the manifest's skeleton: O(keys + ranks)) and every rank's
objects. An error travels as ``(kind, message)`` and is raised alike on every
rank.

With one rank, each collective is a plain call (:class:`~nostall.planning.comm.Comm`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from nostall.errors import CheckpointSaveError, InvalidStateError, WriterVersionError, describe
from nostall.planning import replicas
from nostall.planning.comm import Comm
from nostall.planning import planners
from nostall.planning.plan import Layout, RankMeta, RankPlan, check_objects, own_files

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
    ties: bool = False  # it holds tied keys: every key is planned by rank 0 (planners.planner_of)


@dataclass
class Agreed:
    """A save every rank agreed on: this rank's share, and on rank 0 the plan's layout and every rank's objects."""

    save_id: str
    mine: RankPlan
    cached: bool  # the plan was the one held from an earlier save
    layout: Optional[Layout] = None  # rank 0
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
        self._central = False  # the plan's keys were all planned by rank 0 (ties)
        self._shared: Dict[str, Tuple[Tuple[int, ...], ...]] = {}  # as a planner: its keys several ranks hold
        self._layout: Optional[Layout] = None  # rank 0: the plan's headers and files
        self._any_shared = False  # rank 0: some key of the plan is held by several ranks
        self._objects: Dict[str, Any] = {}  # rank 0: this save's merged objects
        self._reports: Sequence[Report] = ()  # rank 0: this save's reports

    def holds(self, signature: str) -> str:
        """The id of the plan this rank holds for metadata of ``signature`` ("" when none)."""
        return self._mine.plan_id if self._mine is not None and self._mine_sig == signature else ""

    def forget(self) -> None:
        """Plan afresh at the next save (and check the replicas again)."""
        self._mine = None
        self._layout = None

    def run(self, report: Report, meta: RankMeta,
            digests: Callable[[Sequence[str]], Dict[str, int]], check: Optional[bool],
            save_id: str) -> Tuple[Optional[Exception], Optional[Agreed]]:
        """The three phases (collective). Returns the error every rank raises alike, or the agreed save.

        ``meta``: this rank's metadata (its parts go to the planners when rank 0 asks for a plan);
        ``digests`` checksums the given keys of this rank's state; ``check``: the replica check's
        option (None: on a new plan only); ``save_id``: rank 0's id for this save.
        """
        comm = self.comm
        report.ties = report.ties or (meta is not None and any(t.tied_to for t in meta.tensors))
        reports = comm.gather(report)
        answer: Any = None
        if comm.rank == 0:
            assert reports is not None
            try:
                answer = self._answer_reports(reports, check, save_id)
            except Exception as e:  # the others wait for this answer: it must reach them
                answer = ("save", f"rank 0: deciding on the save failed: {describe(e)}"), "", False, False, False
        error, save_id, replan, check_now, central = comm.broadcast(answer)
        if error is not None:
            return _raise(error), None
        cached = not replan
        if replan:
            share = self._replan(meta, check, central)
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
            agreed.layout = self._layout
            agreed.objects = self._objects
            agreed.per_rank_objects = [r.per_rank_objects for r in reports]
        return None, agreed

    # ------------------------------------------------------------------ rank 0's side
    def _answer_reports(self, reports: Sequence[Report], check: Optional[bool], save_id: str) -> Any:
        """Rank 0: (error, save id, replan, check replicas now, central) from every rank's report."""
        step = reports[0].step
        msg = failures([r.state_error for r in reports], "save", step)
        if msg is not None:
            return ("state", msg), "", False, False, False
        msg = failures([r.writer_error for r in reports], "save", step)
        if msg is not None:
            return ("version", msg), "", False, False, False
        msg = failures([r.target_error for r in reports], "save", step)
        if msg is not None:
            return ("save", msg), "", False, False, False
        if len({r.step for r in reports}) > 1:
            return ("state", "ranks disagree on the step being saved: "
                    + ", ".join(f"rank {i}: {r.step}" for i, r in enumerate(reports))), "", False, False, False
        self._objects, self._reports = {}, reports
        held = self._mine.plan_id if self._mine is not None else ""
        central = any(r.ties for r in reports)
        replan = self._layout is None or not held or any(r.holds != held for r in reports)
        if replan:  # the objects are checked against the new plan's keys (_settle_plan)
            return None, save_id, True, False, central
        assert self._layout is not None
        try:
            self._objects = check_objects([r.objects for r in reports], self._layout.tensors)
        except InvalidStateError as e:
            return ("state", str(e)), "", False, False, False
        return None, save_id, False, self._any_shared and bool(check), central

    def _settle_plan(self, facts: Sequence[Any], check: Optional[bool]) -> Any:
        """Rank 0: from every rank's facts (:meth:`_replan`), the plan's (id, total, check now), or the
        error every rank raises."""
        for i in range(3):  # the ranks' own errors, the planners', the laying out of the files
            for f in facts:
                if f[i] is not None:
                    return f[i]
        headers: Dict[str, Any] = {}
        for f in facts:
            headers.update(f[3])
        try:
            objects = check_objects([r.objects for r in self._reports], headers)
        except InvalidStateError as e:
            return ("state", str(e))
        files = {name: (r, size) for r, f in enumerate(facts) for name, size in f[5]}
        self._layout = Layout(len(facts), headers, [f[4] for f in facts], files)
        self._objects = objects
        self._any_shared = any(f[6] for f in facts)
        return uuid.uuid4().hex, sum(size for _, size in files.values()), self._any_shared and check is not False

    # ------------------------------------------------------------------ every rank
    def _replan(self, meta: RankMeta, check: Optional[bool], central: bool) -> Any:
        """The metadata phase: this rank's parts to the planners, their answers back, its file laid out,
        the outcome from rank 0. Returns whether to check the replicas now, or the error every rank raises."""
        comm = self.comm
        self.forget()
        world, rank = comm.size, comm.rank
        own_error: _Error = None
        index: List[List[int]] = [[] for _ in range(world)]
        parts: List[Any] = [None] * world
        try:
            parts, index = planners.route(meta, world, central)
        except Exception as e:  # the others must not wait for this rank's metadata
            own_error = ("save", f"rank {rank}: encoding its metadata failed: {describe(e)}")
        got = comm.exchange(parts)
        try:
            planned = planners.plan_keys(got, rank)
        except Exception as e:  # the others wait for this planner's answers
            planned = planners.Planned(("save", f"rank {rank}: planning its keys failed: {describe(e)}"),
                                       [None] * world)
        answers = comm.exchange(planned.answers if planned.error is None else [None] * world)
        layout_error: _Error = None
        files: Tuple[Any, ...] = ()
        copies: Tuple[int, ...] = ()
        if own_error is None and planned.error is None:
            try:
                owned, copies = planners.merge(index, answers, len(meta.tensors))
                files = own_files(meta, rank, world, owned)
            except InvalidStateError as e:
                layout_error = ("state", str(e))
            except Exception as e:
                layout_error = ("save", f"rank {rank}: laying out its file failed: {describe(e)}")
        facts = (own_error, planned.error, layout_error, planned.headers, meta.per_rank,
                 [(f.name, f.size) for f in files], bool(planned.shared))
        gathered = comm.gather(facts)
        outcome: Any = None
        if gathered is not None:
            try:
                outcome = self._settle_plan(gathered, check)
            except Exception as e:  # the others wait for this answer
                outcome = ("save", f"rank 0: settling the plan failed: {describe(e)}")
        outcome = comm.broadcast(outcome)
        if isinstance(outcome[0], str) and len(outcome) == 2:  # (kind, message)
            self._layout = None
            return _raise(outcome)
        plan_id, total, check_now = outcome
        self._central, self._shared = central, planned.shared
        self._mine = RankPlan(plan_id, rank, world, files, total, tuple(meta.tensors[i].key for i in copies))
        return check_now

    def _check_replicas(self, mine: RankPlan, digests: Callable[[Sequence[str]], Dict[str, int]]) -> _Error:
        """The replica phase: this rank's checksums to the keys' planners, their verdicts to rank 0, the
        first back to every rank."""
        comm = self.comm
        sums: Dict[str, int] = {}
        failed: Optional[str] = None
        try:
            sums = digests(mine.copies)
        except Exception as e:  # the others must not wait for this rank's checksums
            failed = f"rank {comm.rank}: checksumming its replicated tensors failed: {describe(e)}"
        to: List[Dict[str, int]] = [{} for _ in range(comm.size)]
        for key, crc in sums.items():
            to[planners.planner_of(key, comm.size, self._central)][key] = crc
        got = comm.exchange(to)
        problem = replicas.disagreements(self._shared, got) if self._shared else None
        gathered = comm.gather((failed, problem))
        verdict: _Error = None
        if gathered is not None:
            errors = [f for f, _ in gathered if f]
            if errors:
                verdict = ("state", "; ".join(errors))
            else:
                verdict = next((("state", p) for _, p in gathered if p), None)
        return comm.broadcast(verdict)  # type: ignore[no-any-return]


def _raise(error: Tuple[str, str]) -> Exception:
    """The exception of an error that travelled as ``(kind, message)``."""
    kind, msg = error
    cls = _KINDS.get(kind, CheckpointSaveError)
    e: Exception = cls(msg)
    return e
