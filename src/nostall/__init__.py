"""nostall: checkpoint distributed PyTorch training without stalling it.

Public API::

    mgr = nostall.CheckpointManager(root, keep_last=3, async_save=True)
    mgr.save(step, model=model, optimizer=optimizer, scheduler=scheduler, rng=True)
    resumed = mgr.load(model=model, optimizer=optimizer, scheduler=scheduler)

    # the state-dict API: nested dicts of tensors, ShardedTensor, DTensor, JSON and PerRank values
    mgr.save(step, state); restored = mgr.load(state)
    nostall.save(state, path); nostall.load(state, path)

Names are imported lazily, so that ``import nostall.saving.writer`` (the background
writer process) does not import torch.
"""

from __future__ import annotations

import importlib
import logging as _logging
from typing import TYPE_CHECKING, Any

from nostall.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLoadError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    InvalidStateError,
    WriterVersionError,
)

if TYPE_CHECKING:  # pragma: no cover
    from nostall.api import load, save
    from nostall.interop.copy import copy_checkpoint
    from nostall.handles import SaveHandle, SaveStats
    from nostall.manager import CheckpointManager
    from nostall.core.model import PerRank, ShardedTensor
    from nostall.options import MemoryTier, Options
    from nostall.training import LoadedCheckpoint, ParallelLayout

__version__ = "0.1.0"

_LAZY = {
    "CheckpointManager": "manager",
    "ShardedTensor": "core.model",
    "PerRank": "core.model",
    "SaveHandle": "handles",
    "SaveStats": "handles",
    "save": "api",
    "load": "api",
    "copy_checkpoint": "interop.copy",
    "Options": "options",
    "MemoryTier": "options",
    "ParallelLayout": "training",
    "LoadedCheckpoint": "training",
}

__all__ = [
    "CheckpointManager",
    "ShardedTensor",
    "PerRank",
    "SaveHandle",
    "SaveStats",
    "save",
    "load",
    "copy_checkpoint",
    "Options",
    "MemoryTier",
    "ParallelLayout",
    "LoadedCheckpoint",
    "CheckpointError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "InvalidStateError",
    "CheckpointLoadError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "WriterVersionError",
]


_SUBMODULES = ("dcp", "interop")  # imported on first use: ``nostall.dcp.Reader(path)``


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nostall' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


_logging.getLogger("nostall").addHandler(_logging.NullHandler())
