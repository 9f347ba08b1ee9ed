"""A generated text corpus and a resumable, data-parallel batch loader."""

from __future__ import annotations

import random
from typing import Any, Dict, Tuple

import torch

_SUBJECTS = ["the cat", "a small dog", "the old sailor", "my sister", "the robot", "a tired student",
             "the baker", "our neighbour", "the gardener", "a quiet child"]
_VERBS = ["sees", "paints", "finds", "carries", "remembers", "counts", "follows", "repairs", "sells", "hides"]
_OBJECTS = ["a red kite", "the morning bread", "seven stones", "the broken clock", "a letter",
            "the green door", "an old map", "the last apple", "a paper boat", "the silver key"]
_ENDINGS = ["at dawn.", "in the rain.", "near the river.", "before dinner.", "with great care.",
            "and smiles.", "without a word.", "every tuesday.", "under the bridge.", "again."]


def make_corpus(n_sentences: int = 4000, seed: int = 0) -> bytes:
    """Deterministic ASCII text from a tiny grammar (about 40 bytes per sentence)."""
    rng = random.Random(seed)
    words = [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
        for _ in range(n_sentences)
    ]
    return (" ".join(words) + "\n").encode("ascii")


class Loader:
    """Fixed-length windows of the corpus, shuffled per epoch, split over DP ranks.

    Its position (``epoch``, ``index`` of the next global batch) is the same on
    every rank and is saved with the checkpoint; each DP rank takes its own
    slice of every global batch, so resuming at that position continues the
    exact sample sequence, and a different DP size continues the same global
    sequence.
    """

    def __init__(self, corpus: bytes, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by the DP size {dp_size}")
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed
        self.n_windows = (len(self.data) - 1) // seq_len
        if self.n_windows < global_batch:
            raise ValueError("corpus too small for one batch")
        self.epoch, self.index = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.n_windows, generator=torch.Generator().manual_seed(self.seed * 1000003 + epoch))

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank, each (global_batch / dp_size, seq_len)."""
        if (self.index + 1) * self.global_batch > self.n_windows:
            self.epoch, self.index = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        per = self.global_batch // self.dp_size
        lo = self.index * self.global_batch + self.dp_rank * per
        starts = self._perm[lo : lo + per] * self.seq_len
        offs = torch.arange(self.seq_len + 1)
        win = self.data[starts[:, None] + offs[None, :]]
        self.index += 1
        return win[:, :-1], win[:, 1:]

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._perm = self._permutation(self.epoch)
