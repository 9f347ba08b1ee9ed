"""Issue 27, a last save on preemption from the memory tier (docs/protocol.md, "A last save on preemption").

Two real gloo ranks save to memory every step and to the persistent root every
5th. When the job is preempted the host's holder commits the newest memory
snapshot into the persistent root, without the training loop:

- SIGTERM to the trainers while their main threads are stuck in a C call that
  never returns to Python (a second ``pthread_mutex_lock`` of a mutex the
  thread holds, as a hung collective): the signal reaches the holder through
  the wakeup fd, the persistent root's latest becomes the newest memory step
  while the trainers are still stuck, and a restart loads it bit for bit;
- SIGTERM to the holder alone: the same, then the memory root is gone and the
  holder exited;
- SIGTERM at a uniformly random time within 3 s of the loop's first commit: the persistent latest after
  the job is gone is the newest memory step committed before the signal, or
  newer, and loads bit for bit; the holder never outlives the job. A few
  trials by default; ``NOSTALL_SOAK_PREEMPT_MEMORY=N`` runs N (local) and the
  S3 variant runs the same trials against a moto server;
- a persistent root where the step's name is taken by something else: the
  persist fails with a clear line in the holder's log, nothing is published,
  the previous latest still loads.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import threading
import time
from typing import Any, Dict, List, Optional

import torch

import nostall
from nostall.options import MemoryTier
from nostall.storage.locate import open_root
from tests.dist_harness import process_alive, run_ranks

_N = 40000
_PERSIST = 5
_GRACE = 20.0
_SOAK = int(os.environ.get("NOSTALL_SOAK_PREEMPT_MEMORY", "0") or 0)
_SEED = int(os.environ.get("NOSTALL_PREEMPT_SEED", "20261203"))


def _shard(step: int, rank: int) -> torch.Tensor:
    return torch.arange(_N, dtype=torch.float32) * (step + 1) + rank * _N


def _state(step: int, rank: int) -> Dict[str, Any]:
    return {"w": nostall.ShardedTensor(_shard(step, rank), (2 * _N,), (rank * _N,)),
            "b": torch.full((100,), float(step)), "step": step}


def _manager(root: str, shm: str, so: Optional[Dict[str, Any]] = None) -> nostall.CheckpointManager:
    return nostall.CheckpointManager(root, async_save=True, timeout=30, grace_s=_GRACE, storage_options=so,
                                     memory_tier=MemoryTier(persist_every=_PERSIST, memory_dir=shm, idle_s=120.0))


def _write(out: str, rank: int, what: Dict[str, Any]) -> None:
    tmp = os.path.join(out, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(what, f)
    os.rename(tmp, os.path.join(out, f"rank{rank}.json"))


def _stuck_in_c() -> None:
    """Block the main thread in C for good: a second lock of a default pthread mutex this thread holds (a futex
    wait that glibc resumes after a signal handler; Python's own handler never gets to run)."""
    libc = ctypes.CDLL(None, use_errno=True)
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


def _save_then_stick(rank, world, root, shm, out, last):
    mgr = _manager(root, shm)
    for step in range(1, last + 1):
        mgr.save(step, _state(step, rank))
        mgr.finalize_pending_saves()
    _write(out, rank, {"pid": os.getpid(), "holder": mgr._tiers._link.pid, "memory_root": mgr._tiers.root.url,
                       "memory": mgr._tiers.root.steps(), "persistent": mgr.steps()})
    _stuck_in_c()


def _restore(rank, world, root, shm, so=None):
    with _manager(root, shm, so) as mgr:
        t = {"w": nostall.ShardedTensor(torch.zeros(_N), (2 * _N,), (rank * _N,)), "b": torch.zeros(100), "step": -1}
        got = mgr.load(t)
        step = got["step"]
        exact = torch.equal(t["w"].data, _shard(step, rank)) and torch.equal(t["b"], torch.full((100,), float(step)))
        return {"step": step, "exact": exact, "tier": mgr.last_restore.tier, "holder": mgr._tiers._link.pid,
                "memory_root": mgr._tiers.root.url}


def _wait(cond, bound: float) -> bool:
    deadline = time.monotonic() + bound
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _ranks_file(out: str, rank: int) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


class _Job:
    """Two ranks running ``fn`` in a thread (run_ranks waits for them; they never report when killed)."""

    def __init__(self, fn, *args, timeout: float = 240.0) -> None:
        self.error: List[BaseException] = []

        def run() -> None:
            try:
                run_ranks(2, fn, *args, timeout=timeout, grace=60)
            except BaseException as e:
                self.error.append(e)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, bound: float = 120.0) -> None:
        self.thread.join(bound)
        assert not self.thread.is_alive(), "the job did not end"


