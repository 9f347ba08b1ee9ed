"""A checkpoint root on a POSIX filesystem (local or shared): :class:`PosixRoot`.

The commit point is the atomic ``rename`` of a save's staging directory to ``step_<N>``; the
contract it keeps is :mod:`nostall.storage.root`'s. This module does not import torch.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import sys
import time
from typing import AbstractSet, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from nostall.storage import files as storage
from nostall.core.faults import Faults, crash_point
from nostall.core.format import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from nostall.core.jobs import Destination, Done, Outcome
from nostall.errors import (
    CheckpointCorruptError, CheckpointError, CheckpointLoadError, CheckpointNotFoundError, CheckpointSaveError,
)
from nostall.storage.root import (
    BESIDE_RE, LATEST, LATEST_MAX_BYTES, LOCK, MANIFEST_PROOF_MAX_BYTES, MARK_RE, MARK_SUFFIX, NONE, OURS_RE,
    RECORD_MAX_BYTES, RETIRED_MARK_RE, RETIRED_PREFIX, RETIRED_RE, TMP_DIR, Claim, Root, StoredFile, done_name,
    collectable, is_nostall_manifest, listed, lkind, lock_holder, lock_record, maker_gone, mark_content,
    parse_latest, parse_step, record, referenced_hint, retired_id, retired_name, retired_proof, side_size_problem,
    step_name,
)

log = logging.getLogger("nostall")


def _rename_exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


def _create(path: str, data: bytes = b"") -> None:
    """Create a small file that must not exist yet (never following a link). Not fsynced: marks and
    slots only ever save a crash's cleanup or a rename's space, and stay off the trainer's stall."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        if data:
            os.write(fd, data)
    finally:
        os.close(fd)


