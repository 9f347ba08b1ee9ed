"""The on-disk format: data files (safetensors), the manifest, checksums.

See ``docs/format.md`` for the specification. This module is the only place
that knows byte layouts and the manifest schema. It does no I/O and does not
import torch (the background writer process uses it).
"""

from __future__ import annotations

import gc
import json
import math
import re
from contextlib import contextmanager
import struct
from operator import itemgetter
from dataclasses import dataclass, field, replace
from typing import Callable, Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import crc32c as _crc32c

from nostall.core.boxes import cover_problem
from nostall.errors import CheckpointCorruptError

FORMAT_NAME = "nostall"
FORMAT_VERSION = 2
"""The newest version read and written. A manifest is written as version 1 unless it uses what version 2
added (references to files of earlier checkpoints, content digests): full saves stay readable by
every nostall."""
DIGEST_ALGORITHM = "xxh3-128"
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "crc32c"
DEFAULT_BLOCK_SIZE = 4 << 20
HEADER_ALIGN = 8

Shape = Tuple[int, ...]

ITEMSIZE: Dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
"""Item size in bytes of every dtype code (safetensors' codes)."""


def itemsize(code: str) -> int:
    try:
        return ITEMSIZE[code]
    except KeyError:
        raise CheckpointCorruptError(f"unknown dtype code {code!r} in checkpoint") from None


# --------------------------------------------------------------------------- checksums


def block_crcs(buf: memoryview, block_size: int) -> List[int]:
    """CRC32C of each consecutive ``block_size`` block of ``buf`` (last one shorter)."""
    n = len(buf)
    return [_crc32c.crc32c(buf[i : i + block_size]) for i in range(0, n, block_size)]


def crc(buf: Any) -> int:
    return _crc32c.crc32c(buf)


def digest_hasher() -> Any:
    """A streaming content digest (:data:`DIGEST_ALGORITHM`): ``.update(buf)``, ``.hexdigest()``.

    128 bits, so that equal digests prove equal bytes for every purpose short
    of an adversary crafting collisions (incremental saves reuse a piece's
    earlier bytes on that proof). Imported on first use: only incremental
    saves need it.
    """
    import xxhash

    return xxhash.xxh3_128()


def content_digest(buf: Any) -> str:
    """The hex :data:`DIGEST_ALGORITHM` digest of ``buf``."""
    h = digest_hasher()
    h.update(buf)
    return str(h.hexdigest())


# --------------------------------------------------------------------------- data files


@dataclass(frozen=True)
class FileEntry:
    """One tensor (piece) in a data file, as planned."""

    name: str
    dtype: str
    shape: Shape
    nbytes: int


def piece_name(key: str, offset: Sequence[int], shape: Sequence[int], global_shape: Sequence[int]) -> str:
    """Name of a piece inside its safetensors file (informational; the manifest rules)."""
    if tuple(shape) == tuple(global_shape):
        return key if key != "__metadata__" else key + "@"
    return f"{key}@{','.join(str(o) for o in offset)}"


def layout_file(
    entries: Sequence[FileEntry], metadata: Mapping[str, str]
) -> Tuple[bytes, Dict[str, Tuple[int, int]], int]:
    """Lay out a safetensors file.

    Entries are ordered by decreasing item size, then name, so that every
    tensor starts at a multiple of its item size. Returns the full header
    (length prefix included), the absolute ``[start, end)`` of each entry and
    the total file size.
    """
    header, ranges, size = layout_entries([(e.name, e.dtype, e.shape, e.nbytes) for e in entries], metadata)
    return header, {e.name: r for e, r in zip(entries, ranges)}, size


