"""Self-contained copies of one checkpoint (``nostall copy SRC DST``).

An incremental checkpoint (``CheckpointManager(root, incremental=True)``) reads
the pieces that did not change from data files of earlier checkpoints of its
root (``Manifest.references``): on its own, its directory is not a checkpoint.
:func:`copy_checkpoint` writes one that is: every piece the checkpoint reads,
from its own files and from referenced ones, lands in DST's own data files,
and DST's manifest names only those (no references). It is how a checkpoint
is handed to someone else or moved between buckets, and it works the same for
a checkpoint that references nothing (then it is a plain copy).

What is copied: exactly the byte ranges of the pieces, not whole files. A
referenced file often holds pieces the checkpoint does not read (those that
changed since it was written), so copying whole files would carry stale
bytes along and make the copy grow with the chain. The pieces of each rank
are packed into one plain safetensors file per rank, ``rank<N>.safetensors``
(``rank<N>.<id>.safetensors`` on object storage or when replacing a
checkpoint, as saves name them there; header laid out as the planner lays it
out, entries named as it names them), so DST looks like a full save of the
same state.
Each piece keeps its checksums (they are per block from the piece's first
byte, so moving a piece does not change them); the per-piece content digests
of incremental saves are dropped, so the copy's manifest is format version 1,
readable by every nostall. Every block read is checked against its checksum
before it is written: a damaged source is reported, never copied.

How it is written: as a save is (:func:`nostall.saving.commit.run_job` with a world
of one), staged beside DST (a directory) or under a local scratch directory
(object storage) and committed by renaming the staging directory into place
(a directory) or uploading the manifest last (object storage); a crash leaves
no half copy that loads. DST must not exist, or be an empty directory, or,
with ``overwrite=True``, be a nostall checkpoint (replaced atomically); any
other existing directory, file or symbolic link is refused, and so is a DST
inside SRC, holding it, or in a checkpoint SRC reads (:func:`_check_apart`),
before anything is written. Nothing is followed through a symbolic link. The copy never moves a run root's
``latest``: copied into a run root as ``step_<N>``, it is loaded by asking
for that step.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from nostall.storage.locate import local_path, resolve, split_checkpoint
from nostall.storage.root import Root
from nostall.saving.datafiles import Writer
from nostall.saving.solo import save_solo, solo_destination
from nostall.errors import CheckpointCorruptError, CheckpointError, CheckpointSaveError
from nostall.core.format import (
    FileRecord,
    Manifest,
    PieceRecord,
    Placed,
    RankRecord,
    SideFileRecord,
    TensorRecord,
    crc,
    data_file_name,
    layout_entries,
    piece_name,
)
from nostall.core.jobs import Destination, FileJob, SaveJob, Written
from nostall.loading.manifests import read_manifest, read_side_file
from nostall.loading.sources import DataFiles, open_files, verify_window
from nostall.storage.files import FileWriter

__all__ = ["CopyReport", "copy_checkpoint"]

ProgressFn = Callable[[int, int], None]
"""progress(done_bytes, total_bytes), called as the copy advances."""

_TIMEOUT_S = 7 * 24 * 3600.0  # the job's deadline: a copy is bounded by the storage's own timeouts, not by this


@dataclass
class CopyReport:
    """What :func:`copy_checkpoint` wrote.

    ``src``: the checkpoint copied (a run root resolved to its latest);
    ``referenced``: the files of earlier checkpoints of its root that pieces
    were read from (``<checkpoint>/<file>``, empty for a full checkpoint);
    ``files``: DST's data files; ``bytes``: tensor bytes copied (each piece
    once, tied keys counted once); ``own_bytes`` / ``referenced_bytes``: how
    many of them came from SRC's own files and from earlier checkpoints'.
    """

    src: str
    dst: str
    files: List[str] = field(default_factory=list)
    bytes: int = 0
    own_bytes: int = 0
    referenced_bytes: int = 0
    referenced: List[str] = field(default_factory=list)
    side_files: int = 0

    def to_json(self) -> Dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "files": self.files, "bytes": self.bytes,
                "own_bytes": self.own_bytes, "referenced_bytes": self.referenced_bytes,
                "referenced": self.referenced, "side_files": self.side_files}


@dataclass
class _Out:
    """One piece to copy: where it is in SRC, where it goes in DST."""

    src: PieceRecord
    dtype: str
    name: str  # its safetensors entry in DST
    start: int = 0  # where it lands in DST's file (absolute), once laid out
    end: int = 0


_Plan = Dict[int, Dict[Tuple[str, int, int], _Out]]
"""Per rank of DST's files: each distinct piece of SRC (file, start, end) -> where it goes."""
_Entries = Dict[int, Tuple[bytes, int, List[_Out]]]
"""Per rank of DST's files: the file's header, its size, its pieces in file order."""


