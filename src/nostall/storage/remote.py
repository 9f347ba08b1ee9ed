"""Object-storage access through fsspec (``s3://``, ``gs://``, ``az://``, ``memory://``, ...).

Local paths never come here. A remote path is resolved with
``fsspec.core.url_to_fs(path, **storage_options)``; the protocol's package
(s3fs, gcsfs, adlfs) must be installed.

Retries come in two layers, each bounded:

* the back end retries a single request (s3fs: 5 attempts over about 2 s,
  each request under its connect and read timeouts); botocore's own retry
  loop is switched off for ``s3://`` unless the caller configured it, so that
  the layers do not multiply;
* :func:`retry` repeats a whole operation (an upload of a file, a listing)
  with jittered exponential backoff, and, given a deadline, abandons an
  attempt still running when the deadline passes: a stuck transfer becomes a
  ``TimeoutError`` naming the operation, never a hang.
"""

from __future__ import annotations

import copy
import logging
import random
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

from nostall.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

log = logging.getLogger("nostall")

T = TypeVar("T")

RETRIES = 5
BACKOFF_S = 0.2
S3_MAX_CONCURRENCY = 4  # parallel multipart parts per upload (s3fs's default is 10)


def is_remote(path: Any) -> bool:
    """True for a URL with a protocol other than ``file://``."""
    s = str(path)
    return "://" in s and not s.startswith("file://")


def filesystem(path: str, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a remote URL."""
    try:
        import fsspec
    except ImportError as e:
        raise CheckpointError(f"{path}: object storage needs fsspec (pip install 'nostall[s3]')") from e
    try:
        return fsspec.core.url_to_fs(path, **_with_defaults(path, storage_options))
    except (ImportError, ValueError) as e:
        raise CheckpointError(f"{path}: no fsspec back end for this protocol: {e}") from e


def _with_defaults(path: str, storage_options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The caller's options, plus nostall's defaults for ``s3://`` where the caller set none."""
    opts = copy.deepcopy(storage_options) if storage_options else {}
    if path.split("://", 1)[0] in ("s3", "s3a"):
        opts.setdefault("max_concurrency", S3_MAX_CONCURRENCY)
        config = opts.setdefault("config_kwargs", {})
        config.setdefault("retries", {"max_attempts": 1})  # s3fs and retry() retry; botocore does not
    return opts


def _transient(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    return isinstance(e, (OSError, TimeoutError, ConnectionError)) or type(e).__name__ in (
        "ClientError", "EndpointConnectionError", "ReadTimeoutError", "ConnectTimeoutError", "ClientOSError",
        "ServerDisconnectedError", "ResponseStreamingError",
    )


def bounded(what: str, fn: Callable[[], T], deadline: float) -> T:
    """``fn()`` run in a daemon thread and waited for until ``deadline`` (``time.monotonic()``).

    An attempt still running at the deadline is abandoned (the thread is left
    to finish or fail on its own) and ``TimeoutError`` is raised.
    """
    box: Dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the waiting thread
            box["error"] = e
        finally:
            done.set()

    t0 = time.monotonic()
    threading.Thread(target=run, name=f"nostall-remote: {what}"[:60], daemon=True).start()
    if not done.wait(max(0.0, deadline - t0)):
        raise TimeoutError(f"{what}: no result after {time.monotonic() - t0:.1f}s, at the deadline "
                           "(the manager's timeout); abandoned")
    if "error" in box:
        raise box["error"]
    return box["value"]


def retry(what: str, fn: Callable[[], T], *, retries: int = RETRIES, deadline: Optional[float] = None) -> T:
    """``fn()``, retried with jittered exponential backoff on transient errors.

    With a ``deadline`` (``time.monotonic()``), no attempt starts or runs past it (see :func:`bounded`).
    """
    delay = BACKOFF_S
    for attempt in range(retries + 1):
        try:
            return fn() if deadline is None else bounded(what, fn, deadline)
        except Exception as e:
            last = attempt == retries or not _transient(e)
            if deadline is not None and time.monotonic() + delay > deadline:
                last = True
            if last:
                raise
            log.warning("%s failed (%s: %s); retrying in %.1fs (%d/%d)", what, type(e).__name__, e, delay,
                        attempt + 1, retries)
            time.sleep(delay * (0.5 + random.random()))
            delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


def read_small(url: str, limit: int, storage_options: Optional[Dict[str, Any]] = None) -> bytes:
    """A whole small object (a manifest): at most ``limit`` bytes, checked before reading.

    The read itself asks for at most ``limit + 1`` bytes, so an object replaced
    by a bigger one after the size check cannot make it read more.
    """
    fs, key = filesystem(url, storage_options)
    try:
        size = retry(f"stat {url}", lambda: fs.size(key))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{url} does not exist") from None
    if size is None or size > limit:
        raise CheckpointCorruptError(f"{url}: {size} bytes, more than the {limit} accepted")
    if size == 0:
        return b""  # (a ranged read of an empty object is an error on S3)
    # at most limit + 1 bytes, whatever the object has become since the stat (one more byte shows growth)
    try:
        data = retry(f"read {url}", lambda: fs.cat_file(key, start=0, end=limit + 1))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{url} does not exist (it was removed while being read)") from None
    if len(data) > limit:
        raise CheckpointCorruptError(f"{url}: more than the {limit} bytes accepted (it grew after it was "
                                     "measured); if it is being rewritten, retry")
    return bytes(data)
