"""The holder: one process per host and job that owns the lifetime of the job's memory root.

Started by :func:`nostall.memory.rendezvous.ensure_holder` (a fresh
interpreter, in a session of its own), it makes its mark and the memory root,
listens on the job's abstract socket, and serves the trainers' managers:

- on connect: a hello (protocol, nostall version, pid, the mark's token);
- ``{"op": "attach", "rank": r}``: a manager of rank ``r`` lives (the
  connection stays open for its lifetime);
- ``{"op": "release"}``: that manager closed (``close()``): the job is done with
  the memory tier on this rank;
- ``{"op": "status"}``: the holder's pid, attached ranks, root.

It deletes the memory root and its mark and exits when every attached
manager released it and none is attached; when none was attached for
``idle_s`` (since a manager left without releasing it, a crash, or since its
start); or on SIGTERM, SIGINT or SIGHUP. It never follows a symbolic link and
deletes only the root its mark proves it (or a predecessor) made. The
snapshots are tmpfs files: they outlive the trainers (and this process, if it
is SIGKILLed: the next holder adopts the root its predecessor's mark names).
This module does not import torch.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import socket
import stat
import sys
import time
from typing import Dict, List, Optional

from nostall.memory.rendezvous import PROTOCOL, log_path, mark_path, nostall_version, read_mark, send, socket_name

log = logging.getLogger("nostall")

_TICK_S = 0.2
EXIT_RUNNING = 0  # another holder listens already: nothing to do
EXIT_REFUSED = 3  # the memory root is not ours


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
        self.stop: Optional[str] = None

    # ------------------------------------------------------------------ start
    def start(self) -> int:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(socket_name(self.key))
        except OSError:  # EADDRINUSE: a holder runs already
            sock.close()
            return EXIT_RUNNING
        self.listener = sock
        predecessor = read_mark(self.base, self.key) is not None
        path = mark_path(self.base, self.key)
        if predecessor or os.path.lexists(path):
            if os.path.lexists(path) and not predecessor:
                log.error("memory tier: %s is not a holder's mark of this user: remove it", path)
                return EXIT_REFUSED
            os.unlink(path)  # the mark of a holder that died (SIGKILL): its socket is gone, ours is bound
        mode = _lkind(self.root)
        if mode is not None and (not predecessor or not stat.S_ISDIR(mode)):
            log.error("memory tier: %s exists and no holder's mark proves nostall made it: remove it", self.root)
            return EXIT_REFUSED
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "token": self.token}, f)
        if mode is None:
            os.mkdir(self.root, 0o700)
        else:
            log.info("memory tier: holder %d adopts %s (its predecessor's)", os.getpid(), self.root)
        sock.listen(64)
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ)
        return -1

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
        except BlockingIOError:
            return
        conn.setblocking(True)
        conn.settimeout(5.0)
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
        if len(buf) > 1 << 16:
            self._drop(conn)

    def _reply(self, conn: socket.socket, msg: Dict[str, object]) -> None:
        conn.setblocking(True)
        conn.settimeout(5.0)
        try:
            send(conn, msg)
        finally:
            conn.setblocking(False)

    def _handle(self, conn: socket.socket, msg: Dict[str, object]) -> None:
        op = msg.get("op")
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
        """Delete the memory root and the mark (ours: we wrote it), then stop listening."""
        mode = _lkind(self.root)
        if mode is not None and stat.S_ISDIR(mode):
            shutil.rmtree(self.root, ignore_errors=True)  # rmtree never follows a symbolic link inside
        mark = read_mark(self.base, self.key)
        if mark is not None and mark.get("token") == self.token:
            os.unlink(mark_path(self.base, self.key))
        for made in (os.path.join(self.base, f"{self.key}.lock"), log_path(self.base, self.key)):
            if stat.S_ISREG(_lkind(made) or 0):
                try:
                    os.unlink(made)
                except OSError:
                    pass
        for conn in list(self.bufs):
            conn.close()
        if self.listener is not None:
            self.listener.close()


def _lkind(path: str) -> Optional[int]:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None


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
    try:
        holder.serve()
    finally:
        log.info("memory tier: %s: releasing %s", holder.stop or "error", holder.root)
        holder.cleanup()
    return 0
