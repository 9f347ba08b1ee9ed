"""The memory tier across hosts: which host holds whose replica, how a holder is reached, replicas on the wire.

docs/protocol.md, "Memory tier", "Between hosts". Torch-free (the holder
imports it).

- :func:`number_hosts`, :class:`HostTable`: hosts are numbered by their
  lowest rank (host 0 holds rank 0); host ``h``'s snapshot is replicated on
  host ``(h + peer_jump) % H`` (NVRx's ``replication_jump``); a jump that maps
  a host to itself is refused (:func:`check_jump`).
- :func:`reachable_address`: the address of this host that the others reach
  (the source address the kernel picks for ``MASTER_ADDR``).
- :func:`send_replica` / :func:`receive_replica`: one save's files of a host,
  streamed over an authenticated :class:`~nostall.memory.wire.Wire` into a
  directory of the peer's memory root, each frame checksummed, the whole
  acknowledged only once every byte is written.
- :class:`PeerServer`: a holder's TCP listener (a thread per connection,
  bounded), dispatching authenticated requests to handlers by ``op``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from nostall.memory.rendezvous import MemoryTierError
from nostall.memory.wire import Throttle, Wire, WireError, accept_peer
from nostall.storage.files import open_dir_beneath, plain_parts, unlink_beneath

log = logging.getLogger("nostall")

__all__ = ["HostTable", "number_hosts", "check_jump", "reachable_address", "send_replica", "receive_replica",
           "PeerServer", "Replica"]

_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 4 << 20
_MAX_FILES = 1 << 16
_MAX_CONNECTIONS = 64


def number_hosts(idents: Sequence[Hashable]) -> List[int]:
    """Each rank's host index, given each rank's host identity: hosts numbered in order of their lowest rank.

    >>> number_hosts(["b", "b", "a", "a", "c"])
    [0, 0, 1, 1, 2]
    """
    index: Dict[Hashable, int] = {}
    return [index.setdefault(i, len(index)) for i in idents]


def check_jump(jump: int, hosts: int) -> None:
    """Refuse a ``peer_jump`` that maps a host to itself when there are several hosts.

    >>> check_jump(1, 2); check_jump(4, 1)
    >>> check_jump(2, 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nostall.memory.rendezvous.MemoryTierError: MemoryTier.peer_jump=2 maps every host to itself on 2 hosts ...
    """
    if hosts > 1 and jump % hosts == 0:
        raise MemoryTierError(f"MemoryTier.peer_jump={jump} maps every host to itself on {hosts} hosts (a host's "
                              "snapshot would be replicated on the host that holds it, and lost with it): set "
                              f"peer_jump to a number that is not a multiple of {hosts} (1: the next host)")


@dataclass(frozen=True)
class HostTable:
    """A job's hosts: each rank's host, each host's holder address (``addr``, ``port``), the peer jump."""

    host_of: Tuple[int, ...]
    addrs: Tuple[Tuple[str, int], ...]
    jump: int = 1

    def __post_init__(self) -> None:
        if sorted(set(self.host_of)) != list(range(len(self.addrs))):
            raise MemoryTierError(f"a host table names hosts {sorted(set(self.host_of))} for {len(self.addrs)} "
                                  "holder addresses")
        check_jump(self.jump, len(self.addrs))

    @property
    def hosts(self) -> int:
        return len(self.addrs)

    def peer(self, host: int) -> int:
        """The host that holds ``host``'s replica (itself with one host: no replica)."""
        return (host + self.jump) % self.hosts

    def source(self, host: int) -> int:
        """The host whose replica ``host`` holds."""
        return (host - self.jump) % self.hosts

    def ranks_of(self, host: int) -> List[int]:
        return [r for r, h in enumerate(self.host_of) if h == host]

    def to_doc(self) -> Dict[str, object]:
        return {"host_of": list(self.host_of), "addrs": [list(a) for a in self.addrs], "jump": self.jump}

    @classmethod
    def from_doc(cls, doc: Dict[str, object]) -> "HostTable":
        host_of = doc["host_of"]
        addrs = doc["addrs"]
        jump = doc["jump"]
        if not isinstance(host_of, list) or not isinstance(addrs, list) or not isinstance(jump, int):
            raise MemoryTierError(f"not a host table: {doc!r}")
        return cls(tuple(int(h) for h in host_of), tuple((str(a), int(p)) for a, p in addrs), jump)


def reachable_address(master_addr: Optional[str], port: int = 29500) -> str:
    """This host's address that the job's other hosts reach: the source address the kernel picks for a route to
    ``master_addr`` (a UDP ``connect`` sends nothing). Without ``MASTER_ADDR`` (one host), or when it is this
    host, a loopback route: ``127.0.0.1``."""
    if not master_addr:
        return "127.0.0.1"
    try:
        family = socket.getaddrinfo(master_addr, port, type=socket.SOCK_DGRAM)[0]
    except OSError as e:
        raise MemoryTierError(f"cannot resolve MASTER_ADDR={master_addr!r} to find this host's address for the "
                              f"memory tier's peers: {e}") from e
    with socket.socket(family[0], socket.SOCK_DGRAM) as s:
        try:
            s.connect(family[4])
        except OSError as e:
            raise MemoryTierError(f"no route to MASTER_ADDR={master_addr!r} ({e}): the memory tier's holders "
                                  "cannot reach each other") from e
        return str(s.getsockname()[0])


# ---------------------------------------------------------------------- replicas on the wire
@dataclass(frozen=True)
class Replica:
    """What a holder received and wrote: a save's files of host ``host`` (name -> size)."""

    save_id: str
    step: int
    host: int
    files: Dict[str, int]


def _open_new(top: str, rel: str, made: List[str]) -> int:
    """Create the regular file ``top/rel`` (folders made as needed, each one made appended to ``made`` as its
    path under ``top``), nothing followed, refusing one that exists."""
    parts = plain_parts(rel)
    fd = open_dir_beneath(top)
    try:
        for i, part in enumerate(parts[:-1]):
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
                made.append("/".join(parts[:i + 1]))
            except FileExistsError:
                pass
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                       dir_fd=fd)
    finally:
        os.close(fd)


