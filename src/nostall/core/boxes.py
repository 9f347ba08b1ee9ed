"""Boxes (offset + shape) of a global tensor: overlap and exact-cover checks.

:func:`cover_problem` decides whether boxes tile a tensor exactly (every
element held by exactly one box) without comparing boxes pairwise. It uses
the boxes' corners: the indicator of a box ``[lo, hi)`` along one axis is
``step(lo) - step(hi)``, so a sum of box indicators is zero everywhere iff,
after taking differences along the first axis, the signed cross-sections at
every coordinate sum to zero -- recursively, axis by axis. Identical
cross-sections of opposite sign cancel at each level, which is what makes
grid-like layouts (every real sharding) cost O(n * d) dictionary operations
for n boxes in d split dimensions; the worst case is O(n * 2**d). The check
is exact for any layout, pinwheels included.
"""

from __future__ import annotations

import bisect
import math
from typing import Dict, List, Optional, Sequence, Tuple

Shape = Tuple[int, ...]

WORK_PER_BOX = 64
"""Work allowed per box (dictionary operations, pair comparisons) beyond a fixed allowance."""
WORK_FLOOR = 1 << 16


def box_str(offset: Sequence[int], shape: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offset, shape)) + "]"


def overlap(a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int], b_shape: Sequence[int]) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape))


class _OverBudget(Exception):
    pass


def cover_problem(global_shape: Sequence[int], boxes: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> Optional[str]:
    """None when the non-empty boxes tile ``global_shape`` exactly, else what is wrong.

    Boxes outside the global shape are reported too. Costs O(n log n) for the
    layouts real shardings produce; a layout too irregular to decide within
    ``WORK_PER_BOX`` steps per box is reported as a problem (never accepted).
    """
    g = tuple(int(x) for x in global_shape)
    d = len(g)
    nonempty: List[Tuple[Shape, Shape]] = []
    for o, s in boxes:
        off, shp = tuple(o), tuple(s)
        if len(off) != d or len(shp) != d or any(
            a < 0 or n < 0 or a + n > m for a, n, m in zip(off, shp, g)
        ):
            return f"piece {box_str(off, shp)} lies outside the global shape {list(g)}"
        if math.prod(shp) > 0:
            nonempty.append((off, shp))
    if d == 0 and len(nonempty) > 1:
        return "a 0-dimensional tensor has more than one piece"
    covered = sum(math.prod(s) for _, s in nonempty)
    total = math.prod(g)
    if covered < total:
        return (
            f"the pieces cover {covered} of {total} elements of the global shape {list(g)}; "
            "some part of the tensor is held by no rank"
        )
    if total == 0:
        return None  # an empty tensor: nothing to hold (every piece inside it is empty)
    if covered == total:
        budget = WORK_FLOOR + WORK_PER_BOX * len(nonempty)
        try:
            if _tiles(g, nonempty, budget):
                return None
        except _OverBudget:
            found, complete = _find_overlap(nonempty, budget)
            if found is None and complete:
                return None  # every pair compared: no overlap and the volumes add up, so an exact tiling
            if found is None:
                return (
                    f"the layout of its {len(nonempty)} pieces is too irregular to check that they tile the "
                    f"global shape {list(g)} exactly (more than {budget} steps); save it in fewer or "
                    "grid-aligned pieces"
                )
            return found
    # the volumes add up to at least the whole, yet the boxes do not tile it: some element is held twice
    found, _ = _find_overlap(nonempty, WORK_FLOOR + WORK_PER_BOX * len(nonempty))
    if found is not None:
        return found
    return (
        f"some pieces overlap: they hold {covered} elements in all, the global shape {list(g)} has {total}, "
        "but not every element is held exactly once"
    )


def _tiles(g: Shape, boxes: List[Tuple[Shape, Shape]], budget: int) -> bool:
    """True iff ``boxes`` (non-empty, inside ``g``) tile ``g`` exactly. Raises _OverBudget."""
    # Dimensions that every box spans whole factor out of every term: drop them.
    active = [k for k in range(len(g)) if any(o[k] != 0 or s[k] != g[k] for o, s in boxes)]
    # A box as a flat tuple (lo0, hi0, lo1, hi1, ...) over the active dimensions.
    terms: Dict[Tuple[int, ...], int] = {}
    for o, s in boxes:
        key = tuple(v for k in active for v in (o[k], o[k] + s[k]))
        terms[key] = terms.get(key, 0) + 1
    whole = tuple(v for k in active for v in (0, g[k]))
    terms[whole] = terms.get(whole, 0) - 1
    work = len(boxes)
    stack = [terms]
    while stack:
        group = stack.pop()
        if not any(group.values()):
            continue
        if not next(iter(group)):  # no dimension left: a constant that is not zero
            return False
        sub: Dict[int, Dict[Tuple[int, ...], int]] = {}
        for key, sign in group.items():
            if not sign:
                continue
            rest = key[2:]
            lo = sub.setdefault(key[0], {})
            lo[rest] = lo.get(rest, 0) + sign
            hi = sub.setdefault(key[1], {})
            hi[rest] = hi.get(rest, 0) - sign
            work += 2
        if work > budget:
            raise _OverBudget
        stack.extend(sub.values())
    return True


def _find_overlap(boxes: List[Tuple[Shape, Shape]], budget: int) -> Tuple[Optional[str], bool]:
    """(a message naming two overlapping boxes or None, whether every pair was compared).

    Sweeps along the axis where the fewest pairs of boxes overlap, and stops
    after ``budget`` comparisons.
    """
    n = len(boxes)
    if n < 2:
        return None, True
    d = len(boxes[0][0])
    best_axis, best_pairs = 0, None
    for k in range(d):
        starts = sorted(o[k] for o, _ in boxes)
        # pairs (i, j), i before j in start order, whose intervals on axis k overlap
        order = sorted(range(n), key=lambda i: boxes[i][0][k])
        pairs = 0
        for rank, i in enumerate(order):
            end = boxes[i][0][k] + boxes[i][1][k]
            pairs += bisect.bisect_left(starts, end) - rank - 1
        if best_pairs is None or pairs < best_pairs:
            best_axis, best_pairs = k, pairs
    order = sorted(range(n), key=lambda i: boxes[i][0][best_axis])
    work = 0
    for j, i in enumerate(order):
        off, shp = boxes[i]
        end = off[best_axis] + shp[best_axis]
        for j2 in range(j + 1, n):
            off2, shp2 = boxes[order[j2]]
            if off2[best_axis] >= end:
                break
            work += 1
            if work > budget:
                return None, False
            if overlap(off, shp, off2, shp2):
                return f"pieces {box_str(off, shp)} and {box_str(off2, shp2)} overlap", True
    return None, True
