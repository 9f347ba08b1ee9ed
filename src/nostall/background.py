"""The trainer's side of the background writer process.

:class:`BackgroundWriter` starts the rank's writer process (a fresh
interpreter running :func:`nostall.writer.main`, never a fork), shares the staging
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
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from typing import Any, Optional

from . import remote
from ._faults import ROLE_ENV
from .errors import CheckpointError
from .format import MANIFEST_NAME
from .staging import StagingArea
from .writer import (
    LOG_LEVEL_ENV,
    Crcs,
    JobResult,
    SaveJob,
    done_record,
    outcome_record,
    poll_until,
    read_record,
    record_crcs,
    write_record,
)

log = logging.getLogger("nostall")

_POLL_S = 0.1
# A fresh interpreter running nostall.writer.main (imported, so that the
# messages it pickles name nostall.writer's classes, not __main__'s).
_WRITER_MAIN = "import sys; from nostall.writer import main; sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))"


class WriterDied(CheckpointError):
    pass


def _was_committed(job: SaveJob) -> bool:
    """Did rank 0's writer pass the commit point of ``job`` before dying?

    True only if the checkpoint in place holds exactly the manifest this job
    would have written (so an older checkpoint of the same step does not count).
    """
    assert job.commit is not None
    path = os.path.join(job.commit.target.final, MANIFEST_NAME)
    crcs: Crcs = {}
    for r in job.writers:
        rec = read_record(done_record(job.records, r), job.storage_options)
        if not rec or not rec.get("ok"):
            return False
        crcs.update(record_crcs(rec))
    try:
        expected = job.commit.manifest.with_crcs(crcs).to_json_bytes()
        if remote.is_remote(path):
            fs, key = remote.filesystem(path, job.storage_options)
            return remote.retry(f"read {path}", lambda: fs.cat_file(key)) == expected
        with open(path, "rb") as f:
            return f.read() == expected
    except (OSError, ValueError):
        return False


class BackgroundWriter:
    """One writer process and the staging area it shares with this rank."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank = rank
        self.timeout = timeout
        self.area = StagingArea()
        self._attached_generation = 0
        self.proc: Optional[subprocess.Popen] = None
        self._sock: Optional[socket.socket] = None
        self._conn: Optional[Connection] = None
        self.job: Optional[SaveJob] = None  # the job in flight
        self._stash: list = []  # messages read ahead by ready()
        self._start()

    # ------------------------------------------------------------------ process
    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env[ROLE_ENV] = "writer"
        env[LOG_LEVEL_ENV] = str(logging.getLogger("nostall").getEffectiveLevel())
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _WRITER_MAIN, str(child.fileno()), str(os.getpid())],
                pass_fds=[child.fileno()],
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
        log.debug("rank %d: writer process %d started", self.rank, self.proc.pid)

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_alive(self) -> None:
        """Start a fresh writer if the previous one died."""
        if self.alive():
            return
        code = self.proc.returncode if self.proc is not None else None
        log.warning("rank %d: writer process exited (code %s); starting a new one", self.rank, code)
        self._close_channel()
        self._start()

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

    def _recv(self, deadline: float, what: str, skip: tuple = ()) -> Any:
        """Next message from the writer (ignoring kinds in ``skip``), bounded by ``deadline``."""
        assert self._conn is not None
        while self._stash:
            msg = self._stash.pop(0)
            if msg[0] not in skip:
                return msg
        while True:
            if self._conn.poll(max(0.0, min(_POLL_S, deadline - time.monotonic()))):
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    msg = None  # fall through to the liveness check
                if msg is not None:
                    if msg[0] in skip:
                        continue
                    return msg
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                raise WriterDied(f"rank {self.rank}: the writer process died (exit code {code}) while {what}")
            if time.monotonic() > deadline:
                raise CheckpointError(f"rank {self.rank}: timed out after {self.timeout:.0f}s while {what}")

    # ------------------------------------------------------------------ jobs
    def attach_if_needed(self) -> None:
        """Share the (possibly new) staging area with the writer (does not wait for it)."""
        if self._attached_generation == self.area.generation:
            return
        assert self._conn is not None and self._sock is not None and self.area.fd is not None
        self._conn.send(("attach", self.area.size))
        sendfds(self._sock, [self.area.fd])
        self._attached_generation = self.area.generation

    def submit(self, job: SaveJob) -> None:
        assert self.job is None, "one save in flight at a time"
        self.attach_if_needed()
        assert self._conn is not None
        self._conn.send(("save", job))
        self.job = job

    def send_chunk(self, index: int, segments: Any) -> None:
        """Hand the writer the next staged chunk of the job in flight (a chunked job)."""
        assert self._conn is not None
        self._conn.send(("chunk", index, segments))

    def abort_chunks(self, why: str) -> None:
        """Staging failed part-way: the writer fails the job instead of waiting for chunks."""
        try:
            if self._conn is not None:
                self._conn.send(("chunk_abort", why))
        except OSError:
            pass

    def wait_chunk_done(self, index: int, deadline: float) -> bool:
        """Wait until the writer released chunk ``index`` (True), or finished the job early: it failed (False)."""
        while True:
            msg = self._recv(deadline, f"writing chunk {index}", skip=("attached",))
            if msg[0] == "chunk_done" and msg[1] >= index:
                return True
            if msg[0] == "result":
                self._stash.append(msg)
                return False

    def ready(self) -> bool:
        """True when the job in flight has its result waiting (never blocks)."""
        if any(m[0] == "result" for m in self._stash):
            return True
        if self._conn is None or not self.alive():
            return False
        while self._conn.poll(0):
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                return False
            if msg[0] == "result":
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
            reply = self._recv(time.monotonic() + limit, f"writing step {job.step}", skip=("attached", "chunk_done"))
        except WriterDied as e:
            self.job = None
            return self._after_writer_death(job, str(e))
        self.job = None
        if reply[0] != "result":
            return JobResult(job.save_id, False, f"rank {self.rank}: unexpected reply from the writer: {reply!r}")
        return reply[1]

    def _after_writer_death(self, job: SaveJob, why: str) -> JobResult:
        """The writer died with ``job`` in flight: settle the job's outcome for everyone."""
        log.error("%s", why)
        res = JobResult(job.save_id, False, why)
        try:
            so = job.storage_options
            if read_record(done_record(job.records, job.rank), so) is None:
                write_record(done_record(job.records, job.rank), {"ok": False, "error": why}, so)
            if job.commit is not None:
                outcome = read_record(outcome_record(job.records), so)
                if outcome is None:
                    if _was_committed(job):  # died after the commit point
                        job.commit.target.point_latest()
                        outcome = {"ok": True}
                    else:
                        job.commit.target.abort()
                        outcome = {"ok": False, "error": f"save of step {job.step} failed: {why}"}
                    write_record(outcome_record(job.records), outcome, so)
            else:
                try:
                    outcome = poll_until(time.monotonic() + self.timeout, "rank 0's outcome",
                                         lambda: read_record(outcome_record(job.records), so), max_delay=0.5)
                except TimeoutError:
                    outcome = {"ok": False, "error": f"{why}; rank 0 did not record an outcome either"}
            if outcome.get("ok"):
                res.ok, res.error = True, None
            else:
                res.error = outcome.get("error") or why
                if why not in res.error:
                    res.error = f"{why}; {res.error}"
        except OSError as e:
            res.error = f"{why}; recording the failure also failed: {e}"
        return res

    # ------------------------------------------------------------------ lifetime
    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer (after its job, if any, was waited for) and free the area."""
        if self.proc is not None:
            if self.alive() and self._conn is not None:
                try:
                    self._conn.send(("stop",))
                    self._recv(time.monotonic() + timeout, "stopping", skip=("attached", "result", "chunk_done"))
                except (CheckpointError, OSError, EOFError):
                    pass
            if self.alive():
                self.proc.kill()
            self._close_channel()
            self.proc = None
        self.area.close()
