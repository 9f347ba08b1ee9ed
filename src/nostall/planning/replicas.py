"""Replica checks: the copies of a tensor saved once for several ranks must be equal.

A plain ``torch.Tensor`` leaf means "every rank holding this key holds the
same value", and so does a ShardedTensor piece that several ranks hold (one
with ``replica_id`` 0, the others copies). Only one copy is written. When the
ranks' copies differ (an optimizer's ``exp_avg`` of a tensor-parallel weight
saved as a plain tensor, a per-rank counter saved as a tensor), the other
ranks' values would be lost without a word; this check refuses such a save.

Rank 0 finds the keys several ranks hold (:func:`shared_keys`, while it plans)
and tells each rank which of its keys to checksum (:func:`copies_of`); each
rank checksums its copies (crc32c of the bytes), rank 0 gathers the checksums
and sends every rank the same verdict (:mod:`nostall.planning.rounds`), so
every rank raises the same error.

Example::

    >>> from nostall.planning.replicas import disagreements
    >>> shared = {"w": ((0, 1),)}              # key -> the groups of ranks holding a copy
    >>> disagreements(shared, [{"w": 7}, {"w": 7}]) is None
    True
    >>> print(disagreements(shared, [{"w": 7}, {"w": 9}]))  # doctest: +ELLIPSIS
    key 'w': ranks 0 and 1 hold different values of a tensor saved once for all of them ...
"""

from __future__ import annotations

from operator import attrgetter
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import crc32c as _crc32c

from nostall.core.tensorbuf import byte_view, host_contiguous
from nostall.core.model import FlatState

__all__ = ["shared_keys", "scan_shared_keys", "digests", "disagreements"]

_CHUNK = 64 << 20  # bytes copied from a device at a time
_BOX = attrgetter("offset", "shape")


def shared_keys(metas: Sequence[object]) -> Dict[str, Tuple[Tuple[int, ...], ...]]:
    """Keys held by several ranks in the same box: key -> the groups of ranks holding the same box of it
    (from every rank's plan metadata).

    A rank holds at most one piece of a key; ranks whose pieces of a key have
    different boxes are not copies of each other (sharded pieces), so the
    ranks are grouped by box and only boxes with two or more holders count:
    a tensor-parallel weight copied across data-parallel groups has one
    group per shard. ``metas`` are :class:`nostall.planning.plan.RankMeta` values.

    >>> from nostall.planning.plan import RankMeta, TensorMeta
    >>> def tp(r):  # column halves over ranks 0-1, copied to ranks 2-3
    ...     return RankMeta((TensorMeta("w", "F32", (2, 4), (0, 2 * (r % 2)), (2, 2), True, r < 2),), ())
    >>> shared_keys([tp(r) for r in range(4)])
    {'w': ((0, 2), (1, 3))}
    """
    keys0 = [t.key for t in metas[0].tensors] if metas else []  # type: ignore[attr-defined]
    if len(set(keys0)) == len(keys0) and all([t.key for t in m.tensors] == keys0  # type: ignore[attr-defined]
                                             for m in metas[1:]):
        # every rank lists the same keys in the same order (the usual case): one key's boxes at a time, and a
        # key whose every rank holds a box of its own (FSDP-like) or the same box (replicated) settled at once
        out: Dict[str, Tuple[Tuple[int, ...], ...]] = {}
        ranks = tuple(range(len(metas)))
        for key, column in sorted(zip(keys0, zip(*(m.tensors for m in metas))),  # type: ignore[attr-defined]
                                  key=lambda kc: kc[0]):
            bl = list(map(_BOX, column))
            distinct = set(bl)
            if len(distinct) == len(bl):
                continue
            if len(distinct) == 1:
                out[key] = (ranks,)
            else:
                by_box: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], List[int]] = {}
                for r, box in enumerate(bl):
                    by_box.setdefault(box, []).append(r)
                out[key] = tuple(tuple(g) for _, g in sorted(by_box.items()) if len(g) > 1)
        return out
    return scan_shared_keys(metas)


