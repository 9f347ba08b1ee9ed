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

For each: stall (how long the call kept the training loop from modifying its
state), time until durable/committed, throughput, resident memory of the rank
and of its helper processes; the first save separately. Then loads (same
layout, and resharded to full tensors on every rank) and the training-side
cost: step time of a small CPU model while a background save is written,
relative to no save. See docs/benchmarks.md for the JSON schema.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

SYSTEMS = ("nostall_sync", "nostall_async", "nostall_overlap", "dcp_sync", "dcp_async_thread", "dcp_async_process",
           "torch_save")
REMOTE = "nostall_async_remote"  # only with --remote
LIMITS = ("copy", "write")
ASYNC = ("nostall_async", "nostall_overlap", REMOTE, "dcp_async_thread", "dcp_async_process")


# --------------------------------------------------------------------------- helpers (in the ranks)


def _rss_mb(pid: int, field: str = "VmHWM") -> float:
    """Peak (VmHWM, since the last reset) or current (VmRSS) resident memory of a process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children() -> List[int]:
    """This process's children (writer processes, DCP's executor)."""
    me, out = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == me:
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _reset_peaks() -> None:
    """Restart the peak-RSS counters of this process and its children (Linux clear_refs 5)."""
    for pid in [os.getpid()] + _children():
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _make_state(rank: int, world: int, mb: int) -> Tuple[Dict[str, Any], int]:
    """Parameters (DTensor Shard(0) on a 1-D mesh, some replicated) and two moments each."""
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


def _locals(state: Dict[str, Any]) -> List[Any]:
    out = []

    def rec(v: Any) -> None:
        if isinstance(v, dict):
            for x in v.values():
                rec(x)
        elif hasattr(v, "to_local"):
            out.append(v.to_local())
        elif hasattr(v, "numel"):
            out.append(v)

    rec(state)
    return out


def _full_template(state: Dict[str, Any]) -> Dict[str, Any]:
    """The same keys as plain full tensors: a resharded load (every rank reads everything)."""
    import torch

    def rec(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: rec(x) for k, x in v.items()}
        if hasattr(v, "to_local"):
            return torch.zeros(v.shape, dtype=v.dtype)
        if hasattr(v, "numel"):
            return torch.zeros_like(v)
        return v

    return rec(state)


def _zero_template(state: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    def rec(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: rec(x) for k, x in v.items()}
        if isinstance(v, DTensor):
            return DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                      shape=v.shape, stride=v.stride())
        if hasattr(v, "numel"):
            return torch.zeros_like(v)
        return v

    return rec(state)


class _TrainLoop:
    """A small CPU model whose step time shows interference from a background save."""

    def __init__(self) -> None:
        import torch

        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(64, 512)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.forward_backward()
        self.opt.step()
        return time.perf_counter() - t0

    def forward_backward(self) -> float:
        t0 = time.perf_counter()
        loss = self.model(self.x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        return time.perf_counter() - t0

    def compute(self, seconds: float) -> List[float]:
        """Forward/backward passes for about ``seconds`` (one at least); the time of each."""
        times = [self.forward_backward()]
        while sum(times) < seconds:
            times.append(self.forward_backward())
        return times


def _say(cfg: Dict[str, Any], rank: int, text: str) -> None:
    """A progress line on stderr (rank 0 only, when the launcher asked for them)."""
    if rank == 0 and cfg.get("progress"):
        print(f"[bench] {text}", file=sys.stderr, flush=True)


def _dcp_subprocess_quietly(*args: Any, **kwargs: Any) -> Any:
    """DCP's process executor's background process (see :func:`_quiet_dcp_process`), with its
    root logger at WARNING once DCP has set it up."""
    import logging

    from torch.distributed.checkpoint import _async_process_executor as ape

    setup = ape._init_logger

    def quiet(rank: int) -> None:
        setup(rank)
        logging.getLogger().setLevel(logging.WARNING)

    ape._init_logger = quiet  # type: ignore[assignment]
    return ape._AsyncCheckpointProcess._checkpointing_subprocess(*args, **kwargs)


def _quiet_dcp_process() -> None:
    """Keep DCP's INFO lines off the bench's stderr.

    ``dcp.async_save`` with the process executor spawns a background process
    that sets the *root* logger to INFO with its own stderr handler and logs
    every request (about two dozen lines per run). That process runs torch's
    ``_AsyncCheckpointProcess._checkpointing_subprocess``; it is given
    :func:`_dcp_subprocess_quietly` instead, which runs the same code with the
    level raised to WARNING (warnings and errors still show). Private torch
    API: when it is not there, nothing is changed.
    """
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape
    except ImportError:
        return
    cls = getattr(ape, "_AsyncCheckpointProcess", None)
    if cls is None or not hasattr(cls, "_checkpointing_subprocess") or not hasattr(ape, "_init_logger"):
        return
    cls._checkpointing_subprocess = staticmethod(_dcp_subprocess_quietly)


# --------------------------------------------------------------------------- one rank


def _worker(rank: int, world: int, init: str, root: str, cfg: Dict[str, Any], q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import nostall

    for name in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.logging_handlers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    _quiet_dcp_process()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    try:
        q.put((rank, _run_rank(rank, world, root, cfg, torch, dist, dcp, nostall)))
    except BaseException as e:  # report, so the launcher does not wait forever
        import traceback

        q.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))
    finally:
        dist.destroy_process_group()


def _run_rank(rank: int, world: int, root: str, cfg: Dict[str, Any], torch: Any, dist: Any, dcp: Any,
              nostall: Any) -> Dict[str, Any]:
    systems: List[str] = cfg["systems"]
    reps: int = cfg["reps"]
    state, nbytes = _make_state(rank, world, cfg["mb"])
    tensors = _locals(state)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.zero_()  # touched once: the copy floor never pays page faults
    raw = os.path.join(root, "raw")
    os.makedirs(raw, exist_ok=True)

    res: Dict[str, Dict[str, Any]] = {
        s: {"stall_s": [], "commit_s": [], "throughput_gbps": [], "rss_mb": [], "helper_rss_mb": [], "first_save": None}
        for s in list(systems) + list(LIMITS)
    }
    # No retention inside the timed region: every system's old checkpoints are
    # deleted between repetitions, outside the timers (the same work for all).
    mgr_sync = nostall.CheckpointManager(os.path.join(root, "nostall_sync")) if "nostall_sync" in systems else None
    mgr_async = (nostall.CheckpointManager(os.path.join(root, "nostall_async"), async_save=True)
                 if "nostall_async" in systems else None)
    if mgr_async is not None:  # set-up, as docs/integration.md advises: plan, start the writer, map the area
        mgr_async.prepare(state)
    loop = _TrainLoop()
    mgr_overlap = None
    if "nostall_overlap" in systems:
        mgr_overlap = nostall.CheckpointManager(os.path.join(root, "nostall_overlap"), async_save=True, overlap=True)
        mgr_overlap.attach(loop.opt)  # its step() waits for the copy, as a trainer's would
        mgr_overlap.prepare(state)
        res["nostall_overlap"]["compute_ms"] = []  # [forward/backward meanwhile, just before], per save
    mgr_remote = None
    if REMOTE in systems:
        url = f"{cfg['remote'].rstrip('/')}/{cfg['run_id']}"
        mgr_remote = nostall.CheckpointManager(url, async_save=True, keep_last=1,
                                               storage_options=cfg["storage_options"],
                                               local_staging_dir=os.path.join(root, "remote-staging"))
    compute_s = cfg.get("compute_ms", 200) / 1e3
    dcp_proc_stager = None
    if "dcp_async_process" in systems:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # DCP's recommended CPU set-up: a reusable shared-memory staging copy, process executor
        dcp_proc_stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                       use_shared_memory=True, use_async_staging=False,
                                                       use_non_blocking_copy=torch.cuda.is_available()))

    def copy_floor() -> Tuple[float, float]:
        t0 = time.perf_counter()
        pos = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            buf[pos : pos + n].view(t.dtype).view(t.shape).copy_(t)
            pos += n
        d = time.perf_counter() - t0
        return d, d

    def write_floor() -> Tuple[float, float]:
        t0 = time.perf_counter()
        path = os.path.join(raw, f"rank{rank}.bin")
        from nostall.storage import files as storage

        storage.write_file(path, [memoryview(buf.numpy())])
        d = time.perf_counter() - t0
        return d, d

    def run(system: str, rep: int) -> Tuple[float, float]:
        d = os.path.join(root, system, f"r{rep}")
        if system == "nostall_sync":
            assert mgr_sync is not None
            t0 = time.perf_counter()
            mgr_sync.save(rep, state)
            x = time.perf_counter() - t0
            return x, x
        if system in ("nostall_async", REMOTE):
            mgr = mgr_async if system == "nostall_async" else mgr_remote
            assert mgr is not None
            mgr.finalize_pending_saves()
            dist.barrier()
            t0 = time.perf_counter()
            h = mgr.save(rep, state)
            stall = time.perf_counter() - t0
            h.result()
            return stall, time.perf_counter() - t0
        if system == "nostall_overlap":
            assert mgr_overlap is not None
            mgr_overlap.finalize_pending_saves()
            dist.barrier()
            t0 = time.perf_counter()
            h = mgr_overlap.save(rep, state)
            returned = time.perf_counter() - t0
            fb = loop.compute(compute_s)  # the next forward/backward, while the copy runs
            loop.opt.step()  # waits for what is left of the copy
            st = h.result()
            done_s = time.perf_counter() - t0
            if rep:  # the first save is reported apart; the baseline: once the save is done, outside the timers
                base = statistics.median(loop.compute(compute_s))
                res[system]["compute_ms"].append([statistics.median(fb) * 1e3, base * 1e3])
            return returned + st.staged_wait_s, done_s
        if system == "dcp_sync":
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=d)
            x = time.perf_counter() - t0
            return x, x
        if system == "dcp_async_thread":
            t0 = time.perf_counter()
            f = dcp.async_save(state, checkpoint_id=d)
            stall = time.perf_counter() - t0
            f.result()
            return stall, time.perf_counter() - t0
        if system == "dcp_async_process":
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            t0 = time.perf_counter()
            r = dcp.async_save(state, checkpoint_id=d, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                               async_stager=dcp_proc_stager)
            staged = getattr(r, "staging_completion", None)
            if staged is not None:
                staged.result()  # the state may be modified only once staged
            stall = time.perf_counter() - t0
            (getattr(r, "upload_completion", None) or r).result()
            return stall, time.perf_counter() - t0
        if system == "torch_save":
            path = os.path.join(root, system, f"rank{rank}-r{rep}.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            local = {f"t{i}": t for i, t in enumerate(tensors)}
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(local, f)
                f.flush()
                os.fsync(f.fileno())
            x = time.perf_counter() - t0
            return x, x
        if system == "copy":
            return copy_floor()
        if system == "write":
            return write_floor()
        raise ValueError(system)

    def helper_rss(system: str) -> float:
        mgr = {"nostall_async": mgr_async, "nostall_overlap": mgr_overlap, REMOTE: mgr_remote}.get(system)
        if mgr is not None and mgr.writer_pid:
            return _rss_mb(mgr.writer_pid)
        return sum(_rss_mb(p) for p in _children()) if system == "dcp_async_process" else 0.0

    order = list(LIMITS) + list(systems)
    for rep in range(reps + 1):
        for system in order:
            _reset_peaks()
            dist.barrier()
            stall, commit = run(system, rep)
            dist.barrier()
            what = "first run (reported apart)" if rep == 0 else f"rep {rep}/{reps}"
            _say(cfg, rank, f"{system} {what}: stall {stall * 1e3:.1f} ms, until durable {commit * 1e3:.1f} ms")
            r = res[system]
            if rep == 0:
                r["first_save"] = {"stall_s": stall, "commit_s": commit}
                continue
            r["stall_s"].append(stall)
            r["commit_s"].append(commit)
            r["throughput_gbps"].append(nbytes / commit / 1e9 if commit > 0 else 0.0)
            r["rss_mb"].append(_rss_mb(os.getpid()))
            r["helper_rss_mb"].append(helper_rss(system))
            if rank == 0:  # drop the previous repetition's checkpoint, outside the timers
                for old in (os.path.join(root, system, f"r{rep - 1}"), os.path.join(root, system, f"step_{rep - 1}")):
                    shutil.rmtree(old, ignore_errors=True)
            if system == "torch_save":
                old = os.path.join(root, system, f"rank{rank}-r{rep - 1}.pt")
                if os.path.exists(old):
                    os.unlink(old)

    # ---- loads: same layout, and resharded to full tensors on every rank
    loads: Dict[str, Dict[str, List[float]]] = {}
    if cfg["loads"]:
        last = reps
        targets = {
            "nostall": lambda tmpl: mgr_sync.load(tmpl) if mgr_sync else None,
            "dcp": lambda tmpl: dcp.load(tmpl, checkpoint_id=os.path.join(root, "dcp_sync", f"r{last}")),
        }
        for name, fn in targets.items():
            if (name == "nostall" and mgr_sync is None) or (name == "dcp" and "dcp_sync" not in systems):
                continue
            _say(cfg, rank, f"loading from {name} ({max(1, reps)} x same layout, resharded)")
            loads[name] = {"same_layout_s": [], "resharded_s": []}
            for _ in range(max(1, reps)):
                for kind, make in (("same_layout_s", _zero_template), ("resharded_s", _full_template)):
                    tmpl = make(state)
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn(tmpl)
                    loads[name][kind].append(time.perf_counter() - t0)
        # raw read of the write floor's file
        loads["read_floor"] = {"same_layout_s": [], "resharded_s": []}
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            with open(os.path.join(raw, f"rank{rank}.bin"), "rb", buffering=0) as f:
                while f.readinto(memoryview(buf.numpy())[: 64 << 20]):
                    pass
            loads["read_floor"]["same_layout_s"].append(time.perf_counter() - t0)

    # ---- the replica check (check_replicas): what a first save, or one whose plan changed, pays for it
    replica_check: Dict[str, Any] = {}
    if "nostall_sync" in systems:
        replica_check = _time_replica_check(state, rank, world, max(1, reps), dist)
        _say(cfg, rank, f"replica check: {_med(replica_check['check_s']) * 1e3:.1f} ms over "
                        f"{replica_check['bytes'] / 2**20:.1f} MiB of replicated tensors")

    # ---- training-side cost of a background save
    training: Dict[str, Any] = {}
    if cfg["train"]:
        for _ in range(5):
            loop.step()
        baselines = []
        for system in [s for s in systems if s in ASYNC]:
            _say(cfg, rank, f"training steps while {system} writes")
            dist.barrier()  # the baseline right before, under the same conditions
            base = statistics.median([loop.step() for _ in range(30)])
            baselines.append(base)
            dist.barrier()
            d = os.path.join(root, system, "train")
            if system in ("nostall_async", "nostall_overlap", REMOTE):
                mgr = {"nostall_async": mgr_async, "nostall_overlap": mgr_overlap, REMOTE: mgr_remote}[system]
                assert mgr is not None
                mgr.finalize_pending_saves()
                h = mgr.save(10_000, state)
                done: Callable[[], bool] = h.done
            elif system == "dcp_async_thread":
                f = dcp.async_save(state, checkpoint_id=d)
                done = f.done
            else:
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                r = dcp.async_save(state, checkpoint_id=d, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                   async_stager=dcp_proc_stager)
                fut = getattr(r, "upload_completion", None) or r
                done = fut.done
            steps: List[float] = []
            while not done() or len(steps) < 3:
                steps.append(loop.step())
                if len(steps) > 100_000:
                    break
            training[system] = {"step_s": statistics.median(steps), "steps": len(steps), "baseline_step_s": base,
                                "slowdown": statistics.median(steps) / base}
        training["baseline_step_s"] = statistics.median(baselines) if baselines else float("nan")
        for m in (mgr_async, mgr_overlap, mgr_remote):
            if m is not None:
                m.finalize_pending_saves()

    for m in (mgr_sync, mgr_async, mgr_overlap, mgr_remote):
        if m is not None:
            m.close()
    if dcp_proc_stager is not None:
        try:
            dcp_proc_stager.close()
        except Exception:
            pass
    return {"bytes": nbytes, "systems": res, "loads": loads, "training": training, "replica_check": replica_check}


def _time_replica_check(state: Dict[str, Any], rank: int, world: int, reps: int, dist: Any) -> Dict[str, Any]:
    """Time the check a save runs with check_replicas (checksum this rank's copies, gather, compare)."""
    from nostall.planning import replicas
    from nostall.core.model import flatten
    from nostall.planning.plan import local_meta

    flat = flatten(state)
    metas: List[Any] = [None] * world
    dist.all_gather_object(metas, local_meta(flat))
    shared = replicas.shared_keys(metas)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        mine = replicas.digests(flat, shared, rank)
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        assert replicas.disagreements(shared, gathered) is None
        times.append(time.perf_counter() - t0)
    nbytes = sum(flat.tensors[k].data.numel() * flat.tensors[k].data.element_size() for k, rs in shared.items()
                 if rank in rs)
    return {"check_s": times, "bytes": nbytes, "keys": len(shared)}


# --------------------------------------------------------------------------- the launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gather_ranks(worker: Callable[..., None], ranks: int, root: str, cfg: Dict[str, Any], timeout: float,
                 what: str = "benchmark") -> Dict[int, Any]:
    """Run ``worker(rank, ranks, init, root, cfg, queue)`` in ``ranks`` spawned processes and collect their results.

    Every benchmark mode launches its ranks with this: ``init`` is a
    ``tcp://127.0.0.1`` address for their gloo group, and each rank puts
    ``(rank, result)`` on ``queue`` (a dict with ``"error"`` when it failed).
    Raises if a rank fails or dies, or the whole run outlasts ``timeout``
    seconds; no rank process is left on return.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    pc = mp.start_processes(worker, args=(ranks, init, root, cfg, q), nprocs=ranks, join=False, start_method="spawn")
    per_rank: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(per_rank) < ranks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"the {what} did not finish within {timeout:.0f}s")
            try:
                rank, r = q.get(timeout=min(5.0, left))
            except Exception:
                if any(p.exitcode not in (None, 0) for p in pc.processes):
                    raise RuntimeError(f"a {what} rank died") from None
                continue
            if isinstance(r, dict) and "error" in r:
                raise RuntimeError(f"rank {rank} failed: {r['error']}")
            per_rank[rank] = r
        pc.join(60)
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    return per_rank


def run_bench(ranks: int, mb: int, reps: int, systems: List[str], root: Optional[str], loads: bool = True,
              train: bool = True, timeout: float = 1800.0, remote: Optional[str] = None,
              storage_options: Optional[Dict[str, Any]] = None, compute_ms: float = 200.0,
              progress: bool = False) -> Dict[str, Any]:
    """Run the benchmark; returns the JSON-able result (see docs/benchmarks.md).

    ``remote``: a URL under which ``nostall_async_remote`` saves (in a fresh
    ``bench-<id>`` prefix, removed afterwards). ``progress``: a line on stderr
    per system and repetition (``[bench] nostall_async rep 2/3: stall ...``).
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
           "progress": progress}
    if progress:
        print(f"[bench] starting {ranks} ranks x {mb} MiB, {reps} repetition(s) after a first save of each of "
              f"{', '.join(list(LIMITS) + list(systems))}", file=sys.stderr, flush=True)
    try:
        per_rank = gather_ranks(_worker, ranks, root, cfg, timeout)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
        if remote is not None:
            _remove_remote(f"{remote.rstrip('/')}/{run_id}", storage_options)
    r0 = per_rank[0]
    return {
        "config": {"ranks": ranks, "mb_per_rank": mb, "bytes_per_rank": r0["bytes"], "reps": reps,
                   "systems": systems, "backend": "gloo"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "cuda": torch.cuda.is_available()},
        "systems": {name: r0["systems"][name] for name in list(LIMITS) + systems},
        "per_rank": {str(k): v["systems"] for k, v in per_rank.items()},
        "loads": r0["loads"],
        "training": r0["training"],
        "replica_check": r0.get("replica_check", {}),
    }


