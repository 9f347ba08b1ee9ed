"""Run a function on N real ``torch.distributed`` gloo ranks from a pytest test.

Usage::

    from tests.dist_harness import run_ranks

    def _body(rank, world_size, x):          # MUST be module-level
        import torch, torch.distributed as dist
        t = torch.tensor([float(rank + x)])
        dist.all_reduce(t)
        return t.item()                      # MUST be picklable

    def test_something():
        assert run_ranks(2, _body, 1.0) == [3.0, 3.0]

Rules:

* ``fn`` and every element of ``args`` are sent to the children with
  :mod:`pickle` (``spawn`` start method), so ``fn`` must be a module-level
  function importable by reference (no lambdas, closures or nested
  functions), e.g. a function defined at the top of a ``tests/test_*.py``
  module.  The value ``fn`` returns must be picklable too.
* Each child sets ``OMP_NUM_THREADS=1`` and the ``env`` overrides in
  ``os.environ`` *before* unpickling ``fn``/``args`` and importing torch, so
  the overrides are seen by torch and by the module that defines ``fn``.
  A value of ``None`` in ``env`` removes that variable in the children.
* The process group is initialised with a fresh ``file://`` FileStore in a
  private temporary directory, which is deleted afterwards.
* Every child process is joined (or SIGKILLed and joined) before
  :func:`run_ranks` returns or raises: no leaks, no zombies.

Faster: :class:`RankPool` keeps ``world_size`` gloo ranks alive between
jobs (same rules for ``fn``/``args``), so a job costs milliseconds instead
of a spawn + ``import torch`` + rendezvous.  Tests get the session's pools
from the fixtures in ``tests/conftest.py``::

    def test_something(pool2):
        assert pool2.run(_body, 1.0) == [3.0, 3.0]

Keep :func:`run_ranks` for tests that kill ranks, pass ``env`` overrides or
need a pristine interpreter per call.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue as _queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
import weakref
from typing import Any, Callable

__all__ = ["run_ranks", "free_port", "RankPool", "RankPools"]

# After the first rank reports a failure, how long to wait for the remaining
# ranks to report before killing them.  Ranks blocked in a collective with a
# dead peer would otherwise only give up after the gloo timeout.
FAILURE_GRACE_S = 5.0
# How long a child may take to exit after it has reported its result.
EXIT_GRACE_S = 30.0
# Process-group timeout used inside the children.
PG_TIMEOUT_S = 60.0


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    rank: int,
    world_size: int,
    init_file: str,
    payload: bytes,
    env: dict | None,
    q: Any,
) -> None:
    """Entry point of one rank (runs in a spawned process)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    for k, v in (env or {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)

    status, result = "err", "rank did not run"
    initialised = False
    dist = None
    try:
        from datetime import timedelta

        import torch.distributed as dist

        fn, args = pickle.loads(payload)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
        initialised = True
        value = fn(rank, world_size, *args)
        try:
            result = pickle.dumps(value)
        except Exception:
            result = (
                f"return value of {getattr(fn, '__qualname__', fn)!r} is not "
                f"picklable:\n{traceback.format_exc()}"
            )
        else:
            status = "ok"
    except BaseException:
        status, result = "err", traceback.format_exc()
    finally:
        if initialised and dist is not None:
            try:
                dist.destroy_process_group()
            except Exception:
                if status == "ok":
                    status, result = "err", (
                        "destroy_process_group failed:\n" + traceback.format_exc()
                    )
    q.put((rank, status, result))
    # Queue.put hands the data to a feeder thread; it is flushed at exit
    # (the queue's join_thread runs as a finaliser).


def _format_errors(errors: dict[int, str]) -> str:
    parts = []
    for r in sorted(errors):
        parts.append(f"--- rank {r} ---\n{errors[r].rstrip()}")
    return "\n".join(parts)


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    env: dict | None = None,
    grace: float = FAILURE_GRACE_S,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Once a rank failed, the others get ``grace`` seconds to finish before they are killed.

    Returns the per-rank return values ordered by rank.  Raises
    ``AssertionError`` if any rank raised (message contains the traceback of
    every failed rank) or if not all ranks reported within ``timeout``
    seconds (message starts with ``"ranks timed out"``; the stragglers are
    SIGKILLed).  ``fn`` must be a module-level function (see module doc).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        payload = pickle.dumps((fn, args))
    except Exception as e:
        raise TypeError(
            "run_ranks: fn and args must be picklable; fn must be a "
            f"module-level function (got {fn!r}): {e}"
        ) from e

    ctx = mp.get_context("spawn")
    tmpdir = tempfile.mkdtemp(prefix="nostall-dist-")
    init_file = os.path.join(tmpdir, "filestore")
    q = ctx.Queue()
    procs: list = []
    ok = False
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for r in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(r, world_size, init_file, payload, env, q),
                name=f"nostall-rank{r}",
                daemon=True,
            )
            p.start()
            procs.append(p)

        deadline = time.monotonic() + timeout
        fail_deadline: float | None = None
        dead_since: dict[int, float] = {}
        timed_out = False
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            limit = deadline if fail_deadline is None else min(deadline, fail_deadline)
            if now >= limit:
                timed_out = now >= deadline
                break
            try:
                rank, status, res = q.get(timeout=min(0.2, limit - now))
            except _queue.Empty:
                # A rank that died without reporting (segfault, os._exit,
                # OOM kill...) counts as failed once its last message, if
                # any, has had time to arrive.
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r in results or r in errors or p.exitcode is None:
                        continue
                    first = dead_since.setdefault(r, now)
                    if now - first > 1.0:
                        errors[r] = (
                            f"process exited with code {p.exitcode} "
                            "without reporting a result"
                        )
                        if fail_deadline is None:
                            fail_deadline = now + grace
                continue
            if status == "ok":
                try:
                    results[rank] = pickle.loads(res)
                except Exception:
                    errors[rank] = (
                        "could not unpickle the return value in the parent:\n"
                        + traceback.format_exc()
                    )
            else:
                errors[rank] = res
            if errors and fail_deadline is None:
                fail_deadline = time.monotonic() + grace

        missing = [
            r for r in range(world_size) if r not in results and r not in errors
        ]
        if missing:
            # Kill stragglers now so the message reflects reality.
            for r in missing:
                if procs[r].is_alive():
                    procs[r].kill()
            if timed_out or not errors:
                msg = (
                    f"ranks timed out after {timeout:g}s: ranks {missing} did not "
                    f"report (SIGKILLed) out of world_size={world_size}"
                )
                if errors:
                    msg += "\nfailed ranks:\n" + _format_errors(errors)
                raise AssertionError(msg)
            raise AssertionError(
                f"{len(errors)} of {world_size} ranks failed "
                f"(ranks {missing} did not report within {grace:g}s "
                f"of the first failure and were SIGKILLed):\n"
                + _format_errors(errors)
            )
        if errors:
            raise AssertionError(
                f"{len(errors)} of {world_size} ranks failed:\n"
                + _format_errors(errors)
            )
        ok = True
        return [results[r] for r in range(world_size)]
    finally:
        if not ok:
            # Failure or interruption: nothing more is wanted from any rank.
            for p in procs:
                if p.is_alive():
                    p.kill()
        exit_deadline = time.monotonic() + EXIT_GRACE_S
        for p in procs:
            p.join(timeout=max(0.0, exit_deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for p in procs:
            p.close()
        q.close()
        q.cancel_join_thread()
        shutil.rmtree(tmpdir, ignore_errors=True)


# =============================================================================
# Persistent rank pool
# =============================================================================
#
# Spawning ``world_size`` fresh interpreters, importing torch and
# rendezvousing a gloo group costs seconds per call.  A :class:`RankPool`
# pays that once: its workers keep a live default process group and run one
# job after another.  Protocol over one duplex Pipe per rank (parent end in
# ``RankPool._conns``):
#
#   parent -> worker   ("job", job_id, payload)  |  ("stop",)
#   worker -> parent   ("ready", pid, None)                      once, after init
#                      ("init-err", None, traceback)             init failed; exits
#                      ("done", job_id, (status, result, fingerprint, broken))
#
# A Pipe (rather than a Queue) per rank keeps things simple: no feeder
# threads, no lock shared with a process that may be SIGKILLed, and the
# parent sees a worker's death as EOF on its connection.

# Prefix of the pool workers' process names (see ``mp.active_children()``).
POOL_PROCESS_PREFIX = "nostall-pool"
# How long ``RankPool.run`` waits for freshly spawned workers to import torch
# and rendezvous, before the job's own ``timeout`` starts.
POOL_START_TIMEOUT_S = 120.0
# How long ``RankPool.close`` waits for the workers to exit after "stop".
POOL_CLOSE_GRACE_S = 10.0


def _pool_fingerprint() -> tuple:
    """What must be equal on every rank after a job for the pool to be reusable.

    The default group's collective sequence number and the group counter that
    ``new_group`` uses to name groups: a rank that ran a different number of
    collectives / ``new_group`` calls than its peers (e.g. it failed half-way
    through a job while the others went on) would mismatch every later job.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        seq = dist.group.WORLD._get_sequence_number_for_group()
    except Exception:  # pragma: no cover - backend without sequence numbers
        seq = None
    return (seq, getattr(c10d._world, "group_count", None))


def _pool_after_job() -> str | None:
    """Why this worker can't run another job, or None."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return "the job destroyed the default process group"
    return None


def _pool_destroy_leftover_groups() -> None:
    """Destroy the process groups earlier jobs left (all but the default one).

    E.g. a 2-D DeviceMesh's sub-groups: they would otherwise pile up, each
    with its sockets and threads.  Called after the pre-job barrier, when
    every rank is done with the previous job: destroying a gloo group is
    local, and a peer still connecting to a group that this rank destroys
    would fail (see _pool_run_job).
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = dist.group.WORLD
    for pg in list(c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)


def _pool_run_job(rank: int, world_size: int, payload: bytes) -> tuple:
    """Run one job in a pool worker: (status, result, fatal reason or None)."""
    import torch.distributed as dist

    try:
        # Start the job on every rank together, as a fresh init_process_group
        # does for run_ranks.  Without it a rank that got the job late (busy
        # machine) can still be inside a new_group's connectFullMesh when a
        # faster peer has already destroyed that group -- gloo then fails the
        # slow rank with "Connection closed by peer" (seen with a
        # CheckpointManager created and closed without any collective).
        dist.barrier()
    except BaseException:
        return "err", traceback.format_exc(), "the pre-job barrier on the default group failed"
    try:
        _pool_destroy_leftover_groups()
    except BaseException:
        return "err", traceback.format_exc(), "destroying the groups left by an earlier job failed"
    fn = None
    try:
        fn, args = pickle.loads(payload)
        value = fn(rank, world_size, *args)
    except BaseException as e:
        fatal = None
        if isinstance(e, (SystemExit, KeyboardInterrupt)):
            # Someone wants this process gone (sys.exit in the job, a SIGTERM
            # handler, Ctrl-C): report, then exit.
            fatal = f"the job raised {type(e).__name__}"
        return "err", traceback.format_exc(), fatal
    try:
        return "ok", pickle.dumps(value), None
    except Exception:
        return "err", (
            f"return value of {getattr(fn, '__qualname__', fn)!r} is not "
            f"picklable:\n{traceback.format_exc()}"
        ), None


def _pool_worker(rank: int, world_size: int, init_file: str, conn: Any, env: dict | None) -> None:
    """Entry point of one pool rank (runs in a spawned process)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    for k, v in (env or {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)

    dist = None
    code = 0
    try:
        try:
            from datetime import timedelta

            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=PG_TIMEOUT_S),
            )
        except BaseException:
            conn.send(("init-err", None, traceback.format_exc()))
            return
        conn.send(("ready", os.getpid(), None))

        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError, KeyboardInterrupt):
                return  # parent went away / interrupted while idle
            if msg[0] != "job":
                return  # "stop"
            _, job_id, payload = msg
            status, result, fatal = _pool_run_job(rank, world_size, payload)
            payload = None
            try:
                broken = fatal or _pool_after_job()
                fingerprint = _pool_fingerprint() if broken is None else None
            except BaseException:
                broken, fingerprint = "post-job check failed:\n" + traceback.format_exc(), None
            conn.send(("done", job_id, (status, result, fingerprint, broken)))
            if broken is not None:
                return
    except BaseException:  # pragma: no cover - a bug in the loop above
        traceback.print_exc()
        code = 1
    finally:
        if dist is not None:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:
                pass
        try:
            conn.close()
        except Exception:
            pass
        # Run the atexit handlers (e.g. a CheckpointManager a job left open
        # drains its saves) but skip the rest of the interpreter's teardown:
        # with torch loaded that costs ~1 s of CPU per worker for nothing.
        try:
            atexit._run_exitfuncs()
        except BaseException:
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _pool_reap(procs: list, conns: list, tmpdir: str | None) -> None:
    """SIGKILL, join and free one set of pool workers (also the exit-time finaliser)."""
    try:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
    finally:
        for p in procs:
            try:
                p.close()
            except ValueError:  # pragma: no cover - still running (cannot happen)
                pass
        for c in conns:
            c.close()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


