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

import bisect
import hashlib
import pickle
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Tuple

from nostall.core.boxes import box_str, cover_problem
from nostall.errors import InvalidStateError
from nostall.core.dtypes import dtype_code
from nostall.core.jobs import FileJob
from nostall.core.format import data_file_name, gc_paused, itemsize, layout_entries, quick_tiles
from nostall.core.model import FlatState, numel

Shape = Tuple[int, ...]
_new = object.__new__


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
        """SHA-256 of ``repr((self.tensors, self.per_rank))``: equal for equal metadata.

        Computed once per instance and kept with it (a gathered copy brings the sender's along).
        """
        sig = self.__dict__.get("_signature")
        if sig is None:
            sig = hashlib.sha256(_meta_repr(self.tensors, self.per_rank).encode()).hexdigest()
            object.__setattr__(self, "_signature", sig)
        return sig


def _tensor_meta_repr(t: TensorMeta) -> str:
    """``repr(t)`` as the dataclass writes it, at a fraction of its cost."""
    return (f"{type(t).__qualname__}(key={t.key!r}, dtype={t.dtype!r}, global_shape={t.global_shape!r}, "
            f"offset={t.offset!r}, shape={t.shape!r}, sharded={t.sharded!r}, main={t.main!r}, "
            f"tied_to={t.tied_to!r})")


def _meta_repr(tensors: Tuple[TensorMeta, ...], per_rank: Tuple[Tuple[str, str, Shape], ...]) -> str:
    """``repr((tensors, per_rank))``."""
    if type(tensors) is not tuple or any(type(t) is not TensorMeta for t in tensors):
        return repr((tensors, per_rank))
    inner = ", ".join(map(_tensor_meta_repr, tensors))
    if len(tensors) == 1:
        inner += ","
    return f"(({inner}), {per_rank!r})"


def local_meta(flat: FlatState) -> RankMeta:
    tensors = []
    codes: Dict[Any, str] = {}  # dtype -> code, looked up once per dtype
    for t in flat.tensors.values():
        dt = t.data.dtype
        code = codes.get(dt)
        if code is None:
            c = dtype_code(dt)
            if c is None:
                raise InvalidStateError(f"key {t.key!r}: dtype {dt} is not supported")
            code = codes[dt] = c
        m = _new(TensorMeta)  # TensorMeta(...) without the frozen dataclass's per-field setattr
        m.__dict__.update(key=t.key, dtype=code, global_shape=t.global_shape, offset=t.global_offset,
                          shape=tuple(t.data.shape), sharded=t.sharded, main=t.main, tied_to=t.tied_to)
        tensors.append(m)
    per_rank = []
    for k, v in flat.per_rank_tensors.items():
        code = dtype_code(v.dtype)
        if code is None:
            raise InvalidStateError(f"key {k!r}: dtype {v.dtype} is not supported")
        per_rank.append((k, code, tuple(v.shape)))
    return RankMeta(tuple(tensors), tuple(per_rank))


# --------------------------------------------------------------------------- metadata on the wire

_WIRE = 1  # version of encode_meta's layout


def encode_meta(meta: RankMeta) -> bytes:
    """``meta`` as one rank sends it to rank 0 for planning: columns, not pickled dataclasses.

    A tuple of plain lists (keys, dtype codes, global shapes, offsets, shapes), the flags as bytes
    (bit 0 sharded, bit 1 main), the ties by index, the per-rank entries and the signature,
    pickled: an offset of zeros and a shape equal to the global shape (a replicated tensor) go as
    None. About the key's length plus 10-20 bytes a piece.

    >>> m = RankMeta((TensorMeta("w", "F32", (4, 2), (2, 0), (2, 2), True, True),), (("c", "I64", ()),))
    >>> decode_meta(encode_meta(m)) == m
    True
    """
    cols = (_WIRE, *tensor_columns(meta.tensors), meta.per_rank, meta.signature())
    return pickle.dumps(cols, protocol=pickle.HIGHEST_PROTOCOL)


