"""Writing data files: in the trainer (synchronous saves) or in a background writer process.

This module does not import torch. :func:`write_file_image` turns a planned
file (header + pieces, each a buffer) into a durable file and returns the
block checksums of each piece. :func:`run_job` executes one background save
job against the shared staging area, including the commit protocol's part
that runs in the writer; :func:`main` is the writer process's loop.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from . import remote, storage
from ._faults import crash_point
from .commit import check_staging
from .errors import CheckpointSaveError, describe
from .format import Manifest, block_crcs

log = logging.getLogger("nostall")

Crcs = Dict[Tuple[str, int, int], Tuple[int, ...]]  # (file, start, end) -> block checksums
_COMMIT_SLACK_S = 60.0  # other ranks wait this much longer than rank 0 for the outcome


def write_file_image(
    path: str, header: bytes, parts: Iterable[Tuple[int, memoryview]], size: int, block_size: int, name: str
) -> Crcs:
    """Write ``header`` then each ``(start, buffer)`` part, fsync; return part checksums."""
    crcs: Crcs = {}

    def chunks() -> Iterable[memoryview]:
        yield memoryview(header)
        pos = len(header)
        for start, buf in parts:
            if start != pos:
                raise RuntimeError(f"{path}: piece at byte {start} but the file is at byte {pos}")
            crcs[(name, start, start + len(buf))] = tuple(block_crcs(buf, block_size))
            yield buf
            pos += len(buf)

    n = storage.write_file(path, chunks())
    if n != size:
        raise RuntimeError(f"{path}: wrote {n} bytes, the plan says {size}")
    return crcs


# --------------------------------------------------------------------------- background jobs


@dataclass
class FileJob:
    """One file of a background save: where its image lies in the staging area."""

    name: str
    area_offset: int
    size: int
    header_size: int
    pieces: Tuple[Tuple[int, int], ...]  # (start, end) within the file, in order


@dataclass
class Segment:
    """Bytes [start, end) of file ``file`` (an index into the job's files), at ``area_offset`` in the area."""

    file: int
    start: int
    end: int
    area_offset: int


# The next chunk of a chunked job (its segments), after releasing the previous one; None: no more.
ChunkFeed = Callable[[], Optional[List[Segment]]]


def write_chunked(job: "SaveJob", area: memoryview, feed: ChunkFeed) -> Crcs:
    """Write the job's files from segments that arrive chunk by chunk (a host-memory budget).

    Segments come in file order. A chunk is released (its half of the area
    reused by the trainer) once every segment of it is written.
    """
    crcs: Dict[Tuple[str, int, int], List[int]] = {}

    def segments() -> Iterator[Segment]:
        while True:
            chunk = feed()
            if chunk is None:
                return
            yield from chunk

    source = segments()
    for fi, f in enumerate(job.files):
        path = os.path.join(job.staging, f.name)

        def parts(fi: int = fi, f: FileJob = f) -> Iterator[memoryview]:
            pos, pi = 0, 0
            while pos < f.size:
                seg = next(source, None)
                if seg is None or seg.file != fi or seg.start != pos:
                    raise RuntimeError(f"{f.name}: staging sent {seg} where byte {pos} of file {fi} was due")
                buf = area[seg.area_offset : seg.area_offset + seg.end - seg.start]
                if seg.start >= f.header_size:
                    while f.pieces[pi][1] <= seg.start:
                        pi += 1
                    crcs.setdefault((f.name, *f.pieces[pi]), []).extend(block_crcs(buf, job.block_size))
                yield buf
                pos = seg.end

        n = storage.write_file(path, parts())
        if n != f.size:
            raise RuntimeError(f"{path}: wrote {n} bytes, the plan says {f.size}")
        for start, end in f.pieces:
            crcs.setdefault((f.name, start, end), [])  # empty pieces have no segment
    return {k: tuple(v) for k, v in crcs.items()}


@dataclass
class CommitJob:
    """What rank 0's writer needs to commit: the manifest without checksums, and the target."""

    manifest: Manifest
    target: Any  # a commit.Target (picklable, torch-free)


@dataclass
class SaveJob:
    save_id: str
    step: Optional[int]
    rank: int
    world_size: int
    staging: str  # the staging directory of the data files
    records: str  # directory of the per-rank done records and the outcome record
    files: Tuple[FileJob, ...]
    block_size: int
    timeout: float
    commit: Optional[CommitJob] = None  # rank 0 only
    writers: Tuple[int, ...] = ()  # ranks whose done record rank 0 waits for
    test_delay_s: float = 0.0  # test hook: sleep before writing
    test_fault: Optional[str] = None  # test hook: "enospc" fails the write like a full disk
    upload: Any = None  # object storage: the RemoteStepTarget that uploads this rank's staged files
    storage_options: Optional[Dict[str, Any]] = None  # fsspec options for remote records
    chunked: bool = False  # the files' bytes come chunk by chunk after the job (see write_chunked)


@dataclass
class JobResult:
    save_id: str
    ok: bool
    error: Optional[str] = None
    write_s: float = 0.0
    commit_s: float = 0.0
    bytes_written: int = 0


def done_record(records: str, rank: int) -> str:
    return os.path.join(records, f"rank{rank}.json")


def outcome_record(records: str) -> str:
    return os.path.join(records, "outcome.json")


def record_crcs(rec: Dict[str, Any]) -> Crcs:
    """The piece checksums carried by a successful done record."""
    return {(n, int(s), int(e)): tuple(c) for n, s, e, c in rec["crcs"]}


def write_record(path: str, doc: Dict[str, Any], storage_options: Optional[Dict[str, Any]] = None,
                 deadline: Optional[float] = None) -> None:
    """Publish a small JSON record atomically (readers never see half of it): a file, or an object.

    Remote writes are retried until ``deadline`` (monotonic time) at most.
    """
    data = json.dumps(doc, sort_keys=True).encode()
    if remote.is_remote(path):
        fs, key = remote.filesystem(path, storage_options)
        remote.retry(f"upload {path}", lambda: fs.pipe_file(key, data), deadline=deadline)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    storage.atomic_write(path, data)


def read_record(path: str, storage_options: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    try:
        if remote.is_remote(path):
            fs, key = remote.filesystem(path, storage_options)
            return json.loads(remote.retry(f"read {path}", lambda: fs.cat_file(key)))
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def list_records(records: str, storage_options: Optional[Dict[str, Any]] = None) -> set:
    """Names of the records present (one metadata call)."""
    try:
        if remote.is_remote(records):
            fs, key = remote.filesystem(records, storage_options)
            return {os.path.basename(str(p)) for p in fs.ls(key, detail=False, refresh=True)}
        return set(os.listdir(records))
    except FileNotFoundError:
        return set()
    except Exception as e:  # a network blip: the caller polls again, within its deadline
        if not remote.is_remote(records):
            raise
        log.debug("listing %s failed (%s); will look again", records, e)
        return set()


def poll_until(deadline: float, what: str, check: Any, max_delay: float = 0.1) -> Any:
    """Call ``check`` until it returns non-None; bounded by ``deadline``.

    Backs off to ``max_delay`` between looks, so that many ranks polling a
    shared filesystem stay cheap for its metadata server.
    """
    delay = 0.005
    while True:
        v = check()
        if v is not None:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, max_delay)


def run_job(job: SaveJob, area: memoryview, feed: Optional[ChunkFeed] = None) -> JobResult:
    """Write this rank's files from the staging area, then take part in the commit.

    A chunked job's bytes come through ``feed``.
    """
    t0 = time.perf_counter()
    deadline = time.monotonic() + job.timeout
    res = JobResult(job.save_id, ok=False)
    crcs: Crcs = {}
    try:
        if job.test_delay_s:
            time.sleep(job.test_delay_s)
        if job.test_fault == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device (test fault)", job.staging)
        if job.upload is not None:
            job.upload.open_staging()
        else:
            check_staging(job.staging)
        crash_point("write.start", job.step)
        if job.chunked:
            assert feed is not None
            crcs.update(write_chunked(job, area, feed))
            res.bytes_written = sum(f.size for f in job.files)
        for f in job.files if not job.chunked else ():
            header = bytes(area[f.area_offset : f.area_offset + f.header_size])
            parts = [(s, area[f.area_offset + s : f.area_offset + e]) for s, e in f.pieces]
            crcs.update(
                write_file_image(os.path.join(job.staging, f.name), header, parts, f.size, job.block_size, f.name)
            )
            res.bytes_written += f.size
        if job.upload is not None:
            job.upload.upload([f.name for f in job.files])
            crcs = {(job.upload.data_name(n), s, e): c for (n, s, e), c in crcs.items()}
        mine: Dict[str, Any] = {"ok": True, "crcs": [[n, s, e, list(c)] for (n, s, e), c in crcs.items()]}
    except Exception as e:
        mine = {"ok": False, "error": f"rank {job.rank}: {describe(e)}"}
        _remove_own_files(job)  # first: on a full disk, the done record needs the space back
    res.write_s = time.perf_counter() - t0
    crash_point("write.done", job.step)
    t1 = time.perf_counter()
    try:
        write_record(done_record(job.records, job.rank), mine, job.storage_options, deadline)
        if job.commit is not None:
            outcome = _commit(job, deadline)
            write_record(outcome_record(job.records), outcome, job.storage_options, deadline + _COMMIT_SLACK_S / 4)
            if outcome.get("ok"):
                job.commit.target.retain()  # after the other ranks can know the outcome
        else:
            # rank 0 may take up to the timeout waiting for the slowest rank, then commit
            outcome = poll_until(deadline + _COMMIT_SLACK_S, f"rank 0 to commit step {job.step}",
                            lambda: read_record(outcome_record(job.records), job.storage_options), max_delay=0.5)
    except Exception as e:
        outcome = {"ok": False, "error": f"rank {job.rank}: {describe(e)}"}
    res.commit_s = time.perf_counter() - t1
    res.ok = bool(outcome.get("ok"))
    if not res.ok:
        if mine.get("ok"):  # a failed write already removed its files
            _remove_own_files(job)
        res.error = outcome.get("error") or "unknown error"
        if not mine.get("ok") and mine.get("error") not in res.error:
            res.error = f"{mine['error']}; {res.error}"
    return res


def _remove_own_files(job: SaveJob) -> None:
    """After a failed save: delete what this rank wrote into the staging directory.

    Rank 0 removes the directory when it aborts, but a rank still writing then
    (it learns of the failure later) would leave its files behind, holding
    space on a disk that may be full.
    """
    for f in job.files:
        try:
            os.unlink(os.path.join(job.staging, f.name))
        except OSError:
            pass
    try:
        os.rmdir(job.staging)  # the last rank out removes the directory
    except OSError:
        pass


def _commit(job: SaveJob, deadline: float) -> Dict[str, Any]:
    """Rank 0: wait for every writer's done record, then commit (or abort)."""
    assert job.commit is not None
    target = job.commit.target
    pending = set(job.writers)
    crcs: Crcs = {}
    failures: List[str] = []
    try:
        delay = 0.005
        while pending:
            present = list_records(job.records, job.storage_options)  # one metadata call per look
            for r in sorted(pending):
                if os.path.basename(done_record(job.records, r)) not in present:
                    continue
                rec = read_record(done_record(job.records, r), job.storage_options)
                if rec is None:
                    continue
                pending.discard(r)
                if rec.get("ok"):
                    crcs.update(record_crcs(rec))
                else:
                    failures.append(str(rec.get("error")))
            if pending:
                if failures:
                    break  # no need to wait for the rest: this save cannot commit
                if time.monotonic() > deadline:
                    failures.append(
                        f"rank(s) {sorted(pending)} did not finish writing within {job.timeout:.0f}s"
                    )
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        if failures:
            target.abort()
            return {"ok": False, "error": f"save of step {job.step} failed: " + "; ".join(failures)}
        m = job.commit.manifest
        crash_point("commit.ready", job.step)
        target.publish(m.with_crcs(crcs).to_json_bytes(), {n: f.size for n, f in m.files.items()})
        return {"ok": True}
    except Exception as e:
        try:
            target.abort()
        except Exception:
            pass
        return {"ok": False, "error": f"rank 0: commit of step {job.step} failed: {describe(e)}"}


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


def _exit_with_trainer(trainer_pid: int) -> None:
    """A daemon thread that kills this process once the trainer is gone.

    A writer must never outlive its trainer: an orphan still writing or
    committing could touch a root that a restarted job has taken over. (Not
    PR_SET_PDEATHSIG: that fires when the *thread* that started us exits.)
    """
    import signal
    import threading

    def watch() -> None:
        while True:
            if os.getppid() != trainer_pid:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.1)

    threading.Thread(target=watch, name="nostall-trainer-watch", daemon=True).start()