def _med(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def format_table(out: Dict[str, Any]) -> str:
    c = out["config"]
    lines = [f"{c['ranks']} ranks x {c['bytes_per_rank'] / 2**20:.0f} MiB, {c['reps']} repetitions "
             f"(medians, rank 0; min-max in brackets)", ""]
    lines.append(f"{'system':<20}{'stall':>22}{'until durable':>24}{'GB/s':>7}{'peak MB':>9}{'helper pk':>10}"
                 f"{'first stall':>13}")
    s = out["systems"]
    for name, r in s.items():
        st, cm = r["stall_s"], r["commit_s"]
        fs = r["first_save"]["stall_s"] if r["first_save"] else float("nan")
        lines.append(
            f"{name:<20}{_med(st) * 1e3:>10.1f} ms ({min(st) * 1e3:.0f}-{max(st) * 1e3:.0f})"
            f"{_med(cm) * 1e3:>12.1f} ms ({min(cm) * 1e3:.0f}-{max(cm) * 1e3:.0f})"
            f"{_med(r['throughput_gbps']):>7.2f}{_med(r['rss_mb']):>9.0f}{_med(r['helper_rss_mb']):>10.0f}"
            f"{fs * 1e3:>10.0f} ms"
        )
    lines.append("")
    ns = s.get("nostall_async")
    if ns and "nostall_overlap" in s:
        ov = s["nostall_overlap"]
        during, before = _med([c[0] for c in ov["compute_ms"]]), _med([c[1] for c in ov["compute_ms"]])
        lines.append(f"  nostall_overlap stall / nostall_async stall = {_med(ov['stall_s']) / _med(ns['stall_s']):.3f}"
                     f" (forward/backward while it copies: {during:.2f} ms, x{during / before:.2f} of {before:.2f} ms"
                     " after the save)")
    if ns and REMOTE in s:
        lines.append(f"  {REMOTE} stall / nostall_async stall = {_med(s[REMOTE]['stall_s']) / _med(ns['stall_s']):.3f}")
    if ns:
        ref = _med(ns["stall_s"])
        for other in ("nostall_sync", "dcp_sync", "dcp_async_thread", "dcp_async_process", "torch_save", "copy"):
            if other in s:
                lines.append(f"  nostall_async stall / {other} stall = {ref / _med(s[other]['stall_s']):.3f}")
    if "nostall_sync" in s and "dcp_sync" in s:
        lines.append(f"  nostall_sync / dcp_sync (until durable) = "
                     f"{_med(s['nostall_sync']['commit_s']) / _med(s['dcp_sync']['commit_s']):.3f}")
    if "nostall_sync" in s:
        lines.append(f"  nostall_sync / write floor (until durable) = "
                     f"{_med(s['nostall_sync']['commit_s']) / _med(s['write']['commit_s']):.3f}")
    rc = out.get("replica_check")
    if rc and "nostall_sync" in s:
        check = _med(rc["check_s"])
        lines.append(f"  replica check (first save, or a changed plan): {check * 1e3:.1f} ms for "
                     f"{rc['bytes'] / 2**20:.1f} MiB replicated on this rank ({rc['keys']} keys); "
                     f"/ nostall_sync stall = {check / _med(s['nostall_sync']['stall_s']):.3f}")
    if out["loads"]:
        lines.append("")
        for name, r in out["loads"].items():
            rs = f", resharded {_med(r['resharded_s']) * 1e3:.1f} ms" if r["resharded_s"] else ""
            lines.append(f"  load {name:<11} same layout {_med(r['same_layout_s']) * 1e3:.1f} ms{rs}")
    t = out["training"]
    if t:
        lines.append("")
        lines.append(f"  training step without a save: {t['baseline_step_s'] * 1e3:.2f} ms")
        for name, r in t.items():
            if name != "baseline_step_s":
                lines.append(f"  training step while {name} writes: {r['step_s'] * 1e3:.2f} ms "
                             f"(x{r['slowdown']:.2f} of {r['baseline_step_s'] * 1e3:.2f} ms just before; "
                             f"{r['steps']} steps)")
    return "\n".join(lines)


def plot(out: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = out["systems"]
    names = [n for n in s if n not in LIMITS]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, field, title, limit in ((axes[0], "stall_s", "time the training loop is blocked", "copy"),
                                    (axes[1], "commit_s", "time until the checkpoint is durable", "write")):
        vals = [_med(s[n][field]) for n in names]
        ax.bar(range(len(names)), vals, color=["tab:blue" if n.startswith("nostall") else "tab:gray" for n in names])
        ax.axhline(_med(s[limit][field]), color="tab:red", linestyle="--", label=f"limit: {limit}")
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


MODES = {"train": "nostall.tools.bench.train", "scale": "nostall.tools.bench.scale",
         "incremental": "nostall.tools.bench.incremental"}
"""``nostall bench MODE ...``: the other benchmarks, each in its own module with its own ``main(argv)``."""


def main(argv: Optional[List[str]] = None) -> int:
    import importlib

    from nostall.tools.cli import storage_options_arg

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in MODES:
        mode_main: Callable[[List[str]], int] = importlib.import_module(MODES[argv[0]]).main
        return mode_main(argv[1:])

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
    ap.add_argument("--compute-ms", type=float, default=200.0, metavar="MS",
                    help="nostall_overlap: forward/backward time between save() and the optimizer step "
                         "(default: %(default)s)")
    ap.add_argument("--remote", default=None,
                    help="also save to this object-storage URL (nostall_async_remote; default: none)")
    ap.add_argument("--storage-options", type=storage_options_arg, default=None, metavar="JSON",
                    help="fsspec options for --remote, as a JSON object")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress lines on stderr (default: one per system and repetition)")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s) {bad}; choose from {SYSTEMS}")
    out = run_bench(args.ranks, args.mb_per_rank, args.reps, systems, args.dir, loads=not args.no_load,
                    train=not args.no_train, remote=args.remote, storage_options=args.storage_options,
                    compute_ms=args.compute_ms, progress=not args.quiet)
    print(format_table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot(out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
