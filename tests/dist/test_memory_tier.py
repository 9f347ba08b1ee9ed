"""Issue 27, the memory tier on one host (docs/protocol.md, "Memory tier"; docs/reliability.md, "Tiers").

Two real gloo ranks save every step, to memory, and to the persistent root every
4th step; the trainers are SIGKILLed; a new job on the same root restores the
newest memory step bit-exact without reading a byte of the persistent root's
data files (they are zero-filled before the restore: a read of any of them
would fail its checksum). Also: ``close()`` on every rank releases the holder
(process gone, its directory in ``/dev/shm`` gone), an exception does not;
the holder exits when no manager reattaches within its idle bound; at most
``keep`` committed snapshots are held; a corrupted snapshot is refused by the
load's checksums and every rank falls back to the persistent root; a socket
that cannot prove it is the job's holder is refused, and the holder serves
only its user with the mark's token; a restore follows the memory root's
``latest`` and drops a left timeline's snapshots.

The longer crash-phase sweep runs with NOSTALL_SOAK_MEMORY=1 (one phase by default).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import nostall
from nostall.memory import holder as holder_mod
from nostall.memory.rendezvous import (MemoryTierError, NoHello, base_dir, connect, ensure_holder, job_id, job_key,
                                       read_mark, recv, send, socket_name)
from nostall.options import MemoryTier, Options
from nostall.storage.posix import PosixRoot
from tests.dist_harness import run_ranks, process_alive

_N = 50000
_PERSIST = 4


def _state(step: int, rank: int):
    return {"w": nostall.ShardedTensor(torch.arange(_N, dtype=torch.float32) * (step + 1) + rank * _N,
                                       (2 * _N,), (rank * _N,)),
            "b": torch.full((100,), float(step)), "step": step}


def _template(rank: int):
    return {"w": nostall.ShardedTensor(torch.zeros(_N), (2 * _N,), (rank * _N,)), "b": torch.zeros(100), "step": -1}


def _tier(shm, idle_s=120.0, keep=1):
    return MemoryTier(persist_every=_PERSIST, memory_dir=shm, idle_s=idle_s, keep=keep)


def _save_then_die(rank, world, root, shm, out, last, idle_s, keep):
    mgr = nostall.CheckpointManager(root, async_save=True, timeout=30, memory_tier=_tier(shm, idle_s, keep))
    held = []
    for step in range(1, last + 1):
        mgr.save(step, _state(step, rank))
        mgr.finalize_pending_saves()
        held.append(mgr._tiers.root.steps())  # committed memory snapshots after each save
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"holder": mgr._tiers._link.pid, "memory_root": mgr._tiers.root.url, "held": held,
                   "persistent": mgr.steps()}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def _restore(rank, world, root, shm):
    with nostall.CheckpointManager(root, async_save=True, timeout=30, memory_tier=_tier(shm)) as mgr:
        t = _template(rank)
        freshest = mgr.freshest_step()
        got = mgr.load(t)
        step = got["step"]
        exact = torch.equal(t["w"].data, _state(step, rank)["w"].data) and torch.equal(t["b"], _state(step, 0)["b"])
        r = mgr.last_restore
        holder = mgr._tiers._link.pid
        return {"step": step, "freshest": freshest, "exact": exact, "tier": r.tier,
                "persistent_bytes_read": r.persistent_bytes_read, "fell_back": r.fell_back, "holder": holder,
                "memory_root": mgr._tiers.root.url}




def _wait_gone(pid: int, bound: float = 30.0) -> bool:
    deadline = time.monotonic() + bound
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not process_alive(pid)


def _crash(tmp, last=6, idle_s=120.0, keep=1):
    root, shm, out = str(tmp / "run"), str(tmp / "shm"), str(tmp / "out")
    os.makedirs(shm)
    os.makedirs(out)
    with pytest.raises(AssertionError, match="without reporting"):
        run_ranks(2, _save_then_die, root, shm, out, last, idle_s, keep, timeout=180, grace=30)
    return root, shm, [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def _zero_fill_data_files(root: str) -> int:
    """Overwrite every data file of the persistent root with zeros (same size); returns how many."""
    n = 0
    for d in os.listdir(root):
        if d.startswith("step_"):
            for f in os.listdir(os.path.join(root, d)):
                if f.endswith(".safetensors"):
                    p = os.path.join(root, d, f)
                    size = os.path.getsize(p)
                    with open(p, "r+b") as fh:
                        fh.write(b"\0" * size)
                    n += 1
    return n


def test_a_trainer_crash_restores_the_newest_memory_step_with_nothing_read_from_the_root(tmp_path):
    """The trainers die (SIGKILL), then their holder too (an OOM kill, say): the tmpfs files stay, the next holder
    adopts the root its predecessor's mark names, and the restarted job restores from memory."""
    root, shm, ranks = _crash(tmp_path)
    assert ranks[0]["holder"] == ranks[1]["holder"]  # one holder per host
    holder = ranks[0]["holder"]
    assert process_alive(holder)  # it outlives the trainers
    for rank, r in enumerate(ranks):
        assert r["persistent"] == [4]
        # The bound: keep=1 committed snapshot, plus the newest until rank 0's writer applied retention after its
        # commit; rank 0's finalize waits for that retention, another rank's returns at the commit.
        assert all(len(h) <= (1 if rank == 0 else 2) for h in r["held"]), (rank, r["held"])
        assert r["held"][-1][-1] == 6
    assert _zero_fill_data_files(root) == 2  # any read of the persistent root's data would now fail its checksum
    os.kill(holder, signal.SIGKILL)
    assert _wait_gone(holder)
    assert os.path.isdir(os.path.join(ranks[0]["memory_root"], "step_6"))
    got = run_ranks(2, _restore, root, shm, timeout=180)
    for g in got:
        assert (g["step"], g["freshest"], g["tier"], g["exact"], g["persistent_bytes_read"], g["fell_back"]) == (
            6, 6, "memory", True, 0, None), g
        assert g["holder"] != holder and g["memory_root"] == ranks[0]["memory_root"]  # adopted
    assert _wait_gone(got[0]["holder"])  # close() on every rank released it
    assert not os.path.exists(ranks[0]["memory_root"])
    assert os.listdir(os.path.join(shm, f"nostall-{os.getuid()}")) == []


