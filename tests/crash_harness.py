"""Crash-consistency trials: a 2-rank checkpointing job killed at many points, then checked.

One *run* is a sequence of *trials* on one checkpoint root, as a real job
restarted after each failure would be. Each trial starts a fresh 2-rank job
(gloo, processes forked from a server that has torch and nostall imported, so
a start costs milliseconds). The job resumes from the latest checkpoint,
checks the state it loads, and then saves a few steps, asynchronously or
synchronously. During that, one participant is killed with SIGKILL:

* ``point``: a trainer or writer process kills itself at an exact phase of a
  save (``NOSTALL_TEST_CRASH``, see ``nostall/core/faults.py``);
* ``kill``: the harness kills a trainer, a writer, or the whole job after a
  random delay.

No verdict depends on how fast the machine is. A kill's delay counts from
the moment both ranks are up (their managers made), and it is a random
fraction of how long this machine takes to run a job's saves (measured on
an uncrashed calibration job first, then on every job that finished them).
A job that finishes its saves before the kill waits at a gate until the
harness has killed: a kill always hits a running job (``hit``), mid-save
(``mid_save``) in most trials. A point trial's ``hit`` is evidence that the
crash happened: the trainer's SIGKILL status, or its writer gone (or
replaced) while the trainer lived.

After the job is gone, the harness checks:

* no process hangs: every survivor exits within the bound;
* no writer outlives its trainer;
* ``latest_step()`` never goes back, and it names a checkpoint that loads and
  is bit-exact against the state of that step;
* every listed checkpoint verifies, and no ``step_*`` directory lacks its
  manifest;
* the checkpoint ``latest_step()`` names loads bit-exactly (the state of its
  step; in incremental mode every committed one does), and ``latest`` names
  a committed one;
* nothing the job saw committed is lost: ``latest_step()`` is at least the
  last step whose commit the job learnt (its ``on_commit``);
* every file of an earlier checkpoint that a committed manifest reads
  (``references``) is there with its size.

The next trial's start cleans the leftovers in ``.tmp``.

**Incremental mode** (``Dest(incremental=True, full_every=N)``): the jobs save
with ``incremental=True``; their state has a frozen part (most of the bytes,
the same at every step) beside the changing one, so each job's first save is
full and its later ones reference it (a crash point hits one of those);
``keep_last=2`` then retires that first
checkpoint (its manifest renamed ``.retired-<id>.json``, its files kept) while
later ones still read it. Every other trial's job starts a fresh chain every
``N`` saves (``full_every``), so retired files stop being read and are
collected within the job; otherwise the next job's saves do that. After the
trials, an uncrashed job runs, and then no retired file or manifest may be
left that no committed checkpoint reads.
"""

from __future__ import annotations

import dataclasses
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
from tests.dist_harness import process_alive

TIMEOUT_S = 3.0  # the jobs' CheckpointManager timeout (every wait in the library is bounded by it)
ROWS, COLS = 256, 1024  # per rank: 1 MiB of float32 (sharded) + a replicated vector
INC_ROWS = 32  # incremental mode: rows of the changing shard per rank (the frozen one has ROWS: 8x the bytes)
STEPS_PER_JOB = 5  # saves per job (a Dest may set fewer; retention at keep_last=2 needs 3)
TRAINER_POINTS = ("planned", "staged")
WRITER_POINTS = ("write.start", "write.done")
COMMIT_POINTS = ("commit.ready", "commit.manifest", "commit.renamed", "retain.moved")
# synchronous saves: the trainer itself writes and (rank 0) commits
SYNC_POINTS = ("write.done",)
# object storage: rank 0's writer uploads the manifest between commit.ready and commit.renamed
REMOTE_WRITER_POINTS = ("write.start", "upload.done", "write.done")
REMOTE_COMMIT_POINTS = ("commit.ready", "commit.renamed", "retain.moved")
GATE_S = 60.0  # longest a job that finished its saves waits for the harness's kill (a bound, never reached)
# How long after its trainer a writer may still be seen (the trials' writer_gone_s). Measured beside 2
# CPU burners: up to 1.07 s. Not the watchdog: a writer sees its trainer's socket close (EOF), returns
# from main() into a normal interpreter exit -- atexit, then finalizing every module, in a niced process
# -- during which its daemon watchdog is frozen; and a trainer may die while its writer is still
# importing, before any watchdog runs. The writer now exits by os._exit() on EOF/stop and its watchdog
# starts before the imports (writer.py, background.py): the slowest measured was 0.10 s. The bound is
# one only a hang breaks (a writer left running): the wait ends as soon as every writer is gone, and the
# time it took is reported (writer_gone_s), not judged, so that no verdict depends on the machine's speed.
WRITER_GONE_S = 30.0


