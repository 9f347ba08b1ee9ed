"""CheckpointManager: the per-rank entry point for periodic checkpoints."""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, Deque, List, Optional

from . import commit
from ._comm import Comm, make_comm
from .errors import CheckpointError, CheckpointNotFoundError
from .format import DEFAULT_BLOCK_SIZE
from .handles import SaveHandle, SaveStats
from .loading import load_state
from .saving import Saver

log = logging.getLogger("nostall")

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Saves and loads the checkpoints of one training run under ``root``.

    Create one per rank, on every rank of ``process_group`` (creation is a
    collective call when ``torch.distributed`` is initialised: the manager makes
    a gloo group of its own for metadata, with ``timeout`` seconds per
    collective). Checkpoints land in ``<root>/step_<N>/``; ``<root>/latest``
    names the newest committed one.

    Args:
        root: directory of the run's checkpoints (created if missing).
        keep_last: keep only this many newest committed checkpoints (None: all).
        process_group: the ranks that save together (default: all ranks).
        async_save: write in a background process (not available yet).
        timeout: bound, in seconds, of every wait on other ranks.

    Thread safety: calls are serialised by an internal lock; a manager may be
    used from a thread other than the one that created it.
    """

    def __init__(
        self,
        root: str,
        *,
        keep_last: Optional[int] = None,
        process_group: Any = None,
        async_save: bool = False,
        timeout: float = 600.0,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        if async_save:
            raise NotImplementedError("async_save=True is not implemented yet; use async_save=False")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if block_size <= 0 or block_size % 8:
            raise ValueError("block_size must be a positive multiple of 8")
        self.root = os.path.abspath(os.fspath(root))
        self.keep_last = keep_last
        self.timeout = float(timeout)
        self._lock = threading.RLock()
        self._closed = False
        self._comm: Comm = make_comm(process_group, self.timeout, own_group=True)
        self._saver = Saver(self._comm, block_size)
        self._stats: Deque[SaveStats] = collections.deque(maxlen=1000)
        if self._comm.rank == 0:
            commit.check_root(self.root)
            os.makedirs(self.root, exist_ok=True)
            commit.clean_leftovers(self.root)

    # ------------------------------------------------------------------ info
    @property
    def rank(self) -> int:
        """This process's rank in the manager's group."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.size

    def path_for(self, step: int) -> str:
        """Directory of the checkpoint of ``step`` (committed or not)."""
        return commit.step_dir(self.root, step)

    def steps(self) -> List[int]:
        """Steps of the committed checkpoints, ascending."""
        return commit.committed_steps(self.root)

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def stats(self) -> List[SaveStats]:
        """Stats of this manager's successful saves, oldest first."""
        return list(self._stats)

    # ------------------------------------------------------------------ save / load
    def save(self, step: int, state: Any) -> SaveHandle:
        """Save ``state`` as checkpoint ``step``; a collective call over the group.

        Returns after the checkpoint is committed (synchronous mode). Raises
        :class:`~nostall.InvalidStateError` for a bad state and
        :class:`~nostall.CheckpointSaveError` when any rank failed; in both
        cases nothing is committed and the previous checkpoint stays latest.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        with self._lock:
            self._check_open()
            self.finalize_pending_saves()
            target = commit.StepTarget(self.root, step, self.keep_last)
            handle = SaveHandle(step, target.final)
            stats = self._saver.save(state, target, step)
            self._stats.append(stats)
            handle._set_result(stats)
            return handle

    def load(self, state: Any, step: Optional[int] = None, *, verify: bool = True, per_rank: str = "error") -> Any:
        """Fill ``state``'s tensors in place from checkpoint ``step`` (None: latest).

        Returns the restored state: the same structure, tensors filled in place,
        JSON values and this rank's PerRank values (unwrapped) as saved. The
        template may be sharded differently, or on another world size, than the
        save. Not a collective call.
        """
        with self._lock:
            self._check_open()
            self.finalize_pending_saves()
            if step is None:
                step = self.latest_step()
                if step is None:
                    raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}")
            return load_state(
                state,
                self.path_for(step),
                rank=self._comm.rank,
                world_size=self._comm.size,
                verify=verify,
                per_rank=per_rank,
            )

    def finalize_pending_saves(self, timeout: Optional[float] = None) -> None:
        """Wait until every save this rank started is committed (none can be pending
        in synchronous mode). Safe to call any number of times, on any subset of ranks."""
        return None

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Finalize pending saves and release the manager's resources. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self.finalize_pending_saves()
            finally:
                self._closed = True
                self._comm.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager({self.root!r}) is closed")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, rank={self.rank}/{self.world_size}, keep_last={self.keep_last})"
