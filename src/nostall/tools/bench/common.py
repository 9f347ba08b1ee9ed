"""Helpers every benchmark shares: the launcher (:func:`gather_ranks`, :func:`serve_rank`), the
synthetic state's local tensors and load templates, a small training loop, memory counters and
the output of a run (:func:`write_outputs`). Imports torch only inside the helpers that use it.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

# --------------------------------------------------------------------------- memory (Linux /proc)


def rss_mb(pid: int, field: str = "VmHWM") -> float:
    """Peak (VmHWM, since the last reset) or current (VmRSS) resident memory of a process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def child_pids() -> List[int]:
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


def reset_peaks() -> None:
    """Restart the peak-RSS counters of this process and its children (Linux clear_refs 5)."""
    for pid in [os.getpid()] + child_pids():
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def read_chars() -> Optional[int]:
    """Bytes this process's read calls have returned so far (``rchar`` of /proc/self/io: files, page cache or
    tmpfs alike), None where it cannot be read."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class MemoryDir:
    """A memory tier directory of the bench's own (``MemoryTier.memory_dir``), so that a run leaves nothing.

    A fresh ``nostall-bench-*`` directory under ``parent`` (default ``/dev/shm``, else the temporary
    directory). :meth:`close` waits (bounded) for the holders whose marks are in it to exit (every manager
    that released the tier makes its holder delete its root and exit), sends SIGTERM to one that does not
    (a holder deletes its root and exits on it), then SIGKILL, and removes the directory: everything in it
    is the bench's. A process is signalled only when its mark is in this directory and its command line
    names this directory (the holder's arguments do), so never another job's.
    """

    def __init__(self, parent: Optional[str] = None) -> None:
        parent = parent or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.path = tempfile.mkdtemp(prefix="nostall-bench-", dir=parent)
        self.signalled: List[int] = []  # holders that had to be stopped by close()

    def __enter__(self) -> "MemoryDir":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def holders(self) -> List[int]:
        """The pids of the live holders whose marks are in this directory."""
        from nostall.memory.rendezvous import read_mark

        base = os.path.join(self.path, f"nostall-{os.getuid()}")
        try:
            names = os.listdir(base)
        except OSError:
            return []
        pids = []
        for name in names:
            mark = read_mark(base, name[: -len(".holder")]) if name.endswith(".holder") else None
            if mark is not None and self._ours(mark["pid"]):
                pids.append(mark["pid"])
        return pids

    def _ours(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            return False
        return any(a.startswith(self.path.encode()) for a in args)

    def close(self, bound: float = 15.0) -> None:
        """Holders gone (bounded: ``bound`` seconds each for their own exit, SIGTERM, SIGKILL); directory removed."""
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            pids = self.holders()
            if not pids:
                break
            for pid in pids:
                if sig is not None:
                    self.signalled.append(pid)
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            deadline = time.monotonic() + bound
            while self.holders() and time.monotonic() < deadline:
                time.sleep(0.05)
        shutil.rmtree(self.path, ignore_errors=True)


def local_tensors(state: Dict[str, Any]) -> List[Any]:
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


def full_template(state: Dict[str, Any]) -> Dict[str, Any]:
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


def zero_template(state: Dict[str, Any]) -> Dict[str, Any]:
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


class TrainLoop:
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


def _dcp_subprocess_quietly(*args: Any, **kwargs: Any) -> Any:
    """DCP's process executor's background process (see :func:`quiet_dcp_process`), with its
    root logger at WARNING once DCP has set it up, and leaving quietly on Ctrl-C (:func:`exit_on_sigint`)."""
    import logging

    exit_on_sigint()

    from torch.distributed.checkpoint import _async_process_executor as ape

    setup = ape._init_logger

    def quiet(rank: int) -> None:
        setup(rank)
        logging.getLogger().setLevel(logging.WARNING)

    ape._init_logger = quiet  # type: ignore[assignment]
    return ape._AsyncCheckpointProcess._checkpointing_subprocess(*args, **kwargs)


def quiet_dcp_process() -> None:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while :func:`gather_ranks` waited: ``partial`` holds each rank's last :func:`report_partial`."""

    def __init__(self, partial: Dict[int, Any]) -> None:
        super().__init__("interrupted")
        self.partial = partial


def exit_on_sigint() -> None:
    """In a process the launcher started: Ctrl-C (SIGINT, which a terminal sends to the whole process
    group) ends it at once, quietly, with status 130: the launcher prints what was measured."""
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))


