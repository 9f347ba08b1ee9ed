"""The holders' wire (memory/wire.py) and replicas on it (memory/peers.py): frames, authentication, transfers.

Real TCP sockets on the loopback, no torch. Every refusal is checked by what
it leaves: the error's text, the connection closed, no file written.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from typing import Dict, List, Tuple

import pytest

from nostall.core.format import crc
from nostall.memory.peers import HostTable, PeerServer, Replica, check_jump, number_hosts, receive_replica, \
    reachable_address, send_replica
from nostall.memory.rendezvous import MemoryTierError
from nostall.memory.wire import MAGIC, PREFIX, Throttle, Wire, WireError, accept_peer, connect_peer, new_secret
from nostall.options import MemoryTier

SECRET = new_secret()


def _pair() -> Tuple[Wire, Wire]:
    a, b = socket.socketpair()
    return Wire(a, "end a"), Wire(b, "end b")


def _soon(s: float = 5.0) -> float:
    return time.monotonic() + s


def test_frames_round_trip_with_payloads():
    a, b = _pair()
    try:
        big = os.urandom(3 << 20)
        got: List[object] = []
        reader = threading.Thread(target=lambda: got.extend([b.recv(_soon()), b.recv(_soon())]), daemon=True)
        reader.start()
        a.send({"op": "x", "n": 1}, big, deadline=_soon())
        a.send({"op": "y"}, deadline=_soon())
        reader.join(5)
        assert got == [({"op": "x", "n": 1}, big), ({"op": "y"}, b"")]
    finally:
        a.close()
        b.close()


def _raw_frame(header: bytes, payload: bytes, hcrc: int = -1, pcrc: int = -1, magic: bytes = MAGIC) -> bytes:
    return PREFIX.pack(magic, len(header), len(payload), crc(header) if hcrc < 0 else hcrc,
                       crc(payload) if pcrc < 0 else pcrc) + header + payload


@pytest.mark.parametrize("frame, says", [
    (_raw_frame(b'{"op": "data"}', b"abcd", pcrc=crc(b"abce")), "payload of a frame from end b (\'data\', 4 bytes) "
                                                                 "fails its CRC32C"),
    (_raw_frame(b'{"op": "data"}', b"abcd", hcrc=crc(b"other")), "header of a frame from end b fails its CRC32C"),
    (_raw_frame(b'{"op": "data"}', b"", magic=b"HTTP"), "not a nostall peer frame"),
    (_raw_frame(b'[1, 2]', b""), "not a JSON object"),
    (_raw_frame(b'{"op": "data"}', b"abcd")[:-2], "closed the connection in the middle of the frame's payload "
                                                  "(2 of 4 bytes)"),
    (PREFIX.pack(MAGIC, 10, 1 << 40, 0, 0), "announced a frame too large"),
])
def test_bad_frames_are_refused(frame, says):
    a, b = _pair()
    try:
        a.sock.sendall(frame)
        a.sock.shutdown(socket.SHUT_WR)
        with pytest.raises(WireError) as e:
            b.recv(_soon())
        assert says in str(e.value)
    finally:
        a.close()
        b.close()


def test_a_frame_that_never_ends_is_refused_at_the_deadline():
    a, b = _pair()
    try:
        a.sock.sendall(_raw_frame(b'{"op": "data"}', b"abcdef")[:-3])
        with pytest.raises(WireError, match=r"did not send the frame's payload in time \(3 of 6 bytes\)"):
            b.recv(_soon(0.3))
    finally:
        a.close()
        b.close()


def _server(secret: str, handle) -> Tuple[socket.socket, threading.Thread, List[object]]:
    """A one-connection listener on the loopback that authenticates with ``secret`` then runs ``handle``."""
    lst = socket.create_server(("127.0.0.1", 0))
    got: List[object] = []

    def run() -> None:
        conn, _ = lst.accept()
        try:
            wire = accept_peer(conn, "the client", secret, _soon())
            got.append(handle(wire))
        except Exception as e:
            got.append(e)
        finally:
            conn.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lst, t, got


def test_authentication_both_ways():
    lst, t, got = _server(SECRET, lambda w: w.recv(_soon()))
    try:
        wire = connect_peer("127.0.0.1", lst.getsockname()[1], SECRET, _soon())
        wire.send({"op": "hi"}, b"x", deadline=_soon())
        t.join(5)
        assert got == [({"op": "hi"}, b"x")]
        wire.close()
    finally:
        lst.close()


def test_a_client_without_the_secret_is_refused_and_writes_nothing():
    lst, t, got = _server(SECRET, lambda w: w.recv(_soon()))
    try:
        # the client sees the server's mac fail first (it does not hold the secret either): refused at once
        with pytest.raises(WireError, match="does not hold this job's secret"):
            connect_peer("127.0.0.1", lst.getsockname()[1], new_secret(), _soon())
        t.join(5)
        assert len(got) == 1 and isinstance(got[0], WireError)
    finally:
        lst.close()


def test_a_client_with_a_bad_hmac_is_refused_by_the_server():
    lst, t, got = _server(SECRET, lambda w: w.recv(_soon()))
    try:
        sock = socket.create_connection(("127.0.0.1", lst.getsockname()[1]))
        w = Wire(sock, "the server")
        w.send({"op": "hello", "nonce": "00" * 16}, deadline=_soon())
        h, _ = w.expect("challenge", _soon())
        w.send({"op": "auth", "mac": "ab" * 32}, deadline=_soon())
        with pytest.raises(WireError, match="refused: authentication failed"):
            w.expect("welcome", _soon())
        t.join(5)
        assert len(got) == 1 and "failed authentication" in str(got[0])
        w.close()
    finally:
        lst.close()


def test_a_server_without_the_secret_is_refused_by_the_client():
    lst, t, got = _server(new_secret(), lambda w: None)
    try:
        with pytest.raises(WireError, match="does not hold this job's secret"):
            connect_peer("127.0.0.1", lst.getsockname()[1], SECRET, _soon())
    finally:
        lst.close()
        t.join(5)


def test_throttle_paces_to_the_rate_and_refuses_past_the_deadline():
    th = Throttle(1000.0)
    t0 = time.monotonic()
    th.wait(100, _soon())
    th.wait(100, _soon())
    assert time.monotonic() - t0 >= 0.19  # 200 bytes at 1000 bytes/s: the pace itself, not a timing threshold
    with pytest.raises(WireError, match="peer_bytes_per_s"):
        th.wait(10_000, _soon(0.5))
    Throttle(None).wait(1 << 40, time.monotonic())  # unlimited: never waits


# ---------------------------------------------------------------------- hosts and peers
def test_hosts_numbered_by_lowest_rank_and_peers_by_jump():
    assert number_hosts([("h2",), ("h2",), ("h1",), ("h3",), ("h1",)]) == [0, 0, 1, 2, 1]
    t = HostTable((0, 0, 1, 1, 2, 2, 3, 3), tuple(("10.0.0.%d" % i, 1) for i in range(4)), jump=2)
    assert [t.peer(h) for h in range(4)] == [2, 3, 0, 1] and [t.source(h) for h in range(4)] == [2, 3, 0, 1]
    assert t.ranks_of(1) == [2, 3]
    assert HostTable.from_doc(t.to_doc()) == t
    with pytest.raises(MemoryTierError, match=r"peer_jump=4 maps every host to itself on 4 hosts"):
        HostTable(t.host_of, t.addrs, jump=4)
    check_jump(3, 1)  # one host: no replica, any jump
    assert MemoryTier(persist_every=5).peer_jump == 1
    with pytest.raises(ValueError, match="peer_jump"):
        MemoryTier(persist_every=5, peer_jump=0)
    with pytest.raises(ValueError, match="peer_bytes_per_s"):
        MemoryTier(persist_every=5, peer_bytes_per_s=-1)


def test_reachable_address_is_a_local_source_address():
    assert reachable_address(None) == "127.0.0.1"
    assert reachable_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(MemoryTierError, match="MASTER_ADDR"):
        reachable_address("no-such-host.invalid")


# ---------------------------------------------------------------------- replicas
SAVE = "ab" * 16


def _peer(tmp_path, secret: str = SECRET):
    """A PeerServer on the loopback that receives replicas into tmp_path/into/<save_id>."""
    into = tmp_path / "into"
    into.mkdir()
    got: List[Replica] = []
    errors: List[Exception] = []

    def directory(save_id: str, step: int) -> str:
        d = into / save_id
        d.mkdir(exist_ok=True)
        return str(d)

    def on_replica(wire: Wire, header: Dict[str, object], payload: bytes) -> None:
        try:
            got.append(receive_replica(wire, header, directory, _soon()))
        except WireError as e:
            errors.append(e)
            raise

    return PeerServer("127.0.0.1", secret, {"replica": on_replica}, timeout=5.0), into, got, errors


def test_a_replica_arrives_whole_and_acknowledged(tmp_path):
    src = tmp_path / "src"
    (src / "side").mkdir(parents=True)
    data = {"rank0.safetensors": os.urandom(9 << 20 | 7), "rank1.safetensors": b"", "side/x.json": b"{}"}
    for n, b in data.items():
        (src / n).write_bytes(b)
    server, into, got, errors = _peer(tmp_path)
    try:
        wire = connect_peer("127.0.0.1", server.port, SECRET, _soon())
        files = send_replica(wire, save_id=SAVE, step=7, host=1, top=str(src), names=list(data), deadline=_soon(30),
                             throttle=Throttle(None))
        assert files == {n: len(b) for n, b in data.items()}
        _until(lambda: got)  # (the server records it just after its ack)
        assert got == [Replica(SAVE, 7, 1, files)] and not errors
        for n, b in data.items():
            assert (into / SAVE / n).read_bytes() == b
        wire.close()
    finally:
        server.close()


def test_a_corrupted_chunk_is_refused_and_nothing_is_left(tmp_path):
    server, into, got, errors = _peer(tmp_path)
    try:
        wire = connect_peer("127.0.0.1", server.port, SECRET, _soon())
        wire.send({"op": "replica", "save_id": SAVE, "step": 3, "host": 0, "files": [["rank0.safetensors", 8]]},
                  deadline=_soon())
        head = b'{"name": "rank0.safetensors", "offset": 0, "op": "data"}'
        wire.sock.sendall(_raw_frame(head, b"12345678", pcrc=crc(b"12345679")))
        with pytest.raises(WireError, match="refused: WireError: the payload of a frame .* fails its CRC32C"):
            wire.expect("ack", _soon())
        wire.close()
        deadline = _soon()
        while not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not got and errors
        assert os.listdir(into / SAVE) == []
    finally:
        server.close()


@pytest.mark.parametrize("name", ["../escape", "/abs", "a/../../b", ""])
def test_a_replica_naming_a_file_outside_its_directory_is_refused(tmp_path, name):
    server, into, got, errors = _peer(tmp_path)
    try:
        wire = connect_peer("127.0.0.1", server.port, SECRET, _soon())
        wire.send({"op": "replica", "save_id": SAVE, "step": 3, "host": 0, "files": [[name, 1]]}, deadline=_soon())
        with pytest.raises(WireError, match="not plain and relative"):
            wire.expect("ack", _soon())
        wire.close()
        assert not got and sorted(os.listdir(tmp_path)) == ["into"] and os.listdir(into) == []
    finally:
        server.close()


def test_a_peer_without_the_secret_cannot_write_a_replica(tmp_path):
    server, into, got, errors = _peer(tmp_path)
    try:
        with pytest.raises(WireError):
            connect_peer("127.0.0.1", server.port, new_secret(), _soon())
        sock = socket.create_connection(("127.0.0.1", server.port))  # straight to a replica, no authentication
        w = Wire(sock, "server")
        w.send({"op": "replica", "save_id": SAVE, "step": 3, "host": 0, "files": [["f", 1]]}, deadline=_soon())
        with pytest.raises(WireError):
            w.expect("ack", _soon())
        w.close()
        assert not got and os.listdir(into) == []
    finally:
        server.close()


def test_peer_server_close_ends_its_threads(tmp_path):
    server, _, _, _ = _peer(tmp_path)
    wire = connect_peer("127.0.0.1", server.port, SECRET, _soon())
    server.close()
    assert not server._thread.is_alive()
    with pytest.raises(WireError):
        wire.recv(_soon(2))
    wire.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def test_struct_prefix_is_what_the_docs_say():
    assert PREFIX.size == 24 and struct.calcsize(">4sIQII") == 24


# ---------------------------------------------------------------------- two holders' relays, in one process
def _until(check, bound: float = 20.0):
    deadline = time.monotonic() + bound
    while not check():
        assert time.monotonic() < deadline, "not reached within the bound"
        time.sleep(0.02)


def _two_relays(tmp_path):
    from nostall.memory.relay import Relay

    ra, rb = tmp_path / "a", tmp_path / "b"
    ra.mkdir()
    rb.mkdir()
    relays = [Relay(str(ra), SECRET, "127.0.0.1", 5.0), Relay(str(rb), SECRET, "127.0.0.1", 5.0)]
    table = HostTable((0, 1), (("127.0.0.1", relays[0].port), ("127.0.0.1", relays[1].port)), 1)
    for h, r in enumerate(relays):
        r.configure(table, h, 1, None, 5.0)
    return relays, str(ra), str(rb)


def _write_rank(root, dest, rank: int, data: bytes) -> None:
    """What rank ``rank``'s writer does in a memory save on several hosts: its file, then its held record."""
    from nostall.core.jobs import Done

    root.reserve_done(dest, rank)
    staging = root.open_staging(dest, rank)
    with open(os.path.join(staging, f"rank{rank}.safetensors"), "wb") as f:
        f.write(data)
    root.write_done(dest, rank, Done(True, rank=rank), time.monotonic() + 5)


