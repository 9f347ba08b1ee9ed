"""torch dtypes <-> the format's dtype codes."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from nostall.errors import CheckpointCorruptError

_TORCH_TO_CODE: Dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}
for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if hasattr(torch, _name):
        _TORCH_TO_CODE[getattr(torch, _name)] = _code
_CODE_TO_TORCH = {v: k for k, v in _TORCH_TO_CODE.items()}


def dtype_code(dtype: torch.dtype) -> Optional[str]:
    """The format's code of a torch dtype, or None when unsupported."""
    return _TORCH_TO_CODE.get(dtype)


def torch_dtype(code: str) -> torch.dtype:
    try:
        return _CODE_TO_TORCH[code]
    except KeyError:
        raise CheckpointCorruptError(f"dtype code {code!r} has no torch dtype here") from None
