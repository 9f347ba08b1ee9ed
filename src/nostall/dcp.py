"""PyTorch DCP interoperability (public alias of :mod:`nostall.interop.dcp`).

``dcp.load(state, storage_reader=nostall.dcp.Reader(path))`` loads a nostall
checkpoint through ``torch.distributed.checkpoint``; ``nostall.dcp.import_dcp``
converts a DCP checkpoint into the nostall format. See ``docs/interop.md``.
"""

from __future__ import annotations

from .interop.dcp import Reader, fqn_of, import_dcp

__all__ = ["Reader", "import_dcp", "fqn_of"]
