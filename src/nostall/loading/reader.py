"""Loading: fill a template state from a checkpoint, resharding as needed.

No collective is needed: a rank reads the manifest (or is given its share of
it, :mod:`nostall.loading.collective`) and, for each tensor of its template,
the byte ranges of the saved pieces that intersect the region it holds.
Reads are aligned to checksum blocks, so every byte used is verified.
A piece of 1 MiB or more needed whole lands straight in the destination tensor (no extra copy).
The reads themselves are :mod:`nostall.loading.engine`'s; every file is read
through the checkpoint's :class:`~nostall.storage.root.Root` (:mod:`nostall.loading.sources`).
The manifest is :mod:`nostall.loading.manifests`'; ``nostall verify`` is :mod:`nostall.loading.verify`.
"""

from __future__ import annotations

import ctypes
import functools
import errno
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from nostall.core.dtypes import torch_dtype
from nostall.core.format import Manifest, TensorRecord, gc_paused
from nostall.core.model import PerRank, ShardedTensor, dtensor_box, is_dtensor, walk, walk_value
from nostall.errors import CheckpointLoadError
from nostall.loading import engine
from nostall.loading.engine import Read, Shape
from nostall.loading.manifests import read_manifest
from nostall.loading.sources import DataFiles, Verifier, open_files

__all__ = ["KeyReport", "load_state", "load_state_keys", "template_boxes"]

log = logging.getLogger("nostall")


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


def _check_tensor(key: str, rec: TensorRecord, dest: torch.Tensor, gshape: Shape) -> TensorRecord:
    _check_dest(key, dest)
    dtype = torch_dtype(rec.dtype)
    if dest.dtype != dtype:
        raise CheckpointLoadError(f"key {key!r}: the checkpoint holds {dtype}, the template {dest.dtype}")
    if tuple(rec.shape) != tuple(gshape):
        raise CheckpointLoadError(
            f"key {key!r}: the checkpoint holds global shape {list(rec.shape)}, the template {list(gshape)}"
        )
    return rec


@dataclass(frozen=True)
class KeyReport:
    """The keys a load did not match, as torch's ``load_state_dict`` reports them.

    ``missing_keys``: keys of the template that the checkpoint does not hold
    (not loaded: they keep the template's values). ``unexpected_keys``: keys
    of the checkpoint that the template does not reach (not loaded). Both in
    the order of the template and of the manifest. With them, what the load
    read: data-file bytes from storage, and those another rank read for it.
    """

    missing_keys: List[str] = field(default_factory=list)
    unexpected_keys: List[str] = field(default_factory=list)
    bytes_read: int = 0  # of data files, read from storage by this rank
    bytes_received: int = 0  # of data files, received from the rank that read them (read once)


