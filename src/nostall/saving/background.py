"""The trainer's side of the background writer process.

:class:`BackgroundWriter` starts the rank's writer process (a fresh
interpreter running :func:`nostall.saving.writer.main`, never a fork), shares the staging
area with it, hands it one save job at a time and waits for the outcome with a
bounded wait that notices within a fraction of a second when the writer died.
When the writer dies, the trainer side finishes the commit protocol's
bookkeeping for it (a "failed" record, so that no other rank waits for this
one) and a fresh writer is started for the next save.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from typing import Any, List, Optional, Tuple

from nostall.saving import commit
from nostall.core.faults import ROLE_ENV
from nostall.errors import CheckpointError, CheckpointTimeoutError
from nostall.core.jobs import JobResult, Msg, Op, SaveJob, Segment
from nostall.saving.area import StagingArea
from nostall.saving.writer import (
    CODE_TOKEN_ENV, LOG_LEVEL_ENV, ManifestRecords, code_token, version_refusal, without_records,
)

log = logging.getLogger("nostall")

_POLL_S = 0.1
HELLO_WAIT_S = 10.0
"""The longest a save waits for a new writer's first message (which code it runs: :meth:`BackgroundWriter.refusal`)."""
# A fresh interpreter running nostall.saving.writer.main (imported, so that the
# messages it pickles name nostall.saving.writer's classes, not __main__'s).
# An orphan writer (its trainer died) may only finish a job handed over whole, bounded, and rank 0's only while
# it holds the root's lock (docs/protocol.md, "Lifetime"): anything else it might write or commit could touch a
# root that a restarted job has taken over. So its first lines start a watchdog thread that, once its parent is
# no longer the trainer, asks the writer (``main`` puts its question in ``_orphan``) how long to live on, every
# 0.1 s, and kills the process when the answer is 0 -- at once when nothing is imported yet (the imports take
# 0.2 s, more on a busy machine, and a trainer may die meanwhile). Not PR_SET_PDEATHSIG: that fires when the
# *thread* that started the process exits. argv: the socket's fd, the trainer's pid, the root lock's fd (-1: none).
_WRITER_MAIN = (
    "import os, signal, sys, threading, time\n"
    "_orphan = []\n"
    "def _live():\n"
    "    try:\n"
    "        return _orphan[0]() if _orphan else 0.0\n"
    "    except BaseException:\n"
    "        return 0.0\n"
    "def _watch(trainer=int(sys.argv[2])):\n"
    "    while os.getppid() == trainer:\n"
    "        time.sleep(0.1)\n"
    "    while _live() > 0:\n"
    "        time.sleep(0.1)\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "if int(sys.argv[2]):\n"
    "    threading.Thread(target=_watch, name='nostall-trainer-watch', daemon=True).start()\n"
    "from nostall.saving.writer import main\n"
    "sys.exit(main(int(sys.argv[1]), int(sys.argv[3]), _orphan))\n"
)


class WriterDied(CheckpointError):
    pass


def _same_records(held: Optional[ManifestRecords], records: ManifestRecords) -> bool:
    """Whether ``records`` are the very objects the writer holds (identity: they are never changed in place)."""
    return (held is not None and held[0] is records[0] and len(held[1]) == len(records[1])
            and all(a is b for a, b in zip(held[1], records[1])))


