"""The staging area: one reusable shared-memory region per rank.

``save()`` copies this rank's planned file images (headers and piece bytes)
into the area; the writer process maps the same memory and writes it out.
The area is an anonymous memory file (``memfd``; a deleted temporary file where
memfd is unavailable): it has no name to leak, and is released when the
trainer and the writer have both closed it, however they exit. It is allocated
and touched once, reused while the plan fits, and replaced by a larger one when
it does not. For CUDA tensors the area is registered as pinned memory, so the
device-to-host copies are DMA transfers, issued on a side stream after an event
recorded on the caller's stream (the copies see every kernel queued before
``save()``; later kernels do not wait for them).

Under a host-memory budget the area holds two halves of at most half the
budget each, and the rank's file images go through them in *chunks*
(:func:`cut_chunks`): the trainer copies chunk k+1 into one half while the
writer writes chunk k from the other.

An overlapped copy (the area holding every file image) is *streamed*: its
items are copied in area order, in chunks of about 1/:data:`STREAM_CHUNKS` of
the area (:func:`stream_chunks`), and after each chunk the writer learns how
far the area is staged, so that it writes while the copy goes on.
"""

from __future__ import annotations

import logging
import ctypes
import mmap
import os
import tempfile
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from nostall.planning.plan import FilePlan, WriteItem, file_job
from nostall.core.jobs import FileJob, Segment

log = logging.getLogger("nostall")

_ALIGN = 1 << 21  # grow in 2 MiB steps


