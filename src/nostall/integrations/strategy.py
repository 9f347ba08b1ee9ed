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

The optimizer's per-parameter state is sharded like its parameter and keyed
by the parameter's name, so a checkpoint loads into another TP/DP layout;
hyper-parameters, the scheduler and ``extra`` are JSON; RNG states are
per-rank values.
"""

from __future__ import annotations

import logging
import os
import random
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ..api import load as _load_path
from ..errors import CheckpointError, CheckpointLoadError, InvalidStateError
from ..handles import SaveHandle
from ..manager import CheckpointManager
from ..options import Options
from ..roots import open_root, resolve
from ..model import PerRank, ShardedTensor, escape_component, is_dtensor

log = logging.getLogger("nostall")

__all__ = [
    "ParallelLayout",
    "Strategy",
    "LoadedCheckpoint",
    "mark_tensor_parallel",
    "model_state",
    "optimizer_state",
    "init_optimizer_state",
]


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's coordinates in a tensor-parallel x data-parallel layout.

    ``replica_id`` of a TP piece is ``dp_rank``: DP rank 0 of each TP slice
    writes it, unless the planner balances it onto another replica.
    """

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            r, n = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if n < 1 or not 0 <= r < n:
                raise ValueError(f"ParallelLayout: {name}_rank={r} is not in [0, {name}_size={n})")

    def as_dict(self) -> Dict[str, int]:
        return {"tp_size": self.tp_size, "dp_size": self.dp_size}


def _world_size(process_group: Any) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(process_group)
    return 1


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :meth:`Strategy.load_checkpoint` restored besides the tensors."""

    step: int
    path: str
    extra: Any = None
    saved_layout: Dict[str, int] = field(default_factory=dict)
    rng_restored: bool = False


def mark_tensor_parallel(param: torch.Tensor, dim: int) -> torch.Tensor:
    """Mark ``param`` as this rank's slice, along ``dim``, of a TP-split weight.

    Uses Megatron-core's attribute names (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``). Returns ``param``.
    """
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]
    return param


def _tp_dim(t: torch.Tensor, name: str) -> Optional[int]:
    if not getattr(t, "tensor_model_parallel", False):
        return None
    dim = int(getattr(t, "partition_dim", -1))
    if not 0 <= dim < t.dim():
        raise InvalidStateError(f"parameter {name!r}: partition_dim={dim} is not a dimension of shape {tuple(t.shape)}")
    if int(getattr(t, "partition_stride", 1)) != 1:
        raise InvalidStateError(f"parameter {name!r}: strided TP partitions (partition_stride != 1) are not supported")
    return dim


def _shard(t: torch.Tensor, dim: Optional[int], layout: ParallelLayout) -> Any:
    """The nostall leaf for a local tensor ``t`` sharded along ``dim`` (None: TP-replicated)."""
    data = t.detach()
    if dim is None:
        # replicated over TP and DP: a plain tensor; one copy is written
        return data
    gshape = list(data.shape)
    gshape[dim] *= layout.tp_size
    offset = [0] * data.dim()
    offset[dim] = layout.tp_rank * data.shape[dim]
    return ShardedTensor(data, tuple(gshape), tuple(offset), replica_id=layout.dp_rank)


def model_state(model: torch.nn.Module, layout: ParallelLayout) -> Dict[str, Any]:
    """The model's parameters and persistent buffers as nostall leaves, keyed like ``state_dict()``."""
    out: Dict[str, Any] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            raise InvalidStateError(f"model entry {name!r} is a {type(t).__name__}, not a tensor")
        out[name] = t if is_dtensor(t) else _shard(t, _tp_dim(t, name), layout)
    return out


def _param_names(model: torch.nn.Module) -> Dict[int, str]:
    names: Dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def _group_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> List[List[Tuple[str, torch.Tensor]]]:
    names = _param_names(model)
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        items = []
        for p in g["params"]:
            if id(p) not in names:
                raise InvalidStateError(
                    f"optimizer param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} that is not "
                    "in the model; the strategy keys optimizer state by parameter name"
                )
            items.append((names[id(p)], p))
        groups.append(items)
    return groups