def report_partial(q: Any, rank: int, result: Any) -> None:
    """In a rank process: the results measured so far, which the launcher keeps in case of Ctrl-C."""
    q.put((rank, {"partial": result}))


def gather_ranks(worker: Callable[..., None], ranks: int, root: str, cfg: Dict[str, Any], timeout: float,
                 what: str = "benchmark") -> Dict[int, Any]:
    """Run ``worker(rank, ranks, init, root, cfg, queue)`` in ``ranks`` spawned processes and collect their results.

    Every benchmark mode launches its ranks with this: ``init`` is a
    ``tcp://127.0.0.1`` address for their gloo group, and each rank puts
    ``(rank, result)`` on ``queue`` (a dict with ``"error"`` when it failed;
    ``{"partial": ...}`` from :func:`report_partial` meanwhile). Raises if a
    rank fails or dies, or the whole run outlasts ``timeout`` seconds, and
    :class:`Interrupted` (with the partial results) on Ctrl-C; no rank
    process is left on return.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    pc = mp.start_processes(worker, args=(ranks, init, root, cfg, q), nprocs=ranks, join=False, start_method="spawn")
    per_rank: Dict[int, Any] = {}
    partial: Dict[int, Any] = {}
    try:
        _collect(q, pc.processes, ranks, time.monotonic() + timeout, timeout, what, per_rank, partial)
        pc.join(60)
    except KeyboardInterrupt:
        raise Interrupted(partial) from None
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    return per_rank


def _collect(q: Any, procs: Sequence[Any], ranks: int, deadline: float, timeout: float, what: str,
             per_rank: Dict[int, Any], partial: Dict[int, Any]) -> None:
    """Read the ranks' messages into ``per_rank`` (results) and ``partial`` (results so far)."""
    while len(per_rank) < ranks:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"the {what} did not finish within {timeout:.0f}s")
        try:
            rank, r = q.get(timeout=min(5.0, left))
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a {what} rank died") from None
            continue
        if isinstance(r, dict) and "error" in r:
            raise RuntimeError(f"rank {rank} failed: {r['error']}")
        if isinstance(r, dict) and set(r) == {"partial"}:
            partial[rank] = r["partial"]
            continue
        per_rank[rank] = r


def serve_rank(rank: int, world: int, init: str, q: Any, body: Callable[[], Any]) -> None:
    """In a rank process that :func:`gather_ranks` started: join the gloo group at ``init``, put
    ``(rank, body())`` on ``q`` (or ``(rank, {"error": ...})`` when it raised, so that the launcher
    does not wait forever), and leave the group. Ctrl-C ends it quietly (:func:`exit_on_sigint`)."""
    import torch.distributed as dist

    exit_on_sigint()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    try:
        q.put((rank, body()))
    except BaseException as e:  # report, so that the launcher does not wait forever
        import traceback

        q.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- figures


def median(xs: Sequence[float]) -> float:
    """The median, NaN for none."""
    return statistics.median(xs) if xs else float("nan")


def write_outputs(out: Dict[str, Any], table: str, json_path: Any, plot_path: Any,
                  plot: Callable[[Dict[str, Any], str], Any]) -> None:
    """A run's table on stdout, and its figures to ``json_path`` and ``plot(out, plot_path)`` when given."""
    print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    if plot_path:
        plot(out, plot_path)
