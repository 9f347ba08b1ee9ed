"""The background writer process: runs save jobs from the shared staging area.

This module does not import torch (a test checks it). :func:`main` is the
process's loop: it maps the staging area the trainer shares, and runs each
save job with the same routine a synchronous save runs inline
(:func:`nostall.saving.commit.run_job`), its bytes read from the area (whole, or
chunk by chunk under a host-memory budget, :func:`write_chunked`) and the
ranks meeting through records on the root. Messages are :class:`~nostall.core.jobs.Msg`.
An overlapped save's job is *streamed* (``SaveJob.streamed``): its files lie
whole in the area, and the trainer's copy thread says, chunk by chunk, how far
the area is staged (:func:`stream_segments`): the write starts with the first
chunk, through the same chunked path.

Rank 0's job carries the manifest to commit, whose bulk (the tensor records)
is the same for every save of one plan: it travels apart from the job
(:func:`without_records`), once per plan, and the writer keeps it for the
jobs that follow (:func:`with_records`).
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Tuple

from nostall.saving.commit import RecordBarrier, run_job
from nostall.saving.datafiles import Base, Checksums, History, Writer, collect, file_out, report_pacing, write_files
from nostall.errors import CheckpointSaveError
from nostall.core.format import Manifest, TensorRecord
from nostall.core.jobs import FileJob, JobResult, Msg, Op, SaveJob, Segment, Written
from nostall.storage import files as storage

log = logging.getLogger("nostall")

# The next chunk of a chunked job (its segments), after releasing the previous one; None: no more.
ChunkFeed = Callable[[], Optional[List[Segment]]]

ManifestRecords = Tuple[Dict[str, TensorRecord], Tuple[Dict[str, TensorRecord], ...]]
"""A manifest's tensor records: global, and each rank's."""


def without_records(manifest: Manifest) -> Tuple[Manifest, ManifestRecords]:
    """``manifest`` without its tensor records, and those records (see :func:`with_records`)."""
    records = (manifest.tensors, tuple(r.tensors for r in manifest.per_rank))
    bare = replace(manifest, tensors={}, per_rank=tuple(replace(r, tensors={}) for r in manifest.per_rank))
    return bare, records


def with_records(manifest: Manifest, records: ManifestRecords) -> Manifest:
    """The manifest that :func:`without_records` took ``records`` from."""
    tensors, per_rank = records
    if len(per_rank) != len(manifest.per_rank):
        raise CheckpointSaveError(f"the writer holds tensor records for {len(per_rank)} ranks, the manifest of "
                                  f"this save has {len(manifest.per_rank)}: a message from the trainer was lost")
    return replace(manifest, tensors=tensors,
                   per_rank=tuple(replace(r, tensors=t) for r, t in zip(manifest.per_rank, per_rank)))


def from_area(area: memoryview) -> Writer:
    """Write a job whose file images lie whole in the staging area."""

    def source(i: int, f: FileJob) -> Tuple[memoryview, List[Tuple[int, memoryview]]]:
        header = area[f.area_offset : f.area_offset + f.header_size]
        return header, [(s, area[f.area_offset + s : f.area_offset + e]) for s, e in f.pieces]

    return write_files(source)


def write_chunked(area: memoryview, feed: ChunkFeed, release: bool = True) -> Writer:
    """Write a job whose bytes arrive chunk by chunk (a host-memory budget, or a streamed job).

    Segments come in file order, each within a file's header or one piece. A
    chunk is released (its half of the area reused by the trainer) once
    every segment of it is written and checksummed; ``release`` False (a
    streamed job, whose area is not reused before the job ends): the
    checksums of a chunk may still run when the next one is asked for.
    """

    def write(job: SaveJob, staging: str, base: Optional[Base]) -> Written:
        pacer = storage.Pacer(job.max_write_rate, job.timeout)
        outs = []
        with Checksums(job.block_size) as sums:

            def segments() -> Iterator[Segment]:
                while True:
                    if release:
                        sums.drain()  # the chunk's bytes are checksummed before its half is handed back
                    chunk = feed()
                    if chunk is None:
                        return
                    yield from chunk

            source = segments()
            for fi, f in enumerate(job.files):
                with file_out(job, f, staging, sums, pacer, base) as out:
                    pos = 0
                    while pos < f.size:
                        seg = next(source, None)
                        if seg is None or seg.file != fi or seg.start != pos:
                            raise RuntimeError(f"{f.name}: the trainer sent {seg} where byte {pos} of file {fi} is due")
                        out.add(seg.start, area[seg.area_offset : seg.area_offset + seg.end - seg.start])
                        pos = seg.end
                    outs.append((f, out.close(), out.ids))
                for start, end in f.pieces:
                    sums.expect((f.name, start, end))  # empty pieces have no segment
            report_pacing(job, pacer)
            return collect(job, outs, sums.result(), base)

    return write


# --------------------------------------------------------------------------- the process


def _lower_priority() -> None:
    try:
        os.nice(10)
    except OSError:
        pass
    if sys.platform.startswith("linux"):
        try:  # ioprio_set(IOPRIO_WHO_PROCESS, 0, best-effort class, level 7)
            import ctypes
            import platform

            nr = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}.get(platform.machine())
            if nr is not None:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.syscall(nr, 1, 0, (2 << 13) | 7)
        except Exception:
            pass


LOG_LEVEL_ENV = "NOSTALL_WRITER_LOG_LEVEL"


def _log_like_the_trainer() -> None:
    """Send this process's nostall log records to stderr at the trainer's level (upload progress, retries)."""
    level = os.environ.get(LOG_LEVEL_ENV)
    if not level:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[nostall writer %(process)d] %(levelname)s %(message)s"))
    logger = logging.getLogger("nostall")
    logger.addHandler(handler)
    logger.setLevel(int(level))
    logger.propagate = False


def _next_chunk(conn: Any, deadline: float, last: int) -> Msg:
    """The trainer's next CHUNK message (bounded by ``deadline``); a CHUNK_ABORT raises."""
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"no staged chunk from the trainer after chunk {last}")
    msg: Msg = conn.recv()
    if msg.op is Op.CHUNK_ABORT:
        raise CheckpointSaveError(f"the trainer stopped staging: {msg.text}")
    if msg.op is not Op.CHUNK:
        raise RuntimeError(f"expected a staged chunk from the trainer, got {msg.op}")
    return msg