def test_two_relays_replicate_then_forward_the_records_then_publish_on_the_peer(tmp_path):
    from nostall.core.jobs import Destination, Outcome
    from nostall.memory.roots import MemoryRoot

    relays, ra, rb = _two_relays(tmp_path)
    try:
        a, b = MemoryRoot(ra, {0}, {0, 1}), MemoryRoot(rb, {1}, {0, 1})
        da = Destination(a, "step_5", 5, SAVE, move_latest=True, keep_last=1)
        db = Destination(b, "step_5", 5, SAVE, move_latest=True, keep_last=1)
        a.make_staging(da)  # rank 0's trainer, before the plan
        a.make_records(da)
        d0, d1 = os.urandom(5 << 20), os.urandom(3 << 20 | 5)
        _write_rank(a, da, 0, d0)
        rec = os.path.join(ra, ".tmp", f"commit-{SAVE}")
        # host 0's record reaches the commit once its replica is on host 1 (host 1's own rank has not written)
        _until(lambda: os.path.exists(os.path.join(rec, "rank0.json")))
        assert open(os.path.join(b.staging(db), "rank0.safetensors"), "rb").read() == d0
        assert not os.path.exists(os.path.join(rec, "rank1.json"))
        _write_rank(b, db, 1, d1)
        _until(lambda: all(os.path.exists(os.path.join(rec, f"rank{r}.json")) for r in (0, 1)))
        # each host's staging holds both files before any record reached the commit
        for top in (a.staging(da), b.staging(db)):
            assert open(os.path.join(top, "rank0.safetensors"), "rb").read() == d0
            assert open(os.path.join(top, "rank1.safetensors"), "rb").read() == d1
        assert all(json.load(open(os.path.join(rec, f"rank{r}.json")))["ok"] for r in (0, 1))
        # rank 0's writer commits on host 0 (the ordinary routine's Root calls) and announces the outcome
        a.check_files(da, {"rank0.safetensors": len(d0), "rank1.safetensors": len(d1)})
        manifest = b'{"format": "nostall", "step": 5}'
        a.prepare_latest(da)
        a.publish(da, manifest)
        a.move_latest(da)
        a.write_outcome(da, Outcome(True), time.monotonic() + 5)
        # host 1 publishes the same step from the outcome and announces it to its writers
        _until(lambda: b.outcome_of(SAVE) is True)
        assert b.read_latest() == 5
        assert open(os.path.join(rb, "step_5", "manifest.json"), "rb").read() == manifest
        assert sorted(os.listdir(os.path.join(rb, "step_5"))) == ["manifest.json", "rank0.safetensors",
                                                                   "rank1.safetensors"]
        assert open(os.path.join(rb, "step_5", "rank0.safetensors"), "rb").read() == d0
        assert not os.path.exists(os.path.join(rb, ".tmp", f"replica-{SAVE}"))
    finally:
        for r in relays:
            r.close()


