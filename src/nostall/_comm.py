"""Metadata collectives between ranks (never tensor data).

The library talks to other ranks only through a :class:`Comm`: a single-process
stand-in when ``torch.distributed`` is not initialised, otherwise a gloo group
of its own, so that CUDA is never needed for metadata and every collective is
bounded by the library's timeout.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, List, Optional

import torch.distributed as dist

from .errors import CheckpointError

log = logging.getLogger("nostall")


class Comm:
    """Rank, size and object collectives of one process group."""

    rank: int = 0
    size: int = 1

    def all_gather(self, obj: Any) -> List[Any]:
        return [obj]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def close(self) -> None:
        pass


class _TorchComm(Comm):
    def __init__(self, group: Any, owned: bool, timeout: float) -> None:
        self.group = group
        self.owned = owned
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:  # gloo raises RuntimeError on timeout / peer loss
            raise CheckpointError(
                f"rank {self.rank}: metadata {what} with the other {self.size - 1} rank(s) failed "
                f"(timeout {self.timeout:.0f}s): {e}"
            ) from e

    def all_gather(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.size
        self._call("all_gather", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._call("broadcast", lambda: dist.broadcast_object_list(box, src=src_global, group=self.group))
        return box[0]

    def close(self) -> None:
        if self.owned and self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception as e:  # pragma: no cover - best effort at teardown
                log.debug("destroying nostall's gloo group failed: %s", e)
            self.group = None


def make_comm(process_group: Optional[Any], timeout: float, own_group: bool) -> Comm:
    """The Comm for ``process_group`` (None: the default group, if initialised).

    With ``own_group`` (managers), a dedicated gloo group with the library's
    timeout is created -- a collective call over the group's members. Otherwise
    a gloo group is reused as it is and only non-gloo groups get a gloo twin.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise CheckpointError("process_group given but torch.distributed is not initialised")
        return Comm()
    group = process_group if process_group is not None else dist.group.WORLD
    if not own_group and dist.get_backend(group) == "gloo":
        return _TorchComm(group, owned=False, timeout=timeout)
    ranks = dist.get_process_group_ranks(group)
    td = datetime.timedelta(seconds=timeout)
    try:
        if group is dist.group.WORLD or group is None:
            sub = dist.new_group(backend="gloo", timeout=td)
        else:
            sub = dist.new_group(ranks=ranks, backend="gloo", timeout=td, use_local_synchronization=True)
    except Exception as e:  # gloo raises RuntimeError when a member is missing or gone
        raise CheckpointError(
            f"rank {dist.get_rank()}: creating the checkpoint manager's gloo group over ranks {ranks} "
            f"failed (did a rank die or not call it?): {e}"
        ) from e
    comm = _TorchComm(sub, owned=True, timeout=timeout)
    # Every member finishes connecting before anyone may use -- or destroy -- the
    # group: a rank that closes a manager right away must not break a slower
    # peer's connection set-up.
    comm._call("barrier", lambda: dist.barrier(group=sub))
    return comm
