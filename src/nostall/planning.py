"""Planning: from every rank's leaves to who writes which bytes where.

The plan is computed from metadata only (keys, dtypes, shapes, offsets), the
same way on every rank from the same gathered input, so every rank knows the
whole checkpoint layout -- files, byte ranges, owners -- before any byte is
written. Only checksums are unknown until the data is written.

Rules:
* a replicated tensor (plain ``torch.Tensor``) is one piece held by every rank
  that has the key; pieces of a sharded tensor with the same box are replicas;
* exactly one holder writes each distinct piece: pieces with one holder go to
  it, the rest are assigned largest first to the holder with the fewest bytes
  so far (deterministic);
* per-rank tensors are written by their own rank;
* a key whose every holder ties it to another key (the same memory, see
  ``model.flatten``) is written once, as that key: its pieces are the other
  key's pieces.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Sequence, Tuple

from ._boxes import box_str, cover_problem
from .errors import InvalidStateError
from ._dtypes import dtype_code
from .format import FileEntry, data_file_name, itemsize, layout_file, piece_name
from .model import FlatState, numel

Shape = Tuple[int, ...]


# --------------------------------------------------------------------------- local metadata


@dataclass(frozen=True)
class TensorMeta:
    key: str
    dtype: str
    global_shape: Shape
    offset: Shape
    shape: Shape
    sharded: bool
    main: bool
    tied_to: str = ""  # this rank's leaf is the very memory of leaf ``tied_to`` (model.flatten)


@dataclass(frozen=True)
class RankMeta:
    """What one rank holds, without data."""

    tensors: Tuple[TensorMeta, ...]
    per_rank: Tuple[Tuple[str, str, Shape], ...]  # (key, dtype, shape)

    def signature(self) -> str:
        return hashlib.sha256(repr((self.tensors, self.per_rank)).encode()).hexdigest()


def local_meta(flat: FlatState) -> RankMeta:
    tensors = []
    for t in flat.tensors.values():
        code = dtype_code(t.data.dtype)
        if code is None:
            raise InvalidStateError(f"key {t.key!r}: dtype {t.data.dtype} is not supported")
        tensors.append(
            TensorMeta(t.key, code, t.global_shape, t.global_offset, tuple(t.data.shape), t.sharded, t.main,
                       t.tied_to)
        )
    per_rank = []
    for k, v in flat.per_rank_tensors.items():
        code = dtype_code(v.dtype)
        if code is None:
            raise InvalidStateError(f"key {k!r}: dtype {v.dtype} is not supported")
        per_rank.append((k, code, tuple(v.shape)))
    return RankMeta(tuple(tensors), tuple(per_rank))


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PiecePlan:
    offset: Shape
    shape: Shape
    owner: int
    file: str
    start: int
    end: int


@dataclass(frozen=True)
class TensorPlan:
    key: str
    dtype: str
    shape: Shape
    sharded: bool
    pieces: Tuple[PiecePlan, ...]
    tied_to: str = ""  # saved once, as this key: ``pieces`` are that key's pieces


@dataclass(frozen=True)
class WriteItem:
    """One piece this rank writes: which leaf, where in which file."""

    key: str
    per_rank: bool
    offset: Shape  # global offset of the piece (selects among this rank's copies)
    file: str
    start: int
    end: int


@dataclass(frozen=True)
class FilePlan:
    name: str
    rank: int
    header: bytes
    size: int
    items: Tuple[WriteItem, ...]  # in file order


@dataclass
class SavePlan:
    world_size: int
    tensors: Dict[str, TensorPlan]
    per_rank: List[Dict[str, TensorPlan]]
    files: Dict[str, FilePlan]
    signatures: Tuple[str, ...] = ()
    _by_rank: Dict[int, List[FilePlan]] = field(default_factory=dict)

    def files_of(self, rank: int) -> List[FilePlan]:
        if not self._by_rank:
            for f in self.files.values():
                self._by_rank.setdefault(f.rank, []).append(f)
        return self._by_rank.get(rank, [])

    def file_sizes(self) -> Dict[str, int]:
        return {n: f.size for n, f in self.files.items()}


def build_plan(metas: Sequence[RankMeta]) -> SavePlan:
    """Validate every rank's metadata and assign each distinct piece to one writer."""
    world = len(metas)
    by_key: Dict[str, List[Tuple[int, TensorMeta]]] = {}
    for r, m in enumerate(metas):
        for t in m.tensors:
            by_key.setdefault(t.key, []).append((r, t))
    per_rank_keys = {k for m in metas for (k, _, _) in m.per_rank}
    clash = sorted(per_rank_keys & set(by_key))
    if clash:
        raise InvalidStateError(f"key {clash[0]!r} is a PerRank value on some ranks and a tensor on others")

    tied = _ties(by_key)
    # (key, offset, shape, dtype, holders) for every distinct piece
    pieces: List[Tuple[str, Shape, Shape, str, List[int]]] = []
    headers: Dict[str, Tuple[str, Shape, bool]] = {}
    for key in sorted(by_key):
        entries = by_key[key]
        r0, t0 = entries[0]
        for r, t in entries[1:]:
            if t.sharded != t0.sharded:
                raise InvalidStateError(
                    f"key {key!r}: rank {r0} holds a {'sharded' if t0.sharded else 'replicated'} tensor, "
                    f"rank {r} a {'sharded' if t.sharded else 'replicated'} one"
                )
            if t.dtype != t0.dtype:
                raise InvalidStateError(f"key {key!r}: dtype {t0.dtype} on rank {r0} but {t.dtype} on rank {r}")
            if t.global_shape != t0.global_shape:
                what = "global shape" if t0.sharded else "shape"
                raise InvalidStateError(
                    f"key {key!r}: {what} {list(t0.global_shape)} on rank {r0} but {list(t.global_shape)} on rank {r}"
                )
        headers[key] = (t0.dtype, t0.global_shape, t0.sharded)
        boxes: Dict[Tuple[Shape, Shape], List[Tuple[int, bool]]] = {}
        for r, t in entries:
            if t.sharded and numel(t.shape) == 0:
                continue  # an empty shard (FSDP2 with more ranks than rows): nothing to store
            boxes.setdefault((t.offset, t.shape), []).append((r, t.main))
        if t0.sharded:
            for (off, shp), held in boxes.items():
                mains = [r for r, main in held if main]
                if not mains:
                    raise InvalidStateError(
                        f"key {key!r}: piece {box_str(off, shp)} is held by rank(s) "
                        f"{[r for r, _ in held]} but none with replica_id 0"
                    )
                if len(mains) > 1:
                    raise InvalidStateError(
                        f"key {key!r}: ranks {mains} all hold piece {box_str(off, shp)} with replica_id 0; "
                        "mark all but one copy with a non-zero replica_id"
                    )
            problem = cover_problem(t0.global_shape, list(boxes))
            if problem:
                raise InvalidStateError(f"key {key!r}: {problem}")
        if key in tied:
            continue  # validated like any tensor, but stored as the key it is tied to
        for (off, shp), held in sorted(boxes.items()):
            pieces.append((key, off, shp, t0.dtype, sorted(r for r, _ in held)))

    # ---- owner assignment: fixed pieces first, then largest-first greedy
    load = [0] * world
    owner_of: Dict[Tuple[str, Shape], int] = {}
    for r, m in enumerate(metas):
        for _k, code, shape in m.per_rank:
            load[r] += numel(shape) * itemsize(code)
    flexible = []
    for idx, (key, off, shp, code, holders) in enumerate(pieces):
        nbytes = numel(shp) * itemsize(code)
        if len(holders) == 1:
            owner_of[(key, off)] = holders[0]
            load[holders[0]] += nbytes
        else:
            flexible.append((nbytes, idx))
    flexible.sort(key=lambda x: (-x[0], x[1]))
    for nbytes, idx in flexible:
        key, off, shp, code, holders = pieces[idx]
        owner = min(holders, key=lambda r: (load[r], (r - idx) % world))
        owner_of[(key, off)] = owner
        load[owner] += nbytes

    # ---- files: one per rank that writes anything
    entries_of: Dict[int, List[Tuple[FileEntry, WriteItem]]] = {}
    for key, off, shp, code, _holders in pieces:
        r = owner_of[(key, off)]
        dtype, gshape, _ = headers[key]
        e = FileEntry(piece_name(key, off, shp, gshape), code, shp, numel(shp) * itemsize(code))
        entries_of.setdefault(r, []).append((e, WriteItem(key, False, off, data_file_name(r), 0, 0)))
    for r, m in enumerate(metas):
        for k, code, shape in m.per_rank:
            e = FileEntry(k, code, shape, numel(shape) * itemsize(code))
            entries_of.setdefault(r, []).append(
                (e, WriteItem(k, True, (0,) * len(shape), data_file_name(r), 0, 0))
            )

    files: Dict[str, FilePlan] = {}
    placed: Dict[Tuple[int, str, bool, Shape], WriteItem] = {}
    for r in sorted(entries_of):
        name = data_file_name(r)
        ents = entries_of[r]
        try:
            header, where, size = layout_file(
                [e for e, _ in ents], {"format": "nostall", "rank": str(r), "world_size": str(world)}
            )
        except ValueError as err:
            raise InvalidStateError(f"rank {r}: {err}") from None
        items = []
        for e, it in ents:
            start, end = where[e.name]
            w = WriteItem(it.key, it.per_rank, it.offset, name, start, end)
            items.append(w)
            placed[(r, it.key, it.per_rank, it.offset)] = w
        items.sort(key=lambda w: w.start)
        files[name] = FilePlan(name, r, header, size, tuple(items))

    tensors: Dict[str, TensorPlan] = {}
    grouped: Dict[str, List[PiecePlan]] = {}
    for key, off, shp, _code, _holders in pieces:
        r = owner_of[(key, off)]
        w = placed[(r, key, False, off)]
        grouped.setdefault(key, []).append(PiecePlan(off, shp, r, w.file, w.start, w.end))
    for key, (dtype, gshape, sharded) in headers.items():
        a = tied.get(key, "")
        tensors[key] = TensorPlan(key, dtype, gshape, sharded, tuple(grouped.get(a or key, ())), a)
    per_rank: List[Dict[str, TensorPlan]] = []
    for r, m in enumerate(metas):
        d = {}
        for k, code, shape in m.per_rank:
            w = placed[(r, k, True, (0,) * len(shape))]
            d[k] = TensorPlan(k, code, shape, False, (PiecePlan((0,) * len(shape), shape, r, w.file, w.start, w.end),))
        per_rank.append(d)
    return SavePlan(
        world_size=world,
        tensors=tensors,
        per_rank=per_rank,
        files=files,
        signatures=tuple(m.signature() for m in metas),
    )


