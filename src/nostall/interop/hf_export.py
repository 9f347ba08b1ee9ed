"""Hugging Face export at save time: every rank writes its share of a ``from_pretrained`` directory.

``CheckpointManager(root, export=HFExport("hf/step_{step}"))``: after each
committed save, every rank writes the safetensors files assigned to it from
the committed checkpoint (the same per-file code as ``nostall convert --to
safetensors``: :func:`nostall.interop.export.write_shard`), and rank 0 adds the
side files and ``model.safetensors.index.json`` and makes the directory
visible at once, by one rename. docs/interop.md ("Exporting at save time")
is the specification; :mod:`nostall.saving.exports` runs it off the training
thread.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from nostall.core.exports import CheckpointExportError, ExportJob, ExportOutcome, ExportTarget
from nostall.core.faults import crash_point
from nostall.interop._common import Progress, Source
from nostall.interop.export import (
    DEFAULT_MAX_SHARD_SIZE,
    CreatedFiles,
    Item,
    Streamer,
    cast_dtype,
    check_side_names,
    read_budget,
    select_items,
    shard_file_names,
    shard_groups,
    side_plan,
    write_index,
    write_shard,
    write_side_files,
)
from nostall.loading.manifests import read_manifest, read_side_file
from nostall.storage.files import fsync_dir, remove_tree

log = logging.getLogger("nostall")

__all__ = ["HFExport", "assign_files", "STAGE_TAG", "MARKER_NAME"]

STAGE_TAG = ".nostall-export."
"""A staging directory is ``.<destination name>.nostall-export.<tag>`` beside the destination."""
MARKER_NAME = ".nostall-export.json"
"""The record of a published export (source checkpoint, step, files), inside it."""
POLL_S = 0.02
AT_SAVE_MEMORY_LIMIT = 256 << 20


def assign_files(sizes: Sequence[int], world_size: int) -> List[int]:
    """The rank that writes each file: largest first, each to the rank with the fewest bytes so far
    (ties: the lowest rank; equal sizes: the earlier file first). Deterministic.

    >>> assign_files([10, 30, 20, 5], 2)
    [1, 0, 1, 0]
    """
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``, never replacing what is at ``dst`` (Linux renameat2 RENAME_NOREPLACE;
    elsewhere a check just before the rename)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        fn = None
    if fn is not None:
        at_fdcwd, noreplace = -100, 1
        if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), noreplace) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code), dst)
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


class _Guarded(Streamer):
    """The export's streamer, with its cancellation and test faults checked before each region."""

    def __init__(self, src: Source, memory_limit: int, progress: Progress, job: ExportJob) -> None:
        super().__init__(src, memory_limit, progress)
        self.job = job

    def write(self, item: Item, write_at: Callable[[int, memoryview], None]) -> None:
        job = self.job

        def guarded(pos: int, data: memoryview) -> None:
            if job.cancel.is_set():
                raise CheckpointExportError(f"rank {job.rank}: export of step {job.step} cancelled")
            write_at(pos, data)
            job.faults.check_export(item.name)

        super().write(item, guarded)


