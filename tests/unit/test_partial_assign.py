"""Loads from copies that lack data files, without a process group: who reads which byte range for whom
(nostall.loading.peers.assign, collective.plan_transfers), the ranges a rank asks for covering every read the
engine makes, and a reader's checks of a range (docs/protocol.md, "Loading")."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import nostall
from nostall.core.format import Manifest, PieceRecord
from nostall.errors import CheckpointCorruptError, CheckpointLoadError
from nostall.loading import peers
from nostall.loading.collective import ManifestIndex, head_of, plan_transfers, share_of, with_share
from nostall.loading.engine import COALESCE_GAP
from nostall.loading.reader import load_state_keys, template_boxes
from nostall.loading.sources import check_range, open_files

A = "rank0.safetensors"
B = "rank1.safetensors"


def _assign(needs, cap, **kw):
    """peers.assign of ranges with no pieces to check."""
    return peers.assign([[(t, ()) for t in ts] for ts in needs], cap, **kw)


def test_a_rank_lacking_a_file_gets_it_from_a_needing_rank_that_has_it():
    t = (A, 0, 100)
    # ranks 0 and 1 need it; rank 0's copy lacks the file; rank 2 has it too but does not need it
    plans = _assign([[t], [t], []], 1 << 20, absent=[{A: "missing"}, {}, {}], once=False)
    assert plans[1].send == [(0, t, (0,))] and plans[0].recv == [(0, t, 1)]
    assert not plans[2].send and not plans[1].relayed


def test_each_rank_with_the_file_reads_its_own():
    t = (A, 0, 100)
    plans = _assign([[t], [t]], 1 << 20, absent=[{}, {}], once=False)
    assert all(not p.send and not p.recv for p in plans)


def test_no_needing_rank_has_it_the_holders_share_by_bytes():
    big, small, other = (A, 0, 100), (A, 100, 160), (A, 160, 200)
    plans = _assign([[big, small, other], [], [], []], 1 << 20,
                         absent=[{A: "missing"}, {A: "missing"}, {}, {}], once=False)
    # largest first, to the holder with the fewest bytes read for others (lowest rank on a tie)
    assert [s[1] for s in plans[2].send] == [big]
    assert [s[1] for s in plans[3].send] == [small, other]
    assert plans[2].relayed == {0} and plans[3].relayed == {1, 2}
    assert sorted(r[2] for r in plans[0].recv) == [2, 3, 3] and not plans[1].recv


def test_read_once_among_holders_and_to_the_ranks_that_lack_the_file():
    t = (A, 0, 100)
    plans = _assign([[t], [t], [t]], cap=1 << 20, absent=[{}, {}, {A: "gone"}], once=True)
    assert plans[0].send == [(0, t, (1, 2))]
    # past the cap a holder reads for itself; a rank that lacks the file receives whatever the cap
    plans = _assign([[t], [t], [t]], cap=50, absent=[{}, {}, {A: "gone"}], once=True)
    assert plans[0].send == [(0, t, (2,))] and not plans[1].recv


def test_a_failed_rank_reads_for_nobody():
    t = (A, 0, 100)
    plans = _assign([[t], [], []], 1 << 20, absent=[{A: "missing"}, None, {}], once=False)
    assert plans[2].send == [(0, t, (0,))] and not plans[1].send
    with pytest.raises(CheckpointLoadError) as e:
        _assign([[t], []], 1 << 20, absent=[{A: "missing"}, None], once=False)
    assert "rank 1: it failed before the load" in str(e.value)


def test_a_file_no_rank_has_names_it_the_ranks_that_need_it_and_why_each_lacks_it():
    with pytest.raises(CheckpointLoadError) as e:
        _assign([[(B, 0, 10)], [(B, 0, 10), (A, 0, 5)]], 1 << 20,
                     absent=[{B: "/r0/step_1/rank1.safetensors: data file missing"},
                             {B: "/r1/step_1/rank1.safetensors: size 3 bytes, the manifest says 40 (truncated?)"}],
                     once=False)
    msg = str(e.value)
    assert "'rank1.safetensors'" in msg and "needed by ranks 0, 1" in msg
    assert "/r0/step_1/rank1.safetensors: data file missing" in msg and "size 3 bytes" in msg
    assert "rank0.safetensors" not in msg.replace("/r0/", "")  # the file rank 1 has is not named


def _checkpoint(tmp_path):
    """A one-rank checkpoint: a 2-D weight, a vector and a per-rank value, small checksum blocks."""
    path = str(tmp_path / "full" / "step_1")
    state = {"w": torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48), "b": torch.arange(100.0),
             "s": nostall.PerRank(torch.arange(5))}
    nostall.save(state, path, block_size=256)
    return path, state, Manifest.from_json_bytes(open(os.path.join(path, "manifest.json"), "rb").read(), path)


def test_the_ranges_a_rank_asks_for_hold_every_byte_its_load_reads(tmp_path):
    path, state, m = _checkpoint(tmp_path)
    # a resharded template: rows 8..39, columns 10..29 of w (the piece met in part), b whole, the per-rank value
    template = {"w": nostall.ShardedTensor(torch.zeros(32, 20), (64, 48), (8, 10)), "b": torch.zeros(100),
                "s": nostall.PerRank(torch.zeros(5, dtype=torch.long))}
    share, needs = share_of(ManifestIndex(m), 0, template_boxes(template), parts=True, world=1)
    (name,) = m.files
    part = [t for t, ((k, _),) in needs if k == "w"][0]
    assert (part[1], part[2]) != (m.tensors["w"].pieces[0].start, m.tensors["w"].pieces[0].end)  # a sub-range
    # rank 0's copy lacks its one data file; rank 1 (needing nothing) has it and reads for it
    plans = plan_transfers([needs, []], False, [{name: "missing"}, {}])
    assert plans[1].relayed == {n for n, _, _ in plans[1].send} and plans[0].recv
    assert all(n in plans[1].checks for n, _, _ in plans[1].send)
    copy = str(tmp_path / "copy" / "step_1")
    shutil.copytree(path, copy)
    os.remove(os.path.join(copy, name))
    files = open_files(copy, m)
    assert files.absent() == {name: f"{os.path.join(copy, name)}: data file missing"}
    raw = open(os.path.join(path, name), "rb").read()
    for _n, t, _src in plans[0].recv:  # what rank 1 would send
        files.keep(t[0], t[1], memoryview(bytearray(raw[t[1]:t[2]])), received=True)
    got, report = load_state_keys(template, copy, manifest=with_share(head_of(m), share, 0), files=files)
    assert torch.equal(got["w"].data, state["w"][8:40, 10:30]) and torch.equal(got["b"], state["b"])
    assert torch.equal(got["s"], torch.arange(5))
    assert report.bytes_read == 0 and report.bytes_received == sum(t[2] - t[1] for _, t, _ in plans[0].recv)


def test_a_long_range_goes_in_parts_cut_at_blocks_each_checked_by_its_reader(tmp_path):
    path, state, m = _checkpoint(tmp_path)
    template = {"w": nostall.ShardedTensor(torch.zeros(32, 20), (64, 48), (8, 10)), "b": torch.zeros(100)}
    share, needs = share_of(ManifestIndex(m), 0, template_boxes(template), parts=True, world=1)
    (name,) = m.files
    plans = plan_transfers([needs, []], False, [{name: "missing"}, {}], m.block_size, most=1000)
    sends = sorted((t, plans[1].checks[n]) for n, t, _ in plans[1].send)
    assert len(sends) > 3 and all(t[2] - t[1] <= 1000 for t, _ in sends)  # (the load reads them whole below)
    w = m.tensors["w"].pieces[0]
    for blk in range(w.start, w.end, m.block_size):  # each block of w sent is whole in one part, checked there
        end = min(blk + m.block_size, w.end)
        meeting = [(t, cs) for t, cs in sends if t[1] < end and blk < t[2]]
        assert len(meeting) in (0, 1), (blk, meeting)
        assert all(t[1] <= blk and end <= t[2] and any(c[1] == w for c in cs) for t, cs in meeting)
    raw = open(os.path.join(path, name), "rb").read()
    for t, cs in sends:  # what rank 1 would check before sending
        check_range(memoryview(raw)[t[1]:t[2]], t[1], cs, "f", m.block_size)
    copy = str(tmp_path / "copy" / "step_1")
    shutil.copytree(path, copy)
    os.remove(os.path.join(copy, name))
    files = open_files(copy, m)
    for _n, t, _src in plans[0].recv:
        files.keep(t[0], t[1], memoryview(bytearray(raw[t[1]:t[2]])), received=True)
    got, report = load_state_keys(template, copy, manifest=with_share(head_of(m), share, 0), files=files,
                                  strict=False)
    assert torch.equal(got["w"].data, state["w"][8:40, 10:30]) and torch.equal(got["b"], state["b"])
    assert report.bytes_read == 0


def test_ranges_of_a_file_within_the_coalescing_gap_are_one():
    m_piece = PieceRecord((0,), (4,), A, 0, 16, (0,))
    n_piece = PieceRecord((0,), (4,), A, 16 + COALESCE_GAP, 32 + COALESCE_GAP, (0,))
    far = PieceRecord((0,), (4,), A, 33 + 2 * COALESCE_GAP, 49 + 2 * COALESCE_GAP, (0,))
    needs = [((p.file, p.start, p.end), ((k, p),)) for k, p in (("m", m_piece), ("n", n_piece), ("f", far))]
    plans = plan_transfers([needs, []], False, [{A: "missing"}, {}])
    assert [t for _, t, _ in plans[0].recv] == [(A, 0, 32 + COALESCE_GAP), (A, far.start, far.end)]  # largest first
    assert {k for k, _ in plans[1].checks[0]} == {"m", "n"} and {k for k, _ in plans[1].checks[1]} == {"f"}


def test_a_reader_checks_the_whole_blocks_of_a_range(tmp_path):
    path, _, m = _checkpoint(tmp_path)
    p = m.tensors["b"].pieces[0]
    raw = bytearray(open(os.path.join(path, p.file), "rb").read())
    bs = m.block_size
    check_range(memoryview(raw)[p.start:p.end], p.start, [("b", p)], "f", bs)
    raw[p.start + bs + 3] ^= 0xFF  # the second block
    with pytest.raises(CheckpointCorruptError) as e:
        check_range(memoryview(raw)[p.start:p.end], p.start, [("b", p)], "f", bs)
    assert f"[{p.start + bs}, {min(p.start + 2 * bs, p.end)})" in str(e.value) and "'b'" in str(e.value)
    # a range that cuts the damaged block (it does not hold it whole) is not its to check
    check_range(memoryview(raw)[p.start + bs + 8:p.end], p.start + bs + 8, [("b", p)], "f", bs)
    check_range(memoryview(raw)[p.start:p.start + bs + 8], p.start, [("b", p)], "f", bs)
