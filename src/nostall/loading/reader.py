"""Loading: fill a template state from a checkpoint, resharding as needed; verify a checkpoint.

No collective is needed: every rank reads the manifest and, for each tensor of
its template, the byte ranges of the saved pieces that intersect the region it
holds. Reads are aligned to checksum blocks, so every byte used is verified.
A piece needed whole lands straight in the destination tensor (no extra copy).
The reads themselves are :mod:`nostall.loading.engine`'s; every file is read
through the checkpoint's :class:`~nostall.storage.root.Root`.
"""

from __future__ import annotations

import ctypes
import functools
import errno
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from nostall.core.dtypes import torch_dtype
from nostall.core.format import (
    MANIFEST_NAME,
    MAX_HEADER_BYTES,
    MAX_SIDE_FILE_BYTES,
    Manifest,
    PieceRecord,
    SideFileRecord,
    TensorRecord,
    crc,
    parse_file_header,
)
from nostall.core.model import PerRank, ShardedTensor, dtensor_box, is_dtensor, walk, walk_value
from nostall.errors import CheckpointCorruptError, CheckpointError, CheckpointLoadError, CheckpointNotFoundError
from nostall.loading import engine
from nostall.loading.engine import DataFiles, Read, Shape, verify_window
from nostall.storage.locate import open_root, split_checkpoint

__all__ = ["VerifyReport", "check_checkpoint", "load_state", "read_manifest", "read_side_file",
           "referenced_file_problems", "side_file_location", "verify_window"]

log = logging.getLogger("nostall")


def read_manifest(path: str, storage_options: Optional[Dict[str, Any]] = None) -> Manifest:
    """The manifest of the committed checkpoint at ``path`` (a directory or an object-storage URL)."""
    root, name = split_checkpoint(path, storage_options)
    raw = root.load_manifest_bytes(name)
    if raw is None:
        raise CheckpointNotFoundError(_not_a_checkpoint(path, storage_options))
    return Manifest.from_json_bytes(raw, root.path(f"{name}/{MANIFEST_NAME}"))


def _not_a_checkpoint(path: str, storage_options: Optional[Dict[str, Any]] = None) -> str:
    """Why ``path`` (no manifest) cannot be loaded: a run root (then what to pass), or not a checkpoint."""
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


def referenced_file_problems(path: str, m: Manifest, storage_options: Optional[Dict[str, Any]] = None) -> List[str]:
    """One line, naming the file, for each file of an earlier checkpoint that ``m`` (the manifest of the
    checkpoint at ``path``) reads and that is not there as listed: missing, not a regular file (or behind a
    symbolic link), or of another size. An open and ``fstat`` (a ``stat`` on object storage) per referenced
    file, no data read: the cheap check of ``nostall inspect`` and ``nostall ls``; ``check_checkpoint``
    reads every byte. Errors that are not damage (object storage unreachable) are raised."""
    if not m.references:
        return []
    files = engine.open_files(path, m, storage_options)
    problems = []
    try:
        for name in sorted(m.references):
            try:
                files.check(name)
            except CheckpointCorruptError as e:
                problems.append(str(e))
    finally:
        files.close()
    return problems


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


def _storage_words(st: torch.UntypedStorage, n: int) -> Tuple[int, ...]:
    """The first ``n`` machine words of a storage's C++ object (``c10::StorageImpl``, at ``st._cdata``)."""
    return tuple((ctypes.c_size_t * n).from_address(st._cdata))