def point_label(role: str, point: str, async_save: bool) -> str:
    """What a point trial covers: ``"writer write.start"``, ``"trainer commit.ready (sync)"``..."""
    return f"{role} {point}" + ("" if async_save else " (sync)")


def expected_points(remote: bool, n: Optional[int] = None) -> List[str]:
    """The label of every crash point a run of ``n`` trials covers (one point trial each, first)."""
    return [point_label(t.split()[0], p, a) for _, t, p, a, _ in _point_plans(remote)[:n]]


@dataclass
class Dest:
    """Where the trials save: a local root, or a URL on object storage with its fsspec options."""

    root: str
    storage_options: Optional[Dict[str, Any]] = None
    timeout: float = TIMEOUT_S
    steps_per_job: int = STEPS_PER_JOB  # each job saves this many steps; a crash point hits one of them
    incremental: bool = False  # the jobs save incrementally, their state mostly frozen
    full_every: Optional[int] = None  # incremental: every other trial's job starts a fresh chain every N saves

    @property
    def remote(self) -> bool:
        return "://" in self.root

    def _open(self) -> Any:
        from nostall.storage.locate import open_root

        return open_root(self.root, storage_options=self.storage_options, timeout=self.timeout)

    def latest_step(self) -> Optional[int]:
        return self._open().latest_step()

    def committed_steps(self) -> List[int]:
        return self._open().steps()

    def step_path(self, step: int) -> str:
        from nostall.storage.root import step_name

        return self._open().path(step_name(step))

    def beside(self, suffix: str) -> "Dest":
        """Another root of the same kind next to this one (the calibration job's)."""
        return dataclasses.replace(self, root=self.root.rstrip("/") + suffix)


# --------------------------------------------------------------------------- the job (child side)


def state_for(step: int, rank: int, world: int, incremental: bool = False) -> Dict[str, Any]:
    """The state of ``step``; ``incremental``: a smaller changing shard beside a frozen one (most of the bytes)."""
    import torch

    rows = INC_ROWS if incremental else ROWS
    shard = torch.arange(rows * COLS, dtype=torch.float32).reshape(rows, COLS) + step * 1000.0 + rank * 0.5
    st = {
        "w": nostall.ShardedTensor(shard, (rows * world, COLS), (rows * rank, 0)),
        "b": torch.full((4096,), float(step)),
        "meta": {"step": step},
        "rng": nostall.PerRank(torch.full((16,), (step * 10 + rank) % 256, dtype=torch.uint8)),
    }
    if incremental:  # the same bytes at every step: saved once per chain, then referenced
        frozen = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.25 - rank
        st["frozen"] = nostall.ShardedTensor(frozen, (ROWS * world, COLS), (ROWS * rank, 0))
    return st


def expected_full(step: int, world: int, incremental: bool = False) -> Dict[str, Any]:
    """The tensors of ``step`` as a single process loads them (sharded ones whole)."""
    import torch

    states = [state_for(step, r, world, incremental) for r in range(world)]
    out = {"w": torch.cat([s["w"].data for s in states]), "b": torch.full((4096,), float(step))}
    if incremental:
        out["frozen"] = torch.cat([s["frozen"].data for s in states])
    return out


