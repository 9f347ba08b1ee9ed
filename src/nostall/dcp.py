"""``nostall.dcp``: PyTorch DCP interoperability under its public short name.

``dcp.load(state, storage_reader=nostall.dcp.Reader(path))`` loads a nostall
checkpoint through ``torch.distributed.checkpoint``; ``nostall.dcp.import_dcp``
converts a DCP checkpoint into the nostall format (docs/interop.md).

This module is a re-export of :mod:`nostall.interop.dcp`, where the code
lives (and which says how DCP names are offered), and holds nothing else. It
is kept because it is the name users write and the documentation uses: a
user should not need to know the library's internal layers (``interop``) to
find it, as with ``nostall.save`` and ``nostall.load``.
"""

from nostall.interop.dcp import Reader, dcp_leaves, fqn_of, import_dcp

__all__ = ["Reader", "import_dcp", "fqn_of", "dcp_leaves"]
