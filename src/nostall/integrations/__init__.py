"""Integrations with training stacks.

* :mod:`nostall.integrations.strategy`: :class:`Strategy`, the checkpoint half
  of a parallel strategy (``save_checkpoint`` / ``load_checkpoint`` /
  ``finalize_pending_saves``) for tensor-parallel x data-parallel models.
* :mod:`nostall.integrations.ray`: ``Worker`` / ``WorkerDispatch``, the same
  lifecycle driven over a group of Ray actors (needs the ``ray`` extra).
"""

from .strategy import (
    LoadedCheckpoint,
    ParallelLayout,
    Strategy,
    mark_tensor_parallel,
    model_state,
    optimizer_state,
)

__all__ = [
    "LoadedCheckpoint",
    "ParallelLayout",
    "Strategy",
    "mark_tensor_parallel",
    "model_state",
    "optimizer_state",
]