@functools.cache  # the layout of this process's torch: found once
def _cpu_deleter() -> Optional[Tuple[int, int]]:
    """Where a storage's C++ object holds the function that frees its memory, and that of torch's CPU allocator:
    ``(word index, function address)``, or None where this torch's layout is not the one expected.

    No public API tells whose memory a storage is, so this is read from ``c10::StorageImpl``: its
    ``DataPtr`` is the data pointer, then its context and deleter (in the order the C++ library lays out
    a ``unique_ptr``); torch's CPU allocator gives the data pointer as the context. The place is found
    once, by comparing two storages of ``torch.empty`` (same deleter, context = data) with one of
    ``torch.frombuffer`` (another deleter); anything unexpected gives None (and only the public checks
    of :func:`_torch_or_file_memory` are made).
    """
    found = None
    try:
        own = [torch.empty(n, dtype=torch.uint8).untyped_storage() for n in (64, 1 << 16)]
        other = torch.frombuffer(bytearray(64), dtype=torch.uint8).untyped_storage()
        n = 8  # a StorageImpl is larger (vtable, refcounts, DataPtr, size, flags, allocator, ...)
        ws = [_storage_words(x, n) for x in own + [other]]
        for i in range(n - 2):
            if all(w[i] == x.data_ptr() for w, x in zip(ws, own + [other])):
                for d, c in ((i + 2, i + 1), (i + 1, i + 2)):
                    if (all(w[c] == x.data_ptr() for w, x in zip(ws, own)) and ws[0][d] == ws[1][d]
                            and ws[0][d] not in (0, ws[2][d]) and ws[2][d] != 0):
                        found = (d, ws[0][d])
                        break
                break
    except Exception:  # a torch without these attributes, or a storage that cannot be made here
        found = None
    return found


def _torch_or_file_memory(dest: torch.Tensor, last: int) -> bool:
    """Whether a CPU tensor's memory is provably for writing into: torch's allocator made it, or a file is
    mapped there (see :func:`_in_files`).

    Torch's memory is told by its storage: a resizable storage is always torch's allocator's (storages
    over other memory never are); a storage made not resizable since (``Tensor.numpy()``,
    ``np.asarray(t)`` and so ``memoryview(t.numpy())`` mark it so for good, and ``torch.load`` makes its
    storages so) is recognized by the function that frees its memory, torch's CPU allocator's (see
    :func:`_cpu_deleter`); pinned memory is torch's pinned allocator's.

    Still refused: memory torch was handed (``torch.frombuffer``, ``torch.from_numpy`` /
    ``torch.as_tensor`` over an array, DLPack), writable or not. Such a storage may be an immutable
    object, a ``bytes``, a read-only numpy array, an Arrow buffer or a JAX array, whose pages are writable
    all the same (torch only warns when such a tensor is made), and the storage keeps its owner only in
    C++: nothing tells a writable numpy array from a read-only one. Looking for a ``bytes`` object around
    the memory would find one only where the tensor starts at its first byte (not for
    ``frombuffer(b, offset=...)`` or ``np.frombuffer(b, offset=...)``), and the other immutable objects
    have nothing to find, so a load refuses all memory not provably torch's or a file's. Where
    :func:`_cpu_deleter` finds no layout, a storage made not resizable (``.numpy()``, ``torch.load``) is
    refused too.
    """
    st = dest.untyped_storage()
    if st.resizable():
        return True
    slot = _cpu_deleter()
    if slot is not None and _storage_words(st, slot[0] + 1)[slot[0]] == slot[1]:
        return True
    if _in_files([dest.data_ptr(), last]):
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
                "read-only numpy array) that a load must not change, and nostall cannot tell (not even for a "
                "writable numpy array); load into a tensor of torch's own memory instead (e.g. its .clone(), "
                "then copy it back)"
                + ("" if _cpu_deleter() is not None else
                   ". This torch's storages cannot be inspected, so a tensor of torch's memory that .numpy() or "
                   "torch.load made not resizable is refused too")
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
    plan = _TemplatePlan(m, path, rank, world_size, per_rank)
    restored = walk(template, plan.visit)
    files = engine.open_files(path, m, storage_options, timeout)
    try:
        _fill(engine.in_file_order(engine.unique_reads(plan.reads)), files, m, verify)
    finally:
        files.close()
    return restored