def load_state(
    template: Any,
    path: str,
    *,
    strict: bool = True,
    rank: int = 0,
    world_size: int = 1,
    verify: bool = True,
    per_rank: str = "error",
    manifest: Optional[Manifest] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    timeout: Optional[float] = None,
    files: Optional[DataFiles] = None,
) -> Any:
    """Fill ``template`` from the checkpoint at ``path`` and return the restored state.

    ``path`` is a directory or an object-storage URL (``storage_options`` go
    to fsspec); remote data is fetched with one ranged read per needed span,
    each bounded by ``timeout`` seconds (retries included) when given.
    ``per_rank``: ``"error"`` (default) refuses PerRank values when the world
    size differs from the save's; ``"skip"`` leaves them as in the template.

    ``strict`` (default True): the template and the checkpoint must hold the
    same keys, as torch's ``load_state_dict(strict=True)`` wants: a template
    key the checkpoint lacks (missing) or a checkpoint key the template does
    not reach (unexpected) is a :class:`~nostall.CheckpointLoadError` naming
    them, raised before anything is read. The checkpoint's keys are its
    tensors, its JSON values and, when the world size is the saving one's,
    this rank's PerRank values; a key tied to another (tied weights, saved
    once) counts as reached when any key of its tie is. False: the keys both
    hold are loaded, missing keys keep the template's values (they come back
    as given), unexpected keys are not loaded, and both lists are logged at
    WARNING by the ``nostall`` logger (:func:`load_state_keys` returns them).
    A dtype or shape that differs is an error either way.

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
    restored, _ = load_state_keys(template, path, strict=strict, rank=rank, world_size=world_size, verify=verify,
                                  per_rank=per_rank, manifest=manifest, storage_options=storage_options,
                                  timeout=timeout, files=files)
    return restored


def load_state_keys(
    template: Any,
    path: str,
    *,
    strict: bool = True,
    scope: Optional[Sequence[str]] = None,
    rank: int = 0,
    world_size: int = 1,
    verify: bool = True,
    per_rank: str = "error",
    manifest: Optional[Manifest] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    timeout: Optional[float] = None,
    files: Optional[DataFiles] = None,
) -> Tuple[Any, KeyReport]:
    """:func:`load_state`, returning the restored state and the :class:`KeyReport` of the load.

    ``scope``: the top-level keys whose checkpoint entries the template must
    reach (a key counts when it is one of them or lies under one); None: all
    of them. Missing keys are the template's, whatever the scope. ``files``:
    the data files to read through (a shared load's, some bytes received
    from other ranks); closed here. None: opened here.
    """
    try:
        with gc_paused():  # a load makes many small objects in no cycle (records, reads, views)
            return _load_keys(template, path, strict, scope, rank, world_size, verify, per_rank, manifest,
                              storage_options, timeout, files)
    finally:
        if files is not None:  # closed whatever happened (a refused load too): it may hold received bytes
            files.close()


def _load_keys(template: Any, path: str, strict: bool, scope: Optional[Sequence[str]], rank: int, world_size: int,
               verify: bool, per_rank: str, manifest: Optional[Manifest], storage_options: Optional[Dict[str, Any]],
               timeout: Optional[float], files: Optional[DataFiles]) -> Tuple[Any, KeyReport]:
    if per_rank not in ("error", "skip"):
        raise ValueError("per_rank must be 'error' or 'skip'")
    m = manifest if manifest is not None else read_manifest(path, storage_options)
    plan = _TemplatePlan(m, path, rank, world_size, per_rank, strict)
    restored = walk(template, plan.visit)
    report = plan.report(scope)
    if report.missing_keys or report.unexpected_keys:
        if strict:
            raise CheckpointLoadError(_mismatch(path, report))
        log.warning("%s: loaded with strict=False: %s", path,
                    _mismatch_lists(report, " (they keep the template's values)", " (not loaded)"))
    source = files if files is not None else open_files(path, m, storage_options, timeout)
    try:
        _fill(engine.in_file_order(engine.unique_reads(plan.reads)), source, m, verify)
        report = replace(report, bytes_read=source.bytes_read, bytes_received=source.bytes_received)
    finally:
        source.close()
    log.info("rank %d: loaded %s: %d bytes read from storage, %d received from other ranks", rank, path,
             report.bytes_read, report.bytes_received)
    return restored, report


def _some(keys: List[str], n: int = 5) -> str:
    """The first ``n`` of ``keys``, and how many there are."""
    shown = ", ".join(repr(k) for k in keys[:n])
    return f"[{shown}{', ...' if len(keys) > n else ''}] ({len(keys)} in all)"


def _mismatch_lists(report: KeyReport, kept: str = "", ignored: str = "") -> str:
    parts = []
    if report.missing_keys:
        parts.append(f"missing key(s), in the template but not in the checkpoint{kept}: {_some(report.missing_keys)}")
    if report.unexpected_keys:
        parts.append(f"unexpected key(s), in the checkpoint but not in the template{ignored}: "
                     f"{_some(report.unexpected_keys)}")
    return "; ".join(parts)


def _mismatch(path: str, report: KeyReport) -> str:
    return (f"{path}: the checkpoint and the template do not hold the same keys: {_mismatch_lists(report)}. Load "
            "into the model or state that saved it (the same architecture and structure), or pass strict=False to "
            "load the keys both hold (missing keys keep the template's values, unexpected keys are not loaded; "
            "both are reported)")


def _leaf_box(key: str, v: Any) -> Tuple[torch.Tensor, Shape, Shape]:
    """A template tensor leaf's destination, global offset and global shape."""
    if isinstance(v, ShardedTensor):
        return v.data, tuple(v.global_offset), tuple(v.global_shape)
    if is_dtensor(v):
        dest, off, gshape, _ = dtensor_box(v, key)
        return dest, off, gshape
    return v, (0,) * v.dim(), tuple(v.shape)


def template_boxes(template: Any) -> Dict[str, List[Tuple[Shape, Shape]]]:
    """The global boxes ``(offset, shape)`` of each tensor key ``template`` loads (PerRank values aside):
    what a rank asks of a shared manifest (:mod:`nostall.loading.collective`)."""
    boxes: Dict[str, List[Tuple[Shape, Shape]]] = {}

    def visit(kind: str, key: str, v: Any) -> Any:
        if kind == "tensor":
            dest, off, _ = _leaf_box(key, v)
            boxes.setdefault(key, []).append((off, tuple(dest.shape)))
        return v

    walk(template, visit)
    return boxes