class PosixFile(StoredFile):
    """A data file open on a POSIX filesystem (its descriptor kept until :meth:`close`)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd: Optional[int] = fd
        self.path = path

    def read(self, offset: int, length: int, into: Optional[memoryview] = None) -> memoryview:
        assert self.fd is not None
        return storage.read_exact(self.fd, offset, length, self.path, into)

    def read_into(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """One ``preadv`` straight into ``bufs`` (at most ``os.sysconf('SC_IOV_MAX')`` of them); a short read's
        rest is read buffer by buffer (:meth:`read`: the end of the file is corruption)."""
        assert self.fd is not None
        got = os.preadv(self.fd, bufs, offset) if bufs else 0
        for b in bufs:
            n = len(b)
            if got < n:
                self.read(offset + got, n - got, b[got:])
            got = max(0, got - n)
            offset += n
    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class PosixRoot(Root):
    """A root on a POSIX filesystem (local or shared); see :mod:`nostall.storage.root`.

    ``detached``: the parent directory of one-shot checkpoints
    (``nostall.save(state, dir)``, the interop writers): a save stages beside
    its checkpoint (``.<name>.nostall-<id>``), with no ``.tmp``, lock or ``latest``.
    """

    _UNSUPPORTED_LOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
    poll_max_s = 0.05  # a stat on a local or shared filesystem is cheap: other ranks learn the outcome sooner
    retention_beside_next_save = True

    def __init__(self, path: str, *, detached: bool = False, faults: Optional[Faults] = None) -> None:
        self.url = os.path.abspath(os.fspath(path))
        self.detached = detached
        self.faults = faults if faults is not None else Faults()
        self._checked: Optional[Tuple[int, int]] = None  # (st_dev, st_ino) of the root that check() last passed
        self._claim: Optional[Claim] = None  # this process's claim of the root (never pickled)

    def __getstate__(self) -> Dict[str, object]:
        state = dict(self.__dict__)
        state["_claim"] = None  # a descriptor of this process: a writer gets it by pass_fds (held_lock)
        return state

    def __repr__(self) -> str:
        return f"PosixRoot({self.url!r})"

    # ------------------------------------------------------------------ names
    def path(self, name: str) -> str:
        return os.path.join(self.url, name)

    def _tmp(self, kind: str, save_id: str, name: str = "") -> str:
        if self.detached:
            return os.path.join(self.url, f".{name}.nostall-{kind}-{save_id}")
        return os.path.join(self.url, TMP_DIR, f"{kind}-{save_id}")

    def _records(self, save_id: str) -> str:
        return self._tmp("commit", save_id)

    # ------------------------------------------------------------------ checks
    def _no_link(self, path: str) -> Optional[int]:
        mode = lkind(path)
        if mode is not None and stat.S_ISLNK(mode):
            raise CheckpointError(
                f"{path} is a symbolic link: nostall never follows links inside a checkpoint root. "
                "Replace it with a real directory or file (or use another root)"
            )
        return mode

    def check(self) -> None:
        """Refuse a root that is not a directory, or whose ``.tmp``, ``latest`` or a ``step_<N>`` is a
        symbolic link (O(entries): the root is listed)."""
        mode = lkind(self.url)
        if mode is not None and not stat.S_ISDIR(os.stat(self.url).st_mode):
            raise CheckpointSaveError(f"checkpoint root {self.url!r} exists and is not a directory")
        if self.detached or mode is None:
            return
        self._no_link(os.path.join(self.url, TMP_DIR))
        self._no_link(os.path.join(self.url, LATEST))
        for n in os.listdir(self.url):
            if parse_step(n) is not None:
                self._no_link(os.path.join(self.url, n))

    def _check_before_save(self) -> None:
        """:meth:`check` before a save, in O(1) while the root is the directory it last passed (same
        device and inode): then only ``.tmp`` and ``latest`` are looked at. The steps need no listing
        each save: a commit lists them before its commit point, refusing a linked one
        (:func:`nostall.saving.commit.commit`), and every other access goes through :meth:`_no_link`.
        A root that was replaced or removed since is checked in full again."""
        try:
            st = os.stat(self.url)
        except FileNotFoundError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._checked:
            self._checked = None
            self.check()
            os.makedirs(os.path.join(self.url, TMP_DIR), exist_ok=True)
            st = os.stat(self.url)
            self._checked = (st.st_dev, st.st_ino)
            return
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointSaveError(f"checkpoint root {self.url!r} exists and is not a directory")
        tmp = self._no_link(os.path.join(self.url, TMP_DIR))
        self._no_link(os.path.join(self.url, LATEST))
        if tmp is None:
            os.makedirs(os.path.join(self.url, TMP_DIR), exist_ok=True)

    # ------------------------------------------------------------------ reading
    def steps(self) -> List[int]:
        try:
            names = os.listdir(self.url)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise CheckpointNotFoundError(f"{self.url} is neither a checkpoint nor a checkpoint root (it is not a "
                                          "directory)") from None
        out = []
        for n in names:
            s = parse_step(n)
            if s is None:
                continue
            d = os.path.join(self.url, n)
            mode = self._no_link(d)
            if mode is None or not stat.S_ISDIR(mode):
                continue
            m = lkind(os.path.join(d, MANIFEST_NAME))
            if m is not None and stat.S_ISREG(m):
                out.append(s)
        return sorted(out)

    def read_latest(self) -> Optional[int]:
        path = os.path.join(self.url, LATEST)
        self._no_link(path)
        try:
            raw = storage.read_small_file(path, LATEST_MAX_BYTES)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read the latest pointer ({e}); remove or fix it") from None
        return parse_latest(raw, path)

    def is_checkpoint(self, name: str) -> bool:
        try:
            raw = self.manifest_bytes(name)
        except OSError:
            return False
        return raw is not None and is_nostall_manifest(raw, os.path.join(self.path(name), MANIFEST_NAME))

    def has_manifest(self, name: str) -> bool:
        d = self.path(name)
        mode = self._no_link(d)
        return mode is not None and stat.S_ISDIR(mode) and lkind(os.path.join(d, MANIFEST_NAME)) is not None

    def manifest_bytes(self, name: str) -> Optional[bytes]:
        d = self.path(name)
        mode = self._no_link(d)
        if mode is None or not stat.S_ISDIR(mode):
            return None
        try:
            return storage.read_small_file(os.path.join(d, MANIFEST_NAME), MANIFEST_PROOF_MAX_BYTES)
        except FileNotFoundError:
            return None

    def committed_at(self, name: str) -> Optional[str]:
        try:
            t = os.lstat(os.path.join(self.path(name), MANIFEST_NAME)).st_mtime
        except OSError:
            return None
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))

    def identity(self, ref: str) -> Optional[str]:
        st = storage.lstat_beneath(self.url, ref)
        if st is None or not stat.S_ISREG(st.st_mode):
            return None
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    def read_into(self, ref: str, start: int, into: memoryview) -> None:
        storage.read_beneath(self.url, ref, start, into)

    # ------------------------------------------------------------------ a checkpoint's files, for readers
    def load_manifest_bytes(self, name: str) -> Optional[bytes]:
        d = self.path(name)
        if not os.path.isdir(d):
            raise CheckpointNotFoundError(f"no checkpoint at {d}")
        mpath = os.path.join(d, MANIFEST_NAME)
        try:
            return storage.read_whole(mpath, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointLoadError(f"{mpath}: cannot read the manifest: {e}") from None

    def open_file(self, checkpoint: str, name: str, size: int, timeout: Optional[float] = None) -> StoredFile:
        path = self.path(self.ref_of(checkpoint, name))
        try:
            if "/" in name and not stat.S_ISDIR(os.lstat(os.path.dirname(path)).st_mode):
                raise OSError(errno.ELOOP, "is not a directory (a symbolic link?): it is not followed",
                              os.path.dirname(path))
            fd = storage.open_regular(path)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{path}: data file missing{referenced_hint(name)}") from None
        except OSError as e:
            raise CheckpointCorruptError(f"{path}: cannot open the data file: {e.strerror}") from None
        got = os.fstat(fd).st_size
        if got != size:
            os.close(fd)
            raise CheckpointCorruptError(f"{path}: size {got} bytes, the manifest says {size} (truncated?)")
        return PosixFile(fd, path)

    def read_side(self, checkpoint: str, file: str, size: int, label: str = "") -> bytes:
        directory = self.path(checkpoint)
        parts = file.split("/")
        where = os.path.join(directory, *parts)
        d = directory
        for c in parts[:-1]:  # the directories on the way: none may be a symbolic link (nothing is followed)
            d = os.path.join(d, c)
            try:
                mode = os.lstat(d).st_mode
            except FileNotFoundError:
                raise CheckpointCorruptError(f"{where}: side file missing (no directory {d})") from None
            except OSError as e:
                raise CheckpointError(
                    f"{where}: cannot check the side file's directory {d}: {e.strerror or e}") from None
            if not stat.S_ISDIR(mode):
                what = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
                raise CheckpointCorruptError(f"{where}: side file not reachable: {d} is {what}; checkpoint files "
                                             "must be regular files in plain directories (restore the side file)")
        try:
            fd = storage.open_regular(where)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{where}: side file missing") from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EINVAL):  # a symbolic link, FIFO, device, directory...
                raise CheckpointCorruptError(f"{where}: side file {e.strerror}") from None
            raise CheckpointError(f"{where}: cannot open the side file: {e.strerror or e}") from None
        try:
            got = os.fstat(fd).st_size
            if got != size:
                raise side_size_problem(where, got, size)
            # exactly the manifest's size: a file growing meanwhile is not read further
            return bytes(storage.read_exact(fd, 0, size, where))
        except OSError as e:
            raise CheckpointError(f"{where}: cannot read the side file: {e.strerror or e}") from None
        finally:
            os.close(fd)

    def side_location(self, checkpoint: str, file: str) -> str:
        return os.path.join(self.path(checkpoint), *file.split("/"))

    def read_small(self, name: str, limit: int) -> Optional[bytes]:
        path = self.path(name)
        try:
            return storage.read_small_file(path, limit)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.EFBIG:
                raise CheckpointCorruptError(f"{path}: {e.strerror}") from None
            raise

    def write_small(self, name: str, data: bytes, deadline: float) -> None:
        storage.atomic_write(self.path(name), data)

    def is_file(self, name: str) -> bool:
        return os.path.isfile(self.path(name))

    def entries(self, name: str) -> List[str]:
        try:
            return os.listdir(self.path(name))
        except FileNotFoundError:
            return []

    def check_present(self) -> None:
        if not os.path.isdir(self.url):
            raise CheckpointError(f"{self.url}: no such directory")

    @staticmethod
    def _mark_of(path: str) -> str:
        return path + MARK_SUFFIX

    def _proven(self, path: str, save_id: str) -> bool:
        """Whether the mark beside ``path`` proves nostall made it for save ``save_id``."""
        try:
            raw = storage.read_small_file(self._mark_of(path), 512)
        except OSError:
            return False
        return raw.decode("ascii", "replace").split("\n", 1)[0].strip() == save_id

    def _drop_cut_mark(self, path: str, save_id: str) -> None:
        """A mark whose entry never came: a crash cut it short while it was being written (its
        content is a prefix of the id in its name, possibly empty). It is nostall's: delete it."""
        mark = self._mark_of(path)
        try:
            content = storage.read_small_file(mark, 512).decode("ascii")
        except (OSError, UnicodeDecodeError):
            return
        if "\n" not in content and save_id.startswith(content):
            os.unlink(mark)

    def _make_ours(self, path: str, save_id: str, make_dir: bool = True) -> None:
        """Claim ``path`` with its mark (first: a crash never leaves an unmarked entry of ours), then make it."""
        _create(self._mark_of(path), mark_content(save_id))
        if make_dir:
            os.mkdir(path)

    def _remove_ours(self, path: str, save_id: str) -> bool:
        """Delete ``path`` (never following a link) and its mark, if the mark proves it is ``save_id``'s."""
        if not self._proven(path, save_id):
            if lkind(path) is not None:
                log.warning("%s is not nostall's (no mark for save %s): left alone", path, save_id)
                return False
            self._drop_cut_mark(path, save_id)
            return True
        mode = lkind(path)
        if mode is not None:
            if stat.S_ISDIR(mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        if lkind(path) is not None:
            return False
        os.unlink(self._mark_of(path))
        return True

    # ------------------------------------------------------------------ lifetime
    def claim(self) -> Claim:
        self.check()
        os.makedirs(self.url, exist_ok=True)
        tmp = os.path.join(self.url, TMP_DIR)
        try:
            os.mkdir(tmp)
        except FileExistsError:
            if self._no_link(tmp) is None or not stat.S_ISDIR(os.lstat(tmp).st_mode):
                raise CheckpointSaveError(f"{tmp} is not a directory; remove it") from None
        path = os.path.join(tmp, LOCK)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointSaveError(f"{path} is not a regular file; remove it")
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in self._UNSUPPORTED_LOCK:
                try:
                    owner, until, wait_max = lock_holder(os.pread(fd, 4096, 0))
                except OSError:
                    owner, until, wait_max = "an unknown process", None, 0.0
                os.close(fd)
                return Claim(False, owner, busy_until=until, wait_max=wait_max)
            locked = False
            log.warning("%s: this filesystem does not support flock (%s); saving without the guard against a "
                        "second job on this root: make sure one job saves to it at a time", self.url, e)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, lock_record(), 0)
            self._clean_leftovers()
        except BaseException:
            os.close(fd)
            raise
        self._claim = Claim(True, "", fd, locked=locked)
        return self._claim

    def held_lock(self) -> Optional[int]:
        return self._claim.fd if self._claim is not None else None

    @property
    def orphans_may_finish(self) -> bool:
        return not self.detached  # a caller-named directory has no lock to hold

    @staticmethod
    def _lock_owner(fd: int) -> str:
        try:
            return lock_holder(os.pread(fd, 4096, 0))[0]
        except OSError:
            return "an unknown process"

    def _clean_leftovers(self) -> None:
        """Remove what crashed saves left under ``.tmp``: only entries nostall can prove it made."""
        tmp = os.path.join(self.url, TMP_DIR)
        retired = False
        for n in os.listdir(tmp):
            path = os.path.join(tmp, n)
            r = RETIRED_MARK_RE.match(n)
            if r is not None:  # the proof of a retired manifest: kept while that manifest is there
                retired = self._drop_stale_proof(r.group(1)) or retired
                continue
            m = OURS_RE.match(n) or MARK_RE.match(n)
            if m is None:
                if n != LOCK:
                    log.debug("%s is not nostall's: left alone", path)
                continue
            entry = os.path.join(tmp, f"{m.group(1)}-{m.group(2)}")
            if self._remove_ours(entry, m.group(2)) and n == os.path.basename(entry):
                # (a commit's records outlive a completed save until the next one: the other ranks may still
                # read its outcome when the job ends; so a leftover here is not always an interrupted save's)
                log.info("removed %s, left by an earlier save", entry)
        if retired:  # a retention cut short (or files read until now): finish it
            try:
                self.collect(self.referenced())
            except CheckpointError as e:
                log.warning("retired checkpoints under %s are kept: %s", self.url, e)

    # ------------------------------------------------------------------ one save
    def make_staging(self, dest: Destination) -> None:
        if self.detached:
            final = self.path(dest.name)
            mode = lkind(final)
            if mode is not None and not self.is_checkpoint(dest.name):
                raise CheckpointSaveError(
                    f"{final} exists and is not a nostall checkpoint (no nostall manifest.json in it); "
                    "refusing to replace it: choose another directory or remove it"
                )
            os.makedirs(self.url, exist_ok=True)
            self._release_root(self._take_root(dest.name))  # refused now, not after the write
            self._sweep_beside()
        else:
            self._check_before_save()
        self._make_ours(self._tmp("save", dest.save_id, dest.name), dest.save_id)

    def make_records(self, dest: Destination) -> None:
        d = self._records(dest.save_id)
        self._make_ours(d, dest.save_id)
        # the outcome slot exists before anything is written: announcing the outcome is then a
        # rename, which needs no space, so a full disk cannot make the outcome differ from the commit
        _create(os.path.join(d, "outcome.pending"))

    def open_staging(self, dest: Destination, rank: int) -> str:
        path = self._tmp("save", dest.save_id, dest.name)
        if not self._proven(path, dest.save_id) or lkind(path) is None:
            raise FileNotFoundError(
                errno.ENOENT, "the save's staging directory is gone (was the checkpoint directory deleted?)", path
            )
        return path

    def upload(self, dest: Destination, rank: int, names: List[str], deadline: float) -> None:
        """The files are in place already; tagged names (:meth:`data_name`) are given to them here."""
        if not dest.tagged:
            return
        staging = self._tmp("save", dest.save_id, dest.name)
        for n in names:
            os.rename(os.path.join(staging, n), os.path.join(staging, self.data_name(dest, n)))
        for d in {os.path.dirname(os.path.join(staging, n)) for n in names}:  # (a side file may be in a folder)
            storage.fsync_dir(d)

    def remove_own_files(self, dest: Destination, rank: int, names: List[str]) -> None:
        staging = self._tmp("save", dest.save_id, dest.name)
        for n in names + ([self.data_name(dest, n) for n in names] if dest.tagged else []):
            try:
                os.unlink(os.path.join(staging, n))
            except OSError:
                pass

    def check_files(self, dest: Destination, files: Mapping[str, int],
                    references: Mapping[str, int] = NONE) -> None:
        staging = self._tmp("save", dest.save_id, dest.name)
        # own files in the staging; an earlier checkpoint's (``<checkpoint>/<file>``) where it is in the root
        for path, size in [*((os.path.join(staging, n), z) for n, z in files.items()),
                           *((os.path.join(self.url, n), z) for n, z in references.items())]:
            try:
                got = os.lstat(path).st_size
            except FileNotFoundError:
                raise CheckpointSaveError(f"{path} is missing at commit time") from None
            if got != size:
                raise CheckpointSaveError(f"{path} has {got} bytes at commit time, {size} planned")

    def prepare_latest(self, dest: Destination) -> None:
        path = self._tmp("latest", dest.save_id)
        self.faults.check("latest", path)
        self._make_ours(path, dest.save_id, make_dir=False)
        storage.write_file(path, [memoryview(f"{dest.step}\n".encode())])

    def publish(self, dest: Destination, manifest: bytes) -> None:
        staging = self._tmp("save", dest.save_id, dest.name)
        final = self.path(dest.name)
        mpath = os.path.join(staging, MANIFEST_NAME)
        self.faults.check("manifest", mpath)
        storage.write_file(mpath, [memoryview(manifest)])
        storage.fsync_dir(staging)
        crash_point("commit.manifest", dest.step)
        self._no_link(final)
        held = self._take_root(dest.name)  # a managed root's checkpoint is replaced only under its lock
        try:
            self._publish(dest, staging, final)
        finally:
            self._release_root(held)

    def _publish(self, dest: Destination, staging: str, final: str) -> None:
        old: Optional[str] = None  # where the checkpoint this one replaces now is (marked as this save's)
        if lkind(final) is not None:
            if not self.is_checkpoint(dest.name) and not self._retired(dest.name):
                raise CheckpointSaveError(f"{final} exists and is not a nostall checkpoint; refusing to replace it")
            self._carry(dest, staging)
            storage.fsync_dir(staging)
            if _rename_exchange(staging, final):
                old = staging  # the staging path (and its mark) now holds the previous checkpoint
            else:
                old = self._tmp("trash", dest.save_id, dest.name)
                self._make_ours(old, dest.save_id, make_dir=False)
                os.rename(final, old)
                os.rename(staging, final)
        else:
            os.rename(staging, final)
        crash_point("commit.renamed", dest.step)
        try:  # past the commit point
            storage.fsync_dir(self.url)
            if old is not None:
                self._remove_ours(old, dest.save_id)  # the checkpoint we just replaced
            self._drop_mark(staging)
        except OSError as e:
            log.warning("%s is committed, but a follow-up failed: %s", final, e)

    def _take_root(self, name: str) -> Optional[int]:
        """A detached root saving ``step_<N>`` into a directory that is a managed root (it has ``.tmp/.lock``):
        that root's lock, taken without waiting (a descriptor to release), so that no checkpoint of a root
        another live manager holds is created or replaced behind its back. None when there is nothing to take.

        Raises :class:`~nostall.CheckpointSaveError` naming the holder when another process holds it.
        """
        if not self.detached or parse_step(name) is None:
            return None
        path = os.path.join(self.url, TMP_DIR, LOCK)
        self._no_link(os.path.join(self.url, TMP_DIR))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in self._UNSUPPORTED_LOCK:
                return fd
            owner = self._lock_owner(fd)
            os.close(fd)
            raise CheckpointSaveError(
                f"{self.path(name)} is a checkpoint of the root {self.url}, which a checkpoint manager holds "
                f"({owner}): saving there would change that job's checkpoints behind its back. Save to another "
                "directory, or through that manager") from None
        return fd

    @staticmethod
    def _release_root(fd: Optional[int]) -> None:
        if fd is not None:
            os.close(fd)  # releases the flock

    def _sweep_beside(self) -> None:
        """A detached root, before a save: remove what crashed saves left beside their checkpoints here
        (``.<name>.nostall-<kind>-<id>`` with their marks) -- only entries whose mark proves them nostall's
        and whose maker, a process of this host, has ended (a save still running is never touched)."""
        try:
            names = os.listdir(self.url)
        except OSError:
            return
        for n in names:
            m = BESIDE_RE.match(n[:-len(MARK_SUFFIX)] if n.endswith(MARK_SUFFIX) else n)
            if m is None or not n.endswith(MARK_SUFFIX):
                continue
            entry = os.path.join(self.url, n[:-len(MARK_SUFFIX)])
            try:
                content = storage.read_small_file(os.path.join(self.url, n), 512)
            except OSError:
                continue
            if maker_gone(content) and self._remove_ours(entry, m.group(3)):
                log.info("removed %s, left by an interrupted save", entry)

    def _drop_mark(self, path: str) -> None:
        """The mark of an entry that is gone (renamed into place, say)."""
        if lkind(path) is None:
            try:
                os.unlink(self._mark_of(path))
            except FileNotFoundError:
                pass

    def move_latest(self, dest: Destination) -> None:
        path = os.path.join(self.url, LATEST)
        self._no_link(path)
        self.faults.check("latest.move", path)
        prepared = self._tmp("latest", dest.save_id)
        if lkind(prepared) is None and self.read_latest() == dest.step:
            return  # moved already (a writer that died right after is being recovered)
        os.rename(prepared, path)
        storage.fsync_dir(self.url)
        self._drop_mark(prepared)

    def unpublish(self, dest: Destination) -> None:
        trash = self._tmp("trash", dest.save_id, dest.name)
        self._make_ours(trash, dest.save_id, make_dir=False)
        os.rename(self.path(dest.name), trash)
        storage.fsync_dir(self.url)
        self._remove_ours(trash, dest.save_id)

    def abort(self, dest: Destination) -> None:
        self._remove_ours(self._tmp("save", dest.save_id, dest.name), dest.save_id)
        self._remove_ours(self._tmp("latest", dest.save_id), dest.save_id)

    def _proof_path(self, rid: str) -> str:
        return os.path.join(self.url, TMP_DIR, f"retired-{rid}{MARK_SUFFIX}")

    def _prove_retired(self, rid: str, name: str) -> None:
        """The proof of ``<name>/.retired-<rid>.json``, made before it exists (a crash leaves a proof of
        nothing, which the next claim drops; never a retired manifest without proof)."""
        self._no_link(os.path.join(self.url, TMP_DIR))
        os.makedirs(os.path.join(self.url, TMP_DIR), exist_ok=True)
        _create(self._proof_path(rid), retired_proof(rid, name))

    def _drop_stale_proof(self, rid: str) -> bool:
        """Delete the proof of a retired manifest that is no longer anywhere (collected, or never made);
        True when the manifest is there (the proof is kept). Only a file that reads as a proof of ``rid``
        (``<rid> step_<N>``, or a prefix of one a crash cut short) is ever deleted: any other file of that
        name is not nostall's and stays."""
        path = self._proof_path(rid)
        try:
            text = storage.read_small_file(path, 512).decode("ascii")
        except (OSError, UnicodeDecodeError):
            return False
        m = re.fullmatch(rf"{rid} (step_[0-9]+)\n", text)
        if m is not None and parse_step(m.group(1)) is not None:
            if lkind(os.path.join(self.path(m.group(1)), f"{RETIRED_PREFIX}{rid}.json")):
                return True
            if stat.S_ISDIR(self._no_link(self.path(m.group(1))) or 0):
                self._rmdir_retired(m.group(1))  # a collection cut short after its last file went
        elif not (f"{rid} step_".startswith(text) or re.fullmatch(rf"{rid} step_[0-9]*", text)):
            log.debug("%s does not read as nostall's proof: left alone", path)
            return False
        os.unlink(path)
        return False

    def _retire(self, name: str, saving: Optional[int]) -> None:
        """``name`` stops being a checkpoint, atomically: its manifest becomes a retired one (proven first)."""
        d = self.path(name)
        rid, retired = retired_name()
        self._prove_retired(rid, name)
        os.rename(os.path.join(d, MANIFEST_NAME), os.path.join(d, retired))
        storage.fsync_dir(d)
        crash_point("retain.moved", saving)

    def delete_step(self, step: int, saving: Optional[int] = None, live: AbstractSet[str] = frozenset()) -> None:
        """Retire the checkpoint, then delete the files its manifest lists that nothing in ``live`` reads, and
        the directory once nothing else is in it: a file nostall did not write there stays (and so does the
        directory)."""
        name = step_name(step)
        if not self.is_checkpoint(name):
            log.warning("retention: %s is not a nostall checkpoint: left alone", self.path(name))
            return
        self._retire(name, saving)
        self._collect_dir(name, live)
        if lkind(self.path(name)) is None:
            storage.fsync_dir(self.url)
            log.info("retention: deleted %s", self.path(name))
        else:
            log.info("retention: retired %s (what is left there is read by later checkpoints, or not nostall's)",
                     self.path(name))

    def _retired(self, name: str) -> List[Tuple[str, Manifest]]:
        """The retired manifests in step directory ``name`` that nostall proves it retired (a mark under
        ``.tmp`` names each, with its directory): only those prove the files they list are nostall's."""
        d = self.path(name)
        out = []
        try:
            entries = os.listdir(d)
        except OSError:
            return []
        for n in sorted(entries):
            if not RETIRED_RE.match(n):
                continue
            path = os.path.join(d, n)
            rid = n[len(RETIRED_PREFIX):-len(".json")]
            try:
                proven = storage.read_small_file(self._proof_path(rid), 512) == retired_proof(rid, name)
            except OSError:
                proven = False
            if not proven:
                log.warning("%s: nostall has no proof that it retired this manifest: left alone, with the files "
                            "it lists", path)
                continue
            try:
                m = Manifest.from_json_bytes(storage.read_small_file(path, MANIFEST_PROOF_MAX_BYTES), path)
            except (CheckpointError, OSError):
                log.warning("%s is not a nostall manifest: left alone", path)
                continue
            out.append((path, m))
        return out

    def _collect_dir(self, name: str, live: AbstractSet[str]) -> None:
        """Delete the files the retired manifests of ``name`` list that nothing in ``live`` reads (regular files
        reached without following any link; never one the checkpoint now there lists), then each retired
        manifest whose files are all gone, then the directory once it is empty, and only then the proofs: a
        crash anywhere leaves a proof for what is left (the next claim finishes, :meth:`_drop_stale_proof`)."""
        d = self.path(name)
        proofs = []
        for path, files, done in collectable(name, self._retired(name), self.manifest(name), live):
            for f in files:
                storage.unlink_beneath(d, f)
            if done:
                os.unlink(path)
                proofs.append(self._proof_path(retired_id(os.path.basename(path))))
        self._rmdir_retired(name)
        for proof in proofs:
            try:
                os.unlink(proof)
            except FileNotFoundError:
                pass

    def _rmdir_retired(self, name: str) -> None:
        """Remove step directory ``name`` if nostall retired it and nothing is left in it (no manifest, empty)."""
        d = self.path(name)
        if lkind(os.path.join(d, MANIFEST_NAME)) is None:
            try:
                os.rmdir(d)
            except OSError:
                pass  # not empty: something else is there (left alone)

    def collect(self, live: AbstractSet[str]) -> None:
        try:
            for n in os.listdir(self.url):
                if parse_step(n) is not None and stat.S_ISDIR(self._no_link(self.path(n)) or 0) and self._retired(n):
                    self._collect_dir(n, live)
        except Exception as e:  # committed; leftovers are only space
            log.warning("could not delete the retired files under %s: %s", self.url, e)

    def _foreign(self, name: str) -> List[str]:
        """What step directory ``name`` holds that nostall cannot prove it wrote: anything but its manifest,
        its proven retired manifests and the files (and their folders) these list; a link is always foreign."""
        d = self.path(name)
        manifests = self._retired(name)
        m = self.manifest(name)
        ours = {MANIFEST_NAME} | {os.path.basename(p) for p, _ in manifests}
        for _, x in manifests + ([(d, m)] if m is not None else []):
            ours.update(listed(x))
        folders = {f.rsplit("/", i)[0] for f in ours for i in range(1, f.count("/") + 1)}
        out = []
        for top, dirs, files in os.walk(d):
            for n in dirs + files:
                full = os.path.join(top, n)
                rel = os.path.relpath(full, d).replace(os.sep, "/")
                mode = lkind(full) or 0
                if stat.S_ISDIR(mode) and rel in folders or stat.S_ISREG(mode) and rel in ours:
                    continue
                out.append(rel)
            dirs[:] = [n for n in dirs if stat.S_ISDIR(lkind(os.path.join(top, n)) or 0)]
        return sorted(out)

    def _carry(self, dest: Destination, staging: str) -> None:
        """Before ``dest`` replaces the checkpoint (or retired files) of its step: hard-link into the staging
        what other checkpoints still read from the old directory, with the manifests listing it (retired).

        Raises (before the commit point) when the old directory holds anything nostall cannot prove it
        wrote: the replaced directory is deleted whole, so it must hold nothing else.
        """
        foreign = self._foreign(dest.name)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise CheckpointSaveError(
                f"{self.path(dest.name)} holds files nostall did not write ({shown}); refusing to replace it: "
                "move them elsewhere (or save under another step)")
        live = {n for n in self.referenced(skip=[dest.step] if dest.step is not None else [])
                if n.startswith(dest.name + "/")}
        old = self.path(dest.name)
        manifests = self._retired(dest.name)
        current = os.path.join(old, MANIFEST_NAME)
        m = self.manifest(dest.name)
        if m is not None:
            manifests.append((current, m))
        for path, m in manifests:
            kept = [f for f in listed(m) if f"{dest.name}/{f}" in live
                    and stat.S_ISREG(getattr(storage.lstat_beneath(old, f), "st_mode", 0))]
            if not kept:
                continue
            for f in kept:
                os.makedirs(os.path.dirname(os.path.join(staging, f)), exist_ok=True)
                storage.link_beneath(old, f, os.path.join(staging, f))
            if path == current:
                rid, retired = retired_name()
                self._prove_retired(rid, dest.name)
            else:
                retired = os.path.basename(path)
            os.link(path, os.path.join(staging, retired), follow_symlinks=False)
            log.info("%s: files of the checkpoint it replaces that other checkpoints read are kept",
                     self.path(dest.name))

    # ------------------------------------------------------------------ records
    def _write_record(self, path: str, data: bytes, op: str) -> None:
        self.faults.check(op, path)
        storage.atomic_write(path, data)

    def reserve_done(self, dest: Destination, rank: int) -> None:
        _create(os.path.join(self._records(dest.save_id), f"rank{rank}.pending"))

    def _done_file(self, dest: Destination, rank: int, done: Done) -> Tuple[str, bytes]:
        """The name and bytes of rank ``rank``'s done record (a subclass may hold it elsewhere first)."""
        return done_name(rank), json.dumps(done.to_doc(), sort_keys=True).encode()

    def write_done(self, dest: Destination, rank: int, done: Done, deadline: float) -> None:
        d = self._records(dest.save_id)
        name, data = self._done_file(dest, rank, done)
        try:
            self._write_record(os.path.join(d, name), data, "record")
        except OSError:
            # no space for the record (a full disk): a failure is still recorded, by a rename
            try:
                os.rename(os.path.join(d, f"rank{rank}.pending"), os.path.join(d, f"rank{rank}.failed"))
            except FileNotFoundError:
                pass
            raise
        try:
            os.unlink(os.path.join(d, f"rank{rank}.pending"))
        except FileNotFoundError:
            pass

    def read_dones(self, dest: Destination, ranks: Iterable[int]) -> Dict[int, Done]:
        d = self._records(dest.save_id)
        try:
            present = set(os.listdir(d))
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "the save's records directory is gone", d) from None
        out = {}
        for r in ranks:
            if done_name(r) in present:
                path = os.path.join(d, done_name(r))
                out[r] = Done.from_doc(record(storage.read_small_file(path, RECORD_MAX_BYTES), path))
            elif f"rank{r}.failed" in present:
                out[r] = Done(False, error=f"rank {r}: its part of step {dest.step} failed and no record of why "
                                           "could be written (is the disk full?)")
        return out

    def write_outcome(self, dest: Destination, outcome: Outcome, deadline: float) -> None:
        d = self._records(dest.save_id)
        pending = os.path.join(d, "outcome.pending")
        if not outcome.ok:
            try:  # the reason, best effort (it needs space; the rename below does not)
                self._write_record(os.path.join(d, "outcome.json"), json.dumps({"error": outcome.error}).encode(),
                                   "outcome")
            except OSError as e:
                log.error("could not record why step %s failed: %s", dest.step, e)
        os.rename(pending, os.path.join(d, "outcome.ok" if outcome.ok else "outcome.failed"))
        storage.fsync_dir(d)

    def read_outcome(self, dest: Destination) -> Optional[Outcome]:
        d = self._records(dest.save_id)
        try:
            present = set(os.listdir(d))
        except FileNotFoundError:
            return Outcome(False, f"the records of step {dest.step}'s save are gone ({d})")
        if "outcome.ok" in present:
            return Outcome(True)
        if "outcome.failed" not in present:
            return None
        try:
            path = os.path.join(d, "outcome.json")
            return Outcome(False, str(record(storage.read_small_file(path, RECORD_MAX_BYTES), path).get("error")
                                      or "unknown error"))
        except (OSError, ValueError, AttributeError, CheckpointError):
            return Outcome(False, f"save of step {dest.step} failed (rank 0 could not record why)")

    def drop_records(self, save_id: str) -> None:
        self._remove_ours(self._records(save_id), save_id)
