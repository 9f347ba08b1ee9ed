"""The storage-root interface: every operation nostall makes on a checkpoint root.

A *root* holds a run's checkpoints. Everything above this module (the
manager, the saver, the writer, the CLI, the interop writers, ``Strategy``)
talks to a :class:`Root` and never to ``os`` or fsspec paths directly, and never
asks which kind of root it has. There are two implementations:

* :class:`PosixRoot`: a local or shared POSIX filesystem. The commit point is
  the atomic ``rename`` of a save's staging directory to ``step_<N>``; data is
  fsynced before it is renamed, directories after their entries change;
  ``flock`` keeps a second job off the root.
* :class:`ObjectRoot`: object storage through fsspec (``s3://`` and others).
  Each rank writes its files to node-local scratch and uploads them; the
  commit point is the upload of ``manifest.json``, last.

Layout (both; see docs/protocol.md)::

    <root>/step_<N>/            a committed checkpoint: a nostall manifest.json inside
    <root>/latest               the newest committed step (text, at most 64 bytes)
    <root>/.tmp/save-<id>/      a save in progress (POSIX; never a checkpoint)
    <root>/.tmp/commit-<id>/    a save's per-rank done records and its outcome
    <root>/.tmp/trash-<id>/     a checkpoint being deleted (POSIX)

What nostall may delete: only entries it can prove it made (docs/reliability.md has the
table). Every entry it creates under ``.tmp`` (or beside a detached root's checkpoint) is
preceded by its mark, a file ``<entry>.nostall`` holding the id in the entry's name and its
maker (written first, so a crash never leaves an unmarked entry of ours). Retention retires a
committed checkpoint (its manifest renamed ``.retired-<id>.json``, proven by the mark
``.tmp/retired-<id>.nostall`` written before) and deletes only the files that manifest lists;
a directory goes only once empty, and a step directory holding anything else is never
replaced. Nothing inside a root is followed if it is a symbolic link: deletions walk down
with ``O_NOFOLLOW`` at every component, and a root whose ``.tmp``, ``latest`` or
``step_<N>`` is one is refused with an error naming it.

Call order within one save (who: "rank 0" is the committing rank's trainer
for :meth:`~Root.make_staging` and its writer, or trainer for sync saves,
for the commit):

1. rank 0: :meth:`~Root.make_staging` (and :meth:`~Root.make_records` for async saves), before the plan;
2. every rank: :meth:`~Root.open_staging`, write files there, :meth:`~Root.upload`;
3. every rank: :meth:`~Root.write_done` (async) -- rank 0: :meth:`~Root.read_dones`;
4. rank 0: :meth:`~Root.check_files`, :meth:`~Root.prepare_latest`, :meth:`~Root.publish` (the
   commit point), :meth:`~Root.move_latest` -- or :meth:`~Root.abort`;
5. rank 0: :meth:`~Root.write_outcome` (async), then :meth:`~Root.delete_step` for retention and
   :meth:`~Root.sweep`.

This module does not import torch (it runs in the writer process).
"""

from __future__ import annotations

import abc
import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from typing import AbstractSet, Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from . import remote, storage
from ._faults import Faults, crash_point
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CheckpointSaveError
from .format import MANIFEST_NAME, Manifest, check_json_cost
from .jobs import Destination, Done, Outcome

log = logging.getLogger("nostall")

TMP_DIR = ".tmp"
LATEST = "latest"
MARK_SUFFIX = ".nostall"
LOCK = ".lock"
LATEST_MAX_BYTES = 64
RECORD_MAX_BYTES = 1 << 30
MANIFEST_PROOF_MAX_BYTES = 1 << 30

_STEP_RE = re.compile(r"^step_(0|[1-9][0-9]{0,18})$")
_ID = r"[0-9a-f]{32}"
_OURS_RE = re.compile(rf"^(save|commit|trash|latest)-({_ID})$")
_MARK_RE = re.compile(rf"^(save|commit|trash|latest)-({_ID})\.nostall$")
_DATA_RE = re.compile(r"^rank(0|[1-9][0-9]*)\.([0-9a-f]{16})\.safetensors$")
_RECORD_RE = re.compile(r"^(rank(0|[1-9][0-9]*)\.json|outcome\.json)$")
_NONE: Mapping[str, int] = {}
RETIRED_PREFIX = ".retired-"
"""A step directory may hold, besides its checkpoint, *retired manifests* ``.retired-<id>.json``: the
manifests of checkpoints deleted (or replaced) while other retained checkpoints still read some of
their data files (incremental saves). They prove those files are nostall's; each file is deleted once
nothing reads it, and the retired manifest after its last file."""
_RETIRED_RE = re.compile(r"^\.retired-([0-9a-f]{16}|[0-9a-f]{32})\.json$")
_RETIRED_MARK_RE = re.compile(rf"^retired-({_ID})\.nostall$")
_BESIDE_RE = re.compile(rf"^\.(.*)\.nostall-(save|commit|trash)-({_ID})$")
"""What a one-shot save or a directory its caller names (a detached root) makes beside its checkpoint."""


def _retired_name() -> Tuple[str, str]:
    """(id, file name) of a new retired manifest: its proof is the mark ``.tmp/retired-<id>.nostall``."""
    rid = os.urandom(16).hex()
    return rid, f"{RETIRED_PREFIX}{rid}.json"


def _retired_proof(rid: str, name: str) -> bytes:
    """The content of the mark that proves ``<name>/.retired-<rid>.json`` is a manifest nostall retired."""
    return f"{rid} {name}\n".encode()


def _start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, Linux), or "" where unknown: with the pid, it
    tells a live process from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def _mark_content(save_id: str) -> bytes:
    """A mark: the entry's id, then who made it (host, pid, process start), for a sweep to tell whether
    the save it belongs to can still be running."""
    pid = os.getpid()
    return f"{save_id}\n{socket.gethostname()} {pid} {_start_time(pid)}\n".encode()


