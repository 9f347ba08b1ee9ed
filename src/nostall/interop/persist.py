"""The memory tier's persist process: the newest committed memory snapshot, committed into the persistent root.

docs/protocol.md, "A last save on preemption". The holder
(:mod:`nostall.memory.holder`) starts this program when the job is preempted
(:class:`nostall.memory.persist.Persisting`): it reads its
:class:`~nostall.memory.persist.Request` on stdin, holds the persistent root's
lock, waits (bounded) for a memory save in flight, copies the memory root's
latest committed step into the persistent root with
:func:`nostall.interop.copy.copy_checkpoint` when it is newer than the root's
latest, moves ``latest`` to it unless a newer step is latest by then, and
writes its outcome as one JSON line on stdout. It ignores SIGTERM, SIGINT and
SIGHUP: the holder SIGKILLs it at the deadline. This module does not import
torch.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from typing import Any, Dict, List, Optional, Set, Tuple

from nostall.core.jobs import Destination
from nostall.errors import CheckpointError
from nostall.interop.copy import copy_checkpoint
from nostall.memory.persist import Request
from nostall.storage.locate import open_root
from nostall.storage.posix import PosixRoot
from nostall.storage.root import OURS_RE, TMP_DIR, Claim, Root, lock_record, step_name

log = logging.getLogger("nostall")

__all__ = ["persist", "main"]

_POLL_S = 0.05
_INFLIGHT_SHARE = 0.5  # the share of the time left that is spent waiting for a memory save in flight


def _in_flight(memory: str) -> List[str]:
    """The memory saves in flight in the memory root (its ``.tmp/save-<id>/`` entries)."""
    try:
        names = os.listdir(os.path.join(memory, TMP_DIR))
    except OSError:
        return []
    return [n for n in names if (m := OURS_RE.match(n)) is not None and m.group(1) == "save"]


def _record(fd: int, data: bytes) -> None:
    """Replace the root's lock record (one write over the old one, then cut to its length)."""
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _note_lock(fd: int, req: Request, until: float) -> Tuple[bytes, bytes]:
    """Say in the root's lock record that this process holds it until ``until`` (wall clock): a restarted job
    waits for it (bounded by ``life``) rather than refuse the root. Returns (the record it replaced, its own)."""
    what = (f"the memory tier's persist process (pid {os.getpid()} on host {socket.gethostname()}), committing "
            f"the newest memory snapshot of a preempted job (trainer pid {req.trainer})")
    data = lock_record(writer_of=req.trainer, until=until, life=req.grace_s, what=what)
    old = b""
    try:
        old = os.pread(fd, 4096, 0)
        _record(fd, data)
    except OSError as e:
        log.warning("memory tier: could not note the persist in the root's lock record: %s", e)
    return old, data


def _put_back(fd: int, records: Tuple[bytes, bytes]) -> None:
    """After the persist: rank 0's record back in the lock it shares with its trainer, unless another process
    (its orphan writer) wrote its own meanwhile."""
    old, ours = records
    try:
        if old and os.pread(fd, 4096, 0) == ours:
            _record(fd, old)
    except OSError:
        pass


def _claim(root: Root, deadline: float) -> Claim:
    """The root taken as a manager takes it (rank 0 left before the signal, so no descriptor was handed over),
    polled until ``deadline``. Raises :class:`~nostall.CheckpointError` naming the holder when another process
    holds it then."""
    while True:
        claim = root.claim()
        if claim.held:
            return claim
        if time.monotonic() > deadline:
            raise CheckpointError(f"the persistent root {root.url} is held by {claim.owner}: the newest memory "
                                  "snapshot is not written into a root another process holds")
        time.sleep(_POLL_S * 2)


def _point_latest(root: Root, step: int) -> None:
    """``latest`` names ``step`` (prepared, then moved, as a save's commit moves it)."""
    dest = Destination(root, step_name(step), step, uuid.uuid4().hex, move_latest=True)
    root.prepare_latest(dest)
    root.move_latest(dest)


def _move_latest(root: Root, step: int, before: Set[int]) -> str:
    """Make ``step`` the root's latest unless a newer step is latest by then; if a save of the job committed a
    newer step (not in ``before``) between that look and the move, ``latest`` moves on to it."""
    latest = root.latest_step()
    if latest is not None and latest >= step:
        return f"latest stays step {latest} (newer)"
    _point_latest(root, step)
    newer = [n for n in root.steps() if n > step and n not in before]
    if newer and root.read_latest() == step:
        _point_latest(root, max(newer))
    return f"latest is step {root.latest_step()}"


def persist(req: Request) -> Dict[str, Any]:
    """Steps 1-4 of the module docstring; the outcome as a dict: ``ok``, ``step`` (the step committed, or
    None), ``bytes`` (copied), ``seconds``, ``note`` (what happened, or why not). Never raises for a
    storage failure: nothing is committed then, and the note says why."""
    t0 = time.monotonic()
    deadline = t0 + req.left_s
    out: Dict[str, Any] = {"ok": False, "step": None, "bytes": 0, "seconds": 0.0, "note": ""}
    memory = PosixRoot(req.memory)
    records: Optional[Tuple[bytes, bytes]] = None
    claim: Optional[Claim] = None
    try:
        root = open_root(req.root, storage_options=req.storage_options)
        fd = req.lock_fd if req.lock_fd >= 0 else None
        if fd is None:
            claim = _claim(root, deadline)
            fd = claim.fd
        if fd is not None:  # (None: object storage, or a filesystem without flock)
            records = _note_lock(fd, req, time.time() + max(0.0, deadline - time.monotonic()))
        wait_until = t0 + req.left_s * _INFLIGHT_SHARE
        while _in_flight(req.memory) and time.monotonic() < wait_until:
            time.sleep(_POLL_S)
        while True:
            m = memory.latest_step()
            latest = root.latest_step()
            if m is None or (latest is not None and latest >= m):
                out.update(ok=True, note=f"nothing to do: the memory tier's newest step is {m}, the persistent "
                                         f"root's latest {latest}")
                break
            before = set(root.steps())
            try:
                if not root.is_checkpoint(step_name(m)):
                    report = copy_checkpoint(memory.path(step_name(m)), root.path(step_name(m)),
                                             dst_storage_options=req.storage_options, dst_root=root)
                    out["bytes"] = report.bytes
            except CheckpointError:
                if memory.latest_step() != m and time.monotonic() < deadline:
                    continue  # retention deleted step m under the copy: a newer snapshot is latest now
                raise
            out.update(ok=True, step=m, note=_move_latest(root, m, before))
            break
    except Exception as e:  # any failure: logged by the holder; the run_job abort left nothing committed
        out["note"] = f"{type(e).__name__}: {e}"
    if claim is not None:
        claim.release()
    elif records is not None:
        _put_back(req.lock_fd, records)
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def main() -> int:
    """The persist process: ignore the job's signals (the holder kills it at the deadline), read the request
    on stdin, persist, write the outcome on stdout."""
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="nostall persist %(process)d: %(message)s", stream=sys.stderr)
    try:
        req = Request(**json.loads(sys.stdin.buffer.read(1 << 20)))
    except (ValueError, TypeError) as e:
        sys.stdout.write(json.dumps({"ok": False, "step": None, "bytes": 0, "seconds": 0.0,
                                     "note": f"bad request: {e}"}))
        return 2
    sys.stdout.write(json.dumps(persist(req)))
    sys.stdout.flush()
    return 0
