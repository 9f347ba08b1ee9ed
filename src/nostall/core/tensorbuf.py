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

    The view (and every slice of it) keeps ``t`` alive: a checksum thread may
    still read it after the code that made it has let ``t`` go.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    raw = (ctypes.c_char * n).from_address(t.data_ptr())
    raw.owner = t  # type: ignore[attr-defined]  # the memory's owner lives as long as the view
    return memoryview(raw).cast("B")