def test_a_corrupted_snapshot_is_refused_and_every_rank_falls_back_to_the_persistent_root(tmp_path):
    root, shm, ranks = _crash(tmp_path)
    data = os.path.join(ranks[0]["memory_root"], "step_6", "rank1.safetensors")
    with open(data, "r+b") as fh:  # one bit flipped in rank 1's snapshot, past its header
        fh.seek(os.path.getsize(data) - 1000)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 1]))
    got = run_ranks(2, _restore, root, shm, timeout=180)
    for g in got:
        assert (g["step"], g["tier"], g["exact"]) == (4, "persistent", True), g
        assert "rank 1" in g["fell_back"] and "checksum" in g["fell_back"].lower(), g["fell_back"]
        assert g["holder"] == ranks[0]["holder"]  # the restarted job found the holder again
    assert _wait_gone(ranks[0]["holder"])


def _save_and_close(rank, world, root, keep):
    with nostall.CheckpointManager(root, async_save=True, timeout=30,
                                   memory_tier=MemoryTier(persist_every=_PERSIST, keep=keep)) as mgr:
        held = []
        for step in range(1, 7):
            mgr.save(step, _state(step, rank))
            mgr.finalize_pending_saves()
            held.append(mgr._tiers.root.steps())
        return {"holder": mgr._tiers._link.pid, "memory_root": mgr._tiers.root.url, "held": held}


def test_close_releases_the_holder_and_its_shared_memory(tmp_path):
    root = str(tmp_path / "run")
    got = run_ranks(2, _save_and_close, root, 2, timeout=180)
    holder, mroot = got[0]["holder"], got[0]["memory_root"]
    assert mroot.startswith(f"/dev/shm/nostall-{os.getuid()}/")  # the default: host shared memory
    assert got[0]["held"] == [[1], [1, 2], [2, 3], [2, 3], [3, 5], [5, 6]]  # keep=2 (rank 0: retention is done)
    assert _wait_gone(holder)
    key = os.path.basename(mroot)
    assert not [n for n in os.listdir(os.path.dirname(mroot)) if n.startswith(key)]


