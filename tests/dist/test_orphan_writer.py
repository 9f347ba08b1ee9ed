"""Issue 27: what a background writer does once its trainer died (docs/protocol.md, "Lifetime").

Real processes and gloo (``run_ranks``); every trainer SIGKILLs itself right
after ``save()`` returned. Nothing here asserts a time: every wait is a bound
only a hang reaches, and what is checked is what got committed, what the
root's lock record says, and that no process is left.

- A job not handed over whole (an overlapped save's streamed job, its copy
  still running) dies with its trainer: nothing of it is committed, the
  lock's record never names an orphan, and the previous checkpoint loads.
- A streamed job whose every chunk the trainer sent before dying (the
  writer held by the test's gate, ``Faults.writer_gate``, so that it has
  read none of them yet) is finished by the orphans and committed.
- A trainer killed alone (rank 1): its orphan writer writes its part and
  its record, and rank 0 (alive) commits the save.
- Rank 0's root has no flock (its claim holds no lock, so its writer holds
  none): every orphan dies, rank 1's too, though its job was handed over
  whole (``SaveJob.root_locked`` is False): nothing would keep a restarted
  job's clean-up of ``.tmp`` off what it writes.
- A restarted job finds the root's lock held by rank 0's orphan writer,
  which is finishing a whole job (held by the test's gate,
  ``Faults.writer_gate``): it waits for it, then takes the root and finds
  the orphan's save committed.
- A lock whose orphan holder is past the bound it promised is refused at
  once, naming the writer and the fix.
- The claim's bounds (no waiting done): an orphan's record is waited for as
  long as the job's whole life that it states (timeout + 15 s, plus slack),
  above the old 600 s cap; a record naming a trainer of this host that has
  exited, its lock still held (its orphan has not rewritten the record yet),
  is waited for a few seconds instead of refused at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import nostall
from tests.dist_harness import run_ranks, process_alive

_N = 40000
BOUND_S = 90.0  # only a hang reaches it


def _state(step: int, rank: int):
    return {"w": nostall.ShardedTensor(torch.arange(_N, dtype=torch.float32) + step * 1000 + rank * _N,
                                       (2 * _N,), (rank * _N,)),
            "b": torch.full((100,), float(step)), "step": step}


def _expected(step: int):
    return {"w": torch.cat([_state(step, r)["w"].data for r in range(2)]), "b": torch.full((100,), float(step)),
            "step": step}




def _wait(what: str, cond) -> None:
    deadline = time.monotonic() + BOUND_S
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {BOUND_S:.0f}s"
        time.sleep(0.05)


def _lock_record(root: str) -> dict:
    try:
        with open(os.path.join(root, ".tmp", ".lock"), "rb") as f:
            return json.loads(f.read() or b"{}")
    except (OSError, ValueError):
        return {}


def _save_then_die(rank, world, root, out_dir, opts, faults):
    with nostall.CheckpointManager(root, async_save=True, timeout=60, **opts) as mgr:
        mgr.save(1, _state(1, rank)).result()
        for k, v in faults.items():
            setattr(mgr._faults, k, v)
        mgr.save(2, _state(2, rank))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"writer": mgr.writer_pid, "trainer": os.getpid()}, f)
        os.kill(os.getpid(), signal.SIGKILL)


def _killed(root: str, out: str, opts: dict, faults: dict) -> list:
    """Run the job that saves steps 1 and 2 and dies; the pids of its processes."""
    os.makedirs(out, exist_ok=True)
    with pytest.raises(AssertionError, match="without reporting"):
        run_ranks(2, _save_then_die, root, out, opts, faults, timeout=120, grace=30)
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def _load_latest(root):
    with nostall.CheckpointManager(root, read_only=True) as mgr:
        t = {"w": torch.zeros(2 * _N), "b": torch.zeros(100), "step": 0}
        got = mgr.load(t)
        exp = _expected(got["step"])
        assert torch.equal(t["w"], exp["w"]) and torch.equal(t["b"], exp["b"])
        return mgr.latest_step(), mgr.steps()


def test_an_orphan_with_a_job_not_handed_over_whole_dies_and_commits_nothing(tmp_path):
    root = str(tmp_path / "run")
    # overlapped: the job goes to the writer first and its bytes follow; the copy sleeps before its first chunk
    pids = _killed(root, str(tmp_path / "out"), {"overlap": True}, {"stage_delay_s": 30.0})
    _wait("the writers to be gone", lambda: all(not process_alive(p["writer"]) for p in pids))
    latest, steps = _load_latest(root)
    assert (latest, steps) == (1, [1])
    assert not os.path.exists(os.path.join(root, "step_2"))
    assert "writer_of" not in _lock_record(root)  # no orphan ever took the job on


def _stream_then_die(rank, world, root, out_dir, gate):
    with nostall.CheckpointManager(root, async_save=True, timeout=60, overlap=True) as mgr:
        mgr.save(1, _state(1, rank)).result()
        mgr._faults.writer_gate = gate  # the writer reads none of the chunks before the trainer is gone
        mgr.save(2, _state(2, rank))
        for t in threading.enumerate():  # the overlapped copy: every chunk staged and sent
            if t.name.startswith("nostall-staging"):
                t.join(BOUND_S)
                assert not t.is_alive()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"writer": mgr.writer_pid, "trainer": os.getpid()}, f)
        os.kill(os.getpid(), signal.SIGKILL)


def test_an_orphan_finishes_a_streamed_job_whose_every_chunk_was_sent(tmp_path, capfd):
    root, out = str(tmp_path / "run"), str(tmp_path / "out")
    gate = str(tmp_path / "gate")
    os.makedirs(out)
    with pytest.raises(AssertionError, match="without reporting"):
        run_ranks(2, _stream_then_die, root, out, gate, timeout=120, grace=30)
    pids = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    # rank 0's orphan holds the root's lock and says so, its chunks still unread
    _wait("the orphan writer's lock record", lambda: _lock_record(root).get("writer_of") == pids[0]["trainer"])
    assert process_alive(pids[0]["writer"]) and process_alive(pids[1]["writer"])
    open(gate, "w").close()
    _wait("the writers to be gone", lambda: all(not process_alive(p["writer"]) for p in pids))
    latest, steps = _load_latest(root)
    assert (latest, steps) == (2, [1, 2])
    err = capfd.readouterr().err
    for r in range(2):  # each orphan took on a job still being fed: the rest of it was in its socket
        assert f"rank {r}: the trainer (pid {pids[r]['trainer']}) is gone; finishing the save of step 2 it " \
               "handed over, as far as it staged it" in err


def _one_trainer_dies(rank, world, root, out_dir, gate):
    with nostall.CheckpointManager(root, async_save=True, timeout=60) as mgr:
        mgr.save(1, _state(1, rank)).result()
        if rank == 1:
            mgr._faults.writer_gate = gate  # rank 1's writer writes nothing before its trainer is gone
        handle = mgr.save(2, _state(2, rank))
        mine = os.path.join(out_dir, f"rank{rank}.json")
        with open(mine + ".tmp", "w") as f:
            json.dump({"writer": mgr.writer_pid, "trainer": os.getpid()}, f)
        os.rename(mine + ".tmp", mine)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        other = os.path.join(out_dir, "rank1.json")
        _wait("trainer 1 to be gone", lambda: os.path.exists(other) and not process_alive(json.load(open(other))["trainer"]))
        open(gate, "w").close()
        stats = handle.result(timeout=BOUND_S)  # rank 1's part comes from its orphan writer
        with open(os.path.join(out_dir, "outcome.json"), "w") as f:
            json.dump({"committed": stats.committed, "latest": mgr.latest_step()}, f)


def test_a_trainer_killed_alone_its_orphan_reports_and_rank_0_commits(tmp_path):
    root, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    with pytest.raises(AssertionError, match="without reporting"):
        run_ranks(2, _one_trainer_dies, root, out, str(tmp_path / "gate"), timeout=2 * BOUND_S, grace=BOUND_S)
    assert json.load(open(os.path.join(out, "outcome.json"))) == {"committed": True, "latest": 2}
    pids = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    _wait("the writers to be gone", lambda: all(not process_alive(p["writer"]) for p in pids))
    assert _load_latest(root) == (2, [1, 2])


def _no_flock_then_die(rank, world, root, out_dir, gate):
    if rank == 0:  # rank 0's filesystem has no flock: its claim holds no lock (nor does its writer)
        import errno
        import fcntl

        real = fcntl.flock

        def flock(fd, op):
            if op & fcntl.LOCK_NB:
                raise OSError(errno.ENOLCK, "no locks available")
            return real(fd, op)

        fcntl.flock = flock
    # a timeout far above BOUND_S: an orphan allowed to finish would outlive the test's bound (timeout + 15 s)
    with nostall.CheckpointManager(root, async_save=True, timeout=600) as mgr:
        mgr.save(1, _state(1, rank)).result()
        mgr._faults.writer_gate = gate  # the writers write nothing of step 2 while the test holds the gate
        mgr.save(2, _state(2, rank))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"writer": mgr.writer_pid, "trainer": os.getpid()}, f)
        os.kill(os.getpid(), signal.SIGKILL)


def test_without_rank_0s_lock_every_orphan_dies_rank_1s_too(tmp_path):
    root, out = str(tmp_path / "run"), str(tmp_path / "out")
    gate = str(tmp_path / "gate")
    os.makedirs(out)
    with pytest.raises(AssertionError, match="without reporting"):
        run_ranks(2, _no_flock_then_die, root, out, gate, timeout=120, grace=30)
    pids = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    try:  # the job was handed over whole on both ranks: only the missing lock makes the orphans die
        _wait("the writers to be gone (the gate still shut)", lambda: all(not process_alive(p["writer"]) for p in pids))
    finally:
        open(gate, "w").close()
    assert "writer_of" not in _lock_record(root)
    latest, steps = _load_latest(root)
    assert (latest, steps) == (1, [1])


def _resume(rank, world, root, out_dir):
    handler = logging.FileHandler(os.path.join(out_dir, f"resume{rank}.log"))
    logging.getLogger("nostall").addHandler(handler)
    logging.getLogger("nostall").setLevel(logging.INFO)
    with nostall.CheckpointManager(root, async_save=True, timeout=20) as mgr:
        t = {"w": torch.zeros(2 * _N), "b": torch.zeros(100), "step": 0}
        got = mgr.load(t)
        exp = _expected(got["step"])
        assert torch.equal(t["w"], exp["w"]) and torch.equal(t["b"], exp["b"])
        mgr.save(3, _state(3, rank)).result()  # the root is this job's now
        return mgr.latest_step(), got["step"], mgr.writer_pid


def test_a_restarted_job_waits_for_rank_0s_orphan_writer_then_finds_its_save_committed(tmp_path):
    root, out = str(tmp_path / "run"), str(tmp_path / "out")
    gate = str(tmp_path / "gate")
    pids = _killed(root, out, {}, {"writer_gate": gate})
    # rank 0's writer, an orphan now, holds the root's lock and says so
    _wait("the orphan writer's lock record", lambda: _lock_record(root).get("writer_of") == pids[0]["trainer"])
    record = _lock_record(root)
    assert record["pid"] == pids[0]["writer"] and record["step"] == 2
    assert process_alive(pids[0]["writer"]) and process_alive(pids[1]["writer"])

    results: list = []
    errors: list = []

    def restart():
        try:
            results.extend(run_ranks(2, _resume, root, out, timeout=2 * BOUND_S))
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    log0 = os.path.join(out, "resume0.log")
    try:
        _wait("the restarted job to wait for the orphan",
              lambda: os.path.exists(log0) and "waiting for it" in open(log0).read())
        assert not os.path.exists(os.path.join(root, "step_2"))
    finally:
        open(gate, "w").close()  # the orphans may write now
    thread.join(3 * BOUND_S)
    assert not thread.is_alive()
    assert not errors, errors[0]
    assert [r[:2] for r in results] == [(3, 2), (3, 2)]  # resumed from the orphan's step 2, then saved 3
    text = open(log0).read()
    assert f"pid {pids[0]['writer']}" in text and f"pid {pids[0]['trainer']}" in text
    _wait("every writer to be gone", lambda: all(not process_alive(p["writer"]) for p in pids)
          and all(not process_alive(r[2]) for r in results))
    latest, steps = _load_latest(root)
    assert (latest, steps) == (3, [1, 2, 3])
    assert "writer_of" not in _lock_record(root)


_HOLD = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": "then",
                          "writer_of": 12345, "step": 7, "until": time.time() - 30}).encode(), 0)
print("held", flush=True)
sys.stdin.read()
"""


