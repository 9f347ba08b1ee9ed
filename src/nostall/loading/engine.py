"""The read engine's torch side: plan reads of saved pieces into tensors, execute them.

Every reader of tensor data into tensors goes through here: :func:`nostall.loading.reader.load_state`,
the DCP reader (:mod:`nostall.interop.dcp`) and the conversions' ``Source``
(:mod:`nostall.interop._common`). The files themselves and the checks of what is read are
:mod:`nostall.loading.sources`' (torch-free).

* :func:`plan_reads` turns a destination region into :class:`Read` s of the pieces it
  intersects (resharding by box intersection); :func:`unique_reads` drops repeats;
* :func:`execute_all` performs a list of :class:`Read` s, file by file: the block-aligned byte
  ranges they need are sorted and coalesced into spans of at most :data:`VERIFY_WINDOW` (ranges
  that touch or overlap, and gaps under :data:`COALESCE_GAP`), each span read once into a reused
  buffer and scattered to every destination it covers; each block read is handed once to a
  :class:`~nostall.loading.sources.Verifier`, which checks checksums in a thread while the next
  bytes are read.

Reads are aligned to checksum blocks, so every byte used is verified; a piece of at least
:data:`DIRECT_MIN` bytes needed whole, by one read into a contiguous CPU tensor of its dtype, lands
straight in that tensor (no extra copy).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from nostall.core.dtypes import torch_dtype
from nostall.core.format import Manifest, PieceRecord, TensorRecord
from nostall.core.model import numel
from nostall.core.tensorbuf import byte_view
from nostall.loading.sources import Blocks, DataFiles, Verifier

Shape = Tuple[int, ...]
VERIFY_WINDOW = 16 << 20
"""Reads go in windows of about this size (spans of coalesced ranges, windows of a whole-piece read), each
checked while the next is read."""
COALESCE_GAP = 64 << 10
"""Ranges of one file at most this many bytes apart are read as one span (the gap read and dropped)."""
DIRECT_MIN = 1 << 20
"""A whole piece of at least this many bytes is read straight into its destination when it can be."""
OnError = Callable[["Read", Exception], None]


@dataclass
class Read:
    """One read: the region ``box_off`` + ``box_shape`` (global coordinates, inside ``piece``) of ``rec``."""

    rec: TensorRecord
    piece: PieceRecord
    box_off: Shape  # global offset of the region to read (inside the piece)
    box_shape: Shape
    dest: torch.Tensor  # view of the destination covering exactly the region


@dataclass
class _Need:
    """The bytes ``[lo, hi)`` of its file (block-aligned in the piece) that ``read`` needs; ``first`` is the
    region's first element and ``strides`` the piece's, in elements."""

    read: Read
    lo: int
    hi: int
    first: int
    strides: Shape
    direct: bool = False


@dataclass
class _Span:
    """The bytes ``[lo, hi)`` of a file, read at once, covering ``needs``."""

    lo: int
    hi: int
    needs: List[_Need] = field(default_factory=list)


def _strides(shape: Shape) -> Shape:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return tuple(out)


def _needs(r: Read, bs: int, shared: bool) -> Iterator[_Need]:
    """The needs of ``r``: one, or its row chunks of about :data:`VERIFY_WINDOW` bytes when it is larger."""
    piece, box = r.piece, r.box_shape
    dtype = torch_dtype(r.rec.dtype)
    isz = dtype.itemsize
    dest = r.dest
    strides = _strides(piece.shape)
    if (not shared and box == piece.shape and piece.nbytes >= DIRECT_MIN and dest.device.type == "cpu"
            and dest.is_contiguous() and dest.dtype == dtype):
        yield _Need(r, piece.start, piece.end, 0, strides, True)
        return
    rows = [r]
    if box and numel(box) * isz > VERIFY_WINDOW:
        per = max(1, VERIFY_WINDOW // max(1, strides[0] * isz))
        rows = [Read(r.rec, piece, (r.box_off[0] + a,) + r.box_off[1:], (min(per, box[0] - a),) + box[1:],
                     dest.narrow(0, a, min(per, box[0] - a))) for a in range(0, box[0], per)]
    for c in rows:
        first = sum((c.box_off[d] - piece.offset[d]) * strides[d] for d in range(len(strides)))
        last = first + sum((n - 1) * s for n, s in zip(c.box_shape, strides)) + 1
        lo = (first * isz) // bs * bs
        hi = min(-(-(last * isz) // bs) * bs, piece.nbytes)
        yield _Need(c, piece.start + lo, piece.start + hi, first, strides)


def _spans(needs: List[_Need]) -> Iterator[_Span]:
    """The needs of one file in file order coalesced into spans, a direct need alone in its own.

    A need inside the current span joins it; one that starts at most :data:`COALESCE_GAP` past its end joins it
    while the span stays within :data:`VERIFY_WINDOW`. So a new span starts past the previous one's end or
    inside the last need of it (a row chunk's boundary block), never earlier.
    """
    cur: Optional[_Span] = None
    for n in sorted(needs, key=lambda n: (n.lo, n.hi)):
        if n.direct:
            if cur is not None:
                yield cur
                cur = None
            yield _Span(n.lo, n.hi, [n])
        elif cur is not None and n.lo <= cur.hi + COALESCE_GAP and (
                n.hi <= cur.hi or n.hi - cur.lo <= VERIFY_WINDOW):
            cur.needs.append(n)
            cur.hi = max(cur.hi, n.hi)
        else:
            if cur is not None:
                yield cur
            cur = _Span(n.lo, n.hi, [n])
    if cur is not None:
        yield cur


class _Arena:
    """A buffer that spans are placed in one after the other, and the checks of what they hold, handed to the
    verifier in one task when the arena is full (``pending``: that task)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.used = 0
        self.parts: List[Blocks] = []
        self.pending: Optional["Future[None]"] = None


class _Buffers:
    """A ring of arenas for span buffers, taken from a pool kept across loads (their pages are not faulted in
    again) and given back at :meth:`close`. An arena is filled again only once its checks are done, so the
    previous span's bytes stay in place while the next span is read."""

    _pool: List[_Arena] = []
    _lock = threading.Lock()
    KEEP = 3

    def __init__(self, checks: Verifier, bs: int) -> None:
        self.checks, self.bs = checks, bs
        with self._lock:
            self.ring = self._pool[: self.KEEP]
            del self._pool[: self.KEEP]
        self.ring += [_Arena(memoryview(bytearray(0))) for _ in range(self.KEEP - len(self.ring))]
        self.i = 0

    def take(self, size: int) -> memoryview:
        """A buffer of ``size`` bytes; what the buffers taken before it hold stays until the next round."""
        a = self.ring[self.i]
        if a.used + size > len(a.buf):
            self._flush(a)
            self.i = (self.i + 1) % len(self.ring)
            a = self.ring[self.i]
            if a.pending is not None:
                a.pending.exception()  # wait; a mismatch is raised by the checks' finish()
            a.used, a.pending = 0, None
            if len(a.buf) < size:
                a.buf = memoryview(bytearray(max(size, VERIFY_WINDOW)))
        a.used += size
        return a.buf[a.used - size : a.used]

    def check(self, parts: List[Blocks]) -> None:
        """Check ``parts`` (in the buffer taken last) when its arena is full."""
        self.ring[self.i].parts += parts

    def _flush(self, a: _Arena) -> None:
        if a.parts:
            a.pending = self.checks.check_all(a.parts, self.bs)
            a.parts = []

    def close(self) -> None:
        """Hand the checks still held to the verifier; give the arenas back to the pool."""
        for a in self.ring:
            self._flush(a)
        keep = [a for a in self.ring if 0 < len(a.buf) <= 2 * VERIFY_WINDOW]
        with self._lock:
            self._pool[:] = (self._pool + keep)[: self.KEEP]


def execute_all(reads: List[Read], files: DataFiles, m: Manifest, checks: Verifier,
                on_error: Optional[OnError] = None) -> None:
    """Perform ``reads`` into their destinations, file by file and in file order, each needed byte read once and
    every block read handed once to ``checks`` (the caller waits for them with ``checks.finish()``).

    ``on_error(read, e)``: called with the read at fault when reading (``OSError``) or copying into a destination
    (``RuntimeError``) fails, before the error propagates (it may raise its own).
    """
    bs = m.block_size
    uses = Counter((r.piece.file, r.piece.start) for r in reads)
    by_file: Dict[str, List[_Need]] = {}
    for r in reads:
        if numel(r.box_shape):
            by_file.setdefault(r.piece.file, []).extend(_needs(r, bs, uses[(r.piece.file, r.piece.start)] > 1))
    ring = _Buffers(checks, bs)
    try:
        _execute_files(by_file, files, bs, checks, ring, on_error)
    finally:
        ring.close()


def _execute_files(by_file: Dict[str, List[_Need]], files: DataFiles, bs: int, checks: Verifier, ring: _Buffers,
                   on_error: Optional[OnError]) -> None:
    """:func:`execute_all`'s reads: each file's spans in file order, each read, handed to ``checks`` and
    scattered."""
    for name in sorted(by_file):
        path = files.path(name)
        prev: Optional[Tuple[_Span, memoryview]] = None
        for item in _spans(by_file[name]):
            at = item.needs[0].read
            try:
                if item.needs[0].direct:
                    _read_whole(at, files, bs, checks)
                    continue
                buf = _read_span(item, prev, files, name, ring)
                ring.check(_to_check(item, prev, buf, path, bs))
                prev = (item, buf)
                for n in item.needs:
                    at = n.read
                    _scatter(n, buf[n.lo - item.lo : n.hi - item.lo], n.lo - n.read.piece.start)
            except (OSError, RuntimeError) as e:
                if on_error is not None:
                    on_error(at, e)
                raise


def execute(r: Read, files: DataFiles, m: Manifest, checks: Verifier) -> None:
    """Perform the one read ``r`` (see :func:`execute_all`)."""
    execute_all([r], files, m, checks)


def _read_span(span: _Span, prev: Optional[Tuple[_Span, memoryview]], files: DataFiles, name: str,
               ring: _Buffers) -> memoryview:
    """The bytes of ``span``, in a ring buffer: what overlaps the previous span copied from its buffer (read and
    handed to the checks already), the rest read."""
    buf = ring.take(span.hi - span.lo)
    start = span.lo
    if prev is not None and prev[0].hi > span.lo:
        keep = prev[0].hi - span.lo
        buf[:keep] = prev[1][span.lo - prev[0].lo : prev[0].hi - prev[0].lo]
        start = prev[0].hi
    if span.hi > start:
        files.read(name, start, span.hi - start, into=buf[start - span.lo :])
    return buf


def _to_check(span: _Span, prev: Optional[Tuple[_Span, memoryview]], buf: memoryview, path: str,
              bs: int) -> List[Blocks]:
    """The blocks of ``span`` to check, as (bytes, their first block in the piece, piece, record, path): those its
    needs cover, each once, less what the previous span checked."""
    floor = prev[0].hi if prev is not None and prev[0].hi > span.lo else span.lo
    ranges: Dict[Tuple[int, int], List[Tuple[int, int, Read]]] = {}
    for n in span.needs:
        lo = max(n.lo, floor)
        if n.hi > lo:
            ranges.setdefault((n.read.piece.start, n.read.piece.end), []).append((lo, n.hi, n.read))
    out = []
    for parts in ranges.values():
        parts.sort(key=lambda x: x[0])
        lo, hi, r = parts[0]
        for a, b, _ in parts[1:]:
            if a > hi:
                out.append((buf[lo - span.lo : hi - span.lo], (lo - r.piece.start) // bs, r.piece, r.rec, path))
                lo = a
            hi = max(hi, b)
        out.append((buf[lo - span.lo : hi - span.lo], (lo - r.piece.start) // bs, r.piece, r.rec, path))
    return out


def _scatter(n: _Need, raw: memoryview, lo: int) -> None:
    """Copy the region of ``n`` from ``raw``, its bytes from ``lo`` (in the piece) on, into its destination."""
    r = n.read
    flat = torch.frombuffer(raw, dtype=torch_dtype(r.rec.dtype))
    first = n.first - lo // flat.element_size()
    if not r.box_shape:
        r.dest.copy_(flat[first])
        return
    r.dest.copy_(flat.as_strided(r.box_shape, n.strides, first))


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
