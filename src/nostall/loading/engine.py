"""The read engine's torch side: plan reads of saved pieces into tensors, execute them.

Every reader of tensor data into tensors goes through here: :func:`nostall.loading.reader.load_state`,
the DCP reader (:mod:`nostall.interop.dcp`) and the conversions' ``Source``
(:mod:`nostall.interop._common`). The files themselves and the checks of what is read are
:mod:`nostall.loading.sources`' (torch-free).

* :func:`plan_reads` turns a destination region into :class:`Read` s of the pieces it
  intersects (resharding by box intersection); :func:`unique_reads` drops repeats;
* :func:`execute_all` performs a list of :class:`Read` s, file by file: the block-aligned byte
  ranges they need are sorted and coalesced into spans (ranges that touch or overlap, and gaps
  under :data:`COALESCE_GAP`), each span read once into a :class:`SpanBuffers` arena and scattered
  to every destination it covers; each block read is handed once to a
  :class:`~nostall.loading.sources.Verifier`, which checks checksums in a thread while the next
  bytes are read.

The span buffers are the caller's: :func:`execute_all` makes its own for the call (released when it
returns or raises) unless given a :class:`SpanBuffers`, which its owner closes (a conversion's
``Source``, the DCP reader). Their bytes are bounded by the buffers' ``budget`` (a load's default
:data:`SPAN_BUDGET`; an export sets it from its ``memory_limit``); nothing is kept between owners.

Reads are aligned to checksum blocks, so every byte used is verified. A piece needed whole by one
read into a contiguous CPU tensor of its dtype lands straight in that tensor (no extra copy): alone
when it has :data:`DIRECT_MIN` bytes or more (in windows, each checked while the next is read), else
with the pieces next to it in the file by one gathered read (``preadv`` on a filesystem).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from nostall.core.dtypes import torch_dtype
from nostall.core.format import Manifest, PieceRecord, TensorRecord
from nostall.core.model import numel
from nostall.core.tensorbuf import byte_view
from nostall.loading.sources import Blocks, DataFiles, Verifier

Shape = Tuple[int, ...]
VERIFY_WINDOW = 16 << 20
"""A whole piece read straight into its tensor goes in windows of this size, each checked while the next is
read."""
SPAN_BUDGET = 48 << 20
"""A load's span buffers by default: up to three arenas of 16 MiB (one read into while the others' blocks are
checked)."""
ARENAS = 3
"""The most arenas :class:`SpanBuffers` holds."""
COALESCE_GAP = 64 << 10
"""Ranges of one file at most this many bytes apart are read as one span (the gap read and dropped)."""
DIRECT_MIN = 1 << 20
"""A whole piece of at least this many bytes is read alone, straight into its destination, in windows checked
while the next is read; a smaller one with the pieces next to it in the file, by one gathered read."""
GATHER_MAX = 256
"""The most pieces one gathered read fills (with the gaps between them, under the 1,024 buffers of a ``preadv``)."""
COPY_GRAIN = 1 << 15
"""Elements per torch copy into CPU memory: torch's own grain, under which a copy stays on the calling thread
(its intra-op threads would contend with the verifier's, and stall on a busy machine)."""
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
    region's first element and ``strides`` the piece's, in elements. ``whole``: the whole piece, into a
    contiguous CPU tensor of its dtype (copied as bytes); ``direct``: read straight into that tensor."""

    read: Read
    lo: int
    hi: int
    first: int
    strides: Shape
    whole: bool = False
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


def _needs(r: Read, bs: int, shared: bool, window: int) -> Iterator[_Need]:
    """The needs of ``r``: one, or, when its bytes in the piece widened to blocks would pass ``window``, those of
    its chunks (:func:`_chunks`)."""
    piece, box = r.piece, r.box_shape
    dtype = torch_dtype(r.rec.dtype)
    isz = dtype.itemsize
    dest = r.dest
    strides = _strides(piece.shape)
    if box == piece.shape and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype:
        if not shared:
            yield _Need(r, piece.start, piece.end, 0, strides, True, True)
            return
        if piece.nbytes <= window:
            yield _Need(r, piece.start, piece.end, 0, strides, True, False)
            return
    for c in _chunks(r, strides, isz, max(isz, window - bs)):
        first, lo, hi = _block_range(piece, strides, isz, c.box_off, c.box_shape, bs)
        yield _Need(c, lo, hi, first, strides)


def _block_range(piece: PieceRecord, strides: Shape, isz: int, off: Shape, shape: Shape, bs: int
                 ) -> Tuple[int, int, int]:
    """The region ``off`` + ``shape`` (global, inside ``piece``, not empty): its first element in the piece, and
    the bytes of the file from the checksum block holding that element to the end of the one holding its last."""
    first = sum((off[d] - piece.offset[d]) * strides[d] for d in range(len(strides)))
    last = first + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    lo = (first * isz) // bs * bs
    hi = min(-(-(last * isz) // bs) * bs, piece.nbytes)
    return first, piece.start + lo, piece.start + hi


def block_range(piece: PieceRecord, off: Shape, shape: Shape, bs: int) -> Tuple[int, int]:
    """The bytes ``[lo, hi)`` of its file that a load of the region ``off`` + ``shape`` (global, inside ``piece``,
    not empty) reads: whole checksum blocks, from the one holding its first element to the one holding its last
    (what every read of the region here stays within; :mod:`nostall.loading.collective` asks for them)."""
    isz = piece.nbytes // max(1, numel(piece.shape))
    _, lo, hi = _block_range(piece, _strides(piece.shape), isz, off, shape, bs)
    return lo, hi


def _chunks(r: Read, strides: Shape, isz: int, target: int) -> Iterator[Read]:
    """``r``, or its sub-regions in file order whose bytes in the piece (first to last element) are at most
    ``target`` each: split along its first dimension of more than one index, in runs of as many indices as fit,
    a run of one split again along the next."""
    box = r.box_shape
    if (sum((n - 1) * s for n, s in zip(box, strides)) + 1) * isz <= target:
        yield r
        return
    d = next(i for i, n in enumerate(box) if n > 1)
    per = max(1, target // max(1, strides[d] * isz))
    for a in range(0, box[d], per):
        k = min(per, box[d] - a)
        sub = Read(r.rec, r.piece, r.box_off[:d] + (r.box_off[d] + a,) + r.box_off[d + 1:],
                   box[:d] + (k,) + box[d + 1:], r.dest.narrow(d, a, k))
        if k == 1:
            yield from _chunks(sub, strides, isz, target)
        else:
            yield sub


def _spans(needs: List[_Need], window: int) -> Iterator[_Span]:
    """The needs of one file in file order coalesced into spans; direct needs in spans of their own.

    A need inside the current span joins it; one that starts at most :data:`COALESCE_GAP` past its end joins it
    while the span stays within ``window``. So a new span starts past the previous one's end or
    inside the last need of it (a chunk's boundary block), never earlier. A direct need of
    :data:`DIRECT_MIN` bytes or more is a span alone; smaller ones that follow each other in the file without a
    gap over :data:`COALESCE_GAP` share one (read by one gathered read straight into their tensors, a gap into
    a scratch buffer), up to :data:`GATHER_MAX` of them within ``window``.
    """
    cur: Optional[_Span] = None
    for n in sorted(needs, key=lambda n: (n.lo, n.hi)):
        if n.direct:
            if cur is not None and (not cur.needs[0].direct or n.hi - n.lo >= DIRECT_MIN
                                    or not cur.hi <= n.lo <= cur.hi + COALESCE_GAP
                                    or len(cur.needs) >= GATHER_MAX or n.hi - cur.lo > window):
                yield cur
                cur = None
            if n.hi - n.lo >= DIRECT_MIN:
                yield _Span(n.lo, n.hi, [n])
            elif cur is None:
                cur = _Span(n.lo, n.hi, [n])
            else:
                cur.needs.append(n)
                cur.hi = n.hi
        elif cur is not None and not cur.needs[0].direct and n.lo <= cur.hi + COALESCE_GAP and (
                n.hi <= cur.hi or n.hi - cur.lo <= window):
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


class SpanBuffers:
    """The arenas :func:`execute_all` reads spans into, owned by whoever makes them and released by :meth:`close`
    (also a context manager): :func:`execute_all` makes its own for one call when given none; a caller that reads
    many times (a conversion's ``Source``, the DCP reader) may keep one across its reads and close it at its end.

    ``budget``: the bytes all arenas may hold together (:meth:`most`). They are up to :data:`ARENAS` arenas of
    ``budget`` / their number in whole checksum blocks (fewer arenas when one would not hold two blocks), made
    as needed and only as large as what is left to read; a region whose block-aligned bytes would not fit an
    arena is read in chunks that do (a chunk's data at most an arena less one block: its partial blocks at both
    ends fit). A budget under two blocks still takes two (a block's worth of data may straddle two). An arena is
    filled again only once the checks of what it held are done, so a span's bytes stay in place until
    checked, and the previous span's while the next is read.
    """

    def __init__(self, budget: Optional[int] = None) -> None:
        budget = SPAN_BUDGET if budget is None else budget
        if budget <= 0:
            raise ValueError("a span buffer budget must be positive")
        self.budget = budget
        self.ring: List[_Arena] = []
        self.i = 0
        self.bs = 0
        self.left = 0  # bytes of spans this call still reads (arenas are made no larger)
        self.checks: Optional[Verifier] = None

    def arenas(self, bs: int) -> int:
        """How many arenas the budget is cut into for checksum blocks of ``bs`` bytes (each holds two blocks or
        more)."""
        return max(1, min(ARENAS, self.budget // (2 * bs)))

    def window(self, bs: int) -> int:
        """The most bytes one span holds: an arena's share of the budget, in whole blocks (two at least)."""
        return max(2 * bs, self.budget // self.arenas(bs) // bs * bs)

    def most(self, bs: int) -> int:
        """The most bytes the arenas hold at once for blocks of ``bs`` bytes: within the budget, or two blocks
        when the budget is smaller."""
        return self.arenas(bs) * self.window(bs)

    def _begin(self, checks: Verifier, bs: int, left: int) -> None:
        if bs != self.bs:
            self._flush_all()
            self.ring, self.i, self.bs = [], 0, bs
        self.checks, self.left = checks, left

    def take(self, size: int) -> memoryview:
        """A buffer of ``size`` bytes; what the buffers taken before it hold stays until the next round."""
        a = self.ring[self.i] if self.ring else None
        if a is None or a.used + size > len(a.buf):
            if a is not None:
                self._flush(a)
            if len(self.ring) < self.arenas(self.bs):
                a = _Arena(_alloc(max(size, min(self.window(self.bs), self.left))))
                self.ring.append(a)
                self.i = len(self.ring) - 1
            else:
                self.i = (self.i + 1) % len(self.ring)
                a = self.ring[self.i]
                if a.pending is not None:
                    a.pending.exception()  # wait; a mismatch is raised by the checks' finish()
                a.used, a.pending = 0, None
                if len(a.buf) < size:
                    a.buf = memoryview(b"")  # the old arena goes before the new one is made
                    a.buf = _alloc(max(size, min(self.window(self.bs), self.left)))
        a.used += size
        self.left -= size
        return a.buf[a.used - size : a.used]

    def check(self, parts: List[Blocks]) -> None:
        """Check ``parts`` (in the buffer taken last) when its arena is full, or at the end of the call."""
        self.ring[self.i].parts += parts

    def _flush(self, a: _Arena) -> None:
        if a.parts and self.checks is not None:
            a.pending = self.checks.check_all(a.parts, self.bs)
        a.parts = []

    def _flush_all(self) -> None:
        """Hand the checks still held to the verifier (the caller waits for them with its ``finish()``)."""
        for a in self.ring:
            self._flush(a)
        self.checks = None

    def close(self) -> None:
        """Let the arenas go (a check still running holds its arena until it ends); a later call makes new ones."""
        self.ring, self.i, self.checks = [], 0, None

    def __enter__(self) -> "SpanBuffers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _alloc(size: int) -> memoryview:
    """``size`` bytes of new memory, not zeroed (every byte used is read into it first), freed when the last view
    of it goes. (A zeroed ``bytearray`` wrote every page once more before the read did: 16 MiB cost ~25 ms on a
    busy machine, most of a resharded load of 64 MiB.)"""
    return byte_view(torch.empty(size, dtype=torch.uint8))


def execute_all(reads: List[Read], files: DataFiles, m: Manifest, checks: Verifier,
                on_error: Optional[OnError] = None, buffers: Optional[SpanBuffers] = None) -> None:
    """Perform ``reads`` into their destinations, file by file and in file order, each needed byte read once and
    every block read handed once to ``checks`` (the caller waits for them with ``checks.finish()``).

    ``on_error(read, e)``: called with the read at fault when reading (``OSError``) or copying into a destination
    (``RuntimeError``) fails, before the error propagates (it may raise its own). ``buffers``: the span buffers to
    read through (kept by their owner); None: buffers of :data:`SPAN_BUDGET` bytes for this call only.
    """
    own = buffers is None
    ring = SpanBuffers() if buffers is None else buffers
    try:
        bs = m.block_size
        window = ring.window(bs)
        uses = Counter((r.piece.file, r.piece.start) for r in reads)
        by_file: Dict[str, List[_Need]] = {}
        for r in reads:
            if numel(r.box_shape):
                by_file.setdefault(r.piece.file, []).extend(
                    _needs(r, bs, uses[(r.piece.file, r.piece.start)] > 1, window))
        spans = {name: list(_spans(needs, window)) for name, needs in by_file.items()}
        ring._begin(checks, bs, sum(s.hi - s.lo for ss in spans.values() for s in ss if not s.needs[0].direct))
        try:
            _execute_files(spans, files, bs, checks, ring, on_error)
        finally:
            ring._flush_all()
    finally:
        if own:
            ring.close()


def _execute_files(spans: Dict[str, List[_Span]], files: DataFiles, bs: int, checks: Verifier, ring: SpanBuffers,
                   on_error: Optional[OnError]) -> None:
    """:func:`execute_all`'s reads: each file's spans in file order, each read, handed to ``checks`` and
    scattered."""
    gathered: List[Blocks] = []  # pieces read straight into their tensors, checked together
    held = 0  # their bytes
    for name in sorted(spans):
        path = files.path(name)
        prev: Optional[Tuple[_Span, memoryview]] = None
        for item in spans[name]:
            at = item.needs[0].read
            try:
                if item.needs[0].direct:
                    if len(item.needs) == 1 and at.piece.nbytes >= DIRECT_MIN:
                        _read_whole(at, files, bs, checks)
                    else:
                        got = _read_gathered(item, files, name, path)
                        gathered += got
                        held += sum(len(b[0]) for b in got)
                        if held >= VERIFY_WINDOW:
                            checks.check_all(gathered, bs)
                            gathered, held = [], 0
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
    checks.check_all(gathered, bs)


def _read_gathered(span: _Span, files: DataFiles, name: str, path: str) -> List[Blocks]:
    """Whole pieces next to each other in the file, read by one gathered read straight into their tensors; their
    blocks to check."""
    bufs, out = [], []
    pos = span.lo
    for n in span.needs:
        if n.lo > pos:  # bytes between two pieces (padding, a piece not loaded): read and dropped
            bufs.append(memoryview(bytearray(n.lo - pos)))
        b = byte_view(n.read.dest)
        bufs.append(b)
        out.append((b, 0, n.read.piece, n.read.rec, path))
        pos = n.hi
    files.read_into(name, span.lo, bufs)
    return out


def _read_span(span: _Span, prev: Optional[Tuple[_Span, memoryview]], files: DataFiles, name: str,
               ring: SpanBuffers) -> memoryview:
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
    """Copy the region of ``n`` from ``raw``, its bytes from ``lo`` (in the piece) on, into its destination: a
    whole piece as bytes (one memcpy); else by torch, into CPU memory in copies of at most :data:`COPY_GRAIN`
    elements, each on this thread."""
    r = n.read
    if n.whole:
        byte_view(r.dest)[:] = raw
        return
    flat = torch.frombuffer(raw, dtype=torch_dtype(r.rec.dtype))
    first = n.first - lo // flat.element_size()
    box, dest = r.box_shape, r.dest
    if not box:
        dest.copy_(flat[first])
        return
    src = flat.as_strided(box, n.strides, first)
    step = max(1, COPY_GRAIN // max(1, numel(box[1:])))
    if dest.device.type != "cpu" or box[0] <= step:
        dest.copy_(src)
        return
    for a in range(0, box[0], step):
        k = min(step, box[0] - a)
        dest.narrow(0, a, k).copy_(src.narrow(0, a, k))


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
    pieces = rec.pieces
    if shape:  # first the pieces that meet the region's rows (one cheap test each), then the whole boxes
        lo0, hi0 = off[0], off[0] + shape[0]
        pieces = tuple(p for p in pieces if p.offset[0] < hi0 and p.offset[0] + p.shape[0] > lo0)
    for p in pieces:
        po, ps = p.offset, p.shape
        for a, n, b, m in zip(off, shape, po, ps):
            if b < a or b + m > a + n:  # the piece is not inside the region: its overlap with it
                lo = tuple(max(a, b) for a, b in zip(off, po))
                hi = tuple(min(a + n, b + m) for a, n, b, m in zip(off, shape, po, ps))
                if any(h <= l for l, h in zip(lo, hi)):
                    break
                box = tuple(h - l for l, h in zip(lo, hi))
                out.append(Read(rec, p, lo, box, _view(dest, off, shape, lo, box)))
                break
        else:  # the whole piece (the usual case: a load in the saved layout, or of whole tensors)
            if 0 not in ps:
                out.append(Read(rec, p, po, ps, _view(dest, off, shape, po, ps)))


def _view(dest: torch.Tensor, off: Shape, shape: Shape, lo: Shape, box: Shape) -> torch.Tensor:
    """The region ``lo`` + ``box`` (global) of ``dest``, which holds the region ``off`` + ``shape``."""
    view = dest
    for d, (l, n) in enumerate(zip(lo, box)):
        if n != shape[d]:
            view = view.narrow(d, l - off[d], n)
    return view


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
