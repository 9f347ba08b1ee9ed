"""The data model: what a caller hands to ``save`` and how it is flattened.

A state is a nested ``dict`` (dicts, lists and tuples) whose leaves are

* ``torch.Tensor`` -- replicated: every rank that holds the key holds the same
  value; it is written once;
* :class:`ShardedTensor` -- this rank's piece of a global tensor;
* ``torch.distributed.tensor.DTensor`` -- converted to a :class:`ShardedTensor`;
* JSON values (``None``, ``bool``, ``int``, ``float``, ``str`` and lists, tuples
  and string-keyed dicts of them) -- stored in the manifest;
* :class:`PerRank` -- a value (tensors and/or JSON) that differs per rank.

Containers that hold no tensor and no :class:`PerRank` are a single JSON leaf.
Every leaf has a *key*: the path of dict keys and list indices from the root,
each component escaped as in JSON Pointer (``~`` -> ``~0``, ``/`` -> ``~1``)
and joined with ``/`` (``optimizer/state/0/exp_avg``). Containers nest at most
:data:`MAX_DEPTH` levels below the root.
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from nostall.errors import InvalidStateError

__all__ = ["ShardedTensor", "PerRank"]

Shape = Tuple[int, ...]
_JSON_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class ShardedTensor:
    """This rank's piece of a global tensor (Megatron-style).

    Args:
        data: the local piece, shaped like the region it covers.
        global_shape: shape of the whole tensor.
        global_offset: index of ``data[0, 0, ...]`` in the whole tensor.
        replica_id: ``0`` (or all zeros, for a tuple) marks the main copy of a
            piece; any other value marks a replica of a piece that another rank
            also holds. Exactly one copy of every piece is written.
    """

    data: torch.Tensor
    global_shape: Sequence[int]
    global_offset: Sequence[int]
    replica_id: Union[int, Tuple[int, ...]] = 0

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor):
            raise TypeError(f"ShardedTensor.data must be a torch.Tensor, got {type(self.data).__name__}")
        gs = tuple(int(x) for x in self.global_shape)
        go = tuple(int(x) for x in self.global_offset)
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "global_offset", go)
        if len(gs) != self.data.dim() or len(go) != self.data.dim():
            raise ValueError(
                f"ShardedTensor: data has {self.data.dim()} dims but global_shape={gs} "
                f"and global_offset={go}"
            )
        for d, (o, n, g) in enumerate(zip(go, self.data.shape, gs)):
            if o < 0 or o + n > g:
                raise ValueError(
                    f"ShardedTensor: piece [{o}, {o + n}) on dim {d} lies outside global size {g}"
                )

    @property
    def is_main_replica(self) -> bool:
        rid = self.replica_id
        if isinstance(rid, tuple):
            return all(int(x) == 0 for x in rid)
        return int(rid) == 0


@dataclass
class PerRank:
    """A value that differs per rank (RNG state, data-loader position, ...).

    Every rank saves its own value; on load, each rank gets back the value saved
    by the rank with the same id. ``value`` may hold tensors and JSON values.
    """

    value: Any


# --------------------------------------------------------------------------- keys


def escape_component(comp: Union[str, int]) -> str:
    return str(comp).replace("~", "~0").replace("/", "~1")


def join_key(path: Tuple[Union[str, int], ...]) -> str:
    return "/".join(escape_component(c) for c in path)


def _component(k: Any, path: Tuple) -> Union[str, int]:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise InvalidStateError(
            f"key {join_key(path)!r}: dict keys must be str or int, got {type(k).__name__} ({k!r})"
        )
    return k


# --------------------------------------------------------------------------- leaves


def _is_tensor_like(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, ShardedTensor))


MAX_DEPTH = 100
"""Most levels a state's containers (dicts, lists, tuples) nest below its root: a leaf's key has at
most this many components. Deeper values would exhaust Python's recursion limit somewhere on the
way (flattening, the exchange between ranks, JSON), failing with a RecursionError that names
nothing; they are refused up front, naming the key."""


def _contains_special(v: Any, depth: int = 0) -> bool:
    """True when ``v`` (at ``depth`` levels below the root) holds a tensor-like or PerRank somewhere,
    or nests deeper than :data:`MAX_DEPTH` (the walk then goes down and refuses it, naming the key)."""
    if _is_tensor_like(v) or isinstance(v, PerRank):
        return True
    if isinstance(v, Mapping):
        return bool(v) and (depth >= MAX_DEPTH or any(_contains_special(x, depth + 1) for x in v.values()))
    if isinstance(v, (list, tuple)):
        return bool(v) and (depth >= MAX_DEPTH or any(_contains_special(x, depth + 1) for x in v))
    return False


def _too_deep(path: Tuple) -> InvalidStateError:
    where = join_key(path[:4]) + "/..."
    return InvalidStateError(
        f"key {join_key(path[:1])!r}: a value nested more than {MAX_DEPTH} levels deep (at {where!r}); a state's "
        f"dicts, lists and tuples may nest at most {MAX_DEPTH} levels (nostall.core.model.MAX_DEPTH): store it "
        "flatter, or as one str (json.dumps) or a tensor"
    )


MAX_INT_DIGITS = 4300
"""Longest int (in decimal digits) stored as JSON: Python's default limit on int <-> str conversion
(``sys.int_info.default_max_str_digits``), so that every Python can read the manifest back."""
_INT_LIMIT = 10**MAX_INT_DIGITS


def check_json(v: Any, key: str) -> None:
    """Raise InvalidStateError unless ``v`` is a JSON value (tuples allowed)."""
    if isinstance(v, int) and not isinstance(v, bool) and (v >= _INT_LIMIT or v <= -_INT_LIMIT):
        raise InvalidStateError(
            f"key {key!r}: an int of more than {MAX_INT_DIGITS} digits ({v.bit_length()} bits) cannot be "
            "stored as JSON (Python refuses to convert it to text and back); store it as a str (str(v), "
            "after sys.set_int_max_str_digits) or split it"
        )
    if isinstance(v, _JSON_SCALARS):
        return
    if isinstance(v, Mapping):
        for k, x in v.items():
            if not isinstance(k, str):
                raise InvalidStateError(
                    f"key {key!r}: JSON objects need str keys, found {type(k).__name__} key {k!r}"
                )
            check_json(x, f"{key}/{escape_component(k)}" if key else escape_component(k))
        return
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            check_json(x, f"{key}/{i}" if key else str(i))
        return
    raise InvalidStateError(
        f"key {key!r}: unsupported value of type {type(v).__module__}.{type(v).__qualname__}; "
        "leaves must be tensors, ShardedTensor, DTensor, PerRank or JSON values "
        "(None, bool, int, float, str, lists and str-keyed dicts of them)"
    )


def to_json(v: Any) -> Any:
    """Canonical JSON form (tuples become lists)."""
    if isinstance(v, Mapping):
        return {k: to_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_json(x) for x in v]
    return v


@dataclass
class LocalTensor:
    """One tensor leaf of this rank, in global coordinates."""

    key: str
    data: torch.Tensor
    global_shape: Shape
    global_offset: Shape
    sharded: bool  # False: a replicated plain tensor (the whole tensor)
    main: bool  # this rank holds the main copy (replica_id == 0)
    tied_to: str = ""  # key of an earlier leaf whose data is this very memory (same box): saved once, as that key


@dataclass
class FlatState:
    """A state flattened to its leaves, in the order they were visited."""

    tensors: Dict[str, LocalTensor] = field(default_factory=dict)
    objects: Dict[str, Any] = field(default_factory=dict)
    per_rank_tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    per_rank_objects: Dict[str, Any] = field(default_factory=dict)

    def _claim(self, key: str) -> None:
        if (
            key in self.tensors
            or key in self.objects
            or key in self.per_rank_tensors
            or key in self.per_rank_objects
        ):
            raise InvalidStateError(f"key {key!r} occurs twice (e.g. dict keys 0 and '0' in one dict)")


_DTENSOR: Optional[type] = None  # the DTensor class, once the user's program imported it


def _dtensor_type() -> Optional[type]:
    """The DTensor class if the user's program imported it (no import of our own:
    a state can only hold DTensors once ``torch.distributed.tensor`` is loaded). Found once, then
    kept: a module stays imported, and its class is the one its instances have."""
    global _DTENSOR
    if _DTENSOR is None:
        mod = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = getattr(mod, "DTensor", None) if mod is not None else None
    return _DTENSOR


def dtensor_box(dt: Any, key: str) -> Tuple[torch.Tensor, Shape, Shape, bool]:
    """Local tensor, global offset, global shape and main-replica flag of a DTensor.

    Under ``torch.no_grad()`` (as :func:`flatten` calls it), the local tensor is the DTensor's own
    (``to_local()`` skips autograd there); otherwise a view of it, sharing its memory.
    """
    gshape = tuple(dt.shape)  # a torch.Size: ints already
    mesh = dt.device_mesh
    try:
        try:
            known = _LAYOUTS.setdefault(mesh, {})
            found = known.get((dt.placements, gshape))
            if found is None:
                found = known[(dt.placements, gshape)] = _dtensor_layout(mesh, dt.placements, gshape)
        except TypeError:  # a mesh or placement that cannot be hashed or weakly referenced: computed each time
            found = _dtensor_layout(mesh, dt.placements, gshape)
        shape, offset, main = found
    except ValueError as e:
        raise InvalidStateError(f"key {key!r}: {e}") from None
    local = dt.to_local()
    if tuple(local.shape) != shape:
        raise InvalidStateError(
            f"key {key!r}: DTensor local shape {tuple(local.shape)} differs from the expected {shape}"
        )
    return local, offset, gshape, main


_LAYOUTS: "weakref.WeakKeyDictionary[Any, Dict[Tuple[Any, Shape], Tuple[Shape, Shape, bool]]]" = (
    weakref.WeakKeyDictionary())
"""Memo of :func:`_dtensor_layout` (a pure function of its arguments) per device mesh, held weakly: a save's
DTensors share a few layouts that do not change between saves, and a mesh (with its process groups) is never
kept alive by it."""


def _dtensor_layout(mesh: Any, placements: Tuple[Any, ...], gshape: Shape) -> Tuple[Shape, Shape, bool]:
    """This rank's local shape, global offset and main-replica flag of a DTensor laid out so; ValueError
    (the reason) when it cannot be saved."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the DTensor's device mesh")
    main = True
    for dim, p in enumerate(placements):
        if isinstance(p, Shard) or type(p).__name__ == "_StridedShard":
            continue  # _StridedShard: FSDP2 over TP on the same dim (a contiguous box per rank)
        if isinstance(p, Replicate):
            main = main and coord[dim] == 0
            continue
        raise ValueError(f"DTensor placement {p!r} is not supported (only Shard and Replicate; "
                         "reduce Partial tensors before saving)")
    shape, offset = compute_local_shape_and_global_offset(torch.Size(gshape), mesh, placements)
    return tuple(int(x) for x in shape), tuple(int(x) for x in offset), main


