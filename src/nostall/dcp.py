"""PyTorch DCP interoperability.

``dcp.load(state, storage_reader=nostall.dcp.Reader(path))`` loads a nostall
checkpoint through ``torch.distributed.checkpoint``; ``nostall.dcp.import_dcp``
converts a DCP checkpoint into the nostall format. See ``docs/interop.md``.

Names. ``dcp.load`` flattens the caller's state dict and asks the reader for
one item per leaf, named by the leaf's path joined with ``.``. Since torch 2.4
(``torch/distributed/checkpoint/_traverse.py``, ``traverse_state_dict``):

* a dict is always descended into (its keys as ``str``); an empty dict has no
  leaf at all;
* a list is descended into (indices ``0``, ``1`` ...) when it holds a dict, a
  tensor, or a list that is itself descended into; otherwise (scalars,
  strings, tuples, ``None``, flat lists, the empty list) it is one leaf;
* a tuple, and anything else, is one leaf.

Tensor leaves are tensor items; every other leaf is a "bytes" item, which
the reader answers with a ``torch.save`` of the value. So an optimizer's
``param_groups`` is asked for as ``optim.param_groups.0.lr``,
``optim.param_groups.0.betas`` (the tuple as one item),
``optim.param_groups.0.params`` ..., never as one ``optim.param_groups`` item.

:class:`Reader` names a checkpoint's JSON values exactly that way. It offers
no other (pre-2.4) forms: DCP looks at the old flattening only when the
checkpoint's metadata has keys that the new flattening of the caller's state
does not produce, and then switches the *whole* load to the old flattening
if any of them match -- so offering old names next to the new ones would
push every load onto that path (and nostall requires torch >= 2.4, whose
loads never ask for old names first).

A value stored as JSON has lost the difference between a tuple and a list;
where the caller's state holds a tuple at that place (an optimizer's
``betas``), the value is handed back as a tuple.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Dict, Iterator, List, Mapping, Tuple

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from .errors import CheckpointLoadError
from .format import Manifest
from .interop import dcp as _dcp
from .interop.dcp import fqn_of, import_dcp
from .loading import read_manifest

__all__ = ["Reader", "import_dcp", "fqn_of", "dcp_leaves"]


class Reader(_dcp.Reader):
    """A DCP StorageReader over the nostall checkpoint at ``path``.

    Tensors are offered under their nostall key's components joined with
    ``.``; JSON values as the bytes items that ``dcp.load`` asks for (see the
    module docstring and :func:`dcp_leaves`).

    Args:
        path: a checkpoint directory or object-storage URL (optional: DCP's
            ``checkpoint_id`` may give it instead).
        verify: check the CRC32C of every block read (default True).
        storage_options: fsspec options for object storage.
    """

    def _load_manifest(self) -> Manifest:
        if self._manifest is None:
            m = read_manifest(self._path(), self.storage_options)
            keys: Dict[str, str] = {}
            for key in m.tensors:
                fqn = fqn_of(key)
                if fqn in keys:
                    raise CheckpointLoadError(
                        f"keys {keys[fqn]!r} and {key!r} both map to the DCP name {fqn!r} ({self.path})"
                    )
                keys[fqn] = key
            objects: Dict[str, Any] = {}
            owner: Dict[str, str] = {}  # fqn -> the nostall key of the value it comes from
            for key, value in m.objects.items():
                for fqn, leaf in _leaves(fqn_of(key), value):
                    if fqn in keys or fqn in objects:
                        other = keys.get(fqn) or owner[fqn]
                        where = f"twice from {key!r}" if other == key else f"from both {other!r} and {key!r}"
                        raise CheckpointLoadError(f"the DCP name {fqn!r} comes {where} in {self.path}")
                    objects[fqn] = leaf
                    owner[fqn] = key
            self._manifest, self._keys, self._objects = m, keys, objects
        return self._manifest

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        byte_items = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if byte_items:
            self._load_manifest()
            # DefaultLoadPlanner keeps the caller's state, flattened, as `state_dict` (fqn -> value)
            template = getattr(planner, "state_dict", None)
            for item in byte_items:
                fqn = item.storage_index.fqn
                if fqn not in self._objects:
                    raise CheckpointLoadError(f"{fqn!r}: no such value in the checkpoint at {self.path}")
                value = self._objects[fqn]
                if isinstance(template, Mapping):
                    value = _like(template.get(item.dest_index.fqn), value)
                buf = io.BytesIO()
                torch.save(value, buf)  # a JSON value we decoded ourselves
                buf.seek(0)
                planner.load_bytes(item, buf)
        rest = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
        return super().read_data(dataclasses.replace(plan, items=rest), planner)


def dcp_leaves(name: str, value: Any) -> Dict[str, Any]:
    """The DCP items of the JSON value ``value`` at DCP name ``name``: ``{fqn: leaf}``,
    as ``dcp.load`` (torch >= 2.4) flattens that value in a state dict (module docstring).
    ValueError if two items get the same name (``{"a.b": 1, "a": {"b": 2}}``), as DCP's does."""
    out: Dict[str, Any] = {}
    for fqn, leaf in _leaves(name, value):
        if fqn in out:
            raise ValueError(f"two items of the value at {name!r} have the DCP name {fqn!r}")
        out[fqn] = leaf
    return out


def _leaves(name: str, value: Any) -> Iterator[Tuple[str, Any]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(f"{name}.{k}", v)
    elif isinstance(value, list) and _descended(value):
        for i, v in enumerate(value):
            yield from _leaves(f"{name}.{i}", v)
    else:
        yield name, value


def _descended(value: List[Any]) -> bool:
    """Whether DCP descends into this list (JSON: no tensors): it holds a dict, or a list it descends into."""
    return any(isinstance(v, Mapping) or (isinstance(v, list) and _descended(v)) for v in value)


def _like(current: Any, saved: Any) -> Any:
    """``saved`` (JSON: lists) with a tuple wherever the caller's ``current`` value has a plain tuple."""
    if type(current) is tuple and isinstance(saved, list) and len(saved) == len(current):
        return tuple(_like(c, s) for c, s in zip(current, saved))
    if isinstance(current, list) and isinstance(saved, list) and len(saved) == len(current):
        return [_like(c, s) for c, s in zip(current, saved)]
    if isinstance(current, Mapping) and isinstance(saved, dict):
        return {k: _like(current.get(k), v) for k, v in saved.items()}
    return saved
