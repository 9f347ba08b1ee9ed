"""Ray: one actor per rank holding a Strategy, and a driver-side dispatch.

The layout of SkyRL-style stacks: a driver process owns the training loop and
a group of Ray actors, one per rank; each actor (a :class:`Worker`) holds the
rank's model shard and a :class:`~nostall.integrations.Strategy`; a
:class:`WorkerDispatch` on the driver fans every call out to all actors and
gathers the results (bounded waits). The actors form a ``torch.distributed``
gloo group among themselves, so saves stay collective and parallel.

Driver contract (what SkyRL-style trainers do): call
``dispatch.finalize_pending_saves()`` at the end of training unconditionally,
and ``dispatch.load_checkpoint`` (which finalizes first) for any load.

Needs Ray (``pip install 'nostall[ray]'``).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Dict, List, Optional, Sequence, Type

try:
    import ray
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("nostall.integrations.ray needs Ray: pip install 'nostall[ray]'") from e

from nostall.errors import CheckpointError
from nostall.integrations.strategy import LoadedCheckpoint, Strategy

__all__ = ["Worker", "WorkerDispatch"]


class Worker:
    """One rank, living in a Ray actor. Subclass it and build your model in ``__init__`` or a method.

    The default checkpoint methods save and load ``self.model``,
    ``self.optimizer`` and ``self.scheduler`` through ``self.strategy``, with
    ``extra_state()`` / ``load_extra_state()`` for the trainer's own
    counters. Override them where the worker keeps more state.
    """

    strategy: Strategy
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    # ------------------------------------------------------------------ group
    def node_address(self) -> str:
        """An address of this actor's node that the other actors can reach."""
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def init_process_group(self, master_addr: str, master_port: int, timeout_s: float = 300.0) -> int:
        """Join the actors' gloo group (collective over the actors); returns this rank."""
        import torch.distributed as dist

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return dist.get_rank()

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> Any:
        """The trainer's JSON state saved with each checkpoint (default: none)."""
        return None

    def load_extra_state(self, extra: Any) -> None:
        """Restore what :meth:`extra_state` returned."""

    def save_checkpoint(self, ckpt_dir: str, step: int, async_save: Optional[bool] = None,
                        driver_state: Any = None) -> Dict[str, Any]:
        """Save this rank's part of checkpoint ``step``; ``driver_state`` (rank 0 only): the
        driver's own state, committed in the same checkpoint (see :meth:`WorkerDispatch.save_checkpoint`)."""
        handle = self.strategy.save_checkpoint(
            ckpt_dir, step, self.model, self.optimizer, self.scheduler, self.extra_state(), async_save=async_save,
            driver_state=driver_state,
        )
        return {"rank": self.rank, "step": step, "committed": handle.done()}

    def load_checkpoint(self, ckpt_dir: str, step: Optional[int] = None) -> Optional[int]:
        loaded: LoadedCheckpoint = self.strategy.load_checkpoint(
            ckpt_dir, self.model, self.optimizer, self.scheduler, step=step
        )
        self.load_extra_state(loaded.extra)
        self.loaded_driver_state = loaded.driver
        return loaded.step

    loaded_driver_state: Any = None

    def driver_state(self) -> Any:
        """The driver state of the checkpoint this worker loaded last (None: none)."""
        return self.loaded_driver_state

    def finalize_pending_saves(self) -> None:
        self.strategy.finalize_pending_saves()

    def shutdown(self) -> None:
        """Close the strategy (finalizing) and leave the process group."""
        import torch.distributed as dist

        try:
            if getattr(self, "strategy", None) is not None:
                self.strategy.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class WorkerDispatch:
    """The driver's handle on a group of :class:`Worker` actors.

    Every call goes to all actors at once and waits (at most ``timeout``
    seconds) for all of them; results come back by rank. A failure on any
    actor raises on the driver with that actor's error.
    """

    def __init__(self, actors: Sequence[Any], timeout: float = 600.0) -> None:
        self.actors = list(actors)
        self.timeout = timeout

    @classmethod
    def start(
        cls,
        worker_cls: Type[Worker],
        world_size: int,
        *args: Any,
        num_cpus: float = 1.0,
        master_addr: Optional[str] = None,
        timeout: float = 600.0,
        **kwargs: Any,
    ) -> "WorkerDispatch":
        """Create ``world_size`` actors of ``worker_cls(rank, world_size, *args, **kwargs)``; join them in one group."""
        remote_cls = ray.remote(num_cpus=num_cpus)(worker_cls)
        actors: List[Any] = [remote_cls.remote(r, world_size, *args, **kwargs) for r in range(world_size)]
        d = cls(actors, timeout)
        try:
            d.call("free_port")  # every actor is up (scheduled and constructed)
        except CheckpointError as e:
            d.kill()
            raise CheckpointError(
                f"{world_size} {worker_cls.__name__} actors did not start within {timeout}s "
                f"(does the Ray cluster have {world_size * num_cpus:g} free CPUs?)"
            ) from e
        try:
            addr = master_addr or ray.get(actors[0].node_address.remote(), timeout=timeout)
            port = ray.get(actors[0].free_port.remote(), timeout=timeout)
            d.call("init_process_group", addr, port, min(timeout, 300.0))
        except BaseException:
            d.kill()
            raise
        return d

    def call(self, method: str, *args: Any, **kwargs: Any) -> List[Any]:
        """``method(*args, **kwargs)`` on every actor; results by rank."""
        return self._get([getattr(a, method).remote(*args, **kwargs) for a in self.actors], method)

    def _get(self, refs: List[Any], method: str) -> List[Any]:
        try:
            return ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise CheckpointError(f"workers did not finish {method!r} within {self.timeout}s") from e

    def save_checkpoint(self, ckpt_dir: str, step: int, async_save: Optional[bool] = None,
                        driver_state: Any = None) -> List[Any]:
        """Save checkpoint ``step`` on every worker. ``driver_state``: the driver's own state (its
        data-loader position, counters, the in-flight batches' bookkeeping: JSON values and small
        tensors), committed by rank 0 in the same checkpoint, so that the workers' state and the
        driver's can never disagree after a crash. :meth:`load_checkpoint` gives it back."""
        if driver_state is None:
            return self.call("save_checkpoint", ckpt_dir, step, async_save=async_save)
        refs = [a.save_checkpoint.remote(ckpt_dir, step, async_save=async_save,
                                         **({"driver_state": driver_state} if r == 0 else {}))
                for r, a in enumerate(self.actors)]
        return self._get(refs, "save_checkpoint")

    def finalize_pending_saves(self) -> None:
        self.call("finalize_pending_saves")

    def load_checkpoint(self, ckpt_dir: str, step: Optional[int] = None) -> List[Any]:
        """Finalize pending saves on every worker, then load on every worker; results by rank.
        :meth:`driver_state` then gives the loaded checkpoint's driver state."""
        self.finalize_pending_saves()
        return self.call("load_checkpoint", ckpt_dir, step)

    def driver_state(self) -> Any:
        """The driver state committed with the checkpoint the workers loaded last (None: none)."""
        return self._get([self.actors[0].driver_state.remote()], "driver_state")[0]

    def shutdown(self) -> None:
        """Finalize, close every worker, then end the actors."""
        try:
            self.call("shutdown")
        finally:
            self.kill()

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []
