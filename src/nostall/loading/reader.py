"""Loading: fill a template state from a checkpoint, resharding as needed.

No collective is needed: every rank reads the manifest and, for each tensor of
its template, the byte ranges of the saved pieces that intersect the region it
holds. Reads are aligned to checksum blocks, so every byte used is verified.
A piece needed whole lands straight in the destination tensor (no extra copy).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import stat
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from nostall.storage import remote, files as storage
from nostall.core.tensorbuf import byte_view
from nostall.errors import CheckpointCorruptError, CheckpointError, CheckpointLoadError, CheckpointNotFoundError
from nostall.core.dtypes import torch_dtype
from nostall.core.format import (
    MANIFEST_NAME,
    MAX_HEADER_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_SIDE_FILE_BYTES,
    Manifest,
    PieceRecord,
    SideFileRecord,
    TensorRecord,
    crc,
    parse_file_header,
)
from nostall.core.model import PerRank, ShardedTensor, dtensor_box, is_dtensor, numel, walk, walk_value

log = logging.getLogger("nostall")

Shape = Tuple[int, ...]
_READ_CHUNK = 64 << 20
_VERIFY_WINDOW = 16 << 20  # whole-piece reads go in windows of this size, each checked while the next is read


def read_manifest(path: str, storage_options: Optional[Dict[str, Any]] = None) -> Manifest:
    """The manifest of the committed checkpoint at ``path`` (a directory or an object-storage URL)."""
    if remote.is_remote(path):
        mpath = f"{path.rstrip('/')}/{MANIFEST_NAME}"
        try:
            raw = remote.read_small(mpath, MAX_MANIFEST_BYTES, storage_options)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(_not_a_checkpoint(path, storage_options)) from None
        return Manifest.from_json_bytes(raw, mpath)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}")
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        raw = storage.read_whole(mpath, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(_not_a_checkpoint(path)) from None
    except OSError as e:
        raise CheckpointLoadError(f"{mpath}: cannot read the manifest: {e}") from None
    return Manifest.from_json_bytes(raw, mpath)


def _not_a_checkpoint(path: str, storage_options: Optional[Dict[str, Any]] = None) -> str:
    """Why ``path`` (no manifest) cannot be loaded: a run root (then what to pass), or not a checkpoint."""
    from nostall.storage.locate import open_root

    try:
        root = open_root(path, storage_options=storage_options)
        steps = root.steps()
        latest = root.latest_step()
    except Exception:  # only a better message is at stake
        steps, latest = [], None
    if steps:
        shown = ", ".join(str(s) for s in steps[-5:])
        return (f"{path} is a run root (committed steps: {'..., ' if len(steps) > 5 else ''}{shown}), not a "
                f"checkpoint: pass {path.rstrip('/')}/step_{latest} (its latest), or load the run root with "
                "nostall.load(state, root) or CheckpointManager(root).load(...), which use its latest; "
                "`nostall ls` lists the steps")
    return f"{path} has no {MANIFEST_NAME}: it is not a committed checkpoint (an interrupted save?)"


@dataclass
class _Read:
    rec: TensorRecord
    piece: PieceRecord
    box_off: Shape  # global offset of the region to read (inside the piece)
    box_shape: Shape
    dest: torch.Tensor  # view of the destination covering exactly the region


class _Files:
    """The data files of one local checkpoint, opened on first use and checked against the manifest sizes."""

    def __init__(self, directory: str, manifest: Manifest) -> None:
        self.dir = directory
        self.manifest = manifest
        self.fds: Dict[str, int] = {}

    def path(self, name: str) -> str:
        """Own files are in the checkpoint's directory; ``<checkpoint>/<file>`` in a sibling of it (incremental).

        The sibling is found from the absolute path: a checkpoint given as ``.`` or ``./`` has no parent in
        its name (``dirname`` of it is empty, which would look inside the checkpoint itself)."""
        if "/" in name:
            return os.path.join(os.path.dirname(os.path.abspath(self.dir)), name)
        return os.path.join(self.dir, name)

    def _fd(self, name: str) -> int:
        fd = self.fds.get(name)
        if fd is None:
            path = self.path(name)
            if "/" in name and name.split("/")[0] == os.path.basename(os.path.abspath(self.dir)):
                # (the manifest's rule refuses its own step; this is a directory renamed after its commit)
                raise CheckpointCorruptError(f"{os.path.join(self.dir, MANIFEST_NAME)}: referenced file {name!r} "
                                             "is in this checkpoint's own directory, not an earlier checkpoint's; "
                                             "the manifest is damaged: restore it or load another checkpoint")
            try:
                if "/" in name and not stat.S_ISDIR(os.lstat(os.path.dirname(path)).st_mode):
                    raise OSError(errno.ELOOP, "is not a directory (a symbolic link?): it is not followed",
                                  os.path.dirname(path))
                fd = storage.open_regular(path)
            except FileNotFoundError:
                raise CheckpointCorruptError(f"{path}: data file missing{referenced_hint(name)}") from None
            except OSError as e:
                raise CheckpointCorruptError(f"{path}: cannot open the data file: {e.strerror}") from None
            size = os.fstat(fd).st_size
            want = self.manifest.all_files()[name].size
            if size != want:
                os.close(fd)
                raise CheckpointCorruptError(f"{path}: size {size} bytes, the manifest says {want} (truncated?)")
            self.fds[name] = fd
        return fd

    def read(self, name: str, offset: int, length: int, into: Optional[memoryview] = None) -> memoryview:
        return storage.read_exact(self._fd(name), offset, length, self.path(name), into)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def referenced_hint(name: str) -> str:
    """What to say when a data file ``name`` of a manifest is missing: more when it is an earlier checkpoint's."""
    if "/" not in name:
        return ""
    return (f" (an earlier checkpoint's file that this incremental checkpoint reads unchanged pieces from: the "
            f"checkpoint was copied or moved without its root, or {name.split('/')[0]} was deleted by hand; copy "
            "the whole root, or make a self-contained copy with 'nostall copy' from where the root is whole)")