class _TemplatePlan:
    """A load's first phase: walk the template (:meth:`visit`), check each key against the manifest ``m``
    and plan the reads of its tensors (:attr:`reads`); nothing is read or written yet."""

    def __init__(self, m: Manifest, path: str, rank: int, world_size: int, per_rank: str) -> None:
        self.m, self.path, self.rank, self.world_size, self.per_rank = m, path, rank, world_size, per_rank
        self.reads: List[Read] = []

    def visit(self, kind: str, key: str, v: Any) -> Any:
        if kind == "tensor":
            if isinstance(v, ShardedTensor):
                dest, off, gshape = v.data, tuple(v.global_offset), tuple(v.global_shape)
            elif is_dtensor(v):
                dest, off, gshape, _ = dtensor_box(v, key)
            else:
                dest, off, gshape = v, (0,) * v.dim(), tuple(v.shape)
            rec = _check_tensor(key, self.m.tensors.get(key), dest, gshape, self.path)
            engine.plan_reads(rec, dest, off, self.reads)
            return v
        if kind == "object":
            return self._object(key, v)
        return self._per_rank(key, v)

    def _object(self, key: str, v: Any) -> Any:
        m, path = self.m, self.path
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

    def _per_rank(self, key: str, pr: PerRank) -> Any:
        m, path, rank = self.m, self.path, self.rank
        if m.world_size != self.world_size:
            if self.per_rank == "skip":
                return pr.value
            raise CheckpointLoadError(
                f"key {key!r}: PerRank values were saved by {m.world_size} ranks and cannot be restored on "
                f"{self.world_size}; pass per_rank='skip' to keep the template's values"
            )
        saved = m.per_rank[rank]

        def inner(kind: str, k: str, v: Any) -> Any:
            full = key if not k else f"{key}/{k}"
            if kind == "tensor":
                rec = _check_tensor(full, saved.tensors.get(full), v, tuple(v.shape), f"{path} (rank {rank})")
                engine.plan_reads(rec, v, (0,) * v.dim(), self.reads)
                return v
            if kind == "object":
                if full not in saved.objects:
                    raise CheckpointLoadError(f"key {full!r}: not in the checkpoint at {path} (rank {rank})")
                return saved.objects[full]
            raise CheckpointLoadError(f"key {full!r}: PerRank nested inside PerRank")

        return walk_value(pr.value, inner)


def _fill(reads: List[Read], files: DataFiles, m: Manifest, verify: bool) -> None:
    """A load's second phase: perform ``reads`` (in file order), every byte verified before it returns."""
    with engine.Verifier(verify) as checks, torch.no_grad():
        for r in reads:
            try:
                engine.execute(r, files, m, checks)
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
    problems: List[str] = []
    total = 0
    pieces = _pieces_by_file(m)
    files = engine.open_files(path, m, storage_options)
    try:
        for name, rec in sorted(m.all_files().items()):
            total += _check_file(files, name, rec.size, pieces.get(name, []), m.block_size, problems)
    finally:
        files.close()
    for side in sorted(m.side_files.values(), key=lambda r: r.name):
        try:
            read_side_file(path, side, storage_options)
        except (CheckpointError, OSError) as e:
            problems.append(str(e))
    return VerifyReport(path, len(m.all_files()), total, problems, len(m.side_files))


def _pieces_by_file(m: Manifest) -> Dict[str, List[Tuple[TensorRecord, PieceRecord]]]:
    """Every distinct piece of ``m`` (and the key that lists it), by data file, in file order."""
    pieces: Dict[str, List[Tuple[TensorRecord, PieceRecord]]] = {}
    seen = set()
    recs = list(m.tensors.values()) + [t for r in m.per_rank for t in r.tensors.values()]
    for rec in sorted(recs, key=lambda t: bool(t.tied_to)):  # a tied key's pieces are its target's: checked once
        for p in rec.pieces:
            if (p.file, p.start, p.end, p.crc32c) not in seen:
                seen.add((p.file, p.start, p.end, p.crc32c))
                pieces.setdefault(p.file, []).append((rec, p))
    return {f: sorted(ps, key=lambda x: x[1].start) for f, ps in pieces.items()}


