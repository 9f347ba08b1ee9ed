"""Rank-side code of tests/test_resume.py: tiny models in five parallel setups, trained and resumed.

Every function here runs inside a rank spawned by tests/dist_harness.py (or in
the test process itself for one rank), so each is module-level and returns
picklable values (dicts of CPU tensors and floats).

Setups (``kind``):

* ``single``: one rank, a plain MLP with dropout;
* ``ddp``: ``DistributedDataParallel`` with dropout, different data per rank;
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every Linear and the
  root (one Linear has 5 output rows: an uneven shard over 2 ranks);
* ``dtensor_tp``: ``parallelize_module`` with ColwiseParallel / RowwiseParallel;
* ``megatron_tp``: a Megatron-style MLP split by hand (column- then
  row-parallel Linear), parameters marked with ``mark_tensor_parallel`` and
  saved / loaded with a ``ParallelLayout``.

Each setup uses AdamW over two parameter groups (matrices with weight decay,
vectors without, different learning rates) and a LambdaLR that changes the
learning rate at every step. Batches are drawn from torch's, numpy's and
Python's global RNGs, so a resumed run only repeats the reference when all
three are restored.
"""

from __future__ import annotations

import os
import random
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

KINDS = ("single", "ddp", "fsdp2", "dtensor_tp", "megatron_tp")
WORLD = {"single": 1, "ddp": 2, "fsdp2": 2, "dtensor_tp": 2, "megatron_tp": 2}
# tensor-parallel setups need the same input batch on every rank
SAME_DATA_ON_ALL_RANKS = {"dtensor_tp", "megatron_tp"}

D_IN, HIDDEN, D_OUT, BATCH = 6, 16, 5, 4
LAST_STEP = 6  # the reference trains steps 1..LAST_STEP
SAVE_STEPS = (2, 4)  # it saves after these steps; the resume loads the latest
RESUME_STEP = SAVE_STEPS[-1]

REF_SEED, RESUME_SEED = 1234, 987  # global RNG seeds of the two runs
REF_INIT, RESUME_INIT = 1, 2  # weight-init seeds of the two runs


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


# --------------------------------------------------------------------------- Megatron-style TP
class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class MegatronMLP(torch.nn.Module):
    """LayerNorm -> column-parallel Linear -> GELU -> row-parallel Linear (+ replicated bias).

    Built from the full weights of a seeded full-size model, so every rank
    holds its slice of the same global model.
    """

    def __init__(self, tp_rank: int, tp_size: int, init_seed: int) -> None:
        super().__init__()
        from nostall.integrations import mark_tensor_parallel

        g = torch.Generator().manual_seed(init_seed)
        full_w1 = torch.randn(HIDDEN, D_IN, generator=g) * 0.3
        full_b1 = torch.randn(HIDDEN, generator=g) * 0.1
        full_w2 = torch.randn(D_OUT, HIDDEN, generator=g) * 0.3
        full_b2 = torch.randn(D_OUT, generator=g) * 0.1
        h = HIDDEN // tp_size
        sl = slice(tp_rank * h, (tp_rank + 1) * h)
        self.norm = torch.nn.LayerNorm(D_IN)
        self.fc1 = torch.nn.Linear(D_IN, h)
        self.fc2 = torch.nn.Linear(h, D_OUT)
        with torch.no_grad():
            self.norm.weight.copy_(1.0 + torch.randn(D_IN, generator=g) * 0.1)
            self.fc1.weight.copy_(full_w1[sl])
            self.fc1.bias.copy_(full_b1[sl])
            self.fc2.weight.copy_(full_w2[:, sl])
            self.fc2.bias.copy_(full_b2)
        mark_tensor_parallel(self.fc1.weight, 0)
        mark_tensor_parallel(self.fc1.bias, 0)
        mark_tensor_parallel(self.fc2.weight, 1)
        # norm.* and fc2.bias stay unmarked: replicated over the TP group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(self.norm(x))
        h = torch.nn.functional.gelu(self.fc1(x))
        y = _ReduceFromTP.apply(torch.nn.functional.linear(h, self.fc2.weight))
        return y + self.fc2.bias


