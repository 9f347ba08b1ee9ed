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

A writer whose trainer died finishes a job handed over whole, bounded, and
nothing else (:meth:`_Server.live_on`; docs/protocol.md, "Lifetime"). Its
first message says which code it runs (:func:`code_token`); a writer of other
code than its trainer's writes nothing ("Which code").
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Tuple

from nostall.saving.commit import COMMIT_SLACK_S, RecordBarrier, run_job
from nostall.saving.datafiles import Base, Checksums, History, Writer, collect, file_out, report_pacing, write_files
from nostall.errors import CheckpointSaveError, WriterVersionError
from nostall.core.faults import code_token_override
from nostall.core.format import Manifest, TensorRecord
from nostall.core.jobs import Done, FileJob, JobResult, Msg, Op, SaveJob, Segment, Written
from nostall.storage import files as storage
from nostall.storage.root import lock_record

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


# --------------------------------------------------------------------------- the code a process runs

CODE_TOKEN_ENV = "NOSTALL_CODE_TOKEN"
"""The trainer's :func:`code_token`, in the environment of the writer it starts."""


@functools.lru_cache(maxsize=None)
def _source_token() -> str:
    import nostall

    digest = hashlib.sha256()
    top = os.path.dirname(os.path.abspath(nostall.__file__))
    for folder, dirs, names in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, top).encode() + b"\0")
            try:
                with open(path, "rb") as f:
                    digest.update(f.read())
            except OSError as e:  # unreadable: counted as such (both sides see the same)
                digest.update(f"<{e.errno}>".encode())
            digest.update(b"\0")
    return f"{nostall.__version__}+{digest.hexdigest()[:16]}"


def code_token() -> str:
    """Which nostall code this process runs: its version and a hash of the package's source files as they were
    when this process imported this module (nostall's saving layer: a trainer, with its first
    ``CheckpointManager`` or save; a writer, as it starts), computed once per process. A trainer and the
    processes serving it (its writer) must show the same (docs/protocol.md, "Which code"); a test may give a
    writer another one (:func:`~nostall.core.faults.code_token_override`)."""
    return code_token_override() or _source_token()


_source_token()  # now, at import: the files this process loaded its code from, not those on disk later


def version_refusal(trainer: str, writer: str, trainer_pid: int, writer_pid: int) -> str:
    """What a trainer and its writer say when their code differs (``trainer``/``writer``: their tokens)."""
    return (f"the background writer process {writer_pid} runs nostall {writer}, its trainer (pid {trainer_pid}) "
            f"runs nostall {trainer}: the installed nostall changed under the running job (reinstalled or "
            "upgraded since the trainer started), so the writer is refused and writes nothing. Restart the job "
            "so that every process runs the same code")


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


class Feeding:
    """What a chunked or streamed job's feed tells the writer: that a chunk message is being read
    (``receiving``), and that the last one has arrived (``whole``: every byte of the job is in the area now,
    and the trainer touches the area no more). No-ops by default."""

    def receiving(self, on: bool) -> None:
        """A chunk message is being read (True), or was read and taken in (False)."""

    def whole(self) -> None:
        """The job's last chunk has arrived."""


def _next_chunk(conn: Any, deadline: float, last: int, feeding: Feeding) -> Msg:
    """The trainer's next CHUNK message (bounded by ``deadline``); a CHUNK_ABORT raises."""
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"no staged chunk from the trainer after chunk {last}")
    feeding.receiving(True)
    msg: Msg = conn.recv()
    if msg.op is Op.CHUNK_ABORT:
        raise CheckpointSaveError(f"the trainer stopped staging: {msg.text}")
    if msg.op is not Op.CHUNK:
        raise RuntimeError(f"expected a staged chunk from the trainer, got {msg.op}")
    return msg


def _chunk_feed(conn: Any, job: SaveJob, deadline: float, feeding: Feeding) -> ChunkFeed:
    """Chunks of the job in progress, from the trainer (CHUNK or CHUNK_ABORT messages)."""
    last = [-1]

    def feed() -> Optional[List[Segment]]:
        if last[0] >= 0:
            try:
                conn.send(Msg(Op.CHUNK_DONE, index=last[0]))  # its half of the area may be reused
            except OSError:  # the trainer is gone: the chunks it sent before are still read (an orphan's job)
                pass
        msg = _next_chunk(conn, deadline, last[0], feeding)
        last[0] = msg.index
        segs = msg.segments or []
        if segs and segs[-1].file == len(job.files) - 1 and segs[-1].end == job.files[-1].size:
            feeding.whole()  # the last byte is staged: nothing more to come
        feeding.receiving(False)
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


