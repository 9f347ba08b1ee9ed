"""Reading a checkpoint's data files and checking what was read, without torch.

* :func:`open_files` gives the data-file source of a checkpoint (:class:`DataFiles`, over its
  :class:`~nostall.storage.root.Root`, whatever the storage);
* :class:`Verifier` checks blocks against their checksums (:func:`check_blocks`) in a thread
  while the next bytes are read.

The torch side of reading (planning reads into tensors and performing them) is
:mod:`nostall.loading.engine`'s; ``check_checkpoint`` (:mod:`nostall.loading.verify`) and
``nostall copy`` (:mod:`nostall.interop.copy`) read through here without torch.
"""

from __future__ import annotations

import bisect
import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from nostall.core.format import MANIFEST_NAME, Manifest, PieceRecord, TensorRecord, crc
from nostall.errors import CheckpointCorruptError
from nostall.storage.locate import split_checkpoint
from nostall.storage.root import Root, StoredFile

READ_CHUNK = 64 << 20
"""Bytes read at a time by whole-file passes (:func:`verify_window`)."""


def verify_window(bs: int) -> int:
    """Bytes read at a time by ``check_checkpoint`` and ``nostall copy``: about :data:`READ_CHUNK`, a whole
    number of blocks."""
    return max(1, READ_CHUNK // bs) * bs


class DataFiles:
    """The data files of one checkpoint, read through its root: each opened on first use, checked against the
    manifest's size, and kept open (a descriptor on a filesystem) until :meth:`close`.

    Names are the manifest's: its own files, and ``<checkpoint>/<file>`` of an earlier checkpoint (incremental).
    """

    def __init__(self, root: Root, checkpoint: str, manifest: Manifest, timeout: Optional[float] = None) -> None:
        self.root = root
        self.checkpoint = checkpoint
        self.sizes = {n: f.size for n, f in manifest.all_files().items()}
        self.timeout = timeout
        self.open: Dict[str, StoredFile] = {}
        self.bytes_read = 0  # from storage, by :meth:`read`
        self._received: Dict[str, List[Tuple[int, int, memoryview]]] = {}  # file -> (start, end, bytes), by start
        self._starts: Dict[str, List[int]] = {}  # file -> the starts of ``_received[file]``, in the same order
        self.bytes_received = 0  # served from what other ranks sent

    def path(self, name: str) -> str:
        """Where the file ``name`` is (for messages)."""
        return self.root.path(self.root.ref_of(self.checkpoint, name))

    def check(self, name: str) -> StoredFile:
        """The file ``name``, opened; raises :class:`~nostall.CheckpointCorruptError` naming it when it is not
        there as listed (missing, not a regular file or behind a link, of another size)."""
        f = self.open.get(name)
        if f is None:
            if "/" in name and name.split("/")[0] == self.checkpoint:
                # (the manifest's rule refuses its own step; this is a directory renamed after its commit)
                raise CheckpointCorruptError(
                    f"{self.root.path(f'{self.checkpoint}/{MANIFEST_NAME}')}: referenced file {name!r} is in this "
                    "checkpoint's own directory, not an earlier checkpoint's; the manifest is damaged: restore it "
                    "or load another checkpoint")
            f = self.root.open_file(self.checkpoint, name, self.sizes[name], self.timeout)
            self.open[name] = f
        return f

    def absent(self) -> Dict[str, str]:
        """The data files of the manifest that are not there as listed, each with why (missing, not a regular file
        or behind a link, of another size): each opened and checked as a read opens it, nothing read; those
        there stay open for the load (:meth:`close`)."""
        out: Dict[str, str] = {}
        for name in sorted(self.sizes):
            try:
                self.check(name)
            except CheckpointCorruptError as e:
                out[name] = str(e)
        return out

    def keep(self, name: str, start: int, data: memoryview, received: bool) -> None:
        """Serve bytes ``[start, start + len(data))`` of ``name`` from ``data`` instead of storage: bytes
        ``received`` from the rank that read them (:mod:`nostall.loading.peers`, counted in
        :attr:`bytes_received`), or read here already (to send them to others)."""
        if received:
            self.bytes_received += len(data)
        starts = self._starts.setdefault(name, [])
        i = bisect.bisect_right(starts, start)  # after any range of the same start, as kept first
        starts.insert(i, start)
        self._received.setdefault(name, []).insert(i, (start, start + len(data), data))

    def read(self, name: str, offset: int, length: int, into: Optional[memoryview] = None) -> memoryview:
        """Exactly ``length`` bytes of ``name`` at ``offset`` (into ``into`` when given): from what was received,
        the rest from storage (counted in :attr:`bytes_read`)."""
        ranges = self._received.get(name)
        if not ranges:
            self.bytes_read += length
            return self.check(name).read(offset, length, into)
        out = into if into is not None else memoryview(bytearray(length))
        pos, end = offset, offset + length
        i = max(0, bisect.bisect_right(self._starts[name], pos) - 1)  # the last range starting at or before pos
        while pos < end:
            s, e, data = ranges[i] if i < len(ranges) else (end, end, memoryview(b""))
            if e <= pos:
                i += 1
            elif s > pos:  # not received: from storage
                stop = min(s, end)
                self.bytes_read += stop - pos
                self.check(name).read(pos, stop - pos, out[pos - offset: stop - offset])
                pos = stop
            else:
                stop = min(e, end)
                out[pos - offset: stop - offset] = data[pos - s: stop - s]
                pos = stop
        return out

    def read_into(self, name: str, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill ``bufs`` with the consecutive bytes of ``name`` from ``offset`` on: one gathered read from storage
        (:meth:`StoredFile.read_into <nostall.storage.root.StoredFile.read_into>`), or buffer by buffer
        (:meth:`read`) when some of it was received."""
        if self._received.get(name):
            for b in bufs:
                self.read(name, offset, len(b), into=b)
                offset += len(b)
            return
        self.bytes_read += sum(len(b) for b in bufs)
        self.check(name).read_into(offset, bufs)

    def close(self) -> None:
        """Close every opened file and let go of the bytes kept (:meth:`keep`)."""
        for f in self.open.values():
            f.close()
        self.open.clear()
        self._received.clear()
        self._starts.clear()


def open_files(path: str, m: Manifest, storage_options: Optional[Dict[str, Any]] = None,
               timeout: Optional[float] = None) -> DataFiles:
    """The data-file source of the checkpoint at ``path`` (manifest ``m``); the caller closes it.

    ``timeout``: object storage only, the hard bound of each ranged read (retries included).
    """
    root, name = split_checkpoint(path, storage_options)
    return DataFiles(root, name, m, timeout)


def check_blocks(buf: memoryview, first_block: int, piece: PieceRecord, rec: TensorRecord, path: str,
                 bs: int) -> None:
    """Raise :class:`~nostall.CheckpointCorruptError` at the first block of ``buf`` (block ``first_block`` of
    ``piece`` onwards) whose checksum does not match."""
    check_piece_blocks(buf, first_block, piece, rec.key, path, bs)


def check_piece_blocks(buf: memoryview, first_block: int, piece: PieceRecord, key: str, path: str, bs: int) -> None:
    """:func:`check_blocks` for the piece of ``key``."""
    for i in range(0, len(buf), bs):
        b = first_block + i // bs
        if crc(buf[i : i + bs]) != piece.crc32c[b]:
            lo = piece.start + b * bs
            hi = min(lo + bs, piece.end)
            raise CheckpointCorruptError(
                f"{path}: checksum mismatch in bytes [{lo}, {hi}) (key {key!r}, piece at "
                f"offset {list(piece.offset)}): the file is corrupt"
            )


def check_range(data: memoryview, lo: int, pieces: Sequence[Tuple[str, PieceRecord]], path: str, bs: int) -> None:
    """Check ``data``, the bytes of a data file from ``lo`` on, against ``pieces`` ((key, piece) of that file): every
    checksum block of each piece that lies whole inside it (a block the range cuts is not the range's to check);
    raises :class:`~nostall.CheckpointCorruptError` at the first mismatch."""
    hi = lo + len(data)
    for key, p in pieces:
        first = max(0, -(-(lo - p.start) // bs))  # the first block starting at or after lo
        last = (min(hi, p.end) - p.start) // bs  # blocks before it end inside the range
        if min(hi, p.end) == p.end and p.end > p.start:
            last = -(-(p.end - p.start) // bs)  # the piece's last, short block ends with it
        if last > first:
            a = p.start + first * bs
            b = min(p.start + last * bs, p.end)
            check_piece_blocks(data[a - lo: b - lo], first, p, key, path, bs)


Blocks = Tuple[memoryview, int, PieceRecord, TensorRecord, str]
"""Bytes to check: the buffer, its first block in the piece, the piece, its record, the file's path."""


def check_all(parts: Sequence[Blocks], bs: int) -> None:
    """:func:`check_blocks` of each of ``parts``."""
    for buf, first_block, piece, rec, path in parts:
        check_blocks(buf, first_block, piece, rec, path, bs)


class Verifier:
    """Checks blocks against their checksums in one thread while the next bytes are read.

    At most ``depth`` buffers wait at a time (a buffer stays referenced until
    checked). :meth:`finish` waits for every check and raises the first
    mismatch; a load returns only after it. ``enabled=False`` checks nothing.
    """

    def __init__(self, enabled: bool, depth: int = 4) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nostall-verify") if enabled else None
        self._pending: Deque["Future[None]"] = collections.deque()
        self._depth = depth

    def check(self, buf: memoryview, first_block: int, piece: PieceRecord, rec: TensorRecord, path: str,
              bs: int) -> None:
        self.check_all([(buf, first_block, piece, rec, path)], bs)

    def check_all(self, parts: Sequence[Blocks], bs: int) -> "Optional[Future[None]]":
        """Check ``parts`` (one task); the task's future (done once its buffers are free), None when nothing is
        checked."""
        if self._pool is None or not parts:
            return None
        while len(self._pending) >= self._depth:
            self._pending.popleft().result()
        fut = self._pool.submit(check_all, parts, bs)
        self._pending.append(fut)
        return fut

    def finish(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Verifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
