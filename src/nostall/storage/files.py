"""Storage back end: the local (or shared, POSIX) filesystem.

Everything that touches files goes through here, so that durability rules live
in one place: data is fsynced before it is renamed into place, directories are
fsynced after entries change, and pointers are replaced atomically.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import stat
import sys
import time
from typing import Callable, Iterable, List, Optional, Sequence

from nostall.errors import CheckpointCorruptError

_WRITE_CHUNK = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _writeback_starter() -> Optional[Callable[[int, int, int], None]]:
    """Linux's ``sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)``, or None elsewhere.

    It starts the disk writing the given range now and returns without
    waiting. Issued after every write of a large file, the disk works while
    the next bytes are copied and checksummed, so the final ``fsync`` (which
    alone makes the file durable) finds little left to wait for: on this
    project's machine it halved the time to write and fsync 512 MiB.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)

    def start(fd: int, offset: int, length: int) -> None:
        fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # advisory: a failure only loses the head start

    return start


_start_writeback = _writeback_starter()


class Pacer:
    """Keeps a job's writes at or under ``bytes_per_s`` on average (``Options.max_write_rate``).

    A background save then takes longer to become durable but takes less of
    the disk, memory bandwidth and CPU from training at any moment. Shared by
    every file of a job; :meth:`wrote` sleeps as long as the bytes so far are
    ahead of the rate. The cap never costs the save its deadline: pacing
    sleeps only within the first half of the job's time (``timeout``
    seconds from the first write); past it the rest is written at full speed
    and :attr:`lifted` says so.

    >>> p = Pacer(None)        # no limit: never sleeps
    >>> p.wrote(1 << 30)
    """

    def __init__(self, bytes_per_s: Optional[float], timeout: Optional[float] = None) -> None:
        self.rate = bytes_per_s
        self.timeout = timeout
        self.lifted = False  # pacing stopped so that the job finishes within its timeout
        self._t0: Optional[float] = None
        self._bytes = 0

    def wrote(self, n: int) -> None:
        if not self.rate or self.lifted:
            return
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        self._bytes += n
        ahead = self._bytes / self.rate - (now - self._t0)
        if ahead <= 0:
            return
        if self.timeout is not None:
            budget = self._t0 + self.timeout / 2 - now  # sleeping stops halfway to the deadline
            if ahead > budget:
                self.lifted = True
                ahead = max(0.0, budget)
        time.sleep(ahead)


class FileWriter:
    """A new file, written at a position that normally only moves forward, then fsynced.

    Writes go out in pieces of at most 64 MiB; after each, the disk is asked
    to start writing it (see :func:`_writeback_starter`); ``pacer`` caps the
    rate. :meth:`seek` moves the position back (an incremental save drops a
    piece it wrote before it knew the piece was unchanged); :meth:`finish`
    cuts the file at the position, fsyncs and closes it. Use as a context
    manager: the descriptor is closed on error (the file stays; its save's
    clean-up removes it).
    """

    def __init__(self, path: str, pacer: Optional[Pacer] = None) -> None:
        self.path = path
        self.pacer = pacer
        self.pos = 0
        self._fd: Optional[int] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                                          0o644)

    def __enter__(self) -> "FileWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def write(self, chunk: memoryview) -> None:
        assert self._fd is not None
        mv = memoryview(chunk).cast("B")
        for i in range(0, len(mv), _WRITE_CHUNK):
            part = mv[i : i + _WRITE_CHUNK]
            start = self.pos
            while len(part):
                n = os.pwrite(self._fd, part, self.pos)
                part = part[n:]
                self.pos += n
            if _start_writeback is not None and self.pos - start >= 1 << 20:
                _start_writeback(self._fd, start, self.pos - start)
            if self.pacer is not None:
                self.pacer.wrote(self.pos - start)

    def seek(self, pos: int) -> None:
        self.pos = pos

    def write_at(self, offset: int, data: bytes) -> None:
        """Overwrite bytes at ``offset`` (a header laid out once the pieces are known); the position stays."""
        assert self._fd is not None
        view = memoryview(data)
        while len(view):
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def finish(self) -> int:
        """Cut the file at the position, fsync it, close it; its size."""
        assert self._fd is not None
        os.ftruncate(self._fd, self.pos)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        return self.pos


def write_file(path: str, chunks: Iterable[memoryview], pacer: Optional[Pacer] = None) -> int:
    """Create ``path`` from ``chunks``, fsync it, return the bytes written (see :class:`FileWriter`)."""
    with FileWriter(path, pacer) as w:
        for chunk in chunks:
            w.write(chunk)
        return w.finish()


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


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(path: str, mode: int) -> OSError:
    return OSError(errno.EINVAL, f"is {_kind(mode)}, not a regular file; checkpoint files must be regular files "
                                 "(remove it, or restore the file it replaced)", path)


