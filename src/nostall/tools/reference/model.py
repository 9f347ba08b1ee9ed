"""A small GPT-style transformer with real tensor parallelism.

Per block: LayerNorm -> attention (q, k, v column-parallel: each TP rank owns
``n_head / tp`` heads; output projection row-parallel) -> LayerNorm -> MLP
(up column-parallel, down row-parallel). Embeddings, norms and the LM head
are replicated. Weights are drawn from one seeded generator in a fixed order,
so the model is the same for every TP size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from nostall.tools.reference.parallel import ColumnParallelLinear, ParallelGroups, RowParallelLinear, copy_to_tp


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128  # bytes of ASCII text
    seq_len: int = 32
    d_model: int = 64
    n_head: int = 4
    n_layer: int = 2


class Block(torch.nn.Module):
    def __init__(self, cfg: GPTConfig, groups: ParallelGroups, gen: torch.Generator) -> None:
        super().__init__()
        tp = groups.layout.tp_size
        if cfg.n_head % tp:
            raise ValueError(f"n_head={cfg.n_head} is not divisible by the TP size {tp}")
        self.groups = groups
        self.local_heads = cfg.n_head // tp
        self.head_dim = cfg.d_model // cfg.n_head
        d = cfg.d_model
        self.ln1 = torch.nn.LayerNorm(d)
        self.q = ColumnParallelLinear(d, d, groups, gen)
        self.k = ColumnParallelLinear(d, d, groups, gen)
        self.v = ColumnParallelLinear(d, d, groups, gen)
        self.proj = RowParallelLinear(d, d, groups, gen)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = ColumnParallelLinear(d, 4 * d, groups, gen)
        self.down = RowParallelLinear(4 * d, d, groups, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = copy_to_tp(self.ln1(x), self.groups)

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.local_heads, self.head_dim).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.q(h)), heads(self.k(h)), heads(self.v(h)), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        h = copy_to_tp(self.ln2(x), self.groups)
        return x + self.down(F.gelu(self.up(h)))


class GPT(torch.nn.Module):
    def __init__(self, cfg: GPTConfig, groups: ParallelGroups, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        self.tok = torch.nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = torch.nn.Embedding(cfg.seq_len, cfg.d_model)
        with torch.no_grad():
            self.tok.weight.copy_(torch.randn(cfg.vocab_size, cfg.d_model, generator=gen) * 0.02)
            self.pos.weight.copy_(torch.randn(cfg.seq_len, cfg.d_model, generator=gen) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(cfg, groups, gen) for _ in range(cfg.n_layer))
        self.ln_f = torch.nn.LayerNorm(cfg.d_model)
        self.head = torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(cfg.vocab_size, cfg.d_model, generator=gen) * cfg.d_model ** -0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for token ids ``idx`` (batch, time)."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, n: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Sample ``n`` tokens after ``prompt`` (batch, time); returns only the new tokens.

        Samples from the global RNG unless ``generator`` is given; on a TP
        model every rank of a TP group must hold the same RNG state (they then
        draw the same tokens, since the logits are replicated).
        """
        idx = prompt
        out = []
        for _ in range(n):
            logits = self(idx[:, -self.cfg.seq_len :])[:, -1]
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            out.append(nxt)
            idx = torch.cat([idx, nxt], dim=1)
        return torch.cat(out, dim=1)
