"""Megatron-core adapter: save and load a Megatron ``sharded_state_dict`` with nostall.

A caller of ``megatron.core.dist_checkpointing`` switches with one line::

    from nostall.interop import megatron as dist_checkpointing
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)        # collective
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)

or, with a :class:`~nostall.CheckpointManager` (async saves, retention)::

    mgr.save(step, megatron.to_state(sharded_state_dict))   # collective (one small all-gather)
    megatron.load(sharded_state_dict, mgr)                  # newest step

What is mapped, and how (docs/interop.md has the details):

* ``ShardedTensor`` -> a :class:`nostall.ShardedTensor` piece of the global
  tensor (global offset, replica_id kept; the data is not copied). Axes added
  by ``prepend_axis_num`` (layers, experts) have local size 1: each index of
  them is a tensor of its own, ``<key>/<i>`` (``<key>/<i>/<j>`` for two), so a
  rank holding several layers holds one piece of each.
* ``flattened_range`` (the distributed optimizer; megatron-core <= 0.15): the
  local chunk of a regular grid, flattened, holds ``data`` at
  ``[start, stop)``. It is stored the way Megatron's own ``torch_dist`` format
  stores it: a tensor of shape ``grid + (chunk elements,)`` in which each
  rank's range is a rectangular piece. Loads with another data-parallel split
  read their ranges directly; loads with another grid (tensor parallelism) or
  without flattening rebuild each needed chunk region from the stored chunks.
* Several pieces of one tensor on one rank that are not at distinct prepended
  indices (e.g. Megatron's SwiGLU factory): every distinct box of that tensor
  is stored as its own tensor ``<key>[/<i>]/@<offsets>``; loads intersect.
* ``ShardedObject`` -> a JSON value (never a pickle): anything else is refused
  at save time, naming the object. ``LocalNonpersistentObject`` is not saved and
  comes back unwrapped. ``ShardedTensorFactory`` is built on save and its
  ``merge_fn`` applied on load.
* Other (common) values: saved from rank 0 as JSON values and tensors.

megatron-core is optional (extra ``megatron``) and imported only when needed.
"""

from __future__ import annotations

import enum
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from nostall.core.dtypes import dtype_code
from nostall.errors import CheckpointCorruptError, CheckpointError, CheckpointLoadError, InvalidStateError, describe
from nostall.manager import CheckpointManager
from nostall.core.model import ShardedTensor as NostallShardedTensor
from nostall.core.model import check_json, escape_component, numel, to_json
from nostall.interop._common import Source, join_components, nest

log = logging.getLogger("nostall.interop")

__all__ = ["save", "load", "to_state", "load_content_metadata", "META_KEY"]

META_KEY = "__megatron__"
"""Top-level JSON value of a checkpoint saved by this adapter: the layout of every tensor."""
_COMMON_KEY = "__megatron_common__"
_RESERVED = (META_KEY, _COMMON_KEY)
_FORMAT_VERSION = 1

Shape = Tuple[int, ...]


def _mapping() -> Any:
    """megatron-core's mapping module, imported on first use."""
    try:
        from megatron.core.dist_checkpointing import mapping
    except ImportError as e:
        raise CheckpointError(
            "nostall.interop.megatron needs megatron-core: pip install 'nostall[megatron]' "
            f"(import failed: {e})"
        ) from None
    return mapping


def _dist(process_group: Any) -> Tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return 0, 1


def _all_gather(obj: Any, process_group: Any) -> List[Any]:
    import torch.distributed as dist

    rank, world = _dist(process_group)
    if world == 1:
        return [obj]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, obj, group=process_group)
    return out


def _is_main(replica_id: Any) -> bool:
    if isinstance(replica_id, (tuple, list)):
        return all(int(r) == 0 for r in replica_id)
    return int(replica_id) == 0


_DROP = object()


# --------------------------------------------------------------------------- save


@dataclass
class _Piece:
    key: str
    sub: Shape  # indices along the prepended axes
    off: Shape  # box offset, in stored coordinates
    shape: Shape  # box shape
    data: torch.Tensor  # shaped like the box
    replica_id: Any
    layout: Dict[str, Any]  # shape, prepend, dtype, flat


