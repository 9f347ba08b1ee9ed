"""Coalesced reads: the byte ranges a load needs from a file are read in spans, each byte once, every block
used still checked, and the values equal to what was saved (many small pieces, resharded regions, regions
sharing a piece's blocks)."""

import gc
import os
import weakref
from typing import Dict, List, Tuple

import pytest
import torch

import nostall
from nostall.core.format import MANIFEST_NAME
from nostall.core.model import ShardedTensor
from nostall.interop._common import Source
from nostall.loading import engine, sources
from nostall.loading.manifests import read_manifest
from nostall.tools.bench.scale import write_pieces_checkpoint

Ranges = Dict[str, List[Tuple[int, int]]]


@pytest.fixture
def reads(monkeypatch) -> Ranges:
    """Every data-file read of the test: file name -> [(offset, end)]."""
    got: Ranges = {}
    real, real_into = sources.DataFiles.read, sources.DataFiles.read_into

    def counting(self, name, offset, length, into=None):
        got.setdefault(name, []).append((offset, offset + length))
        return real(self, name, offset, length, into)

    def counting_into(self, name, offset, bufs):  # a gathered read: one read of the bytes it fills
        got.setdefault(name, []).append((offset, offset + sum(len(b) for b in bufs)))
        self.read = real.__get__(self)  # its reads buffer by buffer (bytes received) are the same read
        try:
            return real_into(self, name, offset, bufs)
        finally:
            del self.read

    monkeypatch.setattr(sources.DataFiles, "read", counting)
    monkeypatch.setattr(sources.DataFiles, "read_into", counting_into)
    return got


def assert_each_byte_once(got: Ranges) -> int:
    """No byte of any file read twice; the number of reads."""
    for name, ranges in got.items():
        ranges = sorted(ranges)
        for (_, e), (s, _) in zip(ranges, ranges[1:]):
            assert s >= e, f"{name}: bytes [{s}, {e}) read twice"
    return sum(len(r) for r in got.values())


def pieces_checkpoint(path: str, pieces: int, block_size: int) -> Dict[str, torch.Tensor]:
    """A checkpoint of two tensors saved as ``pieces`` row blocks each (one file per block row)."""
    g = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn((pieces * 3, 40), generator=g),
               "b": torch.arange(pieces * 2 * 24, dtype=torch.float64).reshape(pieces * 2, 24)}
    write_pieces_checkpoint(path, tensors, pieces, block_size)
    return tensors