Columns = Tuple[List[str], List[str], List[Shape], List[Any], List[Any], bytes, Dict[int, str]]
"""TensorMetas as columns: keys, dtype codes, global shapes, offsets (None: zeros), shapes (None: the global
shape), flags (bit 0 sharded, bit 1 main), ties by index."""


def tensor_columns(ts: Sequence[TensorMeta]) -> Columns:
    """``ts`` as :data:`Columns` (what :func:`encode_meta` and a planner's part send)."""
    return ([t.key for t in ts], [t.dtype for t in ts], [t.global_shape for t in ts],
            [None if not any(t.offset) else t.offset for t in ts],
            [None if t.shape == t.global_shape else t.shape for t in ts],
            bytes((1 if t.sharded else 0) | (2 if t.main else 0) for t in ts),
            {i: t.tied_to for i, t in enumerate(ts) if t.tied_to})


def tensor_metas(keys: Sequence[str], dtypes: Sequence[str], gshapes: Sequence[Shape], offsets: Sequence[Any],
                 shapes: Sequence[Any], flags: bytes, ties: Mapping[int, str]) -> List[TensorMeta]:
    """The TensorMetas of :func:`tensor_columns`' columns."""
    out = []
    for i, (key, code, gshape, off, shp, fl) in enumerate(zip(keys, dtypes, gshapes, offsets, shapes, flags)):
        m = _new(TensorMeta)
        m.__dict__.update(key=key, dtype=code, global_shape=gshape,
                          offset=off if off is not None else (0,) * len(gshape),
                          shape=shp if shp is not None else gshape, sharded=bool(fl & 1), main=bool(fl & 2),
                          tied_to=ties.get(i, ""))
        out.append(m)
    return out


def decode_meta(blob: bytes) -> RankMeta:
    """The :class:`RankMeta` that :func:`encode_meta` encoded (its signature kept, not recomputed)."""
    version, keys, dtypes, gshapes, offsets, shapes, flags, ties, per_rank, sig = pickle.loads(blob)
    if version != _WIRE:
        raise InvalidStateError(f"planning metadata of layout {version}, this nostall reads {_WIRE}: every rank "
                                "must run the same nostall version")
    tensors = tensor_metas(keys, dtypes, gshapes, offsets, shapes, flags, ties)
    out = RankMeta(tuple(tensors), tuple(per_rank))
    object.__setattr__(out, "_signature", sig)
    return out


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
    shape: Shape = ()  # the piece's shape (with ``offset``, its box: the commit's manifest record)


