"""Helpers shared by the interoperability modules.

* keys: nostall keys <-> their path components, and nested templates from keys;
* :class:`Source`: reads any region of any tensor of a checkpoint, verifying
  the checksum blocks it touches (the loader's own read path);
* :func:`write_checkpoint`: one process writes a whole checkpoint (world size
  1) piece by piece, with the same format and commit rule as a save;
* :class:`Progress`: progress reports for long conversions.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from nostall.core.boxes import cover_problem
from nostall.core.tensorbuf import byte_view
from nostall.saving.solo import save_solo, solo_destination
from nostall.saving.datafiles import write_files
from nostall.core.jobs import FileJob
from nostall.options import check_block_size
from nostall.storage.locate import split_checkpoint
from nostall.errors import CheckpointLoadError, CheckpointSaveError
from nostall.core.format import (
    DEFAULT_BLOCK_SIZE,
    FileEntry,
    FileRecord,
    Manifest,
    PieceRecord,
    RankRecord,
    TensorRecord,
    data_file_name,
    layout_file,
    piece_name,
)
from nostall.loading.engine import Read, SpanBuffers, execute_all, plan_reads
from nostall.loading.manifests import read_manifest
from nostall.loading.sources import Verifier, open_files
from nostall.core.dtypes import torch_dtype
from nostall.core.model import escape_component, numel

log = logging.getLogger("nostall.interop")

Shape = Tuple[int, ...]
ProgressFn = Callable[[int, int], None]
"""progress(done_bytes, total_bytes), called as a conversion advances."""


# --------------------------------------------------------------------------- keys


def split_key(key: str) -> List[str]:
    """The unescaped path components of a nostall key (``a/b~1c`` -> ``["a", "b/c"]``)."""
    if key == "":
        return [""]
    return [c.replace("~1", "/").replace("~0", "~") for c in key.split("/")]


def join_components(parts: Sequence[Any]) -> str:
    """The nostall key of a path (components escaped)."""
    return "/".join(escape_component(p) for p in parts)


def nest(leaves: Dict[str, Any]) -> Dict[str, Any]:
    """A nested dict whose nostall keys are ``leaves``' keys (the inverse of flattening)."""
    root: Dict[str, Any] = {}
    for key, value in leaves.items():
        parts = split_key(key)
        node = root
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"key {key!r} lies under a leaf")
            node = nxt
        if parts[-1] in node:
            raise ValueError(f"key {key!r} given twice")
        node[parts[-1]] = value
    return root


# --------------------------------------------------------------------------- reading