def _remove_made(top: str, made: List[str]) -> None:
    """Remove the folders ``made`` under ``top`` (paths as :func:`_open_new` records them), innermost first, each
    only if empty and reached without following a link: what someone else put in one stays."""
    for rel in reversed(made):
        parts = plain_parts(rel)
        try:
            fd = open_dir_beneath(top, parts[:-1])
        except OSError:
            continue
        try:
            os.rmdir(parts[-1], dir_fd=fd)
        except OSError:
            pass  # not empty, or already gone with a file's emptied folders
        finally:
            os.close(fd)


def send_replica(wire: Wire, *, save_id: str, step: int, host: int, top: str, names: Sequence[str],
                 deadline: float, throttle: Optional[Throttle] = None) -> Dict[str, int]:
    """Stream the files ``names`` of directory ``top`` (regular files, nothing followed) to the peer as host
    ``host``'s replica of save ``save_id``; return them (name -> size) once the peer acknowledged every byte.
    :class:`WireError` (the peer refused, a checksum failed, the deadline passed) or ``OSError`` (a file)."""
    files: Dict[str, int] = {}
    fds: List[int] = []
    try:
        for n in names:
            parts = plain_parts(n)
            d = open_dir_beneath(top, parts[:-1])
            try:
                f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
            finally:
                os.close(d)
            fds.append(f)
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{os.path.join(top, n)} is not a regular file")
            files[n] = st.st_size
        wire.send({"op": "replica", "save_id": save_id, "step": step, "host": host,
                   "files": [[n, z] for n, z in files.items()]}, deadline=deadline)
        for (n, size), f in zip(files.items(), fds):
            offset = 0
            while offset < size:
                chunk = os.pread(f, min(_CHUNK, size - offset), offset)
                if not chunk:
                    raise OSError(f"{os.path.join(top, n)} shrank while it was sent ({offset} of {size} bytes)")
                wire.send({"op": "data", "name": n, "offset": offset}, chunk, deadline=deadline, throttle=throttle)
                offset += len(chunk)
        wire.send({"op": "end", "save_id": save_id}, deadline=deadline)
        ack, _ = wire.expect("ack", deadline)
        if ack.get("save_id") != save_id or ack.get("files") != [[n, z] for n, z in files.items()]:
            raise WireError(f"{wire.where} acknowledged other files than the replica of save {save_id} it was sent")
        return files
    finally:
        for f in fds:
            os.close(f)