def test_a_peer_gone_fails_the_save_on_host_0_without_a_commit(tmp_path):
    from nostall.core.jobs import Destination
    from nostall.memory.roots import MemoryRoot

    relays, ra, rb = _two_relays(tmp_path)
    try:
        relays[1].close()  # host 1's holder is gone
        a = MemoryRoot(ra, {0}, {0, 1})
        da = Destination(a, "step_5", 5, SAVE, move_latest=True, keep_last=1)
        a.make_staging(da)
        a.make_records(da)
        _write_rank(a, da, 0, b"x" * 100)
        rec = os.path.join(ra, ".tmp", f"commit-{SAVE}", "rank0.json")
        _until(lambda: os.path.exists(rec))
        got = json.load(open(rec))
        assert got["ok"] is False and "replica of host 0 (ranks [0]) on host 1 failed" in got["error"], got
        assert a.steps() == [] and a.read_latest() is None
    finally:
        for r in relays:
            r.close()


def test_memory_root_checks_only_the_files_its_host_holds(tmp_path):
    from nostall.core.jobs import Destination
    from nostall.errors import CheckpointSaveError
    from nostall.memory.roots import MemoryRoot

    root = MemoryRoot(str(tmp_path / "m"), {2, 3}, {2, 3, 0, 1})
    d = Destination(root, "step_1", 1, SAVE, move_latest=True)
    root.ensure_save(d)
    for r in (0, 1, 2, 3):
        (tmp_path / "m" / ".tmp" / f"save-{SAVE}" / f"rank{r}.safetensors").write_bytes(b"ab")
    root.check_files(d, {f"rank{r}.safetensors": 2 for r in range(8)})  # ranks 4-7: vouched for by their records
    with pytest.raises(CheckpointSaveError, match="rank3.safetensors is missing"):
        os.unlink(tmp_path / "m" / ".tmp" / f"save-{SAVE}" / "rank3.safetensors")
        root.check_files(d, {f"rank{r}.safetensors": 2 for r in range(8)})


