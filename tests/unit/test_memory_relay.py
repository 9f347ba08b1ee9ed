"""The holders' relay (memory/relay.py; docs/protocol.md, "Several hosts: the commit rule", "the wire"): bodies
larger than a frame cross as blobs, a replica never replaces a file, an outcome reaches every host even when
one does not answer, and the relay forgets saves that are done with. Real sockets, real files."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Dict, List

import pytest

from nostall.memory.peers import HostTable, PeerServer
from nostall.memory.relay import Relay, move_beneath, recv_blob, send_blob
from nostall.memory.wire import Wire, WireError

_SECRET = "5e" * 32


def _pair(max_payload: int):
    a, b = socket.socketpair()
    return Wire(a, "end a", max_payload), Wire(b, "end b", max_payload)


def test_a_blob_larger_than_a_frame_crosses_in_more_frames_bytes_equal():
    a, b = _pair(1000)
    blob = os.urandom(10_500)
    try:
        t = threading.Thread(target=send_blob, args=(a, {"op": "outcome", "x": 1}, blob, time.monotonic() + 10))
        t.start()
        header, payload = b.recv(time.monotonic() + 10)
        got = recv_blob(b, header, payload, 1 << 20, time.monotonic() + 10)
        t.join(10)
        assert (header["op"], header["x"], header["size"], got) == ("outcome", 1, len(blob), blob)
    finally:
        a.close()
        b.close()


def test_an_empty_blob_is_one_frame():
    a, b = _pair(1000)
    try:
        send_blob(a, {"op": "outcome"}, b"", time.monotonic() + 10)
        header, payload = b.recv(time.monotonic() + 10)
        assert recv_blob(b, header, payload, 10, time.monotonic() + 10) == b""
    finally:
        a.close()
        b.close()


def test_a_blob_announced_over_the_limit_is_refused_before_reading():
    a, b = _pair(1000)
    try:
        send_blob(a, {"op": "records"}, b"x" * 100, time.monotonic() + 10)
        header, payload = b.recv(time.monotonic() + 10)
        with pytest.raises(WireError, match="at most 99"):
            recv_blob(b, header, payload, 99, time.monotonic() + 10)
        with pytest.raises(WireError, match="'records' of -1 bytes"):
            recv_blob(b, {"op": "records", "size": -1}, b"", 99, time.monotonic() + 10)
    finally:
        a.close()
        b.close()


def test_a_move_never_replaces_a_file_nor_follows_a_link(tmp_path):
    src, dst, elsewhere = tmp_path / "src", tmp_path / "dst", tmp_path / "elsewhere"
    for d in (src / "sub", dst, elsewhere):
        d.mkdir(parents=True)
    (src / "sub" / "f").write_bytes(b"replica")
    move_beneath(str(src), str(dst), "sub/f")
    assert (dst / "sub" / "f").read_bytes() == b"replica" and not (src / "sub" / "f").exists()
    # a file of this host's own ranks in the staging: refused, left as it was, the replica's file stays put
    (src / "rank0.safetensors").write_bytes(b"peer's")
    (dst / "rank0.safetensors").write_bytes(b"own")
    with pytest.raises(FileExistsError):
        move_beneath(str(src), str(dst), "rank0.safetensors")
    assert (dst / "rank0.safetensors").read_bytes() == b"own" and (src / "rank0.safetensors").exists()
    # a folder of the staging that is a link: nothing is placed through it
    os.symlink(str(elsewhere), str(dst / "linked"))
    (src / "linked").mkdir()
    (src / "linked" / "g").write_bytes(b"g")
    with pytest.raises(OSError):
        move_beneath(str(src), str(dst), "linked/g")
    assert os.listdir(str(elsewhere)) == [] and (src / "linked" / "g").exists()


class _Host:
    """A holder's listener that answers ``outcome`` (recording what came); ``wait_for`` makes it hold its answer
    until that event is set (bounded)."""

    def __init__(self, wait_for: "threading.Event | None" = None) -> None:
        self.got: List[Dict[str, Any]] = []
        self.arrived = threading.Event()
        self.wait_for = wait_for
        self.others_done_first: List[bool] = []
        self.server = PeerServer("127.0.0.1", _SECRET, {"outcome": self._on_outcome}, 60.0)

    def _on_outcome(self, wire: Wire, header: Dict[str, Any], payload: bytes) -> None:
        body = recv_blob(wire, header, payload, 1 << 30, time.monotonic() + 30)
        if self.wait_for is not None:
            self.others_done_first.append(self.wait_for.wait(30))
        self.got.append(dict(header, manifest=body))
        self.arrived.set()
        wire.send({"op": "ok"}, deadline=time.monotonic() + 10)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_an_outcome_reaches_every_host_though_one_is_gone_and_one_does_not_answer(tmp_path):
    fast = _Host()
    slow = _Host(wait_for=fast.arrived)  # answers only once the host after it got the outcome
    relay = Relay(str(tmp_path / "mem"), _SECRET, "127.0.0.1", 60.0)
    try:
        relay.table = HostTable((0, 1, 2, 3), (("127.0.0.1", relay.port), ("127.0.0.1", _closed_port()),
                                               ("127.0.0.1", slow.server.port), ("127.0.0.1", fast.server.port)))
        relay.host = 0
        relay.root = object()  # type: ignore[assignment]  # (a failed outcome reads nothing of the root)
        relay._announce("a" * 32, False)
        # host 1 refused the connection: hosts 2 and 3 still got it; host 2's silence did not hold host 3 back
        assert [g["ok"] for g in fast.got] == [False] and [g["ok"] for g in slow.got] == [False]
        assert slow.others_done_first == [True]
        assert fast.got[0]["save_id"] == "a" * 32 and fast.got[0]["manifest"] == b""
    finally:
        relay.close()
        fast.server.close()
        slow.server.close()


def test_the_relay_forgets_saves_whose_records_directory_is_gone(tmp_path):
    relay = Relay(str(tmp_path / "mem"), _SECRET, "127.0.0.1", 10.0)
    try:
        os.makedirs(str(tmp_path / "mem" / ".tmp"))
        relay.table = HostTable((0,), (("127.0.0.1", relay.port),))
        relay.root = object()  # type: ignore[assignment]  # (no save is listed: the root is not asked)
        done, early = "b" * 32, "c" * 32
        relay._seen.add(done)
        relay._announced.add(done)
        relay._forwarded[done] = 3
        relay._received[done] = {"rank1.safetensors"}
        relay._received[early] = {"rank1.safetensors"}  # a replica that came before this host's writers began
        relay._look()
        assert (relay._seen, relay._announced, relay._forwarded) == (set(), set(), {})
        assert relay._received == {early: {"rank1.safetensors"}}
    finally:
        relay.close()
