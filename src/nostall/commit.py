"""The commit protocol: a checkpoint becomes visible only when it is complete.

Directory layout under a manager's root::

    <root>/step_<N>/            committed checkpoints (manifest.json inside)
    <root>/latest               text file: newest committed step, replaced atomically
    <root>/.tmp/step_<N>/       a save in progress (never a checkpoint)
    <root>/.tmp/trash-*/        a checkpoint being deleted (never a checkpoint)

Protocol of one save (see docs/protocol.md):
1. every rank writes and fsyncs its data files into ``.tmp/step_<N>/``;
2. once every rank succeeded, rank 0 writes ``manifest.json`` there, fsyncs
   it and the directory, renames the directory to ``step_<N>`` and fsyncs the
   root -- this rename is the commit point;
3. rank 0 replaces ``latest``, then applies retention (older checkpoints are
   first renamed into ``.tmp/`` and only then deleted).

A directory counts as a checkpoint only if it is named ``step_<N>`` and holds a
manifest, so a crash at any point leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import socket
import sys
import time
import uuid
from typing import List, Mapping, Optional

from . import storage
from .errors import CheckpointSaveError
from ._faults import crash_point
from .format import MANIFEST_NAME

log = logging.getLogger("nostall")

TMP_DIR = ".tmp"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(0|[1-9][0-9]*)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step}")


def staging_dir(root: str, step: int) -> str:
    return os.path.join(root, TMP_DIR, f"step_{step}")


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def committed_steps(root: str) -> List[int]:
    """Steps of the committed checkpoints under ``root``, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for n in names:
        m = _STEP_RE.match(n)
        if m and is_committed(os.path.join(root, n)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_latest_pointer(root: str) -> Optional[int]:
    """The step named by ``<root>/latest``, or None when absent or unreadable."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def latest_step(root: str) -> Optional[int]:
    """The newest committed step: the ``latest`` pointer when it names a committed
    checkpoint (after a rollback it may be lower than the highest step on disk),
    else the highest committed step (the pointer may lag a crash by one commit)."""
    pointed = read_latest_pointer(root)
    if pointed is not None and is_committed(step_dir(root, pointed)):
        return pointed
    steps = committed_steps(root)
    return steps[-1] if steps else None


def check_staging(staging: str) -> None:
    """Raise a clear error if a save's staging directory vanished (rank 0 creates it before the plan)."""
    if not os.path.isdir(staging):
        raise FileNotFoundError(
            errno.ENOENT, "the save's staging directory is gone (was the checkpoint directory deleted?)", staging
        )


def remove_stale_staging(root: str, step: int) -> None:
    """Rank 0, before a save: drop what an interrupted save of ``step`` left."""
    path = staging_dir(root, step)
    if os.path.exists(path):
        log.info("removing %s left by an interrupted save", path)
        storage.remove_tree(path)


def _rename_exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


def check_files(staging: str, files: Mapping[str, int]) -> None:
    """Every planned data file is in the staging directory with its planned size."""
    for name, size in files.items():
        path = os.path.join(staging, name)
        try:
            got = os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointSaveError(f"{path} is missing at commit time") from None
        if got != size:
            raise CheckpointSaveError(f"{path} has {got} bytes at commit time, {size} planned")


def publish(staging: str, final: str, manifest: bytes, files: Mapping[str, int], trash: str,
            step: Optional[int] = None) -> None:
    """Rank 0: check the data files, write the manifest last, move into place.

    The rename is the commit point: errors before it raise (nothing is
    visible), errors after it are only logged (the checkpoint is committed).
    An existing ``final`` is swapped out atomically where the OS can
    (``RENAME_EXCHANGE``), otherwise moved to ``trash`` just before the rename.
    """
    check_files(staging, files)
    storage.write_file(os.path.join(staging, MANIFEST_NAME), [memoryview(manifest)])
    storage.fsync_dir(staging)
    crash_point("commit.manifest", step)
    parent = os.path.dirname(os.path.abspath(final))
    old = None
    if os.path.exists(final):
        if _rename_exchange(staging, final):
            old = staging  # now holds the previous checkpoint
        else:
            old = trash
            os.makedirs(os.path.dirname(old), exist_ok=True)
            os.rename(final, old)
            os.rename(staging, final)
    else:
        os.rename(staging, final)
    crash_point("commit.renamed", step)
    try:  # past the commit point
        storage.fsync_dir(parent)
        if old is not None:
            storage.remove_tree(old)
    except OSError as e:
        log.warning("%s is committed, but a follow-up failed: %s", final, e)


def _trash_path(root: str) -> str:
    return os.path.join(root, TMP_DIR, f"trash-{uuid.uuid4().hex}")


def update_latest(root: str, step: int) -> None:
    storage.atomic_write(os.path.join(root, LATEST), f"{step}\n".encode())


def apply_retention(root: str, keep_last: Optional[int], just_committed: int) -> List[int]:
    """Delete committed checkpoints beyond the newest ``keep_last``; returns deleted steps.

    Never deletes ``just_committed`` nor the newest checkpoint, never touches
    anything under ``.tmp``.
    """
    if keep_last is None:
        return []
    steps = committed_steps(root)
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    keep.add(just_committed)
    if steps:
        keep.add(steps[-1])
    deleted = []
    for s in steps:
        if s in keep:
            continue
        path = step_dir(root, s)
        trash = _trash_path(root)
        try:
            os.makedirs(os.path.dirname(trash), exist_ok=True)
            os.rename(path, trash)  # disappears atomically, then is deleted
        except OSError as e:
            log.warning("retention: could not remove %s: %s", path, e)
            continue
        crash_point("retain.moved", just_committed)
        storage.remove_tree(trash)
        deleted.append(s)
    if deleted:
        storage.fsync_dir(root)
        log.info("retention: deleted step(s) %s under %s", deleted, root)
    return deleted


def clean_leftovers(root: str) -> None:
    """Rank 0 at start: remove staging and trash directories left by a crash."""
    tmp = os.path.join(root, TMP_DIR)
    try:
        names = os.listdir(tmp)
    except FileNotFoundError:
        return
    for n in names:
        if n == RootLock.NAME:
            continue
        path = os.path.join(tmp, n)
        if os.path.isfile(os.path.join(path, "outcome.json")):
            # the records of a finished background save, kept until every rank had read them
            log.debug("removing the records of a finished save: %s", path)
        else:
            log.info("removing leftover %s from an interrupted save", path)
        storage.remove_tree(path)


def check_root(root: str) -> None:
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointSaveError(f"checkpoint root {root!r} exists and is not a directory")


# --------------------------------------------------------------------------- targets


class Target:
    """Where one save goes: a staging directory, and how rank 0 commits it.

    Targets are plain picklable objects (they travel to the writer process).
    """

    staging: str
    final: str
    save_id: Optional[str] = None  # set once the save is planned

    def prepare(self) -> None:
        """Rank 0, before the plan: check the destination, drop stale staging data."""
        raise NotImplementedError

    def data_name(self, name: str) -> str:
        """What a planned data file is called in the checkpoint (object storage makes each save's names unique)."""
        return name

    def open_staging(self) -> None:
        """Every rank, once the plan is valid: the staging directory rank 0 made must still be there."""
        check_staging(self.staging)

    def publish(self, manifest: bytes, files: Mapping[str, int]) -> None:
        """Rank 0, once every rank's data is durable: the commit (see :func:`publish`)."""
        raise NotImplementedError

    def point_latest(self) -> None:
        """Rank 0, right after the commit point: move the ``latest`` pointer. Never raises."""

    def retain(self) -> None:
        """Rank 0, after the outcome is published: retention. Never raises."""

    def abort(self) -> None:
        """Rank 0, after a failure: remove the staging directory."""
        storage.remove_tree(self.staging)


class NoTarget(Target):
    """Planning only (``CheckpointManager.prepare``): nothing is written."""

    staging = final = "<none>"

    def prepare(self) -> None:
        pass

    def abort(self) -> None:
        pass


class StepTarget(Target):
    """``<root>/step_<N>`` of a manager: commit, ``latest``, then retention."""

    def __init__(self, root: str, step: int, keep_last: Optional[int]) -> None:
        self.root = root
        self.step = step
        self.keep_last = keep_last
        self.staging = staging_dir(root, step)
        self.final = step_dir(root, step)

    def prepare(self) -> None:
        check_root(self.root)
        os.makedirs(self.root, exist_ok=True)
        remove_stale_staging(self.root, self.step)
        os.makedirs(self.staging)

    def publish(self, manifest: bytes, files: Mapping[str, int]) -> None:
        publish(self.staging, self.final, manifest, files, _trash_path(self.root), self.step)
        self.point_latest()

    def point_latest(self) -> None:
        try:
            above = [s for s in committed_steps(self.root) if s > self.step]
            if above:
                log.warning(
                    "committed step %d while step(s) %s from an earlier run exist under %s; `latest` now "
                    "names %d, and those steps are replaced as training reaches them",
                    self.step, above, self.root, self.step,
                )
            update_latest(self.root, self.step)
        except OSError as e:  # committed; latest_step() falls back to scanning
            log.warning("step %d is committed but updating %s failed: %s", self.step, LATEST, e)

    def retain(self) -> None:
        try:
            apply_retention(self.root, self.keep_last, self.step)
        except OSError as e:  # the checkpoint is committed; retention is best effort
            log.warning("retention after step %d failed: %s", self.step, e)


class PathTarget(Target):
    """A one-shot save to a directory of its own (``nostall.save``)."""

    def __init__(self, path: str) -> None:
        self.final = os.path.abspath(path)
        parent, name = os.path.split(self.final)
        self.staging = os.path.join(parent, f".{name}.nostall-tmp")

    def prepare(self) -> None:
        if os.path.exists(self.final) and not is_committed(self.final):
            raise CheckpointSaveError(
                f"{self.final} exists and is not a nostall checkpoint; refusing to replace it"
            )
        os.makedirs(os.path.dirname(self.final), exist_ok=True)
        if os.path.exists(self.staging):
            storage.remove_tree(self.staging)
        os.makedirs(self.staging)

    def publish(self, manifest: bytes, files: Mapping[str, int]) -> None:
        parent, name = os.path.split(self.final)
        publish(self.staging, self.final, manifest, files, os.path.join(parent, f".{name}.nostall-old-{uuid.uuid4().hex}"))


class RootLock:
    """Rank 0's claim on a run root for a manager's lifetime (``<root>/.tmp/.lock``).

    An advisory ``flock``, released by the kernel when its holder dies, so a
    crashed job never leaves a stale claim. The holder writes its host, pid
    and start time into the file, so a refused second job can say who holds it.
    Only the holder saves and cleans up leftovers.

    On a shared filesystem without lock support (NFS mounted ``nolock`` or
    without lockd, Lustre without ``-o flock``) ``flock`` fails with
    ENOLCK / ENOSYS / EOPNOTSUPP: the claim is then taken without the
    cross-job guard (``supported`` is False), with a warning, as on object
    storage. Only a lock held by another process refuses the root.
    """

    NAME = ".lock"
    _UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}

    def __init__(self, root: str) -> None:
        os.makedirs(os.path.join(root, TMP_DIR), exist_ok=True)
        self.path = os.path.join(root, TMP_DIR, self.NAME)
        self.fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.supported = True
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.held = True
        except OSError as e:
            if e.errno not in self._UNSUPPORTED:
                self.held = False
                return
            self.held, self.supported = True, False
            log.warning("%s: this filesystem does not support flock (%s); saving without the guard against a "
                        "second job on this root: make sure one job saves to it at a time", root, e)
        owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, owner, 0)

    def owner(self) -> str:
        """Who holds the lock, as its holder wrote it (best effort)."""
        try:
            with open(self.path, "rb") as f:
                info = json.loads(f.read(4096) or b"{}")
            return f"pid {info['pid']} on host {info['host']} (since {info['since']})"
        except (OSError, ValueError, KeyError, TypeError):
            return "an unknown process"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None