def layout_entries(
    entries: Sequence[Tuple[str, str, Shape, int]], metadata: Mapping[str, str]
) -> Tuple[bytes, List[Tuple[int, int]], int]:
    """:func:`layout_file` for ``(name, dtype, shape, nbytes)`` tuples: the absolute ``[start, end)``
    of each entry in the order given.

    The header is the text ``json.dumps(header, sort_keys=True, separators=(",", ":"))`` writes,
    assembled entry by entry (a plan can hold hundreds of thousands of entries).
    """
    n = len(entries)
    names = [e[0] for e in entries]
    codes = [e[1] for e in entries]
    for c in dict.fromkeys(codes):
        itemsize(c)  # an unknown code raises, as sorting by item size would
    if len(set(names)) != n or "__metadata__" in names:
        return _layout_slow(entries, metadata)  # raises for a repeated name; keeps an odd one as it was
    neg = {c: -ITEMSIZE[c] for c in set(codes)}
    order = [i for _, _, i in sorted(zip(map(neg.__getitem__, codes), names, range(n)))]
    shape_text: Dict[Shape, str] = {}
    code_text = {c: json.dumps(c) for c in neg}
    rel: List[Tuple[int, int]] = [(0, 0)] * n
    parts: List[Tuple[str, str]] = []
    pos = 0
    encode = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
    for i in order:
        name, code, shape, nbytes = entries[i]
        st = shape_text.get(shape)
        if st is None:
            if any(type(x) is not int for x in shape) or type(nbytes) is not int:
                return _layout_slow(entries, metadata)
            st = shape_text[shape] = ",".join(map(str, shape))
        end = pos + nbytes
        rel[i] = (pos, end)
        parts.append((name, f'{encode(name)}:{{"data_offsets":[{pos},{end}],"dtype":{code_text[code]},'
                            f'"shape":[{st}]}}'))
        pos = end
    meta = json.dumps(dict(metadata), sort_keys=True, separators=(",", ":"))
    parts.append(("__metadata__", f'"__metadata__":{meta}'))
    parts.sort()
    text = ("{" + ",".join([p for _, p in parts]) + "}").encode()
    pad = (-(8 + len(text))) % HEADER_ALIGN
    text += b" " * pad
    prefix = struct.pack("<Q", len(text))
    data_start = 8 + len(text)
    return prefix + text, [(data_start + a, data_start + b) for a, b in rel], data_start + pos


def _layout_slow(
    entries: Sequence[Tuple[str, str, Shape, int]], metadata: Mapping[str, str]
) -> Tuple[bytes, List[Tuple[int, int]], int]:
    """:func:`layout_entries` through ``json.dumps`` of the whole header (repeated or unusual names)."""
    order = sorted(entries, key=lambda e: (-itemsize(e[1]), e[0]))
    rel: Dict[str, Tuple[int, int]] = {}
    pos = 0
    header: Dict[str, Any] = {}
    for name, dtype, shape, nbytes in order:
        if name in header:
            raise ValueError(f"two pieces named {name!r} in one file")
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel[name] = (pos, pos + nbytes)
        pos += nbytes
    header["__metadata__"] = dict(metadata)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    pad = (-(8 + len(text))) % HEADER_ALIGN
    text += b" " * pad
    prefix = struct.pack("<Q", len(text))
    data_start = 8 + len(text)
    return prefix + text, [(data_start + rel[e[0]][0], data_start + rel[e[0]][1]) for e in entries], data_start + pos