def _stream_feed(conn: Any, job: SaveJob, deadline: float, feeding: Feeding) -> ChunkFeed:
    """Chunks of a streamed job: each CHUNK message says how far the area is staged (``size``)."""
    segments = stream_segments(job)
    last = [-1]
    end = max((f.area_offset + f.size for f in job.files), default=0)

    def feed() -> Optional[List[Segment]]:
        msg = _next_chunk(conn, deadline, last[0], feeding)
        last[0] = msg.index
        if msg.size >= end:
            feeding.whole()  # the area is staged past the job's last byte: nothing more to come
        feeding.receiving(False)
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


ORPHAN_DRAIN_S = 2.0
"""How long a writer whose trainer died, with no job in hand, may still read what the trainer sent before dying."""
ORPHAN_SLACK_S = COMMIT_SLACK_S / 4
"""An orphan finishing a whole job lives at most the job's ``timeout`` plus this from the job's start (rank 0
announces the outcome by then)."""


class _Barrier(RecordBarrier):
    """The ranks' records on the root, telling the server when this rank (not rank 0) has reported its part:
    a writer whose trainer is gone has nothing left to do then."""

    def __init__(self, server: "_Server") -> None:
        self.server = server

    def gather(self, job: SaveJob, mine: Done, deadline: float) -> Dict[int, Done]:
        got = super().gather(job, mine, deadline)
        if job.rank != 0:
            self.server.reported()
        return got


def _refuse(why: str) -> Writer:
    """A job's write, in a writer whose code differs from its trainer's: nothing is written."""

    def write(job: SaveJob, staging: str, base: Optional[Base]) -> Written:
        raise WriterVersionError(f"rank {job.rank}: {why}")

    return write


class _Server(Feeding):
    """The writer process's state between messages: the channel, the mapped staging area, the history.

    Also what the watchdog asks once the trainer is gone (:meth:`live_on`, from its own thread): a job
    handed over whole is finished, bounded, and everything else ends (docs/protocol.md, "Lifetime").
    """

    def __init__(self, fd: int, lock_fd: Optional[int] = None) -> None:
        self.sock = socket.socket(fileno=fd)
        self.conn = Connection(os.dup(fd))
        self.area: Optional[mmap.mmap] = None
        self.view: Optional[memoryview] = None
        self.history = History()  # this rank's last committed save, for incremental saves
        self.records: Optional[ManifestRecords] = None  # rank 0: the tensor records of the plan of its last job
        # The priority drops once the writer is ready, not at start: start-up imports at nice 10 on a busy
        # machine took seconds of the first save's deadline (importing s3fs 0.6 s at nice 0, 5 s at nice 10).
        self.lowered = False
        self.trainer = os.getppid()
        self.lock_fd = lock_fd  # rank 0: the root's lock, shared with the trainer (its claim)
        self._state = threading.Lock()  # guards what follows: the main thread and the watchdog's
        self._receiving = False  # a message is being read (it may be a job)
        self._job: Optional[SaveJob] = None  # the job being run
        self._until = 0.0  # when a whole job's own bound runs out (monotonic)
        self._may = False  # the job may be finished by an orphan once handed over whole (where that is safe)
        self._whole = False  # ... and it is: every byte is in the area, none to come
        self._reported = False  # this rank (not 0) has reported its part of the job
        self._orphan_at: Optional[float] = None  # when the watchdog found the trainer gone
        self._noted = False  # the orphan's work was announced (log, lock record)
        self.refused = ""  # why this writer serves no job (its code differs from the trainer's), or ""

    # ------------------------------------------------------------------ the trainer gone
    def live_on(self) -> float:
        """The watchdog, once the trainer is gone (every 0.1 s): how many seconds more this process may live
        (0: kill it now). A whole job is finished within its own bound; what the trainer sent before dying is
        still read (a job: within :data:`ORPHAN_DRAIN_S`; the rest of a job being fed that an orphan may
        finish: within the job's bound, the job becoming whole with its last chunk); anything else ends now."""
        now = time.monotonic()
        with self._state:
            if self._orphan_at is None:
                self._orphan_at = now
            pending = self._receiving or self._unread()
            job = self._job
            if job is None:  # the trainer's last message may be a job
                return ORPHAN_DRAIN_S - (now - self._orphan_at) if pending else 0.0
            if self._reported or not self._may or not (self._whole or pending):
                return 0.0
            if not self._noted:
                self._noted = True
                self._note_orphan(job, self._until - now)
            return max(0.0, self._until - now)

    def _unread(self) -> bool:
        """Whether bytes the trainer sent are still unread (not counting the end of the stream)."""
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):
            return False

    def _note_orphan(self, job: SaveJob, left: float) -> None:
        """Say that this orphan finishes ``job``: in the log, and (rank 0) in the root's lock record, which a
        new manager reads to wait for us (bounded) rather than refuse the root."""
        log.warning("rank %d: the trainer (pid %d) is gone; finishing the save of step %s it handed over%s "
                    "(within %.0fs), then exiting", job.rank, self.trainer, job.step,
                    " whole" if self._whole else ", as far as it staged it", left)
        if self.lock_fd is not None and job.rank == 0:
            # life: the whole life the job allows an orphan (a new manager waits at most that, plus slack)
            data = lock_record(writer_of=self.trainer, step=job.step, until=time.time() + left,
                               life=job.timeout + ORPHAN_SLACK_S)
            try:  # longer than the trainer's record: written over it in one write, then cut to its length
                os.pwrite(self.lock_fd, data, 0)
                os.ftruncate(self.lock_fd, len(data))
            except OSError as e:
                log.warning("rank 0: could not note the orphan writer in the root's lock record: %s", e)

    def _may_finish(self, job: SaveJob) -> bool:
        """Whether an orphan may finish ``job`` once it is handed over whole (no chunk to come): on a root
        whose lock keeps a restarted job off it, and rank 0's writer holding that lock (this process on rank 0;
        on another rank, what the job says: ``SaveJob.root_locked``). Otherwise an orphan of rank 0 dies, and
        one of another rank could still write into the root's ``.tmp`` while a restarted job claims it."""
        if not job.dest.root.orphans_may_finish:
            return False
        return self.lock_fd is not None if job.rank == 0 else job.root_locked

    def receiving(self, on: bool) -> None:
        with self._state:  # (the end of the stream is no message: a recv that will only meet it counts as none)
            self._receiving = on and self._unread()

    def whole(self) -> None:
        with self._state:
            self._whole = self._may

    def reported(self) -> None:
        with self._state:
            self._reported = True

    def orphaned(self) -> bool:
        """Whether the trainer is gone (noticed by the watchdog, or seen now)."""
        with self._state:
            return self._orphan_at is not None or os.getppid() != self.trainer

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
        start = time.monotonic()
        deadline = start + job.timeout
        if self.refused:  # the job goes through the protocol (so that no rank waits), writing nothing
            self.conn.send(Msg(Op.RESULT, result=run_job(job, _refuse(self.refused), RecordBarrier())))
            return
        write = (write_chunked(self.view, _stream_feed(self.conn, job, deadline, self), release=False)
                 if job.streamed else write_chunked(self.view, _chunk_feed(self.conn, job, deadline, self))
                 if job.chunked else from_area(self.view))
        with self._state:
            self._job, self._until, self._reported = job, deadline + ORPHAN_SLACK_S, False
            self._may = self._may_finish(job)
            self._whole = self._may and not job.chunked and not job.streamed
            self._receiving = False
        later: List[Callable[[], None]] = []
        try:
            result = run_job(job, write, _Barrier(self), self.history, later)
        finally:
            with self._state:
                self._job = None
        if self.orphaned():  # nobody to report to; retention is left to the next commit
            log.warning("rank %d: the save of step %s that the trainer (pid %d) handed over before dying %s; "
                        "exiting", job.rank, job.step, self.trainer,
                        "is done" if result.ok else f"failed: {result.error}")
            _exit_now()
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