def test_a_socket_that_is_not_the_jobs_holder_is_refused(tmp_path):
    base = base_dir(str(tmp_path))
    key = job_key(str(tmp_path / "run"), "")
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(socket_name(key))
    fake.listen(1)
    try:
        with pytest.raises(MemoryTierError, match="sent no hello"):
            connect(base, key, 2.0)
    finally:
        fake.close()
    assert connect(base, key, 2.0) is None  # nobody listens


def test_a_listener_without_hello_is_looked_at_again_until_it_goes_then_a_holder_is_started(tmp_path):
    base = base_dir(str(tmp_path))
    key = job_key(str(tmp_path / "run"), "")
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(socket_name(key))
    fake.listen(8)
    with pytest.raises(NoHello):  # it never says hello: refused once the deadline passed
        ensure_holder(base, key, 5.0, 3.0)
    threading.Timer(1.0, fake.close).start()  # as a holder that is stopping: its listener is the last to go
    link, proc = ensure_holder(base, key, 5.0, 60.0)
    assert proc is not None and link.pid == proc.pid
    assert link.ask({"op": "attach", "rank": 0}, 10.0)["ok"]
    link.ask({"op": "release"}, 10.0)
    link.close()
    proc.wait(30)
    assert os.listdir(base) == []


def test_settings_are_checked():
    with pytest.raises(ValueError, match="keep must be 1 or 2"):
        MemoryTier(persist_every=2, keep=0)
    with pytest.raises(ValueError, match="persist_every"):
        MemoryTier(persist_every=0)
    with pytest.raises(ValueError, match="incremental"):
        Options(memory_tier=MemoryTier(persist_every=2), incremental=True)
    assert Options().memory_tier is None  # off by default


def _sync_one_rank(rank, world, root, shm, hf):
    from nostall.interop.hf_export import HFExport

    committed = []
    with nostall.CheckpointManager(root, timeout=30, memory_tier=_tier(shm), export=HFExport(hf + "/step_{step}"),
                                   on_commit=lambda h: committed.append(h.step)) as mgr:
        paths = [mgr.save(step, {"w": torch.arange(_N) * step, "step": step, "model": {"x": torch.ones(4) * step}},
                          files={"huggingface/config.json": {"model_type": "test"}}).path
                 for step in range(1, 6)]  # synchronous saves
        exported = mgr.export_result().path  # the latest export: step 4's (a memory save is not exported)
        freshest = mgr.freshest_step()
        t = {"w": torch.zeros(_N, dtype=torch.int64), "step": -1, "model": {"x": torch.zeros(4)}}
        got = mgr.load(t)
        exact = torch.equal(t["w"], torch.arange(_N) * 5)
        holder = mgr._tiers._link.pid
        return {"paths": paths, "committed": committed, "exported": exported, "hf": sorted(os.listdir(hf)),
                "freshest": freshest, "step": got["step"], "exact": exact,
                "tier": mgr.last_restore.tier, "latest": mgr.latest_step(), "holder": holder}


def test_synchronous_saves_go_to_memory_too_and_on_commit_and_export_are_for_persistent_saves_only(tmp_path):
    root, shm, hf = str(tmp_path / "run"), str(tmp_path / "shm"), str(tmp_path / "hf")
    os.makedirs(shm)
    (g,) = run_ranks(1, _sync_one_rank, root, shm, hf, timeout=120)
    assert [os.path.dirname(p) == root for p in g["paths"]] == [False, False, False, True, False]
    assert g["committed"] == [4]  # a memory save is not durable: no on_commit
    assert (g["exported"], g["hf"]) == (os.path.join(hf, "step_4"), ["step_4"])  # nor an export
    assert (g["freshest"], g["step"], g["tier"], g["exact"], g["latest"]) == (5, 5, "memory", True, 4)
    assert _wait_gone(g["holder"])
    assert os.listdir(os.path.join(shm, f"nostall-{os.getuid()}")) == []


