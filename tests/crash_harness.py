"""Crash-consistency trials: a 2-rank checkpointing job killed at many points, then checked.

One *run* is a sequence of *trials* on one checkpoint root, as a real job
restarted after each failure would be. Each trial starts a fresh 2-rank job
(gloo, processes forked from a server that has torch and nostall imported, so
a start costs milliseconds). The job resumes from the latest checkpoint,
checks the state it loads, and then saves a few steps, asynchronously or
synchronously. During that, one participant is killed with SIGKILL:

* ``point``: a trainer or writer process kills itself at an exact phase of a
  save (``NOSTALL_TEST_CRASH``, see ``nostall/_faults.py``);
* ``kill``: the harness kills a trainer, a writer, or the whole job after a
  random delay.

After the job is gone, the harness checks:

* no process hangs: every survivor exits within the bound;
* no writer outlives its trainer;
* ``latest_step()`` never goes back, and it names a checkpoint that loads and
  is bit-exact against the state of that step;
* every listed checkpoint verifies, and no ``step_*`` directory lacks its
  manifest.

The next trial's start cleans the leftovers in ``.tmp``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import nostall

TIMEOUT_S = 3.0  # the jobs' CheckpointManager timeout (every wait in the library is bounded by it)
ROWS, COLS = 256, 1024  # per rank: 1 MiB of float32 (sharded) + a replicated vector
STEPS_PER_JOB = 5
TRAINER_POINTS = ("planned", "staged")
WRITER_POINTS = ("write.start", "write.done")
COMMIT_POINTS = ("commit.ready", "commit.manifest", "commit.renamed", "retain.moved")
# object storage: rank 0's writer uploads the manifest between commit.ready and commit.renamed
REMOTE_WRITER_POINTS = ("write.start", "upload.done", "write.done")
REMOTE_COMMIT_POINTS = ("commit.ready", "commit.renamed", "retain.moved")


@dataclass
class Dest:
    """Where the trials save: a local root, or a URL on object storage with its fsspec options."""

    root: str
    storage_options: Optional[Dict[str, Any]] = None
    timeout: float = TIMEOUT_S

    @property
    def remote(self) -> bool:
        return "://" in self.root

    def latest_step(self) -> Optional[int]:
        from nostall import commit, commit_remote

        return (commit_remote.latest_step(self.root, self.storage_options) if self.remote
                else commit.latest_step(self.root))

    def committed_steps(self) -> List[int]:
        from nostall import commit, commit_remote

        return (commit_remote.committed_steps(self.root, self.storage_options) if self.remote
                else commit.committed_steps(self.root))

    def step_path(self, step: int) -> str:
        from nostall import commit, commit_remote

        return commit_remote.join(self.root, f"step_{step}") if self.remote else commit.step_dir(self.root, step)


# --------------------------------------------------------------------------- the job (child side)


def state_for(step: int, rank: int, world: int) -> Dict[str, Any]:
    import torch

    shard = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + step * 1000.0 + rank * 0.5
    return {
        "w": nostall.ShardedTensor(shard, (ROWS * world, COLS), (ROWS * rank, 0)),
        "b": torch.full((4096,), float(step)),
        "meta": {"step": step},
        "rng": nostall.PerRank(torch.full((16,), (step * 10 + rank) % 256, dtype=torch.uint8)),
    }


def expected_full(step: int, world: int) -> Tuple[Any, Any]:
    import torch

    w = torch.cat([state_for(step, r, world)["w"].data for r in range(world)])
    return w, torch.full((4096,), float(step))


def _job_rank(rank: int, world: int, init_file: str, dest: Dest, crash: Optional[str], async_save: bool,
              out_dir: str) -> None:
    code = 0
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        if crash is not None:
            os.environ["NOSTALL_TEST_CRASH"] = crash  # inherited by this rank's writer
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=dest.timeout * 3))
        mgr = nostall.CheckpointManager(dest.root, keep_last=2, async_save=async_save, timeout=dest.timeout,
                                        storage_options=dest.storage_options,
                                        local_staging_dir=os.path.join(out_dir, f"local{rank}"))
        with open(os.path.join(out_dir, f"pids{rank}.json"), "w") as f:
            json.dump({"trainer": os.getpid(), "writer": mgr.writer_pid}, f)
        first_writer = mgr.writer_pid
        start = mgr.latest_step() or 0
        if start:
            tmpl = state_for(0, rank, world)
            got = mgr.load(tmpl)
            want = state_for(start, rank, world)
            if not (torch.equal(tmpl["w"].data, want["w"].data) and got["meta"] == {"step": start}
                    and torch.equal(got["rng"], want["rng"].value)):
                raise AssertionError(f"rank {rank}: resumed state of step {start} is wrong")
        for step in range(start + 1, start + STEPS_PER_JOB + 1):
            st = state_for(step, rank, world)
            mgr.save(step, st)
            st["w"].data.fill_(-1.0)  # "training" changes the state right after save() returns
            time.sleep(0.03)
        with open(os.path.join(out_dir, f"writer-restarts{rank}"), "w") as f:
            f.write("1" if async_save and mgr.writer_pid != first_writer else "0")
        mgr.close()
        dist.destroy_process_group()
    except nostall.CheckpointError as e:  # a peer died: the expected outcome for survivors
        code = 2
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(str(e))
    except BaseException:
        code = 1
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    os._exit(code)


# --------------------------------------------------------------------------- the harness (parent side)


@dataclass
class Trial:
    index: int
    mode: str  # point | kill
    target: str  # e.g. "writer 0", "trainer 1", "job"
    detail: str  # the crash point and step, or the delay
    async_save: bool
    latest_before: Optional[int]
    latest_after: Optional[int] = None
    exit_codes: List[Optional[int]] = field(default_factory=list)
    exit_s: float = 0.0
    after_kill_s: Optional[float] = None  # kill trials: from the kill to the last rank's exit
    hit: bool = False  # the crash happened (a crash point reached, or a kill while the victim ran)
    problems: List[str] = field(default_factory=list)


@dataclass
class Report:
    trials: List[Trial]
    seed: int
    seconds: float
    timeout: float = TIMEOUT_S

    @property
    def failures(self) -> List[Trial]:
        return [t for t in self.trials if t.problems]

    def summary(self) -> str:
        by: Dict[str, int] = {}
        for t in self.trials:
            key = f"{t.mode} {t.target.split()[0]}"
            by[key] = by.get(key, 0) + 1
        hits = sum(1 for t in self.trials if t.hit)
        advanced = sum(1 for t in self.trials if (t.latest_after or 0) > (t.latest_before or 0))
        lost = sum(1 for t in self.trials if any("lost" in p or "load" in p for p in t.problems))
        hangs = sum(1 for t in self.trials if any("hang" in p for p in t.problems))
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(by.items()))
        waits = [t.after_kill_s for t in self.trials if t.after_kill_s is not None]
        slowest = f"{max(waits):.1f}s" if waits else "n/a"
        return (
            f"crash trials: {len(self.trials)} in {self.seconds:.0f}s (seed {self.seed}; {kinds}); "
            f"a process was killed mid-job in {hits}; "
            f"a new checkpoint committed in {advanced}; checkpoints lost: {lost}; hangs: {hangs}; "
            f"slowest exit after a kill: {slowest} (manager timeout {self.timeout:g}s); "
            f"trials with problems: {len(self.failures)}"
        )

    def as_json(self) -> str:
        return json.dumps({"seed": self.seed, "seconds": self.seconds, "trials": [asdict(t) for t in self.trials]},
                          indent=1)


def _plan(n: int, rng: random.Random, remote: bool) -> List[Tuple[str, str, str, bool, Optional[str]]]:
    """(mode, target, detail, async_save, crash spec template) for n trials: every crash point once, then random."""
    plans: List[Tuple[str, str, str, bool, Optional[str]]] = []
    writer_points, commit_points = (REMOTE_WRITER_POINTS, REMOTE_COMMIT_POINTS) if remote else (
        WRITER_POINTS, COMMIT_POINTS)
    for rank in (0, 1):
        for p in TRAINER_POINTS:
            plans.append(("point", f"trainer {rank}", p, True, f"trainer:{p}"))
        for p in writer_points:
            plans.append(("point", f"writer {rank}", p, True, f"writer:{p}"))
    for p in commit_points:
        plans.append(("point", "writer 0", p, True, f"writer:{p}"))
    for p in ("written",) + commit_points:  # synchronous saves: rank 0's trainer commits
        plans.append(("point", "trainer 0", p, False, f"trainer:{p}"))
    plans = plans[:n]
    targets = ["trainer 0", "trainer 1", "writer 0", "writer 1", "job"]
    while len(plans) < n:
        plans.append(("kill", rng.choice(targets), "", rng.random() < 0.85, None))
    return plans


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"  # a zombie is gone
    except (FileNotFoundError, IndexError):
        return False


def _writer_replaced(out_dir: str, rank: int) -> bool:
    try:
        with open(os.path.join(out_dir, f"writer-restarts{rank}")) as f:
            return int(f.read() or 0) > 0
    except FileNotFoundError:
        return False


def _read_pids(out_dir: str, world: int) -> Dict[int, Dict[str, Optional[int]]]:
    pids = {}
    for r in range(world):
        try:
            with open(os.path.join(out_dir, f"pids{r}.json")) as f:
                pids[r] = json.load(f)
        except (FileNotFoundError, ValueError):
            pass
    return pids


def _check_root(dest: Dest, trial: Trial) -> None:
    import torch

    from nostall.loading import check_checkpoint

    so = dest.storage_options
    latest = dest.latest_step()
    trial.latest_after = latest
    if trial.latest_before is not None and (latest is None or latest < trial.latest_before):
        trial.problems.append(f"checkpoint lost: latest went from {trial.latest_before} to {latest}")
    if not dest.remote:  # on object storage a prefix without its manifest is simply not listed
        for name in os.listdir(dest.root):
            if name.startswith("step_") and not os.path.isfile(os.path.join(dest.root, name, "manifest.json")):
                trial.problems.append(f"{name} is listed without a manifest")
    for s in dest.committed_steps():
        rep = check_checkpoint(dest.step_path(s), so)
        if rep.problems:
            trial.problems.append(f"step {s} does not verify (checkpoint lost): {rep.problems}")
    if latest is None:
        return
    w = torch.zeros(ROWS * 2, COLS)
    b = torch.zeros(4096)
    try:
        got = nostall.load({"w": w, "b": b, "meta": None}, dest.step_path(latest), storage_options=so)
    except nostall.CheckpointError as e:
        trial.problems.append(f"latest step {latest} does not load: {e}")
        return
    want_w, want_b = expected_full(latest, 2)
    if not (torch.equal(w, want_w) and torch.equal(b, want_b) and got["meta"] == {"step": latest}):
        trial.problems.append(f"latest step {latest} loads the wrong values (checkpoint lost)")


def run_trials(n: int, seed: int, dest: Optional[Dest] = None) -> Report:
    """Run ``n`` trials on one destination (a local temp dir unless given); returns the report."""
    rng = random.Random(seed)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "nostall.manager", "nostall.loading", __name__])
    t_all = time.monotonic()
    trials: List[Trial] = []
    with tempfile.TemporaryDirectory(prefix="nostall-crash-") as tmp:
        dest = dest or Dest(os.path.join(tmp, "run"))
        if not dest.remote:
            os.makedirs(dest.root, exist_ok=True)
        for i, (mode, target, detail, async_save, crash) in enumerate(_plan(n, rng, dest.remote)):
            trial = Trial(i, mode, target, detail, async_save, dest.latest_step())
            out_dir = os.path.join(tmp, f"trial{i}")
            os.makedirs(out_dir)
            start = trial.latest_before or 0
            crash_rank = None
            if crash is not None:
                step = start + rng.randint(1, STEPS_PER_JOB)
                if detail == "retain.moved" and start == 0:
                    step = max(step, 3)  # retention deletes something only from the third commit on
                crash = f"{crash}:{step}"
                trial.detail = f"{detail} at step {step}"
                crash_rank = int(target.split()[1])
            init_file = os.path.join(out_dir, "init")
            procs = [
                ctx.Process(target=_job_rank, args=(r, 2, init_file, dest, crash if r == crash_rank else None,
                                                    async_save, out_dir))
                for r in range(2)
            ]
            for p in procs:
                p.start()
            t0 = time.monotonic()
            if mode == "kill":
                delay = rng.uniform(0.02, 0.6)  # a job's saves take about 0.5-0.8 s here
                trial.detail = f"after {delay:.2f}s"
                time.sleep(delay)
                pids = _read_pids(out_dir, 2)
                if target == "job":
                    victims = [p.pid for p in procs] + [v["writer"] for v in pids.values() if v.get("writer")]
                else:
                    role, r = target.split()
                    victim = (pids.get(int(r)) or {}).get(role)
                    victims = [victim] if victim else []
                    if not victims:
                        trial.detail += " (not started yet: killed its trainer)"
                        victims = [procs[int(r)].pid]
                t_kill = time.monotonic()
                for v in victims:
                    if _alive(v):
                        os.kill(v, signal.SIGKILL)
                        trial.hit = True
                if not trial.hit:
                    trial.detail += " (missed: the job had finished)"
            # every survivor must return or raise within the bound: the library's timeout plus start-up
            bound = 3 * dest.timeout + 10
            for p in procs:
                p.join(max(0.0, bound - (time.monotonic() - t0)))
            trial.exit_s = time.monotonic() - t0
            if mode == "kill" and trial.hit:
                trial.after_kill_s = time.monotonic() - t_kill
            for p in procs:
                if p.is_alive():
                    trial.problems.append(f"hang: rank process {p.pid} still running after {bound:.0f}s")
                    p.kill()
                    p.join(10)
            trial.exit_codes = [p.exitcode for p in procs]
            if mode == "point":
                # a trainer's crash shows as -9; a writer's as the error it caused, or (after the commit
                # point) as the replacement writer the trainer had to start: its pid differs
                trial.hit = crash_rank is not None and (
                    trial.exit_codes[crash_rank] == -9 or 2 in trial.exit_codes
                    or _writer_replaced(out_dir, crash_rank))
            for r, code in enumerate(trial.exit_codes):
                if code == 1:
                    with open(os.path.join(out_dir, f"error{r}.txt")) as f:
                        trial.problems.append(f"rank {r} failed unexpectedly: {f.read()[-1500:]}")
            # a writer's watchdog looks every 0.1 s; on object storage a writer has been seen to take
            # longer than 0.3 s to go (see the closing note of 2026-12-01): allow 3 s, then it is a problem
            until = time.monotonic() + 3.0
            while time.monotonic() < until and any(
                    v.get("writer") and _alive(v["writer"]) for v in _read_pids(out_dir, 2).values()):
                time.sleep(0.05)
            for r, v in _read_pids(out_dir, 2).items():
                if v.get("writer") and _alive(v["writer"]):
                    trial.problems.append(f"writer {v['writer']} of rank {r} outlived its trainer")
                    os.kill(v["writer"], signal.SIGKILL)
            _check_root(dest, trial)
            trials.append(trial)
        if not dest.remote:  # a final clean start removes every leftover
            nostall.CheckpointManager(dest.root).close()
            left = [n for n in os.listdir(os.path.join(dest.root, ".tmp")) if n != ".lock"]
            if left:
                trials[-1].problems.append(f"leftovers not cleaned by a new manager: {left}")
    return Report(trials, seed, time.monotonic() - t_all, dest.timeout)
