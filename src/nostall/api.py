"""One-shot save and load of a single checkpoint directory."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

import torch.distributed as dist

from nostall.planning.comm import check_launch, make_comm
from nostall.handles import SaveStats
from nostall.core.jobs import Destination
from nostall.loading.reader import load_state
from nostall.options import NOT_GIVEN, NotGiven, options_from
from nostall.storage.locate import resolve, split_checkpoint
from nostall.saving.saver import Saver

__all__ = ["save", "load"]


def save(state: Any, path: str, *, process_group: Any = None, timeout: Union[float, NotGiven] = NOT_GIVEN,
         block_size: Union[int, NotGiven] = NOT_GIVEN,
         storage_options: Union[Optional[Dict[str, Any]], NotGiven] = NOT_GIVEN) -> SaveStats:
    """Save ``state`` into the directory ``path`` (replacing an older nostall checkpoint there).

    A collective call over ``process_group`` when ``torch.distributed`` is
    initialised. The directory appears only once complete. ``path`` may be
    an object-storage URL (``s3://bucket/run/step_100``, as ``load`` takes);
    ``storage_options`` go to fsspec. ``timeout``, ``block_size`` and
    ``storage_options``: see :class:`~nostall.Options` (their defaults live
    there).
    """
    options = options_from(None, dict(timeout=timeout, block_size=block_size, storage_options=storage_options),
                           "nostall.save()")
    root, name = split_checkpoint(os.fspath(path), options.storage_options, timeout=options.timeout)
    comm = make_comm(process_group, options.timeout, own_group=False)
    try:
        return Saver(comm, options).save(state, Destination(root, name, None, ""))
    finally:
        comm.close()


def load(state: Any, path: str, *, strict: bool = True, verify: bool = True, per_rank: str = "error",
         process_group: Any = None, storage_options: Optional[Dict[str, Any]] = None) -> Any:
    """Fill ``state`` from the checkpoint at ``path``; see CheckpointManager.load.

    ``path`` is a checkpoint (a directory, or an object-storage URL such as
    ``s3://bucket/run/step_100``: any fsspec protocol whose package is
    installed; ``storage_options`` go to fsspec), or a manager's run root:
    then the checkpoint its ``load()`` would use, as ``nostall inspect``
    does. Each rank fetches only the byte ranges its template needs, and
    verifies them.

    ``strict`` (default True): ``state`` and the checkpoint must hold the
    same keys, as torch's ``load_state_dict(strict=True)`` wants; a key of
    either that the other lacks is a :class:`~nostall.CheckpointLoadError`
    naming it. False: the keys both hold are loaded; ``state``'s others come
    back as given, the checkpoint's others are not loaded, and both lists
    are logged at WARNING by the ``nostall`` logger. Either way the restored
    state is returned.
    """
    check_launch()
    rank, world = 0, 1
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    root, name, _ = resolve(os.fspath(path), storage_options=storage_options)
    return load_state(state, root.path(name), strict=strict, rank=rank, world_size=world, verify=verify,
                      per_rank=per_rank, storage_options=storage_options)
