"""Incremental saves take a changed piece's digest beside its write (issue 29).

A piece sure to be written (no base, or its probe differs from the base's) is hashed by the checksum
thread while it is written; a piece that may be unchanged is hashed first. Asserted on what lands on
storage: every digest in the manifest is the xxh3-128 of the bytes it names, a change the probe's
samples miss is still written, and unchanged pieces are still left out. Which path a piece took is
read from the :class:`~nostall.saving.datafiles.Checksums` calls (a pytest monkeypatch, no timing).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Tuple

import pytest
import torch

import nostall
from nostall.core.format import content_digest
from nostall.loading.verify import check_checkpoint
from nostall.saving import datafiles
from nostall.saving.datafiles import probe

BIG = 1 << 18  # float32 elements: 1 MiB, above the size hashed inline
SMALL = 1 << 10  # 4 KiB: hashed inline


def _state() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(29)
    return {"a": torch.randn(BIG, generator=g), "b": torch.randn(BIG, generator=g),
            "frozen": torch.randn(BIG, generator=g), "small": torch.randn(SMALL, generator=g)}


def _manifest(step_dir: str) -> Dict[str, Any]:
    with open(os.path.join(step_dir, "manifest.json")) as f:
        return dict(json.load(f))


def _check_digests(root: str, step: int) -> Dict[str, str]:
    """Every piece's digest in the manifest of ``step`` is that of the bytes it names; name -> its file."""
    step_dir = os.path.join(root, f"step_{step}")
    where = {}
    for name, t in _manifest(step_dir)["tensors"].items():
        for p in t["pieces"]:
            path = os.path.join(root, p["file"]) if "/" in p["file"] else os.path.join(step_dir, p["file"])
            with open(path, "rb") as f:
                a, b = p["byte_range"]
                f.seek(a)
                data = f.read(b - a)
            assert p["xxh3_128"] == content_digest(data), (step, name)
            where[name] = p["file"]
    return where


class _Spy:
    """Records, per save, the pieces the checksum thread was also asked to hash (beside their write)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.beside: List[Tuple[str, int, int]] = []
        add = datafiles.Checksums.add

        def spy(sums: datafiles.Checksums, piece: Any, buf: memoryview, hasher: Any = None) -> None:
            if hasher is not None:
                self.beside.append(piece)
            add(sums, piece, buf, hasher)

        monkeypatch.setattr(datafiles.Checksums, "add", spy)

    def take(self) -> int:
        n, self.beside = len(set(self.beside)), []
        return n


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_changed_pieces_are_hashed_beside_and_their_digests_are_right(tmp_path, monkeypatch, async_save):
    """First save (no base): every large piece is hashed beside its write. Then ``a`` and ``b`` change
    everywhere: their probes differ from the base's, so they are hashed beside their write too; the
    frozen piece (equal probe) is hashed first and left out. Every digest names its bytes."""
    spy = _Spy(monkeypatch) if not async_save else None  # the async writer is another process
    root = str(tmp_path / "run")
    state = _state()
    with nostall.CheckpointManager(root, incremental=True, async_save=async_save) as m:
        m.save(1, state).result()
        if spy is not None:
            assert spy.take() == 3  # a, b, frozen; small is hashed inline
        for step in (2, 3):
            state["a"].add_(1.0)
            state["b"].mul_(1.5)
            state["small"].add_(1.0)
            written = m.save(step, state).result().bytes_written
            assert 2 * 4 * BIG + 4 * SMALL <= written <= 2 * 4 * BIG + 4 * SMALL + 4096  # plus the header
            if spy is not None:
                assert spy.take() == 2  # a and b
    for step in (1, 2, 3):
        where = _check_digests(root, step)
        assert check_checkpoint(os.path.join(root, f"step_{step}")).ok
    assert where["frozen"].startswith("step_1/") and "/" not in where["a"]
    out = nostall.load({k: torch.zeros_like(v) for k, v in state.items()}, os.path.join(root, "step_3"))
    for k, v in state.items():
        assert torch.equal(out[k], v), k


def test_a_change_the_probe_misses_is_written(tmp_path, monkeypatch):
    """One element of the frozen piece changes away from the probe's three samples: the probe equals the
    base's, the full digest is taken first and differs, so the piece is written; unchanged again at the
    next save, it is left out and read from the save that wrote it."""
    spy = _Spy(monkeypatch)
    root = str(tmp_path / "run")
    state = _state()
    before = probe(memoryview(state["frozen"].numpy()).cast("B"))
    state["frozen"][BIG // 4] += 1.0
    assert probe(memoryview(state["frozen"].numpy()).cast("B")) == before  # the probe does not see it
    state["frozen"][BIG // 4] -= 1.0
    with nostall.CheckpointManager(root, incremental=True) as m:
        m.save(1, state)
        spy.take()
        state["frozen"][BIG // 4] += 1.0
        assert m.save(2, state).stats.bytes_written >= 4 * BIG
        assert spy.take() == 0  # nothing was sure to change: every piece hashed first
        assert m.save(3, state).stats.bytes_written < 4096
    where = _check_digests(root, 3)
    assert where["frozen"].startswith("step_2/") and where["a"].startswith("step_1/")
    out = nostall.load({k: torch.zeros_like(v) for k, v in state.items()}, os.path.join(root, "step_3"))
    for k, v in state.items():
        assert torch.equal(out[k], v), k


def test_segmented_pieces_are_hashed_beside_and_dropped_when_unchanged(tmp_path):
    """Pieces arriving in chunks (a 256 KiB staging budget for 1 MiB pieces): hashed as they are written;
    changed ones kept with the right digest, unchanged ones dropped."""
    root = str(tmp_path / "run")
    state = _state()
    with nostall.CheckpointManager(root, incremental=True, async_save=True, staging_budget_bytes=256 << 10,
                                   block_size=64 << 10) as m:
        assert (m.save(1, state).result().chunks or 0) > 2
        state["a"].add_(1.0)
        written = m.save(2, state).result().bytes_written
        assert 4 * BIG <= written <= 4 * BIG + 4096
    where = _check_digests(root, 2)
    assert where["b"].startswith("step_1/") and where["frozen"].startswith("step_1/") and "/" not in where["a"]
    assert check_checkpoint(os.path.join(root, "step_2")).ok


def test_probe_is_a_function_of_three_samples():
    data = bytearray(os.urandom(1 << 20))
    p = probe(memoryview(data))
    assert probe(memoryview(bytes(data))) == p
    for at in (0, (len(data) - 4096) // 2 + 5, len(data) - 1):  # in one of the samples: seen
        changed = bytearray(data)
        changed[at] ^= 1
        assert probe(memoryview(changed)) != p, at
    changed = bytearray(data)
    changed[len(data) // 4] ^= 1  # between the samples: not seen (the digest decides)
    assert probe(memoryview(changed)) == p
    small = memoryview(data)[:1000]
    assert probe(small) != probe(memoryview(bytes(small[:999]) + b"\x00"))
