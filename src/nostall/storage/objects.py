"""A checkpoint root on object storage through fsspec (``s3://`` and others): :class:`ObjectRoot`.

Each rank writes its files to node-local scratch and uploads them; the commit point is the upload
of ``manifest.json``, last. The contract it keeps is :mod:`nostall.storage.root`'s. This module
does not import torch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from typing import AbstractSet, Any, Dict, Iterable, List, Mapping, Optional, Tuple

from nostall.storage import remote
from nostall.core.faults import Faults, crash_point
from nostall.core.format import MANIFEST_NAME, MAX_MANIFEST_BYTES, MAX_SIDE_FILE_BYTES, Manifest
from nostall.core.jobs import Destination, Done, Outcome
from nostall.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CheckpointSaveError
from nostall.storage.root import (
    DATA_RE, LATEST, LATEST_MAX_BYTES, MANIFEST_PROOF_MAX_BYTES, MARK_SUFFIX, NONE, OURS_RE, RECORD_MAX_BYTES,
    RECORD_RE, RETIRED_PREFIX, RETIRED_RE, TMP_DIR, Claim, Root, StoredFile, collectable, done_name, listed, lkind,
    parse_latest, parse_step, record, referenced_hint, retired_id, retired_name, retired_proof, side_size_problem,
    step_name, tagged,
)

log = logging.getLogger("nostall")


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


class ObjectFile(StoredFile):
    """A data file on object storage: each read one ranged GET, retried, bounded by ``timeout`` when given."""

    def __init__(self, fs: Any, key: str, url: str, timeout: Optional[float]) -> None:
        self.fs, self.key, self.path = fs, key, url
        self.timeout = timeout  # hard bound of each call, retries included (None: the back end's timeouts)

    def deadline(self) -> Optional[float]:
        return time.monotonic() + self.timeout if self.timeout is not None else None

    def read(self, offset: int, length: int, into: Optional[memoryview] = None) -> memoryview:
        try:
            data = remote.retry(f"read {self.path} [{offset}, {offset + length})",
                                lambda: self.fs.cat_file(self.key, start=offset, end=offset + length),
                                deadline=self.deadline())
        except Exception as e:
            raise CheckpointError(f"{self.path}: ranged read [{offset}, {offset + length}) failed: {e}") from e
        if len(data) != length:
            raise CheckpointCorruptError(
                f"{self.path}: short read at {offset}: {len(data)} of {length} bytes (truncated?)"
            )
        if into is not None:
            into[:length] = data
            return into
        return memoryview(bytearray(data))


class ObjectRoot(Root):
    """A root on object storage through fsspec; see :mod:`nostall.storage.root`.

    There is no rename: the manifest, uploaded last, is the commit point, and
    a ``step_<N>/`` prefix without one is never listed or loaded. Data file
    names carry the save's id (``rank0.<id>.safetensors``), so re-saving a
    step never touches the files its older manifest names. There is no lock
    either: one job must save to a root at a time.
    """

    read_once_pays = True  # every GET costs: replicas read a piece once and pass it on

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
        return tagged(name, dest.save_id)

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
        return parse_latest(raw, url)

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

    # ------------------------------------------------------------------ a checkpoint's files, for readers
    def load_manifest_bytes(self, name: str) -> Optional[bytes]:
        try:
            return remote.read_small(self.path(f"{name}/{MANIFEST_NAME}"), MAX_MANIFEST_BYTES, self.storage_options)
        except CheckpointNotFoundError:
            return None

    def open_file(self, checkpoint: str, name: str, size: int, timeout: Optional[float] = None) -> StoredFile:
        ref = self.ref_of(checkpoint, name)
        f = ObjectFile(self._fs()[0], self._key(*ref.split("/")), self.path(ref), timeout)
        try:
            got = remote.retry(f"stat {f.path}", lambda: f.fs.size(f.key), deadline=f.deadline())
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{f.path}: data file missing{referenced_hint(name)}") from None
        except Exception as e:
            raise CheckpointError(f"{f.path}: cannot stat the data file: {e}") from e
        if got != size:
            raise CheckpointCorruptError(f"{f.path}: size {got} bytes, the manifest says {size} (truncated?)")
        return f

    def read_side(self, checkpoint: str, file: str, size: int, label: str = "") -> bytes:
        url = self.side_location(checkpoint, file)
        where = url + label
        try:
            data = remote.read_small(url, MAX_SIDE_FILE_BYTES, self.storage_options)  # sized first, then bounded
        except CheckpointNotFoundError:
            raise CheckpointCorruptError(f"{where}: side file missing") from None
        except CheckpointError:
            raise
        except Exception as e:  # the back end's own errors (connection, permission...)
            raise CheckpointError(f"{where}: cannot read the side file: {e}") from e
        if len(data) != size:
            raise side_size_problem(where, len(data), size)
        return data

    def read_small(self, name: str, limit: int) -> Optional[bytes]:
        try:
            return remote.read_small(self.path(name), limit, self.storage_options)
        except CheckpointNotFoundError:
            return None

    def write_small(self, name: str, data: bytes, deadline: float) -> None:
        fs = self._fs()[0]
        self._retry(f"write {self.path(name)}", lambda: fs.pipe_file(self._key(name), data), deadline=deadline)

    def is_file(self, name: str) -> bool:
        return bool(self._fs()[0].isfile(self._key(name)))

    def entries(self, name: str) -> List[str]:
        return self._ls(name)

    def check_present(self) -> None:
        fs, key = self._fs()
        key = key.rstrip("/")
        if fs.exists(key):
            return
        bucket = key.split("/", 1)[0]
        if bucket and bucket != key and not fs.exists(bucket):
            raise CheckpointNotFoundError(f"{self.url}: no such bucket {bucket!r} (or no access to it)")
        raise CheckpointNotFoundError(f"{self.url}: nothing there (no object under this prefix)")

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
            m = OURS_RE.match(n)
            if m and m.group(1) == "save" and stat.S_ISDIR(lkind(os.path.join(parent, n)) or 0):
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
                    references: Mapping[str, int] = NONE) -> None:
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
            kept = {f for _, m in self._retired(dest.name) for f in listed(m)}
            for n in self._ls(dest.name):
                m = DATA_RE.match(n)
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
                m = DATA_RE.match(n)
                if m and m.group(2) == tag:
                    fs.rm(self._key(dest.name, n))
        except Exception as e:
            log.warning("could not remove the partial upload under %s: %s", self.path(dest.name), e)

    def _upload_retired(self, name: str, raw: bytes) -> None:
        """Store ``raw`` (a manifest of ``name``) as a retired manifest there, its proof uploaded first."""
        fs = self._fs()[0]
        rid, retired = retired_name()
        proof = (TMP_DIR, f"retired-{rid}{MARK_SUFFIX}")
        self._retry(f"upload {_join(self.url, *proof)}", lambda: fs.pipe_file(self._key(*proof),
                                                                               retired_proof(rid, name)))
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
                m = OURS_RE.match(n)
                if m is None or m.group(1) != "commit" or m.group(2) == dest.save_id:
                    continue
                for r in self._ls(TMP_DIR, n):
                    if RECORD_RE.match(r):
                        self._retry(f"delete {n}/{r}", functools.partial(fs.rm, self._key(TMP_DIR, n, r)))
                log.info("removed the records of an earlier save: %s", _join(self.url, TMP_DIR, n))
            committed = set(self.steps())
            for n in self._ls():
                s = parse_step(n)
                if s is None or s in committed or s == dest.step:
                    continue
                kept = {f for _, m in self._retired(n) for f in listed(m)}  # collect() deletes those
                for f in self._ls(n):
                    if DATA_RE.match(f) and f not in kept:
                        self._retry(f"delete {n}/{f}", functools.partial(fs.rm, self._key(n, f)))
                        log.info("removed %s, left by an earlier save", _join(self.url, n, f))
        except Exception as e:  # committed; leftovers are only space
            log.warning("could not sweep the leftovers of earlier saves under %s: %s", self.url, e)

    def _retired(self, name: str) -> List[Tuple[str, Manifest]]:
        """The retired manifests under prefix ``name`` that nostall proves it retired (``.tmp/retired-<id>.nostall``
        names each, with its prefix): only those prove the files they list are nostall's."""
        out = []
        for n in self._ls(name):
            if not RETIRED_RE.match(n):
                continue
            url = _join(self.url, name, n)
            rid = n[len(RETIRED_PREFIX):-len(".json")]
            if self._cat((TMP_DIR, f"retired-{rid}{MARK_SUFFIX}")) != retired_proof(rid, name):
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
        for rname, files, done in collectable(name, self._retired(name), self.manifest(name), live):
            for f in files:
                try:
                    self._retry(f"delete {_join(self.url, name, f)}", functools.partial(fs.rm, self._key(name, f)))
                except FileNotFoundError:
                    pass  # deleted already
            if done:
                self._retry(f"delete {_join(self.url, name, rname)}", functools.partial(fs.rm, self._key(name, rname)))
                proof = (TMP_DIR, f"retired-{retired_id(rname)}{MARK_SUFFIX}")
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
        self._pipe(self._records(dest, done_name(rank)), json.dumps(done.to_doc(), sort_keys=True).encode(),
                   deadline, "record")

    def read_dones(self, dest: Destination, ranks: Iterable[int]) -> Dict[int, Done]:
        try:
            present = set(self._ls(*self._records(dest)))
        except Exception as e:  # a network blip: the caller polls again, within its deadline
            log.debug("listing the records of step %s failed (%s); will look again", dest.step, e)
            return {}
        out = {}
        for r in ranks:
            if done_name(r) in present:
                raw = self._cat(self._records(dest, done_name(r)))
                if raw is not None:
                    out[r] = Done.from_doc(record(raw, _join(self.url, *self._records(dest, done_name(r)))))
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
        doc = record(raw, _join(self.url, *self._records(dest, "outcome.json")))
        return Outcome(bool(doc.get("ok")), str(doc.get("error") or ""))

    def drop_records(self, save_id: str) -> None:
        """On object storage rank 0's writer sweeps records after its next commit: no remote call here."""