def _mark(out_dir: str, name: str, **fields: Any) -> None:
    """A marker file for the harness (written whole, then renamed: never seen half-written)."""
    tmp = os.path.join(out_dir, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(dict(fields, t=time.monotonic()), f)
    os.replace(tmp, os.path.join(out_dir, name))


def _read_mark(out_dir: str, name: str) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(out_dir, name)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def _job_rank(rank: int, world: int, init_file: str, dest: Dest, crash: Optional[str], async_save: bool,
              out_dir: str, gate: bool = False, full_every: Optional[int] = None) -> None:
    """One rank of a job. Markers for the harness: ``pids<rank>.json`` once the manager is made,
    ``committed<rank>.json`` (the step) each time a save's commit is learnt, ``saved<rank>`` once its
    saves are done; with ``gate`` it then waits for ``release``."""
    code = 0
    first_writer: Optional[int] = None
    first_proc: Any = None
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
                                        local_staging_dir=os.path.join(out_dir, f"local{rank}"),
                                        incremental=dest.incremental, full_every=full_every,
                                        on_commit=lambda h: _mark(out_dir, f"committed{rank}.json", step=h.step))
        first_writer = mgr.writer_pid
        # the writer's process handle (the manager's own) tells how it ended: -9 is a crash point's SIGKILL
        first_proc = getattr(getattr(mgr, "_writer", None), "proc", None)
        _mark(out_dir, f"pids{rank}.json", trainer=os.getpid(), writer=first_writer)
        start = mgr.latest_step() or 0
        if start:
            tmpl = state_for(0, rank, world, dest.incremental)
            if dest.incremental:
                tmpl["frozen"].data.zero_()
            got = mgr.load(tmpl)
            want = state_for(start, rank, world, dest.incremental)
            if not (torch.equal(tmpl["w"].data, want["w"].data) and got["meta"] == {"step": start}
                    and torch.equal(got["rng"], want["rng"].value)
                    and (not dest.incremental or torch.equal(tmpl["frozen"].data, want["frozen"].data))):
                raise AssertionError(f"rank {rank}: resumed state of step {start} is wrong")
        for step in range(start + 1, start + dest.steps_per_job + 1):
            st = state_for(step, rank, world, dest.incremental)
            mgr.save(step, st)
            st["w"].data.fill_(-1.0)  # "training" changes the state right after save() returns
            time.sleep(0.03)
        _writer_fate(out_dir, rank, first_writer, first_proc, mgr.writer_pid)
        _mark(out_dir, f"saved{rank}")
        if gate:  # the harness kills this job: it must not end before that
            until = time.monotonic() + GATE_S
            while not os.path.exists(os.path.join(out_dir, "release")) and time.monotonic() < until:
                time.sleep(0.005)
        mgr.close()
        _writer_fate(out_dir, rank, first_writer, first_proc, None)  # a crash while close() drained it
        dist.destroy_process_group()
    except nostall.CheckpointError as e:  # a peer died: the expected outcome for survivors
        code = 2
        _writer_fate(out_dir, rank, first_writer, first_proc, None)
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(str(e))
    except BaseException:
        code = 1
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    os._exit(code)


def _writer_fate(out_dir: str, rank: int, first: Optional[int], proc: Any, now: Optional[int]) -> None:
    """Record, from the trainer (alive), whether its first writer was replaced or died of a SIGKILL."""
    if first is None or os.path.exists(os.path.join(out_dir, f"writer-gone{rank}")):
        return
    if now is not None and now != first:
        fate = "replaced"
    elif proc is not None and getattr(proc, "pid", None) == first:
        fate = "killed" if proc.poll() == -signal.SIGKILL else ""
    else:  # no handle (the manager changed): a writer gone while its trainer lives
        fate = "" if now is None or process_alive(first) else "gone"
    if fate:
        with open(os.path.join(out_dir, f"writer-gone{rank}"), "w") as f:
            f.write(fate)


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
    mid_save: bool = False  # kill trials: the victim's rank had not finished its saves
    label: str = ""  # point trials: what the trial covers (see point_label)
    writer_gone_s: Optional[float] = None  # from the last trainer's exit to the last writer's
    full_every: Optional[int] = None  # incremental mode: the job's full_every
    seen_committed: Optional[int] = None  # the last step whose commit the job learnt (its on_commit)
    references: int = 0  # incremental mode: references to earlier checkpoints' files in the committed manifests
    retired: int = 0  # incremental mode: retired manifests in the root after the trial
    check_s: float = 0.0  # how long the checks after the trial took
    errors: List[str] = field(default_factory=list)  # the survivors' CheckpointError (expected), shortened
    problems: List[str] = field(default_factory=list)


