"""PyTorch Distributed Checkpoint (DCP) interoperability, both ways.

* :class:`Reader` is a ``torch.distributed.checkpoint`` StorageReader over a
  nostall checkpoint: ``dcp.load(state, storage_reader=Reader(path))`` loads
  it into any DCP state dict (plain tensors, DTensor, torch ShardedTensor), on
  any world size, resharding like DCP does. Each saved piece is one DCP chunk;
  a read fetches only the checksum blocks covering the requested region and
  verifies them. JSON values are served as DCP "bytes" items; per-rank values
  are not exposed (DCP has no notion of them).

* :func:`import_dcp` converts a DCP checkpoint directory (written by
  ``dcp.save``, or Megatron's ``torch_dist`` format) into a nostall
  checkpoint, chunk by chunk. DCP's ``.metadata`` file is a pickle: importing
  trusts the source, as DCP itself does. Tensor chunks are read with
  ``torch.load(weights_only=True)``, and so are non-tensor items, which must
  then be JSON values.

Key mapping: a nostall key's components joined with ``.`` are the DCP fully
qualified name, as DCP's own flattening of nested dicts produces it
(``model/layer.weight`` <-> ``model.layer.weight``).

Names. ``dcp.load`` flattens the caller's state dict and asks the reader for
one item per leaf, named by the leaf's path joined with ``.``. Since torch 2.4
(``torch/distributed/checkpoint/_traverse.py``, ``traverse_state_dict``):

* a dict is always descended into (its keys as ``str``); an empty dict has no
  leaf at all;
* a list is descended into (indices ``0``, ``1`` ...) when it holds a dict, a
  tensor, or a list that is itself descended into; otherwise (scalars,
  strings, tuples, ``None``, flat lists, the empty list) it is one leaf;
* a tuple, and anything else, is one leaf.

Tensor leaves are tensor items; every other leaf is a "bytes" item, which
the reader answers with a ``torch.save`` of the value. So an optimizer's
``param_groups`` is asked for as ``optim.param_groups.0.lr``,
``optim.param_groups.0.betas`` (the tuple as one item),
``optim.param_groups.0.params`` ..., never as one ``optim.param_groups`` item.

:class:`Reader` names a checkpoint's JSON values exactly that way. It offers
no other (pre-2.4) forms: DCP looks at the old flattening only when the
checkpoint's metadata has keys that the new flattening of the caller's state
does not produce, and then switches the *whole* load to the old flattening
if any of them match -- so offering old names next to the new ones would
push every load onto that path (and nostall requires torch >= 2.4, whose
loads never ask for old names first).

A value stored as JSON has lost the difference between a tuple and a list;
where the caller's state holds a tuple at that place (an optimizer's
``betas``), the value is handed back as a tuple.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.futures import Future
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from nostall.core.dtypes import dtype_code, torch_dtype
from nostall.errors import CheckpointCorruptError, CheckpointLoadError, CheckpointNotFoundError, CheckpointSaveError
from nostall.core.format import DEFAULT_BLOCK_SIZE, MANIFEST_NAME, Manifest, PieceRecord, TensorRecord
from nostall.loading.engine import Read, SpanBuffers, execute_all
from nostall.loading.manifests import read_manifest
from nostall.loading.sources import READ_CHUNK, DataFiles, Verifier, open_files
from nostall.core.model import check_json, numel, to_json, walk
from nostall.storage.locate import local_path
from nostall.interop._common import PieceSource, Progress, ProgressFn, TensorSource, split_key, write_checkpoint

log = logging.getLogger("nostall.interop")

__all__ = ["Reader", "import_dcp", "fqn_of", "dcp_leaves"]


def fqn_of(key: str) -> str:
    """The DCP fully qualified name of a nostall key (components joined with ``.``)."""
    return ".".join(split_key(key))


# --------------------------------------------------------------------------- reading nostall through DCP


class Reader(StorageReader):
    """A DCP StorageReader over the nostall checkpoint at ``path``.

    Args:
        path: a checkpoint directory or object-storage URL (optional: DCP's
            ``checkpoint_id`` may give it instead).
        verify: check the CRC32C of every block read (default True).
        storage_options: fsspec options for object storage.
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, verify: bool = True,
                 storage_options: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        self.path: Optional[str] = os.fspath(path) if path is not None else None
        self.verify = verify
        self.storage_options = storage_options
        self._manifest: Optional[Manifest] = None
        self._keys: Dict[str, str] = {}  # fqn -> nostall key (tensors)
        self._objects: Dict[str, Any] = {}  # fqn -> JSON value

    # ---------------------------------------------------------------- protocol
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._manifest = None
        self._keys = {}
        self._objects = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        path = local_path(checkpoint_id)
        if path is None:
            return False  # never picked automatically for a URL; pass Reader(url) explicitly
        return os.path.isfile(os.path.join(path, MANIFEST_NAME))

    @property
    def checkpoint_id(self) -> Optional[str]:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's per-rank fallback: nostall has one manifest only
            raise CheckpointNotFoundError("a nostall checkpoint has no per-rank metadata")
        m = self._load_manifest()
        md: Dict[str, Any] = {}
        for fqn, key in self._keys.items():
            rec = m.tensors[key]
            chunks = [ChunkStorageMetadata(torch.Size(p.offset), torch.Size(p.shape)) for p in rec.pieces
                      if numel(p.shape) > 0]
            if not chunks:  # no elements: one empty chunk, so that a plan can still name it
                chunks = [ChunkStorageMetadata(torch.Size((0,) * len(rec.shape)), torch.Size(rec.shape))]
            md[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch_dtype(rec.dtype)), torch.Size(rec.shape),
                                            chunks)
        for fqn in self._objects:
            md[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md, planner_data=None, storage_data=None)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._load_manifest()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        m = self._load_manifest()
        # DefaultLoadPlanner keeps the caller's state, flattened, as `state_dict` (fqn -> value): where it
        # holds a tuple, the JSON value (a list) is handed back as one
        template = getattr(planner, "state_dict", None)
        files = open_files(self._path(), m, self.storage_options)
        try:
            tensor_items = []
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    fqn = item.storage_index.fqn
                    if fqn not in self._objects:
                        raise CheckpointLoadError(f"{fqn!r}: no such value in the checkpoint at {self.path}")
                    value = self._objects[fqn]
                    if isinstance(template, Mapping):
                        value = _like(template.get(item.dest_index.fqn), value)
                    buf = io.BytesIO()
                    torch.save(value, buf)  # a JSON value we decoded ourselves
                    buf.seek(0)
                    planner.load_bytes(item, buf)
                elif numel(tuple(item.lengths)) == 0:  # nothing to copy (an empty tensor or region)
                    planner.commit_tensor(item, planner.resolve_tensor(item).detach())
                else:
                    rec, piece = self._piece(item)
                    tensor_items.append((piece.file, piece.start, item, rec, piece))
            tensor_items.sort(key=lambda x: (x[0], x[1]))
            with torch.no_grad(), Verifier(self.verify) as checks, SpanBuffers() as spans:
                batch: List[Tuple[ReadItem, TensorRecord, PieceRecord]] = []
                size = 0
                for _, _, item, rec, piece in tensor_items:
                    batch.append((item, rec, piece))
                    size += numel(tuple(item.lengths)) * torch_dtype(rec.dtype).itemsize
                    if size >= READ_CHUNK:
                        self._read_tensors(batch, planner, files, m, checks, spans)
                        batch, size = [], 0
                self._read_tensors(batch, planner, files, m, checks, spans)
        finally:
            files.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_tensors(self, batch: List[Tuple[ReadItem, TensorRecord, PieceRecord]], planner: LoadPlanner,
                      files: DataFiles, m: Manifest, checks: Verifier, spans: SpanBuffers) -> None:
        """Read the tensor items of ``batch`` (in file order) together, through ``spans`` (this read's span
        buffers), check them, then commit them to ``planner``; a target off the CPU is read into a CPU tensor
        first, copied once checked."""
        reads: List[Read] = []
        targets = []
        for item, rec, piece in batch:
            target = planner.resolve_tensor(item).detach()
            lengths = tuple(int(x) for x in item.lengths)
            if tuple(target.shape) != lengths:
                raise CheckpointLoadError(
                    f"{item.storage_index.fqn!r}: the planner's target has shape {list(target.shape)}, "
                    f"the read {list(lengths)}"
                )
            box = tuple(o + int(s) for o, s in zip(piece.offset, item.storage_offsets))
            dest = target if target.device.type == "cpu" else torch.empty(lengths, dtype=target.dtype)
            reads.append(Read(rec, piece, box, lengths, dest))
            targets.append((item, target, dest))
        execute_all(reads, files, m, checks, buffers=spans)
        checks.finish()  # every byte is checked before it reaches a target off the CPU, or the planner
        for item, target, dest in targets:
            if dest is not target:
                target.copy_(dest)
            planner.commit_tensor(item, target)

    # ---------------------------------------------------------------- helpers
    def _path(self) -> str:
        if self.path is None:
            raise CheckpointLoadError("nostall.dcp.Reader: no checkpoint path (pass one, or DCP's checkpoint_id)")
        return self.path

    def _load_manifest(self) -> Manifest:
        if self._manifest is None:
            m = read_manifest(self._path(), self.storage_options)
            keys: Dict[str, str] = {}
            for key in m.tensors:
                fqn = fqn_of(key)
                if fqn in keys:
                    raise CheckpointLoadError(
                        f"keys {keys[fqn]!r} and {key!r} both map to the DCP name {fqn!r} ({self.path})"
                    )
                keys[fqn] = key
            objects: Dict[str, Any] = {}
            owner: Dict[str, str] = {}  # fqn -> the nostall key of the value it comes from
            for key, value in m.objects.items():
                for fqn, leaf in _leaves(fqn_of(key), value):
                    if fqn in keys or fqn in objects:
                        other = keys.get(fqn) or owner[fqn]
                        where = f"twice from {key!r}" if other == key else f"from both {other!r} and {key!r}"
                        raise CheckpointLoadError(f"the DCP name {fqn!r} comes {where} in {self.path}")
                    objects[fqn] = leaf
                    owner[fqn] = key
            self._manifest, self._keys, self._objects = m, keys, objects
        return self._manifest

    def _piece(self, item: ReadItem) -> Tuple[TensorRecord, PieceRecord]:
        fqn = item.storage_index.fqn
        key = self._keys.get(fqn)
        if key is None:
            raise CheckpointLoadError(f"{fqn!r}: no such tensor in the checkpoint at {self.path}")
        assert self._manifest is not None
        rec = self._manifest.tensors[key]
        offset = tuple(int(x) for x in (item.storage_index.offset or ()))
        for p in rec.pieces:
            if p.offset == offset:
                return rec, p
        raise CheckpointLoadError(f"{fqn!r}: no piece at offset {list(offset)} in {self.path}")


