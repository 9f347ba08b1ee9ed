"""nostall: checkpoint distributed PyTorch training without stalling it.

Public API::

    mgr = nostall.CheckpointManager(root, keep_last=3)
    mgr.save(step, state)          # state: nested dict of tensors, ShardedTensor,
    restored = mgr.load(state)     # DTensor, JSON values and PerRank values
    nostall.save(state, path); nostall.load(state, path)
"""

import logging as _logging

from .api import load, save
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLoadError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    InvalidStateError,
)
from .handles import SaveHandle, SaveStats
from .manager import CheckpointManager
from .model import PerRank, ShardedTensor

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "ShardedTensor",
    "PerRank",
    "SaveHandle",
    "SaveStats",
    "save",
    "load",
    "CheckpointError",
    "CheckpointSaveError",
    "InvalidStateError",
    "CheckpointLoadError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
]

_logging.getLogger("nostall").addHandler(_logging.NullHandler())