def _stage_memory_save_then_die(rank, world, root, shm, out):
    mgr = nostall.CheckpointManager(root, async_save=True, timeout=30, memory_tier=_tier(shm))
    mgr.save(1, _state(1, rank)).result()
    mgr._faults.writer_delay_s = 2.0  # the writer cannot have committed step 2 before the kill
    mgr.save(2, _state(2, rank))  # to memory, handed whole to the writer
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"holder": mgr._tiers._link.pid, "writer": mgr.writer_pid, "memory_root": mgr._tiers.root.url}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_memory_save_handed_whole_to_every_writer_is_still_committed_when_the_trainers_die(tmp_path):
    root, shm, out = str(tmp_path / "run"), str(tmp_path / "shm"), str(tmp_path / "out")
    os.makedirs(shm)
    os.makedirs(out)
    with pytest.raises(AssertionError, match="without reporting"):
        run_ranks(2, _stage_memory_save_then_die, root, shm, out, timeout=180, grace=30)
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    assert all(_wait_gone(r["writer"], 90.0) for r in ranks)  # the orphan writers finish (bounded), then exit
    got = run_ranks(2, _restore, root, shm, timeout=180)
    for g in got:
        assert (g["step"], g["tier"], g["exact"], g["persistent_bytes_read"]) == (2, "memory", True, 0), g
    assert _wait_gone(ranks[0]["holder"])


def _two_hosts(rank, world, root, shm):
    from nostall.memory import tier

    if rank == 1:  # as if rank 1 ran on another host
        tier._host_identity = lambda base: ("elsewhere", "another-boot", 0, 0)
    try:
        # two hosts and a peer_jump that maps each to itself: refused at creation (a jump of 1 would set up
        # replication: tests/system/test_memory_multihost.py)
        nostall.CheckpointManager(root, async_save=True, timeout=30,
                                  memory_tier=MemoryTier(persist_every=_PERSIST, memory_dir=shm, idle_s=600.0,
                                                         peer_jump=2))
    except MemoryTierError as e:
        base = base_dir(shm)
        return str(e), read_mark(base, job_key(root, job_id()))["pid"]
    return None


def test_a_peer_jump_mapping_a_host_to_itself_is_refused_on_every_rank_naming_the_fix(tmp_path):
    root, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(shm)
    got = run_ranks(2, _two_hosts, root, shm, timeout=120)
    for e, _ in got:
        assert "peer_jump=2" in e and "2 hosts" in e and "set peer_jump" in e, e
    # A manager that fails to start releases nothing (a restart that fails must not delete the snapshots it came
    # to restore): the holder stays, until its idle bound (or a signal).
    holder = got[0][1]
    base = os.path.join(shm, f"nostall-{os.getuid()}")
    assert process_alive(holder) and len(os.listdir(base)) > 1
    os.kill(holder, signal.SIGTERM)
    assert _wait_gone(holder)
    assert os.listdir(base) == []


def _save_until_killed(rank, world, root, shm, out):
    mgr = nostall.CheckpointManager(root, async_save=True, timeout=20, memory_tier=_tier(shm))
    try:
        for step in range(1, 9):
            with open(os.path.join(out, f"rank{rank}.json"), "w") as f:  # the writer of this save (a new one
                json.dump({"writer": mgr.writer_pid, "memory_root": mgr._tiers.root.url}, f)  # after a death)
            mgr.save(step, _state(step, rank))
            mgr.finalize_pending_saves()
    except nostall.CheckpointError:
        pass  # a writer killed at a crash point: the job dies here
    os.kill(os.getpid(), signal.SIGKILL)


def _committed(d: str):
    return {int(n[len("step_"):]) for n in os.listdir(d) if n.startswith("step_")
            and os.path.isfile(os.path.join(d, n, "manifest.json"))} if os.path.isdir(d) else set()


_SOAK = os.environ.get("NOSTALL_SOAK_MEMORY") == "1"


@pytest.mark.parametrize("crash", ["writer:commit.renamed:7"] + [
    pytest.param(c, marks=pytest.mark.skipif(not _SOAK, reason="crash-phase sweep: NOSTALL_SOAK_MEMORY=1"))
    for c in ("trainer:staged:6", "trainer:planned:8", "writer:commit.manifest:6")])