def dcp_leaves(name: str, value: Any) -> Dict[str, Any]:
    """The DCP items of the JSON value ``value`` at DCP name ``name``: ``{fqn: leaf}``,
    as ``dcp.load`` (torch >= 2.4) flattens that value in a state dict (module docstring).
    ValueError if two items get the same name (``{"a.b": 1, "a": {"b": 2}}``), as DCP's does."""
    out: Dict[str, Any] = {}
    for fqn, leaf in _leaves(name, value):
        if fqn in out:
            raise ValueError(f"two items of the value at {name!r} have the DCP name {fqn!r}")
        out[fqn] = leaf
    return out


def _leaves(name: str, value: Any) -> Iterator[Tuple[str, Any]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(f"{name}.{k}", v)
    elif isinstance(value, list) and _descended(value):
        for i, v in enumerate(value):
            yield from _leaves(f"{name}.{i}", v)
    else:
        yield name, value


def _descended(value: List[Any]) -> bool:
    """Whether DCP descends into this list (JSON: no tensors): it holds a dict, or a list it descends into."""
    return any(isinstance(v, Mapping) or (isinstance(v, list) and _descended(v)) for v in value)


def _like(current: Any, saved: Any) -> Any:
    """``saved`` (JSON: lists) with a tuple wherever the caller's ``current`` value has a plain tuple."""
    if type(current) is tuple and isinstance(saved, list) and len(saved) == len(current):
        return tuple(_like(c, s) for c, s in zip(current, saved))
    if isinstance(current, list) and isinstance(saved, list) and len(saved) == len(current):
        return [_like(c, s) for c, s in zip(current, saved)]
    if isinstance(current, Mapping) and isinstance(saved, dict):
        return {k: _like(current.get(k), v) for k, v in saved.items()}
    return saved


# --------------------------------------------------------------------------- importing DCP into nostall


class _ChunkPlanner(LoadPlanner):
    """A minimal planner: resolves each read into a buffer we own; bytes through weights_only."""

    def __init__(self) -> None:
        self.targets: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
        self.values: Dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan([])

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ()))]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _paths(md: Metadata) -> Dict[str, Tuple[Any, ...]]:
    """fqn -> the object path of the saved state (DCP keeps it as planner data), or (fqn,)."""
    pd = md.planner_data
    out: Dict[str, Tuple[Any, ...]] = {}
    for fqn in md.state_dict_metadata:
        path = pd.get(fqn) if isinstance(pd, dict) else None
        if isinstance(path, tuple) and path and all(isinstance(p, (str, int)) for p in path) \
                and ".".join(str(p) for p in path) == fqn:
            out[fqn] = tuple(path)
        else:
            out[fqn] = (fqn,)
    return out