def main(fd: int, lock_fd: int = -1, orphan: Optional[List[Callable[[], float]]] = None) -> int:
    """The writer process: serve jobs from the trainer over the socket ``fd``.

    It outlives its trainer only to finish a job handed over whole (docs/protocol.md, "Lifetime"): the
    code that starts it (``nostall.saving.background``) watches the trainer from the process's first line,
    before any import, and asks, through ``orphan`` (where this puts :meth:`_Server.live_on`), how long
    to live on once the trainer is gone. ``lock_fd``: rank 0's share of the root's lock (-1: none).
    """
    # The trainer decides when we stop: Ctrl-C / SIGTERM sent to the whole
    # process group must not kill a write half-way; the trainer drains us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _log_like_the_trainer()
    server = _Server(fd, lock_fd if lock_fd >= 0 else None)
    if orphan is not None:
        orphan.append(server.live_on)
    # The handshake: the first message says which code this writer runs (the trainer checks it too), and a
    # writer whose code differs from its trainer's serves no job.
    mine, theirs = code_token(), os.environ.get(CODE_TOKEN_ENV, "")
    if theirs and theirs != mine:
        server.refused = version_refusal(theirs, mine, server.trainer, os.getpid())
        log.error("%s", server.refused)
    try:
        server.conn.send(Msg(Op.PONG, size=os.getpid(), text=mine))
    except OSError:
        _exit_now()  # the trainer is gone already
    try:
        while True:
            try:
                server.conn.poll(None)  # (readable, or the trainer's end closed)
                server.receiving(True)
                msg: Msg = server.conn.recv()
                if msg.op is Op.STOP:
                    server.conn.send(Msg(Op.STOPPED))
                    _exit_now()
                server.serve(msg)
                server.receiving(False)
            except (EOFError, OSError):
                _exit_now()  # the trainer is gone (its end of the socket is closed)
    finally:
        server.close()
