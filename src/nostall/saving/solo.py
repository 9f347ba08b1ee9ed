"""A save by one process alone (a world of one): how the interop writers commit a checkpoint.

Who calls it: the writers that make a nostall checkpoint out of something
other than a trainer's state -- :func:`nostall.interop.copy.copy_checkpoint`
(a self-contained copy) and :func:`nostall.interop._common.write_checkpoint`
(hence :func:`nostall.interop.dcp.import_dcp`). Saves of a manager or of
:func:`nostall.save` go through :class:`nostall.saving.saver.Saver` instead;
both end in the same routine, :func:`nostall.saving.commit.run_job`.

The phases, and who does what:

1. the caller, before anything is written: checks the destination (what it
   may replace, what it refuses), gets its root and name
   (:func:`nostall.storage.locate.split_checkpoint`) and a
   :class:`~nostall.core.jobs.Destination` for them
   (:func:`solo_destination`: never moves ``latest``, no retention), lays out
   the data files (:class:`~nostall.core.jobs.FileJob`) and builds the
   manifest (every piece where it is planned, under the planned file names;
   the job gets its skeleton, and each planned piece's key and box beside its
   byte range: the commit assembles the piece records, with the stored names
   and the checksums, from what was written, as for a save,
   :meth:`~nostall.core.format.Manifest.with_pieces`);
2. :func:`save_solo`: the root makes the save's staging (beside the
   checkpoint, or a local scratch directory on object storage); then
   :func:`~nostall.saving.commit.run_job` with
   :class:`~nostall.saving.commit.SoloBarrier` runs the caller's writer into
   the staging, writes the side files, uploads (object storage) and commits:
   the staging renamed into place (a directory) or the manifest uploaded last
   (object storage). It commits exactly the skeleton's checkpoint, or nothing.

What it raises: :class:`~nostall.CheckpointSaveError` naming the destination
and the fix when the staging cannot be made or the write or the commit fails
(``run_job`` has then aborted: the staging is removed, nothing is committed,
a checkpoint the save would have replaced stays); an error the writer raised
whose type the caller lists in ``keep_errors`` (a damaged source, say) is
raised as it is instead; a :class:`~nostall.CheckpointError` of the root's own
(a destination it refuses) passes unchanged.

This module does not import torch.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple, Type

from nostall.core.format import Manifest
from nostall.core.jobs import Destination, FileJob, PieceWhat, SaveJob, Written
from nostall.errors import CheckpointError, CheckpointSaveError, describe
from nostall.saving.commit import SoloBarrier, run_job
from nostall.saving.datafiles import Base, Writer
from nostall.storage.root import Root

__all__ = ["SOLO_TIMEOUT_S", "solo_destination", "save_solo"]

SOLO_TIMEOUT_S = 7 * 24 * 3600.0
"""The job's deadline: a solo save is bounded by the storage's own timeouts, not by this."""


def solo_destination(root: Root, name: str, step: Optional[int] = None, *, tagged: bool = False) -> Destination:
    """Where a solo save of checkpoint ``name`` in ``root`` goes: a fresh save id, ``latest`` never
    moved, no retention. ``tagged``: the data files' names carry the save id (needed when the save
    replaces a checkpoint, so that no name is one the replaced checkpoint used; always on object storage)."""
    return Destination(root, name, step, uuid.uuid4().hex, move_latest=False, keep_last=None, tagged=tagged)


def _with_what(manifest: Manifest, files: Sequence[FileJob]) -> Tuple[FileJob, ...]:
    """``files`` with what each piece is, from where ``manifest`` plans it: the commit assembles the
    manifest's piece records from the done record, as for a save (:meth:`Manifest.with_pieces`)."""
    what: Dict[Tuple[str, int, int], List[PieceWhat]] = {}  # several: empty pieces at one place
    records = [(t, -1) for t in manifest.tensors.values()]
    records += [(t, r) for r, rec in enumerate(manifest.per_rank) for t in rec.tensors.values()]
    for t, of in records:
        if t.tied_to:
            continue  # its pieces are those of the key it is tied to
        for p in t.pieces:
            what.setdefault((p.file, p.start, p.end), []).append((t.key, of, p.offset, p.shape))
    out = []
    for f in files:
        ranges: List[Tuple[int, int]] = []
        got: List[PieceWhat] = []
        for s, e in dict.fromkeys(f.pieces):  # each range once, with every piece laid out there
            ws = what.get((f.name, s, e))
            if not ws:
                raise CheckpointSaveError(f"{f.name}: bytes [{s}, {e}) are laid out for no piece of the manifest "
                                          "(a bug of the caller's layout)")
            ranges += [(s, e)] * len(ws)
            got += ws
        out.append(replace(f, pieces=tuple(ranges), what=tuple(got)))
    return tuple(out)


def save_solo(dst: str, dest: Destination, manifest: Manifest, files: Sequence[FileJob], write: Writer, *,
              side_files: Sequence[Tuple[str, bytes]] = (), what: Optional[str] = None,
              keep_errors: Tuple[Type[BaseException], ...] = ()) -> None:
    """Write and commit the checkpoint ``manifest`` (a skeleton, see the module docstring) at ``dest``.

    ``dst``: the destination as its caller named it (for messages). ``files``:
    the data files as laid out (the skeleton's planned names); ``write`` writes
    them into the staging directory it is given and says what it wrote.
    ``side_files``: (name, bytes) committed with the checkpoint. ``what``: the
    operation, for messages (default ``writing <dst>``). ``keep_errors``: an
    error of these types raised by ``write`` is raised as it is.
    """
    what = what or f"writing {dst}"
    try:
        dest.root.make_staging(dest)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointSaveError(f"{what}: cannot write {dst}: {describe(e)}; check the destination's directory "
                                  "and permissions") from None
    failure: List[BaseException] = []

    def recorded(job: SaveJob, staging: str, base: Optional[Base]) -> Written:
        try:
            return write(job, staging, base)
        except BaseException as e:
            failure.append(e)
            raise

    job = SaveJob(dest, 0, 1, _with_what(manifest, files), manifest.block_size, timeout=SOLO_TIMEOUT_S,
                  manifest=manifest.without_pieces(), side_files=tuple(side_files))
    result = run_job(job, recorded, SoloBarrier())  # aborts on failure: nothing committed, the staging removed
    if not result.ok:
        if failure and isinstance(failure[0], keep_errors):
            raise failure[0]
        raise CheckpointSaveError(f"{what} failed, nothing was committed: {result.error}; fix the cause, then run it "
                                  "again")
