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
- ``{"op": "status"}``: the holder's pid, attached ranks, root.

It deletes the memory root and its mark and exits when every attached
manager released it and none is attached; when none was attached for
``idle_s`` (since a manager left without releasing it, a crash, or since its
start); or on SIGTERM, SIGINT or SIGHUP. It never follows a symbolic link and
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
from typing import Dict, List, Optional

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
        while self.stop is None:
            for k, _ in self.sel.select(_TICK_S):
                if k.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(k.fileobj)  # type: ignore[arg-type]
            self._check_idle()

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
            chunk = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        buf = self.bufs[conn]
        buf += chunk
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            try:
                msg = json.loads(line)
                self._handle(conn, msg)
            except (ValueError, TypeError, AttributeError, OSError):
                self._drop(conn)
                return
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
        if op in ("attach", "release", "listen", "peers") and msg.get("token") != self.token:
            raise ValueError(f"{op} without the mark's token")  # the connection is dropped
        if op == "attach":
            rank = msg.get("rank")
            if not isinstance(rank, int):
                raise ValueError("attach without a rank")
            self.attached[conn] = rank
            self.crashed = False
            self.idle_since = None
            self._reply(conn, {"ok": True, "root": self.root, "pid": os.getpid()})
        elif op == "release":
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
                               "released": self.released})
        else:
            raise ValueError(f"unknown op {op!r}")

    def _drop(self, conn: socket.socket) -> None:
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        self.bufs.pop(conn, None)
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
        self.bufs.clear()
        self.attached.clear()


def main(argv: List[str]) -> int:
    """``holder <base> <key> <idle_s>``: serve until released, abandoned or signalled."""
    logging.basicConfig(level=logging.INFO, format="nostall holder %(process)d: %(message)s", stream=sys.stderr)
    base, key, idle_s = argv[0], argv[1], float(argv[2])
    holder = Holder(base, key, idle_s)

    def on_signal(signum: int, frame: object) -> None:
        holder.stop = f"signal {signal.Signals(signum).name}"

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
        holder.close_connections()
        return EXIT_ERROR
    log.info("memory tier: %s: releasing %s", holder.stop, holder.root)
    holder.cleanup()
    return 0