def receive_replica(wire: Wire, header: Dict[str, object], directory: Callable[[str, int], str],
                    deadline: float, before_ack: Optional[Callable[[Replica], None]] = None) -> Replica:
    """Receive the replica that the ``{"op": "replica"}`` frame ``header`` announces into ``directory(save_id,
    step)`` (made by the caller, marked as nostall's); acknowledge it once every byte is written (and
    ``before_ack`` returned: the caller moves the files where they belong). Anything
    wrong (a name that leaves the directory, a file that exists, a frame out of order, a short file) is sent
    back as an error, the files written so far and the folders made for them are removed, and
    :class:`WireError` raised."""
    written: List[str] = []
    made: List[str] = []
    top = ""
    try:
        save_id, step, host, listing = header.get("save_id"), header.get("step"), header.get("host"), header.get(
            "files")
        if not isinstance(save_id, str) or not _SAVE_ID.match(save_id) or not isinstance(step, int) or step < 0 \
                or not isinstance(host, int) or not isinstance(listing, list) or len(listing) > _MAX_FILES:
            raise WireError(f"{wire.where} announced a malformed replica: {header!r}")
        files: Dict[str, int] = {}
        for item in listing:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], int) and item[1] >= 0):
                raise WireError(f"{wire.where} announced a malformed file in the replica of save {save_id}: {item!r}")
            try:
                plain_parts(item[0])
            except OSError:
                raise WireError(f"{wire.where} announced a file name that is not plain and relative: "
                                f"{item[0]!r}") from None
            files[item[0]] = item[1]
        top = directory(save_id, step)
        for n, size in files.items():
            fd = _open_new(top, n, made)
            written.append(n)
            try:
                offset = 0
                while offset < size:
                    got, payload = wire.expect("data", deadline)
                    if got.get("name") != n or got.get("offset") != offset or offset + len(payload) > size:
                        raise WireError(f"{wire.where} sent {got.get('name')!r} at {got.get('offset')} where "
                                        f"{n!r} at {offset} was expected (replica of save {save_id})")
                    os.pwrite(fd, payload, offset)
                    offset += len(payload)
            finally:
                os.close(fd)
        wire.expect("end", deadline)
        replica = Replica(save_id, step, host, files)
        if before_ack is not None:
            before_ack(replica)
        wire.send({"op": "ack", "save_id": save_id, "files": [[n, z] for n, z in files.items()]}, deadline=deadline)
        return replica
    except (WireError, OSError, ValueError, MemoryTierError) as e:  # ValueError: what the OS refuses to name
        for n in written:
            unlink_beneath(top, n)
        _remove_made(top, made)
        try:
            wire.send({"op": "error", "error": f"{type(e).__name__}: {e}"}, deadline=min(deadline,
                                                                                        time.monotonic() + 1.0))
        except WireError:
            pass
        if isinstance(e, WireError):
            raise
        raise WireError(f"the replica from {wire.where} could not be written: {e}") from e


Handler = Callable[[Wire, Dict[str, object], bytes], None]


class PeerServer:
    """A holder's TCP listener for its peers: each connection authenticated (the job's secret), then each of its
    requests handed to ``handlers[op]`` (which answers on the wire); a connection whose request fails is closed.
    At most 64 connections at a time; each request bounded by ``timeout``. :meth:`close` stops it (bounded)."""

    def __init__(self, addr: str, secret: str, handlers: Dict[str, Handler], timeout: float,
                 port: int = 0) -> None:
        self.secret = secret
        self.handlers = handlers
        self.timeout = timeout
        self.sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, port))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.addr = addr
        self.port: int = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: Dict[int, socket.socket] = {}
        self._threads: Dict[int, threading.Thread] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="nostall-peers", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                if len(self._conns) >= _MAX_CONNECTIONS or self._stop.is_set():
                    conn.close()
                    continue
                self._conns[id(conn)] = conn
                t = threading.Thread(target=self._serve, args=(conn, f"the peer at {peer[0]}:{peer[1]}"),
                                     name="nostall-peer", daemon=True)
                self._threads[id(conn)] = t
            t.start()

    def _serve(self, conn: socket.socket, where: str) -> None:
        try:
            wire = accept_peer(conn, where, self.secret, time.monotonic() + min(self.timeout, 10.0))
            while not self._stop.is_set():
                try:
                    header, payload = wire.recv(time.monotonic() + self.timeout)
                except WireError:
                    return  # closed (or idle past the bound): the client reconnects when it needs to
                handler = self.handlers.get(str(header.get("op")))
                if handler is None:
                    wire.send({"op": "error", "error": f"unknown request {header.get('op')!r}"},
                              deadline=time.monotonic() + 1.0)
                    return
                handler(wire, header, payload)
        except (WireError, OSError) as e:
            log.warning("memory tier: %s: %s (connection closed)", where, e)
        except Exception:  # a handler's bug: this connection ends, the holder goes on
            log.exception("memory tier: serving %s failed (connection closed)", where)
        finally:
            with self._lock:
                self._conns.pop(id(conn), None)
                self._threads.pop(id(conn), None)
            conn.close()

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, shut every connection down, wait for the listener thread and then every connection's
        thread (a handler may be writing into the memory root: the caller removes it only after), all within
        ``timeout`` together; a thread still running then is named in a warning. Idempotent."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for c in self._conns.values():
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._threads.values())
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        left = [t for t in threads if t.is_alive()]
        if left:
            log.warning("memory tier: %d peer connection(s) of the holder's listener on %s:%d still ran %.1f s "
                        "after close (a handler past its bound); they end at their own deadline", len(left),
                        self.addr, self.port, timeout)
