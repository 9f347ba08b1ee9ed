"""Export a nostall checkpoint to consolidated files other tools read.

* ``to="safetensors"``: full (unsharded) tensors in safetensors files of at
  most ``max_shard_size`` bytes each (a single larger tensor gets a file of its
  own), named like Hugging Face's (``model.safetensors``, or
  ``model-00001-of-00003.safetensors`` ... with ``model.safetensors.index.json``);
* ``to="torch"``: one file that ``torch.load(path, weights_only=True)`` reads
  as a flat ``{name: tensor}`` dict.

Memory stays under ``memory_limit``: a tensor is assembled whole when it fits,
otherwise it is written region by region. Both formats store a tensor as raw
C-contiguous bytes at a known offset, so any tensor is streamed as a sequence
of row blocks (slabs of the leading dimensions), each read from whichever
saved pieces cover it -- whatever the saved sharding -- and written in place.
Checksums are verified on every byte read. JSON values and per-rank values are
not exported (neither format has a place for them).

Side files (small files saved with the checkpoint, see ``side_files`` in
docs/format.md) are copied into a safetensors export, each checked against
its size and crc32c: one under ``huggingface/`` lands at the top level with
that prefix removed (``huggingface/config.json`` becomes ``<dst>/config.json``,
beside ``model.safetensors``, where ``from_pretrained(<dst>)`` reads it),
any other keeps its name (``notes.txt``, ``extra/vocab.txt``). A side file
whose name there is that of a weights file or of the shard index is refused.
A ``torch`` export is one file: side files are not carried there.

Tied keys (saved once, see ``tied_to`` in docs/format.md) are exported once
when the key they are tied to is exported too. In safetensors, as Hugging
Face does for tied weights, the tied name is left out of the files (and out
of the index) and the model re-ties it on load; as ``safetensors.torch.save_model``
does, the file holding the kept tensor records ``{tied name: kept name}`` in
its ``__metadata__``. In ``torch.save`` format both names refer to one
storage, as ``torch.save`` of a tied ``state_dict`` gives.

A failed export leaves the destination as it found it: every file is written
under a temporary name of its own (``.<name>.<random>.partial``) and renamed
into place only once all of them are complete, and on any failure the files
and directories this export created are removed -- nothing else -- so a rerun
works.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import secrets
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from nostall.core.dtypes import dtype_code, torch_dtype
from nostall.core.tensorbuf import byte_view
from nostall.errors import CheckpointLoadError, CheckpointSaveError
from nostall.core.format import FileEntry, Manifest, SideFileRecord, TensorRecord, layout_file
from nostall.loading.engine import COALESCE_GAP, SPAN_BUDGET
from nostall.loading.manifests import read_manifest, read_side_file
from nostall.storage.files import FileWriter
from nostall.core.model import numel
from nostall.interop._common import Progress, ProgressFn, Source, split_key

log = logging.getLogger("nostall.interop")

__all__ = ["export", "ExportReport", "select_keys", "CreatedFiles", "DEFAULT_MEMORY_LIMIT", "DEFAULT_MAX_SHARD_SIZE",
           "Item", "Streamer", "select_items", "shard_groups", "shard_file_names", "side_plan", "check_side_names",
           "write_shard", "write_index", "write_side_files", "read_budget", "cast_dtype"]

DEFAULT_MEMORY_LIMIT = 1 << 30
DEFAULT_MAX_SHARD_SIZE = 5 << 30
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TORCH_NAME = "model.pt"
HF_SIDE_PREFIX = "huggingface/"
"""Side files under this prefix land at the top level of a safetensors export (prefix removed)."""

Shape = Tuple[int, ...]
_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
}


@dataclass
class ExportReport:
    """What :func:`export` wrote."""

    files: List[str]
    tensors: int
    bytes: int
    names: Dict[str, str] = field(default_factory=dict)  # output name -> checkpoint key
    tied: Dict[str, str] = field(default_factory=dict)  # tied output name -> the output name holding its data
    peak_buffer_bytes: int = 0  # the most buffer memory held at once (estimate, see export())
    memory_limit: int = 0
    side_files: List[str] = field(default_factory=list)  # the side files written (paths), besides ``files``
    side_files_skipped: List[str] = field(default_factory=list)  # side files not carried (a torch export)

    def to_json(self) -> Dict[str, Any]:
        return {"files": self.files, "tensors": self.tensors, "bytes": self.bytes, "tied": self.tied,
                "peak_buffer_bytes": self.peak_buffer_bytes, "memory_limit": self.memory_limit,
                "side_files": self.side_files, "side_files_skipped": self.side_files_skipped}


def select_keys(keys: Sequence[str], patterns: Optional[Sequence[str]]) -> List[str]:
    """The keys matching any pattern: a key prefix at a component boundary
    (``model`` selects ``model/...``) or a glob (``model/*.weight``)."""
    if not patterns:
        return list(keys)
    out = []
    for k in keys:
        for p in patterns:
            pre = p.rstrip("/")
            if k == pre or k.startswith(pre + "/") or fnmatch.fnmatchcase(k, p):
                out.append(k)
                break
    return out


def _output_name(key: str, strip_prefix: Optional[str], sep: str) -> str:
    parts = split_key(key)
    if strip_prefix:
        pre = split_key(strip_prefix.strip("/"))
        if parts[: len(pre)] == pre and len(parts) > len(pre):
            parts = parts[len(pre):]
    return sep.join(parts)


def side_output_name(name: str) -> str:
    """Where the side file ``name`` lands in a safetensors export, relative to it: ``huggingface/`` removed."""
    return name[len(HF_SIDE_PREFIX):] if name.startswith(HF_SIDE_PREFIX) else name


def _side_outputs(records: Sequence[SideFileRecord]) -> List[Tuple[str, SideFileRecord]]:
    """(output name, record) of each side file, by output name; two landing on one name, or one on
    the other's directory, are refused naming both."""
    out = sorted(((side_output_name(r.name), r) for r in records), key=lambda x: x[0])
    for (a, ra), (b, rb) in zip(out, out[1:]):
        if a == b or b.startswith(a + "/"):
            how = "the same file" if a == b else "a file and a directory at once"
            raise CheckpointSaveError(f"side files {ra.name!r} and {rb.name!r} would be exported as {how} "
                                      f"({a!r}, {b!r}); rename one of them when saving")
    return out


def _out_dtype(stored: torch.dtype, want: Optional[Union[str, torch.dtype]]) -> torch.dtype:
    if want is None or not stored.is_floating_point:
        return stored  # casts apply to floating-point tensors only
    if isinstance(want, torch.dtype):
        return want
    try:
        return _DTYPES[want.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {want!r}; one of {sorted(_DTYPES)}") from None


def cast_dtype(want: str) -> torch.dtype:
    """The dtype ``want`` names (``"bf16"``, ``"fp16"``, ``"fp32"``...), or ``ValueError`` listing the known names."""
    return _out_dtype(torch.float32, want)


def _slabs(shape: Shape, max_elems: int) -> Iterator[Tuple[Shape, Shape]]:
    """Boxes that tile ``shape`` in C order, each contiguous in memory and of at most
    ``max_elems`` elements (whole rows when a row fits, else recursively inside a row)."""
    if numel(shape) == 0:
        return
    if not shape:
        yield (), ()
        return
    inner = numel(shape[1:])
    if inner <= max_elems:
        rows = max(1, max_elems // inner)
        for a in range(0, shape[0], rows):
            yield (a,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - a),) + tuple(shape[1:])
        return
    for a in range(shape[0]):
        for off, shp in _slabs(tuple(shape[1:]), max_elems):
            yield (a,) + off, (1,) + shp


@dataclass
class Item:
    name: str
    key: str
    rec: TensorRecord
    src_dtype: torch.dtype
    out_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return numel(self.rec.shape) * self.out_dtype.itemsize


class Streamer:
    """Reads a tensor slab by slab within a memory budget, and writes each slab at its file offset."""

    def __init__(self, src: Source, memory_limit: int, progress: Progress) -> None:
        self.src = src
        self.limit = memory_limit
        self.progress = progress
        self.peak = 0
        # the read engine's span buffers (the source's, within its read budget: read_budget() of this limit),
        # let go after each slab's read
        self.spans = src.spans.most(src.manifest.block_size)

    def _read_mem(self, item: Item) -> int:
        """The most bytes the span buffers hold while a slab of ``item`` is read: within their budget, and no
        more than the item's stored pieces and the gaps a span may take in between two of them."""
        pieces = item.rec.pieces
        return min(self.spans, sum(p.nbytes for p in pieces) + COALESCE_GAP * max(0, len(pieces) - 1))

    def _cost(self, item: Item, n: int) -> int:
        """Bytes held while a slab of ``n`` elements is read and written: the slab, and the read
        engine's span buffers while it is read or the cast copy after."""
        cast = n * item.out_dtype.itemsize if item.out_dtype != item.src_dtype else 0
        return n * item.src_dtype.itemsize + max(self._read_mem(item), cast)

    def slab_elems(self, item: Item) -> int:
        """The most elements one slab of ``item`` may hold within the limit."""
        si = item.src_dtype.itemsize
        so = item.out_dtype.itemsize if item.out_dtype != item.src_dtype else 0
        n = min((self.limit - self._read_mem(item)) // si, self.limit // (si + so))
        if n < 1 and numel(item.rec.shape) > 0:
            bs = self.src.manifest.block_size
            need = max(self._read_mem(item) + si, si + so)
            raise CheckpointLoadError(
                f"memory limit {self.limit} bytes is too small to read key {item.key!r}: a read needs buffers of "
                f"up to two of the checkpoint's {bs}-byte checksum blocks (no more than its stored pieces) besides "
                f"the data; allow at least {need} bytes"
            )
        return max(n, 1)

    def write(self, item: Item, write_at: Callable[[int, memoryview], None]) -> None:
        """Stream ``item``; ``write_at(byte offset within the tensor, bytes)`` stores each slab."""
        shape = tuple(item.rec.shape)
        max_elems = self.slab_elems(item)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        so = item.out_dtype.itemsize
        for off, shp in _slabs(shape, max_elems):
            n = numel(shp)
            buf = torch.empty(shp, dtype=item.src_dtype)
            try:
                self.src.read(item.key, off, buf)
            finally:
                self.src.spans.close()  # the span buffers go before the cast copy is made
            cast = buf if item.out_dtype == item.src_dtype else buf.to(item.out_dtype)
            self.peak = max(self.peak, self._cost(item, n))
            start = sum(o * s for o, s in zip(off, strides)) * so
            write_at(start, byte_view(cast))
            self.progress.advance(n * so)
            del buf, cast


_Streamer = Streamer  # its former name (tests patch ``export._Streamer.write``)


class CreatedFiles:
    """What one export created: directories, temporary files, and final files that did not
    exist before. ``undo()`` removes exactly those (a directory only when empty), nothing else."""

    def __init__(self) -> None:
        self.dirs: List[str] = []  # outermost first
        self.temps: List[str] = []
        self.finals: List[str] = []  # final paths that did not exist before the export

    def makedirs(self, path: str) -> None:
        missing = []
        path = os.path.abspath(path)
        while not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise CheckpointSaveError(f"{d} exists and is not a directory") from None
                continue  # made by someone else meanwhile: not ours to remove
            self.dirs.append(d)

    def temp_for(self, final: str) -> str:
        """A new empty file beside ``final``, under a name no one else uses (recorded)."""
        folder, name = os.path.split(final)
        while True:
            tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.partial")
            try:
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                continue
            os.close(fd)
            self.temps.append(tmp)
            return tmp

    def publish(self, tmp: str, final: str) -> None:
        existed = os.path.lexists(final)
        os.replace(tmp, final)
        self.temps.remove(tmp)
        if not existed:
            self.finals.append(final)

    def undo(self) -> None:
        for path in self.temps + self.finals:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("could not remove %s after a failed export: %s", path, e)
        for d in reversed(self.dirs):
            try:
                os.rmdir(d)  # only when empty: whatever someone else put there meanwhile stays
            except OSError:
                pass
        self.temps, self.finals, self.dirs = [], [], []


def export(src: str, dst: str, *, to: str = "safetensors", keys: Optional[Sequence[str]] = None,
           strip_prefix: Optional[str] = None, separator: str = ".", dtype: Optional[Union[str, torch.dtype]] = None,
           max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, memory_limit: int = DEFAULT_MEMORY_LIMIT,
           overwrite: bool = False, verify: bool = True, storage_options: Optional[Dict[str, Any]] = None,
           progress: Optional[ProgressFn] = None) -> ExportReport:
    """Export the tensors of the checkpoint at ``src`` to ``dst``.

    Args:
        src: a nostall checkpoint directory (or object-storage URL).
        dst: ``to="safetensors"``: a directory (created); ``to="torch"``: a file path.
        keys: keys to export, as key prefixes (``"model"``) or globs; default all.
        strip_prefix: leading key components removed from the output names
            (``"model"`` turns ``model/layer.weight`` into ``layer.weight``).
        separator: joins the remaining key components in output names (``/`` -> ``.``).
        dtype: cast floating-point tensors (``"bf16"``, ``"fp16"``, ``"fp32"``...).
        max_shard_size: largest safetensors file, in bytes.
        memory_limit: bytes of buffers the export may hold at once, the
            read engine's span buffers included (a quarter of the limit, at
            most 48 MiB, at least two checksum blocks). A tensor bigger than
            the rest is written region by region. (A side file, at most
            64 MiB, is read whole, one at a time.)
        progress: ``progress(done_bytes, total_bytes)`` after each region.

    Side files go into a safetensors export (``huggingface/`` ones at its top
    level, see the module doc), each checked against its size and crc32c
    whatever ``verify`` says; a ``torch`` export leaves them out (listed in
    the report's ``side_files_skipped``).

    Raises:
        CheckpointLoadError: a key is missing, the limit is below what one
            read needs, or a checksum fails (CheckpointCorruptError), a side file's too.
        CheckpointSaveError: ``dst`` exists (without ``overwrite``) or cannot be written, or a
            side file would take the name of a weights file, of the index or of another side file.
    """
    if to not in ("safetensors", "torch"):
        raise ValueError(f"to must be 'safetensors' or 'torch', got {to!r}")
    if memory_limit <= 0 or max_shard_size <= 0:
        raise ValueError("memory_limit and max_shard_size must be positive")
    manifest = read_manifest(src, storage_options)
    source = Source(src, storage_options=storage_options, verify=verify, manifest=manifest,
                    read_budget=read_budget(memory_limit, manifest.block_size))
    try:
        items, tied = select_items(source.manifest, src, keys, strip_prefix, separator, dtype)
        prog = Progress(f"export {src} -> {dst}", sum(i.nbytes for i in items), progress)
        streamer = Streamer(source, memory_limit, prog)
        for it in items:
            streamer.slab_elems(it)  # fail before writing anything if the limit is too small
        side, skipped = side_plan(to, source.manifest, src)
        files, side_paths = _write_all(to, items, tied, dst, max_shard_size, overwrite, streamer, side,
                                       lambda rec: read_side_file(src, rec, storage_options))
        prog.finish()
        return ExportReport(files=files, tensors=len(items), bytes=prog.total, names={i.name: i.key for i in items},
                            tied=tied, peak_buffer_bytes=streamer.peak, memory_limit=memory_limit,
                            side_files=side_paths, side_files_skipped=skipped)
    finally:
        source.close()


def read_budget(memory_limit: int, block_size: int) -> int:
    """The span buffers' share of an export's ``memory_limit``: a quarter, at most the loads' default
    (:data:`~nostall.loading.engine.SPAN_BUDGET`), at least two checksum blocks (what one read needs)."""
    return min(SPAN_BUDGET, max(memory_limit // 4, 2 * block_size))


def select_items(m: Manifest, src: str, keys: Optional[Sequence[str]], strip_prefix: Optional[str], separator: str,
            dtype: Optional[Union[str, torch.dtype]]) -> Tuple[List[Item], Dict[str, str]]:
    """The tensors to export, each under its output name, and the tied names left out (tied output
    name -> the output name holding its data). Refuses a selection that matches nothing and two keys
    that export under one name."""
    chosen = select_keys(sorted(m.tensors), keys)
    if keys and not chosen:
        raise CheckpointLoadError(f"no tensor of {src} matches {list(keys)}")
    items: List[Item] = []
    seen: Dict[str, str] = {}
    out_name: Dict[str, str] = {}
    chosen_set = set(chosen)
    tied_keys: List[str] = []
    for k in chosen:
        rec = m.tensors[k]
        name = _output_name(k, strip_prefix, separator)
        if name in seen:
            raise CheckpointSaveError(f"keys {seen[name]!r} and {k!r} both export as {name!r}")
        seen[name] = k
        out_name[k] = name
        if rec.tied_to and rec.tied_to in chosen_set:
            tied_keys.append(k)  # its data is exported once, under the name of the key it is tied to
            continue
        sd = torch_dtype(rec.dtype)
        items.append(Item(name, k, rec, sd, _out_dtype(sd, dtype)))
    tied = {out_name[k]: out_name[m.tensors[k].tied_to] for k in tied_keys}
    return items, tied


def side_plan(to: str, m: Manifest, src: str) -> Tuple[List[Tuple[str, SideFileRecord]], List[str]]:
    """The side files an export writes ((output name, record); a safetensors export) and those it
    leaves out (a torch export, one file)."""
    side: List[Tuple[str, SideFileRecord]] = []
    skipped: List[str] = []
    if to == "safetensors":
        side = _side_outputs(list(m.side_files.values()))
    elif m.side_files:
        skipped = sorted(m.side_files)
        log.info("%s: %d side file(s) not exported (a torch export is one file): %s", src, len(skipped),
                 ", ".join(skipped))
    return side, skipped


def _write_all(to: str, items: List[Item], tied: Dict[str, str], dst: str, max_shard_size: int, overwrite: bool,
               streamer: Streamer, side: Sequence[Tuple[str, SideFileRecord]],
               read_side: Callable[[SideFileRecord], bytes]) -> Tuple[List[str], List[str]]:
    """Write the export's files (see :func:`_export_safetensors`, :func:`_export_torch`); on any
    failure remove exactly what this export created, nothing else. The files and side files written."""
    created = CreatedFiles()
    try:
        if to == "safetensors":
            return _export_safetensors(items, tied, dst, max_shard_size, overwrite, streamer, created, side,
                                       read_side)
        return [_export_torch(items, tied, dst, overwrite, streamer, created)], []
    except BaseException:
        created.undo()  # exactly what this export created, nothing else
        raise


# --------------------------------------------------------------------------- safetensors


def shard_groups(items: Sequence[Item], max_size: int, min_files: int = 1) -> List[List[Item]]:
    """The tensors of each safetensors file, in order: contiguous runs of ``items``, each of at most
    ``max_size`` bytes (a bigger tensor gets a file of its own). With ``min_files`` > 1 (the export at
    save time: one file per rank at least), the runs are also cut near equal shares of the total, into
    ``max(ceil(total / max_size), min(min_files, len(items)))`` files or one more: a run starts a new
    file at the tensor whose middle lies past the next share's boundary. Deterministic."""
    if not items:
        return []
    total = sum(it.nbytes for it in items)
    k = max(-(-total // max_size), min(min_files, len(items)))
    share = total / k if min_files > 1 and k > 1 else None
    groups: List[List[Item]] = [[]]
    size = done = 0
    for it in items:
        past_share = share is not None and len(groups) < k and done + it.nbytes / 2 > share * len(groups)
        if groups[-1] and (size + it.nbytes > max_size or past_share):
            groups.append([])
            size = 0
        groups[-1].append(it)
        size += it.nbytes
        done += it.nbytes
    return groups


def shard_file_names(n: int) -> List[str]:
    """The names of ``n`` safetensors files, as Hugging Face names them."""
    return [SINGLE_NAME] if n <= 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _prepare_dir(dst: str, overwrite: bool, created: CreatedFiles) -> None:
    if os.path.exists(dst):
        if not os.path.isdir(dst):
            raise CheckpointSaveError(f"{dst} exists and is not a directory")
        if os.listdir(dst) and not overwrite:
            raise CheckpointSaveError(f"{dst} is not empty; pass overwrite=True (--overwrite) to write into it")
    created.makedirs(dst)


def check_side_names(side: Sequence[Tuple[str, SideFileRecord]], weights: Sequence[str]) -> None:
    """Refuse a side file that would land on (or make a directory of) a weights file or the index."""
    owned = {w: "weights file" for w in weights}
    owned[INDEX_NAME] = "shard index"  # the export's own, even unsharded (a stale one would mislead a reader)
    for out, rec in side:
        parts = out.split("/")
        for i in range(1, len(parts) + 1):
            hit = "/".join(parts[:i])
            if hit in owned:
                how = "would overwrite" if i == len(parts) else "would need a directory in place of"
                raise CheckpointSaveError(
                    f"side file {rec.name!r} (exported as {out!r}) {how} the export's {owned[hit]} {hit!r}; "
                    "rename the side file when saving, or export without it"
                )


def write_side_files(side: Sequence[Tuple[str, SideFileRecord]], read_side: Callable[[SideFileRecord], bytes],
                      dst: str, created: CreatedFiles) -> List[Tuple[str, str]]:
    """Each side file read (size and crc32c checked) and written under a temporary name beside its final one."""
    ready: List[Tuple[str, str]] = []
    for out, rec in side:
        data = read_side(rec)  # raises naming the file when it is missing or damaged
        final = os.path.join(dst, *out.split("/"))
        created.makedirs(os.path.dirname(final))
        tmp = created.temp_for(final)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        ready.append((tmp, final))
    return ready


def _export_safetensors(items: List[Item], tied: Dict[str, str], dst: str, max_size: int, overwrite: bool,
                        streamer: Streamer, created: CreatedFiles, side: Sequence[Tuple[str, SideFileRecord]] = (),
                        read_side: Optional[Callable[[SideFileRecord], bytes]] = None) -> Tuple[List[str], List[str]]:
    """Every file is written under a temporary name; all are renamed into place (the side
    files first, the index last) only once every one is complete. ``tied`` names (tied
    name -> kept name) are left out; the file holding a kept name records the tie in its
    metadata. ``side``: (output name, record) of the side files, read with ``read_side``.
    Returns the paths of the weights files (and index), and of the side files."""
    groups = shard_groups(items, max_size)
    n = len(groups)
    names = shard_file_names(n)
    check_side_names(side, names)  # before anything is written
    _prepare_dir(dst, overwrite, created)
    side_ready: List[Tuple[str, str]] = []
    if side:
        assert read_side is not None
        side_ready = write_side_files(side, read_side, dst, created)  # small: a damaged one fails at once
    weight_map: Dict[str, str] = {}
    ready: List[Tuple[str, str]] = []  # (temporary, final)
    for fname, group in zip(names, groups or [[]]):
        ready.append(write_shard(os.path.join(dst, fname), group, tied, streamer, created))
        for it in group:
            weight_map[it.name] = fname
    if n > 1:
        ready.append(write_index(sum(i.nbytes for i in items), weight_map, dst, created))
    for tmp, path in side_ready + ready:
        created.publish(tmp, path)
    written = [path for _, path in ready]
    log.info("exported %d tensor(s) to %d safetensors file(s) in %s", len(items), n, dst)
    if side_ready:
        log.info("exported %d side file(s) to %s", len(side_ready), dst)
    return written, [path for _, path in side_ready]


def write_shard(path: str, group: Sequence[Item], tied: Dict[str, str], streamer: Streamer,
                 created: CreatedFiles) -> Tuple[str, str]:
    """One safetensors file of ``group``, written under a temporary name beside ``path``, each tensor
    streamed to its place; a ``tied`` name whose kept name is in the file is recorded in its metadata.
    (temporary, final)."""
    entries = []
    for it in group:
        code = dtype_code(it.out_dtype)
        if code is None:
            raise CheckpointSaveError(f"key {it.key!r}: dtype {it.out_dtype} has no safetensors code")
        entries.append(FileEntry(it.name, code, tuple(it.rec.shape), it.nbytes))
    metadata = {"format": "pt"}
    in_file = {it.name for it in group}
    for gone, kept in sorted(tied.items()):
        if kept in in_file:
            metadata.setdefault(gone, kept)  # as safetensors.torch.save_model records a dropped shared name
    header, where, size = layout_file(entries, metadata)
    tmp = created.temp_for(path)
    with FileWriter(tmp) as f:  # the disk starts writing each region as it comes (as a save's data files)
        f.write(memoryview(header))
        for it in sorted(group, key=lambda i: where[i.name][0]):
            base = where[it.name][0]

            def write_at(pos: int, data: memoryview, base: int = base) -> None:
                f.seek(base + pos)
                f.write(data)

            streamer.write(it, write_at)
        f.seek(size)
        f.finish()  # cut at the size (a last empty tensor), fsync
    return tmp, path


def write_index(total_size: int, weight_map: Dict[str, str], dst: str, created: CreatedFiles) -> Tuple[str, str]:
    """The shard index of a sharded export, written under a temporary name. (temporary, final)."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    ipath = os.path.join(dst, INDEX_NAME)
    tmp = created.temp_for(ipath)
    with open(tmp, "w") as fi:
        json.dump(index, fi, indent=2, sort_keys=True)
        fi.write("\n")
        fi.flush()
        os.fsync(fi.fileno())
    return tmp, ipath


# --------------------------------------------------------------------------- torch.save


def _export_torch(items: List[Item], tied: Dict[str, str], dst: str, overwrite: bool, streamer: Streamer,
                  created: CreatedFiles) -> str:
    """One torch.save file written without holding the tensors: ``torch.save`` lays the
    file out from shapes only (``torch.serialization.skip_data``: storages are
    allocated but never touched, so they take address space, not memory), then each
    tensor's bytes are streamed to its record, and the zip CRCs are filled in. A ``tied``
    name is the very tensor of its kept name, so the file holds that storage once."""
    if os.path.isdir(dst):
        raise CheckpointSaveError(f"{dst} is a directory; --to torch writes one file")
    if os.path.exists(dst) and not overwrite:
        raise CheckpointSaveError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
    dst_abs = os.path.abspath(dst)
    created.makedirs(os.path.dirname(dst_abs))
    tmp = created.temp_for(dst_abs)
    layout = {it.name: torch.empty(tuple(it.rec.shape), dtype=it.out_dtype) for it in items}
    for gone, kept in sorted(tied.items()):  # after every kept name: the storage numbering below is unchanged
        layout[gone] = layout[kept]
    with torch.serialization.skip_data():
        torch.save(layout, tmp)
    del layout
    reader = torch._C.PyTorchFileReader(tmp)
    offsets = {}
    for i, it in enumerate(items):  # storages are numbered in pickling order (the dict's order), each once
        # get_record_offset exists at runtime but is missing from torch's type stubs (torch/_C/__init__.pyi)
        offsets[it.name] = (f"data/{i}", reader.get_record_offset(f"data/{i}"))  # type: ignore[attr-defined]
    del reader
    crcs: Dict[str, int] = {}
    with open(tmp, "r+b") as f:
        for it in items:
            record, base = offsets[it.name]
            running = [0, 0]  # crc, next expected position (slabs arrive in order)

            def write_at(pos: int, data: memoryview, base: int = base, running: List[int] = running,
                         key: str = it.key) -> None:
                if pos != running[1]:
                    raise CheckpointSaveError(f"{key!r}: out-of-order write at {pos}")
                f.seek(base + pos)
                f.write(data)
                running[0] = zlib.crc32(data, running[0])
                running[1] = pos + len(data)

            streamer.write(it, write_at)
            if running[1] != it.nbytes:
                raise CheckpointSaveError(f"{it.key!r}: wrote {running[1]} of {it.nbytes} bytes")
            crcs[record] = running[0]
        f.flush()
        _patch_zip_crcs(f, crcs)
        os.fsync(f.fileno())
    created.publish(tmp, dst_abs)
    log.info("exported %d tensor(s) to %s", len(items), dst)
    return dst


def _patch_zip_crcs(f: Any, crcs: Dict[str, int]) -> None:
    """Set the CRC-32 of the given records (names without the archive folder) in the zip's
    central directory and data descriptors, so that any zip reader accepts the file."""
    import zipfile

    f.seek(0)
    z = zipfile.ZipFile(f)
    infos = {i.filename.split("/", 1)[-1]: i for i in z.infolist()}
    start_dir = z.start_dir
    count = len(z.infolist())
    z.close()
    pos = start_dir
    for _ in range(count):
        f.seek(pos)
        head = f.read(46)
        if head[:4] != b"PK\x01\x02":
            raise CheckpointSaveError("unexpected zip central directory layout")
        n, m, k = struct.unpack("<HHH", head[28:34])
        name = f.read(n).decode("utf-8").split("/", 1)[-1]
        if name in crcs:
            f.seek(pos + 16)
            f.write(struct.pack("<I", crcs[name]))
        pos += 46 + n + m + k
    for name, value in crcs.items():
        info = infos[name]
        f.seek(info.header_offset)
        local = f.read(30)
        n, m = struct.unpack("<HH", local[26:30])
        data_end = info.header_offset + 30 + n + m + info.compress_size
        if info.flag_bits & 0x08:  # CRC in the data descriptor after the data
            f.seek(data_end)
            sig = f.read(4)
            f.seek(data_end + 4 if sig == b"PK\x07\x08" else data_end)
        else:
            f.seek(info.header_offset + 14)
        f.write(struct.pack("<I", value))