def referenced_file_problems(path: str, m: Manifest, storage_options: Optional[Dict[str, Any]] = None) -> List[str]:
    """One line, naming the file, for each file of an earlier checkpoint that ``m`` (the manifest of the
    checkpoint at ``path``) reads and that is not there as listed: missing, not a regular file (or behind a
    symbolic link), or of another size. An open and ``fstat`` (a ``stat`` on object storage) per referenced
    file, no data read: the cheap check of ``nostall inspect`` and ``nostall ls``; ``check_checkpoint``
    reads every byte. Errors that are not damage (object storage unreachable) are raised."""
    if not m.references:
        return []
    files = _open_files(path, m, storage_options)
    check = files._check if isinstance(files, remote.RemoteFiles) else files._fd
    problems = []
    try:
        for name in sorted(m.references):
            try:
                check(name)
            except CheckpointCorruptError as e:
                problems.append(str(e))
    finally:
        files.close()
    return problems


def _open_files(path: str, m: Manifest, storage_options: Optional[Dict[str, Any]],
                timeout: Optional[float] = None) -> Any:
    """The data-file source of the checkpoint at ``path``: local files or ranged object reads.

    ``timeout``: object storage only, the hard bound of each ranged read (retries included).
    """
    if remote.is_remote(path):
        return remote.RemoteFiles(path, {n: f.size for n, f in m.all_files().items()}, storage_options, timeout)
    return _Files(path, m)


def _check_blocks(buf: memoryview, first_block: int, piece: PieceRecord, rec: TensorRecord, path: str, bs: int) -> None:
    for i in range(0, len(buf), bs):
        b = first_block + i // bs
        if crc(buf[i : i + bs]) != piece.crc32c[b]:
            lo = piece.start + b * bs
            hi = min(lo + bs, piece.end)
            raise CheckpointCorruptError(
                f"{path}: checksum mismatch in bytes [{lo}, {hi}) (key {rec.key!r}, piece at "
                f"offset {list(piece.offset)}): the file is corrupt"
            )