def test_a_crash_at_a_phase_of_a_save_restores_the_newest_committed_step_of_either_tier(tmp_path, crash):
    root, shm, out = str(tmp_path / "run"), str(tmp_path / "shm"), str(tmp_path / "out")
    os.makedirs(shm)
    os.makedirs(out)
    with pytest.raises(AssertionError, match="without reporting"):
        run_ranks(2, _save_until_killed, root, shm, out, timeout=180, grace=30, env={"NOSTALL_TEST_CRASH": crash})
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    mroot = ranks[0]["memory_root"]
    assert all(_wait_gone(r["writer"], 90.0) for r in ranks)  # an orphan writer finishes its job (bounded) first
    newest = max(_committed(mroot) | _committed(root))
    # nothing committed before the crashed save is lost (a writer's death is recovered by its trainer: the save
    # of its step commits or fails, and the job may go on to step 8)
    assert newest >= int(crash.rsplit(":", 1)[1]) - 1, (crash, newest)
    got = run_ranks(2, _restore, root, shm, timeout=180)
    for g in got:
        assert (g["step"], g["exact"]) == (newest, True), (crash, g)
        assert g["tier"] == ("memory" if newest % _PERSIST else "persistent"), (crash, g)
    assert _wait_gone(got[0]["holder"])


# ---------------------------------------------------------------- the holder: who it serves, how it stops

def _hello(key: str):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(socket_name(key))
    buf = bytearray()
    return s, buf, recv(s, buf, time.monotonic() + 10)


def _closed_after(s: socket.socket, buf: bytearray, msg) -> bool:
    """Whether the holder closes the connection when sent ``msg`` (instead of answering)."""
    send(s, msg)
    try:
        return recv(s, buf, time.monotonic() + 10) is None
    except ConnectionResetError:
        return True
    finally:
        s.close()


def _as_nobody_connect(key: str, w: int) -> None:  # (forked child: never returns)
    name = socket_name(key)  # (this user's holder's: the name holds the uid)
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(name)
        s.settimeout(10)
        got = s.recv(4096)
        os.write(w, b"closed" if not got else b"hello")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        os.write(w, f"error {e}".encode())
    os._exit(0)


def test_the_holder_serves_only_this_user_and_attach_or_release_only_with_the_marks_token(tmp_path):
    base = base_dir(str(tmp_path))
    key = job_key(str(tmp_path / "run"), "")
    link, proc = ensure_holder(base, key, 3600.0, 30.0)
    assert proc is not None
    try:
        link.ask({"op": "attach", "rank": 0}, 10.0)
        with open(os.path.join(base, key, "snapshot"), "w") as f:
            f.write("x")
        link.close()  # the trainer crashed: the snapshots are kept for a restart
        s, buf, hello = _hello(key)
        assert hello is not None and "token" in hello  # (the token is the mark's: only this user reads it)
        assert _closed_after(s, buf, {"op": "attach", "rank": 0})  # no token: dropped
        s, buf, _ = _hello(key)
        assert _closed_after(s, buf, {"op": "release", "token": "0" * 32})  # a wrong one: dropped
        if os.getuid() == 0:  # another user's process is turned away before any hello
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                _as_nobody_connect(key, w)
            os.close(w)
            os.waitpid(pid, 0)
            assert os.read(r, 200) == b"closed"
            os.close(r)
        assert proc.poll() is None and os.path.isfile(os.path.join(base, key, "snapshot"))  # nothing released
        link = connect(base, key, 10.0)
        assert link is not None
        link.ask({"op": "attach", "rank": 0}, 10.0)
        assert link.ask({"op": "release"}, 10.0)["ok"]  # (the link sends the mark's token)
        link.close()
        assert proc.wait(30) == 0
        assert os.listdir(base) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_new_holder_waits_for_its_predecessor_to_finish_deleting_its_root(tmp_path):
    base = base_dir(str(tmp_path))
    key = job_key(str(tmp_path / "run"), "")
    old = holder_mod.Holder(base, key, 60.0)
    assert old.start() == -1
    with open(os.path.join(old.root, "snapshot"), "w") as f:
        f.write("x")
    old.close_connections()  # stopping: its listener is closed first, the deletion not done yet
    new = holder_mod.Holder(base, key, 60.0)
    code = []
    t = threading.Thread(target=lambda: code.append(new.start()))
    t.start()
    t.join(1.0)
    assert t.is_alive() and os.path.isfile(os.path.join(old.root, "snapshot"))  # waits on the mark's flock
    old.cleanup()
    os.close(old.mark_fd)  # (the process exits: its flock goes)
    t.join(30)
    assert code == [-1] and os.listdir(new.root) == []  # a fresh root: nothing of the old one adopted
    new.cleanup()
    os.close(new.mark_fd)
    assert os.listdir(base) == []


