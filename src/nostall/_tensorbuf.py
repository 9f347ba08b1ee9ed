"""Raw byte views of CPU tensors, for any dtype (bfloat16 included), no numpy."""

from __future__ import annotations

import ctypes

import torch


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor (a copy only when needed)."""
    if t.device.type != "cpu":
        t = t.detach().to("cpu")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable memoryview over the bytes of a contiguous CPU tensor.

    The caller keeps ``t`` alive while the view is used.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