def _local_of(key: str, v: Any) -> Optional[LocalTensor]:
    """The LocalTensor of a ShardedTensor or DTensor leaf (its data checked), else None."""
    if isinstance(v, ShardedTensor):
        check_tensor_leaf(v.data, key)
        return LocalTensor(key, v.data, tuple(v.global_shape), tuple(v.global_offset), True, v.is_main_replica)
    dt_type = _dtensor_type()
    if dt_type is not None and isinstance(v, dt_type):
        local, offset, gshape, main = dtensor_box(v, key)
        check_tensor_leaf(local, key)
        return LocalTensor(key, local, gshape, offset, True, main)
    return None


def is_tensor_leaf(value: Any) -> bool:
    dt_type = _dtensor_type()
    return _is_tensor_like(value) or (dt_type is not None and isinstance(value, dt_type))


# --------------------------------------------------------------------------- walking

Visit = Callable[[str, str, Any], Any]
"""visit(kind, key, value) -> replacement. kind: tensor | object | per_rank."""


def walk(state: Any, visit: Visit) -> Any:
    """Walk a state, calling ``visit`` on each leaf; returns the rebuilt tree."""
    if not isinstance(state, Mapping):
        raise InvalidStateError(f"a state must be a dict at the top level, got {type(state).__name__}")
    return _walk(state, (), visit, root=True)


