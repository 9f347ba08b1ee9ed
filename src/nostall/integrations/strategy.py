"""Strategy: the checkpoint side of a training framework's parallel strategy.

A training stack (Megatron-style, SkyRL-style) gives each rank a *strategy*
object that owns the rank's model shard and knows its place in the parallel
layout. :class:`Strategy` is that object's checkpoint half: it turns a model,
an optimizer, an LR scheduler, the RNG states and the trainer's own counters
into a nostall state and back.

What is sharded and what is replicated is read off the parameters, with
Megatron's attribute names, so Megatron-built layers work unchanged:

* a parameter with ``tensor_model_parallel = True`` and ``partition_dim = d``
  is this rank's slice of a weight split along ``d`` over the tensor-parallel
  (TP) group (:func:`mark_tensor_parallel` sets them);
* any other parameter or buffer is replicated over the TP group;
* every TP piece is replicated over the data-parallel (DP) group.

Each piece is written once, by one of the ranks holding it. DTensor
parameters (FSDP2, DTensor TP) are saved as they are.

The state is the one ``CheckpointManager.save(step, model=..., ...)`` writes
(:mod:`nostall.training`: the same machinery, the same keys): the
optimizer's per-parameter state is sharded like its parameter and keyed by
the parameter's name, so a checkpoint loads into another TP/DP layout, and a
fresh optimizer needs no preparation; hyper-parameters, the scheduler and
``extra`` are JSON; RNG states are per-rank values.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from nostall.errors import CheckpointError
from nostall.handles import SaveHandle
from nostall.manager import CheckpointManager
from nostall.core.exports import ExportTarget
from nostall.options import NOT_GIVEN, MemoryTier, NotGiven, Options, options_from
from nostall.storage.locate import open_root, resolve
from nostall.training import LoadedCheckpoint, ParallelLayout, Training, load_training, mark_tensor_parallel

log = logging.getLogger("nostall")

__all__ = [
    "ParallelLayout",
    "Strategy",
    "LoadedCheckpoint",
    "mark_tensor_parallel",
    "model_state",
    "optimizer_state",
]


def _rank_world(process_group: Any) -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return 0, 1


def model_state(model: torch.nn.Module, layout: ParallelLayout) -> Dict[str, Any]:
    """The model's parameters and persistent buffers as nostall leaves, keyed like ``state_dict()``."""
    return Training(model, layout=layout).model_leaves()


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: ParallelLayout) -> Dict[str, Any]:
    """The optimizer's state keyed by parameter name, split like the parameters (see nostall.training)."""
    return Training(model, optimizer, layout=layout).optimizer_leaves()