def _json_hparam(v: Any, where: str) -> Any:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise InvalidStateError(f"{where}: tensor hyper-parameters must have one element")
        return v.item()
    return v


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: ParallelLayout) -> Dict[str, Any]:
    """The optimizer's state keyed by parameter name, sharded like the parameters.

    A state tensor shaped like its parameter is sharded like it; a
    one-element tensor (Adam's ``step``) is replicated; any other tensor is
    refused (override :meth:`Strategy.build_state` for such optimizers).
    Hyper-parameters are JSON, with each group's parameters listed by name.
    """
    state: Dict[str, Any] = {}
    groups: List[Dict[str, Any]] = []
    for gi, items in enumerate(_group_params(model, optimizer)):
        g = optimizer.param_groups[gi]
        entry = {k: _json_hparam(v, f"optimizer param_groups[{gi}][{k!r}]") for k, v in g.items() if k != "params"}
        entry["params"] = [n for n, _ in items]
        groups.append(entry)
        for name, p in items:
            st = optimizer.state.get(p)
            if not st:
                continue
            dim = None if is_dtensor(p) else _tp_dim(p, name)
            leaves: Dict[str, Any] = {}
            for k, v in st.items():
                where = f"optimizer state {k!r} of parameter {name!r}"
                if not isinstance(v, torch.Tensor):
                    leaves[k] = _json_hparam(v, where)
                elif is_dtensor(v) or (v.shape == p.shape and v.dim() > 0):
                    leaves[k] = v if is_dtensor(v) else _shard(v, dim, layout)
                elif v.numel() == 1:
                    leaves[k] = v.detach()
                else:
                    raise InvalidStateError(
                        f"{where} has shape {tuple(v.shape)}, unlike the parameter's {tuple(p.shape)}: "
                        "its sharding is unknown; override Strategy.build_state for this optimizer"
                    )
            state[name] = leaves
    return {"state": state, "param_groups": groups}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily-built state without changing any parameter.

    Runs one step with zero gradients and every learning rate set to 0, then
    restores the learning rates and clears the gradients. No-op when the
    state already exists. Needed before loading into a fresh optimizer.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise CheckpointError("init_optimizer_state: parameters already hold gradients; "
                              "call zero_grad(set_to_none=True) first")
    saved_lrs = []
    for g in optimizer.param_groups:
        lr = g.get("lr")
        saved_lrs.append(lr)
        if isinstance(lr, torch.Tensor):
            lr_t = lr.clone()
            lr.fill_(0.0)
            saved_lrs[-1] = lr_t
        elif lr is not None:
            g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lrs):
            if isinstance(g.get("lr"), torch.Tensor):
                g["lr"].copy_(lr)
            elif lr is not None:
                g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def _restore_param_groups(optimizer: torch.optim.Optimizer, saved: Any, current: List[List[str]], path: str) -> None:
    if not isinstance(saved, list) or len(saved) != len(optimizer.param_groups):
        n = len(saved) if isinstance(saved, list) else "no"
        raise CheckpointLoadError(
            f"{path}: the checkpoint's optimizer has {n} param groups, this optimizer {len(optimizer.param_groups)}"
        )
    for gi, (g, s, names) in enumerate(zip(optimizer.param_groups, saved, current)):
        if s.get("params") != names:
            raise CheckpointLoadError(
                f"{path}: optimizer param_groups[{gi}] holds parameters {names[:3]}... in this run but "
                f"{list(s.get('params', []))[:3]}... in the checkpoint"
            )
        for k, v in s.items():
            if k == "params":
                continue
            cur = g.get(k)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)
            elif isinstance(cur, tuple) and isinstance(v, list):
                g[k] = tuple(v)
            else:
                g[k] = v


