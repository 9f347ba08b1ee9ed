"""``nostall bench incremental``: what incremental saves write, and what they cost.

Launches ``--ranks`` gloo processes on this machine. Every rank holds a state
of ``--mb-per-rank`` MiB, the same layout in two *states*:

* ``lora`` (LoRA-shaped): a frozen base of 90% of the bytes (one weight per
  layer) and, per layer, a low-rank adapter (``lora_A``, ``lora_B``) with the
  two Adam moments of each (adapter: one third of the other 10%, moments two
  thirds). Between saves, the adapter and its moments change; the base does
  not.
* ``everything``: the same tensors, every one of them changed between saves
  (as under full fine-tuning): an incremental save can skip nothing, and pays
  its digests for nothing.

Every tensor is a DTensor ``Shard(0)`` view over a 1-D mesh, each rank's
shard different, so every rank writes its own pieces.

*Systems*: ``full_async`` (``CheckpointManager(async_save=True)``),
``incremental_async`` (``async_save=True, incremental=True``), ``full_sync``
and ``incremental_sync``. A *run* is one system on one state: a fresh
manager in a fresh root, a first save (step 0, reported apart: process
start-up, allocations, and for incremental saves the full first write), then
``--saves`` saves, the state changed (untimed) before each. Runs are
interleaved: every repetition runs every state and system once, in an order
rotated per repetition.

Per save after the first: *bytes written* (the sum over ranks of
``handle.stats.bytes_written``, and the data files' sizes in the
checkpoint's directory, both taken after ``result()``), *stall* (the
``save()`` call) and *time until durable* (from the call until
``result()`` returns: committed); the figure of a save is the slowest
rank's. Every save starts after a barrier, the previous one committed.

*Hash cost*: an incremental save takes an xxh3-128 digest of every piece,
changed or not, in the process that writes (the background writer of an
async save, the trainer for a sync one). It is measured directly -- every
rank digests all its bytes with :func:`nostall.core.format.content_digest`, in the
bench process, all ranks at once -- and indirectly, as the difference of
the time until durable of incremental and full saves of the ``everything``
state.

At the end of every incremental run, its last checkpoint is loaded (with
checksum verification) into a zeroed template and compared bit for bit with
the state at its save. See docs/benchmarks.md ("Incremental saves") for the
JSON schema.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nostall.tools.bench.common import gather_ranks, local_tensors, serve_rank, write_outputs, zero_template

SYSTEMS = ("full_async", "incremental_async", "full_sync", "incremental_sync")
STATES = ("lora", "everything")
LAYERS = 8
COLS = 256  # columns of every tensor (float32)
BYTES_GOAL = 1.1  # the goal: bytes written per save <= 1.1 x the bytes that changed
PARTS = ("wait_s", "plan_s", "stage_s", "write_s", "commit_s")
"""SaveStats fields kept per save (the slowest rank's): where a save's time went."""
STALL_TOLERANCE = 1.25  # "stall unchanged": incremental / full at most this (times are noisy; lower is no harm)

# --------------------------------------------------------------------------- the state (in the ranks)


def layer_sizes(mb: int) -> Tuple[int, int]:
    """Rows (of ``COLS`` float32) of one layer's base weight and of one adapter matrix, for ``mb`` MiB per rank.

    The base weights take 90% of the bytes; the adapter matrices (two per
    layer) a third of the rest and their two moments each the other two
    thirds.
    """
    total = mb * (1 << 20)
    row = COLS * 4
    base_rows = max(1, int(total * 0.9) // LAYERS // row)
    adapter_rows = max(1, int(total * 0.1) // 3 // (2 * LAYERS) // row)
    return base_rows, adapter_rows


class _State:
    """One rank's state: ``{"model": {...}, "optim": {...}, "step": int}`` of DTensor ``Shard(0)`` views.

    ``frozen`` are the base weights, ``moving`` the adapter matrices and
    their moments; :meth:`change` alters the moving tensors (``lora``) or
    all of them (``everything``), deterministically.
    """

    def __init__(self, kind: str, rank: int, world: int, mb: int, mesh: Any) -> None:
        import torch
        from torch.distributed.tensor import DTensor, Shard

        self.kind = kind
        base_rows, ad_rows = layer_sizes(mb)
        g = torch.Generator().manual_seed(4321 + rank)

        def sharded(rows: int) -> Tuple[Any, Any]:
            local = torch.randn((rows, COLS), generator=g)
            return local, DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size((rows * world, COLS)),
                                             stride=(COLS, 1))

        model: Dict[str, Any] = {}
        optim: Dict[str, Any] = {}
        self.frozen: List[Any] = []
        self.moving: List[Any] = []
        for i in range(LAYERS):
            local, model[f"layers.{i}.weight"] = sharded(base_rows)
            self.frozen.append(local)
            for ab in ("lora_A", "lora_B"):
                name = f"layers.{i}.{ab}"
                local, model[name] = sharded(ad_rows)
                m1, d1 = sharded(ad_rows)
                m2, d2 = sharded(ad_rows)
                m2.abs_()
                optim[name] = {"exp_avg": d1, "exp_avg_sq": d2}
                self.moving += [local, m1, m2]
        self.state: Dict[str, Any] = {"model": model, "optim": optim, "step": 0}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.frozen + self.moving)
        self.changing = self.tensors_changed()
        self.changed_bytes = sum(t.numel() * t.element_size() for t in self.changing)

    def tensors_changed(self) -> List[Any]:
        """The local tensors :meth:`change` alters."""
        return self.moving if self.kind == "lora" else self.frozen + self.moving

    def change(self, step: int) -> None:
        """A training step's worth of change (untimed): every byte of the changing tensors moves."""
        for t in self.changing:
            t.mul_(0.999).add_(1e-3 * step)
        self.state["step"] = step

    def locals(self) -> List[Any]:
        return local_tensors(self.state)


def _dir_bytes(path: str) -> int:
    """Bytes of the data files (``*.safetensors``) directly in a checkpoint's directory."""
    n = 0
    try:
        for e in os.scandir(path):
            if e.is_file(follow_symlinks=False) and e.name.endswith(".safetensors"):
                n += e.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return n


class _Rank:
    """One rank of the benchmark: runs, hash timing, verification."""

    def __init__(self, rank: int, world: int, root: str, cfg: Dict[str, Any], torch: Any, dist: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world, self.root, self.cfg = rank, world, root, cfg
        self.torch, self.dist = torch, dist
        self.mesh = init_device_mesh("cpu", (world,))

    def say(self, text: str) -> None:
        if self.rank == 0 and self.cfg.get("progress"):
            print(f"[bench incremental] {text}", file=sys.stderr, flush=True)

    def run(self, kind: str, system: str, rep: int) -> Dict[str, Any]:
        """One run: a fresh manager and state, a first save, ``saves`` timed saves, then verification."""
        import nostall

        dist = self.dist
        run_root = os.path.join(self.root, kind, system, f"r{rep}")
        st = _State(kind, self.rank, self.world, self.cfg["mb"], self.mesh)
        incremental = system.startswith("incremental")
        async_save = system.endswith("_async")
        dist.barrier()
        mgr = nostall.CheckpointManager(run_root, async_save=async_save, incremental=incremental,
                                        full_every=self.cfg["full_every"] if incremental else None)
        out: Dict[str, Any] = {"saves": []}
        try:
            if async_save:  # set-up, as docs/integration.md advises: plan, start the writer, map the area
                mgr.prepare(st.state)
            saves = self.cfg["saves"]
            for step in range(saves + 1):
                if step:
                    st.change(step)
                dist.barrier()
                t0 = time.perf_counter()
                h = mgr.save(step, st.state)
                stall = time.perf_counter() - t0
                stats = h.result()
                durable = time.perf_counter() - t0
                rec = {"step": step, "stall_s": stall, "durable_s": durable, "bytes_written": stats.bytes_written,
                       "disk_bytes": _dir_bytes(mgr.path_for(step)) if self.rank == 0 else 0,
                       "parts": {f: float(getattr(stats, f) or 0.0) for f in PARTS},
                       "plan_cached": bool(stats.plan_cached)}
                if step == 0:
                    out["first"] = rec
                else:
                    out["saves"].append(rec)
            dist.barrier()
            if incremental:
                out["verified"], out["mismatch"] = self.verify(mgr, st)
            mgr.finalize_pending_saves()
        finally:
            mgr.close()
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(run_root, ignore_errors=True)
        out["bytes"] = st.nbytes
        out["changed_bytes"] = st.changed_bytes
        return out

    def verify(self, mgr: Any, st: _State) -> Tuple[bool, str]:
        """Load the run's last checkpoint (checksums verified) and compare it bit for bit with the state."""
        torch = self.torch
        template = zero_template(st.state)
        template["step"] = -1
        try:
            loaded = mgr.load(template)
        except Exception as e:  # a failed load is a failed verification, said so
            return False, f"rank {self.rank}: load failed: {type(e).__name__}: {e}"
        if loaded["step"] != st.state["step"]:
            return False, f"rank {self.rank}: step {loaded['step']!r}, saved {st.state['step']!r}"
        got, want = local_tensors(template), st.locals()
        if len(got) != len(want):
            return False, f"rank {self.rank}: {len(got)} tensors loaded, {len(want)} saved"
        for i, (a, b) in enumerate(zip(got, want)):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                return False, f"rank {self.rank}: local tensor #{i} differs from the state at its save"
        return True, ""

    def hash_cost(self) -> float:
        """Seconds to digest (xxh3-128) all this rank's bytes, every rank at once."""
        from nostall.core.format import content_digest

        st = _State("everything", self.rank, self.world, self.cfg["mb"], self.mesh)
        views = [memoryview(t.numpy()).cast("B") for t in st.locals()]
        self.dist.barrier()
        t0 = time.perf_counter()
        for v in views:
            content_digest(v)
        return time.perf_counter() - t0

    def main(self) -> Dict[str, Any]:
        systems: List[str] = self.cfg["systems"]
        states: List[str] = self.cfg["states"]
        reps: int = self.cfg["reps"]
        runs: Dict[str, Dict[str, List[Any]]] = {k: {s: [] for s in systems} for k in states}
        hashes: List[float] = []
        for rep in range(reps):
            h = self.hash_cost()
            hashes.append(h)
            self.say(f"rep {rep + 1}/{reps}: xxh3-128 over this rank's bytes: {h * 1e3:.1f} ms")
            for kind in states:
                shift = rep % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    r = self.run(kind, system, rep)
                    runs[kind][system].append(r)
                    med_d = statistics.median(x["durable_s"] for x in r["saves"]) if r["saves"] else float("nan")
                    med_s = statistics.median(x["stall_s"] for x in r["saves"]) if r["saves"] else float("nan")
                    ver = ""
                    if "verified" in r:
                        ver = (", last checkpoint verified" if r["verified"]
                               else f", VERIFICATION FAILED: {r['mismatch']}")
                    self.say(f"rep {rep + 1}/{reps} {kind} {system}: {len(r['saves'])} saves, median stall "
                             f"{med_s * 1e3:.1f} ms, until durable {med_d * 1e3:.1f} ms, rank 0 wrote "
                             f"{r['saves'][-1]['bytes_written'] / 2**20 if r['saves'] else 0:.1f} MiB{ver}")
        return {"runs": runs, "hash_s": hashes}


def _worker(rank: int, world: int, init: str, root: str, cfg: Dict[str, Any], q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
    serve_rank(rank, world, init, q, lambda: _Rank(rank, world, root, cfg, torch, dist).main())


# --------------------------------------------------------------------------- figures


def _spread(xs: Sequence[float]) -> Dict[str, float]:
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def combine(per_rank: Dict[int, Dict[str, Any]]) -> Dict[str, Dict[str, List[Dict[str, Any]]]]:
    """Every run with its saves across ranks: times of the slowest rank, bytes summed over ranks."""
    ranks = sorted(per_rank)
    r0 = per_rank[ranks[0]]["runs"]
    out: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for kind, by in r0.items():
        out[kind] = {}
        for system, reps in by.items():
            out[kind][system] = []
            for i, run in enumerate(reps):
                each = [per_rank[k]["runs"][kind][system][i] for k in ranks]

                def merged(recs: List[Dict[str, Any]]) -> Dict[str, Any]:
                    return {"step": recs[0]["step"], "stall_s": max(x["stall_s"] for x in recs),
                            "durable_s": max(x["durable_s"] for x in recs),
                            "bytes_written": sum(x["bytes_written"] for x in recs),
                            "disk_bytes": sum(x["disk_bytes"] for x in recs),
                            "parts": {f: max(x["parts"][f] for x in recs) for f in PARTS},
                            "plan_cached": all(x["plan_cached"] for x in recs)}

                c: Dict[str, Any] = {
                    "first": merged([e["first"] for e in each]),
                    "saves": [merged([e["saves"][j] for e in each]) for j in range(len(run["saves"]))],
                    "bytes": sum(e["bytes"] for e in each),
                    "changed_bytes": sum(e["changed_bytes"] for e in each),
                }
                if "verified" in run:
                    c["verified"] = all(e["verified"] for e in each)
                    c["mismatches"] = [e["mismatch"] for e in each if e["mismatch"]]
                out[kind][system].append(c)
    return out


def summarize(runs: Dict[str, Dict[str, List[Dict[str, Any]]]]) -> Dict[str, Dict[str, Any]]:
    """Per state and system: spreads over every save after the first, of every repetition."""
    out: Dict[str, Dict[str, Any]] = {}
    for kind, by in runs.items():
        out[kind] = {}
        for system, reps in by.items():
            saves = [s for r in reps for s in r["saves"]]
            out[kind][system] = {
                "stall_s": _spread([s["stall_s"] for s in saves]),
                "durable_s": _spread([s["durable_s"] for s in saves]),
                "bytes_written": _spread([float(s["bytes_written"]) for s in saves]),
                "disk_bytes": _spread([float(s["disk_bytes"]) for s in saves]),
                "parts": {f: _spread([s["parts"][f] for s in saves]) for f in PARTS},
                "plan_cached": sum(1 for s in saves if s["plan_cached"]),
                "first_durable_s": _spread([r["first"]["durable_s"] for r in reps]),
                "first_bytes_written": _spread([float(r["first"]["bytes_written"]) for r in reps]),
                "saves": len(saves),
            }
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def goals(summary: Dict[str, Dict[str, Any]], bytes_total: Dict[str, int], changed: Dict[str, int],
          hash_s: float) -> Dict[str, Any]:
    """The issue's goals, as ratios within this run (only those whose systems and states ran)."""
    out: Dict[str, Any] = {}

    def med(kind: str, system: str, field: str) -> Optional[float]:
        r = summary.get(kind, {}).get(system)
        return None if r is None else float(r[field]["median"])

    lo = summary.get("lora", {})
    for mode in ("async", "sync"):
        inc, full = f"incremental_{mode}", f"full_{mode}"
        if inc in lo:
            w = med("lora", inc, "bytes_written")
            assert w is not None
            r = _ratio(w, changed["lora"])
            out[f"lora {inc}: bytes written per save / bytes changed"] = {
                "value": r, "goal": f"<= {BYTES_GOAL}", "met": r <= BYTES_GOAL}
        if inc in lo and full in lo:
            di, df = med("lora", inc, "durable_s"), med("lora", full, "durable_s")
            si, sf = med("lora", inc, "stall_s"), med("lora", full, "stall_s")
            assert di is not None and df is not None and si is not None and sf is not None
            frac = _ratio(changed["lora"], bytes_total["lora"])
            out[f"lora until durable: {inc} / {full}"] = {
                "value": _ratio(di, df), "changed_fraction": frac,
                "goal": "scales with the bytes changed (compare with changed_fraction)"}
            r = _ratio(si, sf)
            entry: Dict[str, Any] = {"value": r}
            if mode == "async":
                entry.update(goal=f"unchanged: not above full's (~1.0; <= {STALL_TOLERANCE} counted as met)",
                             met=r <= STALL_TOLERANCE)
            else:
                entry["goal"] = "none (a sync save's stall is its time until durable)"
            out[f"lora stall: {inc} / {full}"] = entry
    ev = summary.get("everything", {})
    for mode in ("async", "sync"):
        inc, full = f"incremental_{mode}", f"full_{mode}"
        if inc in ev and full in ev:
            di, df = med("everything", inc, "durable_s"), med("everything", full, "durable_s")
            assert di is not None and df is not None
            out[f"everything until durable: {inc} / {full}"] = {
                "value": _ratio(di, df), "difference_s": di - df, "hash_s": hash_s,
                "goal": "no slower than full by more than the hash cost", "met": di - df <= hash_s}
    return out


def run_bench(ranks: int = 2, mb: int = 256, reps: int = 3, saves: int = 4, systems: Sequence[str] = SYSTEMS,
              states: Sequence[str] = STATES, full_every: Optional[int] = None, root: Optional[str] = None,
              progress: bool = False, timeout: float = 7200.0) -> Dict[str, Any]:
    """Run the benchmark; returns the JSON-able result (see docs/benchmarks.md)."""
    import torch

    if saves < 1 or reps < 1 or ranks < 1 or mb < 1:
        raise ValueError("--saves, --reps, --ranks and --mb-per-rank must be at least 1")
    own = root is None
    root = root or tempfile.mkdtemp(prefix="nostall-bench-incremental-")
    os.makedirs(root, exist_ok=True)
    cfg = {"mb": mb, "reps": reps, "saves": saves, "systems": list(systems), "states": list(states),
           "full_every": full_every, "progress": progress}
    if progress:
        print(f"[bench incremental] {ranks} ranks x {mb} MiB; states {', '.join(states)}; {reps} repetition(s) of "
              f"{', '.join(systems)}, each a first save and {saves} more; under {root}", file=sys.stderr, flush=True)
    try:
        per_rank = gather_ranks(_worker, ranks, root, cfg, timeout, "benchmark")
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    runs = combine(per_rank)
    summary = summarize(runs)
    first = {kind: next(iter(by.values()))[0] for kind, by in runs.items()}
    bytes_total = {kind: r["bytes"] for kind, r in first.items()}
    changed = {kind: r["changed_bytes"] for kind, r in first.items()}
    hash_each = [max(per_rank[k]["hash_s"][i] for k in per_rank) for i in range(reps)]
    hash_s = statistics.median(hash_each)
    per_rank_bytes = bytes_total[next(iter(bytes_total))] // ranks
    verified = {f"{kind}/{system}": [r["verified"] for r in rs] for kind, by in runs.items()
                for system, rs in by.items() if system.startswith("incremental")}
    mismatches = [m for by in runs.values() for rs in by.values() for r in rs for m in r.get("mismatches", [])]
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return {
        "config": {"ranks": ranks, "mb_per_rank": mb, "bytes_per_rank": per_rank_bytes, "reps": reps,
                   "saves": saves, "systems": list(systems), "states": list(states), "full_every": full_every,
                   "layers": LAYERS, "backend": "gloo",
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        "machine": {"cpus": cpus, "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "states": {kind: {"bytes": bytes_total[kind], "changed_bytes_per_save": changed[kind]} for kind in runs},
        "hash": {"algorithm": "xxh3-128", "s": hash_s, "each_s": hash_each, "bytes_per_rank": per_rank_bytes,
                 "gbps_per_rank": per_rank_bytes / hash_s / 1e9 if hash_s else float("nan")},
        "summary": summary,
        "goals": goals(summary, bytes_total, changed, hash_s),
        "verified": verified,
        "verification_passed": bool(verified) and all(all(v) for v in verified.values()) and not mismatches,
        "mismatches": mismatches,
        "runs": runs,
    }


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def _ms(s: Dict[str, float]) -> str:
    return f"{s['median'] * 1e3:.1f} ms ({s['min'] * 1e3:.0f}-{s['max'] * 1e3:.0f})"


def format_table(out: Dict[str, Any]) -> str:
    c = out["config"]
    lines = [f"{c['ranks']} ranks x {_mib(c['bytes_per_rank'])} MiB, {c['reps']} repetition(s) x {c['saves']} saves "
             "after a first (medians over those saves; the slowest rank's times, bytes summed over ranks; "
             "min-max in brackets). copy: the save's copy into the staging area (async; in the stall); write: "
             "the data files written and fsynced, digests included (SaveStats.stage_s, write_s)", ""]
    for kind, by in out["summary"].items():
        st = out["states"][kind]
        lines.append(f"== {kind}: {_mib(st['bytes'])} MiB in all, {_mib(st['changed_bytes_per_save'])} MiB change "
                     "per save")
        lines.append(f"{'system':<20}{'MiB written':>12}{'on disk':>10}{'stall':>24}{'until durable':>26}"
                     f"{'copy':>9}{'write':>10}{'first save':>14}")
        for system, r in by.items():
            parts = r.get("parts", {})
            stage, write = (parts.get(f, {}).get("median", float("nan")) * 1e3 for f in ("stage_s", "write_s"))
            lines.append(f"{system:<20}{_mib(r['bytes_written']['median']):>12}{_mib(r['disk_bytes']['median']):>10}"
                         f"{_ms(r['stall_s']):>24}{_ms(r['durable_s']):>26}{stage:>6.0f} ms{write:>7.0f} ms"
                         f"{r['first_durable_s']['median'] * 1e3:>11.0f} ms")
        lines.append("")
    h = out["hash"]
    lines.append(f"hash cost, measured: xxh3-128 over a rank's {_mib(h['bytes_per_rank'])} MiB, every rank at once: "
                 f"{h['s'] * 1e3:.1f} ms ({h['gbps_per_rank']:.2f} GB/s per rank)")
    lines.append("")
    lines.append("goals (ratios within this run):")
    for name, g in out["goals"].items():
        extra = ""
        if "changed_fraction" in g:
            extra = f" (bytes changed / state: {g['changed_fraction']:.3f})"
        if "difference_s" in g:
            extra = (f" (difference {g['difference_s'] * 1e3:+.1f} ms; measured hash cost "
                     f"{g['hash_s'] * 1e3:.1f} ms)")
        verdict = ""
        if "met" in g:
            verdict = "; met" if g["met"] else "; NOT met"
        lines.append(f"  {name} = {g['value']:.3f}{extra}  [goal: {g['goal']}{verdict}]")
    lines.append("")
    n = sum(len(v) for v in out["verified"].values())
    if out["verification_passed"]:
        lines.append(f"verification: the last checkpoint of each of the {n} incremental runs loaded bit-exactly "
                     "(checksums verified, every tensor equal to the state at its save): passed")
    else:
        lines.append(f"verification: FAILED ({len(out['mismatches'])} mismatch(es) in {n} incremental runs)")
        lines += [f"  {m}" for m in out["mismatches"]]
    return "\n".join(lines)


def plot(out: Dict[str, Any], path: str) -> None:
    """Bytes written, stall and time until durable per save, per state and system (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = out["summary"]
    kinds = list(s)
    systems = list(out["config"]["systems"])
    colors = {"full_async": "tab:gray", "incremental_async": "tab:blue", "full_sync": "silver",
              "incremental_sync": "tab:cyan"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / max(1, len(systems))
    for ax, field, scale, title, unit in (
            (axes[0], "bytes_written", 1 / 2**20, "written per save", "MiB (median)"),
            (axes[1], "stall_s", 1e3, "stall (save() call)", "ms (median)"),
            (axes[2], "durable_s", 1e3, "time until durable", "ms (median)")):
        for j, system in enumerate(systems):
            vals = [s[k][system][field]["median"] * scale if system in s[k] else 0.0 for k in kinds]
            ax.bar([i + (j - (len(systems) - 1) / 2) * width for i in range(len(kinds))], vals, width,
                   label=system, color=colors.get(system))
        if field == "bytes_written":
            for i, k in enumerate(kinds):
                ch = out["states"][k]["changed_bytes_per_save"] * scale
                ax.hlines(ch, i - 0.45, i + 0.45, colors="tab:red", linestyles="--",
                          label="bytes changed" if i == 0 else None)
        ax.set_xticks(range(len(kinds)), [{"lora": "LoRA-shaped", "everything": "everything changes"}.get(k, k)
                                          for k in kinds])
        ax.set_ylabel(unit)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    c = out["config"]
    fig.suptitle(f"incremental vs full saves: {c['ranks']} ranks x {_mib(c['bytes_per_rank'])} MiB per rank, "
                 f"{c['reps']} reps x {c['saves']} saves")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    """``nostall bench incremental [options]``; returns the exit status (1 when a checkpoint did not verify)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="nostall bench incremental",
        description="What incremental saves write and cost against full ones, async and sync, on a LoRA-shaped "
                    "state (a frozen base of 90%% of the bytes) and on one where everything changes. Progress "
                    "goes to stderr, the table to stdout.")
    ap.add_argument("--ranks", type=int, default=2, metavar="N",
                    help="gloo ranks on this machine (default: %(default)s)")
    ap.add_argument("--mb-per-rank", type=int, default=256, metavar="MIB",
                    help="MiB of state per rank (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, metavar="N",
                    help="repetitions: every state and system once each, interleaved (default: %(default)s)")
    ap.add_argument("--saves", type=int, default=4, metavar="N",
                    help="timed saves per run, after a first save reported apart (default: %(default)s)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), metavar="LIST",
                    help="comma-separated subset of %(default)s")
    ap.add_argument("--states", default=",".join(STATES), metavar="LIST",
                    help="comma-separated subset of %(default)s")
    ap.add_argument("--full-every", type=int, default=None, metavar="N",
                    help="incremental systems: a full save every N saves (default: only the first)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    ap.add_argument("--plot", default=None, help="draw bytes written, stall and time until durable (PNG)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    states = [s for s in args.states.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS] + [s for s in states if s not in STATES]
    if bad or not systems or not states:
        ap.error(f"unknown or missing system(s)/state(s) {bad}; choose from {SYSTEMS} and {STATES}")
    if args.full_every is not None and args.full_every < 1:
        ap.error("--full-every must be at least 1")
    out = run_bench(args.ranks, args.mb_per_rank, args.reps, args.saves, systems, states, args.full_every,
                    args.dir, progress=not args.quiet)
    write_outputs(out, format_table(out), args.json, args.plot, plot)
    return 0 if out["verification_passed"] or not out["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
