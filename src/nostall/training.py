"""Training objects to a nostall state and back: the machinery of the two-call API.

``CheckpointManager.save(step, model=..., optimizer=..., scheduler=...)`` and
``CheckpointManager.load(model=..., optimizer=..., scheduler=...)`` (and
``Strategy``) go through this module. It reads the state of the training
objects at every save (nothing stale), and puts it back after a load.

The checkpoint's keys::

    model/<parameter or buffer name>          the unwrapped module's state_dict()
    optimizer/state/<parameter name>/<name>   per-parameter state, sharded like its parameter
    optimizer/param_groups                    hyper-parameters (JSON), parameters listed by name
    scheduler                                 the scheduler's state_dict() (JSON)
    rng/{torch,cuda,python,numpy}             per-rank RNG states (rng=True)
    extra                                     the caller's own state (JSON, tensors, PerRank)
    layout                                    tp_size, dp_size, world_size of the saving run

How each tensor is split is read off the tensors themselves: a DTensor (FSDP2
``fully_shard``, DTensor tensor parallelism) as it is; a parameter marked the
Megatron way (``tensor_model_parallel``, ``partition_dim``: see
:func:`mark_tensor_parallel`) is this rank's slice of a weight split over the
tensor-parallel group described by a :class:`ParallelLayout`; anything else is
replicated (and checked to be, see ``check_replicas``). An optimizer state
tensor shaped like its parameter is split like it; a one-element one (Adam's
``step``) is replicated.

A fresh optimizer (no step taken yet) needs no preparation: the templates of
its state are made from the checkpoint's manifest, shaped and split like
their parameters, and handed to ``optimizer.load_state_dict``.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from nostall.errors import CheckpointLoadError, InvalidStateError
from nostall.core.format import Manifest, TensorRecord
from nostall.core.dtypes import torch_dtype
from nostall.loading.collective import shared_manifest
from nostall.loading.manifests import read_manifest
from nostall.planning.comm import Comm
from nostall.loading.reader import KeyReport, load_state_keys
from nostall.core.model import PerRank, ShardedTensor, escape_component, is_dtensor
from nostall.saving.saver import RankZeroOnly

log = logging.getLogger("nostall")

__all__ = ["ParallelLayout", "LoadedCheckpoint", "Training", "mark_tensor_parallel", "load_training"]


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's coordinates in a tensor-parallel x data-parallel layout.

    Needed only for parameters marked the Megatron way
    (:func:`mark_tensor_parallel`); DTensors carry their own layout.
    ``replica_id`` of a TP piece is ``dp_rank``: DP rank 0 of each TP slice
    writes it, unless the planner balances it onto another replica.

    Example::

        >>> ParallelLayout(tp_rank=1, tp_size=2, dp_rank=0, dp_size=4).as_dict()
        {'tp_size': 2, 'dp_size': 4}
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


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What a load of training objects restored besides the tensors.

    ``step``: the checkpoint's step (None for a checkpoint saved without
    one); ``extra``: the saved ``extra`` (this rank's PerRank values
    unwrapped); ``rng_restored``: whether the RNG states were set (they are
    only on the world size that saved them); ``driver``: the state rank 0
    saved as ``driver`` (None: none).

    ``missing_keys`` and ``unexpected_keys``, as torch's ``load_state_dict``
    returns them, as checkpoint keys (``model/<name>``,
    ``optimizer/state/<name>/<state>``): entries of the objects given that
    the checkpoint lacks (they keep their values), and checkpoint entries of
    the objects given that those objects lack (not loaded). Empty after a
    strict load, which refuses both; filled only by ``strict=False``.

    ``bytes_read``: data-file bytes this rank read from storage;
    ``bytes_received``: those another rank read once for it and sent
    (``Options.read_once``).
    """

    step: Optional[int]
    path: str
    extra: Any = None
    saved_layout: Dict[str, int] = field(default_factory=dict)
    rng_restored: bool = False
    driver: Any = None
    missing_keys: List[str] = field(default_factory=list)
    unexpected_keys: List[str] = field(default_factory=list)
    bytes_read: int = 0
    bytes_received: int = 0