def test_a_holder_takes_the_host_table_of_a_large_job(tmp_path):
    """listen, then peers with the table of 32,768 ranks on 4,096 hosts (a message far over 64 KiB) over the
    holder's unix socket: answered, and the holder's relay listens on TCP with the job's secret."""
    import secrets as _secrets

    from nostall.memory.holder import Holder
    from nostall.memory.rendezvous import base_dir, connect

    base = base_dir(str(tmp_path))
    key = _secrets.token_hex(10)
    holder = Holder(base, key, 60.0)
    assert holder.start() == -1
    serving = threading.Thread(target=holder.serve, daemon=True)
    serving.start()
    try:
        link = connect(base, key, 5.0)
        assert link is not None
        got = link.ask({"op": "listen", "secret": SECRET, "addr": "127.0.0.1", "timeout": 5.0}, 5.0)
        assert got["ok"] and isinstance(got["port"], int)
        hosts = 4096
        table = HostTable(tuple(r // 8 for r in range(8 * hosts)),
                          tuple(("10.%d.%d.%d" % (h >> 16, (h >> 8) & 255, h & 255), 40000 + h) for h in range(hosts)),
                          1)
        got = link.ask({"op": "peers", "table": table.to_doc(), "host": 0, "keep": 1, "rate": None,
                        "timeout": 5.0}, 10.0)
        assert got == {"ok": True}, got
        wire = connect_peer("127.0.0.1", holder.relay.port, SECRET, _soon())  # the relay answers peers
        wire.close()
        link.close()
    finally:
        holder.stop = "test over"
        serving.join(5)
        holder.cleanup()
    assert not os.path.exists(os.path.join(base, key)) and holder.relay is None


# ---------------------------------------------------------------------- review fixes: pre-auth bounds, odd names
def test_a_hello_announcing_any_payload_is_refused_before_authentication():
    """Handshake frames carry no payload: one announcing even a byte is refused from its prefix alone."""
    a, b = socket.socketpair()
    head = json.dumps({"op": "hello", "nonce": "0" * 32}).encode()
    a.sendall(PREFIX.pack(MAGIC, len(head), 64 << 20, crc(head), 0) + head)  # the payload is never sent
    with pytest.raises(WireError, match=r"announced a frame too large \(header \d+, payload 67108864 bytes; at "
                                        r"most 65536, 0\)"):
        accept_peer(b, "the client", SECRET, _soon())
    a.close()
    b.close()


def test_a_payload_announced_but_not_sent_takes_only_what_arrived():
    """The receiver's buffer grows with the bytes that arrive, not with the length a frame announces."""
    import tracemalloc
    tx, rx = _pair()
    head = b'{"op": "data"}'
    tx.sock.sendall(PREFIX.pack(MAGIC, len(head), 64 << 20, crc(head), 0) + head + b"x" * 1000)
    tx.close()
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match=r"closed the connection in the middle of the frame's payload \(1000 of"):
            rx.recv(_soon())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rx.close()
    assert peak < 4 << 20  # the 64 MiB announced were never allocated