@dataclass
class Report:
    trials: List[Trial]
    seed: int
    seconds: float
    timeout: float = TIMEOUT_S
    save_span_s: float = 0.0  # how long this machine took for a job's saves (the kills' time scale)
    incremental: bool = False
    final: Optional[Trial] = None  # incremental mode: the uncrashed job after the trials, and the leftover check

    @property
    def failures(self) -> List[Trial]:
        return [t for t in self.trials + ([self.final] if self.final else []) if t.problems]

    def summary(self) -> str:
        by: Dict[str, int] = {}
        for t in self.trials:
            key = f"{t.mode} {t.target.split()[0]}"
            by[key] = by.get(key, 0) + 1
        hits = sum(1 for t in self.trials if t.hit)
        advanced = sum(1 for t in self.trials if (t.latest_after or 0) > (t.latest_before or 0))
        lost = sum(1 for t in self.trials if any("lost" in p or "load" in p for p in t.problems))
        missing = sum(1 for t in self.trials if any("referenced file" in p for p in t.problems))
        hangs = sum(1 for t in self.trials if any("hang" in p for p in t.problems))
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(by.items()))
        waits = [t.after_kill_s for t in self.trials if t.after_kill_s is not None]
        slowest = f"{max(waits):.1f}s" if waits else "n/a"
        kills = [t for t in self.trials if t.mode == "kill"]
        gone = [t.writer_gone_s for t in self.trials if t.writer_gone_s is not None]
        gone_s = f"{max(gone):.2f}s" if gone else "n/a"
        inc = ""
        if self.incremental:
            refs = [t.references for t in self.trials]
            inc = (f"incremental: references in committed manifests after {sum(r > 0 for r in refs)} trials "
                   f"(up to {max(refs, default=0)}), a retired checkpoint kept for its readers after "
                   f"{sum(t.retired > 0 for t in self.trials)}; referenced files missing: {missing}; "
                   f"final uncrashed job: {'; '.join(self.final.problems) if self.final else 'not run'}"
                   f"{'' if self.final is None or self.final.problems else 'no unreferenced retired file left'}; ")
        return (
            f"crash trials{' (incremental)' if self.incremental else ''}: {len(self.trials)} in "
            f"{self.seconds:.0f}s (seed {self.seed}; {kinds}); "
            f"a process was killed mid-job in {hits}; kills mid-save: {sum(t.mid_save for t in kills)} of "
            f"{len(kills)} (saves take {self.save_span_s:.2f}s here); "
            f"a new checkpoint committed in {advanced}; checkpoints lost: {lost}; hangs: {hangs}; "
            f"slowest exit after a kill: {slowest} (manager timeout {self.timeout:g}s); "
            f"slowest writer exit after its trainer: {gone_s}; {inc}"
            f"trials with problems: {len(self.failures)}"
        )

    def as_json(self) -> str:
        return json.dumps({"seed": self.seed, "seconds": self.seconds, "save_span_s": self.save_span_s,
                           "incremental": self.incremental, "trials": [asdict(t) for t in self.trials],
                           "final": asdict(self.final) if self.final else None}, indent=1)


Plan = Tuple[str, str, str, bool, Optional[str]]


def _point_plans(remote: bool) -> List[Plan]:
    plans: List[Plan] = []
    writer_points, commit_points = (REMOTE_WRITER_POINTS, REMOTE_COMMIT_POINTS) if remote else (
        WRITER_POINTS, COMMIT_POINTS)
    for rank in (0, 1):
        for p in TRAINER_POINTS:
            plans.append(("point", f"trainer {rank}", p, True, f"trainer:{p}"))
        for p in writer_points:
            plans.append(("point", f"writer {rank}", p, True, f"writer:{p}"))
    for p in commit_points:
        plans.append(("point", "writer 0", p, True, f"writer:{p}"))
    for p in SYNC_POINTS + commit_points:  # synchronous saves: the trainer writes, rank 0's commits
        plans.append(("point", "trainer 0", p, False, f"trainer:{p}"))
    return plans


def _plan(n: int, rng: random.Random, remote: bool) -> List[Plan]:
    """(mode, target, detail, async_save, crash spec template) for n trials: every crash point once, then random."""
    plans = _point_plans(remote)[:n]
    targets = ["trainer 0", "trainer 1", "writer 0", "writer 1", "job"]
    while len(plans) < n:
        plans.append(("kill", rng.choice(targets), "", rng.random() < 0.85, None))
    return plans


def _start_job(ctx: Any, dest: Dest, out_dir: str, crash: Optional[str], crash_rank: Optional[int],
               async_save: bool, gate: bool, full_every: Optional[int] = None) -> List[Any]:
    init_file = os.path.join(out_dir, "init")
    procs = [ctx.Process(target=_job_rank, args=(r, 2, init_file, dest, crash if r == crash_rank else None,
                                                 async_save, out_dir, gate, full_every))
             for r in range(2)]
    for p in procs:
        p.start()
    return procs


