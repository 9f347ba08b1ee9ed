"""PyTorch DCP interoperability: ``nostall.dcp.Reader`` and ``nostall.dcp.import_dcp``.

``dcp.load(state, storage_reader=nostall.dcp.Reader(path))`` loads a nostall
checkpoint through ``torch.distributed.checkpoint``; ``import_dcp`` converts a
DCP checkpoint into the nostall format. They live in
:mod:`nostall.interop.dcp` (which says how DCP names are offered); see
``docs/interop.md``.
"""

from nostall.interop.dcp import Reader, dcp_leaves, fqn_of, import_dcp

__all__ = ["Reader", "import_dcp", "fqn_of", "dcp_leaves"]