def _nostall_keys(paths: Dict[str, Tuple[Any, ...]],
                  tensors: Sequence[str]) -> Tuple[Dict[str, str], Dict[str, List[str]]]:
    """The nostall keys of a DCP state: rebuild the nested structure from the object paths
    and flatten it the way nostall flattens a state (a container without tensors is one
    JSON value). Returns fqn -> key for tensors, and object key -> fqns beneath it."""
    tset = set(tensors)
    root: Dict[Any, Any] = {}
    markers: Dict[int, str] = {}
    for fqn, path in paths.items():
        node = root
        for p in path[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise CheckpointLoadError(f"DCP item {fqn!r} lies under another item")
        leaf: Any
        if fqn in tset:
            leaf = torch.empty(0)
            markers[id(leaf)] = fqn
        else:
            leaf = _Marker(fqn)
        node[path[-1]] = leaf
    root = _listify(root)
    tensor_keys: Dict[str, str] = {}
    object_keys: Dict[str, List[str]] = {}

    def visit(kind: str, key: str, v: Any) -> Any:
        if kind == "tensor":
            tensor_keys[markers[id(v)]] = key
        else:
            object_keys[key] = _marker_fqns(v)
        return v

    walk(root, visit)
    return tensor_keys, object_keys


class _Marker:
    def __init__(self, fqn: str) -> None:
        self.fqn = fqn


def _marker_fqns(v: Any) -> List[str]:
    if isinstance(v, _Marker):
        return [v.fqn]
    if isinstance(v, dict):
        return [f for x in v.values() for f in _marker_fqns(x)]
    if isinstance(v, (list, tuple)):
        return [f for x in v for f in _marker_fqns(x)]
    return []


def _listify(node: Any) -> Any:
    """Dicts whose keys are exactly the ints 0..n-1 were lists (DCP paths use ints for list items)."""
    if not isinstance(node, dict):
        return node
    items = {k: _listify(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items


def _fill(v: Any, values: Dict[str, Any]) -> Any:
    if isinstance(v, _Marker):
        return values[v.fqn]
    if isinstance(v, dict):
        return {k: _fill(x, values) for k, x in v.items()}
    if isinstance(v, list):
        return [_fill(x, values) for x in v]
    return v


def import_dcp(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], *, block_size: int = DEFAULT_BLOCK_SIZE,
               unsupported_objects: str = "error", progress: Optional[ProgressFn] = None) -> Manifest:
    """Convert the DCP checkpoint directory ``src`` into a nostall checkpoint at ``dst``.

    Every DCP chunk becomes one piece (the tensors stay sharded as saved), so
    the nostall checkpoint loads on any world size. Chunks are read and
    written one at a time: memory holds one chunk (DCP stores each chunk as
    one ``torch.save`` record, which must be read whole), not the checkpoint.

    Non-tensor items are read with ``torch.load(weights_only=True)`` and
    must be JSON values; ``unsupported_objects="skip"`` leaves out the ones
    that are not (logged), ``"error"`` (default) refuses the import.

    The DCP ``.metadata`` file itself is a pickle, read by torch's
    FileSystemReader: import only checkpoints you trust.

    ``block_size`` must pass :func:`nostall.options.check_block_size`
    (ValueError otherwise, before anything is read or written).
    """
    from nostall.options import check_block_size

    check_block_size(block_size)
    if unsupported_objects not in ("error", "skip"):
        raise ValueError("unsupported_objects must be 'error' or 'skip'")
    source = _DcpSource(os.fspath(src))
    md = source.md
    tensor_fqns = sorted(f for f, x in md.state_dict_metadata.items() if isinstance(x, TensorStorageMetadata))
    byte_fqns = sorted(f for f, x in md.state_dict_metadata.items() if isinstance(x, BytesStorageMetadata))
    tensor_keys, object_keys = _nostall_keys(_paths(md), tensor_fqns)
    values = _read_values(source, byte_fqns, unsupported_objects)  # non-tensor values first (small): JSON
    objects: Dict[str, Any] = {}
    for key, fqns in object_keys.items():
        if all(f in values for f in fqns):
            objects[key] = _fill(_structure_of(key, fqns, md), values)
    tensors = [_tensor_source(source, fqn, tensor_keys[fqn]) for fqn in tensor_fqns]
    total = sum(numel(p.shape) * torch_dtype(t.dtype).itemsize for t in tensors for p in t.pieces)
    prog = Progress(f"import {source.src} -> {dst}", total, progress)
    manifest = write_checkpoint(os.fspath(dst), tensors, objects, block_size=block_size, progress=prog)
    prog.finish()
    log.info("imported %d tensor(s) and %d value(s) from DCP checkpoint %s into %s", len(tensors), len(objects),
             source.src, dst)
    return manifest


class _DcpSource:
    """A DCP checkpoint directory, opened with torch's FileSystemReader: its metadata, and its items
    read one at a time (a tensor chunk, a non-tensor value)."""

    def __init__(self, src: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        if not os.path.isfile(os.path.join(src, ".metadata")):
            raise CheckpointNotFoundError(f"{src} is not a DCP checkpoint (no .metadata file)")
        self.src = src
        self.reader = FileSystemReader(src)
        try:
            self.md = self.reader.read_metadata()
            self.reader.set_up_storage_reader(self.md, True)
        except Exception as e:
            raise CheckpointCorruptError(f"{src}: cannot read the DCP metadata: {type(e).__name__}: {e}") from None
        self.planner = _ChunkPlanner()

    def chunk(self, fqn: str, index: int, chunk: ChunkStorageMetadata, dtype: torch.dtype) -> torch.Tensor:
        """Chunk ``index`` of tensor ``fqn``, read whole."""
        sizes = tuple(int(s) for s in chunk.sizes)
        offsets = torch.Size(chunk.offsets)
        buf = torch.empty(sizes, dtype=dtype)
        self.planner.targets = {(fqn, tuple(offsets)): buf}
        zeros = torch.Size((0,) * len(sizes))
        item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, offsets), dest_offsets=zeros,
                        storage_index=MetadataIndex(fqn, offsets, index), storage_offsets=zeros,
                        lengths=torch.Size(sizes))
        try:
            self.reader.read_data(LoadPlan([item]), self.planner).wait()
        except Exception as e:
            raise CheckpointCorruptError(f"{self.src}: reading {fqn!r} chunk at {list(offsets)} failed: "
                                         f"{type(e).__name__}: {e}") from None
        self.planner.targets = {}
        return buf

    def value(self, fqn: str, index: int) -> Any:
        """The non-tensor item ``fqn`` (the ``index``-th), as ``torch.load(weights_only=True)`` reads it."""
        item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn), dest_offsets=torch.Size(()),
                        storage_index=MetadataIndex(fqn, None, index), storage_offsets=torch.Size(()),
                        lengths=torch.Size(()))
        self.reader.read_data(LoadPlan([item]), self.planner).wait()
        return self.planner.values.pop(fqn)