# --------------------------------------------------------------------------- setups
class Setup:
    def __init__(self, kind: str, model: torch.nn.Module, inner: torch.nn.Module, optimizer: Any,
                 scheduler: Any, layout: Any = None) -> None:
        self.kind = kind
        self.model = model  # what is passed to save/load (DDP: the wrapper)
        self.inner = inner  # the module whose named_parameters name the state
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.layout = layout

    def layout_kw(self) -> Dict[str, Any]:
        return {} if self.layout is None else {"layout": self.layout}


def _mlp(init_seed: int, dropout: float) -> torch.nn.Module:
    torch.manual_seed(init_seed)
    layers: List[torch.nn.Module] = [torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh()]
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    layers.append(torch.nn.Linear(HIDDEN, D_OUT))
    return torch.nn.Sequential(*layers)


def _optimizer(inner: torch.nn.Module) -> torch.optim.Optimizer:
    params = dict(inner.named_parameters())
    matrices = [p for n, p in params.items() if p.dim() >= 2]
    vectors = [p for n, p in params.items() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1, "lr": 0.02},
         {"params": vectors, "weight_decay": 0.0, "lr": 0.01}],
        betas=(0.85, 0.95),
    )


def build(kind: str, rank: int, world: int, init_seed: int) -> Setup:
    """Model, optimizer and scheduler of ``kind``; the global RNGs are left as the caller set them."""
    state = torch.get_rng_state()  # model init below must not consume the caller's RNG stream
    try:
        if kind == "single":
            inner = model = _mlp(init_seed, dropout=0.25)
        elif kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            inner = _mlp(init_seed, dropout=0.25)
            model = DistributedDataParallel(inner)
        elif kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            inner = model = _mlp(init_seed, dropout=0.0)
            for m in inner:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(inner, mesh=mesh)
        elif kind == "dtensor_tp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (world,))
            inner = model = _mlp(init_seed, dropout=0.0)
            parallelize_module(inner, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        elif kind == "megatron_tp":
            import nostall

            inner = model = MegatronMLP(rank, world, init_seed)
            layout = nostall.ParallelLayout(tp_rank=rank, tp_size=world, dp_rank=0, dp_size=1)
        else:
            raise ValueError(kind)
    finally:
        torch.set_rng_state(state)
    opt = _optimizer(inner)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return Setup(kind, model, inner, opt, sched, layout if kind == "megatron_tp" else None)


def batch() -> tuple:
    """One batch from the three global RNGs (torch, numpy, Python)."""
    scale = 1.0 + random.random()
    shift = float(np.random.uniform(-0.5, 0.5))
    x = torch.randn(BATCH, D_IN) * scale + shift
    y = torch.randn(BATCH, D_OUT)
    return x, y


def train_step(s: Setup) -> float:
    x, y = batch()
    s.model.train()
    loss = torch.nn.functional.mse_loss(s.model(x), y)
    loss.backward()
    s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    return loss.item()


# --------------------------------------------------------------------------- snapshots
def _local(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "to_local"):  # DTensor (FSDP2, DTensor TP)
        t = t.to_local()
    return t.detach().clone()


def params_of(s: Setup) -> Dict[str, torch.Tensor]:
    """This rank's local parameter (and buffer) values, keyed by name in the inner module."""
    return {n: _local(t) for n, t in s.inner.state_dict().items() if isinstance(t, torch.Tensor)}


def optimizer_state_of(s: Setup) -> Dict[str, Dict[str, Any]]:
    """This rank's optimizer state, keyed by parameter name (tensors as local clones)."""
    names = {id(p): n for n, p in s.inner.named_parameters()}
    out: Dict[str, Dict[str, Any]] = {}
    for p, st in s.optimizer.state.items():
        out[names[id(p)]] = {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
    return out


def hparams_of(s: Setup) -> Dict[str, Any]:
    return {
        "lrs": [g["lr"] for g in s.optimizer.param_groups],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in s.optimizer.param_groups],
        "last_lr": list(s.scheduler.get_last_lr()),
        "last_epoch": s.scheduler.last_epoch,
    }


def snapshot(s: Setup) -> Dict[str, Any]:
    return {"params": params_of(s), "opt": optimizer_state_of(s), **hparams_of(s)}


def extra_for(rank: int, step: int) -> Dict[str, Any]:
    import nostall

    return {"epoch": step // 3, "loader": nostall.PerRank(rank * 1000 + step)}


def rank_seed(kind: str, seed: int, rank: int) -> int:
    return seed if kind in SAME_DATA_ON_ALL_RANKS else seed + 17 * rank


# --------------------------------------------------------------------------- jobs
def reference_job(rank: int, world: int, kind: str, root: Any, async_save: Optional[bool] = None,
                  last_step: int = LAST_STEP, save_steps: tuple = SAVE_STEPS) -> Dict[str, Any]:
    """Train steps 1..last_step from REF_INIT, saving after ``save_steps`` (root None: no saves).

    ``root`` is one root (saved with ``async_save``) or a list of ``(root, async_save)``: one run saves
    each step into every root, in that order, with a manager each (a synchronous save before an
    asynchronous one leaves the asynchronous one racing the next training step, as it would alone).
    """
    seed_all(rank_seed(kind, REF_SEED, rank))
    s = build(kind, rank, world, REF_INIT)
    dests = [] if root is None else [(root, async_save)] if isinstance(root, str) else list(root)
    mgrs = []
    out: Dict[str, Any] = {"losses": {}, "saved": {}}
    try:
        import nostall

        for r, a in dests:
            mgrs.append(nostall.CheckpointManager(r, keep_last=3, async_save=bool(a)))
        for step in range(1, last_step + 1):
            out["losses"][step] = train_step(s)
            if step in save_steps:
                out["saved"][step] = snapshot(s)  # what the checkpoint must hold
                for mgr in mgrs:
                    mgr.save(step, model=s.model, optimizer=s.optimizer, scheduler=s.scheduler, rng=True,
                             extra=extra_for(rank, step), **s.layout_kw())
        out["final"] = snapshot(s)
    finally:
        for mgr in mgrs:
            mgr.close()
    return out


def resume_job(rank: int, world: int, kind: str, root: str, step: Optional[int] = None,
               last_step: int = LAST_STEP) -> Dict[str, Any]:
    """Fresh model (other init, other RNG seeds), fresh optimizer and scheduler: load, then train to last_step."""
    import nostall

    seed_all(rank_seed(kind, RESUME_SEED, rank))
    s = build(kind, rank, world, RESUME_INIT)
    out: Dict[str, Any] = {"before": params_of(s), "losses": {}}
    assert not s.optimizer.state, "a fresh optimizer has no state"
    with nostall.CheckpointManager(root, keep_last=3) as mgr:
        kw: Dict[str, Any] = {} if step is None else {"step": step}
        resumed = mgr.load(model=s.model, optimizer=s.optimizer, scheduler=s.scheduler, **kw, **s.layout_kw())
        out["type"] = type(resumed).__name__
        out["is_loaded_checkpoint"] = isinstance(resumed, nostall.LoadedCheckpoint)
        out["step"] = resumed.step
        out["extra"] = resumed.extra
        out["path"] = os.path.normpath(str(resumed.path))
        out["path_for_step"] = os.path.normpath(mgr.path_for(resumed.step))
        out["rng_restored"] = resumed.rng_restored
        out["loaded"] = snapshot(s)
        for st in range(resumed.step + 1, last_step + 1):
            out["losses"][st] = train_step(s)
        out["final"] = snapshot(s)
    return out


def resume_each_job(rank: int, world: int, kind: str, roots: List[str]) -> List[Dict[str, Any]]:
    """:func:`resume_job` from each root in turn, in one fresh process (each with its own fresh model,
    RNG seeds, optimizer and scheduler; none of them saw the reference run)."""
    return [resume_job(rank, world, kind, root) for root in roots]


def resume_kinds_job(rank: int, world: int, plans: List[tuple]) -> List[List[Dict[str, Any]]]:
    """:func:`resume_each_job` for each ``(kind, roots)`` of ``plans`` in turn, in one fresh process."""
    return [resume_each_job(rank, world, kind, roots) for kind, roots in plans]


# --------------------------------------------------------------------------- comparison
def diff(a: Any, b: Any, where: str = "") -> List[str]:
    """Every place where ``a`` and ``b`` differ (tensors: bit-exact, dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        if not torch.equal(a, b):
            return [f"{where}: values differ (max abs diff {(a.double() - b.double()).abs().max().item():.3g})"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        if set(a) != set(b):
            out.append(f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}")
        for k in a:
            if k in b:
                out += diff(a[k], b[k], f"{where}/{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += diff(x, y, f"{where}[{i}]")
        return out
    if a != b or type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return [f"{where}: {a!r} vs {b!r}"]
    return []