def quick_tiles(global_shape: Sequence[int], boxes: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> bool:
    """True when ``boxes`` (offset, shape) certainly tile ``global_shape`` exactly, found cheaply; False
    when this cannot tell (ask :func:`~nostall.core.boxes.cover_problem`, which then decides).

    Recognises the layout of every 1-D sharding: all boxes non-empty, spanning every dimension whole
    but one, along which they are contiguous from 0 to its end. :func:`cover_problem` returns None for
    every layout this accepts.
    """
    g = tuple(global_shape)
    d = len(g)
    if d == 0 or not boxes:
        return False
    offs = [b[0] for b in boxes]
    shps = [b[1] for b in boxes]
    if set(map(len, offs)) != {d} or set(map(len, shps)) != {d} or min(map(min, shps)) <= 0:
        return False
    varying = []
    for k in range(d):
        get = itemgetter(k)
        if set(map(get, offs)) != {0} or set(map(get, shps)) != {g[k]}:
            varying.append(k)
    if not varying:
        return len(boxes) == 1
    if len(varying) > 1:
        return False
    get = itemgetter(varying[0])
    spans = sorted(zip(map(get, offs), map(get, shps)))
    starts = [a for a, _ in spans]
    ends = [a + n for a, n in spans]
    return starts[0] == 0 and ends[-1] == g[varying[0]] and starts[1:] == ends[:-1]


MAX_HEADER_BYTES = 100 << 20
"""Largest safetensors header accepted (the safetensors library's own limit)."""
MAX_MANIFEST_BYTES = 1 << 30
"""Largest manifest read; anything bigger is refused before it is read."""
MAX_MANIFEST_MEMORY = 4 << 30
"""Most memory the parse of a manifest (or safetensors header) may take, as estimated before parsing.

A real manifest is estimated at 12 to 15 bytes of memory per byte (1.7 to
1.9 KB per piece; it really takes about 1.1 KB), so this admits manifests of
over 2 million pieces. Raise it to load a genuine manifest that is bigger."""
JSON_MEMORY_FLOOR = 512 << 20
"""Estimated parse memory always accepted (below :data:`MAX_MANIFEST_MEMORY`), whatever the density."""
JSON_MEMORY_PER_BYTE = 40
"""Above the floor, the estimated parse memory may be at most this many times the text's size:
some 2.5 times a real manifest's density; more (many tiny containers) marks a hostile or damaged file."""


def json_memory_estimate(raw: Any) -> int:
    """An upper estimate of the memory ``json.loads(raw)`` takes, counted without parsing.

    Every ``{`` may become a dict (192 bytes with its slot), every ``[`` a
    list (96, with room for its first items), every ``,`` a further value (48:
    a number and its slot), every ``:`` a dict entry (64), every pair of ``"``
    a str (48 besides its characters); plus the text itself and its decoded
    copy. Characters inside strings are counted too (an overestimate).
    """
    b = raw.encode() if isinstance(raw, str) else raw
    return (2 * len(b) + 192 * b.count(b"{") + 96 * b.count(b"[") + 48 * b.count(b",") + 64 * b.count(b":")
            + 24 * b.count(b'"'))


def check_json_cost(raw: Any, path: str, what: str) -> None:
    """Refuse, before parsing, a JSON text whose parse could take too much memory (see :data:`MAX_MANIFEST_MEMORY`)."""
    est = json_memory_estimate(raw)
    cap = min(MAX_MANIFEST_MEMORY, max(JSON_MEMORY_FLOOR, JSON_MEMORY_PER_BYTE * len(raw)))
    if est > cap:
        raise CheckpointCorruptError(
            f"{path}: refused: parsing this {what} ({len(raw)} bytes) could take about {est >> 20} MiB of memory, "
            f"more than the {cap >> 20} MiB accepted (too many JSON values or containers for its size; a real "
            f"{what} is estimated at about 15 bytes per byte). It is damaged or not written by nostall: restore it "
            "or load another checkpoint (for a genuine one this big, raise nostall.core.format.MAX_MANIFEST_MEMORY)"
        )


def parse_file_header(raw: bytes, path: str) -> Tuple[Dict[str, Any], int]:
    """Parse a safetensors header from the first bytes of a file.

    ``raw`` must hold at least the 8-byte prefix and the header. Returns the
    header dict and the absolute offset where data starts.
    """
    if len(raw) < 8:
        raise CheckpointCorruptError(f"{path}: too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > MAX_HEADER_BYTES or len(raw) < 8 + n:
        raise CheckpointCorruptError(f"{path}: safetensors header length {n} is invalid or truncated")
    text = raw[8 : 8 + n]
    check_json_cost(text, path, "safetensors header")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{path}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path}: safetensors header is not an object")
    return header, 8 + n


# --------------------------------------------------------------------------- manifest

_new = object.__new__


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused: parsing a manifest or planning many ranks makes millions of
    objects in no cycle, and each collection they would trigger walks all of them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()



_BOX_RANK = itemgetter(0, 1, 2)  # a piece's (offset, shape, rank): the order of a record's pieces


@dataclass(frozen=True)
class PieceRecord:
    offset: Shape
    shape: Shape
    file: str
    start: int  # absolute byte offset in the file
    end: int
    crc32c: Tuple[int, ...]
    digest: str = ""
    """The piece's :data:`DIGEST_ALGORITHM` digest (hex), written by incremental saves; optional."""

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TensorRecord:
    key: str
    dtype: str
    shape: Shape
    sharded: bool
    pieces: Tuple[PieceRecord, ...]
    tied_to: str = ""
    """Non-empty: this key holds the very data of global tensor ``tied_to`` (tied weights, saved once);
    ``pieces`` are that tensor's pieces. Optional in the manifest (absent: not tied)."""


@dataclass(frozen=True)
class FileRecord:
    name: str
    rank: int
    size: int


@dataclass(frozen=True)
class RankRecord:
    tensors: Dict[str, TensorRecord]
    objects: Dict[str, Any]


MAX_SIDE_FILE_BYTES = 64 << 20
"""Largest side file: they are small files (configs, tokenizers) carried in the save job's message."""
_SIDE_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,254}")


def side_file_problem(name: Any) -> Optional[str]:
    """Why ``name`` cannot be a side file's name, or None.

    A relative path of at most 8 components of letters, digits and ``_.+=-``,
    none starting with a dot; not the manifest's name.

    >>> side_file_problem("huggingface/config.json") is None
    True
    >>> side_file_problem("../etc/passwd")
    "a component '..' starts with a dot or holds a character other than letters, digits and _.+=-"
    """
    if not isinstance(name, str) or not name:
        return "it is not a non-empty string"
    parts = name.split("/")
    if len(parts) > 8:
        return "it has more than 8 components"
    for c in parts:
        if not _SIDE_COMPONENT.fullmatch(c):
            return f"a component {c!r} starts with a dot or holds a character other than letters, digits and _.+=-"
    if name == MANIFEST_NAME:
        return "it is the manifest's name"
    return None