def _anonymous_file(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("nostall-staging", getattr(os, "MFD_CLOEXEC", 1))
    else:  # pragma: no cover - non-Linux
        fd, path = tempfile.mkstemp(prefix="nostall-staging-")
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def layout(files: Sequence[FilePlan]) -> Tuple[List[int], int]:
    """Offset of each file image in the area (64-byte aligned) and the bytes needed."""
    offsets, pos = [], 0
    for f in files:
        offsets.append(pos)
        pos += -(-f.size // 64) * 64
    return offsets, pos


@dataclass
class _Cut:
    """A segment being planned: its part in the area, and where its bytes come from."""

    seg: Segment
    item: Optional[WriteItem]  # None: (part of) the file's header
    item_offset: int  # byte offset of the segment within the item's piece (or the header)


def cut_chunks(files: Sequence[FilePlan], capacity: int, block_size: int) -> List[List[_Cut]]:
    """Split the rank's file images, in file order, into chunks of at most ``capacity`` bytes.

    A piece is cut only at multiples of ``block_size`` from its start, so the
    writer's per-block checksums come out as for a whole piece; a header is
    never cut. Raises ValueError when ``capacity`` cannot hold a header or a block.
    """
    need = max([len(f.header) for f in files] + [block_size])
    if capacity < need:
        raise ValueError(f"a staging chunk of {capacity} bytes cannot hold {need} bytes (a file header or a "
                         f"checksum block): raise staging_budget_bytes to at least {2 * need}")
    chunks: List[List[_Cut]] = [[]]
    used = 0

    def add(cut_len: int, fi: int, start: int, item: Optional[WriteItem], item_offset: int) -> None:
        nonlocal used
        chunks[-1].append(_Cut(Segment(fi, start, start + cut_len, used), item, item_offset))
        used = -(-(used + cut_len) // 64) * 64  # every segment 64-byte aligned in the area

    for fi, f in enumerate(files):
        if used + len(f.header) > capacity:
            chunks.append([])
            used = 0
        add(len(f.header), fi, 0, None, 0)
        for item in f.items:
            pos = item.start
            while pos < item.end:
                take = min(item.end - pos, capacity - used)
                if take < item.end - pos:
                    take -= take % block_size  # cut on a block boundary of the piece
                if take <= 0:
                    chunks.append([])
                    used = 0
                    continue
                add(take, fi, pos, item, pos - item.start)
                pos += take
    return [c for c in chunks if c]


STREAM_CHUNKS = 16
"""A streamed copy goes in about this many chunks: the first write waits for 1/16 of the copy (a few ms for
256 MiB), the writer wakes up for a new chunk at most this many times, and the messages (tens of bytes each)
always fit in the socket's buffer, so the copy never waits for the writer."""


@dataclass
class StreamChunk:
    """One chunk of a streamed copy: byte ranges of pieces to copy, and how far the area is staged after them.

    ``copies``: (area offset, item, first, last): bytes [first, last) of the
    item's piece, copied to that offset. ``upto``: every byte of the area
    below it is staged once these are copied (what the writer is told).
    """

    copies: List[Tuple[int, WriteItem, int, int]]
    upto: int


def stream_chunks(todo: Sequence[Tuple[int, WriteItem]], total: int, block_size: int,
                  whole_pieces: bool = False) -> List[StreamChunk]:
    """Cut the pieces still to copy (``todo``: (area offset of the piece, item), in area order) into chunks.

    A chunk holds about ``total`` / :data:`STREAM_CHUNKS` bytes (at least a
    block); a piece is cut only at multiples of ``block_size`` from its start
    (the writer's block checksums come out as for a whole piece), and never
    when ``whole_pieces`` (an incremental save: the writer decides on a whole
    piece before writing it). The last chunk's ``upto`` is ``total``. No
    pieces: no chunks.
    """
    size = max(block_size, -(-total // STREAM_CHUNKS // block_size) * block_size)
    chunks: List[StreamChunk] = []
    cur: List[Tuple[int, WriteItem, int, int]] = []
    used = 0
    for pos, item in todo:
        n, first = item.end - item.start, 0
        while first < n:
            take = n - first
            if not whole_pieces and take > size - used:
                take = (size - used) // block_size * block_size
                if take == 0:  # the room left is less than a block: the chunk is full
                    chunks.append(StreamChunk(cur, pos + first))
                    cur, used = [], 0
                    continue
            cur.append((pos + first, item, first, first + take))
            used += take
            first += take
            if used >= size:
                chunks.append(StreamChunk(cur, pos + first))
                cur, used = [], 0
    if cur:
        chunks.append(StreamChunk(cur, total))
    elif chunks:
        chunks[-1].upto = total
    return chunks


def _copy_elements(src: torch.Tensor, first: int, last: int, dst: torch.Tensor, non_blocking: bool) -> None:
    """Copy elements [first, last) of ``src`` in row-major order into the 1-D ``dst``, any strides, no temporaries."""
    if first >= last:
        return
    if src.dim() == 0 or src.is_contiguous():
        dst.copy_(src.reshape(-1)[first:last], non_blocking=non_blocking)
        return
    row = src[0].numel() if src.shape[0] else 0
    r0, r1 = -(-first // row), last // row  # whole rows [r0, r1)
    if r0 > r1:  # inside one row
        _copy_elements(src[first // row], first % row, last % row or row, dst, non_blocking)
        return
    head = r0 * row - first
    if head:
        _copy_elements(src[r0 - 1], row - head, row, dst[:head], non_blocking)
    if r1 > r0:
        dst[head : head + (r1 - r0) * row].view((r1 - r0,) + tuple(src.shape[1:])).copy_(
            src[r0:r1], non_blocking=non_blocking)
    tail = last - r1 * row
    if tail:
        _copy_elements(src[r1], 0, tail, dst[last - first - tail :], non_blocking)


class StagingArea:
    """A host-memory area shared with the writer process."""

    def __init__(self) -> None:
        self.size = 0
        self.fd: Optional[int] = None
        self._mm: Optional[mmap.mmap] = None
        self._tensor: Optional[torch.Tensor] = None
        self._pinned = False
        self.generation = 0  # bumped at every (re)allocation
        self.fences: dict = {}  # CUDA device -> event on the saving thread's stream (see record_fences)

    def record_fences(self, tensors: Sequence[torch.Tensor]) -> None:
        """In the thread that calls ``save()``: mark, on its current CUDA streams, where the state is final.

        The copies into the area (perhaps issued from another thread) wait for these events.
        """
        self.fences = {}
        for t in tensors:
            if t.device.type == "cuda" and t.device not in self.fences:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(t.device))
                self.fences[t.device] = ev

    def ensure(self, size: int, cap: Optional[int] = None) -> bool:
        """Make the area at least ``size`` bytes (at most ``cap``); True when it was (re)allocated."""
        if size <= self.size and self._mm is not None and (cap is None or self.size <= cap):
            return False
        new_size = max(_ALIGN, -(-int(size) // _ALIGN) * _ALIGN)
        if cap is not None:
            new_size = max(size, min(new_size, cap))
        self.close()
        fd = _anonymous_file(new_size)
        try:
            mm = mmap.mmap(fd, new_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self._mm, self.size = fd, mm, new_size
        self._tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self._tensor.zero_()  # touch every page once, now rather than during saves
        self.generation += 1
        log.debug("staging area of %d bytes allocated", new_size)
        return True

    @property
    def half_size(self) -> int:
        """Bytes of each half of the area (64-byte aligned), when it is used chunk by chunk."""
        return (self.size // 2) // 64 * 64

    @property
    def tensor(self) -> torch.Tensor:
        assert self._tensor is not None
        return self._tensor

    def _pin(self) -> None:
        if self._pinned or self._tensor is None:
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self._tensor.data_ptr(), self.size, 1)  # cudaHostRegisterPortable
        if int(err) != 0:  # pragma: no cover - GPU only
            log.warning("cudaHostRegister of the staging area failed (%s); copies will not be pinned", err)
            return
        self._pinned = True

    def stage(self, files: Sequence[FilePlan], source: Callable[[WriteItem], torch.Tensor],
              now: Optional[Callable[[WriteItem], bool]] = None, cap: Optional[int] = None, block_size: int = 1,
              whole_pieces: bool = False) -> Tuple[Tuple[FileJob, ...], List[StreamChunk]]:
        """Copy the file images of ``files`` into the area: (where each lies, the rest of the copy).

        Headers and the items ``now`` selects (all of them when ``now`` is
        None) are copied before this returns; the others are left in chunks
        (:func:`stream_chunks`) for the overlap thread (:meth:`copy_chunk`).
        """
        offsets, total = layout(files)
        self.ensure(total, cap)
        jobs = tuple(file_job(f, pos) for f, pos in zip(files, offsets))
        area = self.tensor
        for f, pos in zip(files, offsets):
            area[pos : pos + len(f.header)].copy_(torch.frombuffer(bytearray(f.header), dtype=torch.uint8))
        todo = [(pos + item.start, item) for f, pos in zip(files, offsets) for item in f.items]
        first = [t for t in todo if now is None or now(t[1])]
        rest = [t for t in todo if now is not None and not now(t[1])]
        self._copy_items(first, source)
        return jobs, stream_chunks(rest, total, block_size, whole_pieces)

    def copy_chunk(self, chunk: StreamChunk, source: Callable[[WriteItem], torch.Tensor]) -> None:
        """Copy one chunk of a streamed copy into place; its bytes are in host memory when this returns."""
        copier = _Copier(self)
        for pos, item, first, last in chunk.copies:
            copier.copy(source(item), item.key, first, last, item.end - item.start, pos)
        copier.finish()

    def _copy_items(self, todo: Sequence[Tuple[int, WriteItem]], source: Callable[[WriteItem], torch.Tensor]) -> None:
        copier = _Copier(self)
        for pos, item in todo:
            n = item.end - item.start
            if n:
                copier.copy(source(item), item.key, 0, n, n, pos)
        copier.finish()

    def stage_chunk(self, cuts: Sequence[_Cut], half: int, files: Sequence[FilePlan],
                    source: Callable[[WriteItem], torch.Tensor]) -> List[Segment]:
        """Copy one chunk into half ``half`` of the area; returns its segments (area offsets absolute)."""
        base = half * self.half_size
        area = self.tensor
        copier = _Copier(self)
        segs = []
        for c in cuts:
            s = c.seg
            pos = base + s.area_offset
            if c.item is None:
                area[pos : pos + (s.end - s.start)].copy_(torch.frombuffer(bytearray(files[s.file].header),
                                                                           dtype=torch.uint8))
            else:
                copier.copy(source(c.item), c.item.key, c.item_offset, c.item_offset + (s.end - s.start),
                            c.item.end - c.item.start, pos)
            segs.append(Segment(s.file, s.start, s.end, base + s.area_offset))
        copier.finish()
        return segs

    def close(self) -> None:
        """Release the area (the writer keeps its own mapping until it lets go)."""
        if self._pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())  # type: ignore[union-attr]
            except Exception:  # pragma: no cover
                pass
            self._pinned = False
        self._tensor = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # pragma: no cover - a view still exported somewhere
                log.debug("staging area still referenced; leaving it to the garbage collector")
            self._mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.size = 0


class _Copier:
    """Byte ranges of source tensors into the area: CPU copies in place, CUDA ones on a side stream."""

    def __init__(self, area: StagingArea) -> None:
        self.area = area
        self.streams: dict = {}  # device -> side stream

    def copy(self, src: torch.Tensor, key: str, first: int, last: int, total: int, pos: int) -> None:
        """Bytes [first, last) of ``src``'s row-major image (``total`` bytes planned) into the area at ``pos``."""
        size = src.element_size()
        if src.numel() * size != total or first % size or last % size:
            raise RuntimeError(f"key {key!r}: {src.numel() * size} bytes, the plan expects {total} "
                               f"(copying bytes [{first}, {last}))")
        if src.device.type == "cpu" and src.is_contiguous():
            # one memcpy (GIL released), no view of the area made: a third of the cost of torch's copy_ for
            # the many small tensors of an MoE or per-layer state, where the per-call overhead is most of it
            ctypes.memmove(self.area.tensor.data_ptr() + pos, src.data_ptr() + first, last - first)
            return
        dst = self.area.tensor[pos : pos + (last - first)]
        src = src.detach()
        if src.device.type not in ("cpu", "cuda"):
            src = src.to("cpu")
        out = dst.view(src.dtype) if src.dtype != torch.bool else dst.view(torch.bool)
        if src.device.type == "cuda":
            stream = self.streams.get(src.device)
            if stream is None:
                self.area._pin()
                stream = torch.cuda.Stream(src.device)
                fence = self.area.fences.get(src.device)
                if fence is not None:  # recorded by save() on the caller's stream
                    stream.wait_event(fence)
                else:
                    stream.wait_stream(torch.cuda.current_stream(src.device))
                self.streams[src.device] = stream
            with torch.cuda.stream(stream):
                src.record_stream(stream)  # the allocator keeps the memory until the copy is done
                _copy_elements(src, first // size, last // size, out, True)
        else:
            _copy_elements(src, first // size, last // size, out, False)

    def finish(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()
        self.streams.clear()