def _chunk_feed(conn: Any, deadline: float) -> ChunkFeed:
    """Chunks of the job in progress, from the trainer (CHUNK or CHUNK_ABORT messages)."""
    last = [-1]

    def feed() -> Optional[List[Segment]]:
        if last[0] >= 0:
            conn.send(Msg(Op.CHUNK_DONE, index=last[0]))  # its half of the area may be reused
        msg = _next_chunk(conn, deadline, last[0])
        last[0] = msg.index
        return msg.segments

    return feed


def _area_segments(files: List[FileJob]) -> Iterator[Tuple[Segment, int]]:
    """Every header and non-empty piece of a job whose files lie whole in the area, in area order, each with
    where its piece starts (-1: a header)."""
    for fi, f in enumerate(files):
        yield Segment(fi, 0, f.header_size, f.area_offset), -1
        for start, end in f.pieces:
            if end > start:
                yield Segment(fi, start, end, f.area_offset + start), start


def stream_segments(job: SaveJob) -> Callable[[int], List[Segment]]:
    """For a streamed job: the segments newly staged once the area is staged up to a given offset.

    The trainer stages in area order and says how far it got; a piece it
    has staged part of is cut there, which must be a checksum-block boundary
    of the piece (else the block checksums would not be a whole save's), and
    a header is never cut.
    """
    todo = _area_segments(list(job.files))
    held: List[Tuple[Segment, int]] = []  # the rest of the segment the last offset fell inside

    def upto(offset: int) -> List[Segment]:
        out: List[Segment] = []
        while True:
            seg, piece = held.pop() if held else next(todo, (None, 0))
            if seg is None:
                return out
            if seg.area_offset >= offset:
                held.append((seg, piece))
                return out
            if seg.area_offset + seg.end - seg.start <= offset:
                out.append(seg)
                continue
            cut = seg.start + offset - seg.area_offset
            if piece < 0 or (cut - piece) % job.block_size:
                raise RuntimeError(f"{job.files[seg.file].name}: the trainer staged up to byte {cut}, "
                                   "inside its header or off a checksum-block boundary of a piece")
            out.append(Segment(seg.file, seg.start, cut, seg.area_offset))
            held.append((Segment(seg.file, cut, seg.end, offset), piece))
            return out

    return upto


def _stream_feed(conn: Any, job: SaveJob, deadline: float) -> ChunkFeed:
    """Chunks of a streamed job: each CHUNK message says how far the area is staged (``size``)."""
    segments = stream_segments(job)
    last = [-1]

    def feed() -> Optional[List[Segment]]:
        msg = _next_chunk(conn, deadline, last[0])
        last[0] = msg.index
        return segments(msg.size)

    return feed


def _exit_now() -> NoReturn:
    """End the process at once, skipping the interpreter's shutdown.

    Once the trainer is gone (or has stopped us) nothing is left to do, and a
    normal exit -- atexit handlers, then finalizing every module, long with
    fsspec/s3fs loaded and slow in this niced process on a busy machine --
    keeps the process alive 0.1-1 s after its trainer, with the watchdog
    thread already frozen by the finalization.
    """
    for stream in (sys.stderr, sys.stdout):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)


