"""The write path: checksums taken beside the writes, paced background writes, byte views that own their memory."""

from __future__ import annotations

import gc
import os

import pytest
import torch

import nostall
from nostall.storage import files as storage
from nostall.core.tensorbuf import byte_view
from nostall.saving.datafiles import Checksums
from nostall.core.format import block_crcs
from nostall.loading.verify import check_checkpoint
from nostall.options import Options


def _state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(1 << 20, generator=g), "b": torch.randn(333, generator=g).to(torch.bfloat16),
            "odd": torch.randn(64, 48, generator=g)[:, ::3], "empty": torch.empty(0), "step": 7}


def _files(step_dir):
    return {n: open(os.path.join(step_dir, n), "rb").read() for n in sorted(os.listdir(step_dir))}


def test_byte_view_keeps_its_tensor_alive():
    t = torch.arange(1000, dtype=torch.float32) * 3
    expected = bytes(byte_view(t))
    view = byte_view(t)[8:]
    del t
    gc.collect()
    torch.zeros(1000, dtype=torch.float32).add_(1)  # memory freed above would be reused here
    assert bytes(view) == expected[8:]


def test_checksums_match_inline_checksums_in_order():
    data = memoryview(os.urandom(5 * 4096 + 17))
    with Checksums(4096) as sums:
        sums.add(("f", 0, 2 * 4096), data[: 2 * 4096])
        sums.add(("f", 0, 2 * 4096), data[2 * 4096 : 2 * 4096])  # an empty segment changes nothing
        sums.add(("g", 10, 10 + len(data) - 2 * 4096), data[2 * 4096 :])
        sums.expect(("h", 5, 5))
        got = sums.result()
    assert got == {("f", 0, 2 * 4096): tuple(block_crcs(data[: 2 * 4096], 4096)),
                   ("g", 10, 10 + len(data) - 2 * 4096): tuple(block_crcs(data[2 * 4096 :], 4096)),
                   ("h", 5, 5): ()}


@pytest.mark.parametrize("budget", [None, 1 << 20])
def test_sync_async_and_chunked_saves_are_byte_identical(tmp_path, budget):
    """The checksums now come from a thread: whole or chunk by chunk (a 1 MiB budget for 4 MiB), sync or async,
    the files are the same bytes and they verify."""
    state = _state()
    bs = 1 << 16
    with nostall.CheckpointManager(tmp_path / "sync", block_size=bs) as m:
        m.save(1, state)
    with nostall.CheckpointManager(tmp_path / "async", async_save=True, staging_budget_bytes=budget,
                                   block_size=bs) as m:
        stats = m.save(1, state).result()
    assert (stats.chunks > 1) == (budget is not None)
    assert _files(tmp_path / "sync" / "step_1") == _files(tmp_path / "async" / "step_1")
    for run in ("sync", "async"):
        report = check_checkpoint(str(tmp_path / run / "step_1"))
        assert report.ok and report.files == 1, report.problems
        with nostall.CheckpointManager(tmp_path / run, read_only=True) as m:
            out = m.load({k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in state.items()})
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(out[k], v), (run, k)


def test_max_write_rate_paces_the_background_writer(tmp_path):
    """A cap of 4 MiB/s makes an 8 MiB save take at least about 2 s to write (the pacer sleeps), with the same
    bytes on disk as an unpaced save."""
    state = {"w": torch.randn(2 << 20)}  # 8 MiB
    rate = 4 << 20
    with nostall.CheckpointManager(tmp_path / "paced", async_save=True, max_write_rate=rate) as m:
        stats = m.save(1, state).result()
    with nostall.CheckpointManager(tmp_path / "free", async_save=True) as m:
        m.save(1, state).result()
    assert _files(tmp_path / "paced" / "step_1") == _files(tmp_path / "free" / "step_1")
    # a lower bound set by the pacer's sleep after the one 8 MiB piece, not by the machine's speed
    assert stats.write_s is not None and stats.write_s >= 8 / 4 * 0.95


def test_pacer_sleeps_only_when_ahead(monkeypatch):
    clock = [100.0]
    slept = []
    monkeypatch.setattr(storage.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(storage.time, "sleep", lambda s: slept.append(s))
    p = storage.Pacer(10.0)
    p.wrote(20)  # 2 s of bytes at t=0: sleeps 2 s
    clock[0] += 5.0  # 5 s later, 2 s were due: not ahead
    p.wrote(10)
    assert slept == [pytest.approx(2.0)]


def test_pacer_never_sleeps_past_half_the_timeout(monkeypatch):
    clock = [100.0]
    slept = []
    monkeypatch.setattr(storage.time, "monotonic", lambda: clock[0])

    def sleep(s):
        slept.append(s)
        clock[0] += s

    monkeypatch.setattr(storage.time, "sleep", sleep)
    p = storage.Pacer(10.0, timeout=8.0)  # 100 bytes at 10 B/s take 10 s: more than the 4 s it may pace
    for _ in range(10):
        p.wrote(10)
    assert p.lifted and sum(slept) == pytest.approx(4.0)  # paced until halfway to the deadline, then full speed
    q = storage.Pacer(10.0, timeout=100.0)
    for _ in range(10):
        q.wrote(10)
    assert not q.lifted


@pytest.mark.parametrize("bad", [0, -5, True, "fast", 1000])
def test_max_write_rate_is_validated(bad):
    with pytest.raises(ValueError, match="max_write_rate"):
        Options(max_write_rate=bad)