def _latest(root: str, so: Optional[Dict[str, Any]] = None) -> Optional[int]:
    return open_root(root, storage_options=so).latest_step()


def _stuck_job(tmp_path, last: int = 8, fn=_save_then_stick):
    root, shm, out = str(tmp_path / "run"), str(tmp_path / "shm"), str(tmp_path / "out")
    os.makedirs(shm)
    os.makedirs(out)
    job = _Job(fn, root, shm, out, last)
    assert _wait(lambda: all(_ranks_file(out, r) for r in range(2)), 180), job.error
    ranks = [_ranks_file(out, r) for r in range(2)]
    assert ranks[0]["memory"] == [last] and ranks[0]["persistent"] == [_PERSIST]
    return root, shm, job, ranks


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _holder_log(memory_root: str) -> str:
    try:
        with open(memory_root + ".log") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def test_sigterm_to_trainers_stuck_in_c_persists_the_newest_memory_step_within_grace(tmp_path):
    root, shm, job, ranks = _stuck_job(tmp_path)
    pids = [r["pid"] for r in ranks]
    holder = ranks[0]["holder"]
    try:
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        persisted = _wait(lambda: _latest(root) == 8, _GRACE)
        stuck = all(process_alive(p) for p in pids)  # their Python handlers have not run: still in C
        _wait(lambda: "persisted step" in _holder_log(ranks[0]["memory_root"]), 10)  # (logged once it ended)
        log = _holder_log(ranks[0]["memory_root"])
    finally:
        _kill(pids)  # the scheduler's SIGKILL at the end of the grace period
        job.join()
    assert persisted, log
    assert stuck
    assert "persisted step 8" in log and "received SIGTERM" in log, log
    assert process_alive(holder)  # trigger (a): it keeps the snapshots for a restart on this host
    got = run_ranks(2, _restore, root, shm, timeout=180)
    for g in got:
        assert (g["step"], g["tier"], g["exact"]) == (8, "persistent", True), g
    assert _wait(lambda: not process_alive(holder), 30)  # the restarted job closed cleanly: released
    assert not os.path.exists(ranks[0]["memory_root"])


def _save_then_wait_with_a_wakeup_fd_of_its_own(rank, world, root, shm, out, last):
    """As an event loop would: a wakeup fd is set before the manager, so the manager's handler tells the holder."""
    mine, peer = socket.socketpair()
    mine.setblocking(False)
    signal.set_wakeup_fd(mine.fileno(), warn_on_full_buffer=False)
    try:
        with _manager(root, shm) as mgr:
            for step in range(1, last + 1):
                mgr.save(step, _state(step, rank))
                mgr.finalize_pending_saves()
            _write(out, rank, {"pid": os.getpid(), "holder": mgr._tiers._link.pid,
                               "memory_root": mgr._tiers.root.url, "memory": mgr._tiers.root.steps(),
                               "persistent": mgr.steps()})
            while True:
                time.sleep(0.05)  # Python runs the handler here: the preemption exits the loop
    finally:
        peer.setblocking(False)
        try:
            got = list(peer.recv(16))
        except BlockingIOError:
            got = []
        with open(os.path.join(out, f"wakeup{rank}.json"), "w") as f:
            json.dump({"bytes": got, "still_mine": signal.set_wakeup_fd(-1) == mine.fileno()}, f)


def test_with_a_wakeup_fd_taken_the_managers_handler_tells_the_holder(tmp_path):
    root, shm, job, ranks = _stuck_job(tmp_path, fn=_save_then_wait_with_a_wakeup_fd_of_its_own)
    pids = [r["pid"] for r in ranks]
    holder = ranks[0]["holder"]
    try:
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        job.join(_GRACE + 60)
    finally:
        _kill(pids)
    assert _wait(lambda: not process_alive(holder), 60)  # persisted, then every rank released it
    assert _latest(root) == 8
    assert not os.path.exists(ranks[0]["memory_root"])
    out = str(tmp_path / "out")
    for r in range(2):
        with open(os.path.join(out, f"wakeup{r}.json")) as f:
            assert json.load(f) == {"bytes": [signal.SIGTERM], "still_mine": True}