def mark_tensor_parallel(param: torch.Tensor, dim: int) -> torch.Tensor:
    """Mark ``param`` as this rank's slice, along ``dim``, of a TP-split weight.

    Uses Megatron-core's attribute names (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``). Returns ``param``.
    """
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]
    return param


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP and ``torch.compile`` wrappers, whose names a checkpoint uses."""
    from torch.nn.parallel import DistributedDataParallel

    wrappers: Tuple[type, ...] = (DistributedDataParallel,)
    try:
        from torch._dynamo.eval_frame import OptimizedModule

        wrappers += (OptimizedModule,)
    except ImportError:  # pragma: no cover - torch without dynamo
        pass
    while isinstance(model, wrappers):
        inner = model._orig_mod if isinstance(model, wrappers[1:]) else model.module
        model = inner  # type: ignore[assignment]
    if not isinstance(model, torch.nn.Module):
        raise InvalidStateError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


# --------------------------------------------------------------------------- sharding of one tensor


def _tp_dim(t: torch.Tensor, name: str) -> Optional[int]:
    if not getattr(t, "tensor_model_parallel", False):
        return None
    dim = int(getattr(t, "partition_dim", -1))
    if not 0 <= dim < t.dim():
        raise InvalidStateError(f"parameter {name!r}: partition_dim={dim} is not a dimension of shape {tuple(t.shape)}")
    if int(getattr(t, "partition_stride", 1)) != 1:
        raise InvalidStateError(f"parameter {name!r}: strided TP partitions (partition_stride != 1) are not supported")
    return dim


@dataclass(frozen=True)
class _Split:
    """How one parameter is split on this rank: DTensor, a TP slice along ``dim``, or replicated."""

    name: str
    dim: Optional[int]  # TP dimension (Megatron attributes), else None
    layout: ParallelLayout

    def global_shape(self, t: torch.Tensor) -> Tuple[int, ...]:
        shape = list(t.shape)
        if self.dim is not None and not is_dtensor(t):
            shape[self.dim] *= self.layout.tp_size
        return tuple(shape)

    def leaf(self, t: torch.Tensor) -> Any:
        """The nostall leaf of a tensor split like the parameter (the parameter itself, or its state)."""
        if is_dtensor(t):
            return t
        data = t.detach()
        if self.dim is None:
            return data
        offset = [0] * data.dim()
        offset[self.dim] = self.layout.tp_rank * data.shape[self.dim]
        return ShardedTensor(data, self.global_shape(t), tuple(offset), replica_id=self.layout.dp_rank)


def _split_of(name: str, p: torch.Tensor, layout: Optional[ParallelLayout]) -> _Split:
    dim = None if is_dtensor(p) else _tp_dim(p, name)
    if dim is not None and layout is None:
        raise InvalidStateError(
            f"parameter {name!r} is marked tensor-parallel (tensor_model_parallel=True, partition_dim={dim}) but "
            "no layout was given: pass layout=nostall.ParallelLayout(tp_rank=..., tp_size=..., dp_rank=..., "
            "dp_size=...) to save and load, or make the parameter a DTensor"
        )
    return _Split(name, dim, layout or ParallelLayout())


# --------------------------------------------------------------------------- the training objects


def _json_hparam(v: Any, where: str) -> Any:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise InvalidStateError(f"{where}: tensor hyper-parameters must have one element")
        return v.item()
    return v


def _py_rng_to_json(s: Any) -> Any:
    version, internal, gauss = s
    return [version, list(internal), gauss]


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None
    return numpy.random


@dataclass
class Training:
    """The objects of one training run that a checkpoint holds, read afresh at each save.

    Args:
        model: the module (DDP and ``torch.compile`` wrappers are looked
            through: keys are the inner module's).
        optimizer: its state is keyed by parameter name and split like the
            parameters; ``param_groups`` are restored on load.
        scheduler: anything with ``state_dict()`` / ``load_state_dict()``
            whose state is JSON (torch's LR schedulers).
        rng: save the RNG states of torch, CUDA (when initialised), Python's
            ``random`` and numpy, per rank.
        extra: the caller's own state (a state subtree: JSON values,
            tensors, ShardedTensor, DTensor, PerRank).
        layout: this rank's TP x DP coordinates, for Megatron-style parameters.
        strict: loading only (default True): the checkpoint's entries of the
            objects given and those objects' entries must match, as torch's
            ``load_state_dict(strict=True)`` wants: a model entry the
            checkpoint lacks, or a checkpoint entry under ``model/``,
            ``optimizer/``, ``scheduler`` or ``extra/`` (``extra=`` given)
            that the objects lack (a layer more, optimizer state of a
            parameter this model has not) is an error naming them. Entries of
            objects not given (loading only ``model=`` from a checkpoint with
            an optimizer) are not loaded and not an error. False: the entries
            both hold are loaded, the others reported in
            :class:`LoadedCheckpoint` (``missing_keys``, ``unexpected_keys``)
            and logged; an optimizer's param groups must still list the same
            parameters.
        driver: state that only rank 0 gives (the job driver's or
            coordinator's own: its data position, counters), saved once in
            the same commit; a load gives it back on every rank. Given on
            another rank, the save fails on every rank, naming that rank
            (rank-divergent input must not silently change what is saved).
    """

    model: Optional[torch.nn.Module] = None
    optimizer: Optional[torch.optim.Optimizer] = None
    scheduler: Any = None
    rng: bool = False
    extra: Any = None
    layout: Optional[ParallelLayout] = None
    strict: bool = True
    driver: Any = None

    def __post_init__(self) -> None:
        if self.model is not None:
            self.model = unwrap(self.model)
        if self.optimizer is not None and self.model is None:
            raise InvalidStateError("optimizer given without model: its state is keyed by the model's parameter "
                                    "names; pass model= too")
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise InvalidStateError(f"optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}")

    # ------------------------------------------------------------------ save
    def state(self, world_size: int) -> Dict[str, Any]:
        """The nostall state of the objects as they are now (``driver`` wrapped in a
        :class:`~nostall.saving.saver.RankZeroOnly`: only a :class:`~nostall.saving.saver.Saver` saves it)."""
        out: Dict[str, Any] = {}
        if self.model is not None:
            out["model"] = self.model_leaves()
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer_leaves()
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.rng:
            out["rng"] = _rng_now()
        if self.extra is not None:
            out["extra"] = self.extra
        if self.driver is not None:
            out["driver"] = RankZeroOnly(self.driver, "driver=")  # the saver refuses it from another rank
        layout = self.layout or ParallelLayout()
        out["layout"] = dict(layout.as_dict(), world_size=world_size)
        return out

    def buffer_keys(self) -> List[str]:
        """State keys of the model's buffers (what the next forward may change: BatchNorm statistics)."""
        if self.model is None:
            return []
        return [f"model/{escape_component(n)}" for n, _ in self.model.named_buffers()]

    def model_leaves(self) -> Dict[str, Any]:
        """The model's parameters and persistent buffers as nostall leaves, keyed like ``state_dict()``."""
        assert self.model is not None
        out: Dict[str, Any] = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):
                raise InvalidStateError(
                    f"model entry {name!r} is a {type(t).__name__}, not a tensor (a module's extra state?); save "
                    "it through extra= or the state-dict API"
                )
            out[name] = _split_of(name, t, self.layout).leaf(t)
        return out

    def _groups(self) -> List[List[Tuple[str, torch.Tensor]]]:
        assert self.model is not None and self.optimizer is not None
        names: Dict[int, str] = {}
        for name, p in self.model.named_parameters():
            names.setdefault(id(p), name)
        groups = []
        for gi, g in enumerate(self.optimizer.param_groups):
            items = []
            for p in g["params"]:
                if id(p) not in names:
                    raise InvalidStateError(
                        f"optimizer param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} that is not in "
                        "the model: optimizer state is keyed by parameter name; pass the model that owns it"
                    )
                items.append((names[id(p)], p))
            groups.append(items)
        return groups

    def optimizer_leaves(self) -> Dict[str, Any]:
        """The optimizer's state keyed by parameter name and split like the parameters, and its
        ``param_groups`` as JSON with each group's parameters listed by name."""
        assert self.optimizer is not None
        state: Dict[str, Any] = {}
        groups: List[Dict[str, Any]] = []
        for gi, items in enumerate(self._groups()):
            g = self.optimizer.param_groups[gi]
            entry = {k: _json_hparam(v, f"optimizer param_groups[{gi}][{k!r}]") for k, v in g.items()
                     if k != "params"}
            entry["params"] = [n for n, _ in items]
            groups.append(entry)
            for name, p in items:
                st = self.optimizer.state.get(p)
                if st:
                    state[name] = self._param_state(name, p, st)
        return {"state": state, "param_groups": groups}

    def _param_state(self, name: str, p: torch.Tensor, st: Mapping[str, Any]) -> Dict[str, Any]:
        split = _split_of(name, p, self.layout)
        sharded = is_dtensor(p) or split.dim is not None
        leaves: Dict[str, Any] = {}
        for k, v in st.items():
            where = f"optimizer state {k!r} of parameter {name!r}"
            if not isinstance(v, torch.Tensor):
                leaves[k] = _json_hparam(v, where)
            elif is_dtensor(v) or (v.shape == p.shape and v.dim() > 0):
                leaves[k] = split.leaf(v)  # split like the parameter
            elif not sharded or v.numel() == 1:
                leaves[k] = v.detach()  # a replicated parameter's state, or a scalar (Adam's step)
            else:
                raise InvalidStateError(
                    f"{where} has shape {tuple(v.shape)}, unlike the parameter's local {tuple(p.shape)}: how it is "
                    "split over the ranks is unknown; save this optimizer through the state-dict API with "
                    "ShardedTensor / PerRank leaves"
                )
        return leaves

    # ------------------------------------------------------------------ load
    def template(self, m: Manifest, rank: int, world_size: int, path: str) -> Dict[str, Any]:
        """The load template for checkpoint ``m`` (tensors to fill; None where a JSON value is restored)."""
        out: Dict[str, Any] = {}
        if self.model is not None:
            out["model"] = self.model_leaves()
        if self.optimizer is not None:
            # (an optimizer saved before its first step holds no tensor: one JSON value under "optimizer")
            if not any(k == "optimizer" or k.startswith("optimizer/") for k in list(m.tensors) + list(m.objects)):
                raise CheckpointLoadError(f"{path}: the checkpoint holds no optimizer state (it was saved without "
                                          "optimizer=); load without optimizer=, or from a checkpoint that has it")
            out["optimizer"] = {"state": self._state_template(m), "param_groups": None}
        if self.scheduler is not None:
            if m.objects.get("scheduler") is None:
                raise CheckpointLoadError(f"{path}: the checkpoint holds no scheduler state (it was saved without "
                                          "scheduler=); load without scheduler=")
            out["scheduler"] = None
        if self.rng and m.world_size == world_size and 0 <= rank < len(m.per_rank):
            mine = m.per_rank[rank]
            rng = {k: v for k, v in _rng_now().items()
                   if f"rng/{k}" in mine.tensors or f"rng/{k}" in mine.objects}
            if rng:
                out["rng"] = rng
        if self.extra is not None:
            out["extra"] = self.extra
        else:
            extra = _saved_template("extra", m, rank, world_size, path)
            if extra is not _ABSENT:
                out["extra"] = extra
        driver = _saved_template("driver", m, rank, world_size, path)
        if driver is not _ABSENT:
            out["driver"] = driver
        if "layout" in m.objects:
            out["layout"] = None
        return out

    def _state_template(self, m: Manifest) -> Dict[str, Any]:
        """Per parameter name, the tensors to load its saved optimizer state into.

        Existing state tensors of the right shape and dtype are filled in
        place; missing ones (a fresh optimizer) are made like the parameter,
        split like it, from the manifest's records.
        """
        prefix = "optimizer/state/"
        saved: Dict[str, Dict[str, Optional[TensorRecord]]] = {}
        for key, rec in m.tensors.items():
            if key.startswith(prefix):
                pname, _, sname = key[len(prefix):].partition("/")
                saved.setdefault(pname, {})[sname] = rec
        for key in m.objects:
            if key.startswith(prefix):
                pname, _, sname = key[len(prefix):].partition("/")
                saved.setdefault(pname, {})[sname] = None
        assert self.optimizer is not None
        out: Dict[str, Any] = {}
        for items in self._groups():
            for name, p in items:
                esc = escape_component(name)
                entries = saved.get(esc)
                if not entries:
                    continue
                if "" in entries:  # all of the parameter's state was JSON: one value
                    out[name] = None
                    continue
                current = self.optimizer.state.get(p) or {}
                split = _split_of(name, p, self.layout)
                leaves: Dict[str, Any] = {}
                for sname, found in entries.items():
                    # None: a JSON value, restored as saved
                    leaves[sname] = None if found is None else _state_leaf(split, p, found, current.get(sname))
                out[name] = leaves
        # the state of a parameter this model lacks is left out: the load reports it as unexpected
        return out

    def scope(self) -> List[str]:
        """The top-level checkpoint keys a strict load checks: what the given objects restore.

        Left out on purpose: the objects not given (``mgr.load(model=...)`` of a checkpoint that holds an
        optimizer loads the model alone, as ``model.load_state_dict(ckpt["model"])`` would), and ``rng``
        (restored for the generators this process has, on the saving world size only: a CUDA state saved
        by a GPU run is no error on a CPU-only load). ``extra``, ``driver`` and ``layout`` are checked,
        but their templates are built from the checkpoint unless ``extra=`` is given, so only a given
        ``extra=`` can miss one.
        """
        given = [("model", self.model), ("optimizer", self.optimizer), ("scheduler", self.scheduler)]
        return [k for k, obj in given if obj is not None] + ["extra", "driver", "layout"]

    def restore(self, restored: Mapping[str, Any], m: Manifest, path: str,
                report: Optional[KeyReport] = None) -> LoadedCheckpoint:
        """Put the loaded values back into the objects (the model's tensors are filled already)."""
        if self.optimizer is not None:
            self._load_optimizer(restored["optimizer"], path)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(restored["scheduler"])
        rng_restored = False
        if self.rng:
            if "rng" in restored:
                _set_rng(restored["rng"])
                rng_restored = True
            elif any(k.startswith("rng/") for r in m.per_rank for k in list(r.tensors) + list(r.objects)):
                log.warning("%s: saved by %d ranks, loaded by another number: RNG states are not restored",
                            path, m.world_size)
        layout = restored.get("layout")
        report = report or KeyReport()
        return LoadedCheckpoint(m.step, path, restored.get("extra"), dict(layout) if isinstance(layout, dict) else {},
                                rng_restored, restored.get("driver"), list(report.missing_keys),
                                list(report.unexpected_keys), report.bytes_read, report.bytes_received)

    def _load_optimizer(self, saved: Mapping[str, Any], path: str) -> None:
        assert self.optimizer is not None
        groups = self._groups()
        saved_groups = saved["param_groups"]
        if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
            n = len(saved_groups) if isinstance(saved_groups, list) else "no"
            raise CheckpointLoadError(f"{path}: the checkpoint's optimizer has {n} param groups, this optimizer "
                                      f"{len(groups)}")
        index: Dict[str, int] = {}
        param_groups = []
        for gi, (items, s, g) in enumerate(zip(groups, saved_groups, self.optimizer.param_groups)):
            names = [n for n, _ in items]
            if s.get("params") != names:
                raise CheckpointLoadError(
                    f"{path}: optimizer param_groups[{gi}] holds parameters {names[:3]}... in this run but "
                    f"{list(s.get('params', []))[:3]}... in the checkpoint: build the optimizer's groups as the "
                    "saving run did"
                )
            entry = {k: _like(g.get(k), v) for k, v in s.items() if k != "params"}
            entry["params"] = [index.setdefault(n, len(index)) for n in names]
            param_groups.append(entry)
        state: Dict[int, Any] = {}
        for name, values in saved["state"].items():
            state[index[name]] = {k: (v.data if isinstance(v, ShardedTensor) else v) for k, v in values.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def load_training(training: Training, path: str, *, rank: int, world_size: int, verify: bool = True,
                  per_rank: str = "error", storage_options: Optional[Dict[str, Any]] = None,
                  timeout: Optional[float] = None, comm: Optional[Comm] = None,
                  read_once: Optional[bool] = None, own_copies: bool = False) -> LoadedCheckpoint:
    """Restore ``training``'s objects from the checkpoint at ``path`` (a directory or URL); strict as
    ``training.strict`` says (see :class:`Training`). ``comm``: the group loading together (rank 0 reads
    the manifest and gives each rank its share, :mod:`nostall.loading.collective`; ``read_once`` as
    ``Options.read_once``; ``own_copies``: each rank's ``path`` is its own copy, which may lack data files)."""
    files = None
    if comm is not None and comm.size > 1:
        m, template, files = shared_manifest(comm, path,
                                             lambda head: training.template(head, rank, world_size, path),
                                             storage_options, read_once=read_once, verify=verify, timeout=timeout,
                                             own_copies=own_copies)
    else:
        m = read_manifest(path, storage_options)
        template = training.template(m, rank, world_size, path)
    restored, report = load_state_keys(template, path, strict=training.strict, scope=training.scope(), rank=rank,
                                       world_size=world_size, verify=verify, per_rank=per_rank, manifest=m,
                                       storage_options=storage_options, timeout=timeout, files=files)
    return training.restore(restored, m, path, report)


_ABSENT = object()


def _unescape(component: str) -> str:
    return component.replace("~1", "/").replace("~0", "~")


def _saved_template(top: str, m: Manifest, rank: int, world_size: int, path: str) -> Any:
    """A template for the saved ``top`` (``extra``, ``driver``) made from the manifest: everything
    under it, as saved (``_ABSENT`` when there is nothing).

    JSON values come back as saved; tensors are loaded whole (a sharded one
    assembled); this rank's PerRank values unwrapped (they are left out,
    with a warning, on another world size). Containers that held tensors or
    PerRank values come back as dicts (a list's items keyed "0", "1", ...);
    pass ``extra=`` a template to get other types.
    """
    if top in m.objects:
        return None  # one JSON value
    entries: Dict[str, Any] = {}
    for key, rec in m.tensors.items():
        if key.startswith(top + "/"):
            entries[key] = torch.empty(tuple(rec.shape), dtype=torch_dtype(rec.dtype))
    for key in m.objects:
        if key.startswith(top + "/"):
            entries[key] = None
    mine = m.per_rank[rank] if m.world_size == world_size and 0 <= rank < len(m.per_rank) else None
    skipped = False
    for r in m.per_rank:
        for key, rec in r.tensors.items():
            if key == top or key.startswith(top + "/"):
                if r is mine:
                    entries[key] = PerRank(torch.empty(tuple(rec.shape), dtype=torch_dtype(rec.dtype)))
                skipped = skipped or mine is None
        for key in r.objects:
            if key == top or key.startswith(top + "/"):
                if r is mine:
                    entries[key] = PerRank(None)
                skipped = skipped or mine is None
    if skipped:
        log.warning("%s: saved by %d ranks, loaded by %d: the PerRank values of %s are left out", path,
                    m.world_size, world_size, top)
    if top in entries:  # the whole of it was one PerRank value
        return entries[top]
    if not entries:
        return _ABSENT
    tree: Dict[str, Any] = {}
    for key, leaf in entries.items():
        parts = [_unescape(c) for c in key.split("/")[1:]]
        node = tree
        for c in parts[:-1]:
            node = node.setdefault(c, {})
        node[parts[-1]] = leaf
    return tree


def _like(current: Any, saved: Any) -> Any:
    """A saved (JSON) hyper-parameter in the type the optimizer holds it in (tuple, tensor)."""
    if isinstance(current, torch.Tensor) and not isinstance(saved, torch.Tensor):
        return torch.tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


def _state_leaf(split: _Split, p: torch.Tensor, rec: TensorRecord, current: Any) -> Any:
    """The destination of one saved optimizer state tensor of parameter ``p``."""
    dtype = torch_dtype(rec.dtype)
    like_param = tuple(rec.shape) == split.global_shape(p) and len(rec.shape) > 0
    if isinstance(current, torch.Tensor) and current.dtype == dtype and (
            (like_param and current.shape == p.shape) or (not like_param and tuple(current.shape) == tuple(rec.shape))):
        return split.leaf(current) if like_param else current  # filled in place
    if like_param:
        with torch.no_grad():
            return split.leaf(torch.empty_like(p, dtype=dtype, requires_grad=False))
    return torch.empty(tuple(rec.shape), dtype=dtype)


def _rng_now() -> Dict[str, Any]:
    state: Dict[str, Any] = {
        "torch": PerRank(torch.get_rng_state()),
        "python": PerRank(_py_rng_to_json(random.getstate())),
    }
    np_random = _numpy_random()
    if np_random is not None:
        name, keys, pos, has_gauss, cached = np_random.get_state()
        state["numpy"] = PerRank([str(name), [int(x) for x in keys], int(pos), int(has_gauss), float(cached)])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = PerRank(torch.cuda.get_rng_state())
    return state


def _set_rng(restored: Mapping[str, Any]) -> None:
    if "torch" in restored:
        torch.set_rng_state(restored["torch"])
    if "python" in restored:
        version, internal, gauss = restored["python"]
        random.setstate((version, tuple(internal), gauss))
    np_random = _numpy_random()
    if "numpy" in restored and np_random is not None:
        import numpy

        name, keys, pos, has_gauss, cached = restored["numpy"]
        np_random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))
    if "cuda" in restored and torch.cuda.is_available():
        torch.cuda.set_rng_state(restored["cuda"])
