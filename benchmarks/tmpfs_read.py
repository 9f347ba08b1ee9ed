"""Why a memory-tier restore is not at memcpy speed: reading a tmpfs file against a memcpy of the same bytes.

    .venv/bin/python benchmarks/tmpfs_read.py [--mb 256] [--dir /dev/shm] [--reps 5]

Times (best of ``--reps``) a memcpy of ``--mb`` MiB into a touched buffer, ``preadv`` of the same bytes
from a file in ``--dir`` into that buffer (what a restore's reads do), and CRC32C of them (what its
checksum checks do), and prints each as a ratio to the memcpy. On a tmpfs whose pages are 4 KiB
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` = never) the read alone is ~2-2.7x a memcpy.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Callable

import crc32c
import numpy as np


def best(f: Callable[[], None], reps: int) -> float:
    out = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        out = min(out, time.perf_counter() - t)
    return out * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    n = a.mb << 20
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    dst = np.ones(n, dtype=np.uint8)
    view = memoryview(dst)
    fd_, path = tempfile.mkstemp(dir=a.dir, prefix="nostall-tmpfs-read-")
    os.close(fd_)
    try:
        src.tofile(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            def read() -> None:
                off = 0
                while off < n:
                    off += os.preadv(fd, [view[off:off + (64 << 20)]], off)

            def check() -> None:
                for o in range(0, n, 1 << 20):
                    crc32c.crc32c(view[o:o + (1 << 20)])

            mc = best(lambda: np.copyto(dst, src), a.reps)
            rd = best(read, a.reps)
            cr = best(check, a.reps)
        finally:
            os.close(fd)
    finally:
        os.unlink(path)
    print(f"{a.mb} MiB from {a.dir}: memcpy {mc:.1f} ms, pread {rd:.1f} ms ({rd / mc:.2f}x), "
          f"crc32c {cr:.1f} ms ({cr / mc:.2f}x)")


if __name__ == "__main__":
    main()
