"""``nostall bench train``: what a training loop pays per save, end to end.

Launches ``--ranks`` gloo processes on this machine. Every rank holds a
training state of ``--mb-per-rank`` MiB: parameters (DTensor ``Shard(0)``
views over a 1-D mesh of plain local tensors, plus a few replicated tensors)
and the two moments a real ``torch.optim.Adam`` keeps for each (one third
parameters, two thirds moments). Every parameter has a fixed gradient, so each
``optimizer.step()`` rewrites every tensor of the state.

A run is ``--steps`` training steps; a step is a *compute phase*, a small
all-reduce (the data-parallel gradient sync), then ``optimizer.step()``, and
every ``--every`` steps (not on the last step) a save of the state. Two
compute models:

* ``device``: ``time.sleep(--compute-ms)``: the host CPU is idle, as while a
  GPU runs the forward/backward kernels;
* ``host``: forward/backward passes of a small CPU MLP, as many as take about
  ``--compute-ms`` (calibrated once): the CPU is busy.

For each compute model and repetition, a baseline run without saves, then one
run per system (``SYSTEMS``), interleaved. The per-save overhead of a system
is ``(wall time with saves - baseline wall time) / saves``. Each save is
broken down into the wait for the previous save (write backpressure), the
call itself, and the wait before the next ``optimizer.step()`` (overlapped
and DCP async-staging saves).

``nostall_memory`` is ``nostall_async`` with the memory tier
(``memory_tier=MemoryTier(persist_every=--persist-every)``, default 10 x
``--every``): a save goes to host shared memory, and to the persistent root
when its step is a multiple of ``--persist-every``. Its tier lives in a
directory of the run's own under ``--memory-dir`` (default ``/dev/shm``),
released by each run's ``close()`` and removed at the end.

*Interference*: the steps that run while a nostall background save is in
flight (from its call until its writer is done, by the writer's own write and
commit times) are timed apart from the run's other steps and the baseline's:
p50/p99, how many per save, and what they cost per save against the
baseline's median step (``interference_per_save_s``): the part of the
overhead that is not the call but the writer's memory and CPU traffic.

Every checkpoint is verified: an untimed reference pass replays the same
optimizer trajectory (Adam on fixed gradients is deterministic: every run
starts from the same reset state) and records a CRC32C of every local tensor
at every save step; after each run, every checkpoint it wrote is loaded back
and compared (``nostall_memory``: every checkpoint the run still holds: its
persistent ones, and the memory tier's newest, which ``load()`` must restore
from the memory tier with 0 bytes read from the persistent root; the tier
keeps one snapshot). Nothing is digested inside a timed run. See docs/benchmarks.md
("End to end") for the JSON schema.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from nostall.tools.bench.common import (MemoryDir, TrainLoop, gather_ranks, local_tensors, quiet_dcp_process,
                                        serve_rank, write_outputs, zero_template)

SYSTEMS = ("nostall_sync", "nostall_async", "nostall_overlap", "nostall_async_capped", "nostall_memory", "dcp_sync",
           "dcp_async_process", "dcp_async_staging", "torch_save")
MEMORY_PERSIST_X = 10  # nostall_memory: a persistent save every 10 saves by default (--persist-every = 10 x --every)
CAPPED_MB_S = 200.0  # nostall_async_capped: Options.max_write_rate, MB/s per rank (--capped-mb-s)
COMPUTE = ("device", "host")
DCP_ASYNC = ("dcp_async_process", "dcp_async_staging")
EVERY_20 = 20  # the "a save every 20 steps" figure, computed from the measured per-save overhead


# --------------------------------------------------------------------------- the training state (in the ranks)


class _State:
    """Parameters, their fixed gradients and a real Adam; the saved state is DTensor views of them.

    ``state`` is ``{"model": {name: DTensor | Tensor}, "optim": {name: {"exp_avg", "exp_avg_sq"}}, "step": int}``;
    its tensors share storage with the optimizer's parameters and moments, so every
    ``optimizer.step()`` changes every saved byte.
    """

    def __init__(self, rank: int, world: int, mb: int) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        self.torch = torch
        mesh = init_device_mesh("cpu", (world,))
        per = max(1, mb * (1 << 20) // 4 // 3)  # float32 parameter elements per rank (moments: 2x)
        sizes = [per // 4, per // 8, per // 8, per // 8] + [per // 64] * 24
        g = torch.Generator().manual_seed(1234 + rank)
        self.params: List[Any] = []
        replicated: List[bool] = []
        for i, n in enumerate(sizes):
            rows = max(1, n // 256)
            rep = i % 7 == 6  # replicated (norms, say): identical on every rank
            gen = torch.Generator().manual_seed(99 + i) if rep else g
            p = torch.randn((rows, 256), generator=gen)
            p.grad = torch.randn((rows, 256), generator=gen) * 1e-2
            self.params.append(p)
            replicated.append(rep)
        self.initial = [p.clone() for p in self.params]
        self.optimizer = torch.optim.Adam(self.params, lr=1e-3, foreach=False)
        self.optimizer.step()  # creates the moments; reset() brings everything back to step 0
        model: Dict[str, Any] = {}
        optim: Dict[str, Any] = {}
        for i, (p, rep) in enumerate(zip(self.params, replicated)):
            st = self.optimizer.state[p]

            def view(t: Any, rep: bool = rep) -> Any:
                if rep:
                    return t
                return DTensor.from_local(t, mesh, [Shard(0)], shape=torch.Size((t.shape[0] * world, 256)),
                                          stride=(256, 1))

            model[f"p{i}"] = view(p)
            optim[f"p{i}"] = {"exp_avg": view(st["exp_avg"]), "exp_avg_sq": view(st["exp_avg_sq"])}
        self.state: Dict[str, Any] = {"model": model, "optim": optim, "step": 0}
        self.tensors = local_tensors(self.state)  # this rank's local tensors, in a fixed order
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.reset()

    def reset(self) -> None:
        """Back to the state before the first step (bit for bit what a fresh optimizer would start from)."""
        with self.torch.no_grad():
            for p, p0 in zip(self.params, self.initial):
                p.copy_(p0)
                st = self.optimizer.state[p]
                st["exp_avg"].zero_()
                st["exp_avg_sq"].zero_()
                st["step"].zero_()
        self.state["step"] = 0

    def digests(self, tensors: Optional[Sequence[Any]] = None) -> List[int]:
        """CRC32C of each local tensor (this rank's shards and replicas)."""
        from nostall.core.format import crc

        return [crc(memoryview(t.contiguous().view(self.torch.uint8).numpy()))
                for t in (self.tensors if tensors is None else tensors)]


# --------------------------------------------------------------------------- the systems (in the ranks)


class _System:
    """One checkpointing system, one run at a time: ``setup`` .. ``teardown`` around a run.

    ``wait_previous`` (timed apart: write backpressure), ``save`` (the call),
    ``before_step`` (right before the next ``optimizer.step()``; returns the
    time waited), ``drain`` (after the loop, untimed), ``verify``.
    """

    name = ""

    def __init__(self, ctx: "_Rank") -> None:
        self.ctx = ctx
        self.dir = ""
        self.extra: List[Dict[str, float]] = []  # per save, system-specific figures

    def setup(self, run_dir: str) -> None:
        self.dir = run_dir
        self.extra = []

    def wait_previous(self) -> None:
        pass

    def save(self, step: int) -> None:
        raise NotImplementedError

    def before_step(self) -> float:
        return 0.0

    def drain(self) -> None:
        pass

    def load_into(self, step: int, template: Dict[str, Any]) -> Tuple[List[Any], Any]:
        """Load checkpoint ``step`` into ``template``: (local tensors, the saved ``step`` value)."""
        raise NotImplementedError

    def kept(self, save_steps: List[int]) -> List[int]:
        """The checkpoints a run holds at its end, each verified: step 0 (the untimed first save) and every save."""
        return [0] + save_steps

    def restore_problem(self, step: int) -> Optional[str]:
        """After :meth:`load_into` of ``step``: what was wrong with how it was restored (None: nothing)."""
        return None

    def teardown(self) -> None:
        pass


class _Nostall(_System):
    def __init__(self, ctx: "_Rank", async_save: bool, overlap: bool, max_write_rate: Optional[float] = None,
                 memory_tier: Any = None) -> None:
        super().__init__(ctx)
        self.async_save, self.overlap, self.max_write_rate = async_save, overlap, max_write_rate
        self.memory_tier = memory_tier
        self.mgr: Any = None
        self.handles: List[Any] = []

    def setup(self, run_dir: str) -> None:
        import nostall

        super().setup(run_dir)
        self.handles = []
        self.mgr = nostall.CheckpointManager(run_dir, keep_last=None, async_save=self.async_save,
                                             overlap=self.overlap, max_write_rate=self.max_write_rate,
                                             memory_tier=self.memory_tier)
        if self.overlap:
            self.mgr.attach(self.ctx.st.optimizer)  # its step() waits until the copy is done
        self.mgr.prepare(self.ctx.st.state)  # plan and staging area ahead, as a trainer's set-up would

    def wait_previous(self) -> None:
        self.mgr.finalize_pending_saves()

    def save(self, step: int) -> None:
        self.handles.append(self.mgr.save(step, self.ctx.st.state))

    def drain(self) -> None:
        self.mgr.finalize_pending_saves()
        for h in self.handles:
            s = h.result()
            extra = {"stall_s": s.stall_s, "stage_s": s.stage_s, "staged_wait_s": s.staged_wait_s,
                     "total_s": s.total_s or 0.0}
            if self.async_save:  # the writer's times: the save is in flight until it is done (in_flight)
                extra.update(write_s=s.write_s or 0.0, commit_s=s.commit_s or 0.0)
            self.extra.append(extra)
        self.handles = []

    def load_into(self, step: int, template: Dict[str, Any]) -> Tuple[List[Any], Any]:
        restored = self.mgr.load(template, step=step)
        return local_tensors(template), restored["step"]

    def teardown(self) -> None:
        if self.mgr is not None:
            self.mgr.close()  # with a memory tier: released (its holder deletes it and exits)
            self.mgr = None


class _NostallMemory(_Nostall):
    """``nostall_memory``: async saves with the memory tier (``persist_every`` steps apart to the persistent root).

    The tier keeps one committed snapshot (``MemoryTier.keep``), so a run ends holding its persistent
    checkpoints and the newest memory one: those are verified. When that memory step is newer than the
    newest persistent one it is the freshest tier, and it is loaded through ``load()`` as a restarted
    trainer's restore (it must come from memory, 0 bytes read from the persistent root); the others by path.
    """

    def __init__(self, ctx: "_Rank", persist_every: int, memory_dir: str) -> None:
        from nostall.options import MemoryTier

        super().__init__(ctx, async_save=True, overlap=False,
                         memory_tier=MemoryTier(persist_every=persist_every, memory_dir=memory_dir))
        persistent = [s for s in [0] + ctx.save_steps if s % persist_every == 0]
        memory = [s for s in ctx.save_steps if s % persist_every]
        self.held = sorted(persistent + memory[-1:])  # what a run ends holding
        self.freshest: Optional[int] = memory[-1] if memory and memory[-1] > persistent[-1] else None
        self.paths: Dict[int, str] = {}  # step -> its checkpoint, in either tier

    def setup(self, run_dir: str) -> None:
        super().setup(run_dir)
        self.paths = {}

    def save(self, step: int) -> None:
        super().save(step)
        self.paths[step] = self.handles[-1].path

    def kept(self, save_steps: List[int]) -> List[int]:
        return self.held

    def load_into(self, step: int, template: Dict[str, Any]) -> Tuple[List[Any], Any]:
        if step == self.freshest:
            restored = self.mgr.load(template)  # the freshest complete tier: the memory snapshot
        else:
            restored = self.mgr.load(template, path=self.paths[step])
        return local_tensors(template), restored["step"]

    def restore_problem(self, step: int) -> Optional[str]:
        r = self.mgr.last_restore
        if step != self.freshest:
            return None
        if r is not None and (r.tier, r.step, r.persistent_bytes_read) == ("memory", step, 0):
            return None
        got = "no restore" if r is None else (f"tier {r.tier}, step {r.step}, {r.persistent_bytes_read} bytes read "
                                              f"from the persistent root (fell back: {r.fell_back})")
        return f"{self.name} rank {self.ctx.rank} step {step}: load() did not restore it from the memory tier ({got})"


class _DcpSync(_System):
    def save(self, step: int) -> None:
        self.ctx.dcp.save(self.ctx.st.state, checkpoint_id=os.path.join(self.dir, f"step_{step}"))

    def load_into(self, step: int, template: Dict[str, Any]) -> Tuple[List[Any], Any]:
        self.ctx.dcp.load(template, checkpoint_id=os.path.join(self.dir, f"step_{step}"))
        return local_tensors(template), template["step"]


class _DcpAsync(_DcpSync):
    """``dcp.async_save`` with the process executor and a cached shared-memory ``DefaultStager``.

    ``staging``: DCP's async staging mode (the call returns at once; the
    copy's end is waited for right before the next ``optimizer.step()``);
    otherwise the copy is waited for right after the call.
    """

    def __init__(self, ctx: "_Rank", staging: bool) -> None:
        super().__init__(ctx)
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.staging = staging
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                   use_async_staging=staging, use_non_blocking_copy=cuda))
        self.upload: Any = None
        self.staged: Any = None

    def wait_previous(self) -> None:
        if self.upload is not None:
            self.upload.result()  # the stager's cached buffers are reused: the previous save must be done
            self.upload = None

    def save(self, step: int) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        r = self.ctx.dcp.async_save(self.ctx.st.state, checkpoint_id=os.path.join(self.dir, f"step_{step}"),
                                    async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        self.upload = getattr(r, "upload_completion", None) or r
        staged = getattr(r, "staging_completion", None)
        if staged is not None and not self.staging:
            staged.result()  # the state may be modified only once staged
        else:
            self.staged = staged

    def before_step(self) -> float:
        if self.staged is None:
            return 0.0
        t0 = time.perf_counter()
        self.staged.result()
        self.staged = None
        return time.perf_counter() - t0

    def drain(self) -> None:
        self.before_step()
        self.wait_previous()

    def close(self) -> None:
        try:
            self.stager.close()
        except Exception:
            pass


class _TorchSave(_System):
    def _path(self, step: int) -> str:
        return os.path.join(self.dir, f"step_{step}", f"rank{self.ctx.rank}.pt")

    def save(self, step: int) -> None:
        path = self._path(step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            self.ctx.torch.save({"step": step, **{f"t{i}": t for i, t in enumerate(self.ctx.st.tensors)}}, f)
            f.flush()
            os.fsync(f.fileno())

    def load_into(self, step: int, template: Dict[str, Any]) -> Tuple[List[Any], Any]:
        d = self.ctx.torch.load(self._path(step), weights_only=True)
        return [d[f"t{i}"] for i in range(len(self.ctx.st.tensors))], d["step"]


# --------------------------------------------------------------------------- one rank


class _Rank:
    """What one rank runs: calibration, the reference pass, then the interleaved runs."""

    def __init__(self, rank: int, world: int, root: str, cfg: Dict[str, Any], torch: Any, dist: Any, dcp: Any) -> None:
        self.rank, self.world, self.root, self.cfg = rank, world, root, cfg
        self.torch, self.dist, self.dcp = torch, dist, dcp
        self.st = _State(rank, world, cfg["mb"])
        self.steps: int = cfg["steps"]
        self.save_steps = [s for s in range(1, self.steps) if s % cfg["every"] == 0]  # never the last step
        self.sync = torch.zeros(1)
        self.loop = TrainLoop()
        self.host_passes = 0
        self.host_pass_s = 0.0
        self.ref: Dict[int, List[int]] = {}

    def say(self, text: str) -> None:
        if self.rank == 0 and self.cfg["progress"]:
            print(f"[bench train] {text}", file=sys.stderr, flush=True)

    # ---- set-up
    def calibrate_host(self) -> None:
        """Passes of the MLP per step so that the host compute phase takes about --compute-ms (rank 0's count)."""
        for _ in range(3):
            self.loop.forward_backward()
        self.dist.barrier()
        t = statistics.median(self.loop.forward_backward() for _ in range(15))
        n = [max(1, round(self.cfg["compute_ms"] / 1e3 / t)), t]
        self.dist.broadcast_object_list(n, src=0)
        self.host_passes, self.host_pass_s = int(n[0]), float(n[1])

    def reference(self) -> Dict[int, List[int]]:
        """Digests of the state at step 0 and at every save step, and after the last step (untimed)."""
        self.st.reset()
        ref = {0: self.st.digests()}
        for s in range(1, self.steps + 1):
            self.st.optimizer.step()
            if s in self.save_steps or s == self.steps:
                ref[s] = self.st.digests()
        return ref

    def copy_floor(self, buf: Any) -> float:
        """Median of 3 copies of the rank's bytes into an already-touched buffer."""
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            pos = 0
            for t in self.st.tensors:
                n = t.numel() * t.element_size()
                buf[pos : pos + n].view(t.dtype).view(t.shape).copy_(t)
                pos += n
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    # ---- one run
    def compute_phase(self, compute: str) -> Callable[[], None]:
        if compute == "device":
            seconds = self.cfg["compute_ms"] / 1e3
            return lambda: time.sleep(seconds)
        n, fb = self.host_passes, self.loop.forward_backward

        def host() -> None:
            for _ in range(n):
                fb()

        return host

    def run(self, compute: str, system: Optional[_System]) -> Dict[str, Any]:
        """One run: the loop of --steps steps, saving with ``system`` (None: the baseline)."""
        st, dist = self.st, self.dist
        st.reset()
        phase = self.compute_phase(compute)
        saves = set(self.save_steps) if system is not None else set()
        step_s: List[float] = []
        step_t0: List[float] = []  # when each step began, from the run's start
        per_save: List[Dict[str, float]] = []
        dist.barrier()
        ticks = _cpu_ticks()
        cpu0, t_start = time.process_time(), time.perf_counter()
        for s in range(1, self.steps + 1):
            t0 = time.perf_counter()
            step_t0.append(t0 - t_start)
            phase()
            dist.all_reduce(self.sync)  # the data-parallel gradient sync: ranks step together
            waited = system.before_step() if system is not None else 0.0
            st.optimizer.step()  # an attached manager's hook waits here for the copy
            if waited and per_save:
                per_save[-1]["before_step_s"] = waited
            if s in saves:
                assert system is not None
                st.state["step"] = s
                t1 = time.perf_counter()
                system.wait_previous()
                t2 = time.perf_counter()
                system.save(s)
                per_save.append({"step": s, "wait_previous_s": t2 - t1, "call_s": time.perf_counter() - t2,
                                 "before_step_s": 0.0, "t_call_s": t2 - t_start})
            step_s.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
        cpu = time.process_time() - cpu0
        out: Dict[str, Any] = {"wall_s": wall, "step_s": step_s, "step_t0_s": step_t0, "cpu_s": cpu,
                               "machine_busy": _busy_since(ticks)}
        if system is not None:
            t0 = time.perf_counter()
            system.drain()
            out["drain_s"] = time.perf_counter() - t0
            for d, x in zip(per_save, system.extra):
                d.update(x)
            out["saves"] = per_save
        if st.digests() != self.ref[self.steps]:
            raise RuntimeError(f"rank {self.rank}: the state after the run differs from the reference pass's "
                               "(the training is not deterministic, or a save changed the state)")
        return out

    def verify(self, system: _System, template: Dict[str, Any]) -> Tuple[int, List[str]]:
        """Load every checkpoint of the run (step 0 and each save) and compare with the reference digests."""
        n, bad = 0, []
        for s in system.kept(self.save_steps):
            for t in local_tensors(template):
                t.zero_()
            template["step"] = -1
            tensors, step = system.load_into(s, template)
            problem = system.restore_problem(s)
            if problem:
                bad.append(problem)
            got = self.st.digests(tensors)
            n += 1
            if step != s:
                bad.append(f"{system.name} rank {self.rank} step {s}: saved step value {step!r}")
            diff = [i for i, (a, b) in enumerate(zip(got, self.ref[s])) if a != b]
            if diff or len(got) != len(self.ref[s]):
                bad.append(f"{system.name} rank {self.rank} step {s}: {len(diff)} tensor(s) differ from the state "
                           f"at the save (first: local tensor #{diff[0] if diff else len(got)})")
        return n, bad

    # ---- everything
    def make_systems(self, names: List[str]) -> Dict[str, "_System"]:
        """The systems to time, by name (the baseline has none)."""
        made: Dict[str, _System] = {}
        for name in names:
            sysobj: _System
            if name == "nostall_memory":
                sysobj = _NostallMemory(self, self.cfg["persist_every"], self.cfg["memory_dir"])
            elif name.startswith("nostall_"):
                sysobj = _Nostall(self, async_save=name != "nostall_sync", overlap=name == "nostall_overlap",
                                  max_write_rate=self.cfg.get("capped_mb_s", CAPPED_MB_S) * 1e6
                                  if name == "nostall_async_capped" else None)
            elif name == "dcp_sync":
                sysobj = _DcpSync(self)
            elif name in DCP_ASYNC:
                sysobj = _DcpAsync(self, staging=name == "dcp_async_staging")
            else:
                sysobj = _TorchSave(self)
            sysobj.name = name
            made[name] = sysobj
        return made

    def run_system(self, compute: str, system: "Optional[_System]", run_dir: str, template: Dict[str, Any],
                   verified: Dict[str, int], mismatches: List[str]) -> Dict[str, Any]:
        """One timed run of ``system`` (None: the baseline) in ``run_dir``: set up with a first, untimed save,
        run, verify its checkpoints against the reference, tear down."""
        dist = self.dist
        if system is not None:
            if self.rank == 0:
                os.makedirs(run_dir, exist_ok=True)
            dist.barrier()
            system.setup(run_dir)
            self.st.reset()
            system.wait_previous()
            system.save(0)  # a first save, untimed: allocations and process start-ups
            system.drain()
            system.extra = []
        r = self.run(compute, system)
        if system is not None:
            n, bad = self.verify(system, template)
            verified[system.name] += n
            mismatches += bad
            r["verified"] = n
            system.teardown()
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(run_dir, ignore_errors=True)
        return r

    def main(self) -> Dict[str, Any]:
        torch, dist, cfg = self.torch, self.dist, self.cfg
        systems: List[str] = cfg["systems"]
        computes: List[str] = cfg["compute"]
        if "host" in computes:
            self.calibrate_host()
            self.say(f"host compute: {self.host_passes} forward/backward passes of {self.host_pass_s * 1e3:.2f} ms "
                     "per step")
        self.say(f"reference pass: {self.steps} optimizer steps, digests at step 0 and at {len(self.save_steps)} "
                 "save steps (untimed)")
        self.ref = self.reference()
        made = self.make_systems(systems)
        template = zero_template(self.st.state)
        buf = torch.empty(self.st.nbytes, dtype=torch.uint8)
        buf.zero_()  # touched once: the copy floor pays no page faults
        copy_floor: List[float] = []
        runs: Dict[str, Dict[str, List[Any]]] = {c: {n: [] for n in ["baseline"] + systems} for c in computes}
        verified = {n: 0 for n in systems}
        mismatches: List[str] = []
        reps = cfg["reps"]
        for rep in range(1, reps + 1):
            dist.barrier()
            copy_floor.append(self.copy_floor(buf))
            for compute in computes:
                for name in ["baseline"] + systems:
                    run_dir = os.path.join(self.root, f"{name}-{compute}-r{rep}")
                    system = made.get(name)
                    r = self.run_system(compute, system, run_dir, template, verified, mismatches)
                    runs[compute][name].append(r)
                    base = runs[compute]["baseline"][-1]["wall_s"]
                    extra = ""
                    if system is not None:
                        o = (r["wall_s"] - base) / max(1, len(self.save_steps))
                        extra = f", {o * 1e3:+.1f} ms per save, {r['verified']} checkpoints verified"
                    self.say(f"{compute} rep {rep}/{reps} {name}: {r['wall_s']:.2f} s for {self.steps} steps{extra}")
        for s in made.values():
            if isinstance(s, _DcpAsync):
                s.close()
        return {"bytes": self.st.nbytes, "runs": runs, "copy_floor_s": copy_floor, "verified": verified,
                "mismatches": mismatches, "host_passes": self.host_passes, "host_pass_s": self.host_pass_s,
                "save_steps": self.save_steps}


def _worker(rank: int, world: int, init: str, root: str, cfg: Dict[str, Any], q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    for name in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.logging_handlers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_dcp_process()
    serve_rank(rank, world, init, q, lambda: _Rank(rank, world, root, cfg, torch, dist, dcp).main())


# --------------------------------------------------------------------------- figures


def _cpu_ticks() -> Tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot (Linux /proc/stat; (0, 0) elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _busy_since(start: Tuple[int, int]) -> float:
    """Fraction of the machine's CPU time spent busy (every process, not only the bench's) since ``start``."""
    busy, total = _cpu_ticks()
    return (busy - start[0]) / (total - start[1]) if total > start[1] else float("nan")


def _pct(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``xs``; nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _spread(xs: Sequence[float]) -> Dict[str, float]:
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def in_flight(run: Dict[str, Any]) -> Tuple[List[float], List[float], List[int]]:
    """A run's steps while a background save was in flight, and its other steps (neither saving nor in flight),
    and how many steps each save was in flight for.

    A save is in flight from its call until its writer is done (the call, then the writer's write and
    commit times: ``SaveStats.write_s``, ``commit_s``); a step is in flight when it overlaps that window.
    The steps that save are in neither list. A run without those figures (not a nostall background save)
    has no steps in flight: ``([], [], [])``.
    """
    saves = run.get("saves", [])
    starts = run.get("step_t0_s")
    if not saves or starts is None or not all("write_s" in d and "t_call_s" in d for d in saves):
        return [], [], []
    windows = [(d["t_call_s"], d["t_call_s"] + d["call_s"] + d["write_s"] + d["commit_s"]) for d in saves]
    saving = {d["step"] - 1 for d in saves}  # 0-based indices of the steps that save
    busy: List[float] = []
    quiet: List[float] = []
    counts = [0] * len(windows)
    for i, (t0, dt) in enumerate(zip(starts, run["step_s"])):
        if i in saving:
            continue
        hit = [k for k, (a, b) in enumerate(windows) if t0 < b and t0 + dt > a]
        for k in hit:
            counts[k] += 1
        (busy if hit else quiet).append(dt)
    return busy, quiet, counts


def summarize(runs: Dict[str, Dict[str, List[Dict[str, Any]]]], walls: Dict[str, Dict[str, List[float]]],
              save_steps: List[int], steps: int) -> Dict[str, Dict[str, Any]]:
    """Per compute model and system: overheads, losses and step-time percentiles (see docs/benchmarks.md).

    ``runs``: rank 0's runs; ``walls``: each run's wall time, slowest rank.
    """
    out: Dict[str, Dict[str, Any]] = {}
    n = max(1, len(save_steps))
    after = [s for s in save_steps if s < steps]  # 1-based save steps; the step after is index s
    for compute, by in runs.items():
        base_w = walls[compute]["baseline"]
        base_runs = by["baseline"]
        base_after = [r["step_s"][s] for r in base_runs for s in after]
        res: Dict[str, Any] = {"baseline": {"wall_s": _spread(base_w), "step_s": _spread(
            [statistics.median(r["step_s"]) for r in base_runs]),
            "after_save_p50_s": _pct(base_after, 50), "after_save_p99_s": _pct(base_after, 99),
            "step_p99_s": _pct([x for r in base_runs for x in r["step_s"]], 99),
            "cpu_busy": _spread([r["cpu_s"] / r["wall_s"] for r in base_runs]),
            "machine_busy": _spread([r.get("machine_busy", float("nan")) for r in base_runs])}}
        for name, rs in by.items():
            if name == "baseline":
                continue
            w = walls[compute][name]
            over = [(a - b) / n for a, b in zip(w, base_w)]
            loss = [100 * (1 - b / a) for a, b in zip(w, base_w)]
            base_step = [b / steps for b in base_w]
            loss20 = [100 * max(0.0, o) / (EVERY_20 * t + max(0.0, o)) for o, t in zip(over, base_step)]
            aft = [r["step_s"][s] for r in rs for s in after]
            at = [r["step_s"][s - 1] for r in rs for s in save_steps]
            saves = [d for r in rs for d in r.get("saves", [])]
            flights = [in_flight(r) for r in rs]
            busy = [x for f in flights for x in f[0]]
            quiet = [x for f in flights for x in f[1]]
            base_med = [statistics.median(b["step_s"]) for b in base_runs]
            interference = [sum(x - m for x in f[0]) / n for f, m in zip(flights, base_med) if f[2]]
            res[name] = {
                "overhead_per_save_s": _spread(over), "loss_pct": _spread(loss), "loss_every20_pct": _spread(loss20),
                "save_step_p50_s": _pct(at, 50), "save_step_p99_s": _pct(at, 99),
                "after_save_p50_s": _pct(aft, 50), "after_save_p99_s": _pct(aft, 99),
                "in_flight_p50_s": _pct(busy, 50), "in_flight_p99_s": _pct(busy, 99),
                "quiet_p50_s": _pct(quiet, 50), "quiet_p99_s": _pct(quiet, 99),
                "in_flight_steps_per_save": _spread([float(c) for f in flights for c in f[2]]),
                "interference_per_save_s": _spread(interference),
                "wait_previous_s": _spread([d["wait_previous_s"] for d in saves]),
                "call_s": _spread([d["call_s"] for d in saves]),
                "before_step_s": _spread([d["before_step_s"] for d in saves]),
                "drain_s": _spread([r.get("drain_s", 0.0) for r in rs]),
                "verified": sum(r.get("verified", 0) for r in rs),
            }
            if saves and "staged_wait_s" in saves[0]:
                res[name]["staged_wait_s"] = _spread([d["staged_wait_s"] for d in saves])
                res[name]["stage_s"] = _spread([d["stage_s"] for d in saves])
        out[compute] = res
    return out


def ratios(summary: Dict[str, Dict[str, Any]], copy_floor: float) -> Dict[str, Dict[str, float]]:
    """The issue's ratios per compute model (medians of per-save overhead)."""
    out: Dict[str, Dict[str, float]] = {}
    for compute, s in summary.items():
        def o(name: str, s: Dict[str, Any] = s) -> float:
            return s[name]["overhead_per_save_s"]["median"] if name in s else float("nan")

        r: Dict[str, float] = {}
        if "nostall_memory" in s:
            r["nostall_memory / copy_floor"] = o("nostall_memory") / copy_floor
            r["nostall_memory call / copy_floor"] = s["nostall_memory"]["call_s"]["median"] / copy_floor
            if "nostall_async" in s:
                r["nostall_memory / nostall_async"] = o("nostall_memory") / o("nostall_async")
        if "nostall_async" in s:
            r["nostall_async / copy_floor"] = o("nostall_async") / copy_floor
            dcps = [o(n) for n in DCP_ASYNC if n in s]
            if dcps:
                r["nostall_async / dcp_best_async"] = o("nostall_async") / min(dcps)
            if "nostall_overlap" in s:
                r["nostall_overlap / nostall_async"] = o("nostall_overlap") / o("nostall_async")
            if "nostall_async_capped" in s:
                r["nostall_async_capped / nostall_async"] = o("nostall_async_capped") / o("nostall_async")
        if "nostall_sync" in s and "dcp_sync" in s:
            r["nostall_sync / dcp_sync"] = o("nostall_sync") / o("dcp_sync")
        out[compute] = r
    return out


def saturation(out: Dict[str, Any]) -> Optional[str]:
    """A sentence when the host compute keeps (nearly) every core busy, else None."""
    host = out["summary"].get("host")
    if not host:
        return None
    busy = out["host_busy_cores"]
    cpus = out["machine"]["cpus"]
    machine = host["baseline"]["machine_busy"]["median"]
    if busy < 0.75 * cpus and not machine >= 0.85:
        return None
    return (f"host compute: the ranks keep {busy:.1f} of {cpus} cores busy and the machine's CPUs are "
            f"{100 * machine:.0f}% busy (every process): the CPU is saturated, so a save's copy and its writer "
            "compete with the compute; overlapped staging cannot pay off here (its copy runs beside the "
            "forward/backward, on a core that is not free)")


# --------------------------------------------------------------------------- the launcher


def run_bench(ranks: int = 2, mb: int = 256, steps: int = 60, every: int = 3, reps: int = 3,
              systems: Sequence[str] = SYSTEMS, compute: Sequence[str] = COMPUTE, compute_ms: float = 150.0,
              root: Optional[str] = None, progress: bool = False, timeout: float = 7200.0,
              capped_mb_s: float = CAPPED_MB_S, persist_every: Optional[int] = None,
              memory_dir: Optional[str] = None) -> Dict[str, Any]:
    """Run the end-to-end benchmark; returns the JSON-able result (see docs/benchmarks.md).

    ``persist_every``: nostall_memory's ``MemoryTier.persist_every`` (default
    10 x ``every``); ``memory_dir``: where its tier's own directory is made
    (default ``/dev/shm``; removed after the run)."""
    import torch

    if every < 1 or steps <= every:
        raise ValueError(f"--steps ({steps}) must exceed --every ({every}) >= 1: a run needs a save and a step after")
    persist_every = MEMORY_PERSIST_X * every if persist_every is None else persist_every
    if persist_every < 1:
        raise ValueError(f"--persist-every must be >= 1, got {persist_every}")
    own = root is None
    root = root or tempfile.mkdtemp(prefix="nostall-bench-train-")
    os.makedirs(root, exist_ok=True)
    cfg = {"mb": mb, "steps": steps, "every": every, "reps": reps, "systems": list(systems),
           "compute": list(compute), "compute_ms": compute_ms, "progress": progress, "capped_mb_s": capped_mb_s,
           "persist_every": persist_every}
    memory = MemoryDir(memory_dir) if "nostall_memory" in systems else None
    cfg["memory_dir"] = memory.path if memory is not None else None
    if progress:
        print(f"[bench train] {ranks} ranks x {mb} MiB, {steps} steps of {compute_ms:g} ms compute "
              f"({', '.join(compute)}), a save every {every}; {reps} repetition(s) of baseline, "
              f"{', '.join(systems)}; under {root}", file=sys.stderr, flush=True)
    try:
        per_rank = gather_ranks(_worker, ranks, root, cfg, timeout, "benchmark")
    finally:
        if memory is not None:
            memory.close()  # every run's holder gone (released by its close()), the directory removed
        if own:
            shutil.rmtree(root, ignore_errors=True)
    r0 = per_rank[0]
    walls = {c: {n: [max(per_rank[k]["runs"][c][n][i]["wall_s"] for k in per_rank) for i in range(reps)]
                 for n in by} for c, by in r0["runs"].items()}
    summary = summarize(r0["runs"], walls, r0["save_steps"], steps)
    floor = statistics.median(r0["copy_floor_s"])
    host_busy = 0.0
    if "host" in r0["runs"]:
        host_busy = statistics.median(sum(per_rank[k]["runs"]["host"]["baseline"][i]["cpu_s"]
                                          / per_rank[k]["runs"]["host"]["baseline"][i]["wall_s"] for k in per_rank)
                                      for i in range(reps))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    out: Dict[str, Any] = {
        "config": {"ranks": ranks, "mb_per_rank": mb, "bytes_per_rank": r0["bytes"], "steps": steps, "every": every,
                   "save_steps": r0["save_steps"], "saves_per_run": len(r0["save_steps"]), "reps": reps,
                   "systems": list(systems), "compute": list(compute), "compute_ms": compute_ms,
                   "host_passes": r0["host_passes"], "host_pass_ms": r0["host_pass_s"] * 1e3,
                   "optimizer": "torch.optim.Adam(foreach=False)", "backend": "gloo",
                   "persist_every": persist_every,
                   "memory_holders_stopped": memory.signalled if memory is not None else [],
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        "machine": {"cpus": cpus, "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "cuda": torch.cuda.is_available()},
        "copy_floor_s": _spread(r0["copy_floor_s"]),
        "host_busy_cores": host_busy,
        "summary": summary,
        "ratios": ratios(summary, floor),
        "verified": {n: sum(per_rank[k]["verified"][n] for k in per_rank) for n in systems},
        "mismatches": [m for k in sorted(per_rank) for m in per_rank[k]["mismatches"]],
        "walls": walls,
        "runs": r0["runs"],
    }
    out["saturated"] = saturation(out)
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _flight_cells(r: Dict[str, Any]) -> str:
    """The table's in-flight columns of one system: steps in flight p50/p99, how many per save, their cost."""
    if not math.isfinite(r["in_flight_p50_s"]):
        return f"{'-':>16}{'-':>5}{'-':>8}"
    return (f"{_ms(r['in_flight_p50_s'])}/{_ms(r['in_flight_p99_s'])}".rjust(16)
            + f"{r['in_flight_steps_per_save']['median']:>5.0f}"
            + f"{_ms(r['interference_per_save_s']['median']):>8}")


def _busy_text(baseline: Dict[str, Any]) -> str:
    busy = baseline.get("machine_busy", {}).get("median", float("nan"))
    return f"{100 * busy:.0f}% busy (all processes)" if math.isfinite(busy) else "busy: not recorded"


def format_table(out: Dict[str, Any]) -> str:
    """The figures as text: one block per compute model, then the ratios."""
    c = out["config"]
    lines = [f"{c['ranks']} ranks x {c['bytes_per_rank'] / 2**20:.0f} MiB, {c['steps']} steps, a save every "
             f"{c['every']} ({c['saves_per_run']} per run), compute {c['compute_ms']:g} ms; {c['reps']} "
             f"repetition(s): medians [min-max]; step times of rank 0",
             f"copy floor (the rank's bytes into a touched buffer): {_ms(out['copy_floor_s']['median'])} ms "
             f"[{_ms(out['copy_floor_s']['min'])}-{_ms(out['copy_floor_s']['max'])}]"]
    for compute, s in out["summary"].items():
        b = s["baseline"]
        what = ("sleep: host CPU idle, as under GPU kernels" if compute == "device"
                else f"{c['host_passes']} MLP forward/backward passes on the CPU")
        lines += ["", f"== {compute} compute ({what}); baseline {b['wall_s']['median']:.2f} s, step "
                      f"{_ms(b['step_s']['median'])} ms, p99 {_ms(b['step_p99_s'])} ms, after-save steps p50/p99 "
                      f"{_ms(b['after_save_p50_s'])}/{_ms(b['after_save_p99_s'])} ms; machine CPU {_busy_text(b)}",
                  f"{'system':<19}{'per-save overhead ms':>26}{'loss %':>8}{'loss/20':>8}{'prev':>7}{'call':>7}"
                  f"{'pre-opt':>8}{'save step':>16}{'after save':>16}{'in flight':>16}{'n':>5}{'interf':>8}"
                  f"{'verified':>9}"]
        for name, r in s.items():
            if name == "baseline":
                continue
            o = r["overhead_per_save_s"]
            lines.append(
                f"{name:<19}{_ms(o['median']):>10} [{_ms(o['min'])}-{_ms(o['max'])}]".ljust(45)
                + f"{r['loss_pct']['median']:>8.1f}{r['loss_every20_pct']['median']:>8.2f}"
                + f"{_ms(r['wait_previous_s']['median']):>7}{_ms(r['call_s']['median']):>7}"
                + f"{_ms(r['before_step_s']['median'] + r.get('staged_wait_s', {}).get('median', 0.0)):>8}"
                + f"{_ms(r['save_step_p50_s'])}/{_ms(r['save_step_p99_s'])}".rjust(16)
                + f"{_ms(r['after_save_p50_s'])}/{_ms(r['after_save_p99_s'])}".rjust(16)
                + _flight_cells(r)
                + f"{r['verified']:>9}")
        if compute == "host" and out.get("saturated"):
            lines.append(f"  NOTE: {out['saturated']}")
        rs = out["ratios"].get(compute, {})
        if rs:
            lines.append("  " + "; ".join(f"{k} = {v:.2f}" for k, v in rs.items()))
    lines += ["", "per-save overhead = (wall time with saves - baseline) / saves; loss = 1 - baseline / with saves; "
              f"loss/20: the loss of a save every {EVERY_20} steps, computed from the same overhead; prev / call / "
              "pre-opt: medians per save of the wait for the previous save, the call, the wait before the next "
              "optimizer step (ms); save step / after save: p50/p99 of the step that saves and of the next one (ms); "
              "in flight: p50/p99 of the other steps run while a nostall background save was in flight (from its call "
              "until its writer was done), n: how many per save (median), interf: what they cost per save against "
              "the baseline's median step (ms); '-': not a nostall background save"]
    total = sum(out["verified"].values())
    lines.append(f"checkpoints verified against the state at their save: {total} "
                 f"({', '.join(f'{k} {v}' for k, v in out['verified'].items())}); mismatches: "
                 f"{len(out['mismatches'])}")
    lines += [f"  MISMATCH {m}" for m in out["mismatches"][:20]]
    return "\n".join(lines)


def plot(out: Dict[str, Any], path: str) -> None:
    """Per compute model: median per-save overhead per system (min-max bars) against the copy floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = out["summary"]
    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4.5), squeeze=False)
    floor = out["copy_floor_s"]["median"] * 1e3
    for ax, (compute, s) in zip(axes[0], summary.items()):
        names = [n for n in s if n != "baseline"]
        med = [s[n]["overhead_per_save_s"]["median"] * 1e3 for n in names]
        lo = [m - s[n]["overhead_per_save_s"]["min"] * 1e3 for m, n in zip(med, names)]
        hi = [s[n]["overhead_per_save_s"]["max"] * 1e3 - m for m, n in zip(med, names)]
        ax.bar(range(len(names)), med, yerr=[lo, hi], capsize=3,
               color=["tab:blue" if n.startswith("nostall") else "tab:gray" for n in names])
        ax.axhline(floor, color="tab:red", linestyle="--", label=f"copy floor {floor:.0f} ms")
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_ylabel("extra wall time per save, ms (median, min-max)")
        ax.set_title(f"{compute} compute")
        ax.legend()
    c = out["config"]
    fig.suptitle(f"{c['ranks']} ranks x {c['bytes_per_rank'] / 2**20:.0f} MiB, a save every {c['every']} of "
                 f"{c['steps']} steps of {c['compute_ms']:g} ms compute, {c['reps']} reps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    """``nostall bench train [options]``; returns the exit status (1 when a checkpoint did not verify)."""
    ap = argparse.ArgumentParser(
        prog="nostall bench train",
        description="What a training loop pays per save, end to end: a loop of compute + Adam steps without "
                    "checkpoints, then with a save every --every steps, per system; every checkpoint verified. "
                    "Progress on stderr, the table on stdout.")
    ap.add_argument("--ranks", type=int, default=2, metavar="N", help="gloo ranks on this machine (default: 2)")
    ap.add_argument("--mb-per-rank", type=int, default=256, metavar="MIB",
                    help="MiB of training state per rank: parameters and Adam's two moments (default: 256)")
    ap.add_argument("--steps", type=int, default=60, metavar="N", help="training steps per run (default: 60)")
    ap.add_argument("--every", type=int, default=3, metavar="K",
                    help="a save every K steps, never on the last step (default: 3)")
    ap.add_argument("--compute-ms", type=float, default=150.0, metavar="MS",
                    help="length of the compute phase of a step (default: 150)")
    ap.add_argument("--compute", choices=("device", "host", "both"), default="both",
                    help="device: a sleep (host CPU idle); host: CPU forward/backward of a small MLP (default: both)")
    ap.add_argument("--reps", type=int, default=3, metavar="N",
                    help="interleaved repetitions of the baseline and every system (default: 3)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), metavar="LIST",
                    help="comma-separated subset of %(default)s")
    ap.add_argument("--dir", default=None,
                    help="where the runs write (each run's checkpoints are deleted once verified; default: a "
                         "temporary directory)")
    ap.add_argument("--capped-mb-s", type=float, default=CAPPED_MB_S, metavar="MB_S",
                    help="nostall_async_capped: its writers' max_write_rate, MB/s per rank (default: %(default)s)")
    ap.add_argument("--persist-every", type=int, default=None, metavar="STEPS",
                    help="nostall_memory: a save goes to the persistent root when its step is a multiple of this, "
                         f"to the memory tier otherwise (default: {MEMORY_PERSIST_X} x --every)")
    ap.add_argument("--memory-dir", default=None, metavar="DIR",
                    help="nostall_memory: its tier under this tmpfs directory (default: /dev/shm)")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    ap.add_argument("--plot", default=None, help="draw the per-save overheads (PNG)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        ap.error(f"unknown system(s) {bad}; choose from {SYSTEMS}")
    compute = list(COMPUTE) if args.compute == "both" else [args.compute]
    out = run_bench(args.ranks, args.mb_per_rank, args.steps, args.every, args.reps, systems, compute,
                    args.compute_ms, args.dir, progress=not args.quiet, capped_mb_s=args.capped_mb_s,
                    persist_every=args.persist_every, memory_dir=args.memory_dir)
    write_outputs(out, format_table(out), args.json, args.plot, plot)
    if out["mismatches"]:
        print(f"nostall bench train: {len(out['mismatches'])} checkpoint(s) differ from the state at their save",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
