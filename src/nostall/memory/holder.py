"""The holder: one process per host and job that owns the lifetime of the job's memory root.

Started by :func:`nostall.memory.rendezvous.ensure_holder` (a fresh
interpreter, in a session of its own), it makes its mark and the memory root,
listens on the job's abstract socket, and serves the trainers' managers:

- on connect: a hello (protocol, nostall version, pid, the mark's token), to a
  peer of this user only (``SO_PEERCRED``; anyone else's connection is closed
  at once: an abstract socket has no permissions);
- ``{"op": "attach", "rank": r, "token": t}``: a manager of rank ``r`` lives
  (the connection stays open for its lifetime); ``t`` is the token of the
  mark (0600: only this user reads it), without which attach and release are
  refused (the connection closed);
- ``{"op": "release", "token": t}``: that manager closed cleanly (``close()``
  with no exception in flight): the job is done with the memory tier on this
  rank;
- ``{"op": "status"}``: the holder's pid, attached ranks, root, and the outcome of a persist;
- ``{"op": "wake", "signal": s, "rank": r, "token": t}``: this connection reports rank ``r``'s signals
  from now on, one raw byte per signal (the trainer's wakeup fd); a byte ``s`` (its preemption signal)
  starts the last save on preemption (:mod:`nostall.memory.persist`).

Rank 0's ``attach`` also carries ``persist`` (the persistent root's URL, its
``storage_options``, ``grace_s``) and, with ``"lock": true``, its descriptor of
the persistent root's lock (``SCM_RIGHTS``), kept only while rank 0 is
attached (the persist process gets its own copy).

It deletes the memory root and its mark and exits when every attached
manager released it and none is attached; when none was attached for
``idle_s`` (since a manager left without releasing it, a crash, or since its
start); or on SIGTERM, SIGINT or SIGHUP, after persisting the newest memory
snapshot. A persist in progress delays the deletion until it ended. It never follows a symbolic link and
deletes only the root its mark proves it (or a predecessor) made. The
snapshots are tmpfs files: they outlive the trainers (and this process, if it
is SIGKILLed, or fails of an internal error: the next holder adopts the root
its predecessor's mark names).

Shutdown order: the listener is closed first (a trainer reattaching now finds
no holder and starts a new one), then the root is deleted (retried, bounded,
while something still writes into it: an orphan writer finishing a memory
save), and the mark is removed only once the root is gone; if the root could
not be deleted the mark stays and the next holder adopts it. The holder holds
an ``flock`` on its mark from its start to its exit, and a successor waits
(bounded) for it before it looks at the mark and the root, so no successor
adopts a root its predecessor is still deleting. This module does not import
torch.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import socket
import stat
import struct
import sys
import time
from typing import Any, Dict, List, Optional

from nostall.memory.persist import Persisting, Request, deadline_after
from nostall.storage.root import lkind
from nostall.memory.relay import Relay, holder_op
from nostall.memory.rendezvous import (MAX_LINE, PROTOCOL, log_path, mark_path, nostall_version, read_mark, send,
                                       socket_name)

log = logging.getLogger("nostall")

_TICK_S = 0.2
_REPLY_S = 1.0  # a client that does not read its reply is dropped after this (the holder serves everyone)
_DELETE_TRIES_S = 5.0  # how long the holder retries deleting a root something still writes into
_PREDECESSOR_S = 60.0  # how long a new holder waits for its predecessor to finish deleting
EXIT_RUNNING = 0  # another holder listens already: nothing to do
EXIT_REFUSED = 3  # the memory root is not ours
EXIT_ERROR = 4  # an internal error: the root and the mark are left to the next holder


class Holder:
    def __init__(self, base: str, key: str, idle_s: float) -> None:
        self.base = base
        self.key = key
        self.idle_s = idle_s
        self.root = os.path.join(base, key)
        self.token = secrets.token_hex(16)
        self.sel = selectors.DefaultSelector()
        self.listener: Optional[socket.socket] = None
        self.bufs: Dict[socket.socket, bytearray] = {}
        self.attached: Dict[socket.socket, int] = {}  # open connections of live managers -> rank
        self.released = 0
        self.crashed = False  # a manager left without releasing since the last attach
        self.idle_since: Optional[float] = time.monotonic()  # nobody attached since then
        self.stop: Optional[str] = None  # why it stops (release, idle, a signal): then it deletes the root
        self.mark_fd: Optional[int] = None
        self.relay: Optional[Relay] = None  # a job on several hosts: replicas, records, outcomes (memory/relay.py)
        self.signalled: Optional[str] = None  # a signal to the holder itself: persist, then stop
        self.wakes: Dict[socket.socket, Any] = {}  # wake connections -> (rank, the signal they report)
        self.fds: Dict[socket.socket, List[int]] = {}  # descriptors received, until an attach takes them
        self.persist_to: Optional[Dict[str, Any]] = None  # rank 0's: root, storage_options, grace_s, trainer
        self.lock: Optional[socket.socket] = None  # rank 0's connection while the holder keeps its lock fd
        self.lock_fd = -1
        self.persisting: Optional[Persisting] = None
        self.persisted: Optional[Dict[str, Any]] = None  # the persist's outcome, once ended

    # ------------------------------------------------------------------ start
    def start(self) -> int:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(socket_name(self.key))
        except OSError:  # EADDRINUSE: a holder runs already (the abstract socket is the real mutex)
            sock.close()
            return EXIT_RUNNING
        self.listener = sock
        path = mark_path(self.base, self.key)
        if not self._outlive_predecessor(path):
            return EXIT_REFUSED
        predecessor = read_mark(self.base, self.key) is not None
        if predecessor or os.path.lexists(path):
            if os.path.lexists(path) and not predecessor:
                log.error("memory tier: %s is not a holder's mark of this user: remove it", path)
                return EXIT_REFUSED
            os.unlink(path)  # the mark of a holder that is gone (SIGKILL, an error, a root it could not delete)
        mode = lkind(self.root)
        if mode is not None and (not predecessor or not stat.S_ISDIR(mode)):
            log.error("memory tier: %s exists and no holder's mark proves nostall made it: remove it", self.root)
            return EXIT_REFUSED
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # (new: nobody else has it) held until this process exits
        os.write(fd, json.dumps({"pid": os.getpid(), "token": self.token}).encode())
        self.mark_fd = fd
        if mode is None:
            os.mkdir(self.root, 0o700)
        else:
            log.info("memory tier: holder %d adopts %s (its predecessor's)", os.getpid(), self.root)
        sock.listen(64)
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ)
        return -1

    def _outlive_predecessor(self, path: str) -> bool:
        """Wait (bounded) until no process holds the flock of the mark at ``path``: a predecessor that closed its
        listener and still deletes its root. False (logged) when it still does after the bound."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return True  # no mark: nobody to wait for
        try:
            deadline = time.monotonic() + _PREDECESSOR_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.error("memory tier: the holder that made %s still runs after %.0fs (deleting its "
                                  "root?): kill it, then restart the job", path, _PREDECESSOR_S)
                        return False
                    time.sleep(0.05)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ serve
    def serve(self) -> None:
        """Serve until a stop, and until a persist in progress ended."""
        while self.stop is None or self.persisting is not None:
            for k, _ in self.sel.select(_TICK_S):
                if k.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(k.fileobj)  # type: ignore[arg-type]
            if self.signalled is not None and self.stop is None:
                self.preempted(self.signalled)
                self.stop = self.signalled
            self._check_idle()
            self._check_persist()

    # ------------------------------------------------------------------ preemption
    def preempted(self, why: str) -> None:
        """The job is preempted: start the last save on preemption, once (later triggers are ignored)."""
        if self.persisting is not None or self.persisted is not None:
            return
        to = self.persist_to
        if to is None:
            self.persisted = {"ok": False, "step": None, "note": "rank 0 never attached: no persistent root known"}
            log.warning("memory tier: %s: nothing to persist here (rank 0's manager did not attach to this holder: "
                        "the holder of rank 0's host persists)", why)
            return
        req = Request(self.root, to["root"], to.get("storage_options"), deadline_after(float(to["grace_s"])),
                      float(to["grace_s"]), self.lock_fd, int(to.get("trainer") or 0))
        log.warning("memory tier: %s: persisting the newest memory snapshot into %s (within %.1fs)", why, to["root"],
                    req.left_s)
        try:
            self.persisting = Persisting(req, sys.stderr)
        except OSError as e:
            self.persisted = {"ok": False, "step": None, "note": f"cannot start the persist process: {e}"}
            log.error("memory tier: %s: cannot start the persist process: %s", why, e)

    def _check_persist(self) -> None:
        if self.persisting is None:
            return
        got = self.persisting.poll()
        if got is None:
            return
        self.persisting, self.persisted = None, got
        if got.get("ok") and got.get("step") is not None:
            log.warning("memory tier: persisted step %s into %s in %.2fs (%d bytes); %s", got["step"],
                        self.persist_to and self.persist_to["root"], got.get("seconds", 0.0), got.get("bytes", 0),
                        got.get("note"))
        elif got.get("ok"):
            log.warning("memory tier: persist: %s", got.get("note"))
        else:
            log.error("memory tier: the newest memory snapshot was NOT persisted into %s: %s; the root's previous "
                      "latest stays, and loads", self.persist_to and self.persist_to["root"], got.get("note"))

    def _wake(self, conn: socket.socket, data: bytes) -> None:
        """Bytes on a wake connection: one per signal the trainer received."""
        rank, signum = self.wakes[conn]
        if signum in data:
            self.preempted(f"rank {rank} received {signal.Signals(signum).name}")  # (checked at "wake")

    def _drop_lock(self) -> None:
        """Rank 0 left: the holder keeps its lock descriptor no longer (a persist process has its own)."""
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
        self.lock_fd, self.lock = -1, None

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
        except OSError:
            uid = -1
        if uid != os.getuid():  # an abstract socket has no permissions: another user's process is turned away
            log.warning("memory tier: a connection from uid %d (not this user's) refused", uid)
            conn.close()
            return
        conn.setblocking(True)
        conn.settimeout(_REPLY_S)
        try:
            send(conn, {"protocol": PROTOCOL, "version": nostall_version(), "pid": os.getpid(), "token": self.token})
        except OSError:
            conn.close()
            return
        conn.setblocking(False)
        self.bufs[conn] = bytearray()
        self.sel.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        try:
            chunk, fds, _, _ = socket.recv_fds(conn, 4096, 1, socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            return
        except OSError:
            chunk, fds = b"", []
        self.fds.setdefault(conn, []).extend(fds)
        if not chunk:
            self._drop(conn)
            return
        if conn in self.wakes:
            self._wake(conn, chunk)
            return
        buf = self.bufs[conn]
        buf += chunk
        while b"\n" in buf and conn not in self.wakes:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            try:
                msg = json.loads(line)
                self._handle(conn, msg)
            except (ValueError, TypeError, AttributeError, KeyError, OSError):
                self._drop(conn)
                return
        if conn in self.wakes and buf:
            self._wake(conn, bytes(buf))
            buf.clear()
        if not buf:
            for fd in self.fds.pop(conn, []):  # sent with no attach that takes it
                os.close(fd)
        if len(buf) > MAX_LINE:
            self._drop(conn)

    def _reply(self, conn: socket.socket, msg: Dict[str, object]) -> None:
        conn.setblocking(True)
        conn.settimeout(_REPLY_S)
        try:
            send(conn, msg)
        finally:
            conn.setblocking(False)

    def _handle(self, conn: socket.socket, msg: Dict[str, object]) -> None:
        op = msg.get("op")
        if op in ("attach", "release", "listen", "peers", "wake") and msg.get("token") != self.token:
            raise ValueError(f"{op} without the mark's token")  # the connection is dropped
        if op == "attach":
            rank = msg.get("rank")
            if not isinstance(rank, int):
                raise ValueError("attach without a rank")
            self.attached[conn] = rank
            self.crashed = False
            persist = msg.get("persist")
            if rank == 0 and isinstance(persist, dict):
                self.persist_to = {**persist, "trainer": msg.get("pid")}
                self._drop_lock()
                got = self.fds.get(conn) or []
                if msg.get("lock") and got:
                    self.lock_fd, self.lock = got.pop(0), conn
            self.idle_since = None
            self._reply(conn, {"ok": True, "root": self.root, "pid": os.getpid()})
        elif op == "release":
            if conn is self.lock:
                self._drop_lock()
            if conn in self.attached:
                del self.attached[conn]
                self.released += 1
            self._reply(conn, {"ok": True})
            self._left()
        elif op in ("listen", "peers"):  # a job on several hosts (memory/relay.py)
            self.relay, answer = holder_op(self.relay, self.root, msg)
            self._reply(conn, answer)
        elif op == "status":
            ranks: List[int] = sorted(self.attached.values())
            self._reply(conn, {"ok": True, "pid": os.getpid(), "root": self.root, "attached": ranks,
                               "released": self.released, "persisting": self.persisting is not None,
                               "persisted": self.persisted})
        elif op == "wake":
            signum = msg["signal"]
            if not isinstance(signum, int) or not 0 < signum < 256:
                raise ValueError("wake without a signal number")
            signal.Signals(signum)  # ValueError (the connection dropped) for a number that is no signal
            self.wakes[conn] = (msg.get("rank"), signum)
            self._reply(conn, {"ok": True})
        else:
            raise ValueError(f"unknown op {op!r}")

    def _drop(self, conn: socket.socket) -> None:
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        self.bufs.pop(conn, None)
        self.wakes.pop(conn, None)
        for fd in self.fds.pop(conn, []):
            os.close(fd)
        if conn is self.lock:
            self._drop_lock()
        if conn in self.attached:  # a manager gone without releasing: its trainer died
            rank = self.attached.pop(conn)
            self.crashed = True
            log.info("memory tier: the manager of rank %d left without releasing %s: snapshots kept for a restart "
                     "(at most %.0fs without a manager)", rank, self.root, self.idle_s)
            self._left()
        conn.close()

    def _left(self) -> None:
        if self.attached:
            return
        if self.released and not self.crashed:
            self.stop = "every manager released the memory tier"
        else:
            self.idle_since = time.monotonic()

    def _check_idle(self) -> None:
        if self.stop is None and not self.attached and self.idle_since is not None:
            if time.monotonic() - self.idle_since >= self.idle_s:
                self.stop = f"no manager attached for {self.idle_s:.0f}s"

    # ------------------------------------------------------------------ end
    def cleanup(self) -> None:
        """Stop listening, delete the memory root, then the mark (ours: we wrote it) once the root is gone."""
        if self.relay is not None:
            self.relay.drain()  # (several hosts) what the trainers finished is relayed before the root goes
        self.close_connections()
        deadline = time.monotonic() + _DELETE_TRIES_S
        while True:
            mode = lkind(self.root)
            if mode is None or not stat.S_ISDIR(mode):
                break
            shutil.rmtree(self.root, ignore_errors=True)  # rmtree never follows a symbolic link inside
            if lkind(self.root) is None or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # something still writes into it (an orphan writer finishing a memory save)
        if lkind(self.root) is not None:
            log.error("memory tier: %s could not be deleted within %.0fs (something still writes into it): its mark "
                      "stays, so the next holder adopts it (and deletes it in turn)", self.root, _DELETE_TRIES_S)
            return
        mark = read_mark(self.base, self.key)
        if mark is not None and mark.get("token") == self.token:
            os.unlink(mark_path(self.base, self.key))
        for made in (os.path.join(self.base, f"{self.key}.lock"), log_path(self.base, self.key)):
            # (unlinking <key>.lock can let two starters both pass its flock: harmless, the abstract socket is
            # the real mutex and the second holder exits at once, EXIT_RUNNING)
            if stat.S_ISREG(lkind(made) or 0):
                try:
                    os.unlink(made)
                except OSError:
                    pass

    def close_connections(self) -> None:
        """Close the listener first (a reattaching trainer finds no holder and starts one), then every client."""
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.listener is not None:
            try:
                self.sel.unregister(self.listener)
            except (KeyError, ValueError):
                pass
            self.listener.close()
            self.listener = None
        for conn in list(self.bufs):
            conn.close()
            for fd in self.fds.pop(conn, []):
                os.close(fd)
        self.bufs.clear()
        self.attached.clear()
        self.wakes.clear()
        self._drop_lock()


def main(argv: List[str]) -> int:
    """``holder <base> <key> <idle_s>``: serve until released, abandoned or signalled."""
    logging.basicConfig(level=logging.INFO, format="nostall holder %(process)d: %(message)s", stream=sys.stderr)
    base, key, idle_s = argv[0], argv[1], float(argv[2])
    holder = Holder(base, key, idle_s)

    def on_signal(signum: int, frame: object) -> None:
        holder.signalled = f"signal {signal.Signals(signum).name}"  # serve() persists, then stops

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    code = holder.start()
    if code >= 0:
        return code
    return run(holder)


def run(holder: Holder) -> int:
    """Serve; delete the root only when the holder stops for a reason (release, idle, a signal). An internal
    error leaves the root and the mark to the next holder (it adopts them), and exits with EXIT_ERROR."""
    try:
        holder.serve()
    except Exception:
        log.exception("memory tier: internal error: %s and its mark are left for the next holder to adopt",
                      holder.root)
        if holder.persisting is not None:
            holder.persisting.kill()
        holder.close_connections()
        return EXIT_ERROR
    log.info("memory tier: %s: releasing %s", holder.stop, holder.root)
    holder.cleanup()
    return 0
