"""Writing one rank's data files: checksums beside the writes, and incremental saves.

A save job's files arrive as bytes in planned file order: each file's
safetensors header, then its pieces, whole (a synchronous save, or a staging
area holding every file) or in segments (chunk by chunk, under a host-memory
budget). :class:`_FileOut` writes one file from them; :func:`write_files` and
the writer's chunked path (``nostall.saving.writer``) feed it.

*Incremental saves* (``SaveJob.incremental``): every piece gets an xxh3-128
digest (:data:`nostall.core.format.DIGEST_ALGORITHM`), taken here, in the process
that writes (the background writer for an async save: the trainer's stall
does not grow). A piece that is sure to be written (no base, or a *probe* --
a 64-bit hash of three small samples of its bytes, remembered per piece in
:class:`History` -- differs from the base's) is hashed beside its write, in
the checksum thread, so that the digest need not add to the write's time;
only a piece that may be unchanged is hashed before anything is decided.
When the job names a ``base`` -- the rank's previous committed save -- and
:class:`History` holds that save's pieces, a piece whose identity
(file, safetensors entry, dtype, shape) and digest equal the base's is not
written: the manifest points at the bytes already on storage. The file then
holds only the other pieces, packed in planned order after a header laid out
for them (padded to the planned header's length), so it stays a plain
safetensors file. A piece that arrives in several segments is written as it
comes and dropped (the position moved back) if it turns out unchanged.

This module does not import torch (it runs in the writer process).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Tuple

from nostall.storage import files as storage
from nostall.core.format import FileRecord, Placed, block_crcs, content_digest, digest_hasher, parse_file_header
from nostall.core.jobs import Crcs, FileJob, PieceId, PlannedPiece, SaveJob, Written

log = logging.getLogger("nostall")

Parts = Iterable[Tuple[int, memoryview]]
"""(start, bytes) of each piece of a file, in file order."""
FileSource = Callable[[int, FileJob], Tuple[memoryview, Parts]]
"""(index, file) -> (header bytes, its pieces): where a job's bytes come from."""
Writer = Callable[[SaveJob, str, Optional["Base"]], Written]
"""(job, staging directory, base or None) -> what was written: writes every file of the job."""