@dataclass(frozen=True)
class SideFileRecord:
    """A small file committed with the checkpoint (a model config, tokenizer files), at ``<checkpoint>/<name>``.

    ``stored``: where it is in the checkpoint when that differs from its name (object storage
    tags it with the save, as data files are, so that a re-save never overwrites a file an older
    manifest names); empty: at its name.
    """

    name: str
    size: int
    crc32c: int
    stored: str = ""

    @property
    def file(self) -> str:
        """Its path in the checkpoint."""
        return self.stored or self.name


@dataclass(frozen=True)
class Manifest:
    step: Optional[int]
    world_size: int
    block_size: int
    files: Dict[str, FileRecord]
    tensors: Dict[str, TensorRecord]
    objects: Dict[str, Any]
    per_rank: Tuple[RankRecord, ...]
    version: int = FORMAT_VERSION
    side_files: Dict[str, SideFileRecord] = field(default_factory=dict)
    references: Dict[str, FileRecord] = field(default_factory=dict)
    """Data files of earlier checkpoints of the same root that pieces of this one are read from
    (incremental saves), each named ``<checkpoint>/<file>`` relative to the root; ``files`` holds
    this checkpoint's own."""

    def all_files(self) -> Dict[str, FileRecord]:
        """Every data file the pieces are read from: own files by name, referenced ones as ``<checkpoint>/<file>``."""
        return {**self.files, **self.references} if self.references else self.files

    def uses_version_2(self) -> bool:
        """Whether this manifest needs format version 2 to be read (references or digests)."""
        return bool(self.references) or any(p.digest for t in self.tensors.values() for p in t.pieces) or any(
            p.digest for r in self.per_rank for t in r.tensors.values() for p in t.pieces)

    # ---------------------------------------------------------------- encode
    def to_json_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": 2 if self.uses_version_2() else 1,
            "step": self.step,
            "world_size": self.world_size,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_size": self.block_size},
            "files": {f.name: {"rank": f.rank, "size": f.size} for f in self.files.values()},
            "tensors": {k: _tensor_doc(t) for k, t in self.tensors.items()},
            "objects": self.objects,
            "per_rank": [
                {"tensors": {k: _tensor_doc(t) for k, t in r.tensors.items()}, "objects": r.objects}
                for r in self.per_rank
            ],
        }
        if self.side_files:  # only when there are any: manifests without them stay as they were
            doc["side_files"] = {
                f.name: {"size": f.size, "crc32c": f.crc32c, **({"stored": f.stored} if f.stored else {})}
                for f in self.side_files.values()
            }
        if self.references:  # version 2
            doc["references"] = {f.name: {"rank": f.rank, "size": f.size} for f in self.references.values()}
        return (json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True) + "\n").encode()

    def with_pieces(self, pieces: Iterable[Tuple[int, str, int, Shape, Shape, "Placed"]],
                    sizes: Mapping[str, FileRecord]) -> "Manifest":
        """The manifest of this skeleton (records without pieces) and the pieces every rank wrote.

        ``pieces``: (writing rank, key, the rank whose per-rank tensor it is or -1, global offset, shape,
        where its bytes are) of each piece written
        (the done records', :meth:`~nostall.core.jobs.Done.pieces`); each record's pieces sorted by
        (offset, shape), a tied key taking those of the key it is tied to. ``sizes``: every data file
        the pieces are in, own (``files``) and of earlier checkpoints (``<checkpoint>/<file>``,
        ``references``), with their actual sizes.

        Raises ValueError naming rank and key when a piece is of no key of the skeleton (a per-rank key
        only in its own rank's record), or a tensor is not covered exactly (a gap, an overlap, a
        piece twice): what the manifest promises is checked before it is published.
        """
        world = len(self.per_rank)
        glob: Dict[str, List[Tuple[Shape, Shape, int, PieceRecord]]] = {}
        own: List[Dict[str, List[Tuple[Shape, Shape, int, PieceRecord]]]] = [{} for _ in range(world)]
        tensors = self.tensors
        for rank, key, of, off, shp, w in pieces:
            rec = PieceRecord(off, shp, w.file, w.start, w.end, tuple(w.crc32c), w.digest)
            if of >= 0:
                if of >= world or key not in self.per_rank[of].tensors:
                    raise ValueError(f"rank {rank} wrote per-rank tensor {key!r} of rank {of}, which the plan does "
                                     "not have")
                own[of].setdefault(key, []).append((off, shp, rank, rec))
            else:
                t = tensors.get(key)
                if t is None or t.tied_to:
                    raise ValueError(f"rank {rank} wrote a piece {list(off)}+{list(shp)} of key {key!r}, which the "
                                     "plan does not have" + (f" (it is saved as {t.tied_to!r})" if t else ""))
                glob.setdefault(key, []).append((off, shp, rank, rec))

        def fill(t: TensorRecord, got: Optional[List[Tuple[Shape, Shape, int, PieceRecord]]]) -> TensorRecord:
            got = sorted(got or (), key=_BOX_RANK)
            boxes = [(o, s) for o, s, _, _ in got]
            if not quick_tiles(t.shape, boxes):
                problem = cover_problem(t.shape, boxes)
                if problem:
                    ranks = sorted({r for _, _, r, _ in got})
                    raise ValueError(f"key {t.key!r}: the pieces ranks {ranks} wrote do not cover it exactly: "
                                     f"{problem}")
            return replace(t, pieces=tuple(p for _, _, _, p in got))

        out_tensors = {}
        for k, t in tensors.items():
            out_tensors[k] = fill(t, glob.get(t.tied_to or k))
        return replace(
            self,
            tensors=out_tensors,
            per_rank=tuple(RankRecord({k: fill(t, own[r].get(k)) for k, t in rec.tensors.items()}, rec.objects)
                           for r, rec in enumerate(self.per_rank)),
            files={n: f for n, f in sizes.items() if "/" not in n},
            references={n: f for n, f in sizes.items() if "/" in n},
        )

    def without_pieces(self) -> "Manifest":
        """This manifest's skeleton: every record without its pieces (see :meth:`with_pieces`)."""
        return replace(
            self,
            tensors={k: replace(t, pieces=()) for k, t in self.tensors.items()},
            per_rank=tuple(RankRecord({k: replace(t, pieces=()) for k, t in r.tensors.items()}, r.objects)
                           for r in self.per_rank),
        )

    def renamed(self, name: Callable[[str], str]) -> "Manifest":
        """This manifest with every data file ``n`` called ``name(n)``."""

        def move(t: TensorRecord) -> TensorRecord:
            pieces = tuple(PieceRecord(p.offset, p.shape, name(p.file), p.start, p.end, p.crc32c) for p in t.pieces)
            return replace(t, pieces=pieces)

        return replace(
            self,
            files={name(n): FileRecord(name(n), f.rank, f.size) for n, f in self.files.items()},
            tensors={k: move(t) for k, t in self.tensors.items()},
            per_rank=tuple(RankRecord({k: move(t) for k, t in r.tensors.items()}, r.objects) for r in self.per_rank),
        )

    # ---------------------------------------------------------------- decode
    @classmethod
    def from_json_bytes(cls, raw: bytes, path: str) -> "Manifest":
        check_json_cost(raw, path, "manifest")
        with gc_paused():  # millions of objects in no cycle: collections would walk them again and again
            return cls._parse(raw, path)

    @classmethod
    def _parse(cls, raw: bytes, path: str) -> "Manifest":
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise CheckpointCorruptError(
                f"{path}: manifest is not valid JSON ({e}); the checkpoint is damaged: restore it or load another"
            ) from None
        try:
            return cls._from_doc(doc, path)
        except CheckpointCorruptError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise CheckpointCorruptError(
                f"{path}: malformed manifest ({what}); the checkpoint is damaged: restore it or load another"
            ) from None

    @classmethod
    def _from_doc(cls, doc: Any, path: str) -> "Manifest":
        """The manifest a parsed document describes, read section by section (each checked as it
        is read), then checked whole (:meth:`_check`)."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointCorruptError(f"{path}: not a nostall manifest")
        version, block_size = _version_and_block_size(doc, path)
        files = _files_section(doc, path)
        step = doc["step"]
        references = _references_section(doc, path, step)
        world_size = _int(doc["world_size"], "world_size")
        per_rank = []
        seen: Dict[Any, Any] = {}  # one object per distinct shape, offset, file name
        for i, r in enumerate(_list(doc["per_rank"], "per_rank")):
            r = _obj(r, f"per_rank[{i}]")
            per_rank.append(RankRecord(
                {k: _tensor_rec(k, t, seen) for k, t in _obj(r["tensors"], f"per_rank[{i}].tensors").items()},
                _obj(r["objects"], f"per_rank[{i}].objects"),
            ))
        side = _side_files_section(doc, path, files)
        m = cls(
            step=None if step is None else _int(step, "step"),
            world_size=world_size,
            block_size=block_size,
            files=files,
            tensors={k: _tensor_rec(k, t, seen) for k, t in _obj(doc["tensors"], "tensors").items()},
            objects=_obj(doc["objects"], "objects"),
            per_rank=tuple(per_rank),
            version=version,
            side_files=side,
            references=references,
        )
        m._check(path)
        return m

    def _check(self, path: str) -> None:
        if len(self.per_rank) != self.world_size:
            raise CheckpointCorruptError(
                f"{path}: per_rank has {len(self.per_rank)} entries, world_size {self.world_size}"
            )
        recs = list(self.tensors.values()) + [t for r in self.per_rank for t in r.tensors.values()]
        files = self.all_files()
        sizes: Dict[Shape, int] = {}  # elements per piece shape
        for t in recs:
            isz = itemsize(t.dtype)
            if any(g < 0 for g in t.shape):
                raise CheckpointCorruptError(f"{path}: key {t.key!r}: negative dimension in shape {list(t.shape)}")
            nd, block = len(t.shape), self.block_size
            for p in t.pieces:
                f = files.get(p.file)
                if f is None:
                    raise CheckpointCorruptError(f"{path}: key {t.key!r} refers to unknown file {p.file!r}")
                if len(p.offset) != nd or len(p.shape) != nd:
                    raise CheckpointCorruptError(f"{path}: key {t.key!r}: piece rank does not match tensor rank")
                for o, s, g in zip(p.offset, p.shape, t.shape):
                    if o < 0 or s < 0 or o + s > g:
                        raise CheckpointCorruptError(
                            f"{path}: key {t.key!r}: piece {p.offset}+{p.shape} outside {t.shape}")
                n = sizes.get(p.shape)
                if n is None:
                    n = sizes[p.shape] = math.prod(p.shape)
                if p.end - p.start != n * isz or p.start < 0 or p.end > f.size:
                    raise CheckpointCorruptError(
                        f"{path}: key {t.key!r}: byte range [{p.start}, {p.end}) of {p.file} is inconsistent"
                    )
                if len(p.crc32c) != -(-(p.end - p.start) // block):
                    raise CheckpointCorruptError(f"{path}: key {t.key!r}: wrong number of checksums")
            boxes = [(p.offset, p.shape) for p in t.pieces]
            problem = None if quick_tiles(t.shape, boxes) else cover_problem(t.shape, boxes)
            if problem:
                raise CheckpointCorruptError(f"{path}: key {t.key!r}: {problem}")
        for r in self.per_rank:
            for t in r.tensors.values():
                if t.tied_to:
                    raise CheckpointCorruptError(
                        f"{path}: per-rank key {t.key!r} says it is tied to {t.tied_to!r}, but only global tensors "
                        "may be tied; the manifest is damaged: restore it or load another checkpoint"
                    )
        for t in self.tensors.values():
            if t.tied_to:
                self._check_tie(t, path)

    def _check_tie(self, t: TensorRecord, path: str) -> None:
        """A tied key must name an untied global tensor of the same dtype, shape and sharding whose pieces are
        exactly its own (same boxes, byte ranges and checksums)."""
        a = self.tensors.get(t.tied_to)
        why = ""
        if a is None:
            why = "there is no such global tensor"
        elif a.key == t.key:
            why = "a key cannot be tied to itself"
        elif a.tied_to:
            why = f"that key is itself tied to {a.tied_to!r}"
        elif (a.dtype, a.shape, a.sharded) != (t.dtype, t.shape, t.sharded):
            why = (f"that key is {a.dtype} {list(a.shape)} sharded={a.sharded}, this one {t.dtype} {list(t.shape)} "
                   f"sharded={t.sharded}")
        elif _piece_set(a) != _piece_set(t):
            why = "their pieces differ (a tied key must list exactly the pieces of the key it is tied to)"
        if why:
            raise CheckpointCorruptError(
                f"{path}: key {t.key!r} is tied to {t.tied_to!r}, but {why}; the manifest is damaged: restore it "
                "or load another checkpoint"
            )


def _piece_set(t: TensorRecord) -> List[Tuple[Any, ...]]:
    return sorted((p.offset, p.shape, p.file, p.start, p.end, p.crc32c) for p in t.pieces)


def _tensor_doc(t: TensorRecord) -> Dict[str, Any]:
    doc: Dict[str, Any] = {
        "dtype": t.dtype,
        "shape": list(t.shape),
        "sharded": t.sharded,
        "pieces": [
            {
                "offset": list(p.offset),
                "shape": list(p.shape),
                "file": p.file,
                "byte_range": [p.start, p.end],
                "crc32c": list(p.crc32c),
                **({"xxh3_128": p.digest} if p.digest else {}),
            }
            for p in t.pieces
        ],
    }
    if t.tied_to:
        doc["tied_to"] = t.tied_to  # only when tied: an untied tensor's entry is as before this field existed
    return doc


def _version_and_block_size(doc: Dict[str, Any], path: str) -> Tuple[int, int]:
    """A manifest's format version (one this nostall reads) and checksum block size (a positive
    multiple of 8, of the one checksum algorithm)."""
    version = int(doc["version"])
    if version > FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{path}: format version {version} is newer than this nostall supports ({FORMAT_VERSION})"
        )
    cs = doc["checksum"]
    if cs["algorithm"] != CHECKSUM_ALGORITHM:
        raise CheckpointCorruptError(f"{path}: unknown checksum algorithm {cs['algorithm']!r}")
    block_size = int(cs["block_size"])
    if block_size <= 0 or block_size % 8:
        raise CheckpointCorruptError(f"{path}: invalid checksum block size {block_size}")
    return version, block_size


def _files_section(doc: Dict[str, Any], path: str) -> Dict[str, FileRecord]:
    """A manifest's own data files, each named by one path component of the checkpoint directory
    (anything else is damage: it could name a path outside the checkpoint)."""
    files = {}
    for n, f in _obj(doc["files"], "files").items():
        if data_file_problem(n):
            raise CheckpointCorruptError(
                f"{path}: invalid data file name {n!r}; the manifest is damaged: restore it or load another "
                "checkpoint"
            )
        f = _obj(f, f"files[{n!r}]")
        files[n] = FileRecord(n, _int(f["rank"], "rank"), _int(f["size"], "size"))
    return files


def _references_section(doc: Dict[str, Any], path: str, step: Any) -> Dict[str, FileRecord]:
    """A manifest's referenced files (version 2): each ``<checkpoint>/<file>`` of an earlier
    checkpoint of the same run root, so a checkpoint that records no step has none."""
    references = {}
    own_step = step if type(step) is int else None
    for n, f in _obj(doc.get("references", {}), "references").items():
        problem = reference_problem(n, own_step) or (
            None if step is not None else "a checkpoint that records no step (a one-shot save) is not in a "
                                          "run root: it has no earlier checkpoints to read from")
        if problem:
            raise CheckpointCorruptError(f"{path}: invalid referenced file {n!r} ({problem}); the manifest is "
                                         "damaged: restore it or load another checkpoint")
        f = _obj(f, f"references[{n!r}]")
        references[n] = FileRecord(n, _int(f["rank"], "rank"), _int(f["size"], "size"))
    return references


def _side_files_section(doc: Dict[str, Any], path: str, files: Mapping[str, FileRecord]
                        ) -> Dict[str, SideFileRecord]:
    """A manifest's side files; neither a side file's name nor the name it is stored under may be
    invalid or a data file's."""
    side = {}
    for n, f in _obj(doc.get("side_files", {}), "side_files").items():
        problem = side_file_problem(n) or ("it is also a data file's name" if n in files else None)
        if problem:
            raise CheckpointCorruptError(f"{path}: invalid side file name {n!r} ({problem}); the manifest is "
                                         "damaged: restore it or load another checkpoint")
        f = _obj(f, f"side_files[{n!r}]")
        stored = f.get("stored", "")
        problem = "" if stored == "" else (side_file_problem(stored)
                                           or ("it is also a data file's name" if stored in files else None))
        if problem:
            raise CheckpointCorruptError(f"{path}: side file {n!r}: invalid stored name {stored!r} ({problem}); "
                                         "the manifest is damaged: restore it or load another checkpoint")
        side[n] = SideFileRecord(n, _int(f["size"], "size"), _int(f["crc32c"], "crc32c"), stored)
    return side


