"""Planning split by key: each key saved once for all ranks is planned by one rank, its planner.

The planner of a key is ``crc32(key) % world`` (:func:`planner_of`); when any
rank ties keys (one memory under two keys, :func:`nostall.planning.plan.ties_of`),
every key goes to planner 0, so that tied keys are planned together (the same
code, another routing). Each rank sends each planner the part of its metadata
for that planner's keys (:func:`route`, one all-to-all); each planner validates
its keys and assigns their pieces to writers with the rules of
:func:`~nostall.planning.plan.build_plan` (:func:`plan_keys`), its tie-break
turned by its rank so that planners do not all pick the lowest ranks, finds
its keys' replica groups, and answers each rank, for the tensors it sent, a
byte each (whether it writes that piece) and the indices of those it
checksums for the replica check. A rank's part, a planner's work and every
message follow the rank's own share of the job, not the job
(docs/protocol.md, "Planning").

Example (two ranks, FSDP-like halves of ``w``, a replicated ``b``)::

    >>> from nostall.planning.plan import RankMeta, TensorMeta
    >>> def meta(r):
    ...     return RankMeta((TensorMeta("w", "F32", (4, 2), (2 * r, 0), (2, 2), True, True),
    ...                      TensorMeta("b", "F32", (3,), (0,), (3,), False, True)), ())
    >>> metas = [meta(0), meta(1)]
    >>> parts = [route(m, 2, False)[0] for m in metas]      # parts[r][p]: rank r's part for planner p
    >>> got = [plan_keys([parts[r][p] for r in range(2)], p) for p in range(2)]
    >>> [g.error for g in got]
    [None, None]
    >>> owned = [merge(route(m, 2, False)[1], [g.answers[r] for g in got], len(m.tensors))
    ...          for r, m in enumerate(metas)]
    >>> planner_of("b", 2)                                  # b's planner breaks the tie from its own rank
    1
    >>> [o[0] for o in owned]                               # each rank writes its half of w, rank 1 b
    [b'\\x01\\x00', b'\\x01\\x01']
"""

from __future__ import annotations

import pickle
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nostall.errors import InvalidStateError
from nostall.planning import replicas
from nostall.planning.plan import (RankMeta, TensorMeta, assign_owners, check_headers, key_pieces, tensor_columns,
                                  tensor_metas, ties_of)

__all__ = ["planner_of", "route", "plan_keys", "merge", "in_one_process", "Planned", "Header"]

Shape = Tuple[int, ...]
_new = object.__new__
Header = Tuple[str, Shape, bool, str]
"""A key's header as the manifest records it: (dtype code, global shape, sharded, tied to)."""
_Error = Optional[Tuple[str, str]]  # (kind, message): raised alike on every rank


def planner_of(key: str, world: int, central: bool = False) -> int:
    """The rank that plans ``key``: ``crc32(key) % world``, or 0 when planning is ``central`` (ties).

    >>> planner_of("w", 1), planner_of("w", 4, central=True)
    (0, 0)
    """
    if central or world <= 1:
        return 0
    return zlib.crc32(key.encode()) % world


def _encode(ts: Sequence[TensorMeta], per_rank: Sequence[str]) -> Optional[bytes]:
    """A rank's part for one planner: its tensors of the planner's keys, as columns (a replicated
    tensor's zero offset and full shape as None), and the names of its per-rank tensors of those keys
    (a key may not be both). None when there is nothing."""
    if not ts and not per_rank:
        return None
    cols = (*tensor_columns(ts), list(per_rank))
    return pickle.dumps(cols, protocol=pickle.HIGHEST_PROTOCOL)


def _decode(blob: bytes) -> Tuple[List[TensorMeta], List[str]]:
    keys, dtypes, gshapes, offsets, shapes, flags, ties, per_rank = pickle.loads(blob)
    out = tensor_metas(keys, dtypes, gshapes, offsets, shapes, flags, ties)
    return out, per_rank


def route(meta: RankMeta, world: int, central: bool) -> Tuple[List[Optional[bytes]], List[List[int]]]:
    """This rank's part of its metadata for each planner (None: nothing for it), and beside each the
    indices in ``meta.tensors`` of the tensors it names (in that order: the planner's answer follows it)."""
    ts: List[List[TensorMeta]] = [[] for _ in range(world)]
    index: List[List[int]] = [[] for _ in range(world)]
    names: List[List[str]] = [[] for _ in range(world)]
    for i, t in enumerate(meta.tensors):
        p = planner_of(t.key, world, central)
        ts[p].append(t)
        index[p].append(i)
    for k, _code, _shape in meta.per_rank:
        names[planner_of(k, world, central)].append(k)
    return [_encode(ts[p], names[p]) for p in range(world)], index