def _place(path: str, *, follow_last: bool) -> str:
    """Where ``path`` is, for comparing places: an object-storage URL normalized (scheme in lower case, no
    empty component, no trailing ``/``); a local path absolute, its parents' symbolic links resolved, and
    the last component's too only with ``follow_last`` (a destination that is a link is refused as one later,
    and nothing is ever written through it)."""
    if local_path(path) is None:
        scheme, _, rest = str(path).partition("://")
        return f"{scheme.lower()}://" + "/".join(c for c in rest.split("/") if c)
    full = os.path.abspath(os.fspath(path))
    if follow_last:
        return os.path.realpath(full)
    return os.path.join(os.path.realpath(os.path.dirname(full)), os.path.basename(full))


def _within(inner: str, outer: str) -> bool:
    """Whether place ``inner`` is ``outer`` or under it (places as :func:`_place` gives them)."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _endpoint(so: Optional[Dict[str, Any]]) -> Any:
    so = so or {}
    return (so.get("client_kwargs") or {}).get("endpoint_url") or so.get("endpoint_url")


def _check_apart(src: str, dst: str, m: Manifest, so: Optional[Dict[str, Any]],
                 dso: Optional[Dict[str, Any]]) -> None:
    """Refuse a ``dst`` that is the checkpoint ``src`` (manifest ``m``) or a checkpoint whose files it reads
    (an incremental one's earlier checkpoints), is inside one of them, or holds one: the copy would be written
    into what it reads, or replacing ``dst`` would delete it. Real paths are compared (symbolic links of
    ``dst``'s parents resolved), object-storage URLs normalized; nothing is written before this check."""
    if (local_path(src) is None) != (local_path(dst) is None):
        return
    if local_path(src) is None and dso is not so and _endpoint(dso) != _endpoint(so):
        return  # another endpoint: another store (the same URL there is another object)
    to = _place(dst, follow_last=False)
    me = _place(src, follow_last=True)
    parent = split_checkpoint(src, so)[0].url  # where the loader finds the references
    read = [(me, f"the checkpoint being copied ({src})")]
    for ck in sorted({n.split("/")[0] for n in m.references}):
        read.append((_place(f"{parent}/{ck}", follow_last=True),
                     f"{parent}/{ck}, a checkpoint whose files the incremental checkpoint being copied ({src}) reads"))
    fix = "name a destination outside it"
    for place, what in read:
        if to == place:
            raise CheckpointSaveError(f"copy: {dst} is {what}; name another destination")
        if _within(to, place):
            raise CheckpointSaveError(f"copy: {dst} is inside {what}: the copy would be written into what it "
                                      f"reads; {fix}")
        if _within(place, to):
            raise CheckpointSaveError(f"copy: {what} is inside {dst}: writing the copy there would replace what "
                                      f"it reads; {fix}")


def _records(m: Manifest) -> List[Tuple[TensorRecord, bool]]:
    """Every tensor record (global, then per rank) and whether it is global; untied first."""
    out = [(t, True) for _, t in sorted(m.tensors.items()) if not t.tied_to]
    out += [(t, True) for _, t in sorted(m.tensors.items()) if t.tied_to]
    for r in m.per_rank:
        out += [(t, False) for _, t in sorted(r.tensors.items())]
    return out


def _plan(m: Manifest) -> _Plan:
    """Per rank of DST's files: each distinct piece of SRC (file, start, end) and its entry name."""
    files = m.all_files()
    by_rank: _Plan = {}
    names: Dict[int, Set[str]] = {}
    for rec, is_global in _records(m):
        for p in rec.pieces:
            k = (p.file, p.start, p.end)
            rank = files[p.file].rank
            outs = by_rank.setdefault(rank, {})
            if k in outs:  # a tied key's pieces, or a piece listed twice: copied once
                continue
            base = piece_name(rec.key, p.offset, p.shape, rec.shape) if is_global else rec.key
            taken = names.setdefault(rank, set())
            name, n = base, 1
            while name in taken:  # cannot happen for a manifest a save wrote; kept unique regardless
                n += 1
                name = f"{base}#{n}"
            taken.add(name)
            outs[k] = _Out(p, rec.dtype, name)
    return by_rank


def _replaces(dst: str, root: Root, name: str, overwrite: bool) -> bool:
    """Whether a checkpoint is at DST, to be replaced (refused unless ``overwrite``)."""
    if not root.is_checkpoint(name):
        return False
    if not overwrite:
        raise CheckpointSaveError(f"{dst} is a nostall checkpoint already: pass --overwrite (overwrite=True) to "
                                  "replace it, or choose another destination")
    return True


def _check_destination(dst: str, root: Root, name: str, overwrite: bool,
                       storage_options: Optional[Dict[str, Any]]) -> bool:
    """Refuse a DST that is not ours to write (see the module docstring); remove an empty directory.
    Whether a checkpoint is there (to be replaced)."""
    if not name or name in (".", "..") or name.startswith("."):
        raise CheckpointSaveError(f"{dst}: not a usable checkpoint name ({name!r}): name a directory such as "
                                  "ckpt_copy/ or s3://bucket/prefix/step_100")
    fix = "choose another destination, or remove it first"
    if local_path(dst) is None:
        if _replaces(dst, root, name, overwrite):
            return True
        if root.entries(name):
            raise CheckpointSaveError(f"{dst} holds objects and is not a nostall checkpoint (no nostall "
                                      f"manifest.json there); refusing to write into it: {fix}")
        return False
    try:
        mode: Optional[int] = os.lstat(dst).st_mode
    except FileNotFoundError:
        mode = None
    if mode is None:
        return False
    if stat.S_ISLNK(mode):
        raise CheckpointSaveError(f"{dst} is a symbolic link: nostall never writes through one; {fix}")
    if not stat.S_ISDIR(mode):
        raise CheckpointSaveError(f"{dst} exists and is not a directory; {fix}")
    if _replaces(dst, root, name, overwrite):
        return True
    if os.listdir(dst):
        raise CheckpointSaveError(f"{dst} exists and is not a nostall checkpoint (no nostall manifest.json in "
                                  f"it); refusing to replace it: {fix}")
    os.rmdir(dst)  # an empty directory: the copy is renamed into its place
    return False


def _copy_piece(files: DataFiles, o: _Out, out: FileWriter, buf: memoryview, block_size: int, where: str) -> None:
    """Copy one piece from SRC to the end of ``out``, every block checked against its checksum first."""
    p = o.src
    window = len(buf)
    for lo in range(0, p.nbytes, window):
        n = min(window, p.nbytes - lo)
        view = files.read(p.file, p.start + lo, n, buf[:n])
        for i in range(0, n, block_size):
            b = (lo + i) // block_size
            if crc(view[i : i + block_size]) != p.crc32c[b]:
                a = p.start + b * block_size
                raise CheckpointCorruptError(
                    f"{files.path(p.file)}: checksum mismatch in bytes [{a}, {min(a + block_size, p.end)}) "
                    f"(entry {o.name!r}): the source is damaged, nothing was copied; run 'nostall verify {where}' "
                    "for every problem, and copy from an intact replica"
                )
        out.write(view[:n])


def copy_checkpoint(src: str, dst: str, *, overwrite: bool = False,
                    storage_options: Optional[Dict[str, Any]] = None,
                    dst_storage_options: Optional[Dict[str, Any]] = None,
                    progress: Optional[ProgressFn] = None, dst_root: Optional[Root] = None) -> CopyReport:
    """Write a self-contained copy of the checkpoint ``src`` at ``dst`` (see the module docstring).

    Args:
        src: a checkpoint directory or URL, or a run root (its latest checkpoint).
        dst: the new checkpoint's directory or URL (``s3://...``); it must not
            exist, or be an empty directory, or be a nostall checkpoint (then
            only with ``overwrite``).
        overwrite: replace a nostall checkpoint at ``dst``.
        storage_options: fsspec options for an object-storage ``src`` (and ``dst``).
        dst_storage_options: for ``dst`` when they differ (default: ``storage_options``).
        progress: ``progress(done_bytes, total_bytes)`` after each piece.
        dst_root: the root ``dst`` is a checkpoint of (``<root>/step_<N>``), opened by the caller, instead of the
            one ``dst``'s location opens (a directory alone, taken under its lock when it is a managed root's
            checkpoint): the memory tier's persist, which holds the managed root's lock already, commits there
            as a save of that root does (``nostall.memory.persist``).

    Raises :class:`~nostall.CheckpointCorruptError` naming the file when a
    byte read does not match its checksum or a referenced file is missing
    (nothing is committed then), :class:`~nostall.CheckpointSaveError` for a
    destination that cannot be written.

    Example::

        >>> import os, tempfile, torch, nostall
        >>> from nostall.interop.copy import copy_checkpoint
        >>> d = tempfile.mkdtemp()
        >>> with nostall.CheckpointManager(os.path.join(d, "run"), incremental=True) as m:
        ...     for step in (1, 2):
        ...         _ = m.save(step, {"frozen": torch.ones(1000), "w": torch.full((4,), float(step))})
        >>> r = copy_checkpoint(os.path.join(d, "run"), os.path.join(d, "mine"))
        >>> [n.split("/")[0] for n in r.referenced]   # step 2 reads 'frozen' from step 1's file
        ['step_1']
        >>> nostall.load({"frozen": torch.empty(1000), "w": torch.empty(4)}, os.path.join(d, "mine"))["w"]
        tensor([2., 2., 2., 2.])
    """
    dso = dst_storage_options if dst_storage_options is not None else storage_options
    src_path, dst, m, dest = _endpoints(src, dst, overwrite, storage_options, dso, dst_root)
    plan = _plan(m)
    entries = _lay_out(m, plan)
    side = tuple((r.name, read_side_file(src_path, r, storage_options))
                 for r in sorted(m.side_files.values(), key=lambda r: r.name))
    manifest = _skeleton(m, plan, entries, _side_records(m, side, dest))
    jobs = tuple(FileJob(data_file_name(r), 0, size, len(header), tuple((o.start, o.end) for o in order))
                 for r, (header, size, order) in sorted(entries.items()))
    total = sum(o.src.nbytes for _, _, order in entries.values() for o in order)
    write = _writer(src_path, m, storage_options, entries, total, progress)
    save_solo(dst, dest, manifest, jobs, write, side_files=side, what=f"copy of {src_path} to {dst}",
              keep_errors=(CheckpointError,))  # a damaged source is reported as it is
    used = {k for outs in plan.values() for k in outs}
    own = sum(e - s for f, s, e in used if "/" not in f)
    return CopyReport(
        src=src_path, dst=dst, files=sorted(read_manifest(dst, dso).files), bytes=total, own_bytes=own,
        referenced_bytes=total - own, referenced=sorted(n for n in m.all_files() if "/" in n), side_files=len(side),
    )


def _endpoints(src: str, dst: str, overwrite: bool, so: Optional[Dict[str, Any]],
               dso: Optional[Dict[str, Any]],
               dst_root: Optional[Root] = None) -> Tuple[str, str, Manifest, Destination]:
    """The checkpoint to copy (its path and manifest), DST as the copy names it, and where the copy
    goes: every refusal of a DST (:func:`_check_apart`, :func:`_check_destination`) before anything
    is written. A new directory gets plain names (rank0.safetensors, config.json: as nostall.save
    writes them); replacing a checkpoint, names carry the copy's id, so that none is a name the
    replaced one used (object storage: always)."""
    sroot, sname, _ = resolve(os.fspath(src), storage_options=so)
    src_path = sroot.path(sname)
    dst = os.fspath(dst)
    if local_path(dst) is None:
        dst = dst.rstrip("/")
    m = read_manifest(src_path, so)
    _check_apart(src_path, dst, m, so, dso)
    droot, dname = split_checkpoint(dst, dso)
    if dst_root is not None:
        if dst_root.path(dname) != dst:
            raise CheckpointSaveError(f"copy: {dst} is not a checkpoint of the root {dst_root.url}")
        droot = dst_root
    replacing = _check_destination(dst, droot, dname, overwrite, dso)
    return src_path, dst, m, solo_destination(droot, dname, m.step, tagged=replacing)


def _lay_out(m: Manifest, plan: _Plan) -> _Entries:
    """Per rank of DST's files: the file's header and size, and its pieces in file order (each
    :class:`_Out` given its place), laid out as the planner lays a save's file out."""
    entries: _Entries = {}
    for rank, outs in sorted(plan.items()):
        order = list(outs.values())
        header, ranges, size = layout_entries(
            [(o.name, o.dtype, o.src.shape, o.src.nbytes) for o in order],
            {"format": "nostall", "rank": str(rank), "world_size": str(m.world_size)})
        for o, (a, b) in zip(order, ranges):
            o.start, o.end = a, b
        entries[rank] = (header, size, sorted(order, key=lambda o: o.start))
    return entries


def _side_records(m: Manifest, side: Tuple[Tuple[str, bytes], ...], dest: Destination) -> Dict[str, SideFileRecord]:
    """The manifest's record of each side file copied, under the name DST stores it by."""
    side_recs = {}
    for n, data in side:
        s = dest.root.data_name(dest, n)
        side_recs[n] = SideFileRecord(n, len(data), m.side_files[n].crc32c, "" if s == n else s)
    return side_recs


def _skeleton(m: Manifest, plan: _Plan, entries: _Entries, side_recs: Dict[str, SideFileRecord]) -> Manifest:
    """DST's manifest skeleton: SRC's, every piece moved to where DST's files hold it. The skeleton
    names each piece where it is planned (rank<N>.safetensors); the commit puts the stored names in
    from what was written (Manifest.with_pieces, through save_solo), as for a save."""
    rank_of = {n: f.rank for n, f in m.all_files().items()}

    def moved(t: TensorRecord) -> TensorRecord:
        pieces = []
        for p in t.pieces:
            r = rank_of[p.file]
            o = plan[r][(p.file, p.start, p.end)]
            pieces.append(PieceRecord(p.offset, p.shape, data_file_name(r), o.start, o.end, p.crc32c))
        return replace(t, pieces=tuple(pieces))

    return Manifest(
        step=m.step, world_size=m.world_size, block_size=m.block_size,
        files={data_file_name(r): FileRecord(data_file_name(r), r, size) for r, (_, size, _) in entries.items()},
        tensors={k: moved(t) for k, t in m.tensors.items()},
        objects=m.objects,
        per_rank=tuple(RankRecord({k: moved(t) for k, t in r.tensors.items()}, r.objects) for r in m.per_rank),
        side_files=side_recs,
    )


def _writer(src_path: str, m: Manifest, so: Optional[Dict[str, Any]], entries: _Entries, total: int,
            progress: Optional[ProgressFn]) -> Writer:
    """The copy's writer: each of DST's files written into the staging, header then pieces, every
    block read from SRC checked against its checksum first."""
    done = [0]

    def write(job: SaveJob, staging: str, base: Any) -> Written:
        w = Written()
        files = open_files(src_path, m, so)
        buf = memoryview(bytearray(verify_window(m.block_size)))
        try:
            for rank, (header, size, order) in sorted(entries.items()):
                planned = data_file_name(rank)
                with FileWriter(os.path.join(staging, planned)) as out:
                    out.write(memoryview(header))
                    for o in order:
                        _copy_piece(files, o, out, buf, m.block_size, src_path)
                        w.placed[(planned, o.start, o.end)] = Placed(planned, o.start, o.end, o.src.crc32c)
                        done[0] += o.src.nbytes
                        if progress is not None:
                            progress(done[0], total)
                    got = out.finish()
                if got != size:  # cannot happen: the layout says where each piece goes
                    raise CheckpointSaveError(f"copy: wrote {got} bytes of {planned}, {size} laid out")
                w.files[planned] = FileRecord(planned, rank, size)
        finally:
            files.close()
        return w

    return write