def _tensor_piece(st: Any, where: str) -> Optional[_Piece]:
    """The stored piece of a Megatron ShardedTensor (None for an empty flattened range)."""
    if st.data is None:
        raise InvalidStateError(f"{where}: ShardedTensor {st.key!r} has no data to save")
    code = dtype_code(st.data.dtype)
    if code is None:
        raise InvalidStateError(f"{where}: ShardedTensor {st.key!r}: dtype {st.data.dtype} is not supported")
    if st.key in _RESERVED:
        raise InvalidStateError(f"{where}: ShardedTensor key {st.key!r} is reserved by nostall")
    p = int(st.prepend_axis_num)
    gshape = tuple(int(x) for x in st.global_shape)
    goff = tuple(int(x) for x in st.global_offset)
    chunk = tuple(int(x) for x in st.local_shape)
    if len(gshape) != len(goff) or len(chunk) + p != len(gshape):
        raise InvalidStateError(f"{where}: ShardedTensor {st.key!r}: inconsistent shapes {gshape}, {goff}, {chunk}")
    layout: Dict[str, Any] = {"shape": list(gshape), "prepend": p, "dtype": code, "flat": None}
    fr = st.flattened_range
    if fr is None:
        if tuple(st.data.shape) != chunk:
            raise InvalidStateError(f"{where}: ShardedTensor {st.key!r}: data shape {tuple(st.data.shape)} "
                                    f"differs from local_shape {chunk}")
        return _Piece(st.key, goff[:p], goff[p:], chunk, st.data, st.replica_id, layout)
    start, stop = int(fr.start or 0), int(fr.stop)
    if stop - start != st.data.numel() or st.data.dim() != 1:
        raise InvalidStateError(f"{where}: ShardedTensor {st.key!r}: flattened_range {start}:{stop} does not "
                                f"match its 1-D data of {st.data.numel()} elements")
    if stop == start:
        return None
    grid, cell = [], []
    for d, (g, o, c) in enumerate(zip(gshape[p:], goff[p:], chunk)):
        if c <= 0 or g % c or o % c:
            raise InvalidStateError(
                f"{where}: ShardedTensor {st.key!r} has a flattened_range but its chunk {list(chunk)} does not "
                f"divide the global shape {list(gshape[p:])} at offset {list(goff[p:])} evenly (dim {d}); "
                "flattened ranges need a regular grid"
            )
        grid.append(g // c)
        cell.append(o // c)
    layout["flat"] = {"chunk": list(chunk), "grid": grid}
    nd = len(chunk)
    return _Piece(st.key, goff[:p], tuple(cell) + (start,), (1,) * nd + (stop - start,),
                  st.data.view((1,) * nd + (stop - start,)), st.replica_id, layout)


def _stored_shape(layout: Dict[str, Any]) -> Shape:
    p = layout["prepend"]
    if layout["flat"] is None:
        return tuple(layout["shape"][p:])
    return tuple(layout["flat"]["grid"]) + (numel(layout["flat"]["chunk"]),)


def _collect(value: Any, path: Tuple[Any, ...], mp: Any, tensors: List[Tuple[str, Any]],
             objects: List[Tuple[str, Any]]) -> Any:
    """Walk a sharded state dict: collect sharded leaves, return the common (non-sharded) rest."""
    where = "/".join(str(p) for p in path) or "<root>"
    if isinstance(value, mp.ShardedTensorFactory):
        return _collect(value.build(), path, mp, tensors, objects)
    if isinstance(value, mp.ShardedTensor):
        tensors.append((where, value))
        return _DROP
    if isinstance(value, mp.ShardedObject):
        objects.append((where, value))
        return _DROP
    if isinstance(value, mp.LocalNonpersistentObject):
        return _DROP
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            r = _collect(v, path + (k,), mp, tensors, objects)
            if r is not _DROP:
                out[k] = r
        return out if out or not value else _DROP
    if isinstance(value, (list, tuple)):
        items = [_collect(v, path + (i,), mp, tensors, objects) for i, v in enumerate(value)]
        if value and all(r is _DROP for r in items):
            return _DROP
        return [None if r is _DROP else r for r in items]
    return value


def _common_skeleton(common: Any, tensors: List[torch.Tensor], path: str = "") -> Any:
    """JSON skeleton of the common state; tensors become {"__tensor__": index}."""
    if isinstance(common, torch.Tensor):
        tensors.append(common)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(common, dict):
        out = {}
        for k, v in common.items():
            if not isinstance(k, str):
                raise InvalidStateError(f"common state {path or '<root>'}: dict key {k!r} is not a str")
            out[k] = _common_skeleton(v, tensors, f"{path}/{k}")
        return out
    if isinstance(common, (list, tuple)):
        return [_common_skeleton(v, tensors, f"{path}/{i}") for i, v in enumerate(common)]
    check_json(common, f"common state {path or '<root>'}")
    return to_json(common)


@dataclass
class _Local:
    """What this rank found in its sharded state dict (see :func:`_inspect`)."""

    pieces: List[_Piece] = field(default_factory=list)
    descr: List[Tuple[str, Shape, Shape, Shape, str]] = field(default_factory=list)  # each piece, for the others
    objects: Dict[str, Any] = field(default_factory=dict)  # the main replicas of its ShardedObjects, as JSON
    skeleton: Any = None  # rank 0: the common state's JSON skeleton
    common_tensors: List[torch.Tensor] = field(default_factory=list)  # rank 0: the common state's tensors


def to_state(sharded_state_dict: Dict[str, Any], *, process_group: Any = None,
             content_metadata: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The nostall state of a Megatron sharded state dict, for ``nostall.save`` or
    ``CheckpointManager.save``. Collective (one all-gather of metadata).

    Factories are built (in place, as Megatron's own save does); tensors are
    not copied. Errors are raised on every rank, naming the rank that found them.
    """
    mp = _mapping()
    rank, world = _dist(process_group)
    err: Optional[str] = None
    local = _Local()
    try:
        _inspect(sharded_state_dict, mp, rank, content_metadata, local)
    except InvalidStateError as e:
        err = str(e)
    except Exception as e:  # must reach the other ranks too
        err = f"unexpected error while inspecting the sharded state dict: {describe(e)}"
    gathered = _all_gather((err, local.descr, local.objects), process_group)
    failed = [(r, g[0]) for r, g in enumerate(gathered) if g[0]]
    if failed:
        raise InvalidStateError("Megatron state rejected on rank(s) " + "; ".join(f"rank {r}: {m}" for r, m in failed))
    layouts, boxes, boxed, all_objects = _agree(gathered)
    state: Dict[str, Any] = nest(_nostall_leaves(local.pieces, boxed, rank))
    if rank == 0:
        meta_tensors = {}
        for key, (_, lay) in sorted(layouts.items()):
            info = json.loads(lay)
            info["boxes"] = sorted([list(s), list(o), list(sh)] for s, o, sh in boxes[key]) if key in boxed else None
            meta_tensors[key] = info
        state[META_KEY] = {
            "version": _FORMAT_VERSION,
            "tensors": meta_tensors,
            "objects": dict(sorted(all_objects.items())),
            "common": local.skeleton,
            "content_metadata": to_json(content_metadata) if content_metadata is not None else None,
        }
        if local.common_tensors:
            state[_COMMON_KEY] = {str(i): t for i, t in enumerate(local.common_tensors)}
    return state


def _inspect(sharded_state_dict: Dict[str, Any], mp: Any, rank: int, content_metadata: Optional[Dict[str, Any]],
             local: _Local) -> None:
    """Walk this rank's sharded state dict into ``local``: its tensor pieces, their descriptions,
    the main replicas of its objects (JSON) and, on rank 0, the common state. Raises
    :class:`~nostall.InvalidStateError` for what cannot be saved (what was found so far stays in ``local``)."""
    st_leaves: List[Tuple[str, Any]] = []
    obj_leaves: List[Tuple[str, Any]] = []
    common = _collect(sharded_state_dict, (), mp, st_leaves, obj_leaves)
    for where, st in st_leaves:
        piece = _tensor_piece(st, where)
        if piece is not None:
            local.pieces.append(piece)
            local.descr.append((piece.key, piece.sub, piece.off, piece.shape,
                                json.dumps(piece.layout, sort_keys=True)))
    for where, ob in obj_leaves:
        if not _is_main(ob.replica_id):
            continue
        try:
            check_json(ob.data, ob.unique_key)
        except InvalidStateError as e:
            raise InvalidStateError(f"{where}: ShardedObject {ob.unique_key!r} holds a value that is not JSON "
                                    f"(nostall never pickles): {e}") from None
        local.objects[ob.unique_key] = to_json(ob.data)
    if rank == 0:
        local.skeleton = _common_skeleton(common if common is not _DROP else {}, local.common_tensors)
        if content_metadata is not None:
            check_json(content_metadata, "content_metadata")


def _agree(gathered: List[Any]) -> Tuple[Dict[str, Tuple[int, str]], Dict[str, set], set, Dict[str, Any]]:
    """From every rank's descriptions: each tensor's layout (the first rank's; another rank describing it
    otherwise is refused), every box of it, the tensors some rank holds several boxes of at one index
    (stored box by box), and every rank's objects."""
    layouts: Dict[str, Tuple[int, str]] = {}
    boxes: Dict[str, set] = {}
    boxed: set = set()
    all_objects: Dict[str, Any] = {}
    for r, (_, d, objs) in enumerate(gathered):
        per_rank_boxes: Dict[Tuple[str, Shape], set] = {}
        for key, sub, off, shape, lay in d:
            seen = layouts.setdefault(key, (r, lay))
            if seen[1] != lay:
                raise InvalidStateError(
                    f"ShardedTensor {key!r}: rank {seen[0]} describes it as {seen[1]}, rank {r} as {lay}")
            boxes.setdefault(key, set()).add((tuple(sub), tuple(off), tuple(shape)))
            per_rank_boxes.setdefault((key, tuple(sub)), set()).add((tuple(off), tuple(shape)))
        for (key, _), b in per_rank_boxes.items():
            if len(b) > 1:
                boxed.add(key)
        all_objects.update(objs)
    return layouts, boxes, boxed, all_objects


def _nostall_leaves(pieces: Sequence[_Piece], boxed: set, rank: int) -> Dict[str, NostallShardedTensor]:
    """This rank's pieces as nostall ShardedTensors, by nostall key (see the module docstring)."""
    leaves: Dict[str, NostallShardedTensor] = {}
    for pc in pieces:
        comps: List[Any] = [pc.key] + [str(i) for i in pc.sub]
        if pc.key in boxed:
            comps.append("@" + ",".join(str(o) for o in pc.off))
            gshape, goff = pc.shape, (0,) * len(pc.shape)
        else:
            gshape, goff = _stored_shape(pc.layout), pc.off
        nkey = join_components(comps)
        leaf = NostallShardedTensor(pc.data, gshape, goff, pc.replica_id)
        if nkey in leaves:  # the same box twice on this rank: keep one, the main copy if any
            if leaf.is_main_replica and leaves[nkey].is_main_replica:
                raise InvalidStateError(f"ShardedTensor {pc.key!r}: rank {rank} holds the piece at "
                                        f"{list(pc.off)} twice with a main replica_id")
            if not leaf.is_main_replica:
                continue
        leaves[nkey] = leaf
    return leaves


def _is_manager(target: Any) -> bool:
    return isinstance(target, CheckpointManager)


def save(sharded_state_dict: Dict[str, Any], checkpoint_dir: Any, sharded_strategy: Any = None,
         common_strategy: Any = None, validate_access_integrity: bool = True, async_sharded_save: bool = False,
         preprocess_common_before_consistancy_check: Any = None, content_metadata: Optional[Dict[str, Any]] = None,
         *, step: Optional[int] = None, process_group: Any = None) -> Any:
    """Save a Megatron sharded state dict (collective), like ``dist_checkpointing.save``.

    ``checkpoint_dir`` is a directory, or a :class:`~nostall.CheckpointManager`
    (then ``step`` is required, and the manager's async mode applies; the
    manager's handle is returned). Megatron's strategy arguments have no
    meaning here and must be left at their defaults; the sharding is always
    validated (every piece stored once, the pieces tiling each tensor).
    Returns the save's :class:`~nostall.SaveStats` (or the manager's handle).
    """
    if sharded_strategy is not None or common_strategy is not None:
        raise ValueError("nostall is the checkpoint strategy: leave sharded_strategy and common_strategy as None")
    if preprocess_common_before_consistancy_check is not None:
        raise ValueError("preprocess_common_before_consistancy_check is not supported; common values are saved "
                         "from rank 0")
    if _is_manager(checkpoint_dir):
        if step is None:
            raise ValueError("saving through a CheckpointManager needs step=")
        return checkpoint_dir.save(step, to_state(sharded_state_dict, process_group=process_group,
                                                  content_metadata=content_metadata))
    if async_sharded_save:
        raise ValueError("async_sharded_save: save through a CheckpointManager(async_save=True) instead")
    from nostall.api import save as nostall_save

    state = to_state(sharded_state_dict, process_group=process_group, content_metadata=content_metadata)
    return nostall_save(state, os.fspath(checkpoint_dir), process_group=process_group)


# --------------------------------------------------------------------------- load


def _resolve(checkpoint_dir: Any, step: Optional[int]) -> str:
    if _is_manager(checkpoint_dir):
        mgr = checkpoint_dir
        mgr.finalize_pending_saves()
        s = step if step is not None else mgr.latest_step()
        if s is None:
            from nostall.errors import CheckpointNotFoundError

            raise CheckpointNotFoundError(f"no committed checkpoint under {mgr.root}")
        return mgr.path_for(s)
    return os.fspath(checkpoint_dir)


def _like(template: Any, value: Any) -> Any:
    """``value`` (decoded JSON) shaped like ``template``: tuples where it has tuples."""
    if isinstance(template, tuple) and isinstance(value, list) and len(template) == len(value):
        return type(template)(_like(t, v) for t, v in zip(template, value)) if not hasattr(template, "_fields") \
            else type(template)(*(_like(t, v) for t, v in zip(template, value)))
    if isinstance(template, list) and isinstance(value, list) and len(template) == len(value):
        return [_like(t, v) for t, v in zip(template, value)]
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: _like(template.get(k), v) for k, v in value.items()}
    return value


def _merge(base: Any, extra: Any) -> Any:
    """``extra`` merged into ``base`` (dicts key by key, lists item by item; ``extra`` wins)."""
    if isinstance(base, dict) and isinstance(extra, dict):
        out = dict(base)
        for k, v in extra.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    if isinstance(base, list) and isinstance(extra, list) and len(base) == len(extra):
        return [b if e is _DROP else _merge(b, e) for b, e in zip(base, extra)]
    return extra


def _strip_drops(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _strip_drops(x) for k, x in v.items() if x is not _DROP}
    if isinstance(v, list):
        return [None if x is _DROP else _strip_drops(x) for x in v]
    return v


def _unsqueeze(t: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        t = t.unsqueeze(0)
    return t


def _region(dest: torch.Tensor, rel: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    v = dest
    for d, (o, n) in enumerate(zip(rel, shape)):
        v = v.narrow(d, o, n)
    return v


class _Loader:
    def __init__(self, src: Source) -> None:
        self.src = src
        meta = src.manifest.objects.get(META_KEY)
        self.meta: Optional[Dict[str, Any]] = meta if isinstance(meta, dict) else None
        if self.meta is not None and int(self.meta.get("version", 0)) > _FORMAT_VERSION:
            raise CheckpointLoadError(f"{src.path}: Megatron layout version {self.meta['version']} is newer than "
                                      "this nostall supports")

    # ---------------------------------------------------------------- stored regions
    def _read_stored(self, key: str, sub: Shape, info: Dict[str, Any], off: Shape, dest: torch.Tensor) -> None:
        """Fill ``dest`` from the stored (possibly reformulated) tensor of ``key`` at prepended ``sub``."""
        base = [key] + [str(i) for i in sub]
        if not info.get("boxes"):
            self.src.read(join_components(base), off, dest)
            return
        shape = tuple(dest.shape)
        covered = 0
        for bsub, boff, bshape in info["boxes"]:
            if tuple(bsub) != tuple(sub):
                continue
            lo = [max(a, b) for a, b in zip(off, boff)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(off, shape, boff, bshape)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            inter = [h - l for l, h in zip(lo, hi)]
            nkey = join_components(base + ["@" + ",".join(str(o) for o in boff)])
            self.src.read(nkey, [l - b for l, b in zip(lo, boff)],
                          _region(dest, [l - o for l, o in zip(lo, off)], inter))
            covered += numel(inter)
        if covered != numel(shape):
            raise CheckpointCorruptError(f"{self.src.path}: the stored boxes of {key!r} do not cover the region "
                                         f"{list(off)} + {list(shape)}")

    def _read_real(self, key: str, sub: Shape, info: Optional[Dict[str, Any]], off: Shape, dest: torch.Tensor) -> None:
        """Fill ``dest`` with the region at ``off`` of the real (un-flattened) tensor ``key`` at ``sub``."""
        if numel(dest.shape) == 0:
            return
        if info is None:  # no layout: the whole global tensor under the key (e.g. imported torch_dist)
            self.src.read(escape_component(key), tuple(sub) + tuple(off), _unsqueeze(dest, len(sub)))
            return
        flat = info.get("flat")
        if flat is None:
            self._read_stored(key, sub, info, off, dest)
            return
        chunk = tuple(flat["chunk"])
        n = numel(chunk)
        shape = tuple(dest.shape)
        first = [o // c for o, c in zip(off, chunk)]
        last = [(o + s - 1) // c for o, s, c in zip(off, shape, chunk)]
        cells: List[Tuple[int, ...]] = [()]  # every stored chunk that intersects the region
        for a, b in zip(first, last):
            cells = [c + (i,) for c in cells for i in range(a, b + 1)]
        nd = len(chunk)
        for cell in cells:
            c_off = [i * c for i, c in zip(cell, chunk)]
            if tuple(c_off) == tuple(off) and chunk == shape and dest.is_contiguous():
                self._read_stored(key, sub, info, tuple(cell) + (0,), dest.view((1,) * nd + (n,)))
                continue
            tmp = torch.empty((1,) * nd + (n,), dtype=dest.dtype)
            self._read_stored(key, sub, info, tuple(cell) + (0,), tmp)
            tmp = tmp.view(chunk)
            lo = [max(a, b) for a, b in zip(off, c_off)]
            hi = [min(a + s, b + c) for a, s, b, c in zip(off, shape, c_off, chunk)]
            inter = [h - l for l, h in zip(lo, hi)]
            _region(dest, [l - o for l, o in zip(lo, off)], inter).copy_(
                _region(tmp, [l - c for l, c in zip(lo, c_off)], inter))
            del tmp

    # ---------------------------------------------------------------- leaves
    def tensor(self, st: Any) -> torch.Tensor:
        """Fill ``st.data`` (or a new tensor) from the checkpoint and return it.

        Every view and copy is made under no_grad: ``st.data`` is often a view of a
        parameter that Megatron made under no_grad (e.g. the SwiGLU factory's halves),
        and autograd forbids narrowing such a view in grad mode once its base is
        written in place.
        """
        with torch.no_grad():
            return self._tensor(st)

    def _tensor(self, st: Any) -> torch.Tensor:
        p = int(st.prepend_axis_num)
        gshape = tuple(int(x) for x in st.global_shape)
        goff = tuple(int(x) for x in st.global_offset)
        chunk = tuple(int(x) for x in st.local_shape)
        fr = st.flattened_range
        data = st.data
        if data is None:
            data = torch.empty(chunk if fr is None else (int(fr.stop) - int(fr.start or 0),), dtype=st.dtype)
        info: Optional[Dict[str, Any]] = None
        if self.meta is not None:
            info = self.meta["tensors"].get(st.key)
            if info is None:
                raise CheckpointLoadError(f"ShardedTensor {st.key!r}: not in the checkpoint at {self.src.path}")
        if info is not None:
            if tuple(info["shape"]) != gshape or int(info["prepend"]) != p:
                raise CheckpointLoadError(
                    f"ShardedTensor {st.key!r}: the checkpoint holds global shape {info['shape']} with "
                    f"{info['prepend']} prepended axes, the template {list(gshape)} with {p}")
        else:
            rec = self.src.manifest.tensors.get(escape_component(st.key))
            if rec is None:
                raise CheckpointLoadError(f"ShardedTensor {st.key!r}: not in the checkpoint at {self.src.path}")
            if tuple(rec.shape) != gshape:
                raise CheckpointLoadError(f"ShardedTensor {st.key!r}: the checkpoint holds global shape "
                                          f"{list(rec.shape)}, the template {list(gshape)}")
        sub, off = goff[:p], goff[p:]
        if fr is None:
            self._read_real(st.key, sub, info, off, data)
            return data
        a, b = int(fr.start or 0), int(fr.stop)
        if b <= a:
            return data
        flat = info.get("flat") if info is not None else None
        nd = len(chunk)
        if (info is not None and flat is not None and tuple(flat["chunk"]) == chunk
                and all(o % c == 0 for o, c in zip(off, chunk))):
            cell = tuple(o // c for o, c in zip(off, chunk))
            self._read_stored(st.key, sub, info, cell + (a,), data.view((1,) * nd + (b - a,)))
            return data
        # rebuild the rows of the local chunk that hold [a, b), then take the range
        if nd == 0:
            tmp = torch.empty((), dtype=data.dtype)
            self._read_real(st.key, sub, info, off, tmp)
            data.copy_(tmp.reshape(-1)[a:b])
            return data
        row = numel(chunk[1:])
        r0, r1 = a // row, -(-b // row)
        tmp = torch.empty((r1 - r0,) + chunk[1:], dtype=data.dtype)
        self._read_real(st.key, sub, info, (off[0] + r0,) + tuple(off[1:]), tmp)
        data.copy_(tmp.reshape(-1)[a - r0 * row: b - r0 * row])
        return data

    def object(self, ob: Any) -> Any:
        if self.meta is not None:
            objs = self.meta.get("objects") or {}
            if ob.unique_key not in objs:
                raise CheckpointLoadError(f"ShardedObject {ob.unique_key!r}: not in the checkpoint at {self.src.path}")
            return _like(ob.data, objs[ob.unique_key])
        # no layout record: an imported torch_dist checkpoint. Megatron stores each
        # ShardedObject under its unique key as the list of its data on the saving rank
        # (one entry per local occurrence, all the same object), imported as a JSON value.
        stored = self.src.manifest.objects.get(escape_component(ob.unique_key), _DROP)
        if stored is _DROP:
            raise CheckpointLoadError(
                f"ShardedObject {ob.unique_key!r}: not in the checkpoint at {self.src.path} (a torch_dist import "
                "keeps only JSON values: was it imported with --skip-unsupported?)")
        if not isinstance(stored, list) or not stored:
            raise CheckpointLoadError(
                f"ShardedObject {ob.unique_key!r}: the checkpoint at {self.src.path} has no Megatron layout record "
                f"and holds {type(stored).__name__} under this key, not torch_dist's list of the object's values")
        return _like(ob.data, stored[0])

    def common(self) -> Dict[str, Any]:
        skel = (self.meta or {}).get("common")
        if skel is None:
            return {}

        def build(v: Any) -> Any:
            if isinstance(v, dict):
                if set(v) == {"__tensor__"} and isinstance(v["__tensor__"], int):
                    key = join_components([_COMMON_KEY, str(v["__tensor__"])])
                    rec = self.src.record(key)
                    return self.src.read_new(key, (0,) * len(rec.shape), rec.shape)
                return {k: build(x) for k, x in v.items()}
            if isinstance(v, list):
                return [build(x) for x in v]
            return v

        out = build(skel)
        return out if isinstance(out, dict) else {}

    def value(self, v: Any, mp: Any) -> Any:
        if isinstance(v, mp.ShardedTensorFactory):
            built = self.value(v.build(), mp)
            return v.merge_fn(_strip_drops(built))
        if isinstance(v, mp.ShardedTensor):
            return self.tensor(v)
        if isinstance(v, mp.ShardedObject):
            return self.object(v)
        if isinstance(v, mp.LocalNonpersistentObject):
            return v.unwrap()
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                r = self.value(x, mp)
                if r is not _DROP:
                    out[k] = r
            return out
        if isinstance(v, (list, tuple)):
            return [self.value(x, mp) for x in v]
        return _DROP  # a plain value: comes from the checkpoint's common state, as in Megatron


def load(sharded_state_dict: Dict[str, Any], checkpoint_dir: Any, sharded_strategy: Any = None,
         common_strategy: Any = None, validate_access_integrity: bool = True, strict: Any = None, *,
         step: Optional[int] = None, verify: bool = True,
         storage_options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Load a Megatron sharded state dict, like ``dist_checkpointing.load``.

    Not collective: each rank reads the byte ranges its template needs (any
    tensor-, pipeline- or data-parallel layout), verifying checksums. Tensors
    with data are filled in place. Returns the state dict Megatron's load
    returns: the checkpoint's common values, with every sharded leaf of the
    template replaced by its loaded value (factories merged, non-persistent
    objects unwrapped).

    ``checkpoint_dir``: a checkpoint directory or URL, or a
    :class:`~nostall.CheckpointManager` (``step``, default its latest). A
    checkpoint without the adapter's layout record (e.g. a Megatron
    ``torch_dist`` checkpoint imported with ``nostall convert --from dcp``) is
    read with every tensor stored whole under its Megatron key, and every
    ``ShardedObject`` from the JSON value the import made of it (torch_dist
    stores an object as the list of its values on the saving rank).

    ``strict``: Megatron's ``StrictHandling`` (or its string value), where
    "unexpected" keys are the template's keys the checkpoint lacks and
    "missing" keys the checkpoint's the template lacks (the other way round
    from torch). Supported: None or ``ASSUME_OK_UNEXPECTED`` (Megatron's
    default) and ``RAISE_UNEXPECTED``, which behave alike here: a template
    key the checkpoint lacks is a :class:`~nostall.CheckpointLoadError`
    naming it, and checkpoint keys the template lacks are not loaded (a
    model-only load of a checkpoint that holds an optimizer is legal, as in
    Megatron). The others (logging, ignoring or returning the mismatches,
    the ``*_ALL`` checks across ranks) raise ValueError.
    """
    if sharded_strategy is not None or common_strategy is not None:
        raise ValueError("nostall is the checkpoint strategy: leave sharded_strategy and common_strategy as None")
    _check_strict(strict)
    mp = _mapping()
    path = _resolve(checkpoint_dir, step)
    with Source(path, storage_options=storage_options, verify=verify) as src:
        loader = _Loader(src)
        loaded = loader.value(sharded_state_dict, mp)
        common = loader.common()
    loaded = loaded if isinstance(loaded, dict) else {}
    return _strip_drops(_merge(common, loaded))


_STRICT_SUPPORTED = ("assume_ok_unexpected", "raise_unexpected")


def _check_strict(strict: Any) -> None:
    """Refuse a Megatron ``strict`` (a ``StrictHandling`` member or its value) that :func:`load` does not honour."""
    value = strict.value if isinstance(strict, enum.Enum) else strict
    if value is not None and value not in _STRICT_SUPPORTED:
        raise ValueError(
            f"strict={strict!r} is not supported by nostall's Megatron load: pass None, "
            "StrictHandling.ASSUME_OK_UNEXPECTED or StrictHandling.RAISE_UNEXPECTED (a template key the checkpoint "
            "lacks is an error; checkpoint keys the template lacks are not loaded)"
        )


def load_content_metadata(checkpoint_dir: Any, *, step: Optional[int] = None,
                          storage_options: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """The ``content_metadata`` given to :func:`save`, or None."""
    from nostall.loading.manifests import read_manifest

    m = read_manifest(_resolve(checkpoint_dir, step), storage_options)
    meta = m.objects.get(META_KEY)
    return meta.get("content_metadata") if isinstance(meta, dict) else None