class Strategy:
    """Saves and loads a rank's model shard, optimizer, scheduler, RNG and trainer state.

    One per rank. ``save_checkpoint`` is a collective call (all ranks, same
    order); ``load_checkpoint`` and ``finalize_pending_saves`` are not.
    Checkpoints of ``ckpt_dir`` land in ``<ckpt_dir>/step_<N>``; one
    :class:`~nostall.CheckpointManager` per ``ckpt_dir`` is created on first
    save and kept (its background writer persists across saves).

    Args:
        layout: this rank's TP/DP coordinates.
        process_group: ranks that checkpoint together (default: all).
        on_commit: ``fn(handle)`` once each save is committed, and only
            then (a trainer's own marker, its retention, a notification);
            see ``CheckpointManager``.
        options: every setting below as one :class:`~nostall.Options` value
            (the one a ``CheckpointManager`` takes), handed to every manager
            the strategy opens.
        keep_last, async_save, timeout, errors, block_size, storage_options,
        local_staging_dir, fallback_sync, overlap, staging_budget_bytes,
        check_replicas, max_write_rate, export, incremental, full_every, shared_loads, read_once,
        preemption_signal, grace_s, exit_on_preemption, memory_tier: the
            settings, described (with their defaults, which live only there)
            in :class:`~nostall.Options`; each may be passed as a keyword
            argument, or all of them as ``options=`` (a setting given both
            ways raises ``TypeError`` naming it). For a strategy:
            ``async_save`` is the default mode of ``save_checkpoint``;
            ``keep_last`` is retention per ``ckpt_dir``; with ``overlap``
            the optimizer passed to ``save_checkpoint`` is attached (its
            ``step()`` waits for the copy into host memory) and the model's
            buffers (BatchNorm statistics, which the next forward changes)
            are copied before ``save_checkpoint`` returns (docs/overlap.md);
            ``storage_options`` and ``local_staging_dir`` (node-local
            scratch; docs/topologies.md) serve a ``ckpt_dir`` on object
            storage (``s3://bucket/run``; docs/object-storage.md), its loads
            included.

    Threading: every method may be called from any thread; the managers
    serialise concurrent calls. What ``save_checkpoint`` reads (parameters,
    optimizer state) must not be modified until it returns.
    """

    def __init__(
        self,
        layout: Optional[ParallelLayout] = None,
        *,
        async_save: Union[bool, NotGiven] = NOT_GIVEN,
        overlap: Union[bool, NotGiven] = NOT_GIVEN,
        keep_last: Union[Optional[int], NotGiven] = NOT_GIVEN,
        process_group: Any = None,
        timeout: Union[float, NotGiven] = NOT_GIVEN,
        errors: Union[str, NotGiven] = NOT_GIVEN,
        storage_options: Union[Optional[Dict[str, Any]], NotGiven] = NOT_GIVEN,
        local_staging_dir: Union[Optional[str], NotGiven] = NOT_GIVEN,
        on_commit: Optional[Callable[[SaveHandle], Any]] = None,
        block_size: Union[int, NotGiven] = NOT_GIVEN,
        fallback_sync: Union[bool, NotGiven] = NOT_GIVEN,
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
        options: Optional[Options] = None,
    ) -> None:
        self.layout = layout if layout is not None else ParallelLayout()
        self.options = options_from(options, dict(
            keep_last=keep_last, async_save=async_save, timeout=timeout, errors=errors, block_size=block_size,
            storage_options=storage_options, local_staging_dir=local_staging_dir, fallback_sync=fallback_sync,
            overlap=overlap, staging_budget_bytes=staging_budget_bytes, check_replicas=check_replicas,
            max_write_rate=max_write_rate, export=export, incremental=incremental, full_every=full_every,
            shared_loads=shared_loads, read_once=read_once, preemption_signal=preemption_signal, grace_s=grace_s,
            exit_on_preemption=exit_on_preemption, memory_tier=memory_tier,
        ), "Strategy()")
        self.storage_options = self.options.storage_options
        self.process_group = process_group
        self._managers: Dict[str, CheckpointManager] = {}
        self.on_commit = on_commit

    # ------------------------------------------------------------------ state
    def build_state(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
        extra: Any = None,
        *,
        rng: bool = True,
    ) -> Dict[str, Any]:
        """The nostall state a checkpoint of these objects holds (what ``save_checkpoint`` writes)."""
        return self._training(model, optimizer, scheduler, extra, rng).state(_rank_world(self.process_group)[1])

    def _training(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], scheduler: Any,
                  extra: Any, rng: bool, strict: bool = True) -> Training:
        return Training(model, optimizer, scheduler, rng, extra, self.layout, strict)

    def _root(self, ckpt_dir: str) -> str:
        """``ckpt_dir`` as a manager names it: an absolute path, or a URL as it is (no trailing slash)."""
        return open_root(os.fspath(ckpt_dir), storage_options=self.storage_options).url

    def manager(self, ckpt_dir: str) -> CheckpointManager:
        """The manager of ``ckpt_dir``, created (collectively) on first use."""
        root = self._root(ckpt_dir)
        mgr = self._managers.get(root)
        if mgr is None:
            mgr = CheckpointManager(root, process_group=self.process_group, options=self.options,
                                    on_commit=self.on_commit)
            self._managers[root] = mgr
        return mgr

    # ------------------------------------------------------------------ save / load
    def save_checkpoint(
        self,
        ckpt_dir: str,
        step: int,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
        extra: Any = None,
        *,
        async_save: Optional[bool] = None,
        driver_state: Any = None,
    ) -> SaveHandle:
        """Save checkpoint ``step`` under ``ckpt_dir`` (collective).

        ``extra``: the trainer's JSON state (counters, data-loader position),
        identical on every rank, or containing :class:`~nostall.PerRank`
        values where it differs. Waits for this strategy's previous save of
        ``ckpt_dir`` first. Async saves return once staged; the handle
        completes at commit. ``driver_state`` (rank 0 only): the job
        driver's own state, committed in the same checkpoint
        (``LoadedCheckpoint.driver`` on load).
        """
        return self.manager(ckpt_dir).save(step, model=model, optimizer=optimizer, scheduler=scheduler, rng=True,
                                           extra=extra, layout=self.layout, driver=driver_state,
                                           async_save=async_save)

    def prepare_checkpoint(
        self,
        ckpt_dir: str,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
        extra: Any = None,
    ) -> None:
        """Plan the checkpoint and allocate its host memory ahead of the first save (collective).

        Optional; call it once training state exists (an optimizer's state is
        created by its first step), with the same structure later saves have.
        """
        self.manager(ckpt_dir).prepare(model=model, optimizer=optimizer, scheduler=scheduler, rng=True, extra=extra,
                                       layout=self.layout)

    def finalize_pending_saves(self, timeout: Optional[float] = None) -> None:
        """Wait until every save started by this strategy is committed, or raise its error.

        Not a collective. Call it at the end of training unconditionally (a
        save may have been requested by anything, even with periodic saving
        off); ``load_checkpoint`` and ``close`` call it too.
        """
        errors: List[BaseException] = []
        for mgr in list(self._managers.values()):
            try:
                mgr.finalize_pending_saves(timeout)
            except CheckpointError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def latest_step(self, ckpt_dir: str) -> Optional[int]:
        """The newest committed step under ``ckpt_dir`` (pending saves not counted)."""
        return open_root(self._root(ckpt_dir), storage_options=self.storage_options).latest_step()

    def resolve(self, ckpt_dir: str, step: Optional[int] = None) -> Tuple[int, str]:
        """(step, directory) of a checkpoint: ``ckpt_dir`` itself if it is one (step -1), else its
        ``step`` (None: latest)."""
        root, name, found = resolve(self._root(ckpt_dir), step, storage_options=self.storage_options)
        return (-1 if found is None else found), root.path(name)

    def load_checkpoint(
        self,
        ckpt_dir: str,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
        *,
        step: Optional[int] = None,
        extra: Any = None,
        load_rng: bool = True,
        verify: bool = True,
        strict: bool = True,
    ) -> LoadedCheckpoint:
        """Restore the model (and optimizer, scheduler, RNG) in place from a checkpoint.

        ``ckpt_dir`` is a run's checkpoint root (``step`` None: the latest
        committed one) or one checkpoint directory. Finalizes pending saves
        first. Tensors are filled in place, resharded when this run's layout
        differs from the saving run's; RNG states are restored only on the
        same world size (else left as they are, and ``rng_restored`` is
        False). ``extra`` is the template of the saved ``extra`` when it holds
        tensors or PerRank values (None: a JSON value, returned as saved).
        ``strict`` (default True): the checkpoint's entries of the objects
        given and theirs must match (see :class:`~nostall.training.Training`);
        False: the others are reported in ``missing_keys`` and
        ``unexpected_keys``. Not a collective call.
        """
        self.finalize_pending_saves()
        _, path = self.resolve(ckpt_dir, step)
        rank, world = _rank_world(self.process_group)
        # per_rank="skip": on another world size, PerRank values in extra keep the template's
        return load_training(self._training(model, optimizer, scheduler, extra, load_rng, strict), path, rank=rank,
                             world_size=world, verify=verify, per_rank="skip",
                             storage_options=self.storage_options, timeout=self.options.timeout)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Finalize pending saves and close every manager; raises a pending save's error last."""
        first: Optional[BaseException] = None
        for mgr in list(self._managers.values()):
            try:
                mgr.close()
            except CheckpointError as e:
                first = first or e
        self._managers.clear()
        if first is not None:
            raise first

    def __enter__(self) -> "Strategy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