def _obj(x: Any, what: str) -> Dict[str, Any]:
    if not isinstance(x, dict):
        raise TypeError(f"{what!r} must be a JSON object, not {_json_type(x)}")
    return x


def _list(x: Any, what: str) -> List[Any]:
    if not isinstance(x, list):
        raise TypeError(f"{what!r} must be a JSON array, not {_json_type(x)}")
    return x


def _int(x: Any, what: str) -> int:
    if type(x) is not int:
        raise TypeError(f"{what!r} must be an integer, not {_json_type(x)}")
    return x


def _ints(x: Any, key: str, field: str, seen: Optional[Dict[Any, Any]] = None) -> Tuple[int, ...]:
    """The integers of JSON array ``x`` (field ``field`` of ``key``: named only in an error, the message made then)
    as a tuple; with ``seen``, one tuple kept per distinct value (a manifest repeats a few shapes and offsets
    over millions of pieces)."""
    if type(x) is not list:
        raise TypeError(f"'{key}: {field}' must be a JSON array, not {_json_type(x)}")
    t = tuple(x)
    for v in t:
        if type(v) is not int:
            raise TypeError(f"'{key}: {field}' must be an integer, not {_json_type(v)}")
    if seen is None:
        return t
    got: Tuple[int, ...] = seen.setdefault(t, t)
    return got