def walk_value(value: Any, visit: Visit) -> Any:
    """Like :func:`walk`, for any value (the root's key is ``""``)."""
    return _walk(value, (), visit)


def _walk(v: Any, path: Tuple, visit: Visit, root: bool = False, key: str = "") -> Any:
    """Walk ``v`` at ``path``; ``key`` is ``join_key(path)``, built along the way (one component a level)."""
    if len(path) > MAX_DEPTH:
        raise _too_deep(path)
    if is_tensor_leaf(v):
        return visit("tensor", key, v)
    if isinstance(v, PerRank):
        return visit("per_rank", key, v)
    if isinstance(v, Mapping) and (root or _contains_special(v, len(path))):
        out = {}
        for k, x in v.items():
            c = _component(k, path)
            out[k] = _walk(x, path + (c,), visit, False, f"{key}/{escape_component(c)}" if path
                           else escape_component(c))
        return _rebuild_mapping(v, out)
    if isinstance(v, (list, tuple)) and _contains_special(v, len(path)):
        items = [_walk(x, path + (i,), visit, False, f"{key}/{i}" if path else str(i)) for i, x in enumerate(v)]
        return type(v)(items) if isinstance(v, tuple) and not hasattr(v, "_fields") else items
    return visit("object", key, v)


def _rebuild_mapping(orig: Mapping, items: Dict) -> Any:
    if type(orig) is dict:
        return items
    cls: Any = type(orig)
    try:
        return cls(items)
    except Exception:
        return items