class _TemplatePlan:
    """A load's first phase: walk the template (:meth:`visit`), check each key against the manifest ``m``
    and plan the reads of its tensors (:attr:`reads`); nothing is read or written yet. The keys found are
    recorded (:attr:`reached`), those not found too (:attr:`missing`, the template's values kept)."""

    def __init__(self, m: Manifest, path: str, rank: int, world_size: int, per_rank: str, strict: bool) -> None:
        self.m, self.path, self.rank, self.world_size, self.per_rank = m, path, rank, world_size, per_rank
        self.strict = strict
        self.reads: List[Read] = []
        self.reached: Set[str] = set()
        self.missing: List[str] = []

    def visit(self, kind: str, key: str, v: Any) -> Any:
        if kind == "tensor":
            dest, off, gshape = _leaf_box(key, v)
            rec = self.m.tensors.get(key)
            if rec is None:
                return self._missing(key, v)
            engine.plan_reads(_check_tensor(key, rec, dest, gshape), dest, off, self.reads)
            self.reached.add(key)
            return v
        if kind == "object":
            return self._object(key, v)
        return self._per_rank(key, v)

    def _missing(self, key: str, v: Any) -> Any:
        """A template key the checkpoint lacks: recorded, and its template value kept."""
        self.missing.append(key)
        return v

    def _object(self, key: str, v: Any) -> Any:
        m, path = self.m, self.path
        if key not in m.objects:
            under = [k for k in m.tensors if k.startswith(key + "/")] if key else []
            if under and self.strict:
                raise CheckpointLoadError(
                    f"key {key!r}: the checkpoint at {path} holds tensors under it (e.g. {under[0]!r}) but the "
                    f"template has a {type(v).__name__} value there: give the template the same structure. "
                    "An optimizer's state_dict() is empty until its first step: load a model and optimizer "
                    "with load(model=..., optimizer=...), which needs no preparation"
                )
            return self._missing(key, v)
        self.reached.add(key)
        return m.objects[key]

    def _per_rank(self, key: str, pr: PerRank) -> Any:
        m, rank = self.m, self.rank
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
                rec = saved.tensors.get(full)
                if rec is None:
                    return self._missing(full, v)
                engine.plan_reads(_check_tensor(full, rec, v, tuple(v.shape)), v, (0,) * v.dim(), self.reads)
                self.reached.add(full)
                return v
            if kind == "object":
                if full not in saved.objects:
                    return self._missing(full, v)
                self.reached.add(full)
                return saved.objects[full]
            raise CheckpointLoadError(f"key {full!r}: PerRank nested inside PerRank")

        return walk_value(pr.value, inner)

    def report(self, scope: Optional[Sequence[str]]) -> KeyReport:
        """The keys not matched: the template's missing ones, and the checkpoint's (within ``scope``) not reached.

        A tensor recorded as tied to another (``tied_to``: the same data, saved once) is reached when any
        key of its tie is. PerRank entries count only on the saving world size (this rank's): on another,
        no rank's can be restored.
        """
        m, reached = self.m, self.reached

        def tie(key: str) -> str:
            return m.tensors[key].tied_to or key

        ties_reached = {tie(k) for k in reached if k in m.tensors}
        keys = [k for k in m.tensors if tie(k) not in ties_reached] + [k for k in m.objects if k not in reached]
        if m.world_size == self.world_size and 0 <= self.rank < len(m.per_rank):
            mine = m.per_rank[self.rank]
            keys += [k for k in list(mine.tensors) + list(mine.objects) if k not in reached]
        if scope is not None:
            keys = [k for k in keys if any(k == s or k.startswith(s + "/") for s in scope)]
        return KeyReport(list(self.missing), keys)


def _fill(reads: List[Read], files: DataFiles, m: Manifest, verify: bool) -> None:
    """A load's second phase: perform ``reads`` (coalesced per file), every byte verified before it returns."""

    def failed(r: Read, e: Exception) -> None:
        if isinstance(e, OSError):
            hint = (" (the template's memory is not writable: load into writable tensors)"
                    if e.errno == errno.EFAULT else "")
            raise CheckpointLoadError(
                f"key {r.rec.key!r}: reading {files.path(r.piece.file)} into the template failed: "
                f"{e.strerror or e}{hint}; check the storage and retry"
            ) from e
        raise CheckpointLoadError(  # torch refusing the copy (e.g. an expanded template tensor)
            f"key {r.rec.key!r}: cannot write into the template's tensor: {e}; give the template "
            "a plain tensor of its own memory (e.g. .clone())"
        ) from e

    with Verifier(verify) as checks, torch.no_grad():
        engine.execute_all(reads, files, m, checks, failed)
        checks.finish()