def test_sigterm_to_the_holder_alone_persists_then_deletes_the_memory_root_and_exits(tmp_path):
    root, shm, job, ranks = _stuck_job(tmp_path)
    pids = [r["pid"] for r in ranks]
    holder = ranks[0]["holder"]
    try:
        os.kill(holder, signal.SIGTERM)
        gone = _wait(lambda: not process_alive(holder), _GRACE + 10)
        latest = _latest(root)
    finally:
        _kill(pids)
        job.join()
    assert gone
    assert latest == 8
    assert not os.path.exists(ranks[0]["memory_root"])
    got = run_ranks(2, _restore, root, shm, timeout=180)
    for g in got:
        assert (g["step"], g["tier"], g["exact"]) == (8, "persistent", True), g
        assert g["holder"] != holder


def test_a_name_taken_in_the_persistent_root_fails_the_persist_clearly_and_publishes_nothing(tmp_path):
    root, shm, job, ranks = _stuck_job(tmp_path)
    pids = [r["pid"] for r in ranks]
    holder = ranks[0]["holder"]
    foreign = os.path.join(root, "step_8")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "notes.txt"), "w") as f:
        f.write("not a checkpoint")
    try:
        os.kill(holder, signal.SIGTERM)
        gone = _wait(lambda: not process_alive(holder), _GRACE + 10)
    finally:
        _kill(pids)
        job.join()
    assert gone
    assert _latest(root) == _PERSIST
    assert sorted(os.listdir(foreign)) == ["notes.txt"]
    assert not [n for n in os.listdir(os.path.join(root, ".tmp")) if n.startswith("save-")]
    got = run_ranks(2, _restore, root, shm, timeout=180)
    for g in got:
        assert (g["step"], g["tier"], g["exact"]) == (_PERSIST, "persistent", True), g


# --------------------------------------------------------------------------- random SIGTERM trials


def _loop(rank, world, root, shm, out, so):
    with _manager(root, shm, so) as mgr:
        committed = os.path.join(out, "committed")
        _write(out, rank, {"pid": os.getpid(), "holder": mgr._tiers._link.pid, "memory_root": mgr._tiers.root.url})
        for step in range(1, 100000):
            mgr.save(step, _state(step, rank))
            mgr.finalize_pending_saves()  # rank 0: returns once committed
            if rank == 0:
                with open(committed, "a") as f:
                    f.write(f"{step}\n")


def _newest(out: str) -> Optional[int]:
    try:
        with open(os.path.join(out, "committed")) as f:
            steps = [int(s) for s in f.read().split()]
    except FileNotFoundError:
        return None
    return max(steps) if steps else None


def _trial(tmp_path, i: int, rng: random.Random, so: Optional[Dict[str, Any]] = None,
           root: Optional[str] = None) -> Dict[str, Any]:
    base = tmp_path / f"t{i}"
    root = root or str(base / "run")
    shm, out = str(base / "shm"), str(base / "out")
    os.makedirs(shm)
    os.makedirs(out)
    job = _Job(_loop, root, shm, out, so)
    ranks: List[Dict[str, Any]] = []
    try:
        assert _wait(lambda: all(_ranks_file(out, r) for r in range(2)), 180), job.error
        ranks = [_ranks_file(out, r) for r in range(2)]  # type: ignore[misc]
        assert _wait(lambda: _newest(out) is not None, 120), job.error  # the loop runs: step 1 is committed
        time.sleep(rng.uniform(0.0, 3.0))
        before = _newest(out)  # committed to memory (or the root) before the signal
        for r in ranks:
            os.kill(r["pid"], signal.SIGTERM)
        job.join(_GRACE + 60)
    finally:
        _kill([r["pid"] for r in ranks])
    holder = ranks[0]["holder"]
    holder_gone = _wait(lambda: not process_alive(holder), 60)
    latest = _latest(root, so)
    exact = None
    if latest is not None:
        t = {"w": torch.zeros(2 * _N), "b": torch.zeros(100), "step": -1}
        got = nostall.load(t, f"{root}/step_{latest}", storage_options=so)
        exact = got["step"] == latest and torch.equal(t["w"], torch.cat([_shard(latest, 0), _shard(latest, 1)]))
    return {"before": before, "latest": latest, "exact": exact, "holder_gone": holder_gone,
            "memory_root_gone": not os.path.exists(ranks[0]["memory_root"]),
            "log": _holder_log(ranks[0]["memory_root"])}