def _ties(by_key: Dict[str, List[Tuple[int, TensorMeta]]]) -> Dict[str, str]:
    """Keys saved as another key (tied weights): ``{B: A}``.

    B is tied to A only when every rank holding B says so, A is a tensor key no rank marks as tied,
    A and B agree in dtype, shape and sharding, and every holder of B holds A with the same box.
    Anything else (ranks disagreeing, say) leaves B an ordinary tensor. Computed from the gathered
    metadata alone, so every rank gets the same answer.
    """
    tied: Dict[str, str] = {}
    for key, entries in by_key.items():
        a = entries[0][1].tied_to
        if not a or a == key or a not in by_key or any(t.tied_to != a for _, t in entries):
            continue
        a_entries = by_key[a]
        if any(t.tied_to for _, t in a_entries):
            continue
        held = {(r, t.dtype, t.global_shape, t.offset, t.shape, t.sharded, t.main) for r, t in a_entries}
        if all((r, t.dtype, t.global_shape, t.offset, t.shape, t.sharded, t.main) in held for r, t in entries):
            tied[key] = a
    return tied


def check_objects(objects: Sequence[Dict[str, Any]], tensor_keys: Iterable[str] = ()) -> Dict[str, Any]:
    """Merge replicated JSON objects of all ranks; they must agree, and no value may lie under
    another (one rank's ``extra`` a single JSON value, another's split into ``extra/...`` because it
    holds a tensor there: a load could not tell which is meant)."""
    merged = _merge_objects(objects)
    owner = {k: r for r in reversed(range(len(objects))) for k in objects[r]}
    keys = set(merged) | set(tensor_keys)
    for k in sorted(keys):
        parts = k.split("/")
        for i in range(1, len(parts)):
            above = "/".join(parts[:i])
            if above in merged:
                raise InvalidStateError(
                    f"key {above!r} is one value on rank {owner[above]}, but {k!r} lies under it (on another rank, "
                    "or as a tensor): give every rank the same structure there (a container that holds a tensor or "
                    "PerRank value on one rank is saved entry by entry)"
                )
    return merged


def _merge_objects(objects: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    import json

    merged: Dict[str, Any] = {}
    first: Dict[str, Tuple[int, str]] = {}
    for r, objs in enumerate(objects):
        for k, v in objs.items():
            enc = json.dumps(v, sort_keys=True, allow_nan=True)
            if k in first:
                r0, enc0 = first[k]
                if enc != enc0:
                    raise InvalidStateError(
                        f"key {k!r}: rank {r0} holds {_short(enc0)} but rank {r} holds {_short(enc)}; "
                        "values that differ per rank must be wrapped in nostall.PerRank"
                    )
            else:
                first[k] = (r, enc)
                merged[k] = v
    return merged


def _short(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."