def test_a_root_the_holder_cannot_delete_or_an_internal_error_keeps_its_mark_for_the_next_holder(tmp_path,
                                                                                                 monkeypatch):
    base = base_dir(str(tmp_path))
    key = job_key(str(tmp_path / "run"), "")
    h = holder_mod.Holder(base, key, 60.0)
    assert h.start() == -1
    with open(os.path.join(h.root, "snapshot"), "w") as f:
        f.write("x")
    monkeypatch.setattr(holder_mod, "_DELETE_TRIES_S", 0.3)
    monkeypatch.setattr(holder_mod.shutil, "rmtree", lambda *a, **k: None)  # something keeps writing into it
    h.cleanup()
    monkeypatch.undo()
    assert read_mark(base, key)["token"] == h.token  # the mark stays: the root is provably nostall's
    os.close(h.mark_fd)
    h2 = holder_mod.Holder(base, key, 60.0)
    assert h2.start() == -1  # adopts it (status 3 before: "no holder's mark proves nostall made it")
    assert os.path.isfile(os.path.join(h2.root, "snapshot"))

    def broken() -> None:
        raise RuntimeError("a bug in the holder")

    h2.serve = broken  # type: ignore[method-assign]
    assert holder_mod.run(h2) == holder_mod.EXIT_ERROR  # deletes nothing
    assert os.path.isfile(os.path.join(h2.root, "snapshot")) and read_mark(base, key)["token"] == h2.token
    os.close(h2.mark_fd)
    link, proc = ensure_holder(base, key, 60.0, 30.0)  # the next holder adopts it, and deletes it at release
    link.ask({"op": "attach", "rank": 0}, 10.0)
    assert os.path.isfile(os.path.join(base, key, "snapshot"))
    link.ask({"op": "release"}, 10.0)
    link.close()
    assert proc is not None and proc.wait(30) == 0
    assert os.listdir(base) == []


def test_a_writer_still_writing_into_the_root_as_the_holder_idles_out_leaves_it_usable(tmp_path):
    base = base_dir(str(tmp_path))
    key = job_key(str(tmp_path / "run"), "")
    root = os.path.join(base, key)
    link, proc = ensure_holder(base, key, 1.0, 30.0)
    link.ask({"op": "attach", "rank": 0}, 10.0)
    link.close()  # the trainer died: the holder idles out after 1 s
    i, end = 0, time.monotonic() + 4.0
    while time.monotonic() < end:  # as an orphan writer finishing a memory save while the holder idles out
        try:
            open(os.path.join(root, f"f{i}"), "w").close()
        except FileNotFoundError:
            break
        i += 1
    assert proc is not None and proc.wait(30) == 0
    link, proc = ensure_holder(base, key, 60.0, 30.0)  # a later holder starts (adopting what may be left)
    link.ask({"op": "attach", "rank": 0}, 10.0)
    link.ask({"op": "release"}, 10.0)
    link.close()
    assert proc is not None and proc.wait(30) == 0
    assert os.listdir(base) == []


# ---------------------------------------------------------------- rollback, exceptions, claims, errors