class BackgroundWriter:
    """One writer process and the staging area it shares with this rank."""

    def __init__(self, rank: int, timeout: float, root: Any = None) -> None:
        """``root``: where its jobs write; every new writer process gets ready for it (:meth:`Root.warm`)
        as soon as it starts, off any save's deadline."""
        self.rank = rank
        self.timeout = timeout
        self.root = root
        self.area = StagingArea()
        self._attached_generation = 0
        self.proc: Optional[subprocess.Popen] = None
        self._sock: Optional[socket.socket] = None
        self._conn: Optional[Connection] = None
        self.job: Optional[SaveJob] = None  # the job in flight
        self._stash: list = []  # messages read ahead by ready()
        self._behind = False  # a job was reported since the last flush (its retention may still run)
        self._held: Optional[ManifestRecords] = None  # the tensor records the writer process holds (rank 0)
        self._greeted = False  # the writer's first message (which code it runs) was read
        self.refused: Optional[str] = None  # why the writer is refused: it runs other code than this trainer
        self._start()

    # ------------------------------------------------------------------ process
    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env[ROLE_ENV] = "writer"
        env[LOG_LEVEL_ENV] = str(logging.getLogger("nostall").getEffectiveLevel())
        env[CODE_TOKEN_ENV] = code_token()
        # rank 0: the root's lock, shared, so that it stays held while an orphan writer finishes a whole job
        lock = self.root.held_lock() if self.root is not None else None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _WRITER_MAIN, str(child.fileno()), str(os.getpid()),
                 str(-1 if lock is None else lock)],
                pass_fds=[child.fileno()] + ([] if lock is None else [lock]),
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._sock = parent
        self._conn = Connection(os.dup(parent.fileno()))
        self._attached_generation = 0
        self._held = None
        self._greeted, self.refused = False, None
        log.debug("rank %d: writer process %d started", self.rank, self.proc.pid)
        if self.root is not None:
            self._conn.send(Msg(Op.WARM, root=self.root))

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_alive(self) -> None:
        """Start a fresh writer if the previous one died."""
        if not self.alive():
            code = self.proc.returncode if self.proc is not None else None
            log.warning("rank %d: writer process exited (code %s); starting a new one", self.rank, code)
            self._close_channel()
            self._start()

    def refusal(self, wait_s: float = HELLO_WAIT_S) -> Optional[str]:
        """Why this rank's writer is refused (it runs other code than this trainer: see :func:`version_refusal`),
        or None. Its first message says which code it runs: when not read yet, it is waited for, at most
        ``wait_s`` (once per writer process: it was started with the manager, so it is normally there). A
        save reports the refusal in its collective rounds, so that it fails on every rank alike
        (:class:`~nostall.errors.WriterVersionError`) before any byte moves. Unknown after the wait: None
        (the writer refuses any job itself, through the protocol)."""
        deadline = time.monotonic() + wait_s
        while not self._greeted and self._conn is not None and self.alive():
            if not self._conn.poll(max(0.0, min(_POLL_S, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    log.warning("rank %d: the writer process %s has not said which code it runs after %.0fs; going "
                                "on (a writer of other code refuses every job itself)", self.rank, self.pid, wait_s)
                    self._greeted = True  # not waited for again
                    break
                continue
            try:  # the writer's first message is its hello: anything else (a writer of old code) is kept
                msg = self._conn.recv()
            except (EOFError, OSError):
                break  # it died: the save's wait finds out
            if not self._hello(msg):
                self._greeted = True  # a writer of code from before the handshake: it never says
                self._stash.append(msg)
        return self.refused

    def _hello(self, msg: Msg) -> bool:
        """Whether ``msg`` is the writer's first message, which says which code it runs (then checked:
        a writer of other code is :attr:`refused`; it refuses every job itself too)."""
        if self._greeted or msg.op is not Op.PONG or not msg.text:
            return False
        self._greeted = True
        mine = code_token()
        if msg.text != mine:
            self.refused = version_refusal(mine, msg.text, os.getpid(), msg.size)
            log.error("rank %d: %s", self.rank, self.refused)
        return True

    def _close_channel(self) -> None:
        self._stash = []
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def _recv(self, deadline: float, what: str, skip: Tuple[Op, ...] = ()) -> Msg:
        """Next message from the writer (ignoring kinds in ``skip``), bounded by ``deadline``."""
        assert self._conn is not None
        bound = max(0.0, deadline - time.monotonic())
        while self._stash:
            msg = self._stash.pop(0)
            if msg.op not in skip:
                return msg
        while True:
            if self._conn.poll(max(0.0, min(_POLL_S, deadline - time.monotonic()))):
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    msg = None  # fall through to the liveness check
                if msg is not None:
                    if self._hello(msg) or msg.op in skip:
                        continue
                    return msg
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                raise WriterDied(f"rank {self.rank}: the writer process died (exit code {code}) while {what}")
            if time.monotonic() > deadline:
                raise CheckpointTimeoutError(f"rank {self.rank}: no word from the writer within {bound:.0f}s while "
                                             f"{what}")

    # ------------------------------------------------------------------ jobs
    def attach_if_needed(self) -> None:
        """Share the (possibly new) staging area with the writer (does not wait for it)."""
        if self._attached_generation == self.area.generation:
            return
        assert self._conn is not None and self._sock is not None and self.area.fd is not None
        self._conn.send(Msg(Op.ATTACH, size=self.area.size))
        sendfds(self._sock, [self.area.fd])
        self._attached_generation = self.area.generation

    def submit(self, job: SaveJob) -> None:
        assert self.job is None, "one save in flight at a time"
        self.attach_if_needed()
        assert self._conn is not None
        if job.manifest is None:
            self._conn.send(Msg(Op.SAVE, job=job))
        else:  # rank 0: the tensor records go once per plan (the saves of a cached plan share the very same dicts)
            manifest, records = without_records(job.manifest)
            fresh = not _same_records(self._held, records)
            self._held = None  # unknown until the message is sent whole
            self._conn.send(Msg(Op.SAVE, job=replace(job, manifest=manifest), records=records if fresh else None))
            self._held = records
        self.job = job

    def send_chunk(self, index: int, segments: List[Segment]) -> None:
        """Hand the writer the next staged chunk of the job in flight (a chunked job)."""
        assert self._conn is not None
        self._conn.send(Msg(Op.CHUNK, index=index, segments=segments))

    def send_staged(self, index: int, upto: int) -> None:
        """A streamed job: chunk ``index`` is staged, and with it every byte of the area below ``upto``."""
        assert self._conn is not None
        self._conn.send(Msg(Op.CHUNK, index=index, size=upto))

    def abort_chunks(self, why: str) -> None:
        """Staging failed part-way: the writer fails the job instead of waiting for chunks."""
        try:
            if self._conn is not None:
                self._conn.send(Msg(Op.CHUNK_ABORT, text=why))
        except OSError:
            pass

    def wait_chunk_done(self, index: int, deadline: float) -> bool:
        """Wait until the writer released chunk ``index`` (True), or finished the job early: it failed (False)."""
        while True:
            msg = self._recv(deadline, f"writing chunk {index}", skip=(Op.ATTACHED, Op.PONG))
            if msg.op is Op.CHUNK_DONE and msg.index >= index:
                return True
            if msg.op is Op.RESULT:
                self._stash.append(msg)
                return False

    def ready(self) -> bool:
        """True when the job in flight has its result waiting (never blocks)."""
        if any(m.op is Op.RESULT for m in self._stash):
            return True
        if self._conn is None or not self.alive():
            return False
        while self._conn.poll(0):
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                return False
            if self._hello(msg):
                continue
            if msg.op is Op.RESULT:
                self._stash.append(msg)
                return True
        return False

    def wait(self, timeout: Optional[float]) -> JobResult:
        """The outcome of the job in flight (bounded); the job is then no longer in flight.

        Raises CheckpointError (job still in flight) when ``timeout`` passes.
        When the writer dies, returns a failed result after finishing the
        protocol's bookkeeping, so that the other ranks do not wait for us.
        """
        job = self.job
        assert job is not None
        # By default a little longer than the writer's own bounded waits, so that the
        # writer's precise error (a rank missing, a failed upload) arrives before our timeout.
        limit = self.timeout * 1.5 if timeout is None else timeout
        try:
            reply = self._recv(time.monotonic() + limit, f"writing step {job.step}",
                               skip=(Op.ATTACHED, Op.CHUNK_DONE, Op.PONG))  # (a late answer to flush)
        except WriterDied as e:
            self.job = None
            log.error("%s", e)
            return commit.recover(job, str(e), self.timeout)
        self.job = None
        self._behind = True  # rank 0's writer runs retention after reporting (see flush)
        if reply.op is not Op.RESULT or reply.result is None:
            return JobResult(job.save_id, False, f"rank {self.rank}: unexpected reply from the writer: {reply!r}")
        return reply.result

    def flush(self, timeout: float) -> None:
        """Wait (bounded) until the writer finished what it does after reporting its last job: on rank 0,
        retention and the sweep. The next job waits for them anyway; this is for a caller that looks (a load,
        ``finalize_pending_saves``). A writer that died meanwhile only left them undone (the next commit
        runs retention again, and the next manager that claims the root collects a retention cut short)."""
        if not self._behind or self.job is not None or self._conn is None or not self.alive():
            return
        try:
            self._conn.send(Msg(Op.PING))
        except OSError as e:  # it died since alive() said otherwise: nothing of it left to wait for
            log.warning("rank %d: the writer process is gone (%s): retention after the last save is left to the "
                        "next commit", self.rank, e)
            self._behind = False
            return
        try:
            while self._recv(time.monotonic() + timeout, "deleting old checkpoints (retention)",
                             skip=(Op.ATTACHED, Op.CHUNK_DONE)).op is not Op.PONG:
                pass
        except WriterDied as e:
            log.warning("%s", e)
        except CheckpointTimeoutError:  # the checkpoint is committed: retention is only late (its PONG is skipped)
            log.warning("rank %d: retention after the last save is still running after %.0fs", self.rank, timeout)
        self._behind = False

    # ------------------------------------------------------------------ lifetime
    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer (after its job, if any, was waited for) and free the area."""
        if self.proc is not None:
            if self.alive() and self._conn is not None:
                try:
                    self._conn.send(Msg(Op.STOP))
                    self._recv(time.monotonic() + timeout, "stopping",
                               skip=(Op.ATTACHED, Op.RESULT, Op.CHUNK_DONE, Op.PONG))
                except (CheckpointError, OSError, EOFError):
                    pass
            if self.alive():
                self.proc.kill()
            self._close_channel()
            self.proc = None
        self.area.close()
