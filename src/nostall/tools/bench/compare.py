"""``nostall bench``: nostall side by side with PyTorch DCP, torch.save and the machine's limits.

Launches ``--ranks`` processes (gloo), gives every rank the same synthetic
training state (parameters sharded as DTensors over a 1-D mesh plus replicated
tensors, and an optimizer-like pair of moments per parameter), and times, in
interleaved repetitions on that same state:

* ``nostall_sync``, ``nostall_async`` -- ``CheckpointManager.save``;
* ``nostall_overlap`` -- an async save with overlapped staging: ``save()``
  returns after the plan and the copy runs while the next forward/backward
  (``--compute-ms`` of the small model) runs; the optimizer step then waits
  for what is left of the copy. Its stall is the return time plus that wait;
  ``compute_ms`` holds, per save, the forward/backward time meanwhile and
  right after the save (the copy's cost to training);
* ``nostall_async_remote`` (with ``--remote URL``) -- the async save to
  object storage (``--storage-options`` JSON for fsspec): compare its stall
  with ``nostall_async``'s;
* ``dcp_sync`` (``dcp.save``), ``dcp_async_thread`` (``dcp.async_save``),
  ``dcp_async_process`` (process executor with DCP's shared-memory
  ``DefaultStager``: its best CPU configuration);
* ``torch_save`` -- each rank ``torch.save``s its local tensors to its own
  file, then fsyncs it;
* the limits: ``copy`` (the rank's bytes into an already-touched buffer: the
  floor of any stall that takes a copy) and ``write`` (the same bytes written
  sequentially to one file and fsynced: the floor of a durable save).

Then small states (``--small-mb``, 1 and 16 MiB per rank by default: the
fixed cost per save dominates there): the async stall of ``nostall_async``
beside ``dcp_async_thread``'s and the copy floor, each save after the previous
one is durable.

For each: stall (how long the call kept the training loop from modifying its
state), time until durable/committed, throughput, resident memory of the rank
and of its helper processes; the first save separately. Then loads (same
layout, and resharded to full tensors on every rank) and the training-side
cost: step time of a small CPU model while a background save is written,
relative to no save. Last, with ``--restore``, the restore section
(:mod:`.restore`; opt-in: it took 38 s at the default size on this project's
machine, docs/benchmarks.md): fresh processes, as a restarted trainer, restore the rank's state
from the memory tier and from the persistent root, beside DCP's load of the
same state and a memcpy of the rank's bytes. See docs/benchmarks.md for the
JSON schema.

Ctrl-C stops the ranks quietly; the table of what was measured so far is
printed, and ``nostall bench`` exits with status 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from nostall.tools.argtypes import storage_options_arg
from nostall.tools.bench import MODES, main as bench_main
from nostall.tools.bench import restore as restore_section
from nostall.tools.bench.common import (Interrupted, MemoryDir, TrainLoop, child_pids, full_template, gather_ranks,
                                        local_tensors, median, quiet_dcp_process, report_partial, reset_peaks, rss_mb,
                                        serve_rank, write_outputs, zero_template)

SYSTEMS = ("nostall_sync", "nostall_async", "nostall_overlap", "dcp_sync", "dcp_async_thread", "dcp_async_process",
           "torch_save")
REMOTE = "nostall_async_remote"  # only with --remote
LIMITS = ("copy", "write")
ASYNC = ("nostall_async", "nostall_overlap", REMOTE, "dcp_async_thread", "dcp_async_process")
SMALL = ("copy", "nostall_async", "dcp_async_thread")  # the small-state rows


# --------------------------------------------------------------------------- helpers (in the ranks)


def make_state(rank: int, world: int, mb: int) -> Tuple[Dict[str, Any], int]:
    """Parameters (DTensor Shard(0) on a 1-D mesh, some replicated) and two moments each; the same bytes for the
    same arguments (seeded): the restore section rebuilds the saved state with it."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    per = max(1, mb * (1 << 20) // 4 // 3)  # float32 elements of parameters per rank (moments: 2x)
    sizes = [per // 4, per // 8, per // 8, per // 8] + [per // 64] * 24
    g = torch.Generator().manual_seed(1234 + rank)
    model: Dict[str, Any] = {}
    optim: Dict[str, Any] = {}
    nbytes = 0
    for i, n in enumerate(sizes):
        rows = max(1, n // 256)
        shape = (rows, 256)
        if i % 7 == 6:  # replicated (e.g. norms): identical on every rank
            rep = torch.Generator().manual_seed(99 + i)
            model[f"p{i}"] = torch.randn(shape, generator=rep)
            optim[f"p{i}"] = {"exp_avg": torch.zeros(shape), "exp_avg_sq": torch.zeros(shape)}
        else:
            def shard(shape: Tuple[int, int] = shape, rows: int = rows) -> Any:
                local = torch.randn(shape, generator=g)
                return DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size((rows * world, 256)),
                                          stride=(256, 1))

            model[f"p{i}"] = shard()
            optim[f"p{i}"] = {"exp_avg": shard(), "exp_avg_sq": shard()}
        nbytes += 3 * rows * 256 * 4
    return {"model": model, "optim": optim, "step": 0}, nbytes


def _copy_into(buf: Any, tensors: List[Any]) -> None:
    """The copy floor: ``tensors``' bytes into ``buf``, one after the other."""
    pos = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        buf[pos : pos + n].view(t.dtype).view(t.shape).copy_(t)
        pos += n


def _say(cfg: Dict[str, Any], rank: int, text: str) -> None:
    """A progress line on stderr (rank 0 only, when the launcher asked for them)."""
    if rank == 0 and cfg.get("progress"):
        print(f"[bench] {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- one rank


def _worker(rank: int, world: int, init: str, root: str, cfg: Dict[str, Any], q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import nostall

    # torch is imported before this runs (the launcher's spawn wrapper is torch's): the variable alone comes too late
    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"] or 1)))

    for name in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.logging_handlers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_dcp_process()
    serve_rank(rank, world, init, q, lambda: _Rank(rank, world, root, cfg, torch, dist, dcp, nostall, q).main())


class _Rank:
    """One rank of ``nostall bench``: the state, every system's manager, and the phases it times."""

    def __init__(self, rank: int, world: int, root: str, cfg: Dict[str, Any], torch: Any, dist: Any, dcp: Any,
                 nostall: Any, q: Any) -> None:
        self.rank, self.world, self.root, self.cfg, self.q = rank, world, root, cfg, q
        self.torch, self.dist, self.dcp, self.nostall = torch, dist, dcp, nostall
        self.systems: List[str] = cfg["systems"]
        self.reps: int = cfg["reps"]
        self.state, self.nbytes = make_state(rank, world, cfg["mb"])
        self.tensors = local_tensors(self.state)
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8)
        self.buf.zero_()  # touched once: the copy floor never pays page faults
        self.raw = os.path.join(root, "raw")
        os.makedirs(self.raw, exist_ok=True)
        self.small: Dict[str, Any] = {}
        self.res: Dict[str, Dict[str, Any]] = {
            s: {"stall_s": [], "commit_s": [], "throughput_gbps": [], "rss_mb": [], "helper_rss_mb": [],
                "first_save": None}
            for s in list(self.systems) + list(LIMITS)
        }
        self.loop = TrainLoop()
        self.compute_s = cfg.get("compute_ms", 200) / 1e3
        self._managers()
        self.dcp_proc_stager = None
        if "dcp_async_process" in self.systems:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # DCP's recommended CPU set-up: a reusable shared-memory staging copy, process executor
            cuda = torch.cuda.is_available()
            self.dcp_proc_stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                                use_async_staging=False, use_non_blocking_copy=cuda))

    def _managers(self) -> None:
        # No retention inside the timed region: every system's old checkpoints are
        # deleted between repetitions, outside the timers (the same work for all).
        nostall, root, systems, state = self.nostall, self.root, self.systems, self.state
        self.mgr_sync = (nostall.CheckpointManager(os.path.join(root, "nostall_sync"))
                         if "nostall_sync" in systems else None)
        self.mgr_async = (nostall.CheckpointManager(os.path.join(root, "nostall_async"), async_save=True)
                          if "nostall_async" in systems else None)
        if self.mgr_async is not None:  # set-up, as docs/integration.md advises: plan, start the writer, map the area
            self.mgr_async.prepare(state)
        self.mgr_overlap = None
        if "nostall_overlap" in systems:
            self.mgr_overlap = nostall.CheckpointManager(os.path.join(root, "nostall_overlap"), async_save=True,
                                                         overlap=True)
            self.mgr_overlap.attach(self.loop.opt)  # its step() waits for the copy, as a trainer's would
            self.mgr_overlap.prepare(state)
            self.res["nostall_overlap"]["compute_ms"] = []  # [forward/backward meanwhile, just before], per save
        self.mgr_remote = None
        if REMOTE in systems:
            url = f"{self.cfg['remote'].rstrip('/')}/{self.cfg['run_id']}"
            self.mgr_remote = nostall.CheckpointManager(url, async_save=True, keep_last=1,
                                                        storage_options=self.cfg["storage_options"],
                                                        local_staging_dir=os.path.join(root, "remote-staging"))

    def _async_mgr(self, system: str) -> Any:
        mgrs = {"nostall_async": self.mgr_async, "nostall_overlap": self.mgr_overlap, REMOTE: self.mgr_remote}
        return mgrs.get(system)

    def say(self, text: str) -> None:
        _say(self.cfg, self.rank, text)

    # ---- one save of each system: (stall, until durable) in seconds

    def _timed(self, fn: Callable[[], Any]) -> Tuple[float, float]:
        t0 = time.perf_counter()
        fn()
        x = time.perf_counter() - t0
        return x, x

    def _copy_floor(self, rep: int) -> Tuple[float, float]:
        return self._timed(lambda: _copy_into(self.buf, self.tensors))

    def _write_floor(self, rep: int) -> Tuple[float, float]:
        from nostall.storage import files as storage

        path = os.path.join(self.raw, f"rank{self.rank}.bin")
        return self._timed(lambda: storage.write_file(path, [memoryview(self.buf.numpy())]))

    def _nostall_sync(self, rep: int) -> Tuple[float, float]:
        assert self.mgr_sync is not None
        mgr = self.mgr_sync
        return self._timed(lambda: mgr.save(rep, self.state))

    def _nostall_async(self, rep: int, system: str) -> Tuple[float, float]:
        mgr = self._async_mgr(system)
        assert mgr is not None
        stall, commit, _ = self._spaced_save(mgr, rep, self.state)
        return stall, commit

    def _spaced_save(self, mgr: Any, step: int, state: Any) -> Tuple[float, float, Any]:
        """An async save once the previous one is durable: (stall, until durable, its stats)."""
        mgr.finalize_pending_saves()
        self.dist.barrier()
        t0 = time.perf_counter()
        h = mgr.save(step, state)
        stall = time.perf_counter() - t0
        stats = h.result()
        return stall, time.perf_counter() - t0, stats

    def _nostall_overlap(self, rep: int) -> Tuple[float, float]:
        mgr, loop = self.mgr_overlap, self.loop
        assert mgr is not None
        mgr.finalize_pending_saves()
        self.dist.barrier()
        t0 = time.perf_counter()
        h = mgr.save(rep, self.state)
        returned = time.perf_counter() - t0
        fb = loop.compute(self.compute_s)  # the next forward/backward, while the copy runs
        loop.opt.step()  # waits for what is left of the copy
        st = h.result()
        done_s = time.perf_counter() - t0
        if rep:  # the first save is reported apart; the baseline: once the save is done, outside the timers
            base = statistics.median(loop.compute(self.compute_s))
            self.res["nostall_overlap"]["compute_ms"].append([statistics.median(fb) * 1e3, base * 1e3])
        return returned + st.staged_wait_s, done_s

    def _dcp_sync(self, rep: int) -> Tuple[float, float]:
        d = os.path.join(self.root, "dcp_sync", f"r{rep}")
        return self._timed(lambda: self.dcp.save(self.state, checkpoint_id=d))

    def _dcp_async_thread(self, rep: int, state: Any = None, where: str = "dcp_async_thread") -> Tuple[float, float]:
        t0 = time.perf_counter()
        f = self.dcp.async_save(self.state if state is None else state,
                                checkpoint_id=os.path.join(self.root, where, f"r{rep}"))
        stall = time.perf_counter() - t0
        f.result()
        return stall, time.perf_counter() - t0

    def _dcp_process_save(self, d: str) -> Any:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        return self.dcp.async_save(self.state, checkpoint_id=d, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                   async_stager=self.dcp_proc_stager)

    def _dcp_async_process(self, rep: int) -> Tuple[float, float]:
        t0 = time.perf_counter()
        r = self._dcp_process_save(os.path.join(self.root, "dcp_async_process", f"r{rep}"))
        staged = getattr(r, "staging_completion", None)
        if staged is not None:
            staged.result()  # the state may be modified only once staged
        stall = time.perf_counter() - t0
        (getattr(r, "upload_completion", None) or r).result()
        return stall, time.perf_counter() - t0

    def _torch_save(self, rep: int) -> Tuple[float, float]:
        path = os.path.join(self.root, "torch_save", f"rank{self.rank}-r{rep}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        local = {f"t{i}": t for i, t in enumerate(self.tensors)}

        def save() -> None:
            with open(path, "wb") as f:
                self.torch.save(local, f)
                f.flush()
                os.fsync(f.fileno())

        return self._timed(save)

    def run(self, system: str, rep: int) -> Tuple[float, float]:
        if system in ("nostall_async", REMOTE):
            return self._nostall_async(rep, system)
        runs: Dict[str, Callable[[int], Tuple[float, float]]] = {
            "nostall_sync": self._nostall_sync, "nostall_overlap": self._nostall_overlap, "dcp_sync": self._dcp_sync,
            "dcp_async_thread": self._dcp_async_thread, "dcp_async_process": self._dcp_async_process,
            "torch_save": self._torch_save, "copy": self._copy_floor, "write": self._write_floor,
        }
        if system not in runs:
            raise ValueError(system)
        return runs[system](rep)

    def helper_rss(self, system: str) -> float:
        mgr = self._async_mgr(system)
        if mgr is not None and mgr.writer_pid:
            return rss_mb(mgr.writer_pid)
        return sum(rss_mb(p) for p in child_pids()) if system == "dcp_async_process" else 0.0

    # ---- the phases

    def saves(self) -> None:
        """Every system, ``reps`` timed repetitions after a first save reported apart, interleaved, the order
        turned by one at each repetition: what a save leaves the file system to do (a journal commit, freed
        blocks, pages written back) lands on whichever save comes next, so no system always follows the same
        one."""
        order = list(LIMITS) + list(self.systems)
        for rep in range(self.reps + 1):
            turn = rep % len(order)
            for system in order[turn:] + order[:turn]:
                reset_peaks()
                self.dist.barrier()
                stall, commit = self.run(system, rep)
                self.dist.barrier()
                what = "first run (reported apart)" if rep == 0 else f"rep {rep}/{self.reps}"
                self.say(f"{system} {what}: stall {stall * 1e3:.1f} ms, until durable {commit * 1e3:.1f} ms")
                if rep == 0:
                    self.res[system]["first_save"] = {"stall_s": stall, "commit_s": commit}
                    continue
                self._record(system, stall, commit)
                self._drop_previous(system, rep)
                self.report()

    def report(self) -> None:
        """Rank 0's results so far, for the table printed on Ctrl-C."""
        if self.rank == 0:
            report_partial(self.q, self.rank, {"bytes": self.nbytes, "systems": self.res, "small": self.small})

    def small_states(self) -> Dict[str, Any]:
        """The small-state rows: for each of ``small_mb``, the async stall of nostall_async, dcp_async_thread
        and the copy floor (``small_reps`` saves of each after a first, every save once the last is durable)."""
        for mb in self.cfg.get("small_mb", ()):
            state, nbytes = make_state(self.rank, self.world, mb)
            tensors = local_tensors(state)
            buf = self.torch.empty(nbytes, dtype=self.torch.uint8)
            buf.zero_()
            mgr = self.nostall.CheckpointManager(os.path.join(self.root, f"small-{mb}"), async_save=True, keep_last=2)
            r: Dict[str, Any] = {"bytes": nbytes, "plan_s": [], "stage_s": [], **{s: [] for s in SMALL}}
            self.small[str(mb)] = r
            try:
                mgr.prepare(state)
                for rep in range(self.cfg["small_reps"] + 1):  # the limit first, as above
                    self.dist.barrier()
                    t0 = time.perf_counter()
                    _copy_into(buf, tensors)
                    copy = time.perf_counter() - t0
                    stall, _, stats = self._spaced_save(mgr, rep, state)
                    self.dist.barrier()
                    dcp_stall, _ = self._dcp_async_thread(rep, state, f"dcp-small-{mb}")
                    self._drop_previous(f"dcp-small-{mb}", rep)
                    if rep:  # the first save of each is left out
                        for key, x in (("nostall_async", stall), ("dcp_async_thread", dcp_stall), ("copy", copy),
                                       ("plan_s", stats.plan_s), ("stage_s", stats.stage_s)):
                            r[key].append(x)
                self.say(f"small state {mb} MiB: async stall nostall {median(r['nostall_async']) * 1e3:.2f} ms, "
                         f"dcp {median(r['dcp_async_thread']) * 1e3:.2f} ms, copy {median(r['copy']) * 1e3:.2f} ms")
            finally:
                mgr.close()
            self.report()
        return self.small

    def _record(self, system: str, stall: float, commit: float) -> None:
        r = self.res[system]
        r["stall_s"].append(stall)
        r["commit_s"].append(commit)
        r["throughput_gbps"].append(self.nbytes / commit / 1e9 if commit > 0 else 0.0)
        r["rss_mb"].append(rss_mb(os.getpid()))
        r["helper_rss_mb"].append(self.helper_rss(system))

    def _drop_previous(self, system: str, rep: int) -> None:
        """The previous repetition's checkpoint, deleted outside the timers."""
        if self.rank == 0:
            for old in (os.path.join(self.root, system, f"r{rep - 1}"),
                        os.path.join(self.root, system, f"step_{rep - 1}")):
                shutil.rmtree(old, ignore_errors=True)
        if system == "torch_save":
            old = os.path.join(self.root, system, f"rank{self.rank}-r{rep - 1}.pt")
            if os.path.exists(old):
                os.unlink(old)

    def loads(self) -> Dict[str, Dict[str, List[float]]]:
        """Loads: same layout, and resharded to full tensors on every rank; the raw read floor."""
        loads: Dict[str, Dict[str, List[float]]] = {}
        n = max(1, self.reps)
        last = self.reps
        targets = {
            "nostall": lambda tmpl: self.mgr_sync.load(tmpl) if self.mgr_sync else None,
            "dcp": lambda tmpl: self.dcp.load(tmpl, checkpoint_id=os.path.join(self.root, "dcp_sync", f"r{last}")),
        }
        for name, fn in targets.items():
            if (name == "nostall" and self.mgr_sync is None) or (name == "dcp" and "dcp_sync" not in self.systems):
                continue
            self.say(f"loading from {name} ({n} x same layout, resharded)")
            loads[name] = {"same_layout_s": [], "resharded_s": []}
            for _ in range(n):
                for kind, make in (("same_layout_s", zero_template), ("resharded_s", full_template)):
                    tmpl = make(self.state)
                    self.dist.barrier()
                    t0 = time.perf_counter()
                    fn(tmpl)
                    loads[name][kind].append(time.perf_counter() - t0)
        # raw read of the write floor's file
        loads["read_floor"] = {"same_layout_s": [], "resharded_s": []}
        for _ in range(n):
            t0 = time.perf_counter()
            with open(os.path.join(self.raw, f"rank{self.rank}.bin"), "rb", buffering=0) as f:
                while f.readinto(memoryview(self.buf.numpy())[: 64 << 20]):
                    pass
            loads["read_floor"]["same_layout_s"].append(time.perf_counter() - t0)
        return loads

    def replica_check(self) -> Dict[str, Any]:
        """The replica check (check_replicas): what a first save, or one whose plan changed, pays for it."""
        rc = _time_replica_check(self.state, self.rank, self.world, max(1, self.reps), self.dist)
        self.say(f"replica check: {median(rc['check_s']) * 1e3:.1f} ms over "
                 f"{rc['bytes'] / 2**20:.1f} MiB of replicated tensors")
        return rc

    def _background_save(self, system: str) -> Callable[[], bool]:
        """Start one background save of ``system``; whether it is done."""
        if system in ("nostall_async", "nostall_overlap", REMOTE):
            mgr = self._async_mgr(system)
            assert mgr is not None
            mgr.finalize_pending_saves()
            done: Callable[[], bool] = mgr.save(10_000, self.state).done
            return done
        d = os.path.join(self.root, system, "train")
        if system == "dcp_async_thread":
            return self.dcp.async_save(self.state, checkpoint_id=d).done
        r = self._dcp_process_save(d)
        return (getattr(r, "upload_completion", None) or r).done

    def training(self) -> Dict[str, Any]:
        """The training-side cost of a background save: step times while it writes, against a baseline."""
        training: Dict[str, Any] = {}
        loop = self.loop
        for _ in range(5):
            loop.step()
        baselines = []
        for system in [s for s in self.systems if s in ASYNC]:
            self.say(f"training steps while {system} writes")
            self.dist.barrier()  # the baseline right before, under the same conditions
            base = statistics.median([loop.step() for _ in range(30)])
            baselines.append(base)
            self.dist.barrier()
            done = self._background_save(system)
            steps: List[float] = []
            while not done() or len(steps) < 3:
                steps.append(loop.step())
                if len(steps) > 100_000:
                    break
            training[system] = {"step_s": statistics.median(steps), "steps": len(steps), "baseline_step_s": base,
                                "slowdown": statistics.median(steps) / base}
        training["baseline_step_s"] = statistics.median(baselines) if baselines else float("nan")
        for m in (self.mgr_async, self.mgr_overlap, self.mgr_remote):
            if m is not None:
                m.finalize_pending_saves()
        return training

    def close(self) -> None:
        for m in (self.mgr_sync, self.mgr_async, self.mgr_overlap, self.mgr_remote):
            if m is not None:
                m.close()
        if self.dcp_proc_stager is not None:
            try:
                self.dcp_proc_stager.close()
            except Exception:
                pass

    def main(self) -> Dict[str, Any]:
        self.saves()
        small = self.small_states()
        loads = self.loads() if self.cfg["loads"] else {}
        replica_check = self.replica_check() if "nostall_sync" in self.systems else {}
        training = self.training() if self.cfg["train"] else {}
        self.close()  # (the other systems' staging areas released first)
        leave_s = None
        if self.cfg.get("memory_dir"):  # the restore section's checkpoints, for the fresh processes that restore
            self.say("restore section: saving to the persistent root, the memory tier and DCP")
            leave_s = restore_section.leave_snapshots(self.nostall, self.dcp, self.state, self.root,
                                                      self.cfg["memory_dir"])
        return {"bytes": self.nbytes, "systems": self.res, "loads": loads, "training": training,
                "replica_check": replica_check, "small": small, "restore_leave_s": leave_s}


def _time_replica_check(state: Dict[str, Any], rank: int, world: int, reps: int, dist: Any) -> Dict[str, Any]:
    """Time the check a save runs with check_replicas (checksum this rank's copies, gather, compare)."""
    from nostall.planning import replicas
    from nostall.core.model import flatten
    from nostall.planning.plan import local_meta

    flat = flatten(state)
    metas: List[Any] = [None] * world
    dist.all_gather_object(metas, local_meta(flat))
    shared = replicas.shared_keys(metas)
    keys = replicas.copies_of(shared, world)[rank]
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        mine = replicas.digests(flat, keys)
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        assert replicas.disagreements(shared, gathered) is None
        times.append(time.perf_counter() - t0)
    nbytes = sum(flat.tensors[k].data.numel() * flat.tensors[k].data.element_size() for k in keys)
    return {"check_s": times, "bytes": nbytes, "keys": len(shared)}


# --------------------------------------------------------------------------- the launcher


def run_bench(ranks: int, mb: int, reps: int, systems: List[str], root: Optional[str], loads: bool = True,
              train: bool = True, timeout: float = 1800.0, remote: Optional[str] = None,
              storage_options: Optional[Dict[str, Any]] = None, compute_ms: float = 200.0,
              progress: bool = False, small_mb: Sequence[int] = (), small_reps: int = 10, restore: bool = False,
              memory_dir: Optional[str] = None) -> Dict[str, Any]:
    """Run the benchmark; returns the JSON-able result (see docs/benchmarks.md).

    ``remote``: a URL under which ``nostall_async_remote`` saves (in a fresh
    ``bench-<id>`` prefix, removed afterwards). ``progress``: a line on stderr
    per system and repetition (``[bench] nostall_async rep 2/3: stall ...``).
    ``small_mb``: the small states (MiB per rank) whose async stall is timed
    ``small_reps`` times, after the rest (the result's ``small``).
    ``restore``: the restore section last (the result's ``restore``), its
    memory tier in a directory of its own under ``memory_dir`` (default
    ``/dev/shm``), removed afterwards.
    Interrupted (Ctrl-C), it returns what rank 0 had measured, with
    ``"interrupted": True``.
    """
    import torch

    own = root is None
    root = root or tempfile.mkdtemp(prefix="nostall-bench-")
    if remote is None and REMOTE in systems:
        raise ValueError(f"{REMOTE} needs a remote URL")
    if remote is not None and REMOTE not in systems:
        systems = list(systems) + [REMOTE]
    run_id = f"bench-{os.getpid()}-{int(time.time())}"
    cfg = {"mb": mb, "reps": reps, "systems": systems, "loads": loads, "train": train, "remote": remote,
           "storage_options": storage_options, "run_id": run_id, "compute_ms": compute_ms,
           "progress": progress, "small_mb": list(small_mb), "small_reps": small_reps}
    memory = MemoryDir(memory_dir) if restore else None
    cfg["memory_dir"] = memory.path if memory is not None else None
    if progress:
        print(f"[bench] starting {ranks} ranks x {mb} MiB, {reps} repetition(s) after a first save of each of "
              f"{', '.join(list(LIMITS) + list(systems))}", file=sys.stderr, flush=True)
    interrupted = False
    restored: Dict[str, Any] = {}
    try:
        per_rank = gather_ranks(_worker, ranks, root, cfg, timeout)
        if memory is not None:
            if progress:
                print(f"[bench] restore section: {ranks} fresh rank process(es) restore", file=sys.stderr, flush=True)
            restored = restore_section.run_restore(ranks, root, mb, memory.path, max(1, reps), timeout)
            restored["leave_s"] = per_rank[0]["restore_leave_s"]  # the section's saves, in the bench's ranks
    except Interrupted as e:  # what rank 0 had measured (nothing when it was still starting)
        interrupted = True
        per_rank = {0: e.partial.get(0) or {"bytes": 0, "systems": {}, "small": {}}}
        per_rank[0].update(loads={}, training={})
    finally:
        if memory is not None:
            memory.close()  # the holder is gone (released by the restarted managers), the directory removed
            restored["holders_stopped"] = memory.signalled
        if own:
            shutil.rmtree(root, ignore_errors=True)
        if remote is not None:
            _remove_remote(f"{remote.rstrip('/')}/{run_id}", storage_options)
    r0 = per_rank[0]
    return {
        "interrupted": interrupted,
        "config": {"ranks": ranks, "mb_per_rank": mb, "bytes_per_rank": r0["bytes"], "reps": reps,
                   "systems": systems, "backend": "gloo"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "cuda": torch.cuda.is_available()},
        "systems": {name: r0["systems"][name] for name in list(LIMITS) + systems if name in r0["systems"]},
        "per_rank": {str(k): v["systems"] for k, v in per_rank.items()},
        "loads": r0["loads"],
        "training": r0["training"],
        "replica_check": r0.get("replica_check", {}),
        "small": r0.get("small", {}),
        "restore": restored,
    }


def format_table(out: Dict[str, Any]) -> str:
    c = out["config"]
    lines = [f"{c['ranks']} ranks x {c['bytes_per_rank'] / 2**20:.0f} MiB, {c['reps']} repetitions "
             f"(medians, rank 0; min-max in brackets)", ""]
    lines.append(f"{'system':<20}{'stall':>22}{'until durable':>24}{'GB/s':>7}{'peak MB':>9}{'helper pk':>10}"
                 f"{'first stall':>13}")
    s = out["systems"]
    lines += [_row(name, r) for name, r in s.items()]
    lines.append("")
    lines += _small_table(out.get("small") or {})
    if out.get("interrupted"):
        lines += ["interrupted (Ctrl-C): the figures above are what was measured before it", ""]
        s = {name: r for name, r in s.items() if r["stall_s"]}  # no ratios of what was not measured
    ns = s.get("nostall_async")
    if ns and "nostall_overlap" in s:
        ov = s["nostall_overlap"]
        during, before = median([c[0] for c in ov["compute_ms"]]), median([c[1] for c in ov["compute_ms"]])
        ratio = median(ov['stall_s']) / median(ns['stall_s'])
        lines.append(f"  nostall_overlap stall / nostall_async stall = {ratio:.3f}"
                     f" (forward/backward while it copies: {during:.2f} ms, x{during / before:.2f} of {before:.2f} ms"
                     " after the save)")
    if ns and REMOTE in s:
        ratio = median(s[REMOTE]['stall_s']) / median(ns['stall_s'])
        lines.append(f"  {REMOTE} stall / nostall_async stall = {ratio:.3f}")
    if ns:
        ref = median(ns["stall_s"])
        for other in ("nostall_sync", "dcp_sync", "dcp_async_thread", "dcp_async_process", "torch_save", "copy"):
            if other in s:
                lines.append(f"  nostall_async stall / {other} stall = {ref / median(s[other]['stall_s']):.3f}")
    if "nostall_sync" in s and "dcp_sync" in s:
        lines.append(f"  nostall_sync / dcp_sync (until durable) = "
                     f"{median(s['nostall_sync']['commit_s']) / median(s['dcp_sync']['commit_s']):.3f}")
    if "nostall_sync" in s and "write" in s:
        lines.append(f"  nostall_sync / write floor (until durable) = "
                     f"{median(s['nostall_sync']['commit_s']) / median(s['write']['commit_s']):.3f}")
    rc = out.get("replica_check")
    if rc and "nostall_sync" in s:
        check = median(rc["check_s"])
        lines.append(f"  replica check (first save, or a changed plan): {check * 1e3:.1f} ms for "
                     f"{rc['bytes'] / 2**20:.1f} MiB replicated on this rank ({rc['keys']} keys); "
                     f"/ nostall_sync stall = {check / median(s['nostall_sync']['stall_s']):.3f}")
    if out["loads"]:
        lines.append("")
        for name, r in out["loads"].items():
            rs = f", resharded {median(r['resharded_s']) * 1e3:.1f} ms" if r["resharded_s"] else ""
            lines.append(f"  load {name:<11} same layout {median(r['same_layout_s']) * 1e3:.1f} ms{rs}")
    t = out["training"]
    if t:
        lines.append("")
        lines.append(f"  training step without a save: {t['baseline_step_s'] * 1e3:.2f} ms")
        for name, r in t.items():
            if name != "baseline_step_s":
                lines.append(f"  training step while {name} writes: {r['step_s'] * 1e3:.2f} ms "
                             f"(x{r['slowdown']:.2f} of {r['baseline_step_s'] * 1e3:.2f} ms just before; "
                             f"{r['steps']} steps)")
    if out.get("restore", {}).get("seconds"):
        lines += [""] + restore_section.table(out["restore"])
    return "\n".join(lines)


def _row(name: str, r: Dict[str, Any]) -> str:
    """A system's row of the table ("-" for what was not measured: an interrupted run)."""
    st, cm = r["stall_s"], r["commit_s"]
    first = f"{r['first_save']['stall_s'] * 1e3:>10.0f} ms" if r["first_save"] else f"{'-':>13}"
    if not st:
        return f"{name:<20}{'-':>22}{'-':>24}{'-':>7}{'-':>9}{'-':>10}{first}"
    return (f"{name:<20}{median(st) * 1e3:>10.1f} ms ({min(st) * 1e3:.0f}-{max(st) * 1e3:.0f})"
            f"{median(cm) * 1e3:>12.1f} ms ({min(cm) * 1e3:.0f}-{max(cm) * 1e3:.0f})"
            f"{median(r['throughput_gbps']):>7.2f}{median(r['rss_mb']):>9.0f}{median(r['helper_rss_mb']):>10.0f}{first}")


def _small_table(small: Dict[str, Any]) -> List[str]:
    """The small-state rows: nostall's async stall beside DCP's and the copy floor (medians, rank 0)."""
    if not small:
        return []
    lines = ["small states, async stall (medians of rank 0, each save after the last is durable)",
             f"{'per rank':<10}{'saves':>6}{'copy':>10}{'nostall_async':>15}{'dcp_async_thread':>18}"
             f"{'nostall/dcp':>13}{'nostall-copy':>14}"]
    for r in small.values():
        if not r["nostall_async"]:
            continue  # interrupted before its saves
        ns, dc, cp = (median(r[k]) * 1e3 for k in SMALL[1:] + SMALL[:1])
        lines.append(f"{r['bytes'] / 2**20:>5.1f} MiB{len(r['nostall_async']):>6}{cp:>7.2f} ms{ns:>12.2f} ms"
                     f"{dc:>15.2f} ms{ns / dc if dc else float('nan'):>13.2f}{ns - cp:>11.2f} ms")
    return lines + [""]


def plot(out: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = out["systems"]
    names = [n for n in s if n not in LIMITS]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, field, title, limit in ((axes[0], "stall_s", "time the training loop is blocked", "copy"),
                                    (axes[1], "commit_s", "time until the checkpoint is durable", "write")):
        vals = [median(s[n][field]) for n in names]
        ax.bar(range(len(names)), vals, color=["tab:blue" if n.startswith("nostall") else "tab:gray" for n in names])
        ax.axhline(median(s[limit][field]), color="tab:red", linestyle="--", label=f"limit: {limit}")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_ylabel("seconds (median)")
        ax.set_title(title)
        ax.legend()
    c = out["config"]
    fig.suptitle(f"{c['ranks']} ranks x {c['bytes_per_rank'] / 2**20:.0f} MiB per rank, {c['reps']} reps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _remove_remote(url: str, storage_options: Optional[Dict[str, Any]]) -> None:
    from nostall.storage import remote

    try:
        fs, key = remote.filesystem(url, storage_options)
        fs.rm(key, recursive=True)
    except Exception as e:  # the figures are what matters; say what is left behind
        print(f"could not remove {url}: {e}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    """``nostall bench [OPTIONS]`` (:func:`nostall.tools.bench.main` dispatches the other modes)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in MODES:  # python -m nostall.tools.bench.compare MODE ...
        return bench_main(argv)

    ap = argparse.ArgumentParser(prog="nostall bench",
                                 description="Benchmark nostall side by side with PyTorch DCP, torch.save and the "
                                             "machine's limits (a copy and a sequential write of the same bytes). "
                                             "Progress goes to stderr, the table to stdout. Other modes: "
                                             "'nostall bench train -h' (what a training loop pays per save, end "
                                             "to end), 'nostall bench scale -h' (cost as the work grows), "
                                             "'nostall bench incremental -h' (what incremental saves write).")
    ap.add_argument("--ranks", type=int, default=2, metavar="N",
                    help="processes (gloo ranks on this machine), each saving its shard of the state "
                         "(default: %(default)s)")
    ap.add_argument("--mb-per-rank", type=int, default=512, metavar="MIB",
                    help="MiB of training state per rank: sharded parameters plus two optimizer moments each "
                         "(default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, metavar="N",
                    help="timed repetitions after a first (reported apart) save (default: %(default)s)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), metavar="LIST",
                    help="comma-separated subset of %(default)s (default: all); the copy and write limits always run")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    ap.add_argument("--json", default=None, help="write every figure to this file (default: none)")
    ap.add_argument("--plot", default=None, help="draw stall and time-to-durable per system (PNG; default: none)")
    ap.add_argument("--no-load", action="store_true", help="skip the load measurements")
    ap.add_argument("--no-train", action="store_true", help="skip the training-interference measurement")
    ap.add_argument("--restore", action="store_true",
                    help="also the restore section: fresh processes restore the state after a trainer crash from "
                         "the memory tier and from the persistent root, beside DCP's load and a memcpy (about 40 s "
                         "more at the default size; default: off)")
    ap.add_argument("--memory-dir", default=None, metavar="DIR",
                    help="the restore section's memory tier under this tmpfs directory (default: /dev/shm)")
    ap.add_argument("--compute-ms", type=float, default=200.0, metavar="MS",
                    help="nostall_overlap: forward/backward time between save() and the optimizer step "
                         "(default: %(default)s)")
    ap.add_argument("--remote", default=None,
                    help="also save to this object-storage URL (nostall_async_remote; default: none)")
    ap.add_argument("--storage-options", type=storage_options_arg, default=None, metavar="JSON",
                    help="fsspec options for --remote, as a JSON object")
    ap.add_argument("--small-mb", default="1,16", metavar="LIST",
                    help="small states (comma-separated MiB per rank) whose async stall is timed beside DCP's and "
                         "the copy floor, after the rest ('' for none; default: %(default)s)")
    ap.add_argument("--small-reps", type=int, default=20, metavar="N",
                    help="saves of each small state after a first (default: %(default)s)")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress lines on stderr (default: one per system and repetition)")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s) {bad}; choose from {SYSTEMS}")
    out = run_bench(args.ranks, args.mb_per_rank, args.reps, systems, args.dir, loads=not args.no_load,
                    train=not args.no_train, remote=args.remote, storage_options=args.storage_options,
                    compute_ms=args.compute_ms, progress=not args.quiet,
                    small_mb=[int(x) for x in args.small_mb.split(",") if x], small_reps=args.small_reps,
                    restore=args.restore, memory_dir=args.memory_dir)
    write_outputs(out, format_table(out), args.json, None if out["interrupted"] else args.plot, plot)
    return 130 if out["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