class _Verifier:
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
        self._pending.append(self._pool.submit(_check_blocks, buf, first_block, piece, rec, path, bs))

    def finish(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "_Verifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _execute(r: _Read, files: Any, m: Manifest, checks: _Verifier) -> None:
    bs = m.block_size
    piece, rec = r.piece, r.rec
    path = files.path(piece.file)
    dtype = torch_dtype(rec.dtype)
    isz = dtype.itemsize
    if numel(r.box_shape) == 0:
        return
    whole = r.box_shape == piece.shape
    dest = r.dest
    if whole and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype:
        buf = byte_view(dest)
        window = max(bs, _VERIFY_WINDOW // bs * bs)  # whole blocks, so each window checks on its own
        for lo in range(0, piece.nbytes, window):
            part = buf[lo : min(lo + window, piece.nbytes)]
            files.read(piece.file, piece.start + lo, len(part), into=part)
            checks.check(part, lo // bs, piece, rec, path, bs)
        return
    pshape = piece.shape
    nd = len(pshape)
    strides = [1] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * pshape[d + 1]
    loc = [b - p for b, p in zip(r.box_off, piece.offset)]
    if nd == 0:
        rows = [(0, 1)]
        row_elems = 1
    else:
        row_elems = strides[0]
        per = max(1, _READ_CHUNK // max(1, row_elems * isz))
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
        checks.check(buf, lo // bs, piece, rec, path, bs)
        flat = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
        if nd == 0:
            src = flat.reshape(())
            dst = dest
        else:
            size = (b - a,) + tuple(r.box_shape[1:])
            src = flat.as_strided(size, strides, first - lo // isz)
            dst = dest.narrow(0, a - loc[0], b - a)
        dst.copy_(src)


def _plan_reads(rec: TensorRecord, dest: torch.Tensor, off: Shape, out: List[_Read]) -> None:
    """Reads filling ``dest`` (global region ``off`` + dest.shape) from ``rec``'s pieces."""
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
        out.append(_Read(rec, p, lo, box, view))


def _unique_reads(reads: List[_Read]) -> List[_Read]:
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


def _writable(addr: int) -> bool:
    """Whether the byte at ``addr`` may be written, found without risking a crash.

    The kernel writes the byte's own value back through a pipe: writing
    read-only memory fails with EFAULT there, where a copy would kill the
    process.
    """
    r, w = os.pipe()
    try:
        os.write(w, ctypes.string_at(addr, 1))
        try:
            os.readv(r, [(ctypes.c_char * 1).from_address(addr)])
        except OSError as e:
            if e.errno == errno.EFAULT:
                return False
            raise
        return True
    finally:
        os.close(r)
        os.close(w)


def _in_files(addrs: List[int]) -> bool:
    """Whether every address of ``addrs`` lies in a mapping of a file (``/proc/self/maps`` names its path).

    Such memory was mapped from a file (``torch.from_file``, ``torch.load(mmap=True)``, safetensors,
    ``mmap.mmap`` of a file), never allocated for a Python object such as ``bytes``. False where
    ``/proc`` cannot tell (not Linux).
    """
    left = sorted(set(addrs))
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:  # "lo-hi perms offset dev inode path", by address
                span, _, rest = line.partition(b" ")
                lo, _, hi = span.partition(b"-")
                if left[0] < int(lo, 16):
                    return False  # in no mapping
                while left and left[0] < int(hi, 16):
                    fields = rest.split(None, 4)
                    if len(fields) < 5 or fields[3] == b"0" or not fields[4].startswith(b"/"):
                        return False  # anonymous memory ([heap], malloc's arenas): anything may live there
                    left.pop(0)
                if not left:
                    return True
    except (OSError, ValueError):
        return False
    return False


def _torch_or_file_memory(dest: torch.Tensor, last: int) -> bool:
    """Whether a CPU tensor's memory is provably for writing into: torch's allocator made it (its storage
    is resizable, or pinned), or a file is mapped there (see :func:`_in_files`).

    A storage over someone else's memory (``torch.frombuffer``, ``torch.from_numpy``, DLPack) may be an
    immutable Python object, a ``bytes`` or a read-only numpy array, whose pages are writable all the
    same: torch only warns when such a tensor is made, and would write into it.
    """
    if dest.untyped_storage().resizable() or _in_files([dest.data_ptr(), last]):
        return True
    try:
        return bool(dest.is_pinned())  # torch's pinned allocator (its storages are not resizable)
    except RuntimeError:  # no accelerator to ask
        return False


def _check_dest(key: str, dest: torch.Tensor) -> None:
    """Refuse a template tensor that cannot receive data: on the meta device, not dense, read-only, or over
    memory that is not provably for writing (see :func:`_torch_or_file_memory`)."""
    if dest.is_meta:
        raise CheckpointLoadError(
            f"key {key!r}: the template's tensor is on the meta device and has no memory to load into; "
            "materialize it first (e.g. module.to_empty(device='cpu') or torch.empty_like(t, device=...)), "
            "then load"
        )
    if dest.layout != torch.strided:
        raise CheckpointLoadError(
            f"key {key!r}: the template's tensor has layout {dest.layout}; nostall loads into dense tensors: "
            "give the template a dense tensor (e.g. torch.empty(shape, dtype=...))"
        )
    if dest.device.type == "cpu" and dest.numel() > 0:
        isz = dest.element_size()
        last = dest.data_ptr() + sum((n - 1) * st for n, st in zip(dest.shape, dest.stride())) * isz + isz - 1
        if not (_writable(dest.data_ptr()) and _writable(last)):
            raise CheckpointLoadError(
                f"key {key!r}: the template's tensor is in read-only memory (e.g. torch.frombuffer over a "
                "read-only mmap); load into writable tensors (e.g. its .clone()) instead"
            )
        if not _torch_or_file_memory(dest, last):
            raise CheckpointLoadError(
                f"key {key!r}: the template's tensor is over memory that torch did not allocate and that maps no "
                "file (torch.frombuffer, torch.from_numpy, DLPack): it may be an immutable object (bytes, a "
                "read-only numpy array) that a load must not change, and nostall cannot tell; load into a tensor "
                "of torch's own memory instead (e.g. its .clone(), then copy it back)"
            )


def _check_tensor(key: str, rec: Optional[TensorRecord], dest: torch.Tensor, gshape: Shape, where: str) -> TensorRecord:
    _check_dest(key, dest)
    if rec is None:
        raise CheckpointLoadError(f"key {key!r}: not in the checkpoint at {where}")
    dtype = torch_dtype(rec.dtype)
    if dest.dtype != dtype:
        raise CheckpointLoadError(f"key {key!r}: the checkpoint holds {dtype}, the template {dest.dtype}")
    if tuple(rec.shape) != tuple(gshape):
        raise CheckpointLoadError(
            f"key {key!r}: the checkpoint holds global shape {list(rec.shape)}, the template {list(gshape)}"
        )
    return rec


def load_state(
    template: Any,
    path: str,
    *,
    rank: int = 0,
    world_size: int = 1,
    verify: bool = True,
    per_rank: str = "error",
    manifest: Optional[Manifest] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    timeout: Optional[float] = None,
) -> Any:
    """Fill ``template`` from the checkpoint at ``path`` and return the restored state.

    ``path`` is a directory or an object-storage URL (``storage_options`` go
    to fsspec); remote data is fetched with one ranged read per needed span,
    each bounded by ``timeout`` seconds (retries included) when given.
    ``per_rank``: ``"error"`` (default) refuses PerRank values when the world
    size differs from the save's; ``"skip"`` leaves them as in the template.

    Tensors are filled in place, as ``load_state_dict`` does, so a load writes
    only into memory it can prove is for writing: a CPU template tensor over
    memory torch did not allocate and that maps no file (``torch.frombuffer``
    over ``bytes``, ``torch.from_numpy``, DLPack: possibly an immutable object
    whose pages are writable all the same) is refused with a
    :class:`~nostall.CheckpointLoadError` naming its key, as is read-only
    memory, before anything is written; load into its ``.clone()`` instead.
    A mapped file (``torch.from_file``, safetensors, ``torch.load(mmap=True)``)
    is written into like any tensor.
    """
    if per_rank not in ("error", "skip"):
        raise ValueError("per_rank must be 'error' or 'skip'")
    m = manifest if manifest is not None else read_manifest(path, storage_options)
    reads: List[_Read] = []

    def visit(kind: str, key: str, v: Any) -> Any:
        if kind == "tensor":
            if isinstance(v, ShardedTensor):
                dest, off, gshape = v.data, tuple(v.global_offset), tuple(v.global_shape)
            elif is_dtensor(v):
                dest, off, gshape, _ = dtensor_box(v, key)
            else:
                dest, off, gshape = v, (0,) * v.dim(), tuple(v.shape)
            rec = _check_tensor(key, m.tensors.get(key), dest, gshape, path)
            _plan_reads(rec, dest, off, reads)
            return v
        if kind == "object":
            if key not in m.objects:
                under = [k for k in m.tensors if k.startswith(key + "/")] if key else []
                if under:
                    raise CheckpointLoadError(
                        f"key {key!r}: the checkpoint at {path} holds tensors under it (e.g. {under[0]!r}) but the "
                        f"template has a {type(v).__name__} value there: give the template the same structure. "
                        "An optimizer's state_dict() is empty until its first step: load a model and optimizer "
                        "with load(model=..., optimizer=...), which needs no preparation"
                    )
                raise CheckpointLoadError(f"key {key!r}: not in the checkpoint at {path}")
            return m.objects[key]
        return _restore_per_rank(key, v)

    def _restore_per_rank(key: str, pr: PerRank) -> Any:
        if m.world_size != world_size:
            if per_rank == "skip":
                return pr.value
            raise CheckpointLoadError(
                f"key {key!r}: PerRank values were saved by {m.world_size} ranks and cannot be restored on "
                f"{world_size}; pass per_rank='skip' to keep the template's values"
            )
        saved = m.per_rank[rank]

        def inner(kind: str, k: str, v: Any) -> Any:
            full = key if not k else f"{key}/{k}"
            if kind == "tensor":
                rec = _check_tensor(full, saved.tensors.get(full), v, tuple(v.shape), f"{path} (rank {rank})")
                _plan_reads(rec, v, (0,) * v.dim(), reads)
                return v
            if kind == "object":
                if full not in saved.objects:
                    raise CheckpointLoadError(f"key {full!r}: not in the checkpoint at {path} (rank {rank})")
                return saved.objects[full]
            raise CheckpointLoadError(f"key {full!r}: PerRank nested inside PerRank")

        return walk_value(pr.value, inner)

    restored = walk(template, visit)
    reads = _unique_reads(reads)
    files = _open_files(path, m, storage_options, timeout)
    checks = _Verifier(verify)
    try:
        reads.sort(key=lambda r: (r.piece.file, r.piece.start))
        with torch.no_grad():
            for r in reads:
                try:
                    _execute(r, files, m, checks)
                except OSError as e:
                    hint = (" (the template's memory is not writable: load into writable tensors)"
                            if e.errno == errno.EFAULT else "")
                    raise CheckpointLoadError(
                        f"key {r.rec.key!r}: reading {files.path(r.piece.file)} into the template failed: "
                        f"{e.strerror or e}{hint}; check the storage and retry"
                    ) from e
                except RuntimeError as e:  # torch refusing the copy (e.g. an expanded template tensor)
                    raise CheckpointLoadError(
                        f"key {r.rec.key!r}: cannot write into the template's tensor: {e}; give the template "
                        "a plain tensor of its own memory (e.g. .clone())"
                    ) from e
            checks.finish()
    finally:
        checks.close()
        files.close()
    return restored


@dataclass
class VerifyReport:
    """What :func:`check_checkpoint` found: every problem, not only the first."""

    path: str
    files: int
    bytes: int
    problems: List[str]
    side_files: int = 0  # side files checked (see docs/format.md, Side files)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_checkpoint(path: str, storage_options: Optional[Dict[str, Any]] = None) -> VerifyReport:
    """Re-read every byte of every data file, check every checksum and header; collect every problem.

    A manifest that cannot be read or parsed raises (nothing else can be
    checked without it); problems in data files are collected, one per file
    that cannot be read and one per damaged piece (with its count of bad
    blocks), and checking goes on with the next piece or file. Every side
    file is checked too (a regular file, its size and crc32c), one problem
    per damaged one.
    """
    m = read_manifest(path, storage_options)
    files = _open_files(path, m, storage_options)
    pieces: Dict[str, List[Tuple[TensorRecord, PieceRecord]]] = {}
    seen = set()
    recs = list(m.tensors.values()) + [t for r in m.per_rank for t in r.tensors.values()]
    for rec in sorted(recs, key=lambda t: bool(t.tied_to)):  # a tied key's pieces are its target's: checked once
        for p in rec.pieces:
            if (p.file, p.start, p.end, p.crc32c) not in seen:
                seen.add((p.file, p.start, p.end, p.crc32c))
                pieces.setdefault(p.file, []).append((rec, p))
    problems: List[str] = []
    total = 0
    try:
        all_files = m.all_files()
        for name in sorted(all_files):
            fpath = files.path(name)
            try:
                head = files.read(name, 0, min(all_files[name].size, 1 << 20))
                header, data_start = _header(head, files, name, all_files[name].size)
            except (CheckpointError, OSError) as e:
                problems.append(str(e))
                continue
            ranges = {}
            for k, v in header.items():
                if k != "__metadata__" and isinstance(v, dict):
                    offs = v.get("data_offsets")
                    if isinstance(offs, list) and len(offs) == 2 and all(isinstance(x, int) for x in offs):
                        ranges[(data_start + offs[0], data_start + offs[1])] = v
            for rec, p in sorted(pieces.get(name, []), key=lambda x: x[1].start):
                h = ranges.get((p.start, p.end))
                shape = h.get("shape") if h is not None else None
                if (h is None or h.get("dtype") != rec.dtype or not isinstance(shape, list)
                        or tuple(shape) != tuple(p.shape)):
                    problems.append(
                        f"{fpath}: safetensors header does not match the manifest for key {rec.key!r} (it says "
                        f"{_header_entry(h)}, the manifest dtype {rec.dtype} shape {list(p.shape)}); the data "
                        "file is damaged or was replaced: restore it from a copy"
                    )
                bad = _bad_blocks(files, p, rec, m.block_size, problems)
                if bad:
                    lo = p.start + bad[0] * m.block_size
                    problems.append(
                        f"{fpath}: checksum mismatch in {len(bad)} of {len(p.crc32c)} block(s) of key {rec.key!r} "
                        f"(piece at offset {list(p.offset)}), the first at bytes "
                        f"[{lo}, {min(lo + m.block_size, p.end)})"
                    )
                total += p.nbytes
    finally:
        files.close()
    for side in sorted(m.side_files.values(), key=lambda r: r.name):
        try:
            read_side_file(path, side, storage_options)
        except (CheckpointError, OSError) as e:
            problems.append(str(e))
    return VerifyReport(path, len(m.all_files()), total, problems, len(m.side_files))


def side_file_location(path: str, name: str) -> str:
    """Where the side file ``name`` of the checkpoint at ``path`` (a directory or URL) is."""
    if remote.is_remote(path):
        return f"{path.rstrip('/')}/{name}"
    return os.path.join(path, *name.split("/"))


def read_side_file(path: str, rec: SideFileRecord, storage_options: Optional[Dict[str, Any]] = None) -> bytes:
    """The content of the side file ``rec`` of the checkpoint at ``path``, checked as docs/format.md says.

    A regular file reached through no symbolic link (nor FIFO, device...), of
    the manifest's size and crc32c; at most :data:`~nostall.core.format.MAX_SIDE_FILE_BYTES`
    bytes are ever read. Raises :class:`~nostall.CheckpointCorruptError` naming
    the file when it is missing or damaged, :class:`~nostall.CheckpointError`
    when it cannot be read.
    """
    url = side_file_location(path, rec.file)
    where = url + (f" (side file {rec.name!r})" if rec.stored else "")
    if rec.size > MAX_SIDE_FILE_BYTES:
        raise CheckpointCorruptError(
            f"{where}: the manifest says this side file holds {rec.size} bytes, more than the "
            f"{MAX_SIDE_FILE_BYTES} a side file may; the manifest is damaged: restore it or load another checkpoint"
        )
    data = _read_side_remote(url, rec, storage_options) if remote.is_remote(path) else _read_side_local(path, rec)
    if crc(data) != rec.crc32c:
        raise CheckpointCorruptError(
            f"{where}: side file checksum mismatch (crc32c {crc(data)}, the manifest says {rec.crc32c}): the "
            "file is damaged or was replaced; restore it from a copy"
        )
    return data


def _side_size_problem(where: str, size: int, rec: SideFileRecord) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where}: side file of {size} bytes, the manifest says {rec.size} (truncated or replaced?); restore it "
        "from a copy"
    )


def _read_side_local(directory: str, rec: SideFileRecord) -> bytes:
    parts = rec.file.split("/")
    where = os.path.join(directory, *parts)
    d = directory
    for c in parts[:-1]:  # the directories on the way: none may be a symbolic link (nothing is followed)
        d = os.path.join(d, c)
        try:
            mode = os.lstat(d).st_mode
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{where}: side file missing (no directory {d})") from None
        except OSError as e:
            raise CheckpointError(f"{where}: cannot check the side file's directory {d}: {e.strerror or e}") from None
        if not stat.S_ISDIR(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
            raise CheckpointCorruptError(f"{where}: side file not reachable: {d} is {what}; checkpoint files must "
                                         "be regular files in plain directories (restore the side file)")
    try:
        fd = storage.open_regular(where)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where}: side file missing") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EINVAL):  # a symbolic link, FIFO, device, directory...
            raise CheckpointCorruptError(f"{where}: side file {e.strerror}") from None
        raise CheckpointError(f"{where}: cannot open the side file: {e.strerror or e}") from None
    try:
        size = os.fstat(fd).st_size
        if size != rec.size:
            raise _side_size_problem(where, size, rec)
        # exactly the manifest's size (at most MAX_SIDE_FILE_BYTES): a file growing meanwhile is not read further
        return bytes(storage.read_exact(fd, 0, rec.size, where))
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read the side file: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _read_side_remote(url: str, rec: SideFileRecord, storage_options: Optional[Dict[str, Any]]) -> bytes:
    where = url + (f" (side file {rec.name!r})" if rec.stored else "")
    try:
        data = remote.read_small(url, MAX_SIDE_FILE_BYTES, storage_options)  # sized first, then bounded
    except CheckpointNotFoundError:
        raise CheckpointCorruptError(f"{where}: side file missing") from None
    except CheckpointError:
        raise
    except Exception as e:  # the back end's own errors (connection, permission...)
        raise CheckpointError(f"{where}: cannot read the side file: {e}") from e
    if len(data) != rec.size:
        raise _side_size_problem(where, len(data), rec)
    return data


def verify_window(bs: int) -> int:
    """Bytes read at a time by :func:`check_checkpoint`: about ``_READ_CHUNK``, a whole number of blocks."""
    return max(1, _READ_CHUNK // bs) * bs


def _bad_blocks(files: Any, p: PieceRecord, rec: TensorRecord, bs: int, problems: List[str]) -> List[int]:
    bad: List[int] = []
    window = verify_window(bs)  # a multiple of the block size: every window starts on a block boundary
    for lo in range(0, p.nbytes, window):
        n = min(window, p.nbytes - lo)
        try:
            buf = files.read(p.file, p.start + lo, n)
        except (CheckpointError, OSError) as e:
            problems.append(f"{e} (key {rec.key!r})")
            return bad
        for i in range(0, n, bs):
            b = (lo + i) // bs
            if crc(buf[i : i + bs]) != p.crc32c[b]:
                bad.append(b)
    return bad


def _header_entry(h: Any) -> str:
    if h is None:
        return "no tensor at that byte range"
    return f"dtype {str(h.get('dtype'))[:40]} shape {str(h.get('shape'))[:80]}"


def _header(head: memoryview, files: Any, name: str, size: int) -> Tuple[Dict[str, Any], int]:
    raw = bytes(head)
    if len(raw) >= 8:
        (n,) = struct.unpack("<Q", raw[:8])
        if 8 + n > len(raw) and n <= MAX_HEADER_BYTES and 8 + n <= size:
            raw = bytes(files.read(name, 0, 8 + n))
    return parse_file_header(raw, files.path(name))
