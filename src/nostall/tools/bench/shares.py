"""What a shared load's metadata costs (``nostall bench scale``, planning points): rank 0 and one other rank.

A manager's load over a group (:mod:`nostall.loading.collective`): rank 0
parses the manifest, builds the head and cuts every rank's share (with the
read-once assignment, :mod:`nostall.loading.peers`); each other rank
receives the head and its share. Measured here in one process, without a
process group, from the synthetic metadata's manifest: each rank asks for
the boxes it saved (a resume in the same layout).
"""

from __future__ import annotations

import gc
import pickle
import time
from typing import Any, Dict, List, Sequence

from nostall.core.format import gc_paused

PICKLE = pickle.HIGHEST_PROTOCOL


def shared_load_costs(raw: bytes, metas: Sequence[Any], parse_s: float) -> Dict[str, Any]:
    """The figures of one point: ``raw`` is the manifest's JSON, ``metas`` every rank's ``RankMeta`` (what each
    rank's template asks for), ``parse_s`` rank 0's parse time (measured by the caller)."""
    from nostall.core import format as fmt
    from nostall.loading import collective

    cap = fmt.MAX_MANIFEST_MEMORY
    fmt.MAX_MANIFEST_MEMORY = max(cap, 2 * fmt.json_memory_estimate(raw))
    try:
        m = fmt.Manifest.from_json_bytes(raw, "synthetic")
    finally:
        fmt.MAX_MANIFEST_MEMORY = cap
    with gc_paused():  # as rank 0 runs it
        t0 = time.perf_counter()
        head = pickle.dumps(collective.head_of(m), protocol=PICKLE)
        t_head = time.perf_counter() - t0
        index = collective.ManifestIndex(m)
        asks: List[Any] = [{t.key: [(t.offset, t.shape)] for t in meta.tensors} for meta in metas]
        t0 = time.perf_counter()
        shares = [collective.share_of(index, r, boxes) for r, boxes in enumerate(asks)]
        t1 = time.perf_counter()
        plans = collective.plan_transfers([w for _, w in shares], True, None)
        t2 = time.perf_counter()
        blobs = [pickle.dumps((collective.pack(share), plan), protocol=PICKLE)
                 for (share, _), plan in zip(shares, plans)]
        t_cut, t_assign, t_pickle = t1 - t0, t2 - t1, time.perf_counter() - t2
    other = min(1, len(metas) - 1)
    gc.freeze()  # a rank's own process holds none of this one's millions of objects: leave them to no collection
    try:
        t0 = time.perf_counter()
        (packed, _plan) = pickle.loads(blobs[other])
        collective.with_share(pickle.loads(head), collective.unpack(packed), other)
        t_rank = time.perf_counter() - t0
    finally:
        gc.unfreeze()
    shared = sum(len(p.send) for p in plans)
    return {
        "rank0_parse_s": parse_s, "rank0_head_s": t_head, "rank0_cut_s": t_cut, "rank0_assign_s": t_assign,
        "rank0_pickle_s": t_pickle,
        "head_bytes": len(head), "share_bytes": len(blobs[other]), "other_decode_s": t_rank,
        "other_received_bytes": len(head) + len(blobs[other]), "pieces_read_once": shared,
        "storage_reads_before": len(metas), "storage_reads_after": 1,
    }
