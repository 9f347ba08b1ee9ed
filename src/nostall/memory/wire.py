"""The holders' wire: framed, checksummed, authenticated messages over TCP between hosts (torch-free).

docs/protocol.md, "Memory tier", "Between hosts". The holders of a job's hosts
talk over plain TCP sockets, not over a gloo group: a holder must stay
torch-free (it starts in a fraction of a second, costs no accelerator context,
and runs other code than a trainer only if the version handshake lets it) and
it outlives the trainers, whose process group dies with them.

**A frame** is a fixed prefix, a JSON header and a payload::

    magic b"NSPW" | header length u32 | payload length u64 | CRC32C(header) u32 | CRC32C(payload) u32
    header (UTF-8 JSON object, at most 64 KiB) | payload (at most ``max_payload`` bytes)

(big-endian). The receiver checks the magic, both bounds, both checksums (the
project's CRC32C, :func:`nostall.core.format.crc`) and that the header is a
JSON object before it acts on anything; a frame that fails any check, or that
ends early (the connection closed or the deadline passed mid-frame), is
refused with :class:`WireError` and the connection is closed by its owner.

**Authentication** (mutual, at connect): both ends hold the job's secret (rank
0 draws it; it reaches every holder over the trainers' gloo group and the
holder's private unix socket). The client opens with ``{"op": "hello",
"nonce": c}``; the server answers ``{"op": "challenge", "nonce": s, "mac":
HMAC(secret, "server" | c | s)}``; the client checks that mac and answers
``{"op": "auth", "mac": HMAC(secret, "client" | s | c)}``; the server checks it
and answers ``{"op": "welcome"}``. Nonces are 16 random bytes each (hex);
HMAC-SHA256, compared in constant time (a mac that is not an ASCII string is
a wrong mac: :class:`WireError`). Nothing but these frames is read before the
exchange completes, so a process that does not hold the secret can neither
write into a memory root nor pose as a peer that acknowledges a replica.
These frames carry no payload: until the exchange completes both ends take
frames of payload length 0 only (``HANDSHAKE_PAYLOAD``), so a connection that
has not authenticated costs at most one header (64 KiB); the full
``max_payload`` applies from ``welcome`` on. A payload is read into a buffer
that grows with the bytes that arrive (1 MiB at a time), never allocated at
the length a frame announces.

**Bounds.** Every read and write has a deadline (:class:`Wire` methods take
one); a :class:`Throttle` paces the payload bytes a sender puts on the link
(``MemoryTier.peer_bytes_per_s``; None: unlimited).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import socket
import struct
import time
from typing import Any, Dict, Optional, Tuple, Union

from nostall.core.format import crc
from nostall.memory.rendezvous import MemoryTierError

__all__ = ["WireError", "Wire", "Throttle", "MAGIC", "PREFIX", "MAX_HEADER", "MAX_PAYLOAD", "HANDSHAKE_PAYLOAD",
           "new_secret", "mac", "connect_peer", "accept_peer"]

MAGIC = b"NSPW"
PREFIX = struct.Struct(">4sIQII")  # magic, header length, payload length, crc32c(header), crc32c(payload)
MAX_HEADER = 1 << 16
MAX_PAYLOAD = 64 << 20  # a file travels in frames of at most this many bytes
HANDSHAKE_PAYLOAD = 0  # hello, challenge, auth, welcome carry no payload: nothing larger is taken before welcome
_NONCE = 16
_NONCE_HEX = re.compile(r"^[0-9a-f]{%d}$" % (2 * _NONCE))
_READ_STEP = 1 << 20  # a payload's buffer grows by at most this much per read: by what arrived, not what was announced

Buffer = Union[bytes, bytearray, memoryview]


class WireError(MemoryTierError):
    """A frame between holders was refused (bad magic, length, checksum or authentication; cut short; late)."""


def new_secret() -> str:
    """A per-job secret (rank 0 draws it): 32 random bytes, hex."""
    return secrets.token_hex(32)


def mac(secret: str, role: str, first: str, second: str) -> str:
    """HMAC-SHA256 of ``role | first | second`` (the nonces, hex) under the job's secret, hex."""
    msg = b"nostall-peer\0" + role.encode() + b"\0" + first.encode() + b"\0" + second.encode()
    return hmac.new(bytes.fromhex(secret), msg, hashlib.sha256).hexdigest()