def test_an_orphan_past_its_promised_bound_is_refused_naming_it(tmp_path):
    root = tmp_path / "run"
    (root / ".tmp").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(root / ".tmp" / ".lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(nostall.CheckpointSaveError) as e:
            nostall.CheckpointManager(root, async_save=True, timeout=5)
        msg = str(e.value)
        assert f"background writer (pid {holder.pid}" in msg and "pid 12345" in msg and "step 7" in msg
        assert "kill it" in msg
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(BOUND_S)
    with nostall.CheckpointManager(root, async_save=True, timeout=5) as mgr:  # free once the holder is gone
        assert mgr.latest_step() is None


_HOLD_RECORD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, sys.argv[2].encode(), 0)
print("held", flush=True)
sys.stdin.read()
"""


def _claim_with_record(root, record: dict):
    """The claim a new manager's rank 0 gets while another process holds the lock with ``record``."""
    from nostall.storage.posix import PosixRoot

    (root / ".tmp").mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_RECORD, str(root / ".tmp" / ".lock"), json.dumps(record)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        return PosixRoot(str(root)).claim()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(BOUND_S)


def test_the_claim_waits_for_an_orphans_whole_promised_life(tmp_path):
    import socket

    from nostall.storage.root import ORPHAN_WAIT_SLACK_S

    life = 600.0 + 15.0  # the default timeout's orphan
    claim = _claim_with_record(tmp_path / "run", {"host": socket.gethostname(), "pid": os.getpid(), "since": "then",
                                                   "writer_of": 12345, "step": 7, "until": time.time() + 3600,
                                                   "life": life})
    assert not claim.held and claim.busy_until is not None
    assert claim.wait_left(life - 1) > 0  # after 614 s of waiting, still worth waiting (the old cap: 600 s)
    assert claim.wait_left(life + ORPHAN_WAIT_SLACK_S) == 0


def test_a_lock_held_after_its_trainer_of_this_host_exited_is_waited_for_briefly(tmp_path):
    import socket

    from nostall.storage.root import OWNER_GONE_WAIT_S

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(BOUND_S)  # a pid of this host that has exited (the trainer killed before its orphan said so)
    claim = _claim_with_record(tmp_path / "run", {"host": socket.gethostname(), "pid": gone.pid, "since": "then"})
    assert not claim.held and claim.busy_until is not None and claim.wait_left(0) > 0
    assert claim.wait_left(OWNER_GONE_WAIT_S) == 0
    assert f"pid {gone.pid}" in claim.owner and "exited" in claim.owner
    alive = _claim_with_record(tmp_path / "run2", {"host": socket.gethostname(), "pid": os.getpid(), "since": "then"})
    assert not alive.held and alive.busy_until is None and alive.wait_left(0) == 0  # a live job: refused at once
