"""``nostall bench``'s restore section: restore after a trainer crash, per tier, beside DCP's load of the same state.

Two halves (docs/benchmarks.md, "Restore per tier"):

* :func:`leave_snapshots`, in the bench's ranks once their other phases are
  done: a manager with ``memory_tier=MemoryTier(persist_every=PERSIST)`` saves
  the rank's state to the persistent root (step ``PERSIST``) and to the memory
  tier (step ``PERSIST + 1``), ``dcp.save`` saves the same state, and the
  manager is left as a crashed trainer leaves it (an exception unwinds through
  its ``with``: the holder keeps the memory snapshot);
* :func:`run_restore`: fresh rank processes, as a restarted trainer. Their
  start-up (interpreter and torch, the gloo group, the manager attaching to the
  holder) is timed apart; then ``load()`` restores the freshest tier (the memory
  step, the process's first load), then, ``rounds`` times each, interleaved: the
  memory restore again, the persistent checkpoint of the same bytes
  (``load(path=...)``), DCP's load of its checkpoint, and a memcpy of the rank's
  bytes into the same tensors (the floor). Every load is checked equal to the
  saved state, byte for byte, outside the timers. Per rank: the bytes the
  memory restore read from the persistent root (``mgr.last_restore``) and the
  bytes every load's read calls returned (``rchar``).

The memory tier lives in a directory of the bench's own (:class:`~.common.MemoryDir`),
released by the restarted managers' ``close()`` and removed after the run.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict, List, Optional

from nostall.tools.bench.common import gather_ranks, local_tensors, median, read_chars, serve_rank, zero_template

PERSIST = 1000
"""``MemoryTier.persist_every`` of the section: step 1000 goes to the persistent root, 1001 to memory."""
IDLE_S = 300.0
"""``MemoryTier.idle_s``: how long the holder keeps the snapshot for the restarted ranks (they attach within
seconds; the bench's :class:`~.common.MemoryDir` stops it at the end in any case)."""
SYSTEMS = ("memory_first", "memory", "persistent", "dcp", "memcpy")
"""The rows: the first restore of the fresh process (memory tier), then the rounds."""


class _Crash(Exception):
    """Raised inside the manager's ``with`` by :func:`leave_snapshots`: the manager closes as a crashed trainer's
    (its memory snapshots stay with the holder)."""


def _dirs(root: str) -> Dict[str, str]:
    base = os.path.join(root, "restore")
    return {"run": os.path.join(base, "run"), "dcp": os.path.join(base, "dcp")}


def _tier(memory_dir: str) -> Any:
    from nostall.options import MemoryTier

    return MemoryTier(persist_every=PERSIST, memory_dir=memory_dir, idle_s=IDLE_S)


def leave_snapshots(nostall: Any, dcp: Any, state: Dict[str, Any], root: str, memory_dir: str) -> float:
    """In a rank of ``nostall bench`` (collective): the persistent and memory checkpoints of ``state`` and DCP's,
    the manager left as a crashed trainer's (the holder keeps the memory snapshot for :func:`run_restore`).
    Returns the seconds it took (the section's cost, not a figure of it)."""
    t0 = time.perf_counter()
    d = _dirs(root)
    try:
        with nostall.CheckpointManager(d["run"], async_save=True, memory_tier=_tier(memory_dir)) as mgr:
            for step in (PERSIST, PERSIST + 1):  # persistent, then memory: the same bytes
                mgr.save(step, state).result()
            raise _Crash()
    except _Crash:
        pass
    dcp.save(state, checkpoint_id=d["dcp"])
    return time.perf_counter() - t0


def _worker(rank: int, world: int, init: str, root: str, cfg: Dict[str, Any], q: Any) -> None:
    entered = time.time()  # torch is imported by now (the launcher's spawn wrapper is torch's)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"] or 1)))
    serve_rank(rank, world, init, q, lambda: _Restarted(rank, world, root, cfg, entered).main())


class _Restarted:
    """One rank of the restarted job: its start-up, then the timed loads."""

    def __init__(self, rank: int, world: int, root: str, cfg: Dict[str, Any], entered: float) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        import nostall
        from nostall.tools.bench.compare import make_state

        self.joined = time.time()  # the gloo group is up
        self.rank, self.cfg, self.torch, self.dist, self.dcp = rank, cfg, torch, dist, dcp
        self.dirs = _dirs(root)
        self.state, self.nbytes = make_state(rank, world, cfg["mb"])  # the same seeds: the saved bytes (untimed)
        self.source = local_tensors(self.state)
        self.template = zero_template(self.state)
        self.tensors = local_tensors(self.template)
        t0 = time.time()
        self.mgr = nostall.CheckpointManager(self.dirs["run"], async_save=True, memory_tier=_tier(cfg["memory_dir"]))
        ready = time.time()
        self.startup = {"process_s": entered - cfg["launched"], "group_s": self.joined - entered,
                        "manager_s": ready - t0}
        self.startup["total_s"] = sum(self.startup.values())
        self.problems: List[str] = []

    def _timed(self, name: str, load: Any) -> Dict[str, Optional[float]]:
        """One load into the zeroed template: its time and the bytes its read calls returned; checked equal."""
        for t in self.tensors:
            t.zero_()
        self.dist.barrier()
        r0 = read_chars()
        t0 = time.perf_counter()
        load()
        seconds = time.perf_counter() - t0
        r1 = read_chars()
        if not all(self.torch.equal(a, b) for a, b in zip(self.tensors, self.source)):
            self.problems.append(f"rank {self.rank}: {name}: the loaded tensors differ from the saved state")
        return {"s": seconds, "read_bytes": None if r0 is None or r1 is None else float(r1 - r0)}

    def _memcpy(self) -> float:
        self.dist.barrier()
        t0 = time.perf_counter()
        for a, b in zip(self.tensors, self.source):
            a.copy_(b)
        return time.perf_counter() - t0

    def _restored(self) -> Any:
        """How the manager's last freshest-tier ``load()`` went (``mgr.last_restore``)."""
        r = self.mgr.last_restore
        if r is None:
            raise RuntimeError(f"rank {self.rank}: load() reported no restore (mgr.last_restore is None)")
        return r

    def main(self) -> Dict[str, Any]:
        mgr, tmpl = self.mgr, self.template
        try:
            first = self._timed("memory_first", lambda: mgr.load(tmpl))
            r = self._restored()
            if r.tier != "memory":
                self.problems.append(f"rank {self.rank}: the first restore came from {r.tier}, not the memory tier "
                                     f"(fell back: {r.fell_back})")
            restored = {"tier": r.tier, "step": r.step, "persistent_bytes_read": r.persistent_bytes_read,
                        "fell_back": r.fell_back}
            times: Dict[str, List[float]] = {s: [] for s in SYSTEMS}
            reads: Dict[str, List[Optional[float]]] = {s: [] for s in SYSTEMS}
            times["memory_first"].append(float(first["s"] or 0.0))
            reads["memory_first"].append(first["read_bytes"])
            persistent = mgr.path_for(PERSIST)
            loads = {"memory": lambda: mgr.load(tmpl),  # the freshest tier again: the memory step
                     "persistent": lambda: mgr.load(tmpl, path=persistent),
                     "dcp": lambda: self.dcp.load(tmpl, checkpoint_id=self.dirs["dcp"])}
            for _ in range(self.cfg["rounds"]):
                for name, load in loads.items():
                    got = self._timed(name, load)
                    times[name].append(float(got["s"] or 0.0))
                    reads[name].append(got["read_bytes"])
                    if name == "memory" and self._restored().tier != "memory":
                        self.problems.append(f"rank {self.rank}: a restore came from {self._restored().tier}, "
                                            "not the memory tier")
                times["memcpy"].append(self._memcpy())
        finally:
            mgr.close()  # clean: releases the memory tier (its holder deletes it and exits)
        return {"bytes": self.nbytes, "startup": self.startup, "restored": restored, "seconds": times,
                "read_bytes": reads, "problems": self.problems}


def run_restore(ranks: int, root: str, mb: int, memory_dir: str, rounds: int, timeout: float) -> Dict[str, Any]:
    """The second half (launcher side): fresh rank processes restore what :func:`leave_snapshots` left; the
    section's figures (rank 0's times, every rank's bytes; ratios of the medians against the memcpy)."""
    cfg = {"mb": mb, "memory_dir": memory_dir, "rounds": max(1, rounds), "launched": time.time()}
    t0 = time.perf_counter()
    per_rank = gather_ranks(_worker, ranks, root, cfg, timeout, "restore")
    restart_s = time.perf_counter() - t0
    r0 = per_rank[0]
    secs = r0["seconds"]
    memcpy = median(secs["memcpy"])
    out: Dict[str, Any] = {
        "rounds": cfg["rounds"], "persist_every": PERSIST, "memory_dir": memory_dir,
        "restart_s": restart_s,  # the restarted processes, start to end (with leave_s: what the section costs)
        "startup_s": {k: statistics.median(per_rank[r]["startup"][k] for r in per_rank) for k in r0["startup"]},
        "seconds": secs,
        "over_memcpy": {s: median(secs[s]) / memcpy if memcpy > 0 else float("nan") for s in SYSTEMS},
        "over_dcp": {s: median(secs[s]) / median(secs["dcp"]) for s in ("memory_first", "memory", "persistent")},
        "restored": {str(r): per_rank[r]["restored"] for r in sorted(per_rank)},
        "read_bytes": {str(r): {s: median([x for x in per_rank[r]["read_bytes"][s] if x is not None])
                                for s in SYSTEMS if s != "memcpy"} for r in sorted(per_rank)},
        "bytes_per_rank": {str(r): per_rank[r]["bytes"] for r in sorted(per_rank)},
        "problems": [u for r in sorted(per_rank) for u in per_rank[r]["problems"]],
    }
    return out


_LABELS = {"memory_first": "memory tier, first load of the process", "memory": "memory tier, again",
           "persistent": "persistent root (same bytes)", "dcp": "DCP load of the same state",
           "memcpy": "memcpy of the rank's bytes"}


def table(r: Dict[str, Any]) -> List[str]:
    """The section's lines of ``nostall bench``'s table."""
    st = r["startup_s"]
    lines = [f"restore after a trainer crash, fresh processes (medians of {r['rounds']} round(s), rank 0; start-up "
             f"apart: {st['total_s']:.2f} s = interpreter and torch {st['process_s']:.2f} s, gloo group "
             f"{st['group_s']:.2f} s, manager and holder {st['manager_s']:.2f} s)",
             f"{'':<40}{'ms':>10}{'/ memcpy':>10}{'/ dcp':>8}{'MiB read, rank 0':>18}"]
    reads = r["read_bytes"]["0"]
    for s in SYSTEMS:
        over_dcp = r["over_dcp"].get(s)
        read = reads.get(s)
        lines.append(f"{_LABELS[s]:<40}{median(r['seconds'][s]) * 1e3:>10.1f}{r['over_memcpy'][s]:>10.2f}"
                     + (f"{over_dcp:>8.2f}" if over_dcp is not None else f"{'':>8}")
                     + (f"{read / 2**20:>18.1f}" if read is not None else f"{'':>18}"))
    persistent = {rank: x["persistent_bytes_read"] for rank, x in r["restored"].items()}
    tiers = sorted({x["tier"] for x in r["restored"].values()})
    lines.append(f"  the section took {r.get('leave_s', float('nan')) + r['restart_s']:.1f} s (saves "
                 f"{r.get('leave_s', float('nan')):.1f} s, restarted processes {r['restart_s']:.1f} s)")
    problems = r["problems"]
    lines.append(f"  restored from: {', '.join(tiers)} (step {r['restored']['0']['step']}); bytes read from the "
                 f"persistent root per rank: {', '.join(f'{k}: {v}' for k, v in persistent.items())}; every load "
                 "equal to the saved state, from the tier named: "
                 + ("yes" if not problems else "NO: " + "; ".join(problems[:4])))
    return lines + [""]
