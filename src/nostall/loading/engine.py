"""The read engine's torch side: plan reads of saved pieces into tensors, execute them.

Every reader of tensor data into tensors goes through here: :func:`nostall.loading.reader.load_state`,
the DCP reader (:mod:`nostall.interop.dcp`) and the conversions' ``Source``
(:mod:`nostall.interop._common`). The files themselves and the checks of what is read are
:mod:`nostall.loading.sources`' (torch-free).

* :func:`plan_reads` turns a destination region into :class:`Read` s of the pieces it
  intersects (resharding by box intersection); :func:`unique_reads` drops repeats;
* :func:`execute` performs one :class:`Read` into its destination, handing what it read to a
  :class:`~nostall.loading.sources.Verifier`, which checks checksums in a thread while the next
  bytes are read.

Reads are aligned to checksum blocks, so every byte used is verified; a piece needed whole lands
straight in the destination tensor (no extra copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from nostall.core.dtypes import torch_dtype
from nostall.core.format import Manifest, PieceRecord, TensorRecord
from nostall.core.model import numel
from nostall.core.tensorbuf import byte_view
from nostall.loading.sources import READ_CHUNK, DataFiles, Verifier

Shape = Tuple[int, ...]
VERIFY_WINDOW = 16 << 20
"""Whole-piece reads go in windows of this size, each checked while the next is read."""


@dataclass
class Read:
    """One read: the region ``box_off`` + ``box_shape`` (global coordinates, inside ``piece``) of ``rec``."""

    rec: TensorRecord
    piece: PieceRecord
    box_off: Shape  # global offset of the region to read (inside the piece)
    box_shape: Shape
    dest: torch.Tensor  # view of the destination covering exactly the region


def execute(r: Read, files: DataFiles, m: Manifest, checks: Verifier) -> None:
    """Perform the read ``r`` into ``r.dest``: straight into it when it is the whole piece in CPU memory,
    else in row spans of about :data:`READ_CHUNK`; every block read goes to ``checks``."""
    piece = r.piece
    if numel(r.box_shape) == 0:
        return
    dtype = torch_dtype(r.rec.dtype)
    dest = r.dest
    if r.box_shape == piece.shape and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype:
        _read_whole(r, files, m.block_size, checks)
        return
    path = files.path(piece.file)
    bs, isz = m.block_size, dtype.itemsize
    pshape = piece.shape
    nd = len(pshape)
    strides = [1] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * pshape[d + 1]
    loc = [b - p for b, p in zip(r.box_off, piece.offset)]
    if nd == 0:
        rows = [(0, 1)]
    else:
        per = max(1, READ_CHUNK // max(1, strides[0] * isz))
        rows = [(a, min(a + per, loc[0] + r.box_shape[0])) for a in range(loc[0], loc[0] + r.box_shape[0], per)]
    for a, b in rows:
        if nd == 0:
            first, last = 0, 1
        else:
            first = a * strides[0] + sum(loc[d] * strides[d] for d in range(1, nd))
            last = (b - 1) * strides[0] + sum((loc[d] + r.box_shape[d] - 1) * strides[d] for d in range(1, nd)) + 1
        lo = (first * isz) // bs * bs
        hi = min(-(-(last * isz) // bs) * bs, piece.nbytes)
        buf = files.read(piece.file, piece.start + lo, hi - lo)
        checks.check(buf, lo // bs, piece, r.rec, path, bs)
        flat = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
        if nd == 0:
            src = flat.reshape(())
            dst = dest
        else:
            src = flat.as_strided((b - a,) + tuple(r.box_shape[1:]), strides, first - lo // isz)
            dst = dest.narrow(0, a - loc[0], b - a)
        dst.copy_(src)


def _read_whole(r: Read, files: DataFiles, bs: int, checks: Verifier) -> None:
    """A whole piece straight into its contiguous CPU destination, in windows checked while the next is read."""
    piece = r.piece
    path = files.path(piece.file)
    buf = byte_view(r.dest)
    window = max(bs, VERIFY_WINDOW // bs * bs)  # whole blocks, so each window checks on its own
    for lo in range(0, piece.nbytes, window):
        part = buf[lo : min(lo + window, piece.nbytes)]
        files.read(piece.file, piece.start + lo, len(part), into=part)
        checks.check(part, lo // bs, piece, r.rec, path, bs)


def plan_reads(rec: TensorRecord, dest: torch.Tensor, off: Shape, out: List[Read]) -> None:
    """Append to ``out`` the reads filling ``dest`` (global region ``off`` + dest.shape) from ``rec``'s pieces."""
    shape = tuple(dest.shape)
    if numel(shape) == 0:
        return
    for p in rec.pieces:
        lo = tuple(max(a, b) for a, b in zip(off, p.offset))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(off, shape, p.offset, p.shape))
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        box = tuple(h - l for l, h in zip(lo, hi))
        view = dest
        for d, (l, n) in enumerate(zip(lo, box)):
            view = view.narrow(d, l - off[d], n)
        out.append(Read(rec, p, lo, box, view))


def unique_reads(reads: List[Read]) -> List[Read]:
    """``reads`` without repeats: a read of the same saved bytes into the same memory as an earlier one.

    A tied model (one Parameter under two keys) saved with tied keys gives two reads per piece that
    are the same read; one is enough.
    """
    seen = set()
    out = []
    for r in reads:
        d, p = r.dest, r.piece
        ident = (str(d.device), d.dtype, d.data_ptr(), tuple(d.shape), tuple(d.stride()),
                 p.file, p.start, p.end, p.crc32c, r.box_off, r.box_shape)
        if ident not in seen:
            seen.add(ident)
            out.append(r)
    return out


def in_file_order(reads: List[Read]) -> List[Read]:
    """``reads`` sorted by file and offset (each file read front to back)."""
    return sorted(reads, key=lambda r: (r.piece.file, r.piece.start))