class RankPool:
    """``world_size`` long-lived gloo ranks that run jobs like :func:`run_ranks`.

    ::

        pool = RankPool(2)
        try:
            assert pool.run(_body, 1.0) == [3.0, 3.0]
        finally:
            pool.close()

    * ``RankPool(world_size)`` spawns the workers at once (``spawn`` start
      method); each sets ``OMP_NUM_THREADS=1`` (and the ``env`` overrides),
      initialises the default gloo group with a ``file://`` FileStore in a
      private temporary directory (timeout ``PG_TIMEOUT_S``) and then waits
      for jobs.  Readiness is awaited by the first :meth:`run` (up to
      ``POOL_START_TIMEOUT_S``, not counted in the job's ``timeout``).
    * :meth:`run` has the rules and the error reporting of :func:`run_ranks`
      (module-level ``fn``, picklable args and return value, AssertionError
      with every failed rank's traceback, ``"ranks timed out"``).
    * The pool survives a job whose ranks all report, errors included.  It is
      *broken* -- every worker SIGKILLed and joined, the temp dir removed --
      when a job times out, when ranks are still running ``FAILURE_GRACE_S``
      after the first failure (they would be stuck in a collective), when a
      worker dies, when a job destroys the default group, or when the ranks
      end a job out of step (different collective / ``new_group`` counts).
      The next :meth:`run` then starts a fresh set of workers.
    * Every job starts with a ``dist.barrier()`` on the default group (so
      ranks enter ``fn`` together, as after a fresh rendezvous), after which
      each worker destroys the process groups earlier jobs left behind
      (e.g. DeviceMesh sub-groups): ``fn`` always starts with only the
      default group.  Other process-global state a job changes
      (``os.environ``, module globals, torch settings, signal handlers)
      persists into later jobs: jobs must not depend on a pristine
      interpreter -- use :func:`run_ranks` for those, and for tests that kill
      ranks or pass ``env``.
    * :meth:`close` (idempotent) stops the workers, SIGKILLs stragglers after
      ``POOL_CLOSE_GRACE_S``, joins them and removes the temp dir.
    """

    def __init__(self, world_size: int, *, env: dict | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.env = dict(env) if env else None
        self.starts = 0  # how many times a set of workers was spawned
        self._procs: list = []
        self._conns: list = []
        self._ready: set[int] = set()
        self._tmpdir: str | None = None
        self._job_id = 0
        self._finalizer: Any = None
        self._start()

    # -- state -----------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """True while a set of workers is running (i.e. ``run`` won't restart)."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        """PIDs of the current workers by rank (empty when none are running)."""
        return [p.pid for p in self._procs]

    def __repr__(self) -> str:
        return f"RankPool(world_size={self.world_size}, alive={self.alive}, pids={self.pids})"

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- lifecycle -------------------------------------------------------------

    def _start(self) -> None:
        assert not self._procs
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="nostall-pool-")
        init_file = os.path.join(self._tmpdir, "filestore")
        self._ready = set()
        self.starts += 1
        # A pool nobody closed (a crashed script, a missing fixture teardown)
        # is still reaped -- workers killed, temp dir removed -- when it is
        # garbage collected or at interpreter exit.
        self._finalizer = weakref.finalize(self, _pool_reap, self._procs, self._conns, self._tmpdir)
        try:
            for r in range(self.world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=_pool_worker,
                    args=(r, self.world_size, init_file, child_conn, self.env),
                    name=f"{POOL_PROCESS_PREFIX}{self.world_size}-rank{r}",
                    daemon=True,
                )
                self._conns.append(parent_conn)
                try:
                    p.start()
                finally:
                    # Only the child keeps its end: EOF then means it is gone.
                    child_conn.close()
                self._procs.append(p)
        except BaseException:
            self._teardown(graceful=False)
            raise

    def _teardown(self, graceful: bool) -> None:
        """Stop (graceful) or SIGKILL every worker, join them, free everything."""
        procs, conns, tmpdir = self._procs, self._conns, self._tmpdir
        self._procs, self._conns, self._tmpdir, self._ready = [], [], None, set()
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        try:
            if graceful:
                for p, c in zip(procs, conns):
                    if p.is_alive():
                        try:
                            c.send(("stop",))
                        except (OSError, ValueError):
                            pass
                deadline = time.monotonic() + POOL_CLOSE_GRACE_S
                for p in procs:
                    p.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            _pool_reap(procs, conns, tmpdir)

    def kill(self) -> None:
        """SIGKILL and join every worker now (the next ``run`` starts new ones)."""
        self._teardown(graceful=False)

    def close(self) -> None:
        """Stop the workers (SIGKILL after ``POOL_CLOSE_GRACE_S``); idempotent."""
        self._teardown(graceful=True)

    def ensure_started(self) -> None:
        """Start a fresh set of workers unless the current one is alive."""
        if not self.alive:
            self.kill()  # reap what is left of a broken set
            self._start()

    # -- running jobs ----------------------------------------------------------

    def _wait_ready(self) -> None:
        from multiprocessing.connection import wait

        deadline = time.monotonic() + POOL_START_TIMEOUT_S
        errors: dict[int, str] = {}
        waiting = [r for r in range(self.world_size) if r not in self._ready]
        while waiting and not errors:
            now = time.monotonic()
            if now >= deadline:
                break
            conns = {self._conns[r]: r for r in waiting}
            for c in wait(list(conns), timeout=deadline - now):
                r = conns[c]
                try:
                    kind, _, res = c.recv()
                except (EOFError, OSError):
                    self._procs[r].join(timeout=1.0)
                    errors[r] = (
                        f"pool worker exited with code {self._procs[r].exitcode} "
                        "while starting"
                    )
                    continue
                if kind == "ready":
                    self._ready.add(r)
                else:
                    errors[r] = res
            waiting = [r for r in range(self.world_size) if r not in self._ready]
        if waiting or errors:
            self.kill()
            if errors:
                raise AssertionError(
                    f"rank pool (world_size={self.world_size}) failed to start:\n"
                    + _format_errors(errors)
                )
            raise AssertionError(
                f"rank pool (world_size={self.world_size}) did not start within "
                f"{POOL_START_TIMEOUT_S:g}s: ranks {waiting} not ready"
            )

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list:
        """Run ``fn(rank, world_size, *args)`` on every rank; results by rank.

        Same contract as :func:`run_ranks` (see the class doc for when the
        pool is torn down and restarted).
        """
        from multiprocessing.connection import wait

        try:
            payload = pickle.dumps((fn, args))
        except Exception as e:
            raise TypeError(
                "RankPool.run: fn and args must be picklable; fn must be a "
                f"module-level function (got {fn!r}): {e}"
            ) from e

        self.ensure_started()
        self._wait_ready()
        ws = self.world_size
        self._job_id += 1
        job_id = self._job_id
        keep = False  # whether the workers are reusable afterwards
        try:
            results: dict[int, Any] = {}
            errors: dict[int, str] = {}
            fingerprints: dict[int, Any] = {}
            broken: dict[int, str] = {}
            for r, c in enumerate(self._conns):
                try:
                    c.send(("job", job_id, payload))
                except (OSError, ValueError):
                    errors[r] = "could not send the job: the pool worker is gone"
                    broken[r] = "worker gone"

            deadline = time.monotonic() + timeout
            fail_deadline: float | None = None
            timed_out = False
            pending = {r for r in range(ws) if r not in errors}
            if errors:
                fail_deadline = time.monotonic() + FAILURE_GRACE_S
            while pending:
                now = time.monotonic()
                limit = deadline if fail_deadline is None else min(deadline, fail_deadline)
                if now >= limit:
                    timed_out = now >= deadline
                    break
                conns = {self._conns[r]: r for r in pending}
                for c in wait(list(conns), timeout=limit - now):
                    r = conns[c]
                    try:
                        kind, jid, res = c.recv()
                    except (EOFError, OSError):
                        # Died without reporting (segfault, os._exit, OOM kill...).
                        self._procs[r].join(timeout=1.0)
                        errors[r] = (
                            f"process exited with code {self._procs[r].exitcode} "
                            "without reporting a result"
                        )
                        broken[r] = "worker died"
                        pending.discard(r)
                        continue
                    if kind != "done" or jid != job_id:  # pragma: no cover - protocol bug
                        errors[r] = f"unexpected message from pool worker: {(kind, jid)!r}"
                        broken[r] = "protocol error"
                        pending.discard(r)
                        continue
                    status, value, fingerprints[r], why = res
                    if why is not None:
                        broken[r] = why
                    if status == "ok":
                        try:
                            results[r] = pickle.loads(value)
                        except Exception:
                            errors[r] = (
                                "could not unpickle the return value in the parent:\n"
                                + traceback.format_exc()
                            )
                    else:
                        errors[r] = value
                    if why is not None:
                        note = f"pool worker unusable after the job (pool killed): {why}"
                        errors[r] = f"{errors[r].rstrip()}\n{note}" if r in errors else note
                    pending.discard(r)
                if errors and fail_deadline is None:
                    fail_deadline = time.monotonic() + FAILURE_GRACE_S

            missing = sorted(pending)
            if missing:
                self.kill()  # kill stragglers now so the message reflects reality
                if timed_out or not errors:
                    msg = (
                        f"ranks timed out after {timeout:g}s: ranks {missing} did not "
                        f"report (SIGKILLed) out of world_size={ws}; the pool was "
                        "killed and will restart on the next run"
                    )
                    if errors:
                        msg += "\nfailed ranks:\n" + _format_errors(errors)
                    raise AssertionError(msg)
                raise AssertionError(
                    f"{len(errors)} of {ws} ranks failed "
                    f"(ranks {missing} did not report within {FAILURE_GRACE_S:g}s "
                    f"of the first failure and were SIGKILLed; the pool was killed "
                    f"and will restart on the next run):\n" + _format_errors(errors)
                )
            in_step = len(set(map(repr, fingerprints.values()))) <= 1
            keep = not broken and in_step
            if errors:
                msg = f"{len(errors)} of {ws} ranks failed:\n" + _format_errors(errors)
                if not in_step:
                    msg += (
                        "\n(the ranks ended the job out of step -- different "
                        "collective / new_group counts on the default group: "
                        f"{dict(sorted(fingerprints.items()))} -- so the pool was "
                        "killed and will restart on the next run)"
                    )
                raise AssertionError(msg)
            return [results[r] for r in range(ws)]
        finally:
            if not keep:
                # Failure, desync or interruption: nothing more is wanted from
                # these workers.
                self.kill()


class RankPools:
    """Lazily started :class:`RankPool` per world size, at most ``max_alive`` running.

    ``get(world_size)`` returns the pool for that size (starting or restarting
    its workers as needed) and first closes the least recently requested
    other pools so that no more than ``max_alive`` sets of workers run.  A
    closed pool restarts by itself if it is used again.
    """

    def __init__(self, max_alive: int = 2) -> None:
        if max_alive < 1:
            raise ValueError("max_alive must be >= 1")
        self.max_alive = max_alive
        self._pools: dict[int, RankPool] = {}  # least recently requested first

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.pop(world_size, None)
        running = [p for p in self._pools.values() if p.pids]
        for other in running[: max(0, len(running) - (self.max_alive - 1))]:
            other.close()
        if pool is None:
            pool = RankPool(world_size)
        else:
            pool.ensure_started()
        self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        errors = []
        for p in pools:
            try:
                p.close()
            except Exception as e:  # pragma: no cover - keep closing the others
                errors.append(e)
        if errors:  # pragma: no cover
            raise errors[0]
