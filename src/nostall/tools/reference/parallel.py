"""Tensor x data parallelism for the reference model (Megatron-style, gloo on CPU).

Ranks are laid out TP-major: rank = dp_rank * tp + tp_rank, so the ranks of
a TP group are neighbours (on one host, in a real cluster).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List

import torch
import torch.distributed as dist

from nostall.integrations.strategy import ParallelLayout, mark_tensor_parallel


@dataclass
class ParallelGroups:
    """This rank's layout and its TP and DP process groups (None when of size 1)."""

    layout: ParallelLayout
    tp_group: Any = None
    dp_group: Any = None
    _owned: List[Any] = field(default_factory=list)

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    def destroy(self) -> None:
        for g in self._owned or []:
            dist.destroy_process_group(g)
        self._owned = []


def init_parallel(tp: int) -> ParallelGroups:
    """Split the world into TP groups of ``tp`` ranks and DP groups across them (collective)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if tp < 1 or world % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the world size {world}")
    dp = world // tp
    layout = ParallelLayout(tp_rank=rank % tp, tp_size=tp, dp_rank=rank // tp, dp_size=dp)
    groups = ParallelGroups(layout)
    if world == 1:
        return groups
    groups.tp_group = _subgroups(rank, [[d * tp + t for t in range(tp)] for d in range(dp)], groups._owned)
    groups.dp_group = _subgroups(rank, [[d * tp + t for d in range(dp)] for t in range(tp)], groups._owned)
    return groups


def _subgroups(rank: int, partition: List[List[int]], owned: List[Any]) -> Any:
    """Create a gloo group per part (none for single ranks); return this rank's.

    Every rank creates every group, in the same order: ``new_group`` is collective.
    """
    mine = None
    for ranks in partition:
        g = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None
        if g is not None:
            owned.append(g)
        if rank in ranks:
            mine = g
    return mine


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient over the TP group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce of partial outputs over the TP group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        return g, None


def copy_to_tp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    return _CopyToTP.apply(x, groups.tp_group) if groups.tp_size > 1 else x


def reduce_from_tp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    return _ReduceFromTP.apply(x, groups.tp_group) if groups.tp_size > 1 else x


def _full_init(out_f: int, in_f: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=gen) * (in_f ** -0.5)


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T + b with W's rows (the outputs) split over the TP group.

    Initialised from the full weight drawn from ``gen``, so every TP size
    starts from the same model. Input is the full ``x``; output is this
    rank's slice of ``y``.
    """

    def __init__(self, in_f: int, out_f: int, groups: ParallelGroups, gen: torch.Generator) -> None:
        super().__init__()
        tp, r = groups.layout.tp_size, groups.layout.tp_rank
        if out_f % tp:
            raise ValueError(f"output size {out_f} is not divisible by the TP size {tp}")
        n = out_f // tp
        w = _full_init(out_f, in_f, gen)
        self.weight = torch.nn.Parameter(w[r * n : (r + 1) * n].clone())
        self.bias = torch.nn.Parameter(torch.zeros(n))
        mark_tensor_parallel(self.weight, 0)
        mark_tensor_parallel(self.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """y = x W^T + b with W's columns (the inputs) split over the TP group.

    Input is this rank's slice of ``x``; the partial products are summed over
    the group, then the (replicated) bias is added.
    """

    def __init__(self, in_f: int, out_f: int, groups: ParallelGroups, gen: torch.Generator) -> None:
        super().__init__()
        tp, r = groups.layout.tp_size, groups.layout.tp_rank
        if in_f % tp:
            raise ValueError(f"input size {in_f} is not divisible by the TP size {tp}")
        n = in_f // tp
        w = _full_init(out_f, in_f, gen)
        self.groups = groups
        self.weight = torch.nn.Parameter(w[:, r * n : (r + 1) * n].clone())
        self.bias = torch.nn.Parameter(torch.zeros(out_f))
        mark_tensor_parallel(self.weight, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(torch.nn.functional.linear(x, self.weight), self.groups) + self.bias


def allreduce_dp_grads(model: torch.nn.Module, groups: ParallelGroups) -> None:
    """Average gradients over the DP group (one flat all-reduce)."""
    if groups.layout.dp_size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=groups.dp_group)
    flat /= groups.layout.dp_size
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()


def gather_full_state(model: torch.nn.Module, groups: ParallelGroups) -> dict:
    """The model's full (unsharded) state dict, gathered over the TP group on every rank."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        data = t.detach()
        if groups.tp_size > 1 and getattr(t, "tensor_model_parallel", False):
            parts = [torch.empty_like(data) for _ in range(groups.tp_size)]
            dist.all_gather(parts, data.contiguous(), group=groups.tp_group)
            out[name] = torch.cat(parts, dim=t.partition_dim)
        else:
            out[name] = data.clone()
    return out
