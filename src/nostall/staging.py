"""The staging area: one reusable shared-memory region per rank.

``save()`` copies this rank's planned file images (headers and piece bytes)
into the area; the writer process maps the same memory and writes it out.
The area is an anonymous memory file (``memfd``; a deleted temporary file where
memfd is unavailable): it has no name to leak, and is released when the
trainer and the writer have both closed it, however they exit. It is allocated
and touched once, reused while the plan fits, and replaced by a larger one when
it does not. For CUDA tensors the area is registered as pinned memory, so the
device-to-host copies are DMA transfers.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .planning import FilePlan, WriteItem
from .writer import FileJob

log = logging.getLogger("nostall")

_ALIGN = 1 << 21  # grow in 2 MiB steps


def _anonymous_file(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("nostall-staging", getattr(os, "MFD_CLOEXEC", 1))
    else:  # pragma: no cover - non-Linux
        fd, path = tempfile.mkstemp(prefix="nostall-staging-")
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def layout(files: Sequence[FilePlan]) -> Tuple[List[int], int]:
    """Offset of each file image in the area (64-byte aligned) and the bytes needed."""
    offsets, pos = [], 0
    for f in files:
        offsets.append(pos)
        pos += -(-f.size // 64) * 64
    return offsets, pos


class StagingArea:
    """A host-memory area shared with the writer process."""

    def __init__(self) -> None:
        self.size = 0
        self.fd: Optional[int] = None
        self._mm: Optional[mmap.mmap] = None
        self._tensor: Optional[torch.Tensor] = None
        self._pinned = False
        self.generation = 0  # bumped at every (re)allocation

    def ensure(self, size: int) -> bool:
        """Make the area at least ``size`` bytes; True when it was (re)allocated."""
        if size <= self.size and self._mm is not None:
            return False
        new_size = max(_ALIGN, -(-int(size * 1.0) // _ALIGN) * _ALIGN)
        self.close()
        fd = _anonymous_file(new_size)
        try:
            mm = mmap.mmap(fd, new_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self._mm, self.size = fd, mm, new_size
        self._tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self._tensor.zero_()  # touch every page once, now rather than during saves
        self.generation += 1
        log.debug("staging area of %d bytes allocated", new_size)
        return True

    @property
    def tensor(self) -> torch.Tensor:
        assert self._tensor is not None
        return self._tensor

    def _pin(self) -> None:
        if self._pinned or self._tensor is None:
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self._tensor.data_ptr(), self.size, 1)  # cudaHostRegisterPortable
        if int(err) != 0:  # pragma: no cover - GPU only
            log.warning("cudaHostRegister of the staging area failed (%s); copies will not be pinned", err)
            return
        self._pinned = True

    def stage(self, files: Sequence[FilePlan], source: Callable[[WriteItem], torch.Tensor]) -> Tuple[FileJob, ...]:
        """Copy the file images of ``files`` into the area; returns where each lies."""
        offsets, total = layout(files)
        self.ensure(total)
        area = self.tensor
        jobs: List[FileJob] = []
        cuda = False
        devices = set()
        for f, pos in zip(files, offsets):
            hdr = torch.frombuffer(bytearray(f.header), dtype=torch.uint8)
            area[pos : pos + len(f.header)].copy_(hdr)
            for item in f.items:
                src = source(item)
                if src.device.type == "cuda":
                    if not cuda:
                        self._pin()
                        cuda = True
                    devices.add(src.device)
                elif src.device.type != "cpu":
                    src = src.to("cpu")
                n = item.end - item.start
                if n == 0:
                    continue
                dst = area[pos + item.start : pos + item.end].view(src.dtype)
                if dst.numel() != src.numel():
                    raise RuntimeError(f"key {item.key!r}: {src.numel()} elements, the plan expects {dst.numel()}")
                dst.view(src.shape).copy_(src.detach(), non_blocking=cuda)
            jobs.append(FileJob(f.name, pos, f.size, len(f.header), tuple((i.start, i.end) for i in f.items)))
        for d in devices:  # the copies were asynchronous, on each tensor's device
            torch.cuda.synchronize(d)
        return tuple(jobs)

    def close(self) -> None:
        """Release the area (the writer keeps its own mapping until it lets go)."""
        if self._pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())  # type: ignore[union-attr]
            except Exception:  # pragma: no cover
                pass
            self._pinned = False
        self._tensor = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # pragma: no cover - a view still exported somewhere
                log.debug("staging area still referenced; leaving it to the garbage collector")
            self._mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.size = 0