def _mac_ok(got: object, want: str) -> bool:
    """Whether ``got`` (a frame's ``mac``, any JSON value) is the mac ``want``, compared in constant time as
    bytes; anything but an ASCII string is a wrong mac (``hmac.compare_digest`` would raise on it)."""
    if not isinstance(got, str):
        return False
    try:
        raw = got.encode("ascii")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(raw, want.encode("ascii"))


def _nonce(header: Dict[str, Any]) -> str:
    """The frame's nonce if it is 16 bytes in lower-case hex, else ``""``."""
    n = header.get("nonce")
    return n if isinstance(n, str) and _NONCE_HEX.match(n) else ""


class Throttle:
    """Paces bytes to at most ``bytes_per_s`` on average (None: no pacing); one per sending connection."""

    def __init__(self, bytes_per_s: Optional[float]) -> None:
        self.rate = bytes_per_s
        self._t0 = time.monotonic()
        self._sent = 0

    def wait(self, n: int, deadline: float) -> None:
        """Account ``n`` bytes about to be sent; sleep until they fit the rate (never past ``deadline``)."""
        if self.rate is None:
            return
        self._sent += n
        due = self._t0 + self._sent / self.rate
        now = time.monotonic()
        if due > now:
            if due > deadline:
                raise WireError(f"the throttle ({self.rate:.0f} bytes/s) cannot send {n} more bytes before the "
                                "deadline: raise MemoryTier.peer_bytes_per_s or the manager's timeout")
            time.sleep(due - now)


class Wire:
    """One TCP connection carrying frames; ``where`` names the other end in every error."""

    def __init__(self, sock: socket.socket, where: str, max_payload: int = MAX_PAYLOAD) -> None:
        self.sock = sock
        self.where = where
        self.max_payload = max_payload

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ frames
    def send(self, header: Dict[str, Any], payload: Buffer = b"", *, deadline: float,
             throttle: Optional[Throttle] = None) -> None:
        """Send one frame (bounded by ``deadline``; the payload paced by ``throttle``)."""
        head = json.dumps(header, sort_keys=True).encode()
        body = memoryview(payload).cast("B")
        if len(head) > MAX_HEADER or len(body) > self.max_payload:
            raise WireError(f"a frame to {self.where} is too large (header {len(head)}, payload {len(body)} "
                            f"bytes; at most {MAX_HEADER}, {self.max_payload})")
        prefix = PREFIX.pack(MAGIC, len(head), len(body), crc(head), crc(body))
        self._send_all(prefix + head, deadline)
        step = 1 << 20
        for i in range(0, len(body), step):
            piece = body[i:i + step]
            if throttle is not None:
                throttle.wait(len(piece), deadline)
            self._send_all(piece, deadline)

    def recv(self, deadline: float) -> Tuple[Dict[str, Any], bytes]:
        """The next frame, checked (:class:`WireError` for anything wrong, end of stream included)."""
        raw = self._recv_exact(PREFIX.size, deadline, "the frame's prefix")
        magic, hlen, plen, hcrc, pcrc = PREFIX.unpack(raw)
        if magic != MAGIC:
            raise WireError(f"{self.where} sent something that is not a nostall peer frame (magic {magic!r})")
        if hlen > MAX_HEADER or plen > self.max_payload:
            raise WireError(f"{self.where} announced a frame too large (header {hlen}, payload {plen} bytes; at "
                            f"most {MAX_HEADER}, {self.max_payload})")
        head = self._recv_exact(hlen, deadline, "the frame's header")
        if crc(head) != hcrc:
            raise WireError(f"the header of a frame from {self.where} fails its CRC32C (corrupted in transit)")
        try:
            header = json.loads(head)
        except ValueError as e:
            raise WireError(f"the header of a frame from {self.where} is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise WireError(f"the header of a frame from {self.where} is not a JSON object")
        payload = self._recv_exact(plen, deadline, "the frame's payload")
        if crc(payload) != pcrc:
            raise WireError(f"the payload of a frame from {self.where} ({header.get('op')!r}, {plen} bytes) fails "
                            "its CRC32C (corrupted in transit)")
        return header, payload

    def expect(self, op: str, deadline: float) -> Tuple[Dict[str, Any], bytes]:
        """The next frame, which must be ``op`` (an ``{"op": "error"}`` frame is raised with its reason)."""
        header, payload = self.recv(deadline)
        got = header.get("op")
        if got == "error":
            raise WireError(f"{self.where} refused: {header.get('error')}")
        if got != op:
            raise WireError(f"{self.where} sent {got!r} where {op!r} was expected")
        return header, payload

    # ------------------------------------------------------------------ bytes
    def _send_all(self, data: Buffer, deadline: float) -> None:
        view = memoryview(data).cast("B")
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireError(f"sending to {self.where} did not finish in time (the peer does not read)")
            self.sock.settimeout(left)
            try:
                n = self.sock.send(view)
            except socket.timeout:
                continue
            except OSError as e:
                raise WireError(f"sending to {self.where} failed: {e}") from e
            view = view[n:]

    def _recv_exact(self, n: int, deadline: float, what: str) -> bytes:
        """Exactly ``n`` bytes, read into pieces of at most ``_READ_STEP`` bytes each allocated only when the one
        before is full: memory follows the bytes that arrived, not the ``n`` a peer announced."""
        pieces = []
        got = 0
        while got < n:
            piece = bytearray(min(n - got, _READ_STEP))
            view = memoryview(piece)
            filled = 0
            while filled < len(piece):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WireError(f"{self.where} did not send {what} in time ({got + filled} of {n} bytes)")
                self.sock.settimeout(left)
                try:
                    k = self.sock.recv_into(view[filled:])
                except socket.timeout:
                    continue
                except OSError as e:
                    raise WireError(f"receiving {what} from {self.where} failed: {e}") from e
                if k == 0:
                    raise WireError(f"{self.where} closed the connection in the middle of {what} ({got + filled} "
                                    f"of {n} bytes)")
                filled += k
            view.release()
            pieces.append(piece)
            got += filled
        return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)