def test_after_welcome_both_ends_take_full_frames():
    box: List[Wire] = []
    ls, t, _ = _server(SECRET, lambda w: box.append(w) or w.send({"op": "big"}, b"y" * (5 << 20),
                                                                 deadline=_soon()))
    wire = connect_peer("127.0.0.1", ls.getsockname()[1], SECRET, _soon())
    assert wire.recv(_soon()) == ({"op": "big"}, b"y" * (5 << 20))
    wire.close()
    t.join(5)
    ls.close()


@pytest.mark.parametrize("bad", ["\u00e9" * 64, 7, None])
def test_a_malformed_mac_is_a_wire_error_on_both_ends(bad):
    lst = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = lst.accept()
        srv = Wire(conn, "server")
        srv.recv(_soon())
        srv.send({"op": "challenge", "nonce": "0" * 32, "mac": bad}, deadline=_soon())
        time.sleep(0.2)
        srv.close()

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(WireError, match="does not hold this job's secret"):
        connect_peer("127.0.0.1", lst.getsockname()[1], SECRET, _soon())
    t.join(5)
    lst.close()

    a, b = socket.socketpair()
    cli = Wire(a, "client")

    def client() -> None:
        cli.send({"op": "hello", "nonce": "1" * 32}, deadline=_soon())
        cli.recv(_soon())
        cli.send({"op": "auth", "mac": bad}, deadline=_soon())

    t = threading.Thread(target=client)
    t.start()
    with pytest.raises(WireError, match="failed authentication"):
        accept_peer(b, "the client", SECRET, _soon())
    t.join(5)
    cli.close()
    b.close()