@dataclass(frozen=True)
class HFExport(ExportTarget):
    """Export each committed save as a ``from_pretrained`` directory (see the module doc).

    Args:
        dst: the export's directory, a local or shared filesystem path; ``{step}`` is replaced by the
            save's step (``"hf/step_{step}"``). It must not exist: an export never replaces anything.
        keys: the checkpoint keys exported, as key prefixes or globs (``nostall convert --keys``);
            default ``("model",)``: the weights ``save(model=...)`` saves.
        strip_prefix: leading key components removed from the names (default ``"model"``: ``model/lm_head.weight``
            is exported as ``lm_head.weight``, the name ``state_dict()`` gives).
        separator: joins the remaining key components (``/`` -> ``.``).
        dtype: cast floating-point tensors (``"bf16"``, ``"fp16"``, ``"fp32"``); None: as saved.
        max_shard_size: largest file, in bytes (a bigger tensor gets a file of its own).
        memory_limit: bytes of buffers each rank's part may hold at once, in the trainer process (default
            256 MiB, a quarter of the offline export's: every rank of a host holds its own beside training).
    """

    dst: str
    keys: Tuple[str, ...] = ("model",)
    strip_prefix: Optional[str] = "model"
    separator: str = "."
    dtype: Optional[str] = None
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    memory_limit: int = AT_SAVE_MEMORY_LIMIT

    def __post_init__(self) -> None:
        dst = os.fspath(self.dst)
        if not isinstance(dst, str) or not dst:
            raise ValueError(f"HFExport: dst must be a directory path, got {self.dst!r}")
        if "://" in dst:
            raise ValueError(f"HFExport: dst {dst!r} is a URL: an export at save time goes to a local or shared "
                             "directory (export to object storage offline: nostall convert --to safetensors)")
        try:
            dst.format(step=0)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"HFExport: dst {dst!r} may hold only the field {{step}}: {e!r}") from None
        object.__setattr__(self, "dst", dst)
        keys = (self.keys,) if isinstance(self.keys, str) else tuple(self.keys)
        if not keys or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"HFExport: keys must be key prefixes or globs (str), got {self.keys!r}")
        object.__setattr__(self, "keys", keys)
        for name in ("max_shard_size", "memory_limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"HFExport: {name} must be a positive number of bytes, got {v!r}")
        if self.dtype is not None:
            cast_dtype(self.dtype)  # a ValueError naming the known ones

    def destination(self, step: Optional[int]) -> str:
        """The export's directory for the save of ``step`` (absolute)."""
        self.check_step(step)
        return os.path.abspath(self.dst.format(step=step))

    def check_step(self, step: Optional[int]) -> None:
        if step is None and self.dst.format(step="\0") != self.dst:
            raise ValueError(f"HFExport: dst {self.dst!r} names the step, and this save has none (save(path=...) "
                             "without a step): give the save a step, or export=False")

    # ------------------------------------------------------------------ one rank's share

    def run(self, job: ExportJob) -> ExportOutcome:
        t0 = time.perf_counter()
        dst = self.destination(job.step)
        out = ExportOutcome(job.step, job.rank, path=dst)
        manifest = read_manifest(job.checkpoint, job.storage_options)
        tag = hashlib.sha256(manifest.to_json_bytes()).hexdigest()[:16]
        items, tied = select_items(manifest, job.checkpoint, list(self.keys), self.strip_prefix, self.separator,
                                   self.dtype)
        groups = shard_groups(items, self.max_shard_size, min_files=job.world_size)
        names = shard_file_names(len(groups))
        owners = assign_files([sum(i.nbytes for i in g) for g in groups], job.world_size)
        side, _ = side_plan("safetensors", manifest, job.checkpoint)
        mine = [i for i, r in enumerate(owners) if r == job.rank]
        writers = sorted(set(owners) - {0})
        if not mine and job.rank != 0:
            out.seconds = time.perf_counter() - t0
            return out
        parent, name = os.path.split(dst)
        stage = os.path.join(parent, f".{name}{STAGE_TAG}{tag}")
        where = f"rank {job.rank}: export of step {job.step} to {dst}"
        current = "(before any file)"
        created = CreatedFiles()
        try:
            check_side_names(side, names)
            if os.path.lexists(dst):
                raise CheckpointExportError(f"{where}: {dst} exists; an export never replaces anything: remove "
                                            "it, or export to another name")
            os.makedirs(parent, exist_ok=True)
            self._stage_dir(stage)
            if mine:
                source = Source(job.checkpoint, storage_options=job.storage_options, manifest=manifest,
                                read_budget=read_budget(self.memory_limit, manifest.block_size))
                try:
                    mine_items = [it for i in mine for it in groups[i]]
                    prog = Progress(f"export of step {job.step} (rank {job.rank})",
                                    sum(i.nbytes for i in mine_items), None)
                    streamer = _Guarded(source, self.memory_limit, prog, job)
                    for it in mine_items:
                        streamer.slab_elems(it)  # fail before writing anything if the limit is too small
                    for i in mine:
                        current = names[i]
                        tmp, final = write_shard(os.path.join(stage, names[i]), groups[i], tied, streamer, created)
                        created.publish(tmp, final)
                        out.files.append(names[i])
                        out.bytes += sum(it.nbytes for it in groups[i])
                finally:
                    source.close()
            crash_point("export.written", job.step)
            if job.rank != 0:
                _mark(stage, f".done-rank{job.rank}", "")
                out.seconds = time.perf_counter() - t0
                return out
            current = "(waiting for the other ranks' files)"
            self._wait_for(stage, writers, job, where)
            current = "(side files, index)"
            ready = write_side_files(side, lambda rec: read_side_file(job.checkpoint, rec, job.storage_options), stage,
                                     created)
            if len(groups) > 1:
                weight_map = {it.name: names[i] for i, g in enumerate(groups) for it in g}
                ready.append(write_index(sum(i.nbytes for i in items), weight_map, stage, created))
            for tmp, final in ready:
                created.publish(tmp, final)
            source_path = job.checkpoint if "://" in job.checkpoint else os.path.abspath(job.checkpoint)
            record = {"format": "nostall-export", "checkpoint": source_path, "step": job.step,
                      "files": names, "tied": tied}
            _mark(stage, MARKER_NAME, json.dumps(record, indent=2, sort_keys=True) + "\n")
            for r in writers:
                os.unlink(os.path.join(stage, f".done-rank{r}"))
            fsync_dir(stage)
            crash_point("export.publish", job.step)
            current = "(the rename into place)"
            try:
                _rename_noreplace(stage, dst)
            except OSError as e:
                raise CheckpointExportError(f"{where}: cannot move the finished export into place: {e}; an export "
                                            "never replaces anything") from None
            fsync_dir(parent)
            out.published = True
            self._sweep(parent, name, tag)
        except BaseException as e:
            created.undo()
            error: BaseException = e
            if isinstance(e, Exception) and not isinstance(e, CheckpointExportError):
                error = CheckpointExportError(f"{where} failed at file {current}: {type(e).__name__}: {e} (the "
                                              f"checkpoint {job.checkpoint} is committed and unaffected)")
            self._failed(stage, job, writers, error)
            if error is e:
                raise
            raise error from e
        out.seconds = time.perf_counter() - t0
        return out

    @staticmethod
    def _stage_dir(stage: str) -> None:
        """The staging directory, made by this rank or another of this export; a link there is refused."""
        try:
            os.mkdir(stage)
        except FileExistsError:
            pass
        if os.path.islink(stage) or not os.path.isdir(stage):
            raise CheckpointExportError(f"{stage} is not a directory nostall made (a link, or a file): remove it")

    @staticmethod
    def _wait_for(stage: str, ranks: Sequence[int], job: ExportJob, where: str) -> None:
        """Rank 0: wait (bounded by the job's timeout) until each of ``ranks`` has written its files."""
        deadline = time.monotonic() + job.timeout
        left = list(ranks)
        while left:
            for r in list(left):
                failed = os.path.join(stage, f".failed-rank{r}")
                if os.path.exists(failed):
                    with open(failed) as f:
                        why = f.read().strip()
                    raise CheckpointExportError(f"{where}: rank {r}'s part failed: {why}")
                if os.path.exists(os.path.join(stage, f".done-rank{r}")):
                    left.remove(r)
            if not left:
                return
            if job.cancel.is_set():
                raise CheckpointExportError(f"{where}: cancelled while waiting for rank(s) {left}")
            if time.monotonic() > deadline:
                raise CheckpointExportError(f"{where}: the files of rank(s) {left} did not come within "
                                            f"{job.timeout:.0f}s (a rank died, or its export is slower than the "
                                            "manager's timeout)")
            time.sleep(POLL_S)

    @staticmethod
    def _failed(stage: str, job: ExportJob, writers: Sequence[int], error: BaseException) -> None:
        """After a failure: another rank says so to rank 0; rank 0 waits (bounded) for the others to stop, then
        removes the staging directory. Best effort: a leftover stays hidden, and goes with the next export
        to the same name."""
        try:
            if not os.path.isdir(stage):
                return
            if job.rank != 0:
                _mark(stage, f".failed-rank{job.rank}", f"{error}")
                return
            deadline = time.monotonic() + job.timeout
            for r in writers:
                while not any(os.path.exists(os.path.join(stage, f".{s}-rank{r}")) for s in ("done", "failed")):
                    if time.monotonic() > deadline or job.cancel.is_set():
                        break
                    time.sleep(POLL_S)
            remove_tree(stage)
        except OSError as e:
            log.warning("rank %d: after the failed export of step %s: could not clean %s: %s", job.rank, job.step,
                        stage, e)

    @staticmethod
    def _sweep(parent: str, name: str, tag: str) -> None:
        """Remove the staging directories earlier (crashed) exports to the same name left."""
        prefix = f".{name}{STAGE_TAG}"
        try:
            entries = os.listdir(parent)
        except OSError:
            return
        for e in entries:
            rest = e[len(prefix):] if e.startswith(prefix) else ""
            if rest and rest != tag and len(rest) == len(tag) and all(c in "0123456789abcdef" for c in rest):
                path = os.path.join(parent, e)
                if os.path.isdir(path) and not os.path.islink(path):
                    try:
                        remove_tree(path)
                        log.info("removed %s, left by an earlier export that did not finish", path)
                    except OSError as err:
                        log.warning("could not remove %s: %s", path, err)


def _mark(folder: str, name: str, text: str) -> None:
    """A small file written whole (temporary name, fsync, rename)."""
    path = os.path.join(folder, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
