"""Writing one rank's data files from its planned pieces.

The writer knows nothing of ranks or commits: it turns a list of
:class:`~nostall.planning.FilePlan` plus the bytes of each piece into durable
files and returns the block checksums of every piece it wrote.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import torch

from . import storage
from ._tensorbuf import byte_view, host_contiguous
from .format import block_crcs
from .model import FlatState
from .planning import FilePlan, WriteItem

PieceId = Tuple[str, bool, Tuple[int, ...]]  # (key, per_rank, global offset)


@dataclass
class WriteResult:
    """What one rank wrote: block checksums of each piece, bytes."""

    rank: int
    crcs: Dict[PieceId, Tuple[int, ...]]
    nbytes: int


def piece_id(item: WriteItem) -> PieceId:
    return (item.key, item.per_rank, item.offset)


def source_tensor(flat: FlatState, item: WriteItem) -> torch.Tensor:
    """The local tensor holding the bytes of a planned piece."""
    if item.per_rank:
        return flat.per_rank_tensors[item.key]
    return flat.tensors[item.key].data


def write_files(
    files: Sequence[FilePlan],
    directory: str,
    source: Callable[[WriteItem], torch.Tensor],
    rank: int,
    block_size: int,
) -> WriteResult:
    """Write ``files`` into ``directory``, fsync each, return piece checksums."""
    crcs: Dict[PieceId, Tuple[int, ...]] = {}
    total = 0
    for fp in files:

        def chunks(fp: FilePlan = fp) -> Iterator[memoryview]:
            yield memoryview(fp.header)
            for item in fp.items:
                t = host_contiguous(source(item))
                buf = byte_view(t)
                if len(buf) != item.end - item.start:
                    raise RuntimeError(
                        f"key {item.key!r}: tensor has {len(buf)} bytes, the plan expects {item.end - item.start}"
                    )
                crcs[piece_id(item)] = tuple(block_crcs(buf, block_size))
                yield buf
                del buf, t

        path = os.path.join(directory, fp.name)
        n = storage.write_file(path, chunks())
        if n != fp.size:
            raise RuntimeError(f"{path}: wrote {n} bytes, planned {fp.size}")
        total += n
    return WriteResult(rank, crcs, total)