def _rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {
        "torch": PerRank(torch.get_rng_state()),
        "python": PerRank(_py_rng_to_json(random.getstate())),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = PerRank(torch.cuda.get_rng_state())
    return state


def _py_rng_to_json(s: Any) -> Any:
    version, internal, gauss = s
    return [version, list(internal), gauss]


def _set_rng_state(restored: Mapping[str, Any]) -> None:
    torch.set_rng_state(restored["torch"])
    version, internal, gauss = restored["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in restored:
        torch.cuda.set_rng_state(restored["cuda"])


class Strategy:
    """Saves and loads a rank's model shard, optimizer, scheduler, RNG and trainer state.

    One per rank. ``save_checkpoint`` is a collective call (all ranks, same
    order); ``load_checkpoint`` and ``finalize_pending_saves`` are not.
    Checkpoints of ``ckpt_dir`` land in ``<ckpt_dir>/step_<N>``; one
    :class:`~nostall.CheckpointManager` per ``ckpt_dir`` is created on first
    save and kept (its background writer persists across saves).

    Args:
        layout: this rank's TP/DP coordinates.
        async_save: default mode of ``save_checkpoint`` (off by default).
        overlap: async saves copy the state into host memory while training
            goes on (docs/overlap.md). The optimizer passed to
            ``save_checkpoint`` is attached (its ``step()`` waits for the
            copy), and the model's buffers (BatchNorm statistics, which the
            next forward changes) are copied before ``save_checkpoint`` returns.
        keep_last: retention per ``ckpt_dir`` (None: keep all).
        process_group: ranks that checkpoint together (default: all).
        timeout: bound, in seconds, of every wait.
        errors: what a failed background save does; see CheckpointManager.
        storage_options: fsspec options for a ``ckpt_dir`` on object storage
            (``s3://bucket/run``); see docs/object-storage.md.
        local_staging_dir: object storage: this host's local scratch where
            each rank stages its files before uploading them (default: under
            the temp dir). Must be node-local; see docs/topologies.md.

    Threading: every method may be called from any thread; the managers
    serialise concurrent calls. What ``save_checkpoint`` reads (parameters,
    optimizer state) must not be modified until it returns.
    """

    def __init__(
        self,
        layout: ParallelLayout = ParallelLayout(),
        *,
        async_save: bool = False,
        overlap: bool = False,
        keep_last: Optional[int] = None,
        process_group: Any = None,
        timeout: float = 600.0,
        errors: str = "raise",
        storage_options: Optional[Dict[str, Any]] = None,
        local_staging_dir: Optional[str] = None,
    ) -> None:
        self.layout = layout
        self.options = Options(keep_last=keep_last, async_save=async_save, timeout=timeout, errors=errors,
                               storage_options=storage_options, local_staging_dir=local_staging_dir, overlap=overlap)
        self.storage_options = storage_options
        self._attached: Dict[str, "weakref.WeakSet"] = {}  # per ckpt_dir: the optimizers attached
        self.process_group = process_group
        self._managers: Dict[str, CheckpointManager] = {}

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
        """The nostall state of one checkpoint. Override to add or reshape entries."""
        layout = dict(self.layout.as_dict(), world_size=_world_size(self.process_group))
        state: Dict[str, Any] = {"model": model_state(model, self.layout), "layout": layout}
        if optimizer is not None:
            state["optimizer"] = optimizer_state(model, optimizer, self.layout)
        state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
        if rng:
            state["rng"] = _rng_state()
        state["extra"] = extra
        return state

    def _root(self, ckpt_dir: str) -> str:
        """``ckpt_dir`` as a manager names it: an absolute path, or a URL as it is (no trailing slash)."""
        return open_root(os.fspath(ckpt_dir), storage_options=self.storage_options).url

    def manager(self, ckpt_dir: str) -> CheckpointManager:
        """The manager of ``ckpt_dir``, created (collectively) on first use."""
        root = self._root(ckpt_dir)
        mgr = self._managers.get(root)
        if mgr is None:
            mgr = CheckpointManager(root, process_group=self.process_group, options=self.options)
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
    ) -> SaveHandle:
        """Save checkpoint ``step`` under ``ckpt_dir`` (collective).

        ``extra``: the trainer's JSON state (counters, data-loader position),
        identical on every rank, or containing :class:`~nostall.PerRank`
        values where it differs. Waits for this strategy's previous save of
        ``ckpt_dir`` first. Async saves return once staged; the handle
        completes at commit.
        """
        state = self.build_state(model, optimizer, scheduler, extra)
        state["step"] = step
        mgr = self.manager(ckpt_dir)
        if not self.options.overlap:
            return mgr.save(step, state, async_save=async_save)
        attached = self._attached.setdefault(mgr.root, weakref.WeakSet())
        if optimizer is not None and optimizer not in attached:
            mgr.attach(optimizer)
            attached.add(optimizer)
        buffers = {f"model/{escape_component(n)}" for n, _ in model.named_buffers()}
        return mgr.save(step, state, async_save=async_save, stage_now=buffers.__contains__)

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
        state = self.build_state(model, optimizer, scheduler, extra)
        state["step"] = 0
        self.manager(ckpt_dir).prepare(state)

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
    ) -> LoadedCheckpoint:
        """Restore the model (and optimizer, scheduler, RNG) in place from a checkpoint.

        ``ckpt_dir`` is a run's checkpoint root (``step`` None: the latest
        committed one) or one checkpoint directory. Finalizes pending saves
        first. Tensors are filled in place, resharded when this run's layout
        differs from the saving run's; RNG states are restored only on the
        same world size (else left as they are, and ``rng_restored`` is
        False). ``extra`` is the template of the saved ``extra`` when it holds
        tensors or PerRank values (None: a JSON value, returned as saved).
        Not a collective call.
        """
        self.finalize_pending_saves()
        found_step, path = self.resolve(ckpt_dir, step)
        if optimizer is not None:
            init_optimizer_state(optimizer)
        template = self.build_state(model, optimizer, None, None, rng=load_rng)
        template["scheduler"] = None
        template["extra"] = extra
        template["step"] = None
        restored = _load_path(template, path, verify=verify, per_rank="skip", process_group=self.process_group,
                              storage_options=self.storage_options)
        rng_restored = False
        if load_rng:
            # per_rank="skip" keeps the template's (current) values on another world size
            rng_restored = restored["layout"].get("world_size") == _world_size(self.process_group)
            if rng_restored:
                _set_rng_state(restored["rng"])
            else:
                log.warning("%s: saved on another world size; RNG states are not restored", path)
        if optimizer is not None:
            names = [[n for n, _ in items] for items in _group_params(model, optimizer)]
            _restore_param_groups(optimizer, restored["optimizer"]["param_groups"], names, path)
        if scheduler is not None:
            if restored["scheduler"] is None:
                raise CheckpointLoadError(f"{path}: the checkpoint holds no scheduler state")
            scheduler.load_state_dict(restored["scheduler"])
        if found_step < 0:
            found_step = int(restored["step"])
        return LoadedCheckpoint(found_step, path, restored["extra"], dict(restored["layout"]), rng_restored)

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
        self._attached.clear()
        if first is not None:
            raise first

    def __enter__(self) -> "Strategy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
