"""``nostall verify``: re-read every byte of a checkpoint and report every problem, without torch."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from nostall.core.format import MAX_HEADER_BYTES, Manifest, PieceRecord, TensorRecord, crc, parse_file_header
from nostall.errors import CheckpointError
from nostall.loading.manifests import read_manifest, read_side_file
from nostall.loading.sources import DataFiles, open_files, verify_window

__all__ = ["VerifyReport", "check_checkpoint"]


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
    files = open_files(path, m, storage_options)
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