@pytest.mark.parametrize("name", ["b\x00", "sub/b\x00"])
def test_a_replica_naming_a_file_with_a_nul_byte_is_refused_and_nothing_is_left(tmp_path, name):
    server, into, got, errors = _peer(tmp_path)
    try:
        wire = connect_peer("127.0.0.1", server.port, SECRET, _soon())
        wire.send({"op": "replica", "save_id": SAVE, "step": 3, "host": 0, "files": [["a", 3], [name, 1]]},
                  deadline=_soon())
        with pytest.raises(WireError, match="not plain and relative"):
            wire.expect("ack", _soon())
        wire.close()
        assert not got and os.listdir(into) == []
    finally:
        server.close()


def test_a_replica_whose_file_cannot_be_made_leaves_no_folder_it_made(tmp_path):
    """The folders made for a file whose own create fails (its name too long) go with it."""
    server, into, got, errors = _peer(tmp_path)
    try:
        wire = connect_peer("127.0.0.1", server.port, SECRET, _soon())
        wire.send({"op": "replica", "save_id": SAVE, "step": 3, "host": 0,
                   "files": [["d/a", 3], ["d/e/f/" + "x" * 300, 2]]}, deadline=_soon())
        wire.send({"op": "data", "name": "d/a", "offset": 0}, b"xyz", deadline=_soon())
        with pytest.raises(WireError, match="File name too long"):
            wire.expect("ack", _soon())
        wire.close()
        _until(lambda: errors)
        assert not got and os.listdir(into / SAVE) == []
    finally:
        server.close()


def test_a_replica_leaves_alone_folders_it_did_not_make(tmp_path):
    server, into, got, errors = _peer(tmp_path)
    (into / SAVE / "d").mkdir(parents=True)
    (into / SAVE / "d" / "theirs").write_bytes(b"t")
    try:
        wire = connect_peer("127.0.0.1", server.port, SECRET, _soon())
        wire.send({"op": "replica", "save_id": SAVE, "step": 3, "host": 0, "files": [["d/a", 3]]}, deadline=_soon())
        wire.send({"op": "data", "name": "d/a", "offset": 1}, b"z", deadline=_soon())
        with pytest.raises(WireError, match="was expected"):
            wire.expect("ack", _soon())
        wire.close()
        _until(lambda: errors)
        assert os.listdir(into / SAVE / "d") == ["theirs"]
    finally:
        server.close()


def test_peer_server_close_waits_for_a_handler_that_is_writing(tmp_path):
    """close() returns only once the connection threads ended (bounded): no handler writes after it."""
    entered = threading.Event()
    finished: List[bool] = []

    def slow(wire: Wire, header: Dict[str, object], payload: bytes) -> None:
        entered.set()
        time.sleep(0.5)
        finished.append(True)

    server = PeerServer("127.0.0.1", SECRET, {"slow": slow}, timeout=5.0)
    wire = connect_peer("127.0.0.1", server.port, SECRET, _soon())
    wire.send({"op": "slow"}, deadline=_soon())
    assert entered.wait(5)
    server.close(timeout=5.0)
    assert finished == [True] and not server._threads
    wire.close()