@dataclass(frozen=True)
class FilePlan:
    name: str
    rank: int
    header: bytes
    size: int
    items: Tuple[WriteItem, ...]  # in file order


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of a plan: what it writes, and what it checksums for the replica check.

    Rank 0 plans the whole save and tells each rank which of its pieces it writes; the rank lays out
    its file itself (:func:`own_files`, :mod:`nostall.planning.rounds`): its cost follows its own
    pieces, not the job's.
    """

    plan_id: str  # rank 0's name for the plan this share is of
    rank: int
    world_size: int
    files: Tuple[FilePlan, ...]  # the data files this rank writes
    total_bytes: int  # the size of all the plan's data files (for the stats)
    copies: Tuple[str, ...] = ()  # keys this rank holds a copy of that other ranks hold too


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


@dataclass
class Layout:
    """What rank 0 keeps of a plan for the manifest's skeleton: O(keys + ranks), no piece.

    Gathered from the planners (their keys' headers) and the ranks (their per-rank tensors, their
    files' sizes) by :mod:`nostall.planning.rounds`; :func:`layout_of` gives a whole plan's.
    """

    world_size: int
    tensors: Dict[str, Tuple[str, Shape, bool, str]]  # key -> (dtype code, global shape, sharded, tied to)
    per_rank: List[Tuple[Tuple[str, str, Shape], ...]]  # each rank's per-rank tensors (key, dtype code, shape)
    files: Dict[str, Tuple[int, int]]  # data file -> (rank, size)


def layout_of(plan: SavePlan) -> Layout:
    """The :class:`Layout` of a whole ``plan`` (:func:`build_plan`)."""
    return Layout(plan.world_size, {k: (t.dtype, t.shape, t.sharded, t.tied_to) for k, t in plan.tensors.items()},
                  [tuple((k, t.dtype, t.shape) for k, t in d.items()) for d in plan.per_rank],
                  {n: (f.rank, f.size) for n, f in plan.files.items()})


_KEY = attrgetter("key")
_HEAD = attrgetter("sharded", "dtype", "global_shape")
_BOX = attrgetter("offset", "shape")
_MAIN = attrgetter("main")
_START = attrgetter("start")
_FIRST = itemgetter(0)
_SECOND = itemgetter(1)

# A piece while planning: (key, offset, shape, dtype code, holders (sorted ranks)).
_Piece = Tuple[str, Shape, Shape, str, List[int]]
# A key's header while planning: (dtype code, global shape, sharded).
_Header = Tuple[str, Shape, bool]
# A file's entry while planning: (tensor name in the file, dtype code, shape, bytes).
_Entry = Tuple[str, str, Shape, int]
# Where a piece's bytes lie: (file, start, end).
_Where = Tuple[str, int, int]


def _piece_plan(offset: Shape, shape: Shape, owner: int, file: str, start: int, end: int) -> PiecePlan:
    """``PiecePlan(...)`` without the frozen dataclass's per-field ``object.__setattr__`` (a plan can hold
    millions; the instance is the same)."""
    p = _new(PiecePlan)
    p.__dict__.update(offset=offset, shape=shape, owner=owner, file=file, start=start, end=end)
    return p


def _write_item(key: str, per_rank: bool, offset: Shape, file: str, start: int, end: int, shape: Shape) -> WriteItem:
    """``WriteItem(...)``, built as :func:`_piece_plan` builds a PiecePlan."""
    w = _new(WriteItem)
    w.__dict__.update(key=key, per_rank=per_rank, offset=offset, file=file, start=start, end=end, shape=shape)
    return w


def file_job(f: FilePlan, area_offset: int = 0) -> FileJob:
    """The writer's job for the planned file ``f`` (lying at ``area_offset`` in the staging area): its
    pieces' byte ranges, and what each is (key, per-rank, offset, shape: its done record's entries)."""
    return FileJob(f.name, area_offset, f.size, len(f.header), tuple((it.start, it.end) for it in f.items),
                   tuple((it.key, f.rank if it.per_rank else -1, it.offset, it.shape) for it in f.items))


def _group(metas: Sequence[RankMeta]) -> Dict[str, Tuple[Sequence[int], Sequence[TensorMeta]]]:
    """Every key's holders: ``{key: (ranks, their TensorMetas)}``, ranks in increasing order.

    When every rank lists the same keys in the same order (the usual case: every rank flattens the
    same structure) the columns are cut out of the ranks' tuples in one ``zip``.
    """
    first = metas[0].tensors if metas else ()
    keys0 = list(map(_KEY, first))
    if len(set(keys0)) == len(keys0) and all(list(map(_KEY, m.tensors)) == keys0 for m in metas[1:]):
        ranks = range(len(metas))
        return {k: (ranks, col) for k, col in zip(keys0, zip(*(m.tensors for m in metas)))}
    by_key: Dict[str, Tuple[List[int], List[TensorMeta]]] = {}
    for r, m in enumerate(metas):
        for t in m.tensors:
            e = by_key.get(t.key)
            if e is None:
                by_key[t.key] = e = ([], [])
            e[0].append(r)
            e[1].append(t)
    return by_key  # type: ignore[return-value]


def check_headers(key: str, ranks: Sequence[int], ts: Sequence[TensorMeta]) -> None:
    """Every holder of ``key`` agrees on sharding, dtype and global shape (else the first disagreement)."""
    if len(ts) < 2 or len(set(map(_HEAD, ts))) == 1:
        return
    r0, t0 = ranks[0], ts[0]
    for r, t in zip(ranks[1:], ts[1:]):
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


def _cover(key: str, global_shape: Shape, boxes: List[Tuple[Shape, Shape]]) -> None:
    if quick_tiles(global_shape, boxes):
        return
    problem = cover_problem(global_shape, boxes)
    if problem:
        raise InvalidStateError(f"key {key!r}: {problem}")


def key_pieces(key: str, ranks: Sequence[int], ts: Sequence[TensorMeta], tied: bool,
                pieces: List[_Piece]) -> None:
    """Validate the holders of one key and append its distinct pieces (sorted by box) to ``pieces``."""
    t0 = ts[0]
    sharded, code, gshape = t0.sharded, t0.dtype, t0.global_shape
    bl: List[Tuple[Shape, Shape]] = list(map(_BOX, ts))
    distinct = set(bl)
    if sharded and len(distinct) == len(bl) and all(numel(s) for s in set(map(_SECOND, bl))) \
            and all(map(_MAIN, ts)):
        # every rank holds a piece of its own, the main copy (FSDP-like): one holder per piece
        _cover(key, gshape, bl)
        if not tied:
            pieces.extend((key, off, shp, code, [r]) for (off, shp), r in sorted(zip(bl, ranks)))
        return
    if not sharded and len(distinct) == 1:  # a replicated tensor: one piece, every holder
        if not tied:
            off, shp = bl[0]
            pieces.append((key, off, shp, code, sorted(ranks)))
        return
    boxes: Dict[Tuple[Shape, Shape], List[Tuple[int, bool]]] = {}
    for r, t, box in zip(ranks, ts, bl):
        if sharded and numel(box[1]) == 0:
            continue  # an empty shard (FSDP2 with more ranks than rows): nothing to store
        boxes.setdefault(box, []).append((r, t.main))
    if sharded:
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
        _cover(key, gshape, list(boxes))
    if not tied:
        for (off, shp), held in sorted(boxes.items()):
            pieces.append((key, off, shp, code, sorted(r for r, _ in held)))


def _owners(metas: Sequence[RankMeta], pieces: List[_Piece]) -> Tuple[List[int], List[int]]:
    """(owner, bytes) of every piece: fixed pieces first, then largest first to the least loaded holder
    (each rank's load starting at its per-rank tensors' bytes)."""
    load = [0] * len(metas)
    for r, m in enumerate(metas):
        for _k, code, shape in m.per_rank:
            load[r] += numel(shape) * itemsize(code)
    return assign_owners(len(metas), load, pieces, 0)


def assign_owners(world: int, load: List[int], pieces: List[_Piece], shift: int) -> Tuple[List[int], List[int]]:
    """(owner, bytes) of every piece from the ranks' ``load`` so far (updated): pieces with one holder go
    to it, the others largest first to the least loaded holder, ties broken by the first at or after
    ``(index + shift) % world`` (a planner's ``shift`` is its rank: planners do not all pick the lowest)."""
    size_of: Dict[Tuple[Shape, str], int] = {}
    sizes: List[int] = []
    owners: List[int] = []
    flexible = []
    for idx, (_key, _off, shp, code, holders) in enumerate(pieces):
        nbytes = size_of.get((shp, code))
        if nbytes is None:
            nbytes = size_of[(shp, code)] = numel(shp) * itemsize(code)
        sizes.append(nbytes)
        if len(holders) == 1:
            owners.append(holders[0])
            load[holders[0]] += nbytes
        else:
            owners.append(-1)
            flexible.append((-nbytes, idx))
    flexible.sort()
    for neg, idx in flexible:
        holders = pieces[idx][4]
        # min(holders, key=lambda r: (load[r], (r - idx - shift) % world)): among the least loaded holders
        # (sorted), the first at or after (idx + shift) % world, else the first
        loads = list(map(load.__getitem__, holders))
        least = min(loads)
        if loads.count(least) == 1:
            owner = holders[loads.index(least)]
        else:
            cands = [r for r, x in zip(holders, loads) if x == least]
            i = bisect.bisect_left(cands, (idx + shift) % world)
            owner = cands[i] if i < len(cands) else cands[0]
        owners[idx] = owner
        load[owner] -= neg
    return owners, sizes


def build_plan(metas: Sequence[RankMeta]) -> SavePlan:
    """Validate every rank's metadata and assign each distinct piece to one writer (the garbage collector
    paused meanwhile, :func:`gc_paused`)."""
    with gc_paused():
        return _build_plan(metas)


def _build_plan(metas: Sequence[RankMeta]) -> SavePlan:
    """The plan in its phases: the distinct pieces, their writers, the files, the tensors' plans."""
    by_key = _group(metas)
    per_rank_keys = {k for m in metas for (k, _, _) in m.per_rank}
    clash = sorted(per_rank_keys & set(by_key))
    if clash:
        raise InvalidStateError(f"key {clash[0]!r} is a PerRank value on some ranks and a tensor on others")
    tied = ties_of(by_key)
    pieces, headers = _pieces(by_key, tied)
    owners, sizes = _owners(metas, pieces)
    entries_of, index_of = _file_entries(metas, pieces, owners, sizes, headers)
    files, where, per_rank_where = _lay_out_files(metas, pieces, entries_of, index_of)
    return SavePlan(
        world_size=len(metas),
        tensors=_tensor_plans(pieces, owners, where, headers, tied),
        per_rank=_per_rank_plans(metas, per_rank_where),
        files=files,
        signatures=tuple(m.signature() for m in metas),
    )


def _pieces(by_key: Mapping[str, Tuple[Sequence[int], Sequence[TensorMeta]]],
            tied: Mapping[str, str]) -> Tuple[List[_Piece], Dict[str, _Header]]:
    """Validate every key's holders; its distinct pieces (keys sorted, then boxes) and its header.

    A tied key is validated like any tensor but contributes no piece: it is stored as the key it
    is tied to.
    """
    pieces: List[_Piece] = []
    headers: Dict[str, _Header] = {}
    for key in sorted(by_key):
        ranks, ts = by_key[key]
        check_headers(key, ranks, ts)
        t0 = ts[0]
        headers[key] = (t0.dtype, t0.global_shape, t0.sharded)
        key_pieces(key, ranks, ts, key in tied, pieces)
    return pieces, headers


def _file_entries(metas: Sequence[RankMeta], pieces: List[_Piece], owners: List[int], sizes: List[int],
                  headers: Mapping[str, _Header]) -> Tuple[Dict[int, List[_Entry]], Dict[int, List[int]]]:
    """Each writing rank's file entries, in piece order then its per-rank tensors.

    Returns ``(entries_of, index_of)`` per rank: the entries ``(name, code, shape, nbytes)``, and
    beside each the piece index it stores (``-1 - i`` for the rank's per-rank tensor ``i``), so the
    laid-out byte ranges can be traced back to pieces. Names are those ``format.piece_name`` gives.
    """
    entries_of: Dict[int, List[_Entry]] = {}
    index_of: Dict[int, List[int]] = {}
    offset_name: Dict[Shape, str] = {}  # one suffix string per distinct offset
    for idx, (key, off, shp, code, _holders) in enumerate(pieces):
        r = owners[idx]
        name = _entry_name(key, off, shp, headers[key][1], offset_name)
        ents = entries_of.get(r)
        if ents is None:
            entries_of[r] = ents = []
            index_of[r] = []
        ents.append((name, code, shp, sizes[idx]))
        index_of[r].append(idx)
    for r, m in enumerate(metas):
        for i, (k, code, shape) in enumerate(m.per_rank):
            entries_of.setdefault(r, []).append((k, code, shape, numel(shape) * itemsize(code)))
            index_of.setdefault(r, []).append(-1 - i)
    return entries_of, index_of


def lay_out_file(rank: int, world: int, entries: Sequence[_Entry],
                 items: Sequence[Tuple[str, bool, Shape]]) -> Tuple[FilePlan, List[Tuple[int, int]]]:
    """Rank ``rank``'s data file (``format.layout_entries``: header and byte ranges) holding ``entries`` in
    that order, each written from the leaf ``items[i]`` names (key, per-rank, offset); and each entry's range.

    The one layout of a data file: rank 0 lays out every rank's while planning, and each rank its own
    from its share (:func:`own_files`).
    """
    name = data_file_name(rank)
    try:
        header, ranges, size = layout_entries(entries, {"format": "nostall", "rank": str(rank),
                                                        "world_size": str(world)})
    except ValueError as err:
        raise InvalidStateError(f"rank {rank}: {err}") from None
    its = [_write_item(key, per_rank, off, name, start, end, ent[2])
           for (key, per_rank, off), (start, end), ent in zip(items, ranges, entries)]
    its.sort(key=_START)
    return FilePlan(name, rank, header, size, tuple(its)), ranges


def _lay_out_files(metas: Sequence[RankMeta], pieces: List[_Piece], entries_of: Mapping[int, List[_Entry]],
                   index_of: Mapping[int, List[int]]
                   ) -> Tuple[Dict[str, FilePlan], List[_Where], Dict[Tuple[int, int], _Where]]:
    """Lay out one data file per writing rank (:func:`lay_out_file`).

    Returns the file plans, where each piece's bytes lie (by piece index), and where each per-rank
    tensor's lie (by ``(rank, i)``).
    """
    world = len(metas)
    files: Dict[str, FilePlan] = {}
    where: List[_Where] = [("", 0, 0)] * len(pieces)
    per_rank_where: Dict[Tuple[int, int], _Where] = {}
    for r in sorted(entries_of):
        per_rank = metas[r].per_rank
        items = [(pieces[idx][0], False, pieces[idx][1]) if idx >= 0
                 else (per_rank[-1 - idx][0], True, (0,) * len(per_rank[-1 - idx][2])) for idx in index_of[r]]
        fp, ranges = lay_out_file(r, world, entries_of[r], items)
        for idx, (start, end) in zip(index_of[r], ranges):
            if idx >= 0:
                where[idx] = (fp.name, start, end)
            else:
                per_rank_where[(r, -1 - idx)] = (fp.name, start, end)
        files[fp.name] = fp
    return files, where, per_rank_where


def _entry_name(key: str, off: Shape, shp: Shape, gshape: Shape, names: Dict[Shape, str]) -> str:
    """The piece's name in its file, as ``format.piece_name`` gives it (``names``: suffix per offset, reused)."""
    if shp == gshape:
        return key if key != "__metadata__" else key + "@"
    suffix = names.get(off)
    if suffix is None:
        suffix = names[off] = "@" + ",".join(str(o) for o in off)
    return key + suffix


def own_files(meta: RankMeta, rank: int, world: int, owned: bytes) -> Tuple[FilePlan, ...]:
    """This rank's data file, laid out from its own metadata and its share: ``owned[i]`` says whether it
    writes the piece of ``meta.tensors[i]``. The same file :func:`build_plan` lays out for the rank
    (its pieces in key order, then its per-rank tensors), at a cost of its own pieces.
    """
    ts = meta.tensors
    if len(owned) != len(ts):
        raise InvalidStateError(f"rank {rank}: its share of the plan names {len(owned)} pieces, it holds {len(ts)}: "
                                "the structure changed while planning")
    names: Dict[Shape, str] = {}
    entries: List[_Entry] = []
    items: List[Tuple[str, bool, Shape]] = []
    for t in sorted((t for t, o in zip(ts, owned) if o), key=_KEY):
        nbytes = numel(t.shape) * itemsize(t.dtype)
        entries.append((_entry_name(t.key, t.offset, t.shape, t.global_shape, names), t.dtype, t.shape, nbytes))
        items.append((t.key, False, t.offset))
    for k, code, shape in meta.per_rank:
        entries.append((k, code, shape, numel(shape) * itemsize(code)))
        items.append((k, True, (0,) * len(shape)))
    if not entries:
        return ()
    return (lay_out_file(rank, world, entries, items)[0],)


def owned_pieces(plan: SavePlan, meta: RankMeta, rank: int) -> bytes:
    """The ``owned`` of :func:`own_files` for ``rank`` (holding ``meta``) in ``plan``."""
    mine = {(it.key, it.offset) for f in plan.files_of(rank) for it in f.items if not it.per_rank}
    return bytes((t.key, t.offset) in mine for t in meta.tensors)


def _tensor_plans(pieces: List[_Piece], owners: List[int], where: List[_Where],
                  headers: Mapping[str, _Header], tied: Mapping[str, str]) -> Dict[str, TensorPlan]:
    """Every tensor key's plan, its pieces in piece order; a tied key gets the pieces of its target."""
    grouped: Dict[str, List[PiecePlan]] = {}
    for (key, off, shp, _code, _holders), owner, (file, start, end) in zip(pieces, owners, where):
        g = grouped.get(key)
        if g is None:
            grouped[key] = g = []
        g.append(_piece_plan(off, shp, owner, file, start, end))
    tensors: Dict[str, TensorPlan] = {}
    for key, (dtype, gshape, sharded) in headers.items():
        a = tied.get(key, "")
        tensors[key] = TensorPlan(key, dtype, gshape, sharded, tuple(grouped.get(a or key, ())), a)
    return tensors


def _per_rank_plans(metas: Sequence[RankMeta],
                    per_rank_where: Mapping[Tuple[int, int], _Where]) -> List[Dict[str, TensorPlan]]:
    """Each rank's per-rank tensors' plans: one piece each, written by that rank."""
    plans: List[Dict[str, TensorPlan]] = []
    for r, m in enumerate(metas):
        d = {}
        for i, (k, code, shape) in enumerate(m.per_rank):
            file, start, end = per_rank_where[(r, i)]
            d[k] = TensorPlan(k, code, shape, False, (PiecePlan((0,) * len(shape), shape, r, file, start, end),))
        plans.append(d)
    return plans


def ties_of(by_key: Mapping[str, Tuple[Sequence[int], Sequence[TensorMeta]]]) -> Dict[str, str]:
    """Keys saved as another key (tied weights): ``{B: A}``.

    B is tied to A only when every rank holding B says so, A is a tensor key no rank marks as tied,
    A and B agree in dtype, shape and sharding, and every holder of B holds A with the same box.
    Anything else (ranks disagreeing, say) leaves B an ordinary tensor. Computed from the gathered
    metadata alone, so every rank gets the same answer.
    """
    tied: Dict[str, str] = {}
    for key, (ranks, entries) in by_key.items():
        a = entries[0].tied_to
        if not a or a == key or a not in by_key or any(t.tied_to != a for t in entries):
            continue
        a_ranks, a_entries = by_key[a]
        if any(t.tied_to for t in a_entries):
            continue
        held = {(r, t.dtype, t.global_shape, t.offset, t.shape, t.sharded, t.main) for r, t in zip(a_ranks, a_entries)}
        if all((r, t.dtype, t.global_shape, t.offset, t.shape, t.sharded, t.main) in held
               for r, t in zip(ranks, entries)):
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
