"""CheckpointManager: the per-rank entry point for periodic checkpoints."""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, ContextManager, Deque, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from nostall.planning.comm import Comm, make_comm
from nostall.core.exports import ExportJob, ExportOutcome, ExportTarget
from nostall.core.faults import Faults
from nostall.saving.background import BackgroundWriter
from nostall.errors import CheckpointError, CheckpointNotFoundError, CheckpointSaveError
from nostall.handles import OnCommit, SaveHandle, SaveStats
from nostall.core.jobs import Destination
from nostall.loading.collective import shared_manifest
from nostall.loading.reader import load_state
from nostall.options import NOT_GIVEN, MemoryTier, NotGiven, Options, options_from
from nostall.memory.tier import Restored, Tiers
from nostall.storage.root import Claim, Root, step_name
from nostall.storage.locate import open_root, resolve, split_checkpoint
from nostall.saving.exports import ExportRuns
from nostall.saving.saver import PendingSave, Saver
from nostall.training import LoadedCheckpoint, ParallelLayout, Training, load_training

log = logging.getLogger("nostall")

__all__ = ["CheckpointManager"]


class _Preemption:
    """One manager's handler of its preemption signal (``Options.preemption_signal``).

    Async-signal-safe in the Python sense: a call only stores a time and a
    flag in plain attributes, then forwards the signal (to the handler it
    replaced, or as a normal exit); it takes no lock, logs nothing, and never
    waits. Python runs it in the main thread, between two bytecodes, so the
    main thread's ``shield`` depth it reads is consistent: while the main
    thread is inside a manager call that must not be cut (a save, a
    finalize, a close), the forwarding is deferred until that call returns.
    It holds no reference to its manager (a dropped manager is collected as
    before); once its manager closed it is inactive and only forwards, with
    the signal's default action (a normal exit) where it replaced that.
    The uncut calls: ``save``, ``prepare``, ``any_rank_preempted`` (collectives
    the other ranks would wait in), ``finalize_pending_saves``, a handle's
    ``result()``, ``close``.
    """

    def __init__(self, signum: int, previous: Any, exit: bool) -> None:
        self.signum = signum
        self.previous = previous  # what it replaced: SIG_DFL or a Python callable (a user's, another manager's)
        self.exit = exit  # exit_on_preemption: forwarding SIG_DFL raises SystemExit
        self.at: Optional[float] = None  # time.monotonic() of the first signal
        self.active = True  # False once its manager closed (or was collected)
        self.shield = 0  # depth of uncut manager calls in the main thread
        self.due: Optional[bool] = None  # a deferred forward: whether the manager was active at the signal
        self.main = threading.main_thread().ident
        self.notify: Optional[Callable[[int], None]] = None  # the memory tier's, where no wakeup fd reports it

    def __call__(self, signum: int, frame: Any) -> None:
        if self.at is None:
            self.at = time.monotonic()
            if self.notify is not None:  # never waits, never raises (memory.tier.Tiers.watch)
                self.notify(signum)
        if self.shield and self.active:
            self.due = True
            return
        self.forward(signum, frame, self.active)

    def forward(self, signum: int, frame: Any, active: bool) -> None:
        """The signal's effect besides the flag: the replaced handler's, or (for SIG_DFL) a normal exit when
        asked (``exit``) or once the manager is closed."""
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif self.exit or not active:
            raise SystemExit(128 + signum)

    def deactivate(self) -> None:
        self.active = False

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """A manager call the signal must not cut (main thread only): its forward waits until it returns."""
        if threading.get_ident() != self.main:
            yield
            return
        self.shield += 1
        try:
            yield
        finally:
            self.shield -= 1
            if not self.shield and self.due is not None:
                active, self.due = self.due, None
                self.forward(self.signum, None, active)


def _training(state: Any, model: Any, optimizer: Any, scheduler: Any, rng: bool, extra: Any,
              layout: Optional[ParallelLayout], verb: str, strict: bool = True,
              driver: Any = None) -> Optional[Training]:
    """The training objects of a save or load call, or None for the state-dict form; refuses a mix."""
    objects = (model is not None or optimizer is not None or scheduler is not None or extra is not None
               or driver is not None)
    if state is not None:
        if objects or layout is not None or (verb != "load" and rng):
            raise TypeError(f"{verb}(): pass either a state or training objects (model=, optimizer=, scheduler=, "
                            "rng=, extra=), not both; put your own values in extra=")
        return None
    if not objects:
        raise TypeError(f"{verb}(): nothing to {verb}: pass model= (and optimizer=, scheduler=, extra=), or a state")
    return Training(model, optimizer, scheduler, rng, extra, layout, strict, driver)


def _key_filter(stage_now: Any) -> Optional[Callable[[str], bool]]:
    """``stage_now`` as a predicate on keys: None, a callable, or key prefixes."""
    if stage_now is None or callable(stage_now):
        return stage_now
    if isinstance(stage_now, str):
        stage_now = (stage_now,)
    prefixes = tuple(stage_now)
    if not all(isinstance(p, str) for p in prefixes):
        raise TypeError(f"stage_now must be a callable or key prefixes (str), got {stage_now!r}")
    return lambda key: key.startswith(prefixes)