_PHASE1 = """
import os, sys, torch, nostall
root, shm = sys.argv[1], sys.argv[2]
mgr = nostall.CheckpointManager(root, async_save=False, memory_tier=nostall.MemoryTier(persist_every=4, memory_dir=shm))
for step in (4, 6):
    mgr.save(step, {"w": torch.full((100,), float(step)), "step": step})
mgr.load({"w": torch.zeros(100), "step": -1}, step=4)  # a rollback: step 6 belongs to a timeline left behind
assert mgr._tiers.root.steps() == [], mgr._tiers.root.steps()
mgr.save(5, {"w": torch.full((100,), 5.0), "step": 5})
raise RuntimeError("the trainer dies of an exception (no with: the atexit handler closes the manager)")
"""


def _restore_one(rank, world, root, shm, fail):
    with nostall.CheckpointManager(root, async_save=False, memory_tier=_tier(shm)) as mgr:
        t = {"w": torch.zeros(100), "step": -1}
        got = mgr.load(t)
        out = {"step": got["step"], "tier": mgr.last_restore.tier,
               "exact": torch.equal(t["w"], torch.full((100,), 5.0)),
               "holder": mgr._tiers._link.pid, "memory_root": mgr._tiers.root.url}
        if fail:
            try:
                with mgr:  # an exception unwinds through the manager's __exit__
                    raise ValueError("a training step failed")
            except ValueError:
                pass
    return out


def test_a_rollback_is_followed_and_an_exception_keeps_the_tier_until_a_clean_close(tmp_path):
    root, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(shm)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.getcwd(), "src"), os.getcwd()]))
    r = subprocess.run([sys.executable, "-c", _PHASE1, root, shm], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "RuntimeError: the trainer dies" in r.stderr, r.stderr[-3000:]
    (g,) = run_ranks(1, _restore_one, root, shm, True, timeout=120)
    # The memory root's latest (5), not its highest step (6 was dropped at the rollback); the uncaught
    # exception's close (atexit) released nothing, nor did the one through __exit__.
    assert (g["step"], g["tier"], g["exact"]) == (5, "memory", True), g
    assert process_alive(g["holder"]) and os.listdir(g["memory_root"]).count("step_5") == 1
    (g2,) = run_ranks(1, _restore_one, root, shm, False, timeout=120)
    assert (g2["step"], g2["tier"], g2["exact"], g2["holder"]) == (5, "memory", True, g["holder"]), g2
    assert _wait_gone(g["holder"])  # a clean close releases it
    assert os.listdir(os.path.join(shm, f"nostall-{os.getuid()}")) == []


def _claimed_elsewhere(rank, world, root, shm):
    base = base_dir(shm)
    key = job_key(root, job_id())
    link, _ = ensure_holder(base, key, 2.0, 30.0)
    link.ask({"op": "attach", "rank": 0}, 10.0)
    claim = PosixRoot(os.path.join(base, key)).claim()  # as another manager of this memory root
    assert claim.held
    try:
        nostall.CheckpointManager(root, async_save=False, timeout=30, memory_tier=_tier(shm, idle_s=2.0))
    except MemoryTierError as e:
        return str(e)
    finally:
        claim.release()
        link.close()
    return None


def test_a_refused_claim_of_the_memory_root_is_an_error_naming_its_holder(tmp_path):
    root, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(shm)
    (e,) = run_ranks(1, _claimed_elsewhere, root, shm, timeout=120)
    assert e is not None and "in use by pid" in e and "memory_tier" in e, e


def _one_rank_fails_before_the_exchange(rank, world, root, shm):
    with nostall.CheckpointManager(root, async_save=False, timeout=30, memory_tier=_tier(shm)) as mgr:
        mgr.save(1, _state(1, rank))
        if rank == 1:
            def broken():
                raise OSError("the memory root cannot be read")
            mgr._tiers.root.steps = broken  # (latest_step reads the steps)
        try:
            mgr.load(_template(rank))
        except nostall.CheckpointLoadError as e:
            return str(e)
    return None


def test_an_error_on_one_rank_before_the_restores_exchange_is_raised_on_every_rank(tmp_path):
    root, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(shm)
    got = run_ranks(2, _one_rank_fails_before_the_exchange, root, shm, timeout=120)
    for e in got:
        assert e is not None and "rank 1: OSError: the memory root cannot be read" in e, e
