"""A last save on preemption, the holder's side: the persist process, started, polled, killed at its deadline.

docs/protocol.md, "Memory tier" ("A last save on preemption"). When the job is
preempted (a trainer of the host receives ``Options.preemption_signal``, or the
holder itself receives SIGTERM, SIGINT or SIGHUP), the holder starts one
*persist process* (:class:`Persisting`): a fresh torch-free interpreter that

1. holds the persistent root's lock (POSIX): rank 0's descriptor, which the
   holder hands it (``pass_fds``; its lock record is rewritten to say until
   when it holds it, so that a restarted job waits for it, bounded), or, when
   rank 0 left before the signal, the lock taken by an ordinary claim, polled
   until the deadline (a root another job holds is never written);
2. waits, for at most half of what is left, while a memory save is in flight
   in the memory root (its writers, or orphan writers finishing a job handed
   over whole, may still commit it);
3. copies the memory root's latest committed step ``m`` into the persistent
   root as ``step_<m>`` with :func:`nostall.interop.copy.copy_checkpoint`
   (every block checked against its checksum, the one commit routine), when
   ``m`` is newer than the persistent root's latest;
4. moves the root's ``latest`` to ``m`` only if it still names an older step.

The holder kills it (SIGKILL: a kill at any point is safe, the commit is
atomic) at the deadline, ``grace_s`` from the signal less a margin. Its request
(including the root's ``storage_options``) comes on its stdin, never in argv,
env or a file; its outcome is one JSON line on its stdout. The process's body is
:mod:`nostall.interop.persist` (it copies with :mod:`nostall.interop.copy`, a
layer above this one; the holder runs it as a program). This module does not
import torch.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import IO, Any, Dict, Optional

log = logging.getLogger("nostall")

__all__ = ["Request", "Persisting", "deadline_after"]

_MAIN = "import sys\nfrom nostall.interop.persist import main\nsys.exit(main())\n"


def deadline_after(grace_s: float) -> float:
    """How long after the signal the persist ends (it is killed then): ``grace_s`` less a margin of
    ``min(1 s, grace_s / 10)``, so that it is over before the scheduler's SIGKILL."""
    return grace_s - min(1.0, grace_s / 10)


@dataclass(frozen=True)
class Request:
    """What the holder asks the persist process (JSON on its stdin).

    ``memory``: the memory root's directory. ``root``: the persistent root's URL;
    ``storage_options``: its fsspec options (object storage). ``left_s``: seconds
    until the deadline, from the persist's start. ``grace_s``: the grace period
    (for the lock record). ``lock_fd``: the descriptor of the persistent root's
    lock handed over (-1: none). ``trainer``: rank 0's trainer pid (for the lock
    record; 0: unknown).
    """

    memory: str
    root: str
    storage_options: Optional[Dict[str, Any]]
    left_s: float
    grace_s: float
    lock_fd: int = -1
    trainer: int = 0


class Persisting:
    """The holder's side: one persist process, started at the preemption, polled, killed at its deadline."""

    def __init__(self, req: Request, log_file: Optional[IO[Any]]) -> None:
        self.req = req
        self.deadline = time.monotonic() + req.left_s
        fds = [req.lock_fd] if req.lock_fd >= 0 else []
        env = dict(os.environ, NOSTALL_PROCESS_ROLE="persist")
        self.proc = subprocess.Popen([sys.executable, "-c", _MAIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log_file, env=env, pass_fds=fds, close_fds=True)
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(asdict(req)).encode())
            self.proc.stdin.close()
        except OSError:  # it died at start: poll() reports it
            pass

    def poll(self) -> Optional[Dict[str, Any]]:
        """The outcome once the process ended (killed at the deadline: a failure saying so), else None."""
        if self.proc.poll() is None:
            if time.monotonic() < self.deadline:
                return None
            self.proc.kill()
            self.proc.wait()
            self._close()
            return {"ok": False, "step": None, "bytes": 0, "seconds": round(self.req.left_s, 3),
                    "note": f"not done within the grace period ({self.req.left_s:.1f}s): stopped, nothing committed "
                            "(or the commit had happened already)"}
        assert self.proc.stdout is not None
        raw = self.proc.stdout.read(1 << 16)
        self._close()
        try:
            got = json.loads(raw)
            if isinstance(got, dict):
                return got
        except ValueError:
            pass
        return {"ok": False, "step": None, "bytes": 0, "seconds": 0.0,
                "note": f"the persist process exited with status {self.proc.returncode} and no outcome"}

    def kill(self) -> None:
        """Stop it now (the holder failed): a kill at any point is safe."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