# ---------------------------------------------------------------------- authentication
def connect_peer(addr: str, port: int, secret: str, deadline: float, max_payload: int = MAX_PAYLOAD) -> Wire:
    """A connection to the holder at ``addr:port`` that proved it holds the job's secret (and was told that we
    do). :class:`WireError` when it cannot be reached in time or does not prove it."""
    where = f"the holder at {addr}:{port}"
    try:
        sock = socket.create_connection((addr, port), timeout=max(0.01, deadline - time.monotonic()))
    except OSError as e:
        raise WireError(f"cannot reach {where}: {e} (is that host's holder running? is the port reachable?)") from e
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    wire = Wire(sock, where, HANDSHAKE_PAYLOAD)
    try:
        mine = secrets.token_hex(_NONCE)
        wire.send({"op": "hello", "nonce": mine}, deadline=deadline)
        header, _ = wire.expect("challenge", deadline)
        theirs = _nonce(header)
        if not theirs or not _mac_ok(header.get("mac"), mac(secret, "server", mine, theirs)):
            raise WireError(f"{where} does not hold this job's secret (its challenge's HMAC is wrong): not this "
                            "job's holder; check that every host runs the same job")
        wire.send({"op": "auth", "mac": mac(secret, "client", theirs, mine)}, deadline=deadline)
        wire.expect("welcome", deadline)
        wire.max_payload = max_payload
        return wire
    except BaseException:
        wire.close()
        raise


def accept_peer(sock: socket.socket, where: str, secret: str, deadline: float,
                max_payload: int = MAX_PAYLOAD) -> Wire:
    """Authenticate the client on ``sock`` (just accepted). :class:`WireError` when it does not prove that it
    holds the job's secret in time; the caller closes the connection then."""
    wire = Wire(sock, where, HANDSHAKE_PAYLOAD)
    header, _ = wire.expect("hello", deadline)
    theirs = _nonce(header)
    if not theirs:
        raise WireError(f"{where} sent a hello without a valid nonce")
    mine = secrets.token_hex(_NONCE)
    wire.send({"op": "challenge", "nonce": mine, "mac": mac(secret, "server", theirs, mine)}, deadline=deadline)
    header, _ = wire.expect("auth", deadline)
    if not _mac_ok(header.get("mac"), mac(secret, "client", mine, theirs)):
        try:
            wire.send({"op": "error", "error": "authentication failed"}, deadline=deadline)
        except WireError:
            pass
        raise WireError(f"{where} failed authentication (its HMAC is wrong): not a holder of this job")
    wire.send({"op": "welcome"}, deadline=deadline)
    wire.max_payload = max_payload
    return wire
