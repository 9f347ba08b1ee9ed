"""A committed checkpoint's manifest and side files, read without torch.

:func:`read_manifest` reads and parses a checkpoint's manifest (or says why there is none:
a run root, or not a checkpoint); :func:`referenced_file_problems` is the cheap check of the
earlier checkpoints' files an incremental checkpoint reads; :func:`read_side_file` reads a side
file, checked as docs/format.md says. Every file is reached through the checkpoint's
:class:`~nostall.storage.root.Root`.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional

from nostall.core.format import MANIFEST_NAME, MAX_SIDE_FILE_BYTES, Manifest, SideFileRecord, crc
from nostall.errors import CheckpointCorruptError, CheckpointNotFoundError
from nostall.loading.sources import open_files
from nostall.storage.locate import open_root, split_checkpoint

__all__ = ["read_manifest", "manifest_digest", "read_side_file", "referenced_file_problems", "side_file_location"]


def read_manifest(path: str, storage_options: Optional[Dict[str, Any]] = None) -> Manifest:
    """The manifest of the committed checkpoint at ``path`` (a directory or an object-storage URL)."""
    root, name = split_checkpoint(path, storage_options)
    raw = root.load_manifest_bytes(name)
    if raw is None:
        raise CheckpointNotFoundError(_not_a_checkpoint(path, storage_options))
    return Manifest.from_json_bytes(raw, root.path(f"{name}/{MANIFEST_NAME}"))


def manifest_digest(path: str, storage_options: Optional[Dict[str, Any]] = None) -> str:
    """The SHA-256 (hex) of the manifest's bytes of the committed checkpoint at ``path``, read and not parsed: what
    tells copies of one checkpoint from others (:mod:`nostall.loading.collective`, loading copies)."""
    root, name = split_checkpoint(path, storage_options)
    raw = root.load_manifest_bytes(name)
    if raw is None:
        raise CheckpointNotFoundError(_not_a_checkpoint(path, storage_options))
    return hashlib.sha256(raw).hexdigest()


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
    files = open_files(path, m, storage_options)
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
