"""The storage-root interface: every operation nostall makes on a checkpoint root.

A *root* holds a run's checkpoints. Everything above this module (the
manager, the saver, the writer, the CLI, the interop writers, ``Strategy``)
talks to a :class:`Root` and never to ``os`` or fsspec paths directly, and never
asks which kind of root it has (:func:`~nostall.storage.locate.open_root` picks one). There are two
implementations:

* :class:`~nostall.storage.posix.PosixRoot`: a local or shared POSIX filesystem. The commit point is
  the atomic ``rename`` of a save's staging directory to ``step_<N>``; data is
  fsynced before it is renamed, directories after their entries change;
  ``flock`` keeps a second job off the root.
* :class:`~nostall.storage.objects.ObjectRoot`: object storage through fsspec (``s3://`` and others).
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
import json
import logging
import os
import re
import socket
import time
from typing import AbstractSet, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from nostall.core.faults import Faults
from nostall.core.format import Manifest, check_json_cost
from nostall.core.jobs import Destination, Done, Outcome
from nostall.errors import CheckpointCorruptError, CheckpointError

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
OURS_RE = re.compile(rf"^(save|commit|trash|latest)-({_ID})$")
MARK_RE = re.compile(rf"^(save|commit|trash|latest)-({_ID})\.nostall$")
DATA_RE = re.compile(r"^rank(0|[1-9][0-9]*)\.([0-9a-f]{16})\.safetensors$")
RECORD_RE = re.compile(r"^(rank(0|[1-9][0-9]*)\.json|outcome\.json)$")
NONE: Mapping[str, int] = {}
RETIRED_PREFIX = ".retired-"
"""A step directory may hold, besides its checkpoint, *retired manifests* ``.retired-<id>.json``: the
manifests of checkpoints deleted (or replaced) while other retained checkpoints still read some of
their data files (incremental saves). They prove those files are nostall's; each file is deleted once
nothing reads it, and the retired manifest after its last file."""
RETIRED_RE = re.compile(r"^\.retired-([0-9a-f]{16}|[0-9a-f]{32})\.json$")
RETIRED_MARK_RE = re.compile(rf"^retired-({_ID})\.nostall$")
BESIDE_RE = re.compile(rf"^\.(.*)\.nostall-(save|commit|trash)-({_ID})$")
"""What a one-shot save or a directory its caller names (a detached root) makes beside its checkpoint."""


def retired_name() -> Tuple[str, str]:
    """(id, file name) of a new retired manifest: its proof is the mark ``.tmp/retired-<id>.nostall``."""
    rid = os.urandom(16).hex()
    return rid, f"{RETIRED_PREFIX}{rid}.json"


def retired_proof(rid: str, name: str) -> bytes:
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


_OWN_START = (0, "")  # (pid, _start_time(pid)) of this process, read once (a forked child reads its own)


def mark_content(save_id: str) -> bytes:
    """A mark: the entry's id, then who made it (host, pid, process start), for a sweep to tell whether
    the save it belongs to can still be running."""
    global _OWN_START
    pid = os.getpid()
    if _OWN_START[0] != pid:
        _OWN_START = (pid, _start_time(pid))
    return f"{save_id}\n{socket.gethostname()} {pid} {_OWN_START[1]}\n".encode()


def maker_gone(content: bytes) -> bool:
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


def tagged(name: str, save_id: str) -> str:
    """``rank0.safetensors`` -> ``rank0.<save id>.safetensors`` (a side file's folders keep their names)."""
    folder, slash, base = name.rpartition("/")
    stem, dot, ext = base.rpartition(".")
    tagged = f"{stem}.{save_id[:16]}.{ext}" if dot and stem else f"{base}.{save_id[:16]}"
    return f"{folder}{slash}{tagged}"


def listed(m: Manifest) -> List[str]:
    """The files a manifest names in its own directory: data files and side files."""
    return list(m.files) + [f.file for f in m.side_files.values()]


def retired_id(filename: str) -> str:
    """``.retired-<id>.json`` -> ``<id>``."""
    return filename[len(RETIRED_PREFIX):-len(".json")]


def collectable(name: str, retired: List[Tuple[str, Manifest]], current: Optional[Manifest],
                live: AbstractSet[str]) -> List[Tuple[str, List[str], bool]]:
    """Retention's decision for the step directory ``name``, a pure function (the backends only delete).

    For each proven retired manifest ``(where, manifest)``: the files it lists that may go now -- read by
    no retained checkpoint (``live``, ``<checkpoint>/<file>``) and not listed by the checkpoint now there
    (``current``, a re-saved step) -- and whether the retired manifest goes too (none of its files is read).
    """
    keep = set(listed(current)) if current is not None else set()
    out = []
    for where, m in retired:
        files = listed(m)
        out.append((where, [f for f in files if f"{name}/{f}" not in live and f not in keep],
                    not any(f"{name}/{f}" in live for f in files)))
    return out


def step_name(step: int) -> str:
    return f"step_{step}"


def parse_step(name: str) -> Optional[int]:
    """The step of a checkpoint directory's name (exactly ``step_<N>``), else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def done_name(rank: int) -> str:
    return f"rank{rank}.json"


def parse_latest(raw: bytes, where: str) -> Optional[int]:
    try:
        text = raw.decode("ascii").strip()
        step = parse_step(f"step_{text}")
    except UnicodeDecodeError:
        step = None
    if step is None:
        log.warning("%s does not name a step (%r); using the newest committed step", where, raw[:32])
    return step


def record(raw: bytes, where: str) -> Any:
    """A record's JSON, its parse's memory bounded first (a record is small; a hostile one is refused)."""
    check_json_cost(raw, where, "record")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise CheckpointCorruptError(f"{where}: not a JSON record ({e})") from None


def is_nostall_manifest(raw: bytes, where: str) -> bool:
    try:
        Manifest.from_json_bytes(raw, where)
        return True
    except CheckpointError:
        return False


ORPHAN_WAIT_MAX_S = 3600.0
"""The longest a new manager waits for the lock of a root that an orphan writer holds when its record does not say
how long the orphan may live (``life``); see :class:`Claim`."""
ORPHAN_LIFE_MAX_S = 7 * 86400.0
"""The most a lock record's ``life`` is believed (a longer one is cut to this)."""
ORPHAN_WAIT_SLACK_S = 10.0
"""How long past the ``until`` it announced an orphan writer is waited for (its watchdog kills it at ``until``)."""
OWNER_GONE_WAIT_S = 5.0
"""How long a new manager waits for a lock still held after the process its record names exited on this host: the
trainer's orphan writer rewrites the record within 2 s of its trainer's death (then it is waited for, as long as
it promises), or dies with it (then the lock is free)."""


def lock_record(**extra: Any) -> bytes:
    """The record a root's lock file holds: who holds the lock (host, pid, since) and ``extra`` fields."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **extra}).encode()


def _exited(pid: Any) -> bool:
    """Whether process ``pid`` of this host is known to have exited."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, TypeError, OverflowError):
        return False
    return False


def lock_holder(raw: bytes) -> Tuple[str, Optional[float], float]:
    """Who holds a root's lock, from its record; until when it promised to hold it (wall-clock seconds), or None;
    and how long in all a new manager may wait for it (:meth:`Claim.wait_left`).

    An orphan writer finishing its last save promises that (its record has ``writer_of``, ``until`` and ``life``:
    the whole life its job allows). A record naming a process of this host that has exited, its lock still
    held, is most likely that of a trainer that just died whose orphan writer has not rewritten it yet: it is
    waited for :data:`OWNER_GONE_WAIT_S`. Anything else (a live job) promises nothing."""
    try:
        info = json.loads(raw or b"{}")
        owner = f"pid {info['pid']} on host {info['host']} (since {info['since']})"
        if "writer_of" not in info:
            if info["host"] == socket.gethostname() and _exited(info["pid"]):
                return (f"{owner}, which has exited, its lock still held by a process it started (an orphan writer "
                        "that did not say so)", time.time(), OWNER_GONE_WAIT_S)
            return owner, None, 0.0
        until = float(info["until"])
        life = min(float(info["life"]), ORPHAN_LIFE_MAX_S) + ORPHAN_WAIT_SLACK_S if "life" in info \
            else ORPHAN_WAIT_MAX_S
        what = info.get("what") or (f"the background writer (pid {info['pid']} on host {info['host']}) of a "
                                    f"trainer that died (pid {info['writer_of']}), finishing the save of step "
                                    f"{info.get('step')}")  # (what: another process that promises, e.g. a persist)
        return f"{what} until {time.strftime('%H:%M:%S %Z', time.localtime(until))}", until, life
    except (ValueError, KeyError, TypeError, OverflowError):
        return "an unknown process", None, 0.0


class Claim:
    """A root's claim for a manager's lifetime (see :meth:`Root.claim`); ``release()`` ends it.

    ``locked``: the claim holds the root's lock (``fd`` is its descriptor, which a background writer may
    share: :meth:`Root.held_lock`). When refused, ``owner`` names the holder, and ``busy_until`` is when
    the holder promised to be gone (an orphan writer finishing its last save), or None.
    """

    def __init__(self, held: bool, owner: str = "", fd: Optional[int] = None, *, locked: bool = False,
                 busy_until: Optional[float] = None, wait_max: float = ORPHAN_WAIT_MAX_S) -> None:
        self.held = held
        self.owner = owner
        self.locked = locked and fd is not None
        self.busy_until = busy_until
        self.wait_max = wait_max  # the longest worth waiting for the holder in all (from its record)
        self._fd = fd

    def wait_left(self, waited: float) -> float:
        """A refused claim, after ``waited`` seconds of waiting: how much longer it is worth waiting for the
        holder (until the ``busy_until`` it promised + :data:`ORPHAN_WAIT_SLACK_S`, at most ``wait_max`` in all:
        an orphan writer's whole promised life + the slack, :func:`lock_holder`); 0 when the holder promised
        nothing (a live job: refused at once)."""
        if self.held or self.busy_until is None:
            return 0.0
        return max(0.0, min(self.busy_until + ORPHAN_WAIT_SLACK_S - time.time(), self.wait_max - waited))

    @property
    def fd(self) -> Optional[int]:
        """The lock's descriptor while the claim holds it."""
        return self._fd if self.locked else None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock (once no writer process shares it)
            self._fd = None
            self.locked = False


def referenced_hint(name: str) -> str:
    """What to say when a data file ``name`` of a manifest is missing: more when it is an earlier checkpoint's."""
    if "/" not in name:
        return ""
    return (f" (an earlier checkpoint's file that this incremental checkpoint reads unchanged pieces from: the "
            f"checkpoint was copied or moved without its root, or {name.split('/')[0]} was deleted by hand; copy "
            "the whole root, or make a self-contained copy with 'nostall copy' from where the root is whole)")


def side_size_problem(where: str, size: int, want: int) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where}: side file of {size} bytes, the manifest says {want} (truncated or replaced?); restore it "
        "from a copy"
    )