def _chunk_feed(conn: Any, deadline: float) -> ChunkFeed:
    """Chunks of the job in progress, from the trainer: ("chunk", k, segments) or ("chunk_abort", why)."""
    last = [-1]

    def feed() -> Optional[List[Segment]]:
        if last[0] >= 0:
            conn.send(("chunk_done", last[0]))  # its half of the area may be reused
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"no staged chunk from the trainer after chunk {last[0]}")
        msg = conn.recv()
        if msg[0] == "chunk_abort":
            raise CheckpointSaveError(f"the trainer stopped staging: {msg[1]}")
        if msg[0] != "chunk":
            raise RuntimeError(f"expected a staged chunk from the trainer, got {msg[0]!r}")
        last[0] = msg[1]
        return msg[2]

    return feed


def main(fd: int, trainer_pid: int = 0) -> int:
    """The writer process: serve jobs from the trainer over the socket ``fd``.

    Dies with its trainer (``trainer_pid``, when given).
    """
    import mmap
    import signal
    import socket
    from multiprocessing.connection import Connection
    from multiprocessing.reduction import recvfds

    # The trainer decides when we stop: Ctrl-C / SIGTERM sent to the whole
    # process group must not kill a write half-way; the trainer drains us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _lower_priority()
    _log_like_the_trainer()
    if trainer_pid:
        _exit_with_trainer(trainer_pid)
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    area: Optional[mmap.mmap] = None
    view: Optional[memoryview] = None
    try:
        while True:
            try:
                msg = conn.recv()
                op = msg[0]
                if op == "stop":
                    conn.send(("stopped",))
                    return 0
                if op == "attach":
                    size = msg[1]
                    (afd,) = recvfds(sock, 1)
                    if view is not None:
                        view.release()
                    if area is not None:
                        area.close()
                    area = mmap.mmap(afd, size, mmap.MAP_SHARED, mmap.PROT_READ)
                    os.close(afd)
                    view = memoryview(area)
                    conn.send(("attached", size))
                elif op == "save":
                    job: SaveJob = msg[1]
                    if view is None:
                        result = JobResult(job.save_id, False, f"rank {job.rank}: writer has no staging area")
                    else:
                        feed = _chunk_feed(conn, time.monotonic() + job.timeout) if job.chunked else None
                        result = run_job(job, view, feed)
                    conn.send(("result", result))
                elif op == "ping":
                    conn.send(("pong", os.getpid()))
            except (EOFError, OSError):
                return 0  # the trainer is gone (its end of the socket is closed)
    finally:
        try:
            if view is not None:
                view.release()
            if area is not None:
                area.close()
        except BufferError:
            pass  # a slice of the area is still referenced (a job cut short): the process exits anyway
        conn.close()
        sock.close()

