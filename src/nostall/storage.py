"""Storage back end: the local (or shared, POSIX) filesystem.

Everything that touches files goes through here, so that durability rules live
in one place: data is fsynced before it is renamed into place, directories are
fsynced after entries change, and pointers are replaced atomically.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from typing import Iterable, Optional

from .errors import CheckpointCorruptError

_WRITE_CHUNK = 64 << 20


def write_file(path: str, chunks: Iterable[memoryview]) -> int:
    """Create ``path`` from ``chunks``, fsync it, return the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    total = 0
    try:
        for chunk in chunks:
            mv = memoryview(chunk).cast("B")
            for i in range(0, len(mv), _WRITE_CHUNK):
                part = mv[i : i + _WRITE_CHUNK]
                while len(part):
                    n = os.write(fd, part)
                    part = part[n:]
                    total += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return total


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write_file(tmp, [memoryview(data)])
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_exact(fd: int, offset: int, length: int, path: str, into: Optional[memoryview] = None) -> memoryview:
    """Read exactly ``length`` bytes at ``offset``; a short read is corruption."""
    buf = into if into is not None else memoryview(bytearray(length))
    got = 0
    while got < length:
        n = os.preadv(fd, [buf[got:length]], offset + got)
        if n == 0:
            raise CheckpointCorruptError(
                f"{path}: truncated: wanted bytes [{offset}, {offset + length}) but the file ends at {offset + got}"
            )
        got += n
    return buf[:length]


def open_regular(path: str) -> int:
    """Open a file of a checkpoint for reading; a symlink is refused (ELOOP), nothing else followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link; checkpoint files must be regular files", path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


def read_whole(path: str, limit: int) -> bytes:
    """A whole regular file of at most ``limit`` bytes (checked before reading)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise OSError(errno.EFBIG, f"{size} bytes, more than the {limit} accepted", path)
        return bytes(read_exact(fd, 0, size, path)) if size else b""
    finally:
        os.close(fd)


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