class StoredFile(abc.ABC):
    """A stored file of a checkpoint, opened for ranged reads by :meth:`Root.open_file`; ``close()`` ends it."""

    path: str

    @abc.abstractmethod
    def read(self, offset: int, length: int, into: Optional[memoryview] = None) -> memoryview:
        """Exactly ``length`` bytes at ``offset`` (into ``into`` when given); a short read raises
        :class:`~nostall.CheckpointCorruptError`."""

    def read_into(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill ``bufs`` with the consecutive bytes from ``offset`` on, in one request where the storage can
        (here: one read into a buffer, copied out; a filesystem reads straight into them). A short read raises
        as :meth:`read` does."""
        data = self.read(offset, sum(len(b) for b in bufs))
        at = 0
        for b in bufs:
            b[:] = data[at : at + len(b)]
            at += len(b)

    def close(self) -> None:  # noqa: B027 - optional step, no-op by default
        """Release what the open holds (a descriptor)."""


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
    read_once_pays = False
    """Whether a load over several ranks should read a piece they all need once and pass it on
    (:mod:`nostall.loading.peers`) by default: true where each read costs (object storage); a POSIX root
    may be a local disk whose page cache serves the second reader (``read_once=True`` for a shared one)."""
    """Whether retention and the sweep after a commit may run while the next save is already being
    written: true only where a save in flight writes nowhere they delete (a POSIX root stages in
    ``.tmp/save-<id>/`` and sweeps nothing). Then a background writer reports the commit first."""

    def data_name(self, dest: Destination, name: str) -> str:
        """What the planned data file (or side file) ``name`` is called in the checkpoint: tagged with the
        save's id when ``dest.tagged`` (a re-save of a step never reuses a name that an earlier manifest
        may refer to)."""
        return tagged(name, dest.save_id) if dest.tagged else name

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

    # ------------------------------------------------------------------ a checkpoint's files, for readers
    # (loading, verify, inspect/ls, copy, the DCP reader, export, the reference trainer)
    @staticmethod
    def ref_of(checkpoint: str, name: str) -> str:
        """Where the file ``name`` that the manifest of ``checkpoint`` lists is, as ``<checkpoint>/<file>``:
        its own files are in it, an incremental checkpoint's ``<checkpoint>/<file>`` in that sibling."""
        return name if "/" in name else f"{checkpoint}/{name}"

    @abc.abstractmethod
    def load_manifest_bytes(self, name: str) -> Optional[bytes]:
        """The manifest of the checkpoint ``name`` as a load reads it: at most
        :data:`~nostall.core.format.MAX_MANIFEST_BYTES`, the checkpoint reached as its user named it; None when
        it has none. Raises :class:`~nostall.CheckpointNotFoundError` when ``name`` is no checkpoint directory,
        :class:`~nostall.CheckpointLoadError` when the manifest cannot be read."""

    @abc.abstractmethod
    def open_file(self, checkpoint: str, name: str, size: int, timeout: Optional[float] = None) -> "StoredFile":
        """The data file ``name`` of ``checkpoint``'s manifest (see :meth:`ref_of`), opened for ranged reads and
        checked to be there as listed: a regular file reached through no link, of ``size`` bytes. Raises
        :class:`~nostall.CheckpointCorruptError` naming it when it is not, :class:`~nostall.CheckpointError`
        when the storage cannot tell. ``timeout``: object storage, the bound of each call (retries included)."""

    @abc.abstractmethod
    def read_side(self, checkpoint: str, file: str, size: int, label: str = "") -> bytes:
        """The side file stored as ``file`` in ``checkpoint``: exactly ``size`` bytes (a regular file reached
        through no link, never more read than that). Raises :class:`~nostall.CheckpointCorruptError` when it is
        missing, not a regular file or of another size, :class:`~nostall.CheckpointError` when it cannot be
        read. ``label`` (`` (side file 'x')``) follows the file's location in object storage's messages."""

    def side_location(self, checkpoint: str, file: str) -> str:
        """Where the side file stored as ``file`` in ``checkpoint`` is (for messages)."""
        return self.path(f"{checkpoint}/{file}")

    @abc.abstractmethod
    def read_small(self, name: str, limit: int) -> Optional[bytes]:
        """The small file ``name`` of the root (beside its checkpoints, e.g. a trainer's marker) of at most
        ``limit`` bytes; None when absent. Raises :class:`~nostall.CheckpointCorruptError` when bigger."""

    @abc.abstractmethod
    def write_small(self, name: str, data: bytes, deadline: float) -> None:
        """Replace the small file ``name`` of the root with ``data`` atomically (readers never see half)."""

    @abc.abstractmethod
    def is_file(self, name: str) -> bool:
        """Whether a file (not a directory, not a prefix) named ``name`` is in the root."""

    @abc.abstractmethod
    def entries(self, name: str) -> List[str]:
        """The names directly in ``name`` (a directory's entries; on object storage, what is under the
        prefix ``name/``); empty when nothing is there."""

    @abc.abstractmethod
    def check_present(self) -> None:
        """Raise :class:`~nostall.CheckpointError` naming what is missing when nothing is at the root's
        location (no directory; on object storage, no bucket or no object under the prefix)."""

    # ------------------------------------------------------------------ lifetime
    @abc.abstractmethod
    def claim(self) -> Claim:
        """Rank 0, when a manager opens the root: take it, then remove what crashed saves left."""

    @property
    def orphans_may_finish(self) -> bool:
        """Whether a writer whose trainer died may still finish a job handed over whole here: only where the
        root's lock keeps a restarted job off the root meanwhile (docs/protocol.md, "Lifetime")."""
        return False

    def held_lock(self) -> Optional[int]:
        """The descriptor of this root's lock while this process's claim holds it (None: no such lock).

        Rank 0's background writer gets it when it starts, so that the lock stays held while the
        writer finishes a save its trainer handed over whole after the trainer died
        (docs/protocol.md, "Lifetime"). Never pickled."""
        return None

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
                    references: Mapping[str, int] = NONE) -> None:
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


# =========================================================================== helpers shared by the roots


def lkind(path: str) -> Optional[int]:
    """``st_mode`` of ``path`` itself (never following a link), or None when absent."""
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None

