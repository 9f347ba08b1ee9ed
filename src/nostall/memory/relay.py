"""A holder's part in a memory save across hosts: replicate, forward the records, publish (torch-free).

docs/protocol.md, "Memory tier", "Several hosts: the commit rule" (steps 3
and 5). One :class:`Relay` per holder of a job on several hosts, made when
its trainers hand it the job's secret and its address (``listen``) and
configured with the host table (``peers``). Two threads of the holder: its
:class:`~nostall.memory.peers.PeerServer` (requests from the other holders:
``replica``, ``records`` on host 0, ``outcome`` on the others) and a watcher
that looks at the memory root's records directories every 50 ms:

- once every rank of this host has a held record of a save, all ok, it
  streams the host's own files of that save to the peer host's holder (the
  staging's files less the replica received), then forwards the records to
  host 0 (host 0 releases its own); a failed record, or a replica that
  fails, is forwarded as a failure at once;
- on host 0, once rank 0's writer announced a save's outcome, it sends the
  outcome (with the committed manifest) to every other holder, which
  publishes ``step_N`` in its own memory root (or drops the save) and
  announces the outcome there for its writers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from nostall.core.jobs import Destination
from nostall.memory.peers import HostTable, PeerServer, Replica, receive_replica, send_replica
from nostall.memory.rendezvous import MemoryTierError
from nostall.memory.roots import MemoryRoot
from nostall.memory.wire import MAX_PAYLOAD, Throttle, Wire, WireError, connect_peer
from nostall.saving.commit import steps_to_delete
from nostall.core.format import MANIFEST_NAME
from nostall.storage.files import open_dir_beneath, plain_parts
from nostall.storage.root import RECORD_MAX_BYTES, TMP_DIR, step_name

log = logging.getLogger("nostall")

__all__ = ["Relay"]

_COMMIT_RE = re.compile(r"^commit-([0-9a-f]{32})$")
_LOOK_S = 0.05
_MAX_MANIFEST = 1 << 30
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def send_blob(wire: Wire, header: Dict[str, Any], blob: bytes, deadline: float) -> None:
    """Send ``header`` (with ``"size": len(blob)``) and ``blob`` in frames of at most the wire's payload limit:
    the first piece with the header, the rest in ``{"op": "more"}`` frames (docs/protocol.md, "The relay's
    requests"). A record or a manifest is bounded by nostall's own limits, not by one frame's."""
    step = min(wire.max_payload, MAX_PAYLOAD)
    view = memoryview(blob)
    wire.send(dict(header, size=len(blob)), view[:step], deadline=deadline)
    for i in range(step, len(blob), step):
        wire.send({"op": "more"}, view[i:i + step], deadline=deadline)


def recv_blob(wire: Wire, header: Dict[str, Any], payload: bytes, limit: int, deadline: float) -> bytes:
    """The blob that :func:`send_blob` sent, ``header`` and ``payload`` its first frame: its announced size
    checked against ``limit`` and the bytes that came (a buffer that grows as they come, never allocated ahead
    of them); :class:`WireError` otherwise."""
    size = header.get("size")
    if not isinstance(size, int) or not 0 <= size <= limit:
        raise WireError(f"{wire.where} announced a {header.get('op')!r} of {size!r} bytes (at most {limit})")
    buf = bytearray(payload)
    while len(buf) < size:
        _, more = wire.expect("more", deadline)
        if not more:
            raise WireError(f"{wire.where} sent an empty piece of a {header.get('op')!r}")
        buf += more
    if len(buf) != size:
        raise WireError(f"{wire.where} sent {len(buf)} bytes of a {header.get('op')!r} announced as {size}")
    return bytes(buf)


def move_beneath(src_top: str, dst_top: str, rel: str) -> None:
    """Move the file ``src_top/rel`` to ``dst_top/rel`` (folders made as needed), no link followed on either
    side, never replacing anything: a ``dst_top/rel`` that exists raises :class:`FileExistsError` (a hard link
    then an unlink: one filesystem, the memory root's)."""
    parts = plain_parts(rel)
    src = open_dir_beneath(src_top, parts[:-1])
    try:
        dst = open_dir_beneath(dst_top)
        try:
            for part in parts[:-1]:
                try:
                    os.mkdir(part, 0o700, dir_fd=dst)
                except FileExistsError:
                    pass
                nxt = os.open(part, _DIR_FLAGS, dir_fd=dst)
                os.close(dst)
                dst = nxt
            os.link(parts[-1], parts[-1], src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
            os.unlink(parts[-1], dir_fd=src)
        finally:
            os.close(dst)
    finally:
        os.close(src)


class Relay:
    """A holder's relay (see the module doc). ``close()`` stops both threads (bounded)."""

    def __init__(self, root_path: str, secret: str, addr: str, timeout: float) -> None:
        self.root_path = root_path
        self.secret = secret
        self.addr = addr
        self.timeout = timeout
        self.root: Optional[MemoryRoot] = None
        self.table: Optional[HostTable] = None
        self.host = -1
        self.keep = 1
        self.rate: Optional[float] = None
        self._lock = threading.Lock()
        self._received: Dict[str, Set[str]] = {}  # save id -> names of the replica moved into its staging
        self._forwarded: Dict[str, Optional[int]] = {}  # save id -> step: this host's records went to host 0
        self._announced: Set[str] = set()  # host 0: outcomes sent to the other holders
        self._seen: Set[str] = set()  # saves seen in flight (their outcome unknown) by this relay
        self._last_published: Optional[str] = None  # the records directory of the last save published here
        self._stop = threading.Event()
        self.server = self._serve()
        self._watcher: Optional[threading.Thread] = None

    def _serve(self) -> PeerServer:
        return PeerServer(self.addr, self.secret, {"replica": self._on_replica, "records": self._on_records,
                                                   "outcome": self._on_outcome}, self.timeout)

    def listen(self, secret: str, addr: str, timeout: float) -> int:
        """A restarted job's secret or address: a new listener (what the relay knows of earlier saves stays)."""
        self.timeout = timeout
        if secret != self.secret or addr != self.addr:
            self.server.close()
            self.secret, self.addr = secret, addr
            self.server = self._serve()
        return self.server.port

    @property
    def port(self) -> int:
        return self.server.port

    def configure(self, table: HostTable, host: int, keep: int, rate: Optional[float], timeout: float) -> None:
        """The job's hosts (this holder's is ``host``); starts the watcher on first call."""
        own = table.ranks_of(host)
        with self._lock:
            self.table, self.host, self.keep, self.rate, self.timeout = table, host, keep, rate, timeout
            self.root = MemoryRoot(self.root_path, set(own), set(own) | set(table.ranks_of(table.source(host))))
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="nostall-relay", daemon=True)
            self._watcher.start()

    def drain(self, timeout: float = 2.0) -> None:
        """The holder is stopping: stop the watcher, then look once more, so that what its trainers finished
        before releasing it is relayed (on host 0: the outcome of the last save, which the other hosts' writers
        wait for; rank 0's trainer releases the holder right after its writer announced it). Bounded by the
        relay's timeout per request; never raises."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout)
        try:
            self._look()
        except Exception:
            log.exception("memory tier: the relay's last look at %s failed", self.root_path)

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self.server.close(timeout)
        if self._watcher is not None:
            self._watcher.join(timeout)

    # ------------------------------------------------------------------ the watcher
    def _watch(self) -> None:
        while not self._stop.wait(_LOOK_S):
            try:
                self._look()
            except Exception:  # never the holder's end: logged, looked at again
                log.exception("memory tier: the relay's look at %s failed", self.root_path)

    def _saves(self) -> List[str]:
        try:
            names = os.listdir(os.path.join(self.root_path, TMP_DIR))
        except OSError:
            return []
        return [m.group(1) for m in map(_COMMIT_RE.match, names) if m is not None]

    def _look(self) -> None:
        root, table = self.root, self.table
        if root is None or table is None:
            return
        saves = self._saves()
        self._forget(set(saves))
        for save_id in saves:
            known = root.outcome_of(save_id)
            if known is None:  # (a save whose outcome is known, an earlier job's say, is done with)
                self._seen.add(save_id)
                if save_id not in self._forwarded:
                    held = [root.held_record(save_id, r) for r in sorted(root.own)]
                    if all(h is not None for h in held):
                        self._replicate_and_forward(save_id, dict(zip(sorted(root.own), held)))  # type: ignore
            elif self.host == 0 and save_id in self._seen and save_id not in self._announced:
                try:
                    self._announce(save_id, known)
                finally:  # (every host was tried, each bounded: a host that missed it times out there)
                    self._announced.add(save_id)

    def _forget(self, listed: Set[str]) -> None:
        """What this relay knows of saves whose records directory is gone (dropped after their outcome), dropped:
        its sets stay as small as the memory root's ``.tmp``. A replica received for a save whose records
        directory is not there yet stays (it is made with the replica's staging)."""
        with self._lock:
            for known in (self._forwarded, self._received):
                for save_id in [s for s in known if s not in listed]:
                    if known is self._forwarded or save_id in self._seen:
                        del known[save_id]
            self._seen &= listed
            self._announced &= listed

    def _replicate_and_forward(self, save_id: str, held: Dict[int, Tuple[Optional[int], Dict[str, Any]]]) -> None:
        root, table = self.root, self.table
        assert root is not None and table is not None
        step = next((s for s, _ in held.values() if s is not None), None)
        self._forwarded[save_id] = step
        records = {r: doc for r, (_, doc) in held.items()}
        if all(doc.get("ok") for doc in records.values()) and table.hosts > 1:
            peer = table.peer(self.host)
            try:
                names = self._own_files(save_id)
                addr, port = table.addrs[peer]
                deadline = time.monotonic() + self.timeout
                wire = connect_peer(addr, port, self.secret, deadline)
                try:
                    sent = send_replica(wire, save_id=save_id, step=step if step is not None else -1,
                                        host=self.host, top=root.staging(self._dest(save_id, step)), names=names,
                                        deadline=deadline, throttle=Throttle(self.rate))
                finally:
                    wire.close()
                log.info("memory tier: save %s (step %s): host %d's %d files (%d bytes) replicated on host %d",
                         save_id, step, self.host, len(sent), sum(sent.values()), peer)
            except Exception as e:  # (a peer gone, refusing, late; a file of ours unreadable): the save fails
                why = (f"the replica of host {self.host} (ranks {sorted(root.own)}) on host {peer} failed: "
                       f"{type(e).__name__}: {e}")
                log.error("memory tier: save %s (step %s): %s", save_id, step, why)
                records = {r: {"ok": False, "error": f"rank {r}: {why}"} for r in records}
        try:
            self._forward(save_id, records)
        except (WireError, OSError) as e:
            log.error("memory tier: save %s (step %s): host %d's records could not reach host 0: %s (the save "
                      "fails there by its timeout)", save_id, step, self.host, e)

    def _own_files(self, save_id: str) -> List[str]:
        """The files of this host's ranks in the save's staging: all of it but the replica received there."""
        root = self.root
        assert root is not None
        top = root.staging(self._dest(save_id, None))
        out = []
        with self._lock:
            received = set(self._received.get(save_id, ()))
            for d, dirs, files in os.walk(top):
                dirs[:] = [n for n in dirs if stat.S_ISDIR(os.lstat(os.path.join(d, n)).st_mode)]
                for n in files:
                    rel = os.path.relpath(os.path.join(d, n), top).replace(os.sep, "/")
                    if rel not in received and stat.S_ISREG(os.lstat(os.path.join(d, n)).st_mode):
                        out.append(rel)
        return sorted(out)

    def _forward(self, save_id: str, records: Dict[int, Dict[str, Any]]) -> None:
        root, table = self.root, self.table
        assert root is not None and table is not None
        if self.host == 0:
            for r, doc in records.items():
                root.release_record(save_id, r, doc)
            return
        addr, port = table.addrs[0]
        deadline = time.monotonic() + self.timeout
        wire = connect_peer(addr, port, self.secret, deadline)
        try:
            body = json.dumps({str(r): d for r, d in records.items()}, sort_keys=True).encode()
            send_blob(wire, {"op": "records", "save_id": save_id}, body, deadline)
            wire.expect("ok", deadline)
        finally:
            wire.close()

    def _announce(self, save_id: str, ok: bool) -> None:
        """Host 0: the outcome of ``save_id`` (with its manifest) to every other holder, all at once (one thread
        per host, each bounded by the relay's timeout: a host that does not answer delays no other). Best effort:
        a host that does not get it times out waiting, its save failed there. Never raises."""
        root, table = self.root, self.table
        assert root is not None and table is not None
        step = self._forwarded.get(save_id)
        manifest = b""
        error = ""
        if ok and step is not None:
            try:
                manifest = root.manifest_bytes(step_name(step)) or b""
            except OSError as e:
                log.error("memory tier: save %s: the manifest of step %d on host 0 is unreadable: %s", save_id,
                          step, e)
            if not manifest:
                ok, error = False, f"step {step} is announced committed on host 0 but has no readable manifest there"
        elif not ok:
            error = self._error_of(save_id)
        header = {"op": "outcome", "save_id": save_id, "step": step, "ok": ok, "error": error}
        deadline = time.monotonic() + self.timeout
        threads = [threading.Thread(target=self._announce_to, args=(h, header, manifest, deadline),
                                    name="nostall-relay-outcome", daemon=True) for h in range(1, table.hosts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + 1.0)

    def _announce_to(self, host: int, header: Dict[str, Any], manifest: bytes, deadline: float) -> None:
        """One host's outcome (a thread of :meth:`_announce`): anything wrong is logged, never raised."""
        table = self.table
        assert table is not None
        try:
            addr, port = table.addrs[host]
            wire = connect_peer(addr, port, self.secret, deadline)
            try:
                send_blob(wire, header, manifest, deadline)
                wire.expect("ok", deadline)
            finally:
                wire.close()
        except Exception as e:  # (unreachable, refusing, a bad answer): that host's writers time out
            log.warning("memory tier: the outcome of save %s (step %s) could not reach host %d: %s: %s",
                        header["save_id"], header["step"], host, type(e).__name__, e)

    def _error_of(self, save_id: str) -> str:
        root = self.root
        assert root is not None
        try:
            with open(os.path.join(self.root_path, TMP_DIR, f"commit-{save_id}", "outcome.json"), "rb") as f:
                return str(json.loads(f.read(1 << 20)).get("error") or "failed")
        except (OSError, ValueError, AttributeError):
            return "failed on host 0"

    def _dest(self, save_id: str, step: Optional[int]) -> Destination:
        return Destination(self.root, step_name(step) if step is not None else "", step, save_id, move_latest=True,
                           keep_last=self.keep)

    # ------------------------------------------------------------------ requests from the other holders
    def _on_replica(self, wire: Wire, header: Dict[str, Any], payload: bytes) -> None:
        root = self.root
        if root is None:
            wire.send({"op": "error", "error": "this holder has no host table yet"},
                      deadline=time.monotonic() + 1.0)
            return
        step = header.get("step")

        def directory(save_id: str, step: int) -> str:
            root.ensure_save(self._dest(save_id, step if step >= 0 else None))
            return root.replica_dir(save_id)

        def move(replica: Replica) -> None:
            src = root.replica_dir(replica.save_id)
            top = root.staging(self._dest(replica.save_id, None))
            with self._lock:
                self._received.setdefault(replica.save_id, set()).update(replica.files)
                for n in replica.files:
                    try:
                        move_beneath(src, top, n)
                    except FileExistsError:
                        raise MemoryTierError(
                            f"host {self.host} refuses host {replica.host}'s replica of save {replica.save_id}: "
                            f"{n!r} exists in its staging {top} (two hosts wrote the same file; check the host "
                            "table)") from None
            root.drop_replica_dir(replica.save_id)

        got = receive_replica(wire, header, directory, time.monotonic() + self.timeout, before_ack=move)
        log.info("memory tier: save %s (step %s): host %d's replica received (%d files, %d bytes)", got.save_id,
                 step, got.host, len(got.files), sum(got.files.values()))

    def _on_records(self, wire: Wire, header: Dict[str, Any], payload: bytes) -> None:
        root = self.root
        save_id, table = header.get("save_id"), self.table
        deadline = time.monotonic() + self.timeout
        if root is None or table is None or self.host != 0 or not isinstance(save_id, str) or not _COMMIT_RE.match(
                f"commit-{save_id}"):
            wire.send({"op": "error", "error": "records refused (not host 0, or malformed)"}, deadline=deadline)
            return
        body = recv_blob(wire, header, payload, RECORD_MAX_BYTES * max(
            len(table.ranks_of(h)) for h in range(table.hosts)), deadline)
        try:
            records = json.loads(body)
            if not isinstance(records, dict):
                raise ValueError("the records are not an object")
            for r, doc in records.items():
                if not isinstance(doc, dict):
                    raise ValueError(f"rank {r}'s record is not an object")
                root.release_record(save_id, int(r), doc)
        except (OSError, ValueError) as e:
            wire.send({"op": "error", "error": f"records of save {save_id} not written: {e}"}, deadline=deadline)
            return
        wire.send({"op": "ok"}, deadline=deadline)

    def _on_outcome(self, wire: Wire, header: Dict[str, Any], payload: bytes) -> None:
        root = self.root
        save_id, step, ok = header.get("save_id"), header.get("step"), header.get("ok")
        deadline = time.monotonic() + self.timeout
        if root is None or not isinstance(save_id, str) or not isinstance(ok, bool) or not _COMMIT_RE.match(
                f"commit-{save_id}"):
            wire.send({"op": "error", "error": "outcome refused (malformed)"}, deadline=deadline)
            return
        payload = recv_blob(wire, header, payload, _MAX_MANIFEST, deadline)
        dest = self._dest(save_id, step if isinstance(step, int) else None)
        error = str(header.get("error") or "")
        if ok and isinstance(step, int):
            try:
                self._publish(dest, payload)
            except Exception as e:  # this host's copy is not published: its writers learn the save failed here
                ok, error = False, f"host {self.host} could not publish step {step}: {type(e).__name__}: {e}"
                log.error("memory tier: save %s: %s", save_id, error)
        if not ok:
            try:
                root.abort(dest)
            except OSError as e:
                log.warning("memory tier: could not remove the staging of save %s: %s", save_id, e)
        try:
            root.announce(save_id, ok, error)
        except OSError as e:
            log.warning("memory tier: could not announce the outcome of save %s here: %s", save_id, e)
        root.drop_replica_dir(save_id)
        previous, self._last_published = self._last_published, save_id
        if previous is not None and previous != save_id:
            root.drop_records(previous)  # this host's writers were done with it before this save's plan
        wire.send({"op": "ok"}, deadline=deadline)

    def _publish(self, dest: Destination, manifest: bytes) -> None:
        """``step_N`` in this host's memory root: the committed manifest into the staging (its own ranks' files
        and the replica received), published, ``latest`` moved, retention (``keep``) applied."""
        root = self.root
        assert root is not None and dest.step is not None
        if not manifest or len(manifest) > _MAX_MANIFEST:
            raise ValueError("the outcome came without a manifest")
        root.prepare_latest(dest)
        root.publish(dest, manifest)
        root.move_latest(dest)
        for s in steps_to_delete(root.steps(), self.keep, dest.step):
            root.delete_step(s)
        log.info("memory tier: step %d published on host %d (%s)", dest.step, self.host,
                 os.path.join(root.url, step_name(dest.step), MANIFEST_NAME))


def holder_op(relay: Optional[Relay], root_path: str, msg: Dict[str, Any]) -> Tuple[Optional[Relay], Dict[str, Any]]:
    """A trainer's ``listen`` or ``peers`` request to its holder (the holder checked the mark's token): the
    relay to keep and the answer.

    - ``{"op": "listen", "secret": s, "addr": a, "timeout": t}``: listen for the other holders on ``a`` (a TCP
      port the kernel picks) under the job's secret ``s``; a relay with another secret or address (a restarted
      job) is replaced. Answers the port.
    - ``{"op": "peers", "table": ..., "host": h, "keep": k, "rate": r, "timeout": t}``: the host table.
    """
    try:
        if msg.get("op") == "listen":
            secret, addr, timeout = msg.get("secret"), msg.get("addr"), msg.get("timeout")
            if not isinstance(secret, str) or not isinstance(addr, str) or not isinstance(timeout, (int, float)):
                raise ValueError("listen needs a secret, an address and a timeout")
            if relay is None:
                relay = Relay(root_path, secret, addr, float(timeout))
            return relay, {"ok": True, "port": relay.listen(secret, addr, float(timeout))}
        if relay is None:
            raise ValueError("peers before listen")
        table = HostTable.from_doc(msg["table"])  # type: ignore[arg-type]
        host, keep, rate, timeout = msg.get("host"), msg.get("keep"), msg.get("rate"), msg.get("timeout")
        if not isinstance(host, int) or not isinstance(keep, int) or not isinstance(timeout, (int, float)) \
                or not (rate is None or isinstance(rate, (int, float))):
            raise ValueError("peers needs host, keep, rate and timeout")
        relay.configure(table, host, keep, None if rate is None else float(rate), float(timeout))
        return relay, {"ok": True}
    except (ValueError, KeyError, TypeError, OSError) as e:
        return relay, {"ok": False, "error": f"{type(e).__name__}: {e}"}