def _check_file(files: DataFiles, name: str, size: int, pieces: List[Tuple[TensorRecord, PieceRecord]], bs: int,
                problems: List[str]) -> int:
    """Check the data file ``name`` (its header, then every block of ``pieces``) into ``problems``; the tensor
    bytes checked."""
    fpath = files.path(name)
    try:
        head = files.read(name, 0, min(size, 1 << 20))
        header, data_start = _header(head, files, name, size)
    except (CheckpointError, OSError) as e:
        problems.append(str(e))
        return 0
    ranges = {}
    for k, v in header.items():
        if k != "__metadata__" and isinstance(v, dict):
            offs = v.get("data_offsets")
            if isinstance(offs, list) and len(offs) == 2 and all(isinstance(x, int) for x in offs):
                ranges[(data_start + offs[0], data_start + offs[1])] = v
    total = 0
    for rec, p in pieces:
        h = ranges.get((p.start, p.end))
        shape = h.get("shape") if h is not None else None
        if h is None or h.get("dtype") != rec.dtype or not isinstance(shape, list) or tuple(shape) != tuple(p.shape):
            problems.append(
                f"{fpath}: safetensors header does not match the manifest for key {rec.key!r} (it says "
                f"{_header_entry(h)}, the manifest dtype {rec.dtype} shape {list(p.shape)}); the data "
                "file is damaged or was replaced: restore it from a copy"
            )
        bad = _bad_blocks(files, p, rec, bs, problems)
        if bad:
            lo = p.start + bad[0] * bs
            problems.append(
                f"{fpath}: checksum mismatch in {len(bad)} of {len(p.crc32c)} block(s) of key {rec.key!r} "
                f"(piece at offset {list(p.offset)}), the first at bytes [{lo}, {min(lo + bs, p.end)})"
            )
        total += p.nbytes
    return total


def side_file_location(path: str, name: str) -> str:
    """Where the side file ``name`` of the checkpoint at ``path`` (a directory or URL) is."""
    root, ckpt = split_checkpoint(path)
    return root.side_location(ckpt, name)


def read_side_file(path: str, rec: SideFileRecord, storage_options: Optional[Dict[str, Any]] = None) -> bytes:
    """The content of the side file ``rec`` of the checkpoint at ``path``, checked as docs/format.md says.

    A regular file reached through no symbolic link (nor FIFO, device...), of
    the manifest's size and crc32c; at most :data:`~nostall.core.format.MAX_SIDE_FILE_BYTES`
    bytes are ever read. Raises :class:`~nostall.CheckpointCorruptError` naming
    the file when it is missing or damaged, :class:`~nostall.CheckpointError`
    when it cannot be read.
    """
    root, ckpt = split_checkpoint(path, storage_options)
    label = f" (side file {rec.name!r})" if rec.stored else ""
    where = root.side_location(ckpt, rec.file) + label
    if rec.size > MAX_SIDE_FILE_BYTES:
        raise CheckpointCorruptError(
            f"{where}: the manifest says this side file holds {rec.size} bytes, more than the "
            f"{MAX_SIDE_FILE_BYTES} a side file may; the manifest is damaged: restore it or load another checkpoint"
        )
    data = root.read_side(ckpt, rec.file, rec.size, label)
    if crc(data) != rec.crc32c:
        raise CheckpointCorruptError(
            f"{where}: side file checksum mismatch (crc32c {crc(data)}, the manifest says {rec.crc32c}): the "
            "file is damaged or was replaced; restore it from a copy"
        )
    return data


def _bad_blocks(files: DataFiles, p: PieceRecord, rec: TensorRecord, bs: int, problems: List[str]) -> List[int]:
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


def _header(head: memoryview, files: DataFiles, name: str, size: int) -> Tuple[Dict[str, Any], int]:
    raw = bytes(head)
    if len(raw) >= 8:
        (n,) = struct.unpack("<Q", raw[:8])
        if 8 + n > len(raw) and n <= MAX_HEADER_BYTES and 8 + n <= size:
            raw = bytes(files.read(name, 0, 8 + n))
    return parse_file_header(raw, files.path(name))
