"""Ctrl-C during ``nostall bench``: the ranks stop quietly, the table of what was measured is printed, exit 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def test_bench_ctrl_c_prints_partial_table(tmp_path):
    # the whole process group gets SIGINT, as from a terminal's Ctrl-C (the ranks and their helpers too)
    cmd = [sys.executable, "-m", "nostall", "bench", "--ranks", "2", "--mb-per-rank", "1", "--reps", "1000",
           "--systems", "nostall_async,dcp_async_thread", "--no-load", "--no-train", "--small-mb", "",
           "--dir", str(tmp_path / "run")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    err = []
    try:
        assert p.stderr is not None
        for line in p.stderr:
            err.append(line)
            if "dcp_async_thread rep 2/" in line:  # rep 1 of every system is in the launcher's hands by now
                os.killpg(p.pid, signal.SIGINT)
                break
        out, rest = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    stderr = "".join(err) + rest
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert "interrupted (Ctrl-C)" in out
    rows = {}
    for line in out.splitlines():
        if line.split():
            rows.setdefault(line.split()[0], line)  # a system's row comes before the ratios that name it
    for system in ("copy", "write", "nostall_async", "dcp_async_thread"):
        assert " ms (" in rows[system], out  # measured: a median with its range
