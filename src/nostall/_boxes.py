"""Boxes (offset + shape) of a global tensor: overlap and exact-cover checks."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

Shape = Tuple[int, ...]


def box_str(offset: Sequence[int], shape: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offset, shape)) + "]"


def overlap(a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int], b_shape: Sequence[int]) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape))


def cover_problem(global_shape: Sequence[int], boxes: Sequence[Tuple[Shape, Shape]]) -> Optional[str]:
    """None when the non-empty boxes tile ``global_shape`` exactly, else what is wrong.

    Boxes are assumed to lie inside the global shape.
    """
    nonempty: List[Tuple[int, Shape, Shape]] = [
        (i, tuple(o), tuple(s)) for i, (o, s) in enumerate(boxes) if math.prod(s) > 0
    ]
    if global_shape:
        nonempty.sort(key=lambda b: b[1][0])
        for j, (i, off, shp) in enumerate(nonempty):
            end0 = off[0] + shp[0]
            for _, off2, shp2 in nonempty[j + 1 :]:
                if off2[0] >= end0:
                    break
                if overlap(off, shp, off2, shp2):
                    return f"pieces {box_str(off, shp)} and {box_str(off2, shp2)} overlap"
    elif len(nonempty) > 1:
        return "a 0-dimensional tensor has more than one piece"
    covered = sum(math.prod(s) for _, _, s in nonempty)
    total = math.prod(global_shape)
    if covered != total:
        return (
            f"the pieces cover {covered} of {total} elements of the global shape {list(global_shape)}; "
            "some part of the tensor is held by no rank"
        )
    return None
