"""Where a job's memory tier lives on a host, and how a trainer finds (or starts) its holder.

Names, for a user id ``uid`` and a job key ``key`` (:func:`job_key`), under
``<memory_dir>/nostall-<uid>/`` (the *base*: 0700, owned by the user, never a
symbolic link):

- ``<key>/``: the memory root (an ordinary checkpoint root in tmpfs);
- ``<key>.holder``: the holder's mark, ``{"pid": ..., "token": ...}`` (0600),
  made by the holder before it listens;
- ``<key>.lock``: the ``flock`` under which one rank of the host starts the holder;
- ``<key>.log``: the holder's log;
- the abstract unix socket ``\\0nostall-memory-<uid>-<key>`` (no file; one per
  network namespace, so per host).

A trainer trusts a holder only when the peer's credentials (``SO_PEERCRED``)
name its own uid and the pid of the mark, and the holder's hello carries the
mark's token and the same protocol and nostall versions. The holder in turn
serves only peers of its own uid, and takes ``attach`` and ``release`` only
with the mark's token (which only this user can read). This module does not
import torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import subprocess
import sys
import time
from typing import Any, Dict, Optional, Sequence, Tuple

from nostall.errors import CheckpointError

log = logging.getLogger("nostall")

PROTOCOL = 1
DEFAULT_MEMORY_DIR = "/dev/shm"
MAX_LINE = 16 << 20  # one message on the holder's socket (a host table of a large job fits)


class MemoryTierError(CheckpointError):
    """The memory tier cannot be used (its directory, its holder, or the job's layout); the message says the fix."""


class NoHello(MemoryTierError):
    """A listener on the job's socket accepted but said nothing in time: not a holder, or one that is stopping
    (its listener is the last thing it closes). :func:`ensure_holder` looks again until its deadline."""


def nostall_version() -> str:
    import nostall  # the package's version string only (as saving/writer.py reads it)

    return nostall.__version__


def job_id() -> str:
    """The job's identity across restarts of its processes: torchrun's run id, else SLURM's job id, else empty."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or ""


def job_key(root_url: str, job: str) -> str:
    """The key of a job's memory tier on a host: 20 hex digits of sha256(persistent root URL, newline, job id)."""
    return hashlib.sha256(f"{root_url}\n{job}".encode()).hexdigest()[:20]


def base_dir(memory_dir: Optional[str]) -> str:
    """``<memory_dir>/nostall-<uid>``, made 0700 if missing; refused unless it is a directory of this user,
    not a symbolic link, that no one else may enter."""
    parent = memory_dir or (DEFAULT_MEMORY_DIR if os.path.isdir(DEFAULT_MEMORY_DIR) else "/tmp")
    path = os.path.join(os.path.abspath(parent), f"nostall-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise MemoryTierError(f"cannot make the memory tier's directory {path}: {e}; set memory_dir to a "
                              "writable tmpfs directory") from e
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise MemoryTierError(f"{path} is not a private directory of this user (a symbolic link, another owner, "
                              "or open to others): nostall will not keep checkpoints there; remove it or set "
                              "memory_dir elsewhere")
    return path


def socket_name(key: str) -> bytes:
    return f"\0nostall-memory-{os.getuid()}-{key}".encode()


def mark_path(base: str, key: str) -> str:
    return os.path.join(base, f"{key}.holder")


def log_path(base: str, key: str) -> str:
    return os.path.join(base, f"{key}.log")


def read_mark(base: str, key: str) -> Optional[Dict[str, Any]]:
    """The holder's mark (pid, token), or None when there is none (or it is no mark of ours)."""
    try:
        fd = os.open(mark_path(base, key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > 4096:
            return None
        mark = json.loads(os.read(fd, 4096) or b"null")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(mark, dict) or not isinstance(mark.get("pid"), int) or not isinstance(mark.get("token"), str):
        return None
    return mark


def send(sock: socket.socket, msg: Dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One message (a JSON line); ``fds``: descriptors passed with its first byte (``SCM_RIGHTS``)."""
    data = json.dumps(msg).encode() + b"\n"
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv(sock: socket.socket, buf: bytearray, deadline: float) -> Optional[Dict[str, Any]]:
    """The next message on ``sock`` (None at end of stream), bounded by ``deadline``."""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("no answer from the holder")
        sock.settimeout(left)
        chunk = sock.recv(4096)
        if not chunk:
            return None
        buf += chunk
        if len(buf) > MAX_LINE:
            raise ValueError("message too long")
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError("not a message")
    return msg


class HolderLink:
    """A verified connection to a job's holder on this host."""

    def __init__(self, sock: socket.socket, pid: int, base: str, key: str, token: str) -> None:
        self.sock = sock
        self.pid = pid
        self.token = token  # the mark's: attach and release carry it (the holder refuses them without)
        self.base = base
        self.key = key
        self._buf = bytearray()

    def ask(self, msg: Dict[str, Any], timeout: float, fds: Sequence[int] = ()) -> Dict[str, Any]:
        """Send ``msg`` (with the mark's token, and ``fds``) and wait (bounded) for the holder's answer."""
        try:
            self.sock.settimeout(timeout)
            send(self.sock, dict(msg, token=self.token), fds)
            got = recv(self.sock, self._buf, time.monotonic() + timeout)
        except (OSError, ValueError) as e:
            raise MemoryTierError(f"the memory tier's holder (pid {self.pid}) did not answer {msg.get('op')!r}: "
                                  f"{e}") from e
        if got is None:
            raise MemoryTierError(f"the memory tier's holder (pid {self.pid}) closed the connection")
        return got

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(base: str, key: str, timeout: float, hello_s: float = 2.0) -> Optional[HolderLink]:
    """A verified link to the job's holder, or None when none listens. Refuses (:class:`MemoryTierError`) a
    listener that cannot prove it is this job's holder made by nostall for this user, or runs other code;
    :class:`NoHello` when it sends no hello within ``hello_s`` (a holder sends it as it accepts)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(socket_name(key))
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            return None
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
        if uid != os.getuid():
            raise MemoryTierError(f"the memory tier's holder for {base}/{key} is refused: it runs as uid {uid}, "
                                  f"not {os.getuid()}")
        try:
            hello = recv(sock, bytearray(), time.monotonic() + min(timeout, hello_s))
        except (OSError, ValueError):
            hello = None
        if hello is None:
            raise NoHello(f"pid {pid} listens on the memory tier's socket for {base}/{key} but sent no hello within "
                          f"{min(timeout, hello_s):.0f}s: not the job's holder, or one that is stopping")
        mark = read_mark(base, key)
        problem = ""
        if mark is None or mark["pid"] != pid or hello.get("token") != mark["token"]:
            problem = f"pid {pid} does not hold the mark {mark_path(base, key)} (a socket nostall did not make)"
        elif hello.get("protocol") != PROTOCOL or hello.get("version") != nostall_version():
            problem = (f"it runs other code (nostall {hello.get('version')}, protocol {hello.get('protocol')}; "
                       f"this trainer: nostall {nostall_version()}, protocol {PROTOCOL}): stop it (kill {pid}) "
                       "and restart the job")
        if problem:
            raise MemoryTierError(f"the memory tier's holder for {base}/{key} is refused: {problem}")
        assert mark is not None
        return HolderLink(sock, pid, base, key, mark["token"])
    except BaseException:
        sock.close()
        raise


_HOLDER_MAIN = "import sys\nfrom nostall.memory.holder import main\nsys.exit(main(sys.argv[1:]))\n"


def _connect_until(base: str, key: str, deadline: float) -> Optional[HolderLink]:
    """:func:`connect`, looking again while the listener says no hello (a holder stopping), until ``deadline``."""
    while True:
        try:
            return connect(base, key, max(0.1, deadline - time.monotonic()))
        except NoHello:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def ensure_holder(base: str, key: str, idle_s: float, timeout: float) -> Tuple[HolderLink, Optional[subprocess.Popen]]:
    """A link to the job's holder on this host, started here when none runs (under the host's ``flock``, so
    that one rank starts it). Returns the link and, when this process started the holder, its ``Popen``."""
    deadline = time.monotonic() + timeout
    link = _connect_until(base, key, deadline)
    if link is not None:
        return link, None
    lock = os.path.join(base, f"{key}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise MemoryTierError(f"{lock} stayed locked for {timeout:.0f}s (another rank starting the "
                                          "holder)") from None
                time.sleep(0.01)
        link = _connect_until(base, key, deadline)
        if link is not None:
            return link, None
        env = dict(os.environ)
        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["NOSTALL_PROCESS_ROLE"] = "holder"
        # Its log goes to a file of its own: an inherited stderr (a pipe) would be held open past the trainer,
        # and whoever reads that pipe to its end would wait for the holder.
        logfd = os.open(log_path(base, key), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600)
        try:
            proc = subprocess.Popen([sys.executable, "-c", _HOLDER_MAIN, base, key, repr(float(idle_s))],
                                    stdin=subprocess.DEVNULL, stdout=logfd, stderr=logfd, env=env, close_fds=True,
                                    start_new_session=True)
        finally:
            os.close(logfd)
        log.debug("memory tier: holder %d started for %s/%s", proc.pid, base, key)
        while True:
            link = _connect_until(base, key, deadline)
            if link is not None:
                return link, proc
            code = proc.poll()
            if code is not None:
                link = _connect_until(base, key, deadline)  # (status 0: another holder bound the socket first)
                if link is not None:
                    return link, None
                raise MemoryTierError(f"the memory tier's holder for {base}/{key} exited at start (status {code}; "
                                      f"its log: {log_path(base, key)})")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise MemoryTierError(f"the memory tier's holder for {base}/{key} did not listen within "
                                      f"{timeout:.0f}s")
            time.sleep(0.01)
    finally:
        os.close(fd)  # releases the flock
