"""The memory root of a job on several hosts: a :class:`PosixRoot` whose done records wait for the replica.

docs/protocol.md, "Memory tier", "Several hosts: the commit rule" (steps 2
and 4). Picklable (a rank's writer gets it in its jobs) and torch-free (the
holder uses it too). Three differences from a :class:`PosixRoot`, nothing
else:

- a host's first writer makes the save's staging and records directories in
  its host's memory root when they are missing (only host 0 has rank 0, which
  makes them there before the plan), each with its mark, as rank 0 would;
- a writer's done record is written as ``.tmp/commit-<id>/rank<R>.held``,
  which the commit does not read: the host's holder makes it
  ``rank<R>.json`` on host 0 only once the host's replica is acknowledged;
- the commit checks the data files of the ranks whose files this host holds
  (its own and its source host's): every other rank's record reached host 0
  only after its replica was acknowledged on its peer.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
import uuid
from typing import AbstractSet, Any, Dict, Mapping, Optional, Tuple

from nostall.core.format import MANIFEST_NAME
from nostall.core.jobs import Destination, Done
from nostall.storage import files as storage
from nostall.storage.posix import PosixRoot
from nostall.errors import CheckpointError
from nostall.storage.root import DATA_RE, NONE, RECORD_MAX_BYTES, lkind, record

__all__ = ["MemoryRoot", "HELD"]

HELD = ".held"
_PLAIN_DATA = re.compile(r"^rank(0|[1-9][0-9]*)\.safetensors$")  # a data file's name (untagged)
_MADE_WAIT_S = 10.0  # a host's other writers wait this long for the first one to make the directories


class MemoryRoot(PosixRoot):
    """A memory root on one of several hosts: ``ranks_here`` are the ranks whose data files this host holds
    (its own ranks and its source host's), ``own`` its own ranks."""

    def __init__(self, path: str, own: AbstractSet[int], ranks_here: AbstractSet[int]) -> None:
        super().__init__(path)
        self.own = frozenset(own)
        self.ranks_here = frozenset(ranks_here)

    def __repr__(self) -> str:
        return f"MemoryRoot({self.url!r}, own={sorted(self.own)})"

    # ------------------------------------------------------------------ the host's directories of a save
    def ensure_save(self, dest: Destination) -> None:
        """The save's staging and records directories in this host's memory root, made (marked) when missing;
        when another writer (or the holder) is making them, wait for it (bounded)."""
        self._check_before_save()  # (a fresh memory root has no .tmp yet; and nothing in it is a link)
        for path, records in ((self._tmp("save", dest.save_id, dest.name), False),
                              (self._records(dest.save_id), True)):
            if self._proven(path, dest.save_id) and lkind(path) is not None:
                continue
            try:
                if records:
                    self.make_records(dest)  # (with its outcome slot, as rank 0 makes it on host 0)
                else:
                    self._make_ours(path, dest.save_id)
                continue
            except FileExistsError:
                pass
            deadline = time.monotonic() + _MADE_WAIT_S
            while not (self._proven(path, dest.save_id) and lkind(path) is not None
                       and (not records or lkind(os.path.join(path, "outcome.pending")) is not None
                            or self._outcome_known(path))):
                if time.monotonic() > deadline:
                    raise FileNotFoundError(errno.ENOENT, "another process began making this save's directory and "
                                                          "did not finish", path)
                time.sleep(0.01)

    @staticmethod
    def _outcome_known(records: str) -> bool:
        return any(lkind(os.path.join(records, n)) is not None for n in ("outcome.ok", "outcome.failed"))

    def reserve_done(self, dest: Destination, rank: int) -> None:
        self.ensure_save(dest)
        super().reserve_done(dest, rank)

    def open_staging(self, dest: Destination, rank: int) -> str:
        self.ensure_save(dest)
        return super().open_staging(dest, rank)

    # ------------------------------------------------------------------ records wait for the replica
    def _done_file(self, dest: Destination, rank: int, done: Done) -> Tuple[str, bytes]:
        """This rank's record, held on its host until the host's replica is acknowledged (``rank<R>.held``)."""
        return f"rank{rank}{HELD}", json.dumps({"step": dest.step, "record": done.to_doc()}, sort_keys=True).encode()

    def check_files(self, dest: Destination, files: Mapping[str, int],
                    references: Mapping[str, int] = NONE) -> None:
        """The planned files of the ranks whose files this host holds (a data file names its rank; a side file
        is rank 0's)."""
        def here(name: str) -> bool:
            m = DATA_RE.match(name) or _PLAIN_DATA.match(name)
            return m is None and 0 in self.ranks_here or m is not None and int(m.group(1)) in self.ranks_here

        super().check_files(dest, {n: z for n, z in files.items() if here(n)}, references)

    # ------------------------------------------------------------------ the holder's side
    def held_record(self, save_id: str, rank: int) -> Optional[Tuple[Optional[int], Dict[str, Any]]]:
        """Rank ``rank``'s held record of save ``save_id`` (``rank<R>.held``: the step, the done record's
        document), a failed one for ``rank<R>.failed`` (step None), or None while neither is there."""
        d = self._records(save_id)
        path = os.path.join(d, f"rank{rank}{HELD}")
        try:
            held = record(storage.read_small_file(path, RECORD_MAX_BYTES), path)
        except FileNotFoundError:
            held = None
        except (OSError, CheckpointError) as e:
            return None, {"ok": False, "error": f"rank {rank}: its record {path} cannot be read: {e}"}
        if isinstance(held, dict) and isinstance(held.get("record"), dict):
            step = held.get("step")
            return (step if isinstance(step, int) else None), held["record"]
        if held is not None:
            return None, {"ok": False, "error": f"rank {rank}: its record {path} is not a held done record"}
        if lkind(os.path.join(d, f"rank{rank}.failed")) is not None:
            return None, {"ok": False, "error": f"rank {rank}: its part failed and no record of why could be "
                                                "written (is the memory directory full?)"}
        return None

    def release_record(self, save_id: str, rank: int, doc: Dict[str, Any]) -> None:
        """Make rank ``rank``'s record of save ``save_id`` the one the commit reads (``rank<R>.json``)."""
        d = self._records(save_id)
        if lkind(d) is None:
            raise FileNotFoundError(errno.ENOENT, "the save's records directory is gone", d)
        storage.atomic_write(os.path.join(d, f"rank{rank}.json"), json.dumps(doc, sort_keys=True).encode())

    def announce(self, save_id: str, ok: bool, error: str = "") -> None:
        """Announce a save's outcome in this host's records directory (for its writers), as rank 0's writer does
        on host 0."""
        d = self._records(save_id)
        if lkind(os.path.join(d, "outcome.pending")) is None:
            return
        if not ok:
            try:
                storage.atomic_write(os.path.join(d, "outcome.json"), json.dumps({"error": error}).encode())
            except OSError:
                pass
        os.rename(os.path.join(d, "outcome.pending"), os.path.join(d, "outcome.ok" if ok else "outcome.failed"))

    def outcome_of(self, save_id: str) -> Optional[bool]:
        """The outcome announced in this host's records directory of ``save_id`` (None: none yet)."""
        d = self._records(save_id)
        if lkind(os.path.join(d, "outcome.ok")) is not None:
            return True
        if lkind(os.path.join(d, "outcome.failed")) is not None:
            return False
        return None

    def staging(self, dest: Destination) -> str:
        return self._tmp("save", dest.save_id, dest.name)

    def replica_dir(self, save_id: str) -> str:
        """``.tmp/replica-<id>/``, made with its mark (a replica is received there, then moved into the
        staging)."""
        path = self._tmp("replica", save_id)
        if not (self._proven(path, save_id) and lkind(path) is not None):
            self._make_ours(path, save_id)
        return path

    def manifest_copy(self, manifest: bytes) -> Tuple[str, str]:
        """A host whose memory root lacks a step a restore loads (a replacement host): a directory of its own
        holding only the step's ``manifest`` (marked, under ``.tmp``), this rank's copy of the step for a load
        that takes every piece it lacks from peers. Returns (its path, its id for :meth:`drop_replica_dir`)."""
        self._check_before_save()
        rid = uuid.uuid4().hex
        d = self.replica_dir(rid)
        storage.atomic_write(os.path.join(d, MANIFEST_NAME), manifest)
        return d, rid

    def drop_replica_dir(self, save_id: str) -> None:
        self._remove_ours(self._tmp("replica", save_id), save_id)
