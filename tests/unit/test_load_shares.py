"""A shared load's pieces, without a process group: the head rank 0 broadcasts and each rank's share
(nostall.loading.collective; docs/protocol.md "Loading")."""

from __future__ import annotations

import pickle

import torch

import nostall
from nostall.core.format import Manifest, RankRecord, TensorRecord
from nostall.loading.collective import ManifestIndex, head_of, share_of, with_share


def _manifest(tmp_path, ranks: int) -> Manifest:
    nostall.save({"w": torch.arange(12.0).reshape(4, 3), "rng": nostall.PerRank(torch.arange(3))}, str(tmp_path / "c"))
    m = Manifest.from_json_bytes((tmp_path / "c" / "manifest.json").read_bytes(), "c")
    own = m.per_rank[0]
    # as if `ranks` ranks had saved: alike per-rank keys, each rank its own values
    per_rank = tuple(RankRecord(dict(own.tensors), {**own.objects, "loader": {"next": r}}) for r in range(ranks))
    return Manifest(**{**m.__dict__, "world_size": ranks, "per_rank": per_rank})


def test_head_keeps_keys_not_pieces_and_does_not_grow_with_ranks(tmp_path):
    m8, m512 = _manifest(tmp_path / "a", 8), _manifest(tmp_path / "b", 512)
    h8, h512 = head_of(m8), head_of(m512)
    assert all(not t.pieces for t in h8.tensors.values())
    assert h8.tensors["w"] == TensorRecord("w", "F32", (4, 3), False, ())
    assert len(h512.per_rank) == 512 and all(r is h512.per_rank[0] for r in h512.per_rank)
    assert h512.per_rank[5].objects == {"loader": None} and not h512.per_rank[5].tensors["rng"].pieces
    grown = len(pickle.dumps(h512)) - len(pickle.dumps(h8))
    assert grown < 8 * 504  # a few bytes a rank (a reference to the one record), not the record again


def test_a_rank_gets_its_pieces_and_its_own_record_whole(tmp_path):
    m = _manifest(tmp_path, 4)
    (pieces, mine), whole = share_of(ManifestIndex(m), 2, {"w": [((0, 0), (4, 3))]})
    assert mine == m.per_rank[2] and mine.objects == {"loader": {"next": 2}}
    got = with_share(head_of(m), (pieces, mine), 2)
    assert got.tensors["w"] == m.tensors["w"] and got.per_rank[2] == m.per_rank[2]
    assert got.per_rank[1].objects == {"loader": None}  # the others' keys only
    assert [t for t, _ in whole] == [(p.file, p.start, p.end) for p in m.tensors["w"].pieces]