def _maker_gone(content: bytes) -> bool:
    """Whether the process that wrote a mark is known to have ended (same host, its pid gone or reused).
    Unknown (another host, an old or cut mark): False, so the entry is left alone."""
    lines = content.decode("ascii", "replace").split("\n")
    fields = lines[1].split() if len(lines) > 2 else []
    if len(fields) != 3 or fields[0] != socket.gethostname() or not fields[1].isdigit():
        return False
    pid = int(fields[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, someone else's
    return bool(fields[2]) and _start_time(pid) not in ("", fields[2])


def _tagged(name: str, save_id: str) -> str:
    """``rank0.safetensors`` -> ``rank0.<save id>.safetensors`` (a side file's folders keep their names)."""
    folder, slash, base = name.rpartition("/")
    stem, dot, ext = base.rpartition(".")
    tagged = f"{stem}.{save_id[:16]}.{ext}" if dot and stem else f"{base}.{save_id[:16]}"
    return f"{folder}{slash}{tagged}"


def _listed(m: Manifest) -> List[str]:
    """The files a manifest names in its own directory: data files and side files."""
    return list(m.files) + [f.file for f in m.side_files.values()]


def step_name(step: int) -> str:
    return f"step_{step}"


def parse_step(name: str) -> Optional[int]:
    """The step of a checkpoint directory's name (exactly ``step_<N>``), else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _done_name(rank: int) -> str:
    return f"rank{rank}.json"


def _parse_latest(raw: bytes, where: str) -> Optional[int]:
    try:
        text = raw.decode("ascii").strip()
        step = parse_step(f"step_{text}")
    except UnicodeDecodeError:
        step = None
    if step is None:
        log.warning("%s does not name a step (%r); using the newest committed step", where, raw[:32])
    return step


def _record(raw: bytes, where: str) -> Any:
    """A record's JSON, its parse's memory bounded first (a record is small; a hostile one is refused)."""
    check_json_cost(raw, where, "record")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise CheckpointCorruptError(f"{where}: not a JSON record ({e})") from None


def _is_nostall_manifest(raw: bytes, where: str) -> bool:
    try:
        Manifest.from_json_bytes(raw, where)
        return True
    except CheckpointError:
        return False


class Claim:
    """A root's claim for a manager's lifetime (see :meth:`Root.claim`); ``release()`` ends it."""

    def __init__(self, held: bool, owner: str = "", fd: Optional[int] = None) -> None:
        self.held = held
        self.owner = owner
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


class Root(abc.ABC):
    """Every operation on one checkpoint root (see the module docstring). Picklable."""

    url: str
    faults: Faults

    # ------------------------------------------------------------------ names
    @abc.abstractmethod
    def path(self, name: str) -> str:
        """Location (directory or URL) of the checkpoint named ``name``."""

    poll_max_s = 0.5
    """Longest pause between two looks at a record another rank writes (backing off from 5 ms)."""
    retention_beside_next_save = False
    """Whether retention and the sweep after a commit may run while the next save is already being
    written: true only where a save in flight writes nowhere they delete (a POSIX root stages in
    ``.tmp/save-<id>/`` and sweeps nothing). Then a background writer reports the commit first."""

    def data_name(self, dest: Destination, name: str) -> str:
        """What the planned data file (or side file) ``name`` is called in the checkpoint: tagged with the
        save's id when ``dest.tagged`` (a re-save of a step never reuses a name that an earlier manifest
        may refer to)."""
        return _tagged(name, dest.save_id) if dest.tagged else name

    def manifest(self, name: str) -> Optional[Manifest]:
        """The parsed manifest of checkpoint ``name``, or None (none there, or not a nostall manifest)."""
        try:
            raw = self.manifest_bytes(name)
            return None if raw is None else Manifest.from_json_bytes(raw, self.path(name))
        except (CheckpointCorruptError, OSError):
            return None

    def referenced(self, skip: Iterable[int] = ()) -> Set[str]:
        """Every data file of an earlier checkpoint (``<checkpoint>/<file>``) that a committed checkpoint
        reads, leaving out the checkpoints of steps ``skip``. Manifests without references are not parsed.

        Raises :class:`~nostall.CheckpointError` when a manifest that names references cannot be parsed
        (damaged, or of a newer format version): what it reads is unknown, so the caller must delete
        nothing (retention is skipped; a re-save of a step fails before its commit point).
        """
        out: Set[str] = set()
        skipped = set(skip)
        for s in self.steps():
            if s in skipped:
                continue
            raw = self.manifest_bytes(step_name(s))
            if raw is None or b'"references"' not in raw:
                continue
            try:
                m = Manifest.from_json_bytes(raw, self.path(step_name(s)))
            except CheckpointCorruptError as e:
                raise CheckpointError(f"{e}: this checkpoint may read files of earlier checkpoints, and which "
                                      "is unknown, so none is deleted; fix or remove it") from None
            out.update(m.references)
        return out

    # ------------------------------------------------------------------ reading
    @abc.abstractmethod
    def steps(self) -> List[int]:
        """Steps of the committed checkpoints, ascending."""

    @abc.abstractmethod
    def read_latest(self) -> Optional[int]:
        """The step ``latest`` names, or None (absent or not a step)."""

    def latest_step(self) -> Optional[int]:
        """``latest`` when it names a committed step (after a rollback it may be lower than the
        highest one), else the highest committed step (``latest`` may lag a crash by one commit)."""
        steps = self.steps()
        pointed = self.read_latest()
        if pointed is not None and pointed in steps:
            return pointed
        return steps[-1] if steps else None

    @abc.abstractmethod
    def is_checkpoint(self, name: str) -> bool:
        """Whether ``name`` is a committed nostall checkpoint (its manifest parses as one)."""

    @abc.abstractmethod
    def has_manifest(self, name: str) -> bool:
        """Whether something named ``manifest.json`` is in ``name`` (reading it tells whether it is sound)."""

    @abc.abstractmethod
    def manifest_bytes(self, name: str) -> Optional[bytes]:
        """The manifest of the checkpoint ``name`` in place, as stored; None when there is none."""

    @abc.abstractmethod
    def committed_at(self, name: str) -> Optional[str]:
        """When the checkpoint ``name`` was committed (its manifest written), ISO 8601 UTC; None if unknown."""

    @abc.abstractmethod
    def identity(self, ref: str) -> Optional[str]:
        """A token of the stored file ``ref`` (``<checkpoint>/<file>``) that changes whenever it is written,
        replaced or renamed over; None when it is not there (or only through a link). An incremental save's
        writer reads back what it would reference only when this changed since it last did."""

    @abc.abstractmethod
    def read_into(self, ref: str, start: int, into: memoryview) -> None:
        """Read ``len(into)`` bytes of the stored file ``ref`` at ``start`` into ``into`` (nothing followed
        that is a link; a short file raises :class:`~nostall.CheckpointCorruptError`)."""

    # ------------------------------------------------------------------ lifetime
    @abc.abstractmethod
    def claim(self) -> Claim:
        """Rank 0, when a manager opens the root: take it, then remove what crashed saves left."""

    def warm(self) -> None:  # noqa: B027 - optional step, no-op by default
        """A writer, when it starts: get ready to write here (object storage: import and build the client),
        so that the first save's deadline is not spent on it."""

    def check(self) -> None:  # noqa: B027 - optional step, no-op by default
        """Refuse a root that nostall cannot use safely (raises naming the entry)."""

    # ------------------------------------------------------------------ one save
    @abc.abstractmethod
    def make_staging(self, dest: Destination) -> None:
        """Rank 0, before the plan: the save's staging area (nothing remote)."""

    def make_records(self, dest: Destination) -> None:  # noqa: B027 - optional step, no-op by default
        """Rank 0, before the plan, async saves: the save's records (nothing remote)."""

    @abc.abstractmethod
    def open_staging(self, dest: Destination, rank: int) -> str:
        """Every rank, before writing: the local directory where it writes its files."""

    def upload(self, dest: Destination, rank: int, names: List[str], deadline: float) -> None:  # noqa: B027 - optional step, no-op by default
        """Every rank, after writing: move its staged files (data files, rank 0's side files) into the
        checkpoint, each stored as :meth:`data_name` says (a no-op on POSIX)."""

    @abc.abstractmethod
    def remove_own_files(self, dest: Destination, rank: int, names: List[str]) -> None:
        """A rank whose save failed: delete what it wrote (a full disk needs the space back)."""

    @abc.abstractmethod
    def check_files(self, dest: Destination, files: Mapping[str, int],
                    references: Mapping[str, int] = _NONE) -> None:
        """Rank 0, before the commit: every file of the save (data and side files) is there with its size, and
        every file of an earlier checkpoint that it reads (``references``, ``<checkpoint>/<file>``)."""

    def prepare_latest(self, dest: Destination) -> None:  # noqa: B027 - optional step, no-op by default
        """Rank 0, before the commit point: whatever moving ``latest`` needs that can fail for lack of space."""

    @abc.abstractmethod
    def publish(self, dest: Destination, manifest: bytes) -> None:
        """Rank 0: write the manifest and make the checkpoint visible (the commit point).

        Raises only before the commit point (nothing is visible then).
        """

    @abc.abstractmethod
    def move_latest(self, dest: Destination) -> None:
        """Rank 0, right after the commit point: ``latest`` names ``dest.step``."""

    @abc.abstractmethod
    def unpublish(self, dest: Destination) -> None:
        """Rank 0: take back a commit whose ``latest`` could not move (the checkpoint stops being one)."""

    @abc.abstractmethod
    def abort(self, dest: Destination) -> None:
        """Rank 0, after a failure before the commit point: remove this save's staging and uploads."""

    @abc.abstractmethod
    def delete_step(self, step: int, saving: Optional[int] = None, live: AbstractSet[str] = frozenset()) -> None:
        """Retention: delete the committed checkpoint of ``step`` (it stops being one first).

        ``saving``: the step whose save's retention this is (for the crash points). ``live``: the files
        (``<checkpoint>/<file>``) retained checkpoints read (:meth:`referenced`): those of this step stay,
        with the manifest retired beside them (see :data:`RETIRED_PREFIX`).
        """

    def collect(self, live: AbstractSet[str]) -> None:  # noqa: B027 - optional step, no-op by default
        """Rank 0, after retention: delete the files of retired manifests that nothing in ``live`` reads,
        then each retired manifest left without files (never raises)."""

    def sweep(self, dest: Destination) -> None:  # noqa: B027 - optional step, no-op by default
        """Rank 0, after a commit: delete what earlier crashed saves left (never raises)."""

    # ------------------------------------------------------------------ records
    def reserve_done(self, dest: Destination, rank: int) -> None:  # noqa: B027 - optional step, no-op by default
        """Every rank, before writing (background saves): make what recording a failure will need."""

    @abc.abstractmethod
    def write_done(self, dest: Destination, rank: int, done: Done, deadline: float) -> None:
        """A rank's done record (atomic: readers never see half of it).

        Raises when the record could not be written; where a failure can still
        be recorded without space (see :meth:`reserve_done`), it is.
        """

    @abc.abstractmethod
    def read_dones(self, dest: Destination, ranks: Iterable[int]) -> Dict[int, Done]:
        """The done records present among ``ranks``' (one listing per call)."""

    @abc.abstractmethod
    def write_outcome(self, dest: Destination, outcome: Outcome, deadline: float) -> None:
        """Rank 0: the save's outcome, for the other ranks."""

    @abc.abstractmethod
    def read_outcome(self, dest: Destination) -> Optional[Outcome]:
        """The save's outcome, once rank 0 wrote it."""

    @abc.abstractmethod
    def drop_records(self, save_id: str) -> None:
        """Rank 0, once every rank has read a save's outcome: delete its records."""


# =========================================================================== POSIX


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


def _lkind(path: str) -> Optional[int]:
    """``st_mode`` of ``path`` itself (never following a link), or None when absent."""
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None


class PosixRoot(Root):
    """A root on a POSIX filesystem (local or shared); see the module docstring.

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
        mode = _lkind(path)
        if mode is not None and stat.S_ISLNK(mode):
            raise CheckpointError(
                f"{path} is a symbolic link: nostall never follows links inside a checkpoint root. "
                "Replace it with a real directory or file (or use another root)"
            )
        return mode

    def check(self) -> None:
        mode = _lkind(self.url)
        if mode is not None and not stat.S_ISDIR(os.stat(self.url).st_mode):
            raise CheckpointSaveError(f"checkpoint root {self.url!r} exists and is not a directory")
        if self.detached or mode is None:
            return
        self._no_link(os.path.join(self.url, TMP_DIR))
        self._no_link(os.path.join(self.url, LATEST))
        for n in os.listdir(self.url):
            if parse_step(n) is not None:
                self._no_link(os.path.join(self.url, n))

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
            m = _lkind(os.path.join(d, MANIFEST_NAME))
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
        return _parse_latest(raw, path)

    def is_checkpoint(self, name: str) -> bool:
        try:
            raw = self.manifest_bytes(name)
        except OSError:
            return False
        return raw is not None and _is_nostall_manifest(raw, os.path.join(self.path(name), MANIFEST_NAME))

    def has_manifest(self, name: str) -> bool:
        d = self.path(name)
        mode = self._no_link(d)
        return mode is not None and stat.S_ISDIR(mode) and _lkind(os.path.join(d, MANIFEST_NAME)) is not None

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
        _create(self._mark_of(path), _mark_content(save_id))
        if make_dir:
            os.mkdir(path)

    def _remove_ours(self, path: str, save_id: str) -> bool:
        """Delete ``path`` (never following a link) and its mark, if the mark proves it is ``save_id``'s."""
        if not self._proven(path, save_id):
            if _lkind(path) is not None:
                log.warning("%s is not nostall's (no mark for save %s): left alone", path, save_id)
                return False
            self._drop_cut_mark(path, save_id)
            return True
        mode = _lkind(path)
        if mode is not None:
            if stat.S_ISDIR(mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        if _lkind(path) is not None:
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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in self._UNSUPPORTED_LOCK:
                owner = self._lock_owner(fd)
                os.close(fd)
                return Claim(False, owner)
            log.warning("%s: this filesystem does not support flock (%s); saving without the guard against a "
                        "second job on this root: make sure one job saves to it at a time", self.url, e)
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._clean_leftovers()
        return Claim(True, "", fd)

    @staticmethod
    def _lock_owner(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"{}")
            return f"pid {info['pid']} on host {info['host']} (since {info['since']})"
        except (OSError, ValueError, KeyError, TypeError):
            return "an unknown process"

    def _clean_leftovers(self) -> None:
        """Remove what crashed saves left under ``.tmp``: only entries nostall can prove it made."""
        tmp = os.path.join(self.url, TMP_DIR)
        retired = False
        for n in os.listdir(tmp):
            path = os.path.join(tmp, n)
            r = _RETIRED_MARK_RE.match(n)
            if r is not None:  # the proof of a retired manifest: kept while that manifest is there
                retired = self._drop_stale_proof(r.group(1)) or retired
                continue
            m = _OURS_RE.match(n) or _MARK_RE.match(n)
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
            mode = _lkind(final)
            if mode is not None and not self.is_checkpoint(dest.name):
                raise CheckpointSaveError(
                    f"{final} exists and is not a nostall checkpoint (no nostall manifest.json in it); "
                    "refusing to replace it: choose another directory or remove it"
                )
            os.makedirs(self.url, exist_ok=True)
            self._release_root(self._take_root(dest.name))  # refused now, not after the write
            self._sweep_beside()
        else:
            self.check()
            os.makedirs(os.path.join(self.url, TMP_DIR), exist_ok=True)
        self._make_ours(self._tmp("save", dest.save_id, dest.name), dest.save_id)

    def make_records(self, dest: Destination) -> None:
        d = self._records(dest.save_id)
        self._make_ours(d, dest.save_id)
        # the outcome slot exists before anything is written: announcing the outcome is then a
        # rename, which needs no space, so a full disk cannot make the outcome differ from the commit
        _create(os.path.join(d, "outcome.pending"))

    def open_staging(self, dest: Destination, rank: int) -> str:
        path = self._tmp("save", dest.save_id, dest.name)
        if not self._proven(path, dest.save_id) or _lkind(path) is None:
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
                    references: Mapping[str, int] = _NONE) -> None:
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
        if _lkind(final) is not None:
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
            m = _BESIDE_RE.match(n[:-len(MARK_SUFFIX)] if n.endswith(MARK_SUFFIX) else n)
            if m is None or not n.endswith(MARK_SUFFIX):
                continue
            entry = os.path.join(self.url, n[:-len(MARK_SUFFIX)])
            try:
                content = storage.read_small_file(os.path.join(self.url, n), 512)
            except OSError:
                continue
            if _maker_gone(content) and self._remove_ours(entry, m.group(3)):
                log.info("removed %s, left by an interrupted save", entry)

    def _drop_mark(self, path: str) -> None:
        """The mark of an entry that is gone (renamed into place, say)."""
        if _lkind(path) is None:
            try:
                os.unlink(self._mark_of(path))
            except FileNotFoundError:
                pass

    def move_latest(self, dest: Destination) -> None:
        path = os.path.join(self.url, LATEST)
        self._no_link(path)
        self.faults.check("latest.move", path)
        prepared = self._tmp("latest", dest.save_id)
        if _lkind(prepared) is None and self.read_latest() == dest.step:
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
        _create(self._proof_path(rid), _retired_proof(rid, name))

    def _drop_stale_proof(self, rid: str) -> bool:
        """Delete the proof of a retired manifest that is no longer anywhere (collected, or never made);
        True when the manifest is there (the proof is kept)."""
        path = self._proof_path(rid)
        try:
            name = storage.read_small_file(path, 512).decode("ascii", "replace").split()[1]
        except (OSError, IndexError):
            name = ""
        if parse_step(name) is not None and _lkind(os.path.join(self.path(name), f"{RETIRED_PREFIX}{rid}.json")):
            return True
        os.unlink(path)
        return False

    def _retire(self, name: str, saving: Optional[int]) -> None:
        """``name`` stops being a checkpoint, atomically: its manifest becomes a retired one (proven first)."""
        d = self.path(name)
        rid, retired = _retired_name()
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
        if _lkind(self.path(name)) is None:
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
            if not _RETIRED_RE.match(n):
                continue
            path = os.path.join(d, n)
            rid = n[len(RETIRED_PREFIX):-len(".json")]
            try:
                proven = storage.read_small_file(self._proof_path(rid), 512) == _retired_proof(rid, name)
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
        manifest whose files are all gone and its proof, then the directory once it is empty."""
        d = self.path(name)
        current = self.manifest(name)
        keep = set(_listed(current)) if current is not None else set()
        for path, m in self._retired(name):
            left = False
            for f in _listed(m):
                if f"{name}/{f}" in live:
                    left = True
                elif f not in keep:
                    storage.unlink_beneath(d, f)
            if not left:
                os.unlink(path)
                rid = os.path.basename(path)[len(RETIRED_PREFIX):-len(".json")]
                try:
                    os.unlink(self._proof_path(rid))
                except FileNotFoundError:
                    pass
        if _lkind(os.path.join(d, MANIFEST_NAME)) is None:
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
            ours.update(_listed(x))
        folders = {f.rsplit("/", i)[0] for f in ours for i in range(1, f.count("/") + 1)}
        out = []
        for top, dirs, files in os.walk(d):
            for n in dirs + files:
                full = os.path.join(top, n)
                rel = os.path.relpath(full, d).replace(os.sep, "/")
                mode = _lkind(full) or 0
                if stat.S_ISDIR(mode) and rel in folders or stat.S_ISREG(mode) and rel in ours:
                    continue
                out.append(rel)
            dirs[:] = [n for n in dirs if stat.S_ISDIR(_lkind(os.path.join(top, n)) or 0)]
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
            kept = [f for f in _listed(m) if f"{dest.name}/{f}" in live
                    and stat.S_ISREG(getattr(storage.lstat_beneath(old, f), "st_mode", 0))]
            if not kept:
                continue
            for f in kept:
                os.makedirs(os.path.dirname(os.path.join(staging, f)), exist_ok=True)
                storage.link_beneath(old, f, os.path.join(staging, f))
            if path == current:
                rid, retired = _retired_name()
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

    def write_done(self, dest: Destination, rank: int, done: Done, deadline: float) -> None:
        d = self._records(dest.save_id)
        try:
            self._write_record(os.path.join(d, _done_name(rank)), json.dumps(done.to_doc(), sort_keys=True).encode(),
                               "record")
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
            if _done_name(r) in present:
                path = os.path.join(d, _done_name(r))
                out[r] = Done.from_doc(_record(storage.read_small_file(path, RECORD_MAX_BYTES), path))
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
            return Outcome(False, str(_record(storage.read_small_file(path, RECORD_MAX_BYTES), path).get("error")
                                      or "unknown error"))
        except (OSError, ValueError, AttributeError, CheckpointError):
            return Outcome(False, f"save of step {dest.step} failed (rank 0 could not record why)")

    def drop_records(self, save_id: str) -> None:
        self._remove_ours(self._records(save_id), save_id)


# =========================================================================== object storage


def _join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/")] + [p.strip("/") for p in parts])


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

    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    extra = {"chunksize": UPLOAD_PART_BYTES} if "s3" in protocols else {}
    fs.put_file(local, key, callback=Callback(hooks={"progress": progress}), **extra)


class ObjectRoot(Root):
    """A root on object storage through fsspec; see the module docstring.

    There is no rename: the manifest, uploaded last, is the commit point, and
    a ``step_<N>/`` prefix without one is never listed or loaded. Data file
    names carry the save's id (``rank0.<id>.safetensors``), so re-saving a
    step never touches the files its older manifest names. There is no lock
    either: one job must save to a root at a time.
    """

    def __init__(self, url: str, *, storage_options: Optional[Dict[str, Any]] = None,
                 local_staging: Optional[str] = None, timeout: float = 600.0,
                 faults: Optional[Faults] = None) -> None:
        self.url = str(url).rstrip("/")
        self.storage_options = storage_options
        self.local_staging = local_staging or os.path.join(
            tempfile.gettempdir(), "nostall-staging", hashlib.sha1(self.url.encode()).hexdigest()[:12])
        self.timeout = timeout
        self.faults = faults if faults is not None else Faults()
        self._fs_cache: Optional[Tuple[Any, str]] = None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_fs_cache"] = None  # a live client does not travel to the writer
        return state

    def __repr__(self) -> str:
        return f"ObjectRoot({self.url!r})"

    def warm(self) -> None:
        self._fs()

    def _fs(self) -> Tuple[Any, str]:
        if self._fs_cache is None:
            self._fs_cache = remote.filesystem(self.url, self.storage_options)
        return self._fs_cache

    def _key(self, *parts: str) -> str:
        return _join(self._fs()[1], *parts)

    def _retry(self, what: str, fn: Any, deadline: Optional[float] = None) -> Any:
        return remote.retry(what, fn, deadline=deadline)

    def _ls(self, *parts: str) -> List[str]:
        fs = self._fs()[0]
        try:
            return [os.path.basename(str(p).rstrip("/"))
                    for p in self._retry(f"list {_join(self.url, *parts)}",
                                         lambda: fs.ls(self._key(*parts), detail=False, refresh=True))]
        except FileNotFoundError:
            return []

    # ------------------------------------------------------------------ names
    def path(self, name: str) -> str:
        return _join(self.url, name)

    def data_name(self, dest: Destination, name: str) -> str:
        """``rank0.safetensors`` -> ``rank0.<save id>.safetensors``, always: a re-save of a step never
        overwrites the files an older manifest of that step still names."""
        return _tagged(name, dest.save_id)

    # ------------------------------------------------------------------ reading
    def steps(self) -> List[int]:
        fs, key = self._fs()
        fs.invalidate_cache()  # other processes write here: never trust a cached listing
        try:
            found = self._retry(f"list {self.url}", lambda: fs.glob(f"{key.rstrip('/')}/step_*/{MANIFEST_NAME}"))
        except FileNotFoundError:
            return []
        steps = []
        for p in found:
            s = parse_step(os.path.basename(os.path.dirname(str(p))))
            if s is not None:
                steps.append(s)
        return sorted(steps)

    def read_latest(self) -> Optional[int]:
        url = _join(self.url, LATEST)
        try:
            raw = remote.read_small(url, LATEST_MAX_BYTES, self.storage_options)
        except FileNotFoundError:
            return None
        except CheckpointError as e:
            log.warning("%s: %s; using the newest committed step", url, e)
            return None
        return _parse_latest(raw, url)

    def is_checkpoint(self, name: str) -> bool:
        return self.manifest(name) is not None

    def has_manifest(self, name: str) -> bool:
        fs = self._fs()[0]
        fs.invalidate_cache()  # other processes write here: never trust a cached listing
        return bool(self._retry(f"stat {_join(self.url, name, MANIFEST_NAME)}",
                                lambda: fs.exists(self._key(name, MANIFEST_NAME))))

    def manifest_bytes(self, name: str) -> Optional[bytes]:
        try:
            return remote.read_small(_join(self.url, name, MANIFEST_NAME), MANIFEST_PROOF_MAX_BYTES,
                                     self.storage_options)
        except FileNotFoundError:
            return None

    def committed_at(self, name: str) -> Optional[str]:
        try:
            info = self._fs()[0].info(self._key(name, MANIFEST_NAME))
        except Exception:
            return None
        t = info.get("LastModified") or info.get("mtime") or info.get("created")
        if t is None:
            return None
        if isinstance(t, (int, float, str)):
            try:
                return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(t)))
            except ValueError:
                return None
        return str(t.isoformat())

    def identity(self, ref: str) -> Optional[str]:
        fs = self._fs()[0]
        try:
            info = self._retry(f"stat {_join(self.url, ref)}", lambda: fs.info(self._key(*ref.split("/"))))
        except FileNotFoundError:
            return None
        return ":".join(str(info.get(k, "")) for k in ("ETag", "size", "LastModified", "mtime"))

    def read_into(self, ref: str, start: int, into: memoryview) -> None:
        fs = self._fs()[0]
        url = _join(self.url, ref)
        end = start + len(into)
        raw = self._retry(f"read {url}", lambda: fs.cat_file(self._key(*ref.split("/")), start=start, end=end))
        if len(raw) != end - start:
            raise CheckpointCorruptError(f"{url}: truncated: wanted bytes [{start}, {end}), got {len(raw)}")
        into[:] = raw

    # ------------------------------------------------------------------ lifetime
    def claim(self) -> Claim:
        log.info("%s: object storage has no cross-job lock; make sure one job saves to it at a time", self.url)
        return Claim(True)

    # ------------------------------------------------------------------ one save
    def make_staging(self, dest: Destination) -> None:
        """Nothing remote: no round trip in the trainer's stall."""

    def _local(self, dest: Destination, rank: int) -> str:
        return os.path.join(self.local_staging, f"rank{rank}", f"save-{dest.save_id}")

    def open_staging(self, dest: Destination, rank: int) -> str:
        parent = os.path.join(self.local_staging, f"rank{rank}")
        os.makedirs(parent, exist_ok=True)
        for n in os.listdir(parent):  # what crashed saves of this rank left (nothing else is touched)
            m = _OURS_RE.match(n)
            if m and m.group(1) == "save" and stat.S_ISDIR(_lkind(os.path.join(parent, n)) or 0):
                shutil.rmtree(os.path.join(parent, n), ignore_errors=True)
        path = self._local(dest, rank)
        os.mkdir(path)
        return path

    def upload(self, dest: Destination, rank: int, names: List[str], deadline: float) -> None:
        fs = self._fs()[0]
        staging = self._local(dest, rank)
        for name, stored in [(n, self.data_name(dest, n)) for n in names]:
            local = os.path.join(staging, name)
            size = os.path.getsize(local)
            t0 = time.monotonic()
            url = _join(self.url, dest.name, stored)
            key = self._key(dest.name, stored)
            try:
                self._retry(f"upload {url}", functools.partial(_put, fs, local, key, url, size), deadline)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"uploading {url}: the bucket or prefix does not exist ({e})") from None
            dt = max(time.monotonic() - t0, 1e-9)
            log.info("uploaded %s: %.1f MB in %.2fs (%.0f MB/s)", url, size / 1e6, dt, size / 1e6 / dt)
            crash_point("upload.done", dest.step)
        shutil.rmtree(staging, ignore_errors=True)

    def remove_own_files(self, dest: Destination, rank: int, names: List[str]) -> None:
        shutil.rmtree(self._local(dest, rank), ignore_errors=True)

    def check_files(self, dest: Destination, files: Mapping[str, int],
                    references: Mapping[str, int] = _NONE) -> None:
        fs = self._fs()[0]
        for parts, size in [*(((dest.name, n), z) for n, z in files.items()),
                            *((tuple(n.split("/")), z) for n, z in references.items())]:
            url = _join(self.url, *parts)
            try:
                got = self._retry(f"stat {url}", functools.partial(fs.size, self._key(*parts)))
            except FileNotFoundError:
                raise CheckpointSaveError(f"{url} is missing at commit time") from None
            if got != size:
                raise CheckpointSaveError(f"{url} has {got} bytes at commit time, {size} planned")

    def publish(self, dest: Destination, manifest: bytes) -> None:
        fs = self._fs()[0]
        url = _join(self.url, dest.name, MANIFEST_NAME)
        self.faults.check("manifest", url)
        old = self.manifest_bytes(dest.name)
        if old is not None and any(n.startswith(dest.name + "/") for n in self.referenced(
                skip=[dest.step] if dest.step is not None else [])):
            # other checkpoints read files of the one this replaces: its manifest is kept, retired, to prove them
            self._upload_retired(dest.name, old)
        self._retry(f"upload {url}", lambda: fs.pipe_file(self._key(dest.name, MANIFEST_NAME), manifest))
        crash_point("commit.renamed", dest.step)
        self._drop_other_saves(dest)

    def _drop_other_saves(self, dest: Destination) -> None:
        """After the commit: delete data files that earlier or failed saves of this step left (not those
        a retired manifest lists: :meth:`collect` deletes them once nothing reads them)."""
        try:
            fs = self._fs()[0]
            tag = dest.save_id[:16]
            kept = {f for _, m in self._retired(dest.name) for f in _listed(m)}
            for n in self._ls(dest.name):
                m = _DATA_RE.match(n)
                if m and m.group(2) != tag and n not in kept:
                    fs.rm(self._key(dest.name, n))
        except Exception as e:  # committed; leftovers are only space
            log.warning("could not remove older data files under %s: %s", self.path(dest.name), e)

    def move_latest(self, dest: Destination) -> None:
        fs = self._fs()[0]
        url = _join(self.url, LATEST)
        self.faults.check("latest.move", url)
        self._retry(f"upload {url}", lambda: fs.pipe_file(self._key(LATEST), f"{dest.step}\n".encode()))

    def unpublish(self, dest: Destination) -> None:
        fs = self._fs()[0]
        self._retry(f"delete {self.path(dest.name)}/{MANIFEST_NAME}",
                    lambda: fs.rm(self._key(dest.name, MANIFEST_NAME)))
        self.abort(dest)

    def abort(self, dest: Destination) -> None:
        tag = dest.save_id[:16]
        try:
            fs = self._fs()[0]
            for n in self._ls(dest.name):
                m = _DATA_RE.match(n)
                if m and m.group(2) == tag:
                    fs.rm(self._key(dest.name, n))
        except Exception as e:
            log.warning("could not remove the partial upload under %s: %s", self.path(dest.name), e)

    def _upload_retired(self, name: str, raw: bytes) -> None:
        """Store ``raw`` (a manifest of ``name``) as a retired manifest there, its proof uploaded first."""
        fs = self._fs()[0]
        rid, retired = _retired_name()
        proof = (TMP_DIR, f"retired-{rid}{MARK_SUFFIX}")
        self._retry(f"upload {_join(self.url, *proof)}", lambda: fs.pipe_file(self._key(*proof),
                                                                               _retired_proof(rid, name)))
        self._retry(f"upload {_join(self.url, name, retired)}", lambda: fs.pipe_file(self._key(name, retired), raw))

    def delete_step(self, step: int, saving: Optional[int] = None, live: AbstractSet[str] = frozenset()) -> None:
        """Retire the checkpoint (its manifest kept as a retired one, the checkpoint gone once the manifest is),
        then delete the files it lists that nothing in ``live`` reads: nothing else under its prefix."""
        name = step_name(step)
        raw = self.manifest_bytes(name)
        if raw is None or self.manifest(name) is None:
            log.warning("retention: %s is not a nostall checkpoint: left alone", self.path(name))
            return
        fs = self._fs()[0]
        self._upload_retired(name, raw)
        self._retry(f"delete {self.path(name)}", lambda: fs.rm(self._key(name, MANIFEST_NAME)))
        crash_point("retain.moved", saving)
        self._collect_prefix(name, live)
        log.info("retention: retired %s", self.path(name))

    def sweep(self, dest: Destination) -> None:
        """Delete what earlier saves left: their records, and their data files under ``step_*``
        prefixes that have no manifest. Only nostall's names are touched; safe once this save is
        committed (a manager has one save in flight)."""
        try:
            fs = self._fs()[0]
            for n in self._ls(TMP_DIR):
                m = _OURS_RE.match(n)
                if m is None or m.group(1) != "commit" or m.group(2) == dest.save_id:
                    continue
                for r in self._ls(TMP_DIR, n):
                    if _RECORD_RE.match(r):
                        self._retry(f"delete {n}/{r}", functools.partial(fs.rm, self._key(TMP_DIR, n, r)))
                log.info("removed the records of an earlier save: %s", _join(self.url, TMP_DIR, n))
            committed = set(self.steps())
            for n in self._ls():
                s = parse_step(n)
                if s is None or s in committed or s == dest.step:
                    continue
                kept = {f for _, m in self._retired(n) for f in _listed(m)}  # collect() deletes those
                for f in self._ls(n):
                    if _DATA_RE.match(f) and f not in kept:
                        self._retry(f"delete {n}/{f}", functools.partial(fs.rm, self._key(n, f)))
                        log.info("removed %s, left by an earlier save", _join(self.url, n, f))
        except Exception as e:  # committed; leftovers are only space
            log.warning("could not sweep the leftovers of earlier saves under %s: %s", self.url, e)

    def _retired(self, name: str) -> List[Tuple[str, Manifest]]:
        """The retired manifests under prefix ``name`` that nostall proves it retired (``.tmp/retired-<id>.nostall``
        names each, with its prefix): only those prove the files they list are nostall's."""
        out = []
        for n in self._ls(name):
            if not _RETIRED_RE.match(n):
                continue
            url = _join(self.url, name, n)
            rid = n[len(RETIRED_PREFIX):-len(".json")]
            if self._cat((TMP_DIR, f"retired-{rid}{MARK_SUFFIX}")) != _retired_proof(rid, name):
                log.warning("%s: nostall has no proof that it retired this manifest: left alone, with the files "
                            "it lists", url)
                continue
            try:
                out.append((n, Manifest.from_json_bytes(remote.read_small(url, MANIFEST_PROOF_MAX_BYTES,
                                                                          self.storage_options), url)))
            except (CheckpointError, OSError):
                log.warning("%s is not a nostall manifest: left alone", url)
        return out

    def _collect_prefix(self, name: str, live: AbstractSet[str]) -> None:
        fs = self._fs()[0]
        current = self.manifest(name)
        keep = set(_listed(current)) if current is not None else set()
        for rname, m in self._retired(name):
            left = False
            for f in _listed(m):
                if f"{name}/{f}" in live:
                    left = True
                    continue
                if f in keep:
                    continue
                try:
                    self._retry(f"delete {_join(self.url, name, f)}", functools.partial(fs.rm, self._key(name, f)))
                except FileNotFoundError:
                    pass  # deleted already
            if not left:
                self._retry(f"delete {_join(self.url, name, rname)}", functools.partial(fs.rm, self._key(name, rname)))
                proof = (TMP_DIR, f"retired-{rname[len(RETIRED_PREFIX):-len('.json')]}{MARK_SUFFIX}")
                try:
                    self._retry(f"delete {_join(self.url, *proof)}", functools.partial(fs.rm, self._key(*proof)))
                except FileNotFoundError:
                    pass

    def collect(self, live: AbstractSet[str]) -> None:
        try:
            fs, key = self._fs()
            fs.invalidate_cache()
            for p in self._retry(f"list {self.url}", lambda: fs.glob(f"{key.rstrip('/')}/step_*/{RETIRED_PREFIX}*")):
                name = os.path.basename(os.path.dirname(str(p)))
                if parse_step(name) is not None:
                    self._collect_prefix(name, live)
        except Exception as e:  # committed; leftovers are only space
            log.warning("could not delete the retired files under %s: %s", self.url, e)

    # ------------------------------------------------------------------ records
    def _records(self, dest: Destination, *name: str) -> Tuple[str, ...]:
        return (TMP_DIR, f"commit-{dest.save_id}") + name

    def _pipe(self, parts: Tuple[str, ...], data: bytes, deadline: float, op: str) -> None:
        fs = self._fs()[0]
        url = _join(self.url, *parts)
        self.faults.check(op, url)
        self._retry(f"upload {url}", lambda: fs.pipe_file(self._key(*parts), data), deadline)

    def _cat(self, parts: Tuple[str, ...]) -> Optional[bytes]:
        try:
            return remote.read_small(_join(self.url, *parts), RECORD_MAX_BYTES, self.storage_options)
        except FileNotFoundError:
            return None

    def write_done(self, dest: Destination, rank: int, done: Done, deadline: float) -> None:
        self._pipe(self._records(dest, _done_name(rank)), json.dumps(done.to_doc(), sort_keys=True).encode(),
                   deadline, "record")

    def read_dones(self, dest: Destination, ranks: Iterable[int]) -> Dict[int, Done]:
        try:
            present = set(self._ls(*self._records(dest)))
        except Exception as e:  # a network blip: the caller polls again, within its deadline
            log.debug("listing the records of step %s failed (%s); will look again", dest.step, e)
            return {}
        out = {}
        for r in ranks:
            if _done_name(r) in present:
                raw = self._cat(self._records(dest, _done_name(r)))
                if raw is not None:
                    out[r] = Done.from_doc(_record(raw, _join(self.url, *self._records(dest, _done_name(r)))))
        return out

    def write_outcome(self, dest: Destination, outcome: Outcome, deadline: float) -> None:
        doc = {"ok": outcome.ok, "error": outcome.error}
        self._pipe(self._records(dest, "outcome.json"), json.dumps(doc).encode(), deadline, "outcome")

    def read_outcome(self, dest: Destination) -> Optional[Outcome]:
        try:
            raw = self._cat(self._records(dest, "outcome.json"))
        except Exception as e:
            log.debug("reading the outcome of step %s failed (%s); will look again", dest.step, e)
            return None
        if raw is None:
            return None
        doc = _record(raw, _join(self.url, *self._records(dest, "outcome.json")))
        return Outcome(bool(doc.get("ok")), str(doc.get("error") or ""))

    def drop_records(self, save_id: str) -> None:
        """On object storage rank 0's writer sweeps records after its next commit: no remote call here."""