def _save_span(out_dir: str) -> Optional[float]:
    """How long the job in ``out_dir`` took from both ranks up to both ranks' saves done (None: unfinished)."""
    marks = [_read_mark(out_dir, f"{name}{r}" + (".json" if name == "pids" else ""))
             for name in ("pids", "saved") for r in (0, 1)]
    if any(m is None for m in marks):
        return None
    return max(m["t"] for m in marks[2:]) - max(m["t"] for m in marks[:2])


def _calibrate(ctx: Any, dest: Dest, tmp: str, warm: bool = False) -> float:
    """Run two uncrashed jobs (on a root of their own) and return how long the second one's saves
    took (the first one pays for warming up); one job when ``warm`` (jobs ran here already)."""
    cal = dest.beside("-calibration") if dest.remote else dataclasses.replace(
        dest, root=os.path.join(tmp, "calibration-run"))
    if not cal.remote:
        os.makedirs(cal.root)
    span = None
    for i in range(1 if warm else 2):
        out_dir = os.path.join(tmp, f"calibration{i}")
        os.makedirs(out_dir)
        procs = _start_job(ctx, cal, out_dir, None, None, True, False)
        for p in procs:
            p.join(3 * dest.timeout + 60)
            if p.is_alive():
                p.kill()
                p.join(10)
        span = _save_span(out_dir)
        if span is None or any(p.exitcode != 0 for p in procs):
            errors = [open(os.path.join(out_dir, n)).read()[-1500:] for n in sorted(os.listdir(out_dir))
                      if n.startswith("error")]
            raise RuntimeError(f"a calibration job failed (exit codes {[p.exitcode for p in procs]}): {errors}")
    assert span is not None
    return span




def _read_pids(out_dir: str, world: int) -> Dict[int, Dict[str, Any]]:
    pids = {}
    for r in range(world):
        m = _read_mark(out_dir, f"pids{r}.json")
        if m is not None:
            pids[r] = m
    return pids


def _stored(dest: Dest) -> Tuple[Dict[str, int], List[str]]:
    """Every file under the root's ``step_*`` entries (``step_N/<path>`` -> size), and the empty
    ``step_*`` directories (a local root's)."""
    files: Dict[str, int] = {}
    empty: List[str] = []
    if not dest.remote:
        for name in sorted(os.listdir(dest.root)):
            top = os.path.join(dest.root, name)
            if not name.startswith("step_") or not os.path.isdir(top):
                continue
            found = False
            for d, _, names in os.walk(top):
                for n in names:
                    path = os.path.join(d, n)
                    files[os.path.relpath(path, dest.root)] = os.lstat(path).st_size
                    found = True
            if not found:
                empty.append(name)
        return files, empty
    fs, key = dest._open()._fs()
    fs.invalidate_cache()
    base = key.rstrip("/") + "/"
    for path, info in fs.find(base, detail=True).items():
        rel = str(path)[len(base):] if str(path).startswith(base) else str(path)
        if rel.startswith("step_"):
            files[rel] = int(info.get("size") or 0)
    return files, empty


def _is_retired(rel: str) -> bool:
    """``step_N/.retired-<id>.json``: a retired manifest."""
    n = rel.partition("/")[2]
    return n.startswith(".retired-") and n.endswith(".json") and "/" not in n


def _read_stored(dest: Dest, rel: str) -> bytes:
    if not dest.remote:
        with open(os.path.join(dest.root, rel), "rb") as f:
            return f.read()
    fs, key = dest._open()._fs()
    return fs.cat_file(key.rstrip("/") + "/" + rel)