def scan_shared_keys(metas: Iterable[object]) -> Dict[str, Tuple[Tuple[int, ...], ...]]:
    """:func:`shared_keys` in one pass over ``metas`` (any iterable, each rank's metadata let go once read: a
    benchmark of many ranks streams them), every (key, box) held counted alike."""
    boxes: Dict[Tuple[str, Tuple[int, ...], Tuple[int, ...]], List[int]] = {}
    for r, m in enumerate(metas):
        for t in m.tensors:  # type: ignore[attr-defined]
            boxes.setdefault((t.key, t.offset, t.shape), []).append(r)
    groups: Dict[str, List[Tuple[int, ...]]] = {}
    for (key, _off, _shape), held in sorted(boxes.items()):
        if len(held) > 1:
            groups.setdefault(key, []).append(tuple(held))
    return {k: tuple(g) for k, g in groups.items()}


def copies_of(shared: Dict[str, Tuple[Tuple[int, ...], ...]], world: int) -> List[List[str]]:
    """Each rank's keys in ``shared`` (:func:`shared_keys`): what it checksums for the check.

    >>> copies_of({"a": ((0, 1),), "b": ((1, 2),)}, 3)
    [['a'], ['a', 'b'], ['b']]
    """
    out: List[List[str]] = [[] for _ in range(world)]
    for key, groups in shared.items():
        for ranks in groups:
            for r in ranks:
                out[r].append(key)
    return out


def digests(flat: FlatState, keys: Sequence[str]) -> Dict[str, int]:
    """crc32c of this rank's copy of each key of ``keys`` (its :func:`copies_of`)."""
    out: Dict[str, int] = {}
    for key in keys:
        t = flat.tensors[key].data.detach()
        if t.device.type != "cpu":  # through host memory a bounded slice at a time
            flatv = t.reshape(-1)
            step = max(1, _CHUNK // max(1, t.element_size()))
            value = 0
            for i in range(0, flatv.numel(), step):
                value = _crc32c.crc32c(byte_view(host_contiguous(flatv[i : i + step])), value)
            out[key] = int(value)
        else:
            out[key] = int(_crc32c.crc32c(byte_view(host_contiguous(t))))
    return out


def disagreements(shared: Dict[str, Tuple[Tuple[int, ...], ...]], gathered: Sequence[Dict[str, int]],
                  limit: int = 5) -> Optional[str]:
    """The message naming the keys whose copies differ across ranks, or None when all agree."""
    bad: List[str] = []
    for key, rank_groups in shared.items():
        for ranks in rank_groups:
            groups: Dict[int, List[int]] = {}
            for r in ranks:
                if key in gathered[r]:
                    groups.setdefault(gathered[r][key], []).append(r)
            if len(groups) > 1:
                parts = sorted(groups.values())
                a, b = parts[0], parts[1]
                bad.append(f"key {key!r}: ranks {_ranks(a)} and {_ranks(b)} hold different values")
    if not bad:
        return None
    more = f" (and {len(bad) - limit} more keys)" if len(bad) > limit else ""
    return (
        "; ".join(bad[:limit]) + more + " of a tensor saved once for all of them (a plain tensor means "
        "'the same on every rank', and so do ShardedTensor copies with a non-zero replica_id): only one "
        "copy would be written and the others lost. Describe how it is split instead: a "
        "nostall.ShardedTensor (this rank's piece of a global tensor) or a DTensor; or nostall.PerRank(...) "
        "for a value of each rank's own; for a model and its optimizer, save(step, model=..., "
        "optimizer=...) shards optimizer state like its parameter. check_replicas=False turns this check off"
    )


def _ranks(rs: Sequence[int]) -> str:
    return str(rs[0]) if len(rs) == 1 else str(list(rs))