def _json_type(x: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(x), type(x).__name__)


def _tensor_rec(key: str, t: Any, seen: Dict[Any, Any]) -> TensorRecord:
    """The record of ``key`` in a parsed manifest, every field checked (``seen``: see :func:`_ints`)."""
    t = _obj(t, f"tensor {key}")
    pieces = []
    for p in _list(t["pieces"], f"{key}: pieces"):
        if type(p) is not dict:
            raise TypeError(f"'{key}: piece' must be a JSON object, not {_json_type(p)}")
        byte_range = p["byte_range"]
        if type(byte_range) is not list or len(byte_range) != 2:
            byte_range = _ints(byte_range, key, "byte_range")
            raise ValueError(f"{key!r}: byte_range must hold 2 integers, not {len(byte_range)}")
        start, end = byte_range
        if type(start) is not int or type(end) is not int:
            _ints(byte_range, key, "byte_range")
        file = p["file"]
        if type(file) is not str:
            raise TypeError(f"{key!r}: file must be a string, not {_json_type(file)}")
        file = seen.setdefault(file, file)  # one string per file, as for shapes
        rec = _new(PieceRecord)  # PieceRecord(...) without the frozen dataclass's per-field setattr
        rec.__dict__.update(offset=_ints(p["offset"], key, "offset", seen),
                            shape=_ints(p["shape"], key, "shape", seen), file=file, start=start, end=end,
                            crc32c=_ints(p["crc32c"], key, "crc32c"), digest=_digest(p.get("xxh3_128", ""), key))
        pieces.append(rec)
    code = t["dtype"]
    if not isinstance(code, str):
        raise TypeError(f"{key!r}: dtype must be a string, not {_json_type(code)}")
    itemsize(code)
    sharded = t["sharded"]
    if not isinstance(sharded, bool):
        raise TypeError(f"{key!r}: sharded must be a boolean, not {_json_type(sharded)}")
    tied_to = t.get("tied_to", "")
    if not isinstance(tied_to, str) or ("tied_to" in t and not tied_to):
        what = "an empty string" if tied_to == "" else _json_type(tied_to)
        raise TypeError(f"{key!r}: tied_to must be a non-empty string (a key), not {what}")
    return TensorRecord(key, code, _ints(t["shape"], key, "shape", seen), sharded, tuple(pieces), tied_to)


