"""Where a checkpoint is: the root a location names (:func:`open_root`), a checkpoint given by its
own location (:func:`split_checkpoint`), the checkpoint a user names (:func:`resolve`)."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from nostall.storage import remote
from nostall.core.faults import Faults
from nostall.core.format import MANIFEST_NAME
from nostall.errors import CheckpointNotFoundError
from nostall.storage.objects import ObjectRoot
from nostall.storage.posix import PosixRoot
from nostall.storage.root import Root, step_name

def local_path(location: Any) -> Optional[str]:
    """The local path ``location`` names, or None when it is an object-storage URL (for what can only read a
    local directory, such as a DCP checkpoint, and for wording an error about credentials)."""
    return None if remote.is_remote(location) else os.fspath(location)


def open_root(url: str, *, storage_options: Optional[Dict[str, Any]] = None, local_staging: Optional[str] = None,
              timeout: float = 600.0, faults: Optional[Faults] = None) -> Root:
    """The root at ``url``: a directory (:class:`PosixRoot`) or an fsspec URL (:class:`ObjectRoot`)."""
    if remote.is_remote(url):
        return ObjectRoot(url, storage_options=storage_options, local_staging=local_staging, timeout=timeout,
                          faults=faults)
    return PosixRoot(url, faults=faults)


def split_checkpoint(path: str, storage_options: Optional[Dict[str, Any]] = None, *,
                     local_staging: Optional[str] = None, timeout: float = 600.0,
                     faults: Optional[Faults] = None) -> Tuple[Root, str]:
    """(root, name) of a checkpoint given by its own location (``.../step_100``, a one-shot directory,
    a directory its caller names)."""
    if remote.is_remote(path):
        url = str(path).rstrip("/")
        parent, _, name = url.rpartition("/")
        return ObjectRoot(parent, storage_options=storage_options, local_staging=local_staging, timeout=timeout,
                          faults=faults), name
    full = os.path.abspath(os.fspath(path))
    return PosixRoot(os.path.dirname(full), detached=True, faults=faults), os.path.basename(full)


def resolve(location: str, step: Optional[int] = None, *,
            storage_options: Optional[Dict[str, Any]] = None) -> Tuple[Root, str, Optional[int]]:
    """(root, name, step) of the checkpoint a user names: ``location`` itself when it is a
    checkpoint (step None), else the checkpoint ``step`` of the root ``location`` (None: the
    one ``latest_step()`` names, as a manager's ``load()`` would).

    Raises :class:`~nostall.CheckpointNotFoundError` naming what was looked for.
    """
    if step is None:
        root, name = split_checkpoint(location, storage_options)
        if root.has_manifest(name):  # a checkpoint (reading it says whether it is a sound one)
            return root, name, None
    root = open_root(location, storage_options=storage_options)
    if step is None:
        step = root.latest_step()
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint at {root.url}: it is not a committed checkpoint "
                                          f"(no {MANIFEST_NAME} there: an interrupted save?) nor a run root holding "
                                          "one (no step_<N> in it)")
    if not root.is_checkpoint(step_name(step)):
        raise CheckpointNotFoundError(f"{root.path(step_name(step))} is not a committed checkpoint: no "
                                      f"checkpoint of step {step} (committed steps: {root.steps()})")
    return root, step_name(step), step