def check_tensor_leaf(t: torch.Tensor, key: str) -> None:
    """Raise InvalidStateError unless ``t`` holds dense data that can be saved (strided layout, not meta)."""
    if t.layout != torch.strided:
        raise InvalidStateError(
            f"key {key!r}: a tensor with layout {t.layout} cannot be saved (nostall stores dense tensors); "
            "convert it with .to_dense() first, or store its components (indices, values) as separate tensors"
        )
    if t.is_meta:
        raise InvalidStateError(
            f"key {key!r}: the tensor is on the meta device and holds no data; materialize it first "
            "(e.g. module.to_empty(device=...) and initialize it) or leave it out of the state"
        )


def _memory_identity(lt: LocalTensor) -> Optional[Tuple[Any, ...]]:
    """What makes two tensor leaves the same saved data: the exact local memory (storage, offset, shape,
    strides, dtype, device) and the same global box. None for leaves never tied (empty, or storage unknown)."""
    d = lt.data
    if d.numel() == 0:
        return None  # nothing to store; empty tensors often share a null pointer without being related
    try:
        ptr = d.untyped_storage().data_ptr()
    except Exception:  # a tensor subclass without an inspectable storage: never tied
        return None
    # d.device, not its str: equal devices print alike (and it costs a fraction)
    return (d.device, d.dtype, ptr, d.storage_offset(), tuple(d.shape), d.stride(),
            lt.global_shape, lt.global_offset, lt.sharded, lt.main)


def flatten(state: Any) -> FlatState:
    """Flatten a state into its leaves, validating leaf types.

    A tensor leaf whose local data is exactly the memory of an earlier leaf (tied weights: one
    Parameter under two state-dict keys) with the same global box is marked ``tied_to`` the first
    such key (visit order); the planner then saves it once. PerRank tensors are never tied.
    """
    flat = FlatState()
    first_of: Dict[Tuple[Any, ...], str] = {}

    def tie(lt: LocalTensor) -> LocalTensor:
        ident = _memory_identity(lt)
        if ident is not None:
            first = first_of.setdefault(ident, lt.key)
            if first != lt.key:
                lt.tied_to = first
        return lt

    def visit(kind: str, key: str, v: Any) -> Any:
        flat._claim(key)
        if kind == "tensor":
            lt = _local_of(key, v)
            if lt is None:
                t: torch.Tensor = v
                check_tensor_leaf(t, key)
                lt = LocalTensor(key, t, tuple(t.shape), (0,) * t.dim(), False, True)
            flat.tensors[key] = tie(lt)
        elif kind == "object":
            check_json(v, key)
            flat.objects[key] = to_json(v)
        else:
            _flatten_per_rank(v.value, key, flat)
        return v

    with torch.no_grad():  # inspection only: a DTensor's to_local() then skips autograd
        walk(state, visit)
    return flat


def _flatten_per_rank(value: Any, key: str, flat: FlatState) -> None:
    def visit(kind: str, k: str, v: Any) -> Any:
        full = key if not k else f"{key}/{k}"
        if kind == "tensor":
            if isinstance(v, ShardedTensor) or is_dtensor(v):
                raise InvalidStateError(f"key {full!r}: a PerRank value may hold plain tensors only, "
                                        f"not {type(v).__name__}")
            check_tensor_leaf(v, full)
            flat._claim(full)
            flat.per_rank_tensors[full] = v
        elif kind == "object":
            check_json(v, full)
            flat._claim(full)
            flat.per_rank_objects[full] = to_json(v)
        else:
            raise InvalidStateError(f"key {full!r}: PerRank may not be nested inside PerRank")
        return v

    _walk(value, (), visit)


def is_dtensor(v: Any) -> bool:
    dt_type = _dtensor_type()
    return dt_type is not None and isinstance(v, dt_type)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1