def open_regular(path: str) -> int:
    """Open a file of a checkpoint for reading: a regular file only, never blocking, nothing followed.

    A symlink is refused (ELOOP); a FIFO, device, socket or directory is
    refused without blocking (the open is non-blocking and the type checked
    on the open descriptor), so a FIFO in place of a file can never hang a
    reader. Raises ``OSError`` (``FileNotFoundError`` when missing).
    """
    try:
        mode = os.lstat(path).st_mode  # refuse devices before opening them (an open may have side effects)
    except ValueError:  # a NUL byte in the name
        raise OSError(errno.EINVAL, "invalid file name (it contains a NUL byte)", path) from None
    if stat.S_ISLNK(mode):
        raise OSError(errno.ELOOP, "is a symbolic link; checkpoint files must be regular files", path)
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link; checkpoint files must be regular files", path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode  # the file may have been replaced since lstat
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        if fl & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _too_big(path: str, size: int, limit: int) -> OSError:
    return OSError(errno.EFBIG, f"{size} bytes, more than the {limit} accepted", path)


def read_small_file(path: str, limit: int) -> bytes:
    """The whole regular file ``path``, of at most ``limit`` bytes.

    Opened as :func:`open_regular` does (no symlink followed, nothing but a
    regular file, never blocking on a FIFO). The size is checked against
    ``limit`` before anything is read, and at most ``limit + 1`` bytes are
    ever read, so a file that grows meanwhile cannot exceed it. Raises
    ``OSError`` (``FileNotFoundError`` when missing, ``EFBIG`` when too big).
    """
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise _too_big(path, size, limit)
        chunks = []
        total = 0
        while True:
            # what is left of the size seen, plus one byte to see the end (or growth)
            want = min(limit + 1 - total, size - total + 1 if total < size else 1 << 16)
            chunk = os.read(fd, want)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise _too_big(path, total, limit)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def read_whole(path: str, limit: int) -> bytes:
    """A whole regular file of at most ``limit`` bytes (checked before reading); see :func:`read_small_file`."""
    return read_small_file(path, limit)


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- beneath a directory, no link followed


def plain_parts(rel: str) -> List[str]:
    """The components of ``rel``, a plain relative file name (no empty, ``.`` or ``..`` component, not absolute,
    no NUL byte: the OS would refuse it with ``ValueError``, not ``OSError``); ``OSError(EINVAL)`` otherwise.
    A backslash is an ordinary character of a POSIX name (one component, nothing it could escape), so it is
    taken: a checkpoint's existing files may carry one. Every name reached *beneath* a directory is checked by
    it (also the names a memory tier's peer sends, memory/peers.py).

    >>> plain_parts("side/x.json")
    ['side', 'x.json']
    >>> plain_parts("x" + chr(0))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    OSError: [Errno 22] not a plain relative file name: ...
    """
    parts = rel.split("/")
    if not rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise OSError(errno.EINVAL, "not a plain relative file name", rel)
    return parts


def open_dir_beneath(top: str, folders: Sequence[str] = ()) -> int:
    """A descriptor of ``top/<folders...>``, opened one component at a time, each with ``O_NOFOLLOW``.

    No path component is followed if it is a symbolic link (the open fails with ``ELOOP`` or
    ``ENOTDIR``), so nothing reached through a link is ever touched through the descriptor.
    The caller closes it.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(top, flags)
    try:
        for part in folders:
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat_beneath(top: str, rel: str) -> Optional[os.stat_result]:
    """``lstat`` of ``top/rel`` reached without following any link; None when it is absent or any
    folder on the way is a link or not a directory (then it is not the file that name means here)."""
    parts = plain_parts(rel)
    try:
        fd = open_dir_beneath(top, parts[:-1])
    except OSError:
        return None
    try:
        return os.lstat(parts[-1], dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def unlink_beneath(top: str, rel: str) -> bool:
    """Delete the regular file ``top/rel`` (nothing followed on the way), then each folder of ``rel``
    it leaves empty. False (nothing deleted) when it is absent, not a regular file, or reached only
    through a link."""
    parts = plain_parts(rel)
    try:
        fd = open_dir_beneath(top, parts[:-1])
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.lstat(parts[-1], dir_fd=fd).st_mode):
            return False
        os.unlink(parts[-1], dir_fd=fd)
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)
    for i in range(len(parts) - 2, -1, -1):  # a side file's emptied folders, innermost first
        try:
            fd = open_dir_beneath(top, parts[:i])
        except OSError:
            break
        try:
            os.rmdir(parts[i], dir_fd=fd)
        except OSError:
            break  # not empty (or not ours to judge): left
        finally:
            os.close(fd)
    return True


def link_beneath(top: str, rel: str, dst: str) -> None:
    """Hard-link the regular file ``top/rel`` (reached without following any link) as ``dst``."""
    parts = plain_parts(rel)
    fd = open_dir_beneath(top, parts[:-1])
    try:
        if not stat.S_ISREG(os.lstat(parts[-1], dir_fd=fd).st_mode):
            raise _not_regular(os.path.join(top, rel), os.lstat(parts[-1], dir_fd=fd).st_mode)
        os.link(parts[-1], dst, src_dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


def read_beneath(top: str, rel: str, start: int, into: memoryview) -> None:
    """Read ``len(into)`` bytes of the regular file ``top/rel`` at ``start`` into ``into``, the file reached
    without following any link."""
    parts = plain_parts(rel)
    fd = open_dir_beneath(top, parts[:-1])
    try:
        f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                    dir_fd=fd)
    finally:
        os.close(fd)
    try:
        mode = os.fstat(f).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(os.path.join(top, rel), mode)
        read_exact(f, start, len(into), os.path.join(top, rel), into)
    finally:
        os.close(f)