@dataclass
class Planned:
    """What one planner found for its keys."""

    error: _Error = None  # the first problem of its keys (every rank raises it)
    answers: List[Optional[Tuple[bytes, Tuple[int, ...]]]] = field(default_factory=list)
    # to each rank, for the tensors it sent (in order): whether it writes each (a byte), and the indices of
    # those it checksums (None: it sent nothing)
    headers: Dict[str, Header] = field(default_factory=dict)  # its keys' headers
    shared: Dict[str, Tuple[Tuple[int, ...], ...]] = field(default_factory=dict)  # its keys several ranks hold
    loads: List[int] = field(default_factory=list)  # bytes it gave each rank to write


def plan_keys(parts: Sequence[Optional[bytes]], me: int) -> Planned:
    """Plan the keys of planner ``me`` from every rank's part (``parts[r]``, :func:`route`).

    The checks and rules of :func:`~nostall.planning.plan.build_plan`, on these keys alone; the
    holders' tie-break is turned by ``me`` (:func:`~nostall.planning.plan.assign_owners`). An invalid
    state becomes ``("state", message)`` naming the key and ranks.
    """
    world = len(parts)
    out = Planned(answers=[None] * world, loads=[0] * world)
    sent: List[List[TensorMeta]] = [[] for _ in range(world)]
    by_key: Dict[str, Tuple[List[int], List[TensorMeta]]] = {}
    per_rank_keys: Dict[str, int] = {}
    try:
        for r, blob in enumerate(parts):
            if blob is None:
                continue
            ts, names = _decode(blob)
            sent[r] = ts
            for t in ts:
                e = by_key.get(t.key)
                if e is None:
                    by_key[t.key] = e = ([], [])
                e[0].append(r)
                e[1].append(t)
            for k in names:
                per_rank_keys.setdefault(k, r)
        clash = sorted(set(per_rank_keys) & set(by_key))
        if clash:
            raise InvalidStateError(f"key {clash[0]!r} is a PerRank value on some ranks and a tensor on others")
        tied = ties_of(by_key)
        pieces: List[Any] = []
        for key in sorted(by_key):
            ranks, ts = by_key[key]
            check_headers(key, ranks, ts)
            t0 = ts[0]
            out.headers[key] = (t0.dtype, t0.global_shape, t0.sharded, tied.get(key, ""))
            key_pieces(key, ranks, ts, key in tied, pieces)
        owners, sizes = assign_owners(world, [0] * world, pieces, me)
    except InvalidStateError as e:
        return Planned(("state", str(e)))
    owner = {(p[0], p[1], p[2]): o for p, o in zip(pieces, owners)}
    for o, n in zip(owners, sizes):
        out.loads[o] += n
    out.shared = replicas.scan_shared_keys(RankMeta(tuple(ts), ()) for ts in sent)
    copied = {k: set().union(*groups) for k, groups in out.shared.items()}  # who holds a copy of each key
    none: set = set()
    for r, ts in enumerate(sent):
        if parts[r] is None:
            continue
        owned = bytes(owner.get((t.key, t.offset, t.shape), -1) == r for t in ts)
        copies = tuple(i for i, t in enumerate(ts) if r in copied.get(t.key, none))
        out.answers[r] = (owned, copies)
    return out


def merge(index: Sequence[Sequence[int]], answers: Sequence[Optional[Tuple[bytes, Tuple[int, ...]]]],
          n: int) -> Tuple[bytes, Tuple[int, ...]]:
    """This rank's ``owned`` (a byte per tensor of its metadata, :func:`~nostall.planning.plan.own_files`)
    and the indices of the tensors it checksums, from every planner's answer (``answers[p]``) to the
    parts it sent (``index[p]``, :func:`route`)."""
    owned = bytearray(n)
    copies: List[int] = []
    for idx, got in zip(index, answers):
        if not idx:
            continue
        if got is None or len(got[0]) != len(idx):
            raise InvalidStateError(f"a planner answered {0 if got is None else len(got[0])} pieces of the "
                                    f"{len(idx)} this rank sent: the structure changed while planning")
        for i, o in zip(idx, got[0]):
            owned[i] = o
        copies.extend(idx[j] for j in got[1])
    return bytes(owned), tuple(sorted(copies))


def in_one_process(metas: Sequence[RankMeta], central: Optional[bool] = None
                   ) -> Tuple[List[Planned], List[Tuple[bytes, Tuple[int, ...]]]]:
    """The metadata phase of every rank run in one process (tests, the benchmark): each planner's result,
    and each rank's merged share (``owned``, copy indices). ``central``: None as the ranks decide (some
    rank ties keys). Raises the first planner's error as :class:`~nostall.errors.InvalidStateError`."""
    world = len(metas)
    if central is None:
        central = any(t.tied_to for m in metas for t in m.tensors)
    routed = [route(m, world, central) for m in metas]
    planned = [plan_keys([routed[r][0][p] for r in range(world)], p) for p in range(world)]
    for p in planned:
        if p.error is not None:
            raise InvalidStateError(p.error[1])
    shares = [merge(routed[r][1], [p.answers[r] for p in planned], len(m.tensors)) for r, m in enumerate(metas)]
    return planned, shares