def _check_root(dest: Dest, trial: Trial, out_dir: Optional[str] = None) -> None:
    import torch

    from nostall.core.format import Manifest
    from nostall.loading.verify import check_checkpoint
    from nostall.storage.root import step_name

    so = dest.storage_options
    root = dest._open()
    latest = root.latest_step()
    steps = root.steps()
    trial.latest_after = latest
    if trial.latest_before is not None and (latest is None or latest < trial.latest_before):
        trial.problems.append(f"checkpoint lost: latest went from {trial.latest_before} to {latest}")
    if out_dir is not None:  # what the job itself learnt was committed is never lost
        seen = [m["step"] for m in (_read_mark(out_dir, f"committed{r}.json") for r in (0, 1)) if m]
        trial.seen_committed = max(seen) if seen else None
        if seen and (latest is None or latest < max(seen)):
            trial.problems.append(f"checkpoint lost: the job saw step {max(seen)} committed, latest is {latest}")
    pointed = root.read_latest()
    if pointed is not None and pointed not in steps:
        trial.problems.append(f"latest names step {pointed}, which is not committed (committed: {steps})")
    files, empty = _stored(dest)
    if not dest.remote:  # on object storage a prefix without its manifest is simply not listed
        for name in os.listdir(dest.root):
            if name.startswith("step_") and not os.path.isfile(os.path.join(dest.root, name, "manifest.json")) \
                    and name not in empty and not any(_is_retired(r) for r in files if r.startswith(name + "/")):
                # (a retired checkpoint keeps the files others read, beside its retired manifest; so does one
                # whose retention a crash cut short, until the next claim or retention finishes it)
                trial.problems.append(f"{name} is listed without a manifest")
    live: Dict[str, int] = {}  # what committed checkpoints read from earlier ones
    trial.references = 0
    for s in steps:
        try:
            rep = check_checkpoint(dest.step_path(s), so)
        except nostall.CheckpointError as e:
            trial.problems.append(f"step {s} does not verify (checkpoint lost): {e}")
            continue
        if rep.problems:
            trial.problems.append(f"step {s} does not verify (checkpoint lost): {rep.problems}")
        m = root.manifest(step_name(s))
        if m is None:
            trial.problems.append(f"step {s}: its manifest does not parse (checkpoint lost)")
            continue
        trial.references += len(m.references)
        for ref, rec in m.references.items():
            live[ref] = rec.size
            if not dest.incremental:
                trial.problems.append(f"step {s} reads {ref}, but the saves are not incremental")
            elif files.get(ref) != rec.size:
                got = "missing" if ref not in files else f"{files[ref]} bytes"
                trial.problems.append(f"step {s} reads referenced file {ref} ({rec.size} bytes): {got}")
        if s != latest and not dest.incremental:
            continue  # (full saves: each verifies on its own; the latest one is loaded)
        want = expected_full(s, 2, dest.incremental)
        tmpl: Dict[str, Any] = {k: torch.zeros_like(v) for k, v in want.items()}
        tmpl["meta"] = None
        what = f"latest step {s}" if s == latest else f"step {s}"
        try:
            got = nostall.load(tmpl, dest.step_path(s), storage_options=so)
        except nostall.CheckpointError as e:
            trial.problems.append(f"{what} does not load: {e}")
            continue
        if not (all(torch.equal(tmpl[k], v) for k, v in want.items()) and got["meta"] == {"step": s}):
            trial.problems.append(f"{what} loads the wrong values (checkpoint lost)")
    if dest.incremental:
        trial.retired = 0
        for rel in files:
            if _is_retired(rel):
                trial.retired += 1
                try:
                    Manifest.from_json_bytes(_read_stored(dest, rel), rel)
                except (nostall.CheckpointError, OSError) as e:
                    trial.problems.append(f"retired manifest {rel} does not parse: {e}")


def _unreferenced_leftovers(dest: Dest) -> List[str]:
    """Incremental mode, after an uncrashed job: what under ``step_*`` no committed checkpoint needs --
    a file that is neither its own checkpoint's nor read by a committed one, a retired manifest none of
    whose files is read."""
    from nostall.core.format import Manifest
    from nostall.storage.root import step_name

    root = dest._open()
    files, empty = _stored(dest)
    own: set = set()
    live: set = set()
    for s in root.steps():
        m = root.manifest(step_name(s))
        if m is None:
            return [f"step {s}: its manifest does not parse"]
        own.add(f"{step_name(s)}/manifest.json")
        own.update(f"{step_name(s)}/{f}" for f in list(m.files) + [f.file for f in m.side_files.values()])
        live.update(m.references)
    out = [f"{name}/ (empty)" for name in empty]
    for rel in sorted(files):
        if rel in own or rel in live:
            continue
        d = rel.partition("/")[0]
        if _is_retired(rel):
            m = Manifest.from_json_bytes(_read_stored(dest, rel), rel)
            read = [f for f in list(m.files) + [f.file for f in m.side_files.values()] if f"{d}/{f}" in live]
            if read:
                continue
            out.append(f"{rel} (retired; none of its files is read: {sorted(m.files)})")
        else:
            out.append(f"{rel} ({files[rel]} bytes, read by no committed checkpoint)")
    return out