def open_root(url: str, *, storage_options: Optional[Dict[str, Any]] = None, local_staging: Optional[str] = None,
              timeout: float = 600.0, faults: Optional[Faults] = None) -> Root:
    """The root at ``url``: a directory (:class:`PosixRoot`) or an fsspec URL (:class:`ObjectRoot`)."""
    if remote.is_remote(url):
        return ObjectRoot(url, storage_options=storage_options, local_staging=local_staging, timeout=timeout,
                          faults=faults)
    return PosixRoot(url, faults=faults)


def split_checkpoint(path: str, storage_options: Optional[Dict[str, Any]] = None, *,
                     local_staging: Optional[str] = None, timeout: float = 600.0,
                     faults: Optional[Faults] = None) -> Tuple[Root, str]:
    """(root, name) of a checkpoint given by its own location (``.../step_100``, a one-shot directory,
    a directory its caller names)."""
    if remote.is_remote(path):
        url = str(path).rstrip("/")
        parent, _, name = url.rpartition("/")
        return ObjectRoot(parent, storage_options=storage_options, local_staging=local_staging, timeout=timeout,
                          faults=faults), name
    full = os.path.abspath(os.fspath(path))
    return PosixRoot(os.path.dirname(full), detached=True, faults=faults), os.path.basename(full)


def resolve(location: str, step: Optional[int] = None, *,
            storage_options: Optional[Dict[str, Any]] = None) -> Tuple[Root, str, Optional[int]]:
    """(root, name, step) of the checkpoint a user names: ``location`` itself when it is a
    checkpoint (step None), else the checkpoint ``step`` of the root ``location`` (None: the
    one ``latest_step()`` names, as a manager's ``load()`` would).

    Raises :class:`~nostall.CheckpointNotFoundError` naming what was looked for.
    """
    if step is None:
        root, name = split_checkpoint(location, storage_options)
        if root.has_manifest(name):  # a checkpoint (reading it says whether it is a sound one)
            return root, name, None
    root = open_root(location, storage_options=storage_options)
    if step is None:
        step = root.latest_step()
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint at {root.url}: it is not a committed checkpoint "
                                          f"(no {MANIFEST_NAME} there: an interrupted save?) nor a run root holding "
                                          "one (no step_<N> in it)")
    if not root.is_checkpoint(step_name(step)):
        raise CheckpointNotFoundError(f"{root.path(step_name(step))} is not a committed checkpoint: no "
                                      f"checkpoint of step {step} (committed steps: {root.steps()})")
    return root, step_name(step), step