class CheckpointManager:
    """Saves and loads the checkpoints of one training run under ``root``.

    Create one per rank, on every rank of ``process_group`` (creation is a
    collective call when ``torch.distributed`` is initialised: the manager makes
    a gloo group of its own for metadata, with ``timeout`` seconds per
    collective). Checkpoints land in ``<root>/step_<N>/``; ``<root>/latest``
    names the newest committed one.

    Args:
        root: directory (or URL) of the run's checkpoints (created if
            missing). None: no root of the manager's own; every save names its
            ``path`` (``save(step, ..., path=...)``) and every load too.
        process_group: the ranks that save together (default: all ranks).
        read_only: only list and load (an evaluation job beside the training
            job): no root claim, no cleanup, no writer; ``save`` raises.
        on_commit: ``fn(handle)``, called once each save of this manager is
            committed (durable and visible), and only then: write the
            trainer's own "latest" marker, delete old checkpoints, upload,
            notify. Called on every rank (check ``mgr.rank``), in the thread
            that learns the commit: the caller's, inside a synchronous
            ``save()`` before it returns (with the lock released); for an asynchronous save a
            watcher thread of its handle (within about 50 ms of the commit)
            or the caller of ``result()`` / ``done()`` / the next ``save()``
            / ``finalize_pending_saves()``. An exception it raises is logged
            and ignored: the checkpoint is committed regardless. Not called
            for a failed save. It never runs with the manager's lock held,
            so it may call the manager (``save``, ``load``,
            ``finalize_pending_saves``); ``close()`` and the exit handler
            wait for it (bounded by their timeout; past it, an error is
            logged naming the step and the callback).
        options: every setting below as one :class:`~nostall.Options` value
            (shared with ``Strategy``).
        keep_last, async_save, timeout, errors, block_size, storage_options,
        local_staging_dir, fallback_sync, overlap, staging_budget_bytes,
        check_replicas, max_write_rate, export, incremental, full_every, shared_loads,
        read_once, preemption_signal, grace_s, exit_on_preemption, memory_tier: the
            settings, described (with their defaults, which live only there)
            in :class:`~nostall.Options`. Each may be passed as a keyword
            argument, or all of them as ``options=``; a setting given both
            ways raises ``TypeError`` naming it (``options.but(name=value)``
            changes one). What they mean for a manager in particular:
            ``async_save`` starts the writer process now, so the first save
            pays no start-up, and ``save()`` returns once the rank's state is
            copied to host memory; waiting for the writer's outcome allows
            1.5x ``timeout``, so that the writer's own timeout error is the
            one reported; with ``errors="raise"`` a failed asynchronous save
            raises :class:`~nostall.CheckpointSaveError` from the next
            ``save()``, ``finalize_pending_saves()``, ``load()`` or
            ``close()``; with ``overlap`` the state must not change until
            :meth:`wait_until_staged` returns (:meth:`attach` an optimizer
            and its ``step()`` waits for that itself; docs/overlap.md); a
            state larger than ``staging_budget_bytes`` goes through the area
            in chunks, and ``save()`` then blocks until all but the last are
            written; ``fallback_sync`` saves synchronously even when
            ``async_save`` is set; ``incremental`` compares with this
            manager's previous committed save in its root; once
            ``preemption_signal`` came, :attr:`preempted` is True, and
            ``close()`` waits at most the rest of ``grace_s``.

    One manager saves to a root at a time: creating a second (not read-only)
    manager on a root that another live manager holds raises
    :class:`~nostall.CheckpointSaveError` naming the holder's host and pid, on
    every rank of the group.

    Thread safety: calls are serialised by an internal lock; a manager may be
    used from a thread other than the one that created it (e.g. saves requested
    by a trainer thread while another thread generates). Collective calls
    (``save``, ``prepare``) must be made in the same order on every rank.
    What ``save()`` reads may change once it returns. The preemption signal
    (SIGTERM by default) is handled only by a saving manager created on the
    main thread: there it becomes a normal exit that commits the pending save
    (or, with ``exit_on_preemption=False``, only :attr:`preempted`). See
    docs/integration.md and docs/reliability.md ("Preemption").
    """

    def __init__(
        self,
        root: Optional[str],
        *,
        keep_last: Union[Optional[int], NotGiven] = NOT_GIVEN,
        process_group: Any = None,
        async_save: Union[bool, NotGiven] = NOT_GIVEN,
        timeout: Union[float, NotGiven] = NOT_GIVEN,
        errors: Union[str, NotGiven] = NOT_GIVEN,
        block_size: Union[int, NotGiven] = NOT_GIVEN,
        read_only: bool = False,
        storage_options: Union[Optional[Dict[str, Any]], NotGiven] = NOT_GIVEN,
        local_staging_dir: Union[Optional[str], NotGiven] = NOT_GIVEN,
        fallback_sync: Union[bool, NotGiven] = NOT_GIVEN,
        overlap: Union[bool, NotGiven] = NOT_GIVEN,
        staging_budget_bytes: Union[Optional[int], NotGiven] = NOT_GIVEN,
        check_replicas: Union[Optional[bool], NotGiven] = NOT_GIVEN,
        max_write_rate: Union[Optional[float], NotGiven] = NOT_GIVEN,
        export: Union[Optional[ExportTarget], NotGiven] = NOT_GIVEN,
        incremental: Union[bool, NotGiven] = NOT_GIVEN,
        full_every: Union[Optional[int], NotGiven] = NOT_GIVEN,
        shared_loads: Union[bool, NotGiven] = NOT_GIVEN,
        read_once: Union[Optional[bool], NotGiven] = NOT_GIVEN,
        preemption_signal: Union[Optional[int], NotGiven] = NOT_GIVEN,
        grace_s: Union[float, NotGiven] = NOT_GIVEN,
        exit_on_preemption: Union[bool, NotGiven] = NOT_GIVEN,
        memory_tier: Union[Optional[MemoryTier], NotGiven] = NOT_GIVEN,
        on_commit: Optional[Callable[[SaveHandle], Any]] = None,
        options: Optional[Options] = None,
    ) -> None:
        options = options_from(options, dict(
            keep_last=keep_last, async_save=async_save, timeout=timeout, errors=errors, block_size=block_size,
            storage_options=storage_options, local_staging_dir=local_staging_dir, fallback_sync=fallback_sync,
            overlap=overlap, staging_budget_bytes=staging_budget_bytes, check_replicas=check_replicas,
            max_write_rate=max_write_rate, export=export, incremental=incremental, full_every=full_every,
            shared_loads=shared_loads, read_once=read_once, preemption_signal=preemption_signal, grace_s=grace_s,
            exit_on_preemption=exit_on_preemption, memory_tier=memory_tier,
        ), "CheckpointManager()")
        if read_only and options.async_save:
            options = options.but(async_save=False)
        self.options = options
        self.read_only = bool(read_only)
        self._faults = Faults()  # tests arm it; inert otherwise
        self._root: Optional[Root] = None
        if root is not None:
            self._root = open_root(os.fspath(root), storage_options=options.storage_options,
                                   local_staging=options.local_staging_dir, timeout=self.options.timeout,
                                   faults=self._faults)
        self.root: Optional[str] = self._root.url if self._root is not None else None
        self._init_state(on_commit)
        self._start(process_group)
        self._install_exit_handlers()

    def _init_state(self, on_commit: Optional[Callable[[SaveHandle], Any]]) -> None:
        """__init__, phase 1: the manager's bookkeeping, nothing started yet."""
        self._on_commit = on_commit
        self._hooks: List[Any] = []
        self._attached: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers attached by save(optimizer=)
        self._lock = threading.RLock()
        self._closed = False
        self._exit_hold: List["CheckpointManager"] = []  # self while a save is pending (see _pending)
        self._pending_save: Optional[Tuple[PendingSave, SaveHandle]] = None
        self._closing = False  # close() has begun: it waits (lock released) for commit callbacks
        self._handles: List[SaveHandle] = []  # handles whose commit callbacks may be due or running (close waits)
        self._unraised: Optional[CheckpointSaveError] = None  # a failure not yet reported to the caller
        self._waited_out: Optional[PendingSave] = None  # a pending save whose full wait already ran out
        self._claim: Optional[Claim] = None
        self._stats: Deque[SaveStats] = collections.deque(maxlen=1000)
        self._exports = ExportRuns()  # the export at save time (Options.export), one at a time
        self._writer: Optional[BackgroundWriter] = None
        self._preemption: Optional[_Preemption] = None  # this manager's signal handler, while installed
        self._preemption_noted = False  # the preemption was logged
        self._tiers: Optional[Tiers] = None  # the memory tier (Options.memory_tier), while the manager lives
        self.last_restore: Optional[Restored] = None  # memory tier: how the last load() went (which tier, bytes)
        self._clean_exit = True  # close() releases the memory tier (False: an exception ends the trainer)

    def _start(self, process_group: Any) -> None:
        """__init__, phase 2 (collective): the metadata group, the saver, the root's claim, the writer;
        on failure, what was started is released again."""
        self._comm: Comm = make_comm(process_group, self.options.timeout, own_group=True)
        try:
            self._saver = Saver(self._comm, self.options, self._faults)
            if not self.read_only and self._root is not None:
                self._claim_root()
            self._start_memory_tier()
            if self.options.async_save:
                self._writer = BackgroundWriter(self._comm.rank, self.options.timeout, self._root)
        except BaseException:
            if self._tiers is not None:
                self._tiers.close(release=False)  # a failed start keeps the snapshots it came to restore
            if self._claim is not None:
                self._claim.release()
            self._comm.close()
            raise

    def _start_memory_tier(self) -> None:
        """_start: attach to (or start) the job's memory-tier holder on this host (collective; docs/protocol.md,
        "Memory tier"). A read-only manager has none."""
        if self.options.memory_tier is None or self.read_only:
            return
        if self._root is None:
            raise CheckpointError("memory_tier needs a root (the persistent tier): pass one, or drop memory_tier")
        self._tiers = Tiers(self.options, self._root.url, self._comm, self._root.held_lock())

    def _install_exit_handlers(self) -> None:
        """__init__, phase 3: close at exit (a weak reference: the manager may be collected first), and
        SIGTERM as a normal exit while async saves may be pending (main thread only). While a save is
        pending the handler holds the manager (``_exit_hold``): a manager dropped with a save in flight
        lives until exit, where its save is finalized, never silently lost."""
        ref = weakref.ref(self)
        hold = self._exit_hold

        def at_exit() -> None:
            m = hold[0] if hold else ref()
            if m is not None:
                m._close_at_exit()

        self._at_exit = at_exit
        atexit.register(at_exit)
        self._install_preemption()
        if self._tiers is not None and self._preemption is not None:
            self._tiers.watch(self._preemption)  # the holder's last save on preemption learns of the signal

    def _install_preemption(self) -> None:
        """Handle ``preemption_signal`` (a saving manager on the main thread): a :class:`_Preemption` in front
        of the handler it finds (chained to it), or none where the signal is ignored or handled outside
        Python. Inactive handlers of closed managers in the chain are skipped over."""
        signum = self.options.preemption_signal
        if signum is None or self.read_only:
            return
        if threading.current_thread() is not threading.main_thread():
            log.debug("rank %d: the manager is created outside the main thread: it does not handle %s (preempted "
                      "stays False)", self.rank, signal.Signals(signum).name)
            return
        previous = signal.getsignal(signum)
        while isinstance(previous, _Preemption) and not previous.active:
            previous = previous.previous
        if previous is None or previous == signal.SIG_IGN:
            log.info("rank %d: %s is %s: the manager leaves it so (preempted stays False)", self.rank,
                     signal.Signals(signum).name, "ignored" if previous is not None else "handled outside Python")
            return
        handler = _Preemption(signum, previous, self.options.exit_on_preemption)
        signal.signal(signum, handler)
        self._preemption = handler
        weakref.finalize(self, handler.deactivate)  # a manager collected unclosed: its handler only forwards

    @property
    def preempted(self) -> bool:
        """True once this process received the preemption signal (``Options.preemption_signal``) while the
        manager handled it; never False again. Local to this rank: see :meth:`any_rank_preempted`."""
        handler = self._preemption
        return handler is not None and handler.at is not None

    def _grace_left(self) -> Optional[float]:
        """Seconds left of ``grace_s`` since the preemption signal; None when it did not come."""
        handler = self._preemption
        if handler is None or handler.at is None:
            return None
        return max(0.0, handler.at + self.options.grace_s - time.monotonic())

    def _shielded(self) -> ContextManager[None]:
        """A manager call that the preemption signal must not cut (its effect waits until it returns)."""
        handler = self._preemption
        return handler.shielded() if handler is not None else contextlib.nullcontext()

    def _note_preemption(self) -> None:
        """Log the preemption once (never from the signal handler itself)."""
        left = self._grace_left()
        if left is None or self._preemption_noted:
            return
        self._preemption_noted = True
        pending = self._pending
        log.warning("rank %d: preempted (%s received %.1fs ago, grace period %.0fs): %s", self.rank,
                    signal.Signals(self.options.preemption_signal or 0).name, self.options.grace_s - left,
                    self.options.grace_s,
                    f"the pending save of step {pending[1].step} is committed within what is left of it"
                    if pending is not None else "no save pending")

    def any_rank_preempted(self) -> bool:
        """Whether the preemption signal reached any rank of the group (a collective call: every rank gets
        the same answer, so that they stop at the same step).

        A scheduler signals every rank, but not at the same instant: a loop
        that stops on :attr:`preempted` alone may stop on one rank a step
        before another, and its last ``save()`` then fails on every rank
        (the ranks disagree on the step). Call this every few steps instead::

            if step % 10 == 0 and mgr.any_rank_preempted():
                mgr.save(step, model=model, optimizer=optimizer)
                break

        One all-gather of a bool over the manager's group, bounded by
        ``timeout`` (a rank that is gone makes it raise
        :class:`~nostall.CheckpointError`).
        """
        self._check_open()
        with self._shielded(), self._lock:  # not cut half-way by the signal: the others would wait for this rank
            self._check_open()
            self._note_preemption()
            if self._comm.size == 1:
                return self.preempted
            return any(self._comm.all_gather(self.preempted))

    @property
    def _pending(self) -> Optional[Tuple[PendingSave, SaveHandle]]:
        """The save in flight (async) and its handle; None when every save is settled."""
        return self._pending_save

    @_pending.setter
    def _pending(self, value: Optional[Tuple[PendingSave, SaveHandle]]) -> None:
        self._pending_save = value
        self._exit_hold[:] = [] if value is None else [self]  # the exit handler holds a manager with a pending save

    @property
    def async_save(self) -> bool:
        return self.options.async_save

    @property
    def keep_last(self) -> Optional[int]:
        return self.options.keep_last

    @property
    def timeout(self) -> float:
        return self.options.timeout

    def _claim_root(self) -> None:
        """Rank 0 claims the root (or finds why it cannot); every rank raises the same error.

        A root whose lock is held by an orphan writer finishing the last save of a trainer that died (its
        lock record says until when: docs/protocol.md, "Lifetime") is waited for, bounded
        (:meth:`Claim.wait_left`), in rounds: after each look rank 0 tells every rank whether to wait on, and at
        the end whether its claim holds the root's lock (``SaveJob.root_locked``: rank 0's writer shares it).
        """
        assert self._root is not None
        started = time.monotonic()
        waiting_for = ""
        while True:
            error: Optional[str] = None
            wait = locked = False
            if self._comm.rank == 0:
                try:
                    claim = self._root.claim()
                    waited = time.monotonic() - started
                    if claim.held:
                        self._claim = claim
                        locked = claim.locked
                        if waiting_for:
                            log.info("rank 0: took checkpoint root %s after %.1fs", self.root, waited)
                    elif claim.wait_left(waited) > 0:
                        wait = True
                        if claim.owner != waiting_for:
                            waiting_for = claim.owner
                            log.warning("rank 0: checkpoint root %s is held by %s: waiting for it (at most %.0fs)",
                                        self.root, claim.owner, claim.wait_left(waited))
                    else:
                        error = (
                            f"checkpoint root {self.root} is in use by another CheckpointManager: "
                            f"{claim.owner}. Two jobs must not save to one root; to only read its "
                            "checkpoints, pass read_only=True"
                        ) if claim.busy_until is None else (
                            f"checkpoint root {self.root} is still held by {claim.owner}, after waiting {waited:.0f}s "
                            "for it: retry once that process has exited, or kill it to give that save up"
                        )
                except (OSError, CheckpointError) as e:
                    error = f"cannot use checkpoint root {self.root}: {e}"
            if self._comm.size > 1:
                error, wait, locked = self._comm.broadcast((error, wait, locked))
            if error is not None:
                raise CheckpointSaveError(error)
            if not wait:
                self._saver.root_locked = locked
                return
            if self._comm.rank == 0:
                time.sleep(0.2)

    # ------------------------------------------------------------------ info
    @property
    def rank(self) -> int:
        """This process's rank in the manager's group."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.size

    @property
    def writer_pid(self) -> Optional[int]:
        """Process id of this rank's background writer (async mode), else None."""
        return self._writer.pid if self._writer is not None else None

    def _own_root(self, what: str) -> Root:
        if self._root is None:
            raise CheckpointError(f"{what}: this CheckpointManager has no root (created with root=None): it saves "
                                  "to and loads from the paths its caller names (path=)")
        return self._root

    def path_for(self, step: int) -> str:
        """Directory (or URL) of the checkpoint of ``step`` (committed or not)."""
        return self._own_root("path_for").path(step_name(step))

    def steps(self) -> List[int]:
        """Steps of the committed checkpoints, ascending."""
        return self._own_root("steps").steps()

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None. A pending save is not counted.

        Normally the highest step; after resuming from an older step and saving,
        the step saved last (``latest`` names it).
        """
        return self._own_root("latest_step").latest_step()

    def freshest_step(self) -> Optional[int]:
        """The step ``load()`` restores without ``step``: with a memory tier, the newest step committed in every
        rank's memory root when it is newer than the persistent root's latest (a collective call), else
        :meth:`latest_step`; None when there is none. Resume with it rather than ``latest_step()``."""
        if self._tiers is None:
            return self.latest_step()
        with self._lock:
            self._check_open()
            return self._tiers.freshest(self.latest_step)[0]

    def stats(self) -> List[SaveStats]:
        """Stats of this manager's committed saves, oldest first."""
        return list(self._stats)

    # ------------------------------------------------------------------ save / load
    def prepare(self, state: Any = None, *, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                rng: bool = False, extra: Any = None, layout: Optional[ParallelLayout] = None) -> None:
        """Plan a save of ``state`` (or of the training objects, as ``save`` takes them) and allocate
        the staging area ahead of the first save (collective).

        Optional: the first ``save()`` otherwise does it. Call it once the
        state has its final structure (an optimizer's state exists after its
        first step).
        """
        training = _training(state, model, optimizer, scheduler, rng, extra, layout, "prepare")
        with self._shielded(), self._lock:
            self._check_open(writing=True)
            plan = self._saver.plan(training.state(self.world_size) if training is not None else state)
            if self._writer is not None:
                from nostall.saving.area import layout as file_layout

                _, size = file_layout(plan.files)
                budget = self.options.staging_budget_bytes
                self._writer.ensure_alive()
                self._writer.area.ensure(min(size, budget or size), cap=budget)
                self._writer.attach_if_needed()

    def save(self, step: Optional[int], state: Any = None, *, model: Any = None, optimizer: Any = None,
             scheduler: Any = None, rng: bool = False, extra: Any = None, layout: Optional[ParallelLayout] = None,
             path: Any = None, files: Optional[Mapping[str, Any]] = None, driver: Any = None,
             async_save: Optional[bool] = None,
             overlap: Optional[bool] = None, stage_now: Any = None,
             export: Union[None, bool, ExportTarget] = None) -> SaveHandle:
        """Save checkpoint ``step``; a collective call over the group.

        Either training objects, read as they are now::

            mgr.save(step, model=model, optimizer=optimizer, scheduler=scheduler,
                     rng=True, extra={"epoch": epoch, "loader": nostall.PerRank(position)})

        (optimizer state keyed by parameter name and split like its
        parameter; ``extra``: the caller's own state; ``layout`` only for
        Megatron-style tensor-parallel parameters; see
        :class:`nostall.training.Training`), or a ``state``: a nested dict
        whose leaves are tensors (replicated), ShardedTensor, DTensor,
        PerRank and JSON values::

            mgr.save(step, {"model": model.state_dict(), "step": step})

        Where: ``<root>/step_<step>``, moving the root's ``latest`` and
        applying ``keep_last`` after the commit; or, with ``path``, the
        directory (or URL) the caller names, e.g. ``<run>/global_step_7/policy``
        (created atomically, replacing an older nostall checkpoint there;
        no ``latest``, no retention: the caller owns them, see ``on_commit``).
        All of a manager's saves share its writer and staging memory, and at
        most one is in flight, whatever their paths.

        ``driver``: state only rank 0 passes (a job driver's or coordinator's
        own: its data position, counters; JSON and small tensors), saved
        once in the same commit; ``load(model=...)`` returns it on every rank
        as ``driver``.

        ``files``: small files committed with the checkpoint, at
        ``<checkpoint>/<name>`` (rank 0's; see :mod:`nostall.saving.side_files`)::

            files={"huggingface/config.json": model.config.to_dict(),
                   "huggingface": pathlib.Path(tokenizer_dir)}   # a directory: every file in it

        Waits first for the previous save of this manager to be committed. A
        synchronous save returns after its commit; an asynchronous one
        (``async_save`` defaults to the manager's setting) once this rank's
        data is copied to host memory: the returned handle completes later,
        and its ``stats.stall_s`` is known at once.

        Raises :class:`~nostall.InvalidStateError` for a bad state and
        :class:`~nostall.CheckpointSaveError` when a rank failed; nothing is
        then committed and the previous checkpoint stays latest. Tensors may be
        modified as soon as ``save()`` returns, except with ``overlap``
        (default: the manager's), where they may be modified once
        :meth:`wait_until_staged` returns (an optimizer passed as
        ``optimizer=`` is attached: its ``step()`` waits by itself, and the
        model's buffers are copied before ``save()`` returns). ``stage_now``
        (overlap only): keys to copy before ``save()`` returns, because the
        caller changes them before its next optimizer step (BatchNorm's
        running statistics, say): a callable ``key -> bool``, or key
        prefixes (``"model/bn1."`` for a ``state_dict()`` saved under
        ``"model"``).

        ``export``: this save's export at save time (see ``Options.export``):
        None: the manager's; False: none; an export target: that one. It runs
        after the commit, off the training thread; the next ``save()`` waits
        for it first, and :meth:`export_result` gives its outcome.
        """
        if not (step is None and path is not None) and (isinstance(step, bool) or not isinstance(step, int)
                                                         or step < 0):
            raise ValueError(f"step must be a non-negative int (None only with path=), got {step!r}")
        training = _training(state, model, optimizer, scheduler, rng, extra, layout, "save", driver=driver)
        target = self._export_target(export, step)
        use_async = self.options.async_save if async_save is None else bool(async_save)
        if self.options.fallback_sync:
            use_async = False
        t_call = time.perf_counter()
        self._check_open(writing=True)  # at once, before any wait
        self._note_preemption()
        with self._shielded():  # a preemption signal now takes effect once this save has returned
            # The previous save is settled first and its commit callbacks run (as before any save), but outside
            # the lock: a callback may call the manager (a callback running in a watcher thread too, while this
            # waits).
            self._finalize_then_callbacks(None, flush=False)
            with self._lock:
                handle = self._save_locked(step, state, training, optimizer, path, files, use_async, overlap,
                                           stage_now, t_call)
                if target is not None and not (self._tiers is not None and self._tiers.holds(handle.path)):
                    self._start_export(target, handle, use_async)  # (not for a memory save: not durable)
            if not use_async:
                handle._run_callbacks()  # on_commit of a synchronous save: here, outside the lock
        return handle

    def _save_locked(self, step: Optional[int], state: Any, training: Optional[Training], optimizer: Any, path: Any,
                     files: Optional[Mapping[str, Any]], use_async: bool, overlap: Optional[bool], stage_now: Any,
                     t_call: float) -> SaveHandle:
        """save(), lock held: settle a save started meanwhile, then run this one (sync: committed on return,
        its commit callbacks due once the caller released the lock) or stage it for the writer (async)."""
        self._check_open(writing=True)
        # A save started meanwhile (by one of the previous save's callbacks, or another thread) is settled here;
        # its own callbacks are left to its handle's watcher thread (never run with the lock held).
        self._finalize(None, flush=False)  # the writer's retention after the last commit runs before this job
        self._handles = [h for h in self._handles if not h._callbacks_quiet(strict=True)]
        use_overlap = use_async and (self.options.overlap if overlap is None else bool(overlap))
        if training is not None:
            state = training.state(self.world_size)
            if use_overlap:
                if optimizer is not None and optimizer not in self._attached:
                    self.attach(optimizer)
                if stage_now is None:
                    stage_now = set(training.buffer_keys()).__contains__
        if self._tiers is not None and self._tiers.takes(step, path):
            assert step is not None
            dest = self._tiers.destination(step)  # the memory tier: this step is not a persistent one
        else:
            dest = self._destination(step, path)
        if use_async:
            handle = self._save_async(step, state, dest, t_call, use_overlap, stage_now, files)
        else:
            stats = self._saver.save(state, dest, t_call, side=files)
            self._stats.append(stats)
            handle = SaveHandle(step, dest.path)
            handle._set_result(stats)
            self._watch_commit(handle, run=False)
        self._handles.append(handle)
        return handle

    def _export_target(self, export: Union[None, bool, ExportTarget], step: Optional[int]) -> Optional[ExportTarget]:
        """The export a save runs (``save(export=)``, else the manager's), its step checked."""
        if export is None or export is True:
            target = self.options.export
        elif export is False:
            target = None
        elif isinstance(export, ExportTarget):
            target = export
        else:
            raise TypeError(f"save(): export must be None, False or an export target (HFExport), got {export!r}")
        if target is not None:
            target.check_step(step)
        return target

    def _start_export(self, target: ExportTarget, handle: SaveHandle, use_async: bool) -> None:
        """After ``save()`` (lock held): the save's export, in a thread that starts once the save is committed."""
        job = ExportJob(handle.path, handle.step, self.rank, self.world_size, self.options.timeout, self._faults,
                        storage_options=self.options.storage_options)
        self._exports.start(target, job, None if use_async else True, self._peek, 3 * self.options.timeout)

    def export_result(self, timeout: Optional[float] = None) -> ExportOutcome:
        """The outcome of the latest export at save time on this rank, once it finished (a wait bounded by
        ``timeout``, default the manager's; past it :class:`~nostall.CheckpointError`, the export going on). Raises its
        :class:`~nostall.core.exports.CheckpointExportError` when it failed (rank 0's outcome is the
        export's; another rank's is its own part's), and :class:`~nostall.CheckpointError` when no export ran.
        Settles a pending save first (its failure is still raised by the next call, as always)."""
        wait = self.options.timeout if timeout is None else timeout
        with self._shielded(), self._lock:
            self._check_open()
            if self._pending is not None:
                self._settle(wait)
            self._exports.wait(wait, cancel=False)
            running = self._exports.pending()
            outcome = self._exports.last
        if running:
            raise CheckpointError(f"rank {self.rank}: the export at save time still runs after {wait:.0f}s (it goes "
                                  "on; the next save waits for it)")
        if outcome is None:
            raise CheckpointError(f"rank {self.rank}: no export at save time ran on this manager (Options.export, "
                                  "save(..., export=))")
        if outcome.error is not None:
            raise outcome.error
        return outcome

    def _save_async(self, step: Optional[int], state: Any, dest: Destination, t_call: float, use_overlap: bool,
                    stage_now: Any, files: Optional[Mapping[str, Any]]) -> SaveHandle:
        """save(), asynchronous: stage and hand the job to the writer (lock held)."""
        if self._writer is None:
            self._writer = BackgroundWriter(self._comm.rank, self.options.timeout, self._root)
        pending = self._saver.save_async(state, dest, self._writer, t_call, overlap=use_overlap,
                                         stage_now=_key_filter(stage_now), side=files)
        handle = SaveHandle(step, pending.job.dest.path, driver=self._drive, peek=self._peek,
                            reported=self._reported, staged=self._saver.staged_stats(pending))
        self._pending = (pending, handle)
        self._watch_commit(handle, run=False)  # due once settled: run by whoever settles it, or its watcher
        log.debug("rank %d: step %d staged in %.3fs, writing in the background", self.rank, step, pending.stall_s)
        return handle

    def _destination(self, step: Optional[int], path: Any) -> Destination:
        """Where a save goes: ``<root>/step_<N>`` (moving ``latest``, then retention), or the
        caller's own ``path`` (nothing else moved or deleted)."""
        if path is None:
            assert step is not None
            return Destination(self._own_root("save(step) without path="), step_name(step), step, "",
                               move_latest=True, keep_last=self.options.keep_last)
        where = os.fspath(path)
        root, name = split_checkpoint(where, self.options.storage_options, local_staging=self.options.local_staging_dir,
                                      timeout=self.options.timeout, faults=self._faults)
        if self._root is not None and root.url == self._root.url:
            raise CheckpointError(f"path={where!r} lies directly in this manager's root {self.root}, whose "
                                  "step_<N> layout, latest and retention the manager owns: save(step) writes "
                                  "there; pass a path elsewhere (or a manager with root=None)")
        return Destination(root, name, step, "")

    def _watch_commit(self, handle: SaveHandle, run: bool) -> None:
        """Register ``on_commit`` on a new handle (``run`` False: the caller holds the lock and runs
        the callbacks due once it released it)."""
        if self._on_commit is not None and not (self._tiers is not None and self._tiers.holds(handle.path)):
            handle._add_callback(OnCommit(self._on_commit), run)  # (not for a memory save: it is not durable)

    def _settle(self, timeout: Optional[float]) -> None:
        """Wait (bounded) for the pending save's outcome and record it on its handle.

        A failure is kept in ``_unraised`` until ``finalize_pending_saves``
        reports it, however the outcome was observed.
        """
        if self._pending is None:
            return
        pending, handle = self._pending
        pending.wait_staged(self.options.timeout if timeout is None else timeout)
        if pending.failed is not None:
            result = pending.failed
        else:
            assert self._writer is not None
            try:
                result = self._writer.wait(timeout)  # raises on timeout; the save stays pending
            except CheckpointError:
                if timeout is None:
                    self._waited_out = pending
                raise
        self._pending = None
        try:
            stats = self._saver.complete(pending, result)
        except CheckpointSaveError as e:
            handle._set_exception(e)
            self._unraised = e
            self._exports.settled(False)
            return
        self._stats.append(stats)
        handle._set_result(stats)
        self._exports.settled(True)

    def _drive(self, timeout: Optional[float]) -> None:
        """SaveHandle.result()/exception(): settle (retention included), without raising here."""
        with self._shielded(), self._lock:
            self._settle(timeout)
            if self._writer is not None:
                self._writer.flush(self.options.timeout if timeout is None else timeout)

    def _peek(self) -> Optional[bool]:
        """SaveHandle.done(): settle only if the outcome is already there; never blocks.

        False once the manager is closed (no outcome can come any more)."""
        if self._closed:
            return False
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._pending is None:
                return None
            pending, _ = self._pending
            if pending.staging is not None and pending.staging.is_alive():
                return None  # still copying: the writer has not even got the job
            if pending.failed is not None or (self._writer is not None and self._writer.ready()):
                self._settle(None)
            return None
        finally:
            self._lock.release()

    def _reported(self, error: BaseException) -> None:
        """SaveHandle.result() raised ``error`` to the caller: no need to raise it again."""
        with self._lock:
            if self._unraised is error:
                self._unraised = None

    def wait_until_staged(self, timeout: Optional[float] = None) -> None:
        """Block until the pending save's copy into host memory is done (overlap); then the state may change.

        Returns at once when nothing is being copied. Thread-safe, and it does
        not wait for a concurrent ``finalize_pending_saves`` (no lock taken).
        Raises :class:`~nostall.CheckpointError` after ``timeout`` (default: the
        manager's). Called by attached optimizers before each ``step()``.
        """
        pending = self._pending
        if pending is not None:
            pending[0].wait_staged(self.options.timeout if timeout is None else timeout)

    def attach(self, optimizer: Any) -> Any:
        """Make ``optimizer.step()`` wait until the pending save's state is copied (overlap).

        Registers a step pre-hook on a ``torch.optim.Optimizer``; several
        optimizers may be attached. Returns the hook's handle (``.remove()``
        detaches it); ``close()`` detaches every optimizer.
        """
        ref = weakref.ref(self)

        def before_step(opt: Any, args: Any, kwargs: Any) -> None:
            m = ref()
            if m is not None:
                m.wait_until_staged()

        handle = optimizer.register_step_pre_hook(before_step)
        self._hooks.append(handle)
        self._attached.add(optimizer)
        return handle

    def finalize_pending_saves(self, timeout: Optional[float] = None) -> None:
        """Wait until every save this rank started is committed, or raise its error.

        Bounded by ``timeout`` (default: the manager's); past it, raises
        :class:`~nostall.CheckpointError` and the save stays pending. Not a
        collective: safe to call any number of times, on any subset of ranks.
        Called automatically by ``save()``, ``load()``, ``close()`` and at exit.
        A failed save is raised once (or logged, with ``errors="log"``).
        Once it returns, the commit callbacks of the saves it waited for
        (``on_commit``, ``add_done_callback``) have run, and so has retention
        (``keep_last``: a background writer deletes old checkpoints after it
        reports the commit, so that the trainers learn of it first; a
        handle's ``result()`` waits for it too, the next ``save()`` does not).
        The callbacks run with the manager's lock released: one may call the
        manager, this method included. Once ``close()`` has finished waiting
        for callbacks, it returns at once (nothing is pending then).
        """
        with self._shielded():
            self._finalize_then_callbacks(timeout, flush=True)

    def _finalize(self, timeout: Optional[float], flush: bool, due: Optional[List[SaveHandle]] = None) -> None:
        """Settle the pending save (bounded), wait for the writer's retention (``flush``), and raise (or
        log) a failure not yet reported. The settled save's handle goes into ``due``: its commit callbacks
        are for the caller to run once it holds the lock no more (else its watcher thread runs them)."""
        with self._lock:
            if due is not None and self._pending is not None:
                due.append(self._pending[1])
            self._settle(timeout)
            # the export of the save just settled (logged if it failed): cancelled past the full bound, left
            # running past a caller's shorter one (finalize_pending_saves(timeout)); the next save waits again
            self._exports.wait(self.options.timeout if timeout is None else timeout, cancel=timeout is None)
            if flush and self._writer is not None:
                self._writer.flush(self.options.timeout if timeout is None else timeout)
            if self._unraised is not None:
                e, self._unraised = self._unraised, None
                if self.options.errors == "raise":
                    raise e
                log.error("%s (errors='log': training goes on)", e)

    def _finalize_then_callbacks(self, timeout: Optional[float], flush: bool) -> None:
        """``_finalize``, then the commit callbacks of the save it settled, in this thread, with the
        lock released (a callback may call the manager); one that the handle's watcher runs now is
        waited for (bounded). Never called with the lock held."""
        due: List[SaveHandle] = []
        try:
            self._finalize(timeout, flush, due)
        finally:
            for handle in due:
                if handle.done():
                    handle._finish_callbacks(self.options.timeout)

    def load(self, state: Any = None, step: Optional[int] = None, *, model: Any = None, optimizer: Any = None,
             scheduler: Any = None, rng: bool = True, extra: Any = None, layout: Optional[ParallelLayout] = None,
             path: Any = None, strict: bool = True, verify: bool = True, per_rank: str = "error") -> Any:
        """Restore checkpoint ``step`` (None: latest); a collective call over the group, as ``save`` is
        (rank 0 reads the manifest and each rank gets its part; ``shared_loads=False``: each rank alone).

        Training objects, restored in place (a fresh optimizer needs no
        preparation; its learning rate and the scheduler come back too)::

            resumed = mgr.load(model=model, optimizer=optimizer, scheduler=scheduler)
            start = resumed.step + 1

        returns a :class:`~nostall.LoadedCheckpoint` (``step``, ``extra``,
        ``rng_restored``: RNG states saved with ``rng=True`` are set when
        ``rng`` is true and the world size is the saving one's). ``extra``:
        a template when the saved extra holds tensors or PerRank values.

        Or a ``state`` template: its tensors are filled in place, and the
        restored state is returned (the same structure, with JSON values and
        this rank's PerRank values, unwrapped, as saved).

        Either way the template may be sharded differently, or be on another
        world size, than the save. ``path``: a checkpoint (or a run root:
        its latest, or ``step``) elsewhere than this manager's root.
        Finalizes pending saves first.

        ``strict`` (default True), as torch's ``load_state_dict``: a key the
        template (or the objects given) has and the checkpoint lacks, or one
        the checkpoint has under what is loaded and the template lacks (a
        2-layer model's checkpoint into a 1-layer model, a saved value the
        state leaves out), is a :class:`~nostall.CheckpointLoadError` naming
        the keys. Training objects not given are not loaded (``model=``
        alone from a checkpoint with an optimizer is no error). False: the
        keys both hold are loaded, the others keep their values, and they
        are reported: ``LoadedCheckpoint.missing_keys`` and
        ``unexpected_keys``, and a WARNING of the ``nostall`` logger (a
        ``state`` load returns the restored state as always).

        With a memory tier (``Options.memory_tier``) and neither ``step`` nor
        ``path``: the freshest complete tier (:meth:`freshest_step`), the
        memory root's newest step committed on every rank when it is newer
        than the persistent root's latest; a memory checkpoint that fails to
        load on any rank (a checksum) makes every rank load the persistent
        one. :attr:`last_restore` says which tier, and the bytes read from
        the persistent root (docs/protocol.md, "Memory tier").
        """
        training = _training(state, model, optimizer, scheduler, rng, extra, layout, "load", strict)
        self._check_open()  # at once, before any wait
        self.finalize_pending_saves()  # with the lock released: its callbacks may call the manager
        with self._lock:
            self._check_open()
            self._finalize(None, flush=True)  # one another thread (or a callback) started meanwhile
            if self._tiers is not None and path is None and step is None:  # the freshest complete tier

                def load_from(where: Any, own_copies: bool = False) -> Any:
                    return self._load_locked(training, state, where, None, strict, verify, per_rank, own_copies)

                result, self.last_restore = self._tiers.restore(
                    self.latest_step, load_from, lambda: load_from(None),
                    lambda r: (r.bytes_read, r.bytes_received) if isinstance(r, LoadedCheckpoint) else (None, None),
                    self.path_for, load_partial=lambda where: load_from(where, own_copies=True))
                return result
            result = self._load_locked(training, state, path, step, strict, verify, per_rank)
            if self._tiers is not None and path is None and step is not None:
                self._tiers.drop_newer(step)  # memory snapshots newer than it belong to a timeline left behind
            return result

    def _load_locked(self, training: Optional[Training], state: Any, path: Any, step: Optional[int], strict: bool,
                     verify: bool, per_rank: str, own_copies: bool = False) -> Any:
        """load(), lock held, pending saves settled: checkpoint ``path`` or ``step`` of this manager's root.

        ``own_copies`` (internal: the memory tier's restore across hosts; the same on every rank): each rank's
        ``path`` is its own copy of one checkpoint, which may lack data files; what a rank's copy lacks is read
        by a rank whose copy has it and sent over the group (a collective load whatever ``shared_loads`` says;
        docs/protocol.md, "Loading")."""
        shared = self._shared_loads or (own_copies and self._comm.size > 1)
        try:
            path = self._load_path(path, step)
        except CheckpointError as e:
            if not shared:
                raise
            shared_manifest(self._comm, "", lambda head: state, self.options.storage_options, error=e,
                            own_copies=own_copies)
            raise  # (on rank 0, shared_manifest raised it on every rank)
        if training is not None:
            return load_training(training, path, rank=self.rank, world_size=self.world_size, verify=verify,
                                 per_rank=per_rank, storage_options=self.options.storage_options,
                                 timeout=self.options.timeout, comm=self._comm if shared else None,
                                 read_once=self.options.read_once, own_copies=own_copies)
        manifest = files = None
        if shared:  # rank 0 reads the manifest, each rank gets its share
            manifest, _, files = shared_manifest(self._comm, path, lambda head: state,
                                                 self.options.storage_options, read_once=self.options.read_once,
                                                 verify=verify, timeout=self.options.timeout, own_copies=own_copies)
        return load_state(state, path, strict=strict, rank=self._comm.rank, world_size=self._comm.size,
                          verify=verify, per_rank=per_rank, manifest=manifest, files=files,
                          storage_options=self.options.storage_options, timeout=self.options.timeout)

    @property
    def _shared_loads(self) -> bool:
        """Whether loads are collective (:mod:`nostall.loading.collective`)."""
        return self.options.shared_loads and self._comm.size > 1

    def _load_path(self, path: Any, step: Optional[int]) -> str:
        """The checkpoint a load reads: ``path`` (a checkpoint, or a run root's ``step`` or latest), or this
        manager's ``step`` or latest."""
        if path is not None:
            found, name, _ = resolve(os.fspath(path), step, storage_options=self.options.storage_options)
            return found.path(name)
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}")
        elif step not in self.steps():  # (refuses a symlinked step_<N>)
            raise CheckpointNotFoundError(f"{self.path_for(step)} is not a committed checkpoint: no "
                                          f"checkpoint of step {step} (committed steps: {self.steps()})")
        return self.path_for(step)

    # ------------------------------------------------------------------ lifetime
    def close(self, timeout: Optional[float] = None) -> None:
        """Finalize pending saves, wait for commit callbacks, stop the writer and release resources. Idempotent.

        Raises the error of a failed pending save (after releasing everything).
        A pending save that a finalize already waited the full bound for
        (its outcome never came: the committing rank's host died, say) is
        not waited for again, and its writer is stopped at once.

        Commit callbacks (``on_commit``, ``SaveHandle.add_done_callback``)
        still running, in a handle's watcher thread or elsewhere, are waited
        for, with the manager's lock released: a callback may call the
        manager meanwhile (``save``, ``load``, ``finalize_pending_saves``),
        and close() finalizes the saves such calls start, and waits for their
        callbacks in turn. ``timeout`` (default: the manager's) bounds these
        waits, from the call; the first finalize is bounded as
        ``finalize_pending_saves(timeout)`` is. A callback still running then
        is logged as an error (naming its save's step and itself) and no
        longer waited for. Once close() stops waiting, every call raises
        :class:`~nostall.CheckpointError` at once ("is closed"), a late
        callback's included. A close() while another runs (from a callback,
        say) returns at once.

        Once the preemption signal came (:attr:`preempted`), ``timeout`` is
        at most what is left of ``grace_s``: a save not committed by then is
        given up (its writer stopped; the previous checkpoint stays latest).
        A signal that comes during close() takes effect once it returned.
        """
        with self._shielded():
            with self._lock:
                if self._closed or self._closing:
                    return
                self._closing = True
            self._note_preemption()
            left = self._grace_left()
            if left is not None:
                timeout = left if timeout is None else min(timeout, left)
            failure: Optional[BaseException] = None
            try:
                failure = self._close_wait(timeout)
            finally:
                with self._lock:
                    self._release()
            if left is not None and failure is None:
                log.info("rank %d: preempted: every save of this manager is settled, %.1fs before the end of the "
                         "grace period", self.rank, self._grace_left() or 0.0)
            if failure is not None:
                raise failure

    def _close_wait(self, timeout: Optional[float]) -> Optional[BaseException]:
        """close(), phase 1: finalize, and wait (lock released) for the commit callbacks still running,
        finalizing the saves they start, until none runs or the bound is spent; marks the manager closed.
        Returns the first failure of a save it finalized (close raises it once everything is released)."""
        deadline = time.monotonic() + (self.options.timeout if timeout is None else timeout)
        failure: Optional[BaseException] = None
        first, gave_up = True, False
        while True:
            with self._lock:
                if first:
                    spent = self._pending is not None and self._pending[0] is self._waited_out
                    wait = 0.0 if spent else (None if timeout is None else max(0.0, deadline - time.monotonic()))
                    first = False
                else:  # saves the callbacks started
                    wait = max(0.0, deadline - time.monotonic())
                try:
                    self._finalize(wait, flush=True)
                except Exception as e:
                    failure = failure or e
                busy = [h for h in self._handles if not h._callbacks_quiet()]
                if gave_up or self._pending is not None or not busy:
                    self._closed = True  # every call fails at once from here on; released by _release
                    return failure
            # Outside the lock: a callback may call the manager. Only waits (the handles' watchers run them).
            late = []
            for h in busy:
                names = h._wait_callbacks(deadline)
                if names:
                    late.append((h, names))
            for h, names in late:
                log.error("rank %d: close(): the commit callback %s of the save of step %s still runs after "
                          "%.0fs: no longer waited for (the manager is closed under it; at exit it is cut "
                          "off). Make the callback return sooner, or close with a longer timeout", self.rank,
                          ", ".join(names), h.step, self.options.timeout if timeout is None else timeout)
            gave_up = bool(late)

    def _release(self) -> None:
        """close(), phase 2 (lock held, whatever phase 1 did): detach hooks and handlers, stop the writer,
        release the root's claim and the group."""
        self._closed = True
        self._pending = None
        self._exports.close(1.0)  # one still running here ran past close()'s bound: cancelled
        self._handles = []
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._attached = weakref.WeakSet()
        atexit.unregister(self._at_exit)
        self._uninstall_preemption()
        if self._writer is not None:
            # A job still in flight here timed out above (e.g. rank 0's host died, so its outcome
            # never comes): the writer would answer "stop" only after its own bounded waits. It is
            # killed at once instead (a crash at any point is safe), so close() stays within its bound.
            self._writer.close(timeout=1.0 if self._writer.job is not None else 10.0)
        if self._tiers is not None:
            # After the writer: it may have been writing into the memory root. Released only on a clean close: a
            # trainer ending with an exception keeps its snapshots for a restart (the holder's idle bound).
            self._tiers.close(release=self._clean_exit)
        if self._claim is not None:
            self._claim.release()
        self._comm.close()

    def _uninstall_preemption(self) -> None:
        """close(): the handler goes inactive (it only forwards from now on), and the handler it replaced is
        put back when it is still the signal's (in the main thread; otherwise it stays, inactive)."""
        handler = self._preemption
        if handler is None:
            return
        handler.deactivate()
        signum, previous = handler.signum, handler.previous
        while isinstance(previous, _Preemption) and not previous.active:  # a closed manager's: skipped over
            previous = previous.previous
        if signal.getsignal(signum) is handler:
            try:
                signal.signal(signum, previous)
            except ValueError:  # not the main thread: left in place, forwarding only
                pass

    def _close_at_exit(self) -> None:
        if getattr(sys, "last_value", None) is not None:  # the program ends with an uncaught exception
            self._clean_exit = False
        try:
            self.close()
        except Exception as e:
            log.error("rank %d: while closing the checkpoint manager at exit: %s", self.rank, e)
        except SystemExit:  # a preemption signal during this close: the process is exiting already
            pass

    def _check_open(self, writing: bool = False) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager({self.root!r}) is closed")
        if writing and self.read_only:
            raise CheckpointError(f"CheckpointManager({self.root!r}) is read-only: it cannot save")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is SystemExit and self.preempted:
            # The preemption's exit unwinds through here: a save given up within the grace period is logged,
            # and the exit goes on (an error raised here would replace it).
            try:
                self.close()
            except CheckpointError as e:
                log.error("rank %d: preempted: %s", self.rank, e)
            return
        if exc_type is not None and not (exc_type is SystemExit and getattr(exc, "code", 1) in (0, None)):
            self._clean_exit = False  # an exception unwinds through the manager: the memory tier is kept
        self.close()

    def __repr__(self) -> str:
        mode = "async" if self.options.async_save else "sync"
        return (f"CheckpointManager({self.root!r}, rank={self.rank}/{self.world_size}, {mode}, "
                f"keep_last={self.options.keep_last})")