def run_trials(n: int, seed: int, dest: Optional[Dest] = None) -> Report:
    """Run ``n`` trials on one destination (a local temp dir unless given); returns the report."""
    rng = random.Random(seed)
    if dest is not None and dest.steps_per_job < 3:
        raise ValueError("retain.moved needs 3 saves per job (keep_last=2)")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "nostall.manager", "nostall.loading.reader", __name__])
    t_all = time.monotonic()
    trials: List[Trial] = []
    with tempfile.TemporaryDirectory(prefix="nostall-crash-") as tmp:
        dest = dest or Dest(os.path.join(tmp, "run"))
        if not dest.remote:
            os.makedirs(dest.root, exist_ok=True)
        # the kills' time scale: measured before the first kill trial (after the point trials, which
        # warmed everything up, one calibration job is enough), then on every kill trial's job
        spans: List[float] = []
        for i, (mode, target, detail, async_save, crash) in enumerate(_plan(n, rng, dest.remote)):
            trial = Trial(i, mode, target, detail, async_save, dest.latest_step())
            if dest.incremental and i % 2:
                trial.full_every = dest.full_every
            out_dir = os.path.join(tmp, f"trial{i}")
            os.makedirs(out_dir)
            start = trial.latest_before or 0
            crash_rank = None
            if crash is not None:
                # incremental: a save after the job's first (full) one, which references it
                step = start + rng.randint(2 if dest.incremental else 1, dest.steps_per_job)
                if detail == "retain.moved":
                    # retention (keep_last=2) deletes step start+1 while saving start+3, and start+3 while
                    # saving start+5: this point is reached whether it names the step saved or the one deleted
                    step = start + 3
                crash = f"{crash}:{step}"
                trial.detail = f"{detail} at step {step}"
                crash_rank = int(target.split()[1])
                trial.label = point_label(target.split()[0], detail, async_save)
            # every survivor must return or raise within the bound: the library's timeout plus start-up
            bound = 3 * dest.timeout + 10
            if mode == "kill" and not spans:
                spans.append(_calibrate(ctx, dest, tmp, warm=i > 0))
            span = sorted(spans)[len(spans) // 2] if spans else 0.0
            procs = _start_job(ctx, dest, out_dir, crash, crash_rank, async_save, gate=mode == "kill",
                               full_every=trial.full_every)
            t0 = time.monotonic()
            if mode == "kill":
                # from both ranks up (a kill during the process group's set-up is gloo's business, not
                # ours), a random part of the time this machine takes for the saves; a job done with its
                # saves waits at the gate, so the kill always hits a running job
                frac = rng.uniform(0.02, 1.0)
                while (len(_read_pids(out_dir, 2)) < 2 and all(p.is_alive() for p in procs)
                       and time.monotonic() - t0 < bound):
                    time.sleep(0.005)
                time.sleep(frac * span)
                trial.detail = f"after {frac * span:.2f}s ({frac:.2f} of the saves' {span:.2f}s)"
                pids = _read_pids(out_dir, 2)
                if target == "job":
                    victims = [p.pid for p in procs] + [v["writer"] for v in pids.values() if v.get("writer")]
                    trial.mid_save = any(_read_mark(out_dir, f"saved{r}") is None for r in (0, 1))
                else:
                    role, r = target.split()
                    victim = (pids.get(int(r)) or {}).get(role)
                    victims = [victim] if victim else [procs[int(r)].pid]
                    if not victim:
                        trial.detail += f" (no {role}: killed the trainer)"
                    trial.mid_save = _read_mark(out_dir, f"saved{r}") is None
                t_kill = time.monotonic()
                for v in victims:
                    if process_alive(v):
                        os.kill(v, signal.SIGKILL)
                        trial.hit = True
                with open(os.path.join(out_dir, "release"), "w"):
                    pass
                if not trial.hit:
                    trial.detail += " (missed: the job had ended before it was up)"
            for p in procs:
                p.join(max(0.0, bound - (time.monotonic() - t0)))
            t_trainers = time.monotonic()
            trial.exit_s = t_trainers - t0
            if mode == "kill" and trial.hit:
                trial.after_kill_s = time.monotonic() - t_kill
            for p in procs:
                if p.is_alive():
                    trial.problems.append(f"hang: rank process {p.pid} still running after {bound:.0f}s")
                    p.kill()
                    p.join(10)
            trial.exit_codes = [p.exitcode for p in procs]
            if mode == "point":
                # a trainer's crash shows as -9; a writer's as its trainer seeing it gone (or replaced)
                # while the trainer lived, or as the error it caused
                trial.hit = crash_rank is not None and (
                    trial.exit_codes[crash_rank] == -9 if target.startswith("trainer")
                    else os.path.exists(os.path.join(out_dir, f"writer-gone{crash_rank}"))
                    or 2 in trial.exit_codes)
            else:
                s = _save_span(out_dir)
                if s is not None:
                    spans.append(s)
            for r, code in enumerate(trial.exit_codes):
                if code == 1:
                    with open(os.path.join(out_dir, f"error{r}.txt")) as f:
                        trial.problems.append(f"rank {r} failed unexpectedly: {f.read()[-1500:]}")
            # a writer's watchdog looks every 0.1 s: a writer still there WRITER_GONE_S after its trainer hangs
            until = t_trainers + WRITER_GONE_S
            while time.monotonic() < until and any(
                    v.get("writer") and process_alive(v["writer"]) for v in _read_pids(out_dir, 2).values()):
                time.sleep(0.01)
            if not any(v.get("writer") and process_alive(v["writer"]) for v in _read_pids(out_dir, 2).values()):
                trial.writer_gone_s = time.monotonic() - t_trainers
            for r, v in _read_pids(out_dir, 2).items():
                if v.get("writer") and process_alive(v["writer"]):
                    trial.problems.append(f"writer {v['writer']} of rank {r} outlived its trainer")
                    os.kill(v["writer"], signal.SIGKILL)
            for r, code in enumerate(trial.exit_codes):
                if code == 2:
                    with open(os.path.join(out_dir, f"error{r}.txt")) as f:
                        trial.errors.append(f"rank {r}: {f.read()[:300]}")
            t_check = time.monotonic()
            _check_root(dest, trial, out_dir)
            trial.check_s = time.monotonic() - t_check
            trials.append(trial)
        final = _final_job(ctx, dest, tmp, len(trials)) if dest.incremental else None
        if not dest.remote:  # a final clean start removes every leftover
            nostall.CheckpointManager(dest.root).close()
            retired = {r.rpartition("/.retired-")[2][:-len(".json")] for r in _stored(dest)[0] if _is_retired(r)}
            left = [n for n in os.listdir(os.path.join(dest.root, ".tmp")) if n != ".lock"
                    and not (n.startswith("retired-") and n[len("retired-"):-len(".nostall")] in retired)]
            if left:
                trials[-1].problems.append(f"leftovers not cleaned by a new manager: {left}")
    return Report(trials, seed, time.monotonic() - t_all, dest.timeout,
                  sorted(spans)[len(spans) // 2] if spans else 0.0, dest.incremental, final)


def _final_job(ctx: Any, dest: Dest, tmp: str, index: int) -> Trial:
    """Incremental mode, after the trials: an uncrashed job (its retention collects what the crashed ones
    left retired), then the root must hold nothing that no committed checkpoint needs."""
    trial = Trial(index, "final", "job", "uncrashed, then no unreferenced retired file", True, dest.latest_step())
    out_dir = os.path.join(tmp, "final")
    os.makedirs(out_dir)
    procs = _start_job(ctx, dest, out_dir, None, None, True, False)
    for p in procs:
        p.join(3 * dest.timeout + 60)
        if p.is_alive():
            trial.problems.append(f"hang: rank process {p.pid} of the final job")
            p.kill()
            p.join(10)
    trial.exit_codes = [p.exitcode for p in procs]
    for r, code in enumerate(trial.exit_codes):
        if code != 0:
            err = os.path.join(out_dir, f"error{r}.txt")
            trial.problems.append(f"rank {r} of the final job exited with {code}: "
                                  f"{open(err).read()[-1500:] if os.path.exists(err) else ''}")
    _check_root(dest, trial, out_dir)
    if not trial.problems and trial.latest_after != (trial.latest_before or 0) + dest.steps_per_job:
        trial.problems.append(f"the final job saved up to step {trial.latest_after}, not "
                              f"{(trial.latest_before or 0) + dest.steps_per_job}")
    left = _unreferenced_leftovers(dest)
    if left:
        trial.problems.append(f"left after the final job's retention, read by no committed checkpoint: {left}")
    return trial