def _check(r: Dict[str, Any]) -> bool:
    return (r["holder_gone"] and r["memory_root_gone"]
            and (r["before"] is None or (r["latest"] is not None and r["latest"] >= r["before"] and r["exact"])))


def _trials(tmp_path, n: int, so=None, root_of=None) -> None:
    rng = random.Random(_SEED)
    misses, rows = [], []
    t0 = time.monotonic()
    for i in range(n):
        r = _trial(tmp_path, i, rng, so, root_of(i) if root_of else None)
        rows.append(r)
        if not _check(r):
            misses.append(r)
        print(f"trial {i}: committed before the signal {r['before']}, persistent latest {r['latest']}, exact "
              f"{r['exact']}, holder gone {r['holder_gone']}, memory root gone {r['memory_root_gone']}", flush=True)
    # (the job writes only multiples of _PERSIST to the persistent root: any other latest is the holder's commit)
    by_holder = sum(1 for r in rows if r["latest"] is not None and r["latest"] % _PERSIST)
    newer = sum(1 for r in rows if r["before"] is not None and r["latest"] is not None and r["latest"] > r["before"])
    print(f"memory-tier preemption trials ({'s3' if so else 'local'}): {n}, misses: {len(misses)}, latest committed "
          f"by the holder: {by_holder}, latest newer than the newest step committed before the signal: {newer}, "
          f"no step committed before the signal: {sum(1 for r in rows if r['before'] is None)}, "
          f"{time.monotonic() - t0:.0f}s")
    assert not misses, misses


def test_sigterm_at_random_times_persists_the_newest_committed_memory_step(tmp_path):
    _trials(tmp_path, _SOAK or 2)


def test_sigterm_at_random_times_persists_into_object_storage(tmp_path, s3):
    bucket = s3.make_bucket(f"preempt-{os.getpid()}-{random.randrange(1 << 30)}")
    _trials(tmp_path, _SOAK or 1, s3.storage_options, lambda i: f"s3://{bucket}/run{i}")


# --------------------------------------------------------------------------- the persist's rules, in one process


def _plain(step: int) -> Dict[str, Any]:
    return {"w": torch.arange(1000, dtype=torch.float32) * step, "step": step}


def _roots(tmp_path, memory_steps, persistent_steps):
    memory, root = str(tmp_path / "memory"), str(tmp_path / "run")
    for where, steps in ((memory, memory_steps), (root, persistent_steps)):
        with nostall.CheckpointManager(where, keep_last=None) as mgr:
            for s in steps:
                mgr.save(s, _plain(s))
    return memory, root


def _persist(memory: str, root: str, left_s: float = 20.0) -> Dict[str, Any]:
    from nostall.interop.persist import persist
    from nostall.memory.persist import Request

    return persist(Request(memory, root, None, left_s, left_s))


def test_the_persist_commits_a_newer_memory_step_and_makes_it_latest(tmp_path):
    memory, root = _roots(tmp_path, [6, 7, 8], [5])
    got = _persist(memory, root)
    assert (got["ok"], got["step"]) == (True, 8) and got["bytes"] >= 4000, got
    with nostall.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.steps() == [5, 8] and mgr.latest_step() == 8
        t = {"w": torch.zeros(1000), "step": -1}
        assert mgr.load(t)["step"] == 8 and torch.equal(t["w"], _plain(8)["w"])
    assert not [n for n in os.listdir(os.path.join(root, ".tmp")) if n.startswith("save-")]


def test_the_persist_leaves_a_newer_persistent_latest_alone(tmp_path):
    memory, root = _roots(tmp_path, [8], [5, 10])
    got = _persist(memory, root)
    assert (got["ok"], got["step"]) == (True, None) and "nothing to do" in got["note"], got
    with nostall.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.steps() == [5, 10] and mgr.latest_step() == 10


def test_the_persist_never_writes_into_a_root_another_process_holds(tmp_path):
    memory, root = _roots(tmp_path, [8], [5])
    with nostall.CheckpointManager(root):  # another job's manager holds the root's lock (no descriptor handed over)
        got = _persist(memory, root, left_s=1.0)
    assert not got["ok"] and "held by" in got["note"], got
    with nostall.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.steps() == [5] and mgr.latest_step() == 5
