"""The read engine: plan reads of saved pieces, execute them, verify every byte read.

Every reader of tensor data goes through here: :func:`nostall.loading.reader.load_state` and
``check_checkpoint``, the DCP reader (:mod:`nostall.interop.dcp`), the conversions'
``Source`` (:mod:`nostall.interop._common`) and ``nostall copy`` (:mod:`nostall.interop.copy`).

* :func:`open_files` gives the data-file source of a checkpoint (:class:`DataFiles`, over its
  :class:`~nostall.storage.root.Root`, whatever the storage);
* :func:`plan_reads` turns a destination region into :class:`Read` s of the pieces it
  intersects (resharding by box intersection); :func:`unique_reads` drops repeats;
* :func:`execute` performs one :class:`Read` into its destination, handing what it read to a
  :class:`Verifier`, which checks checksums in a thread while the next bytes are read.

Reads are aligned to checksum blocks, so every byte used is verified; a piece needed whole lands
straight in the destination tensor (no extra copy).
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from nostall.core.dtypes import torch_dtype
from nostall.core.format import MANIFEST_NAME, Manifest, PieceRecord, TensorRecord, crc
from nostall.core.model import numel
from nostall.core.tensorbuf import byte_view
from nostall.errors import CheckpointCorruptError
from nostall.storage.locate import split_checkpoint
from nostall.storage.root import Root, StoredFile

Shape = Tuple[int, ...]
READ_CHUNK = 64 << 20
"""Bytes read at a time where a read is not straight into its destination."""
VERIFY_WINDOW = 16 << 20
"""Whole-piece reads go in windows of this size, each checked while the next is read."""


def verify_window(bs: int) -> int:
    """Bytes read at a time by ``check_checkpoint`` and ``nostall copy``: about :data:`READ_CHUNK`, a whole
    number of blocks."""
    return max(1, READ_CHUNK // bs) * bs


@dataclass
class Read:
    """One read: the region ``box_off`` + ``box_shape`` (global coordinates, inside ``piece``) of ``rec``."""

    rec: TensorRecord
    piece: PieceRecord
    box_off: Shape  # global offset of the region to read (inside the piece)
    box_shape: Shape
    dest: torch.Tensor  # view of the destination covering exactly the region


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

    def read(self, name: str, offset: int, length: int, into: Optional[memoryview] = None) -> memoryview:
        """Exactly ``length`` bytes of ``name`` at ``offset`` (into ``into`` when given)."""
        return self.check(name).read(offset, length, into)

    def close(self) -> None:
        for f in self.open.values():
            f.close()
        self.open.clear()


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
    for i in range(0, len(buf), bs):
        b = first_block + i // bs
        if crc(buf[i : i + bs]) != piece.crc32c[b]:
            lo = piece.start + b * bs
            hi = min(lo + bs, piece.end)
            raise CheckpointCorruptError(
                f"{path}: checksum mismatch in bytes [{lo}, {hi}) (key {rec.key!r}, piece at "
                f"offset {list(piece.offset)}): the file is corrupt"
            )


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
        if self._pool is None:
            return
        while len(self._pending) >= self._depth:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(check_blocks, buf, first_block, piece, rec, path, bs))

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


def execute(r: Read, files: DataFiles, m: Manifest, checks: Verifier) -> None:
    """Perform the read ``r`` into ``r.dest``: straight into it when it is the whole piece in CPU memory,
    else in row spans of about :data:`READ_CHUNK`; every block read goes to ``checks``."""
    piece = r.piece
    if numel(r.box_shape) == 0:
        return
    dtype = torch_dtype(r.rec.dtype)
    dest = r.dest
    if r.box_shape == piece.shape and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype:
        _read_whole(r, files, m.block_size, checks)
        return
    path = files.path(piece.file)
    bs, isz = m.block_size, dtype.itemsize
    pshape = piece.shape
    nd = len(pshape)
    strides = [1] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * pshape[d + 1]
    loc = [b - p for b, p in zip(r.box_off, piece.offset)]
    if nd == 0:
        rows = [(0, 1)]
    else:
        per = max(1, READ_CHUNK // max(1, strides[0] * isz))
        rows = [(a, min(a + per, loc[0] + r.box_shape[0])) for a in range(loc[0], loc[0] + r.box_shape[0], per)]
    for a, b in rows:
        if nd == 0:
            first, last = 0, 1
        else:
            first = a * strides[0] + sum(loc[d] * strides[d] for d in range(1, nd))
            last = (b - 1) * strides[0] + sum((loc[d] + r.box_shape[d] - 1) * strides[d] for d in range(1, nd)) + 1
        lo = (first * isz) // bs * bs
        hi = min(-(-(last * isz) // bs) * bs, piece.nbytes)
        buf = files.read(piece.file, piece.start + lo, hi - lo)
        checks.check(buf, lo // bs, piece, r.rec, path, bs)
        flat = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
        if nd == 0:
            src = flat.reshape(())
            dst = dest
        else:
            src = flat.as_strided((b - a,) + tuple(r.box_shape[1:]), strides, first - lo // isz)
            dst = dest.narrow(0, a - loc[0], b - a)
        dst.copy_(src)


def _read_whole(r: Read, files: DataFiles, bs: int, checks: Verifier) -> None:
    """A whole piece straight into its contiguous CPU destination, in windows checked while the next is read."""
    piece = r.piece
    path = files.path(piece.file)
    buf = byte_view(r.dest)
    window = max(bs, VERIFY_WINDOW // bs * bs)  # whole blocks, so each window checks on its own
    for lo in range(0, piece.nbytes, window):
        part = buf[lo : min(lo + window, piece.nbytes)]
        files.read(piece.file, piece.start + lo, len(part), into=part)
        checks.check(part, lo // bs, piece, r.rec, path, bs)


def plan_reads(rec: TensorRecord, dest: torch.Tensor, off: Shape, out: List[Read]) -> None:
    """Append to ``out`` the reads filling ``dest`` (global region ``off`` + dest.shape) from ``rec``'s pieces."""
    shape = tuple(dest.shape)
    if numel(shape) == 0:
        return
    for p in rec.pieces:
        lo = tuple(max(a, b) for a, b in zip(off, p.offset))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(off, shape, p.offset, p.shape))
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        box = tuple(h - l for l, h in zip(lo, hi))
        view = dest
        for d, (l, n) in enumerate(zip(lo, box)):
            view = view.narrow(d, l - off[d], n)
        out.append(Read(rec, p, lo, box, view))


def unique_reads(reads: List[Read]) -> List[Read]:
    """``reads`` without repeats: a read of the same saved bytes into the same memory as an earlier one.

    A tied model (one Parameter under two keys) saved with tied keys gives two reads per piece that
    are the same read; one is enough.
    """
    seen = set()
    out = []
    for r in reads:
        d, p = r.dest, r.piece
        ident = (str(d.device), d.dtype, d.data_ptr(), tuple(d.shape), tuple(d.stride()),
                 p.file, p.start, p.end, p.crc32c, r.box_off, r.box_shape)
        if ident not in seen:
            seen.add(ident)
            out.append(r)
    return out


def in_file_order(reads: List[Read]) -> List[Read]:
    """``reads`` sorted by file and offset (each file read front to back)."""
    return sorted(reads, key=lambda r: (r.piece.file, r.piece.start))
