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
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as _queue
import shutil
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

__all__ = ["run_ranks", "free_port"]

# After the first rank reports a failure, how long to wait for the remaining
# ranks to report before killing them.  Ranks blocked in a collective with a
# dead peer would otherwise only give up after the gloo timeout.
FAILURE_GRACE_S = 5.0
# How long a child may take to exit after it has reported its result.
EXIT_GRACE_S = 30.0
# Process-group timeout used inside the children.
PG_TIMEOUT_S = 60.0


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
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

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
                            fail_deadline = now + FAILURE_GRACE_S
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
                fail_deadline = time.monotonic() + FAILURE_GRACE_S

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
                f"(ranks {missing} did not report within {FAILURE_GRACE_S:g}s "
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