def _digest(x: Any, key: str) -> str:
    if x == "":
        return ""
    if not isinstance(x, str) or not _DIGEST.fullmatch(x):
        raise ValueError(f"{key!r}: xxh3_128 must be 32 lowercase hex digits")
    return x


_DIGEST = re.compile(r"[0-9a-f]{32}")
def data_file_problem(name: Any) -> Optional[str]:
    """Why ``name`` cannot be a data file's name in a checkpoint directory, or None.

    >>> data_file_problem("rank0.safetensors") is None
    True
    >>> data_file_problem("../x")
    'it must be one non-empty path component, not starting with a dot, not the manifest'
    """
    if (not isinstance(name, str) or not name or "/" in name or "\x00" in name or name.startswith(".")
            or name == MANIFEST_NAME):
        return "it must be one non-empty path component, not starting with a dot, not the manifest"
    return None


def reference_problem(name: Any, own_step: Optional[int] = None) -> Optional[str]:
    """Why ``name`` cannot name a data file of an earlier checkpoint of the root, or None.

    A reference is ``step_<N>/<file>``: ``step_<N>`` a checkpoint directory's name (decimal ``N``, no
    padding) other than the referring checkpoint's own (``own_step``; None: not checked), ``<file>`` a
    data file's name (one path component, not starting with a dot, not the manifest).

    >>> reference_problem("step_5/rank0.1f2e3d4c5b6a7988.safetensors") is None
    True
    >>> reference_problem("../../etc/passwd")
    'it must be step_<N>/<file>, <file> one path component not starting with a dot'
    >>> reference_problem("userdir/rank0.safetensors")
    "'userdir' is not a checkpoint of the root: a reference names step_<N> (decimal N, no padding)"
    >>> reference_problem("step_5/rank0.safetensors", own_step=5)
    'step_5 is this checkpoint itself: a reference names a file of another checkpoint of the root'
    """
    parts = name.split("/") if isinstance(name, str) else []
    if len(parts) != 2 or any(data_file_problem(x) for x in parts):
        return "it must be step_<N>/<file>, <file> one path component not starting with a dot"
    if not _STEP_DIR.fullmatch(parts[0]):
        return f"{parts[0]!r} is not a checkpoint of the root: a reference names step_<N> (decimal N, no padding)"
    if own_step is not None and parts[0] == f"step_{own_step}":
        return f"{parts[0]} is this checkpoint itself: a reference names a file of another checkpoint of the root"
    return None


_STEP_DIR = re.compile(r"step_(0|[1-9][0-9]{0,18})")
"""A checkpoint directory's name in a run root (the rule of ``nostall.storage.root.parse_step``)."""


@dataclass(frozen=True)
class Placed:
    """Where a planned piece's bytes are once a save has written it: ``file`` (an own data file, or
    ``<checkpoint>/<file>`` of an earlier checkpoint of the root), the byte range, checksums, digest."""

    file: str
    start: int
    end: int
    crc32c: Tuple[int, ...]
    digest: str = ""


def data_file_name(rank: int) -> str:
    return f"rank{rank}.safetensors"