def _read_values(source: _DcpSource, byte_fqns: Sequence[str], unsupported_objects: str) -> Dict[str, Any]:
    """Every non-tensor item that is a JSON value, by its fqn; one that is not is refused
    (``unsupported_objects="error"``) or left out, logged (``"skip"``)."""
    values: Dict[str, Any] = {}
    for i, fqn in enumerate(byte_fqns):
        try:
            v = source.value(fqn, i)
            check_json(v, fqn)
            values[fqn] = to_json(v)
        except Exception as e:
            msg = (f"{source.src}: value {fqn!r} is not a JSON value that loads with weights_only=True "
                   f"({type(e).__name__}: {e})")
            if unsupported_objects == "error":
                raise CheckpointLoadError(
                    msg + "; pass unsupported_objects='skip' (--skip-unsupported) to leave it out") from None
            log.warning("%s; skipped", msg)
    return values


def _tensor_source(source: _DcpSource, fqn: str, key: str) -> TensorSource:
    """Tensor ``fqn`` as nostall key ``key``: one piece per DCP chunk, each read when its turn comes."""
    tmd = source.md.state_dict_metadata[fqn]
    assert isinstance(tmd, TensorStorageMetadata)  # called for tensors only
    code = dtype_code(tmd.properties.dtype)
    if code is None:
        raise CheckpointSaveError(
            f"{source.src}: tensor {fqn!r} has dtype {tmd.properties.dtype}, which nostall cannot store")
    dtype = tmd.properties.dtype
    pieces = []
    for idx, ch in enumerate(tmd.chunks):
        def produce(idx: int = idx, ch: ChunkStorageMetadata = ch) -> torch.Tensor:
            return source.chunk(fqn, idx, ch, dtype)

        pieces.append(PieceSource(tuple(int(x) for x in ch.offsets), tuple(int(x) for x in ch.sizes), produce))
    return TensorSource(key, code, tuple(int(x) for x in tmd.size), pieces)


def _structure_of(key: str, fqns: List[str], md: Metadata) -> Any:
    """The nested container (with markers for its leaves) of the JSON object ``key``."""
    paths = _paths(md)
    prefix = tuple(split_key(key)) if key else ()
    root: Dict[Any, Any] = {}
    for f in fqns:
        path = paths[f]
        rel = path[len(prefix):]
        if not rel:
            return _Marker(f)
        node = root
        for p in rel[:-1]:
            node = node.setdefault(p, {})
        node[rel[-1]] = _Marker(f)
    return _listify(root)