def test_many_small_pieces_load_whole_and_each_file_in_one_read(tmp_path, reads):
    path = str(tmp_path / "c")
    saved = pieces_checkpoint(path, 64, 1 << 20)
    out = nostall.load({k: torch.zeros_like(v) for k, v in saved.items()}, path)
    for k, v in saved.items():
        parts = [v.narrow(0, i * (v.shape[0] // 64), v.shape[0] // 64) for i in range(64)]
        assert torch.equal(out[k], torch.cat(parts)), k
    assert assert_each_byte_once(reads) == 64  # both pieces of a file in one span
    assert len(reads) == 64


@pytest.mark.parametrize("block_size", [64, 4096, 1 << 20])
def test_resharded_regions_equal_the_saved_values_each_byte_read_once(tmp_path, reads, block_size):
    path = str(tmp_path / "c")
    saved = pieces_checkpoint(path, 8, block_size)
    # column halves (every piece cut, rows interleaved) and a row band across piece boundaries, in one load
    tpl = {"a": ShardedTensor(torch.zeros(24, 20), (24, 40), (0, 20)),
           "b": ShardedTensor(torch.zeros(5, 24, dtype=torch.float64), (16, 24), (3, 0))}
    out = nostall.load(tpl, path)
    assert torch.equal(out["a"].data, saved["a"][:, 20:])
    assert torch.equal(out["b"].data, saved["b"][3:8])
    assert_each_byte_once(reads)


def test_regions_sharing_a_pieces_blocks_read_it_once(tmp_path, reads):
    """Four regions of one piece whose block-aligned ranges overlap (neighbours share boundary blocks)."""
    path = str(tmp_path / "c")
    w = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    nostall.save({"w": w, "n": torch.ones(3)}, path, block_size=256)
    m = read_manifest(path)
    rec = m.tensors["w"]
    dests = [torch.zeros(16, 30), torch.zeros(16, 18), torch.zeros(32, 48), torch.zeros(1, 5)]
    offs = [(0, 0), (0, 30), (16, 0), (63, 43)]
    plan: List[engine.Read] = []
    for d, off in zip(dests, offs):
        engine.plan_reads(rec, d, off, plan)
    files = sources.open_files(path, m)
    try:
        with sources.Verifier(True) as checks:
            engine.execute_all(plan, files, m, checks)
            checks.finish()
    finally:
        files.close()
    for d, (r, c) in zip(dests, offs):
        assert torch.equal(d, w[r : r + d.shape[0], c : c + d.shape[1]])
    assert assert_each_byte_once(reads) == 1
    (lo, hi), = reads[rec.pieces[0].file]
    assert (lo, hi) == (rec.pieces[0].start, rec.pieces[0].end)


def test_a_span_over_the_window_is_read_in_windows_each_byte_once(tmp_path, reads, monkeypatch):
    """A region larger than the window (three arenas of 4 KiB): row chunks whose boundary blocks are shared,
    carried, not re-read (and copied a few rows at a time)."""
    monkeypatch.setattr(engine, "SPAN_BUDGET", 3 * 4096)
    monkeypatch.setattr(engine, "COPY_GRAIN", 100)
    path = str(tmp_path / "c")
    w = torch.randn(200, 33, generator=torch.Generator().manual_seed(5))
    nostall.save({"w": w}, path, block_size=512)
    out = nostall.load({"w": ShardedTensor(torch.zeros(190, 31), (200, 33), (5, 1))}, path)
    assert torch.equal(out["w"].data, w[5:195, 1:32])
    assert assert_each_byte_once(reads) > 3


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_corrupt_block_in_a_coalesced_span_is_caught_naming_the_file(tmp_path, where):
    path = str(tmp_path / "c")
    pieces_checkpoint(path, 4, 64)
    m = read_manifest(path)
    pieces = sorted(m.tensors["a"].pieces + m.tensors["b"].pieces, key=lambda p: (p.file, p.start))
    p = {"first": pieces[0], "middle": pieces[3], "last": pieces[-1]}[where]
    target = os.path.join(path, p.file)
    with open(target, "r+b") as f:
        f.seek(p.end - 3)
        byte = f.read(1)
        f.seek(p.end - 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    for tpl in ({"a": torch.zeros(12, 40), "b": torch.zeros(8, 24, dtype=torch.float64)},
                {"a": ShardedTensor(torch.zeros(12, 7), (12, 40), (0, 33)),
                 "b": ShardedTensor(torch.zeros(8, 5, dtype=torch.float64), (8, 24), (0, 19))}):
        with pytest.raises(nostall.CheckpointCorruptError, match="checksum mismatch") as ei:
            nostall.load(tpl, path)
        assert target in str(ei.value)
    assert os.path.exists(os.path.join(path, MANIFEST_NAME))


class _Arena(bytearray):
    """A bytearray that can be watched by a weak reference."""


class _Made(list):
    """Weak references to the arenas made; ``most``: the most bytes of them alive at once."""

    most = 0


@pytest.fixture
def arenas(monkeypatch) -> _Made:
    """Every span arena made during the test, weakly (so the test sees when it is let go)."""
    made = _Made()

    def alloc(size: int) -> memoryview:
        gc.collect()
        live = sum(len(a) for a in (r() for r in made) if a is not None)
        made.most = max(made.most, live + size)
        a = _Arena(size)
        made.append(weakref.ref(a))
        return memoryview(a)

    monkeypatch.setattr(engine, "_alloc", alloc)
    return made


def _flip_byte(path: str, piece, at: int) -> None:
    """Flip one bit of the stored byte ``at`` of ``piece`` (a corrupt block)."""
    with open(os.path.join(path, piece.file), "r+b") as f:
        f.seek(piece.start + at)
        b = f.read(1)
        f.seek(piece.start + at)
        f.write(bytes([b[0] ^ 1]))


def _alive(made) -> int:
    gc.collect()
    return sum(r() is not None for r in made)


def test_span_arenas_are_the_loads_own_and_go_with_it(tmp_path, arenas):
    """No arena outlives the load that made it: not after a load, nor after one that failed (a corrupt block)."""
    path = str(tmp_path / "c")
    saved = pieces_checkpoint(path, 8, 4096)
    tpl = {"a": ShardedTensor(torch.zeros(24, 20), (24, 40), (0, 20)), "b": torch.zeros(16, 24, dtype=torch.float64)}
    out = nostall.load(tpl, path)
    assert torch.equal(out["a"].data, saved["a"][:, 20:])
    assert arenas and _alive(arenas) == 0
    m = read_manifest(path)
    _flip_byte(path, m.tensors["a"].pieces[2], 5)
    n = len(arenas)
    with pytest.raises(nostall.CheckpointCorruptError, match="checksum mismatch"):
        nostall.load(tpl, path)
    assert len(arenas) > n and _alive(arenas) == 0


@pytest.mark.parametrize("budget", [1024, 3000, 3 * 4096, 1 << 20])
def test_a_source_reads_within_its_budget_and_close_lets_the_arenas_go(tmp_path, arenas, budget):
    """A conversion's Source keeps its span buffers from read to read, never more than the budget allows (at
    least two blocks), and lets them go at close()."""
    path = str(tmp_path / "c")
    w = torch.randn(300, 70, generator=torch.Generator().manual_seed(7))
    nostall.save({"w": w, "v": torch.arange(5000, dtype=torch.int16)}, path, block_size=512)
    src = Source(path, read_budget=budget)
    try:
        for off, shape in (((0, 0), (300, 70)), ((7, 3), (250, 60)), ((299, 0), (1, 70)), ((5, 69), (200, 1))):
            got = torch.empty(shape)
            src.read("w", off, got)
            assert torch.equal(got, w[off[0]:off[0] + shape[0], off[1]:off[1] + shape[1]])
        assert torch.equal(src.read_new("v", (17,), (4000,)), torch.arange(17, 4017, dtype=torch.int16))
        most = src.spans.most(512)
        assert most <= max(budget, 2 * 512)
        assert 0 < arenas.most <= most
        assert _alive(arenas) > 0
    finally:
        src.close()
    assert _alive(arenas) == 0


def test_an_export_below_two_blocks_reads_small_pieces_within_its_limit(tmp_path, arenas):
    """Blocks of 1 MiB, tensors of a few KiB, a 64 KiB limit: the span buffers are no larger than the pieces
    read, and let go after each region's read."""
    from safetensors.torch import load_file

    from nostall.interop.export import export

    path = str(tmp_path / "c")
    saved = {"a": torch.randn(40, 30), "b": torch.arange(700, dtype=torch.float64)}
    nostall.save(saved, path, block_size=1 << 20)
    rep = export(path, str(tmp_path / "o"), memory_limit=64 << 10)
    got = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in saved.items())
    assert rep.peak_buffer_bytes <= 64 << 10
    assert arenas.most <= 64 << 10  # (whole pieces go straight into their tensors: no arena at all)
    assert _alive(arenas) == 0


def test_gathered_reads_skip_the_gap_of_a_key_not_loaded_and_catch_a_flipped_byte(tmp_path, reads):
    """Small whole pieces go straight into their tensors by one gathered read per file (a key left out of the
    template is a gap read into scratch); every one of their blocks is still checked."""
    path = str(tmp_path / "c")
    saved = {"x": torch.arange(300.0), "y": torch.full((500,), 7.0), "z": torch.arange(200.0) * -1}
    nostall.save(saved, path, block_size=64)
    out = nostall.load({"x": torch.zeros(300), "z": torch.zeros(200)}, path, strict=False)
    assert torch.equal(out["x"], saved["x"]) and torch.equal(out["z"], saved["z"])
    assert assert_each_byte_once(reads) == 1  # x, the gap of y, z: one read
    m = read_manifest(path)
    _flip_byte(path, m.tensors["z"].pieces[0], 300)
    with pytest.raises(nostall.CheckpointCorruptError, match="checksum mismatch.*'z'"):
        nostall.load({"x": torch.zeros(300), "z": torch.zeros(200)}, path, strict=False)


def test_a_short_gathered_read_reads_the_rest_buffer_by_buffer(tmp_path, monkeypatch):
    from nostall.storage import posix

    path = str(tmp_path / "c")
    saved = {f"t{i}": torch.arange(100.0) + i for i in range(5)}
    nostall.save(saved, path)
    real = os.preadv
    calls = []

    def short(fd, bufs, offset):  # a gathered read that stops in the middle of its third buffer
        calls.append(len(bufs))
        if len(bufs) > 1:
            return real(fd, bufs[:2] + [bufs[2][:13]], offset)
        return real(fd, bufs, offset)

    monkeypatch.setattr(posix.os, "preadv", short)
    out = nostall.load({k: torch.zeros(100) for k in saved}, path)
    assert all(torch.equal(out[k], v) for k, v in saved.items())
    assert calls[0] == 5 and len(calls) > 1  # one gathered read of the five, then the rest of the third onwards
