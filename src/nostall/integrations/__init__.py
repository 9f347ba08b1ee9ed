"""Integrations with training stacks.

* :mod:`nostall.integrations.strategy`: :class:`Strategy`, the checkpoint half
  of a parallel strategy (``save_checkpoint`` / ``load_checkpoint`` /
  ``finalize_pending_saves``) for tensor-parallel x data-parallel models.
* :mod:`nostall.integrations.seam`: :class:`CheckpointingMixin`, the same
  methods with the signatures of SkyRL-style strategy classes (a directory
  named per save, ``(ckpt_dir, states)`` results), for a stack's own class.
* :mod:`nostall.integrations.ray`: ``Worker`` / ``WorkerDispatch``, the same
  lifecycle driven over a group of Ray actors (needs the ``ray`` extra).
"""

from nostall.integrations.seam import CheckpointingMixin
from nostall.integrations.strategy import (
    LoadedCheckpoint,
    ParallelLayout,
    Strategy,
    mark_tensor_parallel,
    model_state,
    optimizer_state,
)

__all__ = [
    "CheckpointingMixin",
    "LoadedCheckpoint",
    "ParallelLayout",
    "Strategy",
    "mark_tensor_parallel",
    "model_state",
    "optimizer_state",
]
