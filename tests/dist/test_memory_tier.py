"""Issue 27, the memory tier on one host (docs/protocol.md, "Memory tier"; docs/reliability.md, "Tiers").

Two real gloo ranks save every step, to memory, and to the persistent root every
4th step; the trainers are SIGKILLed; a new job on the same root restores the
newest memory step bit-exact without reading a byte of the persistent root's
data files (they are zero-filled before the restore: a read of any of them
would fail its checksum). Also: ``close()`` on every rank releases the holder
(process gone, its directory in ``/dev/shm`` gone); the holder exits when no
manager reattaches within its idle bound; at most ``keep`` committed
snapshots are held; a corrupted snapshot is refused by the load's checksums
and every rank falls back to the persistent root; a socket that cannot prove
it is the job's holder is refused.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest
import torch

import nostall
from nostall.memory.rendezvous import (MemoryTierError, NoHello, base_dir, connect, ensure_holder, job_key,
                                       socket_name)
from nostall.options import MemoryTier, Options
from tests.dist_harness import run_ranks

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


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, bound: float = 30.0) -> bool:
    deadline = time.monotonic() + bound
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _gone(pid)


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
    root, shm, ranks = _crash(tmp_path)
    assert ranks[0]["holder"] == ranks[1]["holder"]  # one holder per host
    holder = ranks[0]["holder"]
    assert not _gone(holder)  # it outlives the trainers
    for rank, r in enumerate(ranks):
        assert r["persistent"] == [4]
        # The bound: keep=1 committed snapshot, plus the newest until rank 0's writer applied retention after its
        # commit; rank 0's finalize waits for that retention, another rank's returns at the commit.
        assert all(len(h) <= (1 if rank == 0 else 2) for h in r["held"]), (rank, r["held"])
        assert r["held"][-1][-1] == 6
    assert _zero_fill_data_files(root) == 2  # any read of the persistent root's data would now fail its checksum
    got = run_ranks(2, _restore, root, shm, timeout=180)
    for g in got:
        assert (g["step"], g["freshest"], g["tier"], g["exact"], g["persistent_bytes_read"], g["fell_back"]) == (
            6, 6, "memory", True, 0, None), g
        assert g["holder"] == holder  # the restarted job found the holder again
    assert _wait_gone(holder)  # close() on every rank released it
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
    assert _wait_gone(ranks[0]["holder"])


def test_a_holder_killed_too_leaves_the_snapshots_to_the_next_holder_which_adopts_them(tmp_path):
    root, shm, ranks = _crash(tmp_path)
    holder = ranks[0]["holder"]
    os.kill(holder, signal.SIGKILL)  # the holder dies too (an OOM kill, say): the tmpfs files stay
    assert _wait_gone(holder)
    assert os.path.isdir(os.path.join(ranks[0]["memory_root"], "step_6"))
    got = run_ranks(2, _restore, root, shm, timeout=180)
    for g in got:
        assert (g["step"], g["tier"], g["exact"], g["persistent_bytes_read"]) == (6, "memory", True, 0), g
        assert g["holder"] != holder and g["memory_root"] == ranks[0]["memory_root"]
    assert _wait_gone(got[0]["holder"])
    assert os.listdir(os.path.join(shm, f"nostall-{os.getuid()}")) == []


def test_the_holder_releases_the_tier_when_no_manager_reattaches_within_its_idle_bound(tmp_path):
    root, shm, ranks = _crash(tmp_path, last=2, idle_s=2.0)
    holder = ranks[0]["holder"]
    assert _wait_gone(holder, 60.0)
    assert not os.path.exists(ranks[0]["memory_root"])
    assert os.listdir(os.path.join(shm, f"nostall-{os.getuid()}")) == []


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


def _sync_one_rank(rank, world, root, shm):
    committed = []
    with nostall.CheckpointManager(root, timeout=30, memory_tier=_tier(shm),
                                   on_commit=lambda h: committed.append(h.step)) as mgr:
        paths = [mgr.save(step, {"w": torch.arange(_N) * step, "step": step}).path
                 for step in range(1, 6)]  # synchronous saves
        freshest = mgr.freshest_step()
        t = {"w": torch.zeros(_N, dtype=torch.int64), "step": -1}
        got = mgr.load(t)
        exact = torch.equal(t["w"], torch.arange(_N) * 5)
        holder = mgr._tiers._link.pid
        return {"paths": paths, "committed": committed, "freshest": freshest, "step": got["step"], "exact": exact,
                "tier": mgr.last_restore.tier, "latest": mgr.latest_step(), "holder": holder}


def test_synchronous_saves_go_to_memory_too_and_on_commit_is_for_persistent_saves_only(tmp_path):
    root, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(shm)
    (g,) = run_ranks(1, _sync_one_rank, root, shm, timeout=120)
    assert [os.path.dirname(p) == root for p in g["paths"]] == [False, False, False, True, False]
    assert g["committed"] == [4]  # a memory save is not durable: no on_commit
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
        nostall.CheckpointManager(root, async_save=True, timeout=30, memory_tier=_tier(shm))
    except MemoryTierError as e:
        return str(e)
    return None


def test_ranks_on_several_hosts_are_refused_on_every_rank_naming_the_fix(tmp_path):
    root, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    os.makedirs(shm)
    got = run_ranks(2, _two_hosts, root, shm, timeout=120)
    for e in got:
        assert e is not None and "2 hosts" in e and "memory_tier" in e, e
    base = os.path.join(shm, f"nostall-{os.getuid()}")
    deadline = time.monotonic() + 30
    while os.listdir(base) and time.monotonic() < deadline:  # released: the holder deletes its files and exits
        time.sleep(0.1)
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


@pytest.mark.parametrize("crash", ["trainer:staged:6", "trainer:planned:8", "writer:commit.manifest:6",
                                   "writer:commit.renamed:7"])
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