class Checksums:
    """The block checksums of a job's pieces, computed in one thread beside the writes.

    :meth:`add` hands over a buffer and returns at once; the thread takes its
    CRC32C blocks (the library releases the GIL) while the caller writes the
    same bytes, so a save costs the write, not the write plus a checksum
    pass. A buffer must stay unchanged until :meth:`drain` (or
    :meth:`result`) returns. Use as a context manager: the thread ends on
    exit, also on error.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nostall-checksum")
        self._pending: Dict[PlannedPiece, List["Future[List[int]]"]] = {}

    def __enter__(self) -> "Checksums":
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def add(self, piece: PlannedPiece, buf: memoryview, hasher: Any = None) -> None:
        """Checksum ``buf``, the next bytes of ``piece`` (file, start, end), block-aligned within it.

        ``hasher``: a streaming digest (:func:`~nostall.core.format.digest_hasher`) that the same thread
        also feeds ``buf`` to, in the order of the calls (an incremental save's digest beside the write);
        read it once :meth:`wait` for the piece returns.
        """
        self._pending.setdefault(piece, []).append(self._pool.submit(_sum, buf, self.block_size, hasher))

    def wait(self, piece: PlannedPiece) -> None:
        """Wait until every buffer of ``piece`` handed over so far is checksummed (and hashed)."""
        for f in self._pending.get(piece, []):
            f.result()

    def expect(self, piece: PlannedPiece) -> None:
        """``piece`` is part of the job even if no bytes of it come (an empty piece)."""
        self._pending.setdefault(piece, [])

    def forget(self, piece: PlannedPiece) -> None:
        """``piece`` was dropped (an incremental save found it unchanged): its checksums are not wanted."""
        for f in self._pending.pop(piece, []):
            f.result()  # its buffer stays readable until then

    def drain(self) -> None:
        """Wait until every buffer handed over so far is checksummed (it may then be reused)."""
        for futures in self._pending.values():
            for f in futures:
                f.result()

    def result(self) -> Crcs:
        return {k: tuple(c for f in fs for c in f.result()) for k, fs in self._pending.items()}


def _sum(buf: memoryview, block_size: int, hasher: Any) -> List[int]:
    """The checksum thread's work on one buffer: its digest (when asked), then its CRC32C blocks."""
    if hasher is not None:
        hasher.update(buf)
    return block_crcs(buf, block_size)


_PROBE_SAMPLE = 4 << 10
"""Bytes of each of a probe's three samples (the start, the middle and the end of a piece)."""
_INLINE_MAX = 256 << 10
"""Pieces up to this size are hashed in the writing thread before anything is decided: handing them to the
checksum thread would cost more than hashing them."""


def probe(buf: memoryview) -> int:
    """A 64-bit xxh3 hash of three samples of ``buf`` (its first, middle and last 4 KiB).

    Equal bytes give equal probes, so a probe that differs from the base's proves the piece changed (and
    that it will be written); an equal probe proves nothing (the full digest decides).
    """
    import xxhash

    mv = memoryview(buf).cast("B")
    n = len(mv)
    h = xxhash.xxh3_64()
    if n <= 3 * _PROBE_SAMPLE:
        h.update(mv)
    else:
        mid = (n - _PROBE_SAMPLE) // 2
        for a in (0, mid, n - _PROBE_SAMPLE):
            h.update(mv[a : a + _PROBE_SAMPLE])
    return int(h.intdigest())


class Readback(Protocol):
    """Where an incremental save's writer looks at the stored files it would reference (a
    :class:`nostall.storage.root.Root`)."""

    def identity(self, ref: str) -> Optional[str]:
        """A token of the stored file ``ref`` (``<checkpoint>/<file>``) that changes whenever it is written,
        replaced or renamed over; None when it is not there."""

    def read_into(self, ref: str, start: int, into: memoryview) -> None:
        """Read ``len(into)`` bytes of ``ref`` at ``start`` into ``into``."""


_VERIFY_CHUNK = 16 << 20
Verified = Dict[Tuple[str, int, int], str]
"""Pieces (file, start, end) whose stored bytes were read back and hashed to their digest -> the file's
identity then."""


@dataclass
class Base:
    """The pieces of the committed save a new save may reuse: by identity, where their bytes are
    (``<checkpoint>/<file>`` names), and those files.

    ``store``: where a job looks at the stored bytes. With it, a piece is reused only once they are
    shown intact (:meth:`intact`): read back and hashed to the piece's digest the first time it would
    be referenced, and afterwards as long as its file's identity has not changed since (``verified``,
    kept by :class:`History` across saves). A file damaged, replaced or removed since is never
    referenced again: the piece is written anew, from the trainer's good copy.

    ``probes``: the :func:`probe` of the base's pieces (those it knows), which tell a piece that changed
    before its digest is taken. ``seen``: filled by the job, the probe of each of its pieces (for the
    next save's base). An empty base (no pieces) is what a job with nothing to reuse gets.
    """

    pieces: Dict[PieceId, Placed] = field(default_factory=dict)
    files: Dict[str, FileRecord] = field(default_factory=dict)
    store: Optional[Readback] = None
    verified: Verified = field(default_factory=dict)
    probes: Dict[PieceId, int] = field(default_factory=dict)
    seen: Dict[PieceId, int] = field(default_factory=dict)
    _idents: Dict[str, Optional[str]] = field(default_factory=dict)  # this job's look at each file
    _buf: Optional[memoryview] = None

    def for_job(self, store: Readback, verified: Verified, exclude: str = "") -> "Base":
        """This base for one job, showing what it reuses intact through ``store``; files whose name starts
        with ``exclude`` are not offered."""
        files = {n: f for n, f in self.files.items() if not (exclude and n.startswith(exclude))}
        return Base(self.pieces, files, store, verified, self.probes)

    def may_reuse(self, pid: Optional[PieceId], size: int, probe_: Optional[int]) -> bool:
        """Whether a piece (its id, size and probe, if taken) may turn out unchanged: False when it is sure
        to be written (so that its digest can be taken beside the write)."""
        p = self.pieces.get(pid) if pid is not None else None
        if p is None or p.end - p.start != size or p.file not in self.files:
            return False
        known = self.probes.get(pid) if pid is not None else None
        return known is None or probe_ is None or known == probe_

    def intact(self, p: Placed) -> bool:
        """Whether the stored bytes of ``p`` are what was written there (see the class docstring)."""
        if self.store is None:
            return True
        if p.file not in self._idents:
            try:
                self._idents[p.file] = self.store.identity(p.file)
            except Exception as e:
                log.warning("%s: cannot look at it (%s): writing again what this save would reference there",
                            p.file, e)
                self._idents[p.file] = None
        ident = self._idents[p.file]
        if ident is None:
            log.warning("%s is gone: this save writes again the pieces it would reference there", p.file)
            return False
        key = (p.file, p.start, p.end)
        if self.verified.get(key) == ident:
            return True
        if not self._verify(p):
            return False
        self.verified[key] = ident
        return True

    def _verify(self, p: Placed) -> bool:
        assert self.store is not None
        if self._buf is None:
            self._buf = memoryview(bytearray(min(_VERIFY_CHUNK, max(p.end - p.start, 1))))
        h = digest_hasher()
        try:
            for a in range(p.start, p.end, _VERIFY_CHUNK):
                n = min(_VERIFY_CHUNK, p.end - a)
                if n > len(self._buf):
                    self._buf = memoryview(bytearray(_VERIFY_CHUNK))
                self.store.read_into(p.file, a, self._buf[:n])
                h.update(self._buf[:n])
        except Exception as e:  # unreadable, truncated: not to be relied on
            log.warning("%s: cannot read back bytes [%d, %d) that this save would reference (%s): writing "
                        "them again", p.file, p.start, p.end, e)
            return False
        if h.hexdigest() != p.digest:
            log.warning("%s: bytes [%d, %d) no longer hash to what was written there (damaged or replaced "
                        "since): this save writes them again rather than referencing them", p.file, p.start, p.end)
            return False
        return True


class History:
    """One rank's memory of its last committed incremental save (in the process that writes its saves).

    :meth:`base_for` hands a job the pieces it may reuse, when the job's
    ``base`` is the save remembered; :meth:`committed` replaces the memory
    once a save commits. A process that never saw the base (a writer
    restarted, a sync save after async ones) has nothing to offer: that save
    writes every piece.
    """

    def __init__(self) -> None:
        self.save_id = ""
        self.base = Base()
        self.verified: Verified = {}
        self._handed: Optional[Tuple[str, Dict[PieceId, int]]] = None  # the last job given a base: its probes

    def base_for(self, job: SaveJob) -> Optional[Base]:
        """What ``job`` may reuse: None for a full save; an empty base for an incremental save that has
        nothing to reuse (it writes every piece, and its base collects the probes the next save needs)."""
        if not job.incremental:
            return None
        if job.base and job.base == self.save_id:
            # what it reuses is shown intact first; never a file of the directory this save replaces (a
            # re-saved step): a checkpoint references only files of other checkpoints (docs/format.md)
            base = self.base.for_job(job.dest.root, self.verified, exclude=job.dest.name + "/")
        else:
            base = Base()
        self._handed = (job.save_id, base.seen)  # not the base itself: it may hold a read-back buffer
        return base

    def committed(self, job: SaveJob, done_placed: Dict[PlannedPiece, Placed], files: Dict[str, FileRecord],
                  ids: Dict[PlannedPiece, PieceId]) -> None:
        """Remember ``job``'s pieces (named as in its manifest) as the base of the next save."""
        if not job.incremental:  # a save elsewhere (a directory its caller names) leaves the chain as it is
            return
        name = job.dest.name

        def rel(n: str) -> str:
            return n if "/" in n else f"{name}/{n}"

        pieces = {ids[k]: Placed(rel(p.file), p.start, p.end, p.crc32c, p.digest)
                  for k, p in done_placed.items() if k in ids and p.digest}
        handed, self._handed = self._handed, None
        seen = handed[1] if handed is not None and handed[0] == job.save_id else {}
        self.save_id = job.save_id
        self.base = Base(pieces, {rel(n): FileRecord(rel(n), f.rank, f.size) for n, f in files.items()},
                         probes={k: v for k, v in seen.items() if k in pieces})
        self.verified = {k: v for k, v in self.verified.items() if k[0] in self.base.files}


class _FileOut:
    """One planned data file written from its bytes in file order (see the module docstring).

    :meth:`add` takes the bytes at planned offset ``start`` (the header, or
    all or part of one piece); :meth:`close` finishes the file and says where
    each piece is.
    """

    def __init__(self, job: SaveJob, f: FileJob, staging: str, sums: Checksums, pacer: storage.Pacer,
                 base: Optional[Base]) -> None:
        self.job, self.f, self.sums, self.base = job, f, sums, base
        self.path = os.path.join(staging, f.name)
        self.out = storage.FileWriter(self.path, pacer)
        self.pos = 0  # planned offset expected next
        self.header = bytearray() if job.incremental else None
        self.entries: List[Tuple[Tuple[int, int], str, str, Tuple[int, ...]]] = []  # (planned range, name, ...)
        self.meta: Dict[str, Any] = {}
        self.pi = 0
        self.hasher: Any = None
        self.piece_at = 0  # where the piece being written starts in the output
        self.own: Dict[Tuple[int, int], Tuple[int, int, str]] = {}  # planned range -> (start, end, digest) written
        self.reused: Dict[Tuple[int, int], Placed] = {}
        self.beside: Dict[Tuple[int, int], Any] = {}  # own pieces hashed beside their write -> their hasher
        self.ids: Dict[PlannedPiece, PieceId] = {}

    def __enter__(self) -> "_FileOut":
        return self

    def __exit__(self, *exc: object) -> None:
        self.out.__exit__()

    def add(self, start: int, buf: memoryview) -> None:
        f = self.f
        if start != self.pos:
            raise RuntimeError(f"{self.path}: bytes at planned offset {start} came where {self.pos} was due")
        self.pos += len(buf)
        if start < f.header_size:
            self.out.write(buf)  # the planned header (an incremental save may rewrite it, same length)
            if self.header is not None:
                self.header += buf
                if len(self.header) >= f.header_size:
                    self._parse_header()
            return
        while f.pieces[self.pi][1] <= start:
            self.pi += 1
        piece = f.pieces[self.pi]
        key = (f.name, piece[0], piece[1])
        if self.header is None:  # a full save: write, checksum beside
            self.sums.add(key, buf)
            self.out.write(buf)
            return
        ends_here = start + len(buf) == piece[1]
        if start == piece[0]:
            self.hasher = digest_hasher()
            self.piece_at = self.out.pos
            if ends_here:
                self._whole(piece, key, buf)
                return
        # in segments: written as it comes (hashed beside), dropped at its end if unchanged
        self.sums.add(key, buf, self.hasher)
        self.out.write(buf)
        if ends_here:
            self.sums.wait(key)
            digest = self.hasher.hexdigest()
            ref = self._reusable(piece, digest)
            if ref is not None:
                self.sums.forget(key)
                self.out.seek(self.piece_at)
                self.reused[piece] = ref
            else:
                self.own[piece] = (self.piece_at, self.out.pos, digest)

    def _whole(self, piece: Tuple[int, int], key: PlannedPiece, buf: memoryview) -> None:
        """An incremental save's piece that came whole: left out if unchanged, else written.

        A piece sure to be written (see :meth:`Base.may_reuse`) is hashed by the checksum thread beside
        its write (its digest read in :meth:`close`); any other is hashed first, here.
        """
        pid = self.ids.get(key)
        size = piece[1] - piece[0]
        pr: Optional[int] = None
        if size > _INLINE_MAX:
            pr = probe(buf)
            if pid is not None and self.base is not None:
                self.base.seen[pid] = pr
        if size > _INLINE_MAX and (self.base is None or not self.base.may_reuse(pid, size, pr)):
            self.sums.add(key, buf, self.hasher)
            self.out.write(buf)
            self.own[piece] = (self.piece_at, self.out.pos, "")
            self.beside[piece] = self.hasher
            return
        self.hasher.update(buf)
        digest = self.hasher.hexdigest()
        ref = self._reusable(piece, digest)
        if ref is not None:
            self.reused[piece] = ref
            return
        self.sums.add(key, buf)
        self.out.write(buf)
        self.own[piece] = (self.piece_at, self.out.pos, digest)

    def _parse_header(self) -> None:
        head, data_start = parse_file_header(bytes(self.header or b""), self.path)
        self.meta = head.pop("__metadata__", {})
        for name, e in head.items():
            a, b = e["data_offsets"]
            self.entries.append(((data_start + a, data_start + b), name, e["dtype"], tuple(e["shape"])))
        for rng, name, dtype, shape in self.entries:
            if rng[1] > rng[0]:  # an empty piece is never reused (several may share one range)
                self.ids[(self.f.name, rng[0], rng[1])] = (self.f.name, name, dtype, shape)

    def _reusable(self, piece: Tuple[int, int], digest: str) -> Optional[Placed]:
        if self.base is None:
            return None
        p = self.base.pieces.get(self.ids[(self.f.name, piece[0], piece[1])])
        if p is None or p.digest != digest or p.end - p.start != piece[1] - piece[0] or p.file not in self.base.files:
            return None
        return p if self.base.intact(p) else None

    def close(self) -> Tuple[Dict[Tuple[int, int], Tuple[int, int, str]], Dict[Tuple[int, int], Placed], int]:
        """Finish the file: (own pieces' output ranges and digests, reused pieces, size; 0: no file)."""
        f = self.f
        if self.pos != f.size:
            raise RuntimeError(f"{self.path}: {self.pos} bytes came, the plan says {f.size}")
        if self.header is None:
            size = self.out.finish()
            return {p: (p[0], p[1], "") for p in f.pieces}, {}, size
        for p, h in self.beside.items():  # the digests taken beside the writes
            self.sums.wait((f.name, p[0], p[1]))
            a, b, _ = self.own[p]
            self.own[p] = (a, b, str(h.hexdigest()))
        pos = f.header_size
        for p in f.pieces:  # empty pieces never arrive: place them where the packed order puts them
            if p in self.own:
                pos = self.own[p][1]
            elif p not in self.reused:
                self.own[p] = (pos, pos, content_digest(b""))
                self.sums.expect((f.name, p[0], p[1]))
        if not self.reused:
            return self.own, {}, self.out.finish()
        if all(p in self.reused for p in f.pieces):  # nothing of this file changed: no file at all
            self.out.__exit__()
            os.unlink(self.path)
            return {}, self.reused, 0
        doc: Dict[str, Any] = {}
        for rng, name, dtype, shape in self.entries:
            if rng in self.own:
                a, b, _ = self.own[rng]
                doc[name] = {"dtype": dtype, "shape": list(shape),
                             "data_offsets": [a - f.header_size, b - f.header_size]}
        doc["__metadata__"] = self.meta
        text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        room = f.header_size - 8
        if len(text) > room:  # cannot happen: fewer entries at lower offsets never need more room
            raise RuntimeError(f"{self.path}: the header of the changed pieces needs {len(text)} bytes, {room} planned")
        self.out.write_at(0, struct.pack("<Q", room) + text + b" " * (room - len(text)))
        return self.own, self.reused, self.out.finish()


def collect(job: SaveJob, outs: List[Tuple[FileJob, Tuple[Any, Any, int], Dict[PlannedPiece, PieceId]]],
            crcs: Crcs, base: Optional[Base]) -> Written:
    """What a job wrote, from each file's outcome and the checksums."""
    w = Written()
    for f, (own, reused, size), ids in outs:
        w.ids.update(ids)
        if size:
            w.files[f.name] = FileRecord(f.name, job.rank, size)
        for (s, e), (a, b, digest) in own.items():
            w.placed[(f.name, s, e)] = Placed(f.name, a, b, crcs[(f.name, s, e)], digest)
        for (s, e), ref in reused.items():
            w.placed[(f.name, s, e)] = ref
            assert base is not None
            w.files[ref.file] = base.files[ref.file]
    return w


def write_files(source: FileSource) -> Writer:
    """A :data:`Writer` that writes each file of a job from ``source`` (whole pieces)."""

    def write(job: SaveJob, staging: str, base: Optional[Base]) -> Written:
        pacer = storage.Pacer(job.max_write_rate, job.timeout)
        outs = []
        with Checksums(job.block_size) as sums:
            for i, f in enumerate(job.files):
                header, parts = source(i, f)
                with _FileOut(job, f, staging, sums, pacer, base) as out:
                    out.add(0, memoryview(header))
                    for start, buf in parts:
                        out.add(start, buf)
                    outs.append((f, out.close(), out.ids))
                for s, e in f.pieces:
                    sums.expect((f.name, s, e))  # empty pieces have no bytes
            report_pacing(job, pacer)
            return collect(job, outs, sums.result(), base)

    return write


def report_pacing(job: SaveJob, pacer: storage.Pacer) -> None:
    """Warn when ``max_write_rate`` was lifted so that the save could finish within its timeout."""
    if pacer.lifted:
        log.warning("rank %d: step %s: writing at max_write_rate=%g bytes/s would not finish within half the "
                    "timeout (%gs): the rest was written at full speed; raise max_write_rate or the timeout",
                    job.rank, job.step, pacer.rate, job.timeout)


def file_out(job: SaveJob, f: FileJob, staging: str, sums: Checksums, pacer: storage.Pacer,
             base: Optional[Base]) -> _FileOut:
    """The writer of one planned file, for a caller that feeds it segments itself (the chunked path)."""
    return _FileOut(job, f, staging, sums, pacer, base)