class Source:
    """An open checkpoint: read regions of its tensors, checksums verified.

    Reads go through the loader's planner and executor, so a region costs only
    the checksum blocks that cover it, and every byte used is verified.
    ``read_budget``: the bytes of the span buffers reads go through (see
    :class:`~nostall.loading.engine.SpanBuffers`; None: a load's default),
    kept from read to read and let go by :meth:`close`; an export sets it
    from its memory limit.
    """

    def __init__(self, path: str, *, storage_options: Optional[Dict[str, Any]] = None, verify: bool = True,
                 manifest: Optional[Manifest] = None, read_budget: Optional[int] = None) -> None:
        self.path = path
        self.verify = verify
        self.manifest = manifest if manifest is not None else read_manifest(path, storage_options)
        self.files = open_files(path, self.manifest, storage_options)
        self.spans = SpanBuffers(read_budget)

    def record(self, key: str) -> TensorRecord:
        rec = self.manifest.tensors.get(key)
        if rec is None:
            raise CheckpointLoadError(f"key {key!r}: not in the checkpoint at {self.path}")
        return rec

    def read(self, key: str, offset: Sequence[int], dest: torch.Tensor, *, cast: bool = False) -> None:
        """Fill ``dest`` with the region of tensor ``key`` that starts at ``offset`` (global
        coordinates) and has ``dest``'s shape. ``cast``: allow a dtype other than the stored one."""
        rec = self.record(key)
        off = tuple(int(x) for x in offset)
        shape = tuple(dest.shape)
        if len(off) != len(rec.shape) or len(shape) != len(rec.shape) or any(
            o < 0 or o + s > g for o, s, g in zip(off, shape, rec.shape)
        ):
            raise CheckpointLoadError(
                f"key {key!r}: region at offset {list(off)} of shape {list(shape)} lies outside the stored "
                f"shape {list(rec.shape)} ({self.path})"
            )
        if not cast and dest.dtype != torch_dtype(rec.dtype):
            raise CheckpointLoadError(
                f"key {key!r}: the checkpoint holds {torch_dtype(rec.dtype)}, the destination is {dest.dtype}"
            )
        reads: List[Read] = []
        plan_reads(rec, dest, off, reads)
        with torch.no_grad(), Verifier(self.verify) as checks:
            execute_all(reads, self.files, self.manifest, checks, buffers=self.spans)
            checks.finish()

    def read_new(self, key: str, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        """A new tensor holding the region of ``key`` at ``offset`` with ``shape``."""
        rec = self.record(key)
        out = torch.empty(tuple(shape), dtype=torch_dtype(rec.dtype))
        self.read(key, offset, out)
        return out

    def close(self) -> None:
        self.spans.close()
        self.files.close()

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- progress


class Progress:
    """Counts bytes done; calls ``fn`` on every advance and logs at most every ``every_s`` seconds."""

    def __init__(self, what: str, total: int, fn: Optional[ProgressFn] = None, every_s: float = 10.0) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self.fn = fn
        self.every_s = every_s
        self.t0 = time.monotonic()
        self._last = self.t0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.fn is not None:
            self.fn(self.done, self.total)
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            pct = 100.0 * self.done / self.total if self.total else 100.0
            log.info("%s: %.1f%% (%d of %d bytes, %.1f s)", self.what, pct, self.done, self.total, now - self.t0)

    def finish(self) -> None:
        log.info("%s: done, %d bytes in %.1f s", self.what, self.done, time.monotonic() - self.t0)


# --------------------------------------------------------------------------- writing


@dataclass
class PieceSource:
    """One piece of a tensor to write: its box and how to produce its bytes.

    ``produce()`` returns a contiguous CPU tensor of exactly ``shape`` and the
    tensor's dtype; it is called once, when the piece's turn comes, so only one
    piece is in memory at a time.
    """

    offset: Shape
    shape: Shape
    produce: Callable[[], torch.Tensor]


@dataclass
class TensorSource:
    key: str
    dtype: str  # format code
    shape: Shape
    pieces: List[PieceSource]


def _lay_out(tensors: Sequence[TensorSource]) -> Tuple[List[FileEntry], Dict[str, Tuple[TensorSource, PieceSource]]]:
    """The entries of the one data file, in the tensors' order, and the piece each comes from (by
    entry name). Pieces with no elements are left out; two pieces of a key at one offset are refused."""
    entries: List[FileEntry] = []
    where_of: Dict[str, Tuple[TensorSource, PieceSource]] = {}
    for t in tensors:
        isz = torch_dtype(t.dtype).itemsize
        for p in t.pieces:
            if numel(p.shape) == 0:
                continue
            name = piece_name(t.key, p.offset, p.shape, t.shape)
            if name in where_of:
                raise CheckpointSaveError(f"key {t.key!r}: two pieces at offset {list(p.offset)}")
            entries.append(FileEntry(name, t.dtype, tuple(p.shape), numel(p.shape) * isz))
            where_of[name] = (t, p)
    return entries, where_of


def _tensor_records(dst: str, tensors: Sequence[TensorSource], where: Dict[str, Tuple[int, int]],
                    fname: str) -> Dict[str, TensorRecord]:
    """The manifest's record of each tensor, its pieces where ``where`` lays them out in ``fname``
    (no checksums yet); refused unless the pieces tile the tensor."""
    recs: Dict[str, TensorRecord] = {}
    for t in tensors:
        pieces = []
        for p in t.pieces:
            if numel(p.shape) == 0:
                continue
            s, e = where[piece_name(t.key, p.offset, p.shape, t.shape)]
            pieces.append(PieceRecord(tuple(p.offset), tuple(p.shape), fname, s, e, ()))
        problem = cover_problem(tuple(t.shape), [(p.offset, p.shape) for p in pieces])
        if problem:  # the pieces must tile every tensor
            raise CheckpointSaveError(f"writing {dst}: key {t.key!r}: {problem}")
        whole = len(pieces) == 1 and pieces[0].shape == tuple(t.shape)
        recs[t.key] = TensorRecord(t.key, t.dtype, tuple(t.shape), not whole and bool(t.shape), tuple(pieces))
    return recs


def _parts(order: Sequence[str], where_of: Dict[str, Tuple[TensorSource, PieceSource]],
           where: Dict[str, Tuple[int, int]], progress: Optional[Progress]) -> Iterator[Tuple[int, memoryview]]:
    """Each piece produced, checked and handed over in file ``order``: (offset in the file, bytes)."""
    for name in order:
        t, p = where_of[name]
        data = p.produce()
        if tuple(data.shape) != tuple(p.shape) or data.dtype != torch_dtype(t.dtype):
            raise CheckpointSaveError(
                f"key {t.key!r}: piece at {list(p.offset)} produced {data.dtype} {list(data.shape)}, "
                f"expected {torch_dtype(t.dtype)} {list(p.shape)}"
            )
        data = data.detach().contiguous()
        buf = byte_view(data)
        yield where[name][0], buf
        if progress is not None:
            progress.advance(len(buf))
        del buf, data


def write_checkpoint(dst: str, tensors: Sequence[TensorSource], objects: Dict[str, Any], *,
                     block_size: int = DEFAULT_BLOCK_SIZE, progress: Optional[Progress] = None) -> Manifest:
    """Write a one-shot checkpoint (world size 1) at ``dst``, one piece in memory at a time.

    The data file is laid out from the pieces' metadata first, then each
    piece is produced, checksummed and written in file order by the solo save
    (:func:`nostall.saving.solo.save_solo`: the save job and commit routine
    every save runs), so the checkpoint appears only once complete. Pieces
    with no elements are left out.
    """
    block_size = check_block_size(block_size)
    fname = data_file_name(0)
    entries, where_of = _lay_out(tensors)
    header, where, size = layout_file(entries, {"format": "nostall", "rank": "0", "world_size": "1"})
    order = sorted(where, key=lambda n: where[n][0])
    files = {fname: FileRecord(fname, 0, size)} if entries else {}
    manifest = Manifest(step=None, world_size=1, block_size=block_size, files=files,
                        tensors=_tensor_records(dst, tensors, where, fname), objects=dict(objects),
                        per_rank=(RankRecord({}, {}),))
    root, name = split_checkpoint(os.fspath(dst))
    jobs = (FileJob(fname, 0, size, len(header), tuple(sorted(where.values()))),) if entries else ()
    save_solo(dst, solo_destination(root, name), manifest, jobs,
              write_files(lambda i, f: (memoryview(header), _parts(order, where_of, where, progress))))
    return read_manifest(os.fspath(dst))
