"""Run a command on a busy machine: N CPU-bound processes spin beside it.

    python tests/burn.py 2 -- .venv/bin/python -m pytest tests/test_crash.py -x -q
    make test-burn                     # `make test` beside 2 burners (BURNERS=n to change)

No test's verdict may depend on how fast the machine is; this is how to
check. The burners are stopped when the command ends, whatever happens: a
normal exit, a failure, Ctrl-C, SIGTERM, or this script itself being killed
(each burner asks the kernel for SIGKILL when its parent dies). The exit
status is the command's (128 + signal number if a signal ended it).
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from typing import List

_BURN = "while True:\n    pass\n"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the burner, between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the finally clause still stops them
        pass


def start_burners(n: int) -> List[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", _BURN], stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            for _ in range(n)]


def stop(burners: List[subprocess.Popen]) -> None:
    for p in burners:
        if p.poll() is None:
            p.kill()
    for p in burners:
        p.wait()


def main(argv: List[str]) -> int:
    if "--" not in argv or argv.index("--") != 1 or not argv[0].isdigit() or len(argv) < 3:
        print(__doc__.strip().splitlines()[0] + "\nusage: python tests/burn.py N -- COMMAND [ARGS...]",
              file=sys.stderr)
        return 2
    n = int(argv[0])
    cmd = argv[2:]

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through the finally clause below

    signal.signal(signal.SIGTERM, on_term)
    burners = start_burners(n)
    child = None
    t0 = time.monotonic()
    try:
        print(f"burn.py: {n} CPU-bound burner(s) running (pids {[p.pid for p in burners]}) beside: "
              f"{' '.join(cmd)}", file=sys.stderr, flush=True)
        child = subprocess.Popen(cmd)
        code = child.wait()
    except KeyboardInterrupt:
        code = 130
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGINT)
            try:
                code = child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    finally:
        stop(burners)
    print(f"burn.py: command exited {code} after {time.monotonic() - t0:.0f}s; burners stopped",
          file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
