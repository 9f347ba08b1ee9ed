"""The commit protocol on object storage (no atomic rename there).

Layout under a root URL (``s3://bucket/run``)::

    <root>/step_<N>/rank<r>.<id>.safetensors  data files, uploaded by each rank's writer
    <root>/step_<N>/manifest.json         uploaded last by rank 0: the commit point
    <root>/latest                         the step committed last, uploaded after the manifest
    <root>/.tmp/commit-<id>/rank<r>.json  per-rank done records, then outcome.json

A ``step_<N>/`` prefix without its manifest is never listed, loaded or
counted by retention. Each rank writes its files into a local staging
directory (node-local disk), then uploads them with retries, so the trainer's
stall is the same as for a local destination: the trainer makes no remote
call. Data file names carry the save's id (``rank0.<id>.safetensors``), so
re-saving a step never touches the files its older manifest names; that
manifest stays valid until the new one replaces it, and the older files are
deleted after the commit. Retention deletes an old checkpoint's manifest
first, then its prefix.

This module does not import torch (it runs in the writer process).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from typing import Any, Dict, List, Mapping, Optional

from . import remote
from ._faults import crash_point
from .errors import CheckpointSaveError
from .format import MANIFEST_NAME

log = logging.getLogger("nostall")

_STEP_RE = re.compile(r"step_(0|[1-9][0-9]*)$")


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/")] + [p.strip("/") for p in parts])


def committed_steps(root: str, storage_options: Optional[Dict[str, Any]] = None) -> List[int]:
    """Steps under ``root`` whose manifest exists, ascending."""
    fs, key = remote.filesystem(root, storage_options)
    fs.invalidate_cache()  # other processes write here: never trust a cached listing
    try:
        found = remote.retry(f"list {root}", lambda: fs.glob(f"{key.rstrip('/')}/step_*/{MANIFEST_NAME}"))
    except FileNotFoundError:
        return []
    steps = []
    for path in found:
        m = _STEP_RE.search(os.path.dirname(str(path)))
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step(root: str, storage_options: Optional[Dict[str, Any]] = None) -> Optional[int]:
    """``latest`` when it names a committed step, else the highest committed step."""
    steps = committed_steps(root, storage_options)
    fs, key = remote.filesystem(join(root, "latest"), storage_options)
    try:
        pointed: Optional[int] = int(remote.retry("read latest", lambda: fs.cat_file(key)).decode().strip())
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        pointed = None
    if pointed is not None and pointed in steps:
        return pointed
    return steps[-1] if steps else None


UPLOAD_PART_BYTES = 32 << 20  # multipart part size (s3fs); parts go up S3_MAX_CONCURRENCY at a time
PROGRESS_EVERY_S = 10.0


def _put(fs: Any, local: str, key: str, url: str, size: int) -> None:
    """Upload ``local`` to ``key`` (multipart with parallel parts on s3), logging progress every 10 s."""
    from fsspec.callbacks import Callback

    t0 = time.monotonic()
    last = [t0]

    def progress(total: Optional[int], done: int, **_: Any) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            log.info("uploading %s: %.0f of %.0f MB (%.0f MB/s)", url, done / 1e6, size / 1e6,
                     done / 1e6 / (now - t0))

    extra = {"chunksize": UPLOAD_PART_BYTES} if "s3" in _protocols(fs) else {}
    fs.put_file(local, key, callback=Callback(hooks={"progress": progress}), **extra)


def _protocols(fs: Any) -> tuple:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


class RemoteStepTarget:
    """``<root>/step_<N>`` on object storage (the remote counterpart of commit.StepTarget).

    Picklable: it travels to the writer processes, which upload their files
    through :meth:`upload`; rank 0's writer then commits through :meth:`publish`.
    """

    save_id: Optional[str] = None  # set once the save is planned

    def __init__(self, root: str, step: int, keep_last: Optional[int], local_staging: str,
                 storage_options: Optional[Dict[str, Any]], timeout: float) -> None:
        self.root = root.rstrip("/")
        self.step = step
        self.keep_last = keep_last
        self.storage_options = storage_options
        self.timeout = timeout
        self.staging = os.path.join(local_staging, f"step_{step}")  # this rank's local scratch
        self.final = join(self.root, f"step_{step}")

    def _fs(self) -> Any:
        return remote.filesystem(self.root, self.storage_options)[0]

    def _key(self, url: str) -> str:
        return remote.filesystem(url, self.storage_options)[1]

    # -- every rank
    def prepare(self) -> None:
        """Rank 0, before the plan: nothing remote (no round trip in the trainer's stall)."""

    def data_name(self, name: str) -> str:
        """``rank0.safetensors`` -> ``rank0.<save id>.safetensors``: a re-save of a step never
        overwrites the files an older manifest of that step still names."""
        if not self.save_id:
            return name
        stem, dot, ext = name.rpartition(".")
        return f"{stem}.{self.save_id[:16]}.{ext}" if dot else f"{name}.{self.save_id[:16]}"

    def open_staging(self) -> None:
        """Every rank: a fresh local staging directory for its own files."""
        shutil.rmtree(self.staging, ignore_errors=True)
        os.makedirs(self.staging)

    def upload(self, names: List[str]) -> None:
        """Upload this rank's staged files (retried, bounded), then drop the local copies."""
        fs = self._fs()
        deadline = time.monotonic() + self.timeout
        for name in names:
            local = os.path.join(self.staging, name)
            size = os.path.getsize(local)
            t0 = time.monotonic()
            url = join(self.final, self.data_name(name))
            try:
                remote.retry(f"upload {url}", lambda: _put(fs, local, self._key(url), url, size), deadline=deadline)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"uploading {url}: the bucket or prefix does not exist ({e})") from None
            dt = max(time.monotonic() - t0, 1e-9)
            log.info("uploaded %s: %.1f MB in %.2fs (%.0f MB/s)", url, size / 1e6, dt, size / 1e6 / dt)
            crash_point("upload.done", self.step)
        shutil.rmtree(self.staging, ignore_errors=True)

    # -- rank 0
    def publish(self, manifest: bytes, files: Mapping[str, int]) -> None:
        """Check every uploaded file's size, upload the manifest (the commit point), then ``latest``."""
        fs = self._fs()
        for name, size in files.items():
            url = join(self.final, name)
            try:
                got = remote.retry(f"stat {url}", lambda: fs.size(self._key(url)))
            except FileNotFoundError:
                raise CheckpointSaveError(f"{url} is missing at commit time") from None
            if got != size:
                raise CheckpointSaveError(f"{url} has {got} bytes at commit time, {size} planned")
        crash_point("commit.ready", self.step)
        url = join(self.final, MANIFEST_NAME)
        remote.retry(f"upload {url}", lambda: fs.pipe_file(self._key(url), manifest))
        crash_point("commit.renamed", self.step)
        self.point_latest()
        self._drop_other_saves(set(files))

    def _drop_other_saves(self, keep: set) -> None:
        """After the commit: delete data files of earlier or failed saves of this step."""
        try:
            fs = self._fs()
            for path in fs.ls(self._key(self.final), detail=False, refresh=True):
                name = os.path.basename(str(path))
                if name != MANIFEST_NAME and name not in keep:
                    fs.rm(str(path))
        except Exception as e:  # committed; leftovers are only space
            log.warning("could not remove older data files under %s: %s", self.final, e)

    def point_latest(self) -> None:
        fs = self._fs()
        url = join(self.root, "latest")
        try:
            remote.retry(f"upload {url}", lambda: fs.pipe_file(self._key(url), f"{self.step}\n".encode()))
        except Exception as e:  # committed; latest_step() falls back to listing
            log.warning("step %d is committed but updating %s failed: %s", self.step, url, e)

    def retain(self) -> None:
        """After the commit: sweep the leftovers of earlier saves, then apply ``keep_last``."""
        self._sweep()
        if self.keep_last is None:
            return
        try:
            steps = committed_steps(self.root, self.storage_options)
            keep = set(steps[-self.keep_last:]) | {self.step}
            fs = self._fs()
            for s in steps:
                if s in keep:
                    continue
                url = join(self.root, f"step_{s}")
                # the manifest first: a half-deleted checkpoint is never listed
                remote.retry(f"delete {url}", lambda: fs.rm(self._key(join(url, MANIFEST_NAME))))
                crash_point("retain.moved", self.step)
                remote.retry(f"delete {url}", lambda: fs.rm(self._key(url), recursive=True))
                log.info("retention: deleted %s", url)
        except Exception as e:  # the checkpoint is committed; retention is best effort
            log.warning("retention after step %d failed: %s", self.step, e)

    def _sweep(self) -> None:
        """Delete what earlier saves left: records under ``.tmp/`` and ``step_*`` prefixes without a manifest.

        Safe once this save is committed: a manager has one save in flight, and
        every rank finished the previous one before this one was planned. (Two
        jobs saving to one root are not supported: object storage has no lock.)
        """
        try:
            fs = self._fs()
            root = self._key(self.root).rstrip("/")
            current = f"commit-{self.save_id}"
            stale = []
            try:
                records = remote.retry("list records", lambda: fs.ls(f"{root}/.tmp", detail=False, refresh=True))
            except FileNotFoundError:
                records = []
            stale += [str(p) for p in records if os.path.basename(str(p).rstrip("/")) != current]
            committed = set(committed_steps(self.root, self.storage_options))
            for p in remote.retry(f"list {self.root}", lambda: fs.ls(root, detail=False, refresh=True)):
                m = _STEP_RE.search(str(p).rstrip("/"))
                if m and int(m.group(1)) not in committed and int(m.group(1)) != self.step:
                    stale.append(str(p))
            for p in stale:
                remote.retry(f"delete {p}", lambda: fs.rm(p, recursive=True))
                log.info("removed %s, left by an earlier save", p)
        except Exception as e:  # committed; leftovers are only space
            log.warning("could not sweep the leftovers of earlier saves under %s: %s", self.root, e)

    def abort(self) -> None:
        """Rank 0, after a failure: delete this save's uploaded files (an older manifest of the step stays valid)."""
        if self.save_id:
            try:
                fs = self._fs()
                tag = f".{self.save_id[:16]}."
                for path in fs.ls(self._key(self.final), detail=False, refresh=True):
                    if tag in os.path.basename(str(path)):
                        fs.rm(str(path))
            except FileNotFoundError:
                pass
            except Exception as e:
                log.warning("could not remove the partial upload under %s: %s", self.final, e)
        shutil.rmtree(self.staging, ignore_errors=True)