class _Server:
    """The writer process's state between messages: the channel, the mapped staging area, the history."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.conn = Connection(os.dup(fd))
        self.area: Optional[mmap.mmap] = None
        self.view: Optional[memoryview] = None
        self.history = History()  # this rank's last committed save, for incremental saves
        self.records: Optional[ManifestRecords] = None  # rank 0: the tensor records of the plan of its last job
        # The priority drops once the writer is ready, not at start: start-up imports at nice 10 on a busy
        # machine took seconds of the first save's deadline (importing s3fs 0.6 s at nice 0, 5 s at nice 10).
        self.lowered = False

    def serve(self, msg: Msg) -> None:
        """Answer one message from the trainer (STOP is the caller's)."""
        if msg.op is Op.ATTACH:
            self.attach(msg.size)
        elif msg.op is Op.WARM:
            try:
                msg.root.warm()
            except Exception as e:  # the first save will meet (and report) the cause
                log.warning("getting ready to write to %s failed: %s", msg.root, e)
            self.lower_priority()
        elif msg.op is Op.SAVE:
            self.lower_priority()
            assert msg.job is not None
            if msg.records is not None:
                self.records = msg.records
            self.save(msg.job)
        elif msg.op is Op.PING:
            self.conn.send(Msg(Op.PONG, size=os.getpid()))
        # Anything else is dropped: a CHUNK (or CHUNK_ABORT) that arrives after its job already failed and
        # reported (a streamed copy does not wait for the writer, so its later chunks may still come).

    def lower_priority(self) -> None:
        """Yield CPU and I/O to the trainer from now on (once: the writer is ready)."""
        if not self.lowered:
            _lower_priority()
            self.lowered = True

    def attach(self, size: int) -> None:
        """Map the staging area whose descriptor the trainer sends next (a new one replaces the last)."""
        (afd,) = recvfds(self.sock, 1)
        self.release_area()
        self.area = mmap.mmap(afd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(afd)
        self.view = memoryview(self.area)
        self.conn.send(Msg(Op.ATTACHED, size=size))

    def save(self, job: SaveJob) -> None:
        """Run one save job and report its result; then run what rank 0 left for after the report.

        The trainer learns of the commit first; retention and the sweep follow (the next job
        waits for them).
        """
        if self.view is None:
            result = JobResult(job.save_id, False, f"rank {job.rank}: writer has no staging area")
            self.conn.send(Msg(Op.RESULT, result=result))
            return
        if job.manifest is not None and self.records is not None:
            try:
                job = replace(job, manifest=with_records(job.manifest, self.records))
            except CheckpointSaveError as e:
                self.conn.send(Msg(Op.RESULT, result=JobResult(job.save_id, False, f"rank {job.rank}: {e}")))
                return
        deadline = time.monotonic() + job.timeout
        write = (write_chunked(self.view, _stream_feed(self.conn, job, deadline), release=False) if job.streamed
                 else write_chunked(self.view, _chunk_feed(self.conn, deadline)) if job.chunked
                 else from_area(self.view))
        later: List[Callable[[], None]] = []
        result = run_job(job, write, RecordBarrier(), self.history, later)
        self.conn.send(Msg(Op.RESULT, result=result))
        for step in later:
            step()

    def release_area(self) -> None:
        """Unmap the staging area (before mapping a new one, or at exit)."""
        if self.view is not None:
            self.view.release()
            self.view = None
        if self.area is not None:
            self.area.close()
            self.area = None

    def close(self) -> None:
        """Release the area and the channel, as far as a job cut short allows."""
        try:
            self.release_area()
        except BufferError:
            pass  # a slice of the area is still referenced (a job cut short): the process exits anyway
        self.conn.close()
        self.sock.close()


def main(fd: int) -> int:
    """The writer process: serve jobs from the trainer over the socket ``fd``.

    It never outlives its trainer: the code that starts it
    (``nostall.saving.background``) watches the trainer from the process's
    first line, before any import.
    """
    # The trainer decides when we stop: Ctrl-C / SIGTERM sent to the whole
    # process group must not kill a write half-way; the trainer drains us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _log_like_the_trainer()
    server = _Server(fd)
    try:
        while True:
            try:
                msg: Msg = server.conn.recv()
                if msg.op is Op.STOP:
                    server.conn.send(Msg(Op.STOPPED))
                    _exit_now()
                server.serve(msg)
            except (EOFError, OSError):
                _exit_now()  # the trainer is gone (its end of the socket is closed)
    finally:
        server.close()
