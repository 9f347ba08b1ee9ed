"""``nostall bench scale``: what nostall's own work costs as the work grows.

Four curves, each over several sizes (docs/benchmarks.md, "Cost as the work grows"):

* ``planning`` -- a save's planning as :mod:`nostall.planning.rounds` runs it at a
  first save, on synthetic metadata of R ranks x T tensors built without any
  process group (a mix of FSDP-like tensors sharded over every rank, tensors
  sharded over tensor-parallel groups of 8 and replicated across the groups,
  replicated tensors and per-rank values): a non-zero rank's work (its
  signature, its metadata encoded, its own file laid out from its share, the
  share decoded) and rank 0's (every rank's metadata decoded,
  :func:`~nostall.planning.plan.build_plan`, ``check_objects``, the replica
  check's ``shared_keys``, every rank's share, the verdict, the manifest
  skeleton, its JSON encode and parse); and the bytes rank 0 and a non-zero
  rank send and receive in the plan exchange and the commit
  (:mod:`nostall.tools.bench.exchange`). The metadata is made one rank at a
  time, so 16,384 simulated ranks fit in memory; above ``--measure-up-to``
  ranks rank 0's planning, the manifest and the commit are computed from the
  measured growth, and say so (a non-zero rank's work and every byte count
  are measured at every point);
* ``moe`` -- many small tensors per rank (spawned gloo ranks): the stall of an
  asynchronous ``CheckpointManager.save`` in the steady state, the plan's share
  of it, the copy floor (the same tensors copied into a touched buffer), and
  where a save's metadata work goes (flatten, local metadata, signature, the
  all-gather, the plan);
* ``manifest`` figures ride along both: bytes and ``Manifest.from_json_bytes``
  time;
* ``load`` -- a checkpoint whose tensors are saved in P pieces each (a layout
  P ranks would save, planned by the planner and written in the format), then
  loaded as full tensors, as another sharding (halves across every piece) and
  in the saved layout (one simulated rank's pieces), against a raw read of the
  same bytes.

The projection (:mod:`nostall.tools.bench.projection`) puts one rank's costs side by side per rank count.
"""

from __future__ import annotations

import argparse
from collections import Counter
import datetime
import gc
import json
import math
import os
import pickle
import platform
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from nostall.core.format import json_memory_estimate
from nostall.core.format import gc_paused
from nostall.tools.bench import exchange
from nostall.tools.bench.common import gather_ranks, median, serve_rank
from nostall.tools.bench.projection import format_projection, projection

PARTS = ("planning", "moe", "load")
TP_GROUP = 8
"""Tensor-parallel group size of the synthetic metadata's TP-sharded tensors."""
CRC_SAMPLE = 2864434397
"""A ten-digit checksum value that the synthetic manifests carry (real ones are as long, or one digit less)."""


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"[bench scale] {text}", file=sys.stderr, flush=True)


def _timed(fn: Callable[..., Any], *args: Any) -> Tuple[float, Any]:
    """(seconds, result) of ``fn(*args)``."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


# --------------------------------------------------------------------------- planning from synthetic metadata


def synthetic_meta(rank: int, ranks: int, tensors: int) -> Any:
    """The ``RankMeta`` of ``rank`` of ``ranks`` ranks holding ``tensors`` tensors each, as a training job's would be.

    Half the tensors are sharded over every rank along dim 0 (FSDP-like: 64 rows of 1,024 bf16 per
    rank), 3/10 are sharded along dim 1 over tensor-parallel groups of 8 and replicated across the
    groups (the first group's copy is the main one), the rest are replicated fp32 vectors held by every
    rank; every rank also holds two per-rank tensors (an RNG state and a loader position).
    """
    from nostall.planning.plan import RankMeta, TensorMeta

    n_fsdp = tensors // 2
    n_tp = tensors * 3 // 10
    n_rep = tensors - n_fsdp - n_tp
    g = min(TP_GROUP, ranks)
    ts = []
    for i in range(n_fsdp):
        ts.append(TensorMeta(f"model/layers/{i}/fsdp.weight", "BF16", (64 * ranks, 1024), (64 * rank, 0), (64, 1024),
                             True, True))
    for i in range(n_tp):
        ts.append(TensorMeta(f"model/layers/{i}/tp.weight", "BF16", (4096, 512 * g), (0, 512 * (rank % g)),
                             (4096, 512), True, rank // g == 0))
    for i in range(n_rep):
        ts.append(TensorMeta(f"model/layers/{i}/norm.weight", "F32", (4096,), (0,), (4096,), False, True))
    return RankMeta(tuple(ts), (("rng/torch", "U8", (5056,)), ("loader/buffer", "I64", (4,))))


def synthetic_metas(ranks: int, tensors: int) -> List[Any]:
    """:func:`synthetic_meta` of every rank."""
    return [synthetic_meta(r, ranks, tensors) for r in range(ranks)]


def rank_pieces_and_bytes(meta: Any) -> Tuple[int, int]:
    """Pieces and bytes a rank holding ``meta`` loads in its saved layout: its tensors and per-rank tensors."""
    from nostall.core.format import itemsize

    pieces = len(meta.tensors) + len(meta.per_rank)
    nbytes = sum(math.prod(t.shape) * itemsize(t.dtype) for t in meta.tensors)
    return pieces, nbytes + sum(math.prod(shape) * itemsize(dt) for _, dt, shape in meta.per_rank)


def distinct_pieces(metas: Sequence[Any]) -> int:
    """Pieces a plan of ``metas`` holds: one per distinct (key, box), plus every per-rank tensor."""
    return (len({(t.key, t.offset, t.shape) for m in metas for t in m.tensors})
            + sum(len(m.per_rank) for m in metas))


def _synthetic_manifest(plan: Any, block_size: int) -> Tuple[Dict[str, float], Any]:
    """Times of the skeleton, checksums filled in, JSON encode; and the manifest."""
    from nostall.planning.plan import layout_of
    from nostall.saving.saver import manifest_skeleton

    per_rank_objects = [exchange.per_rank_objects(r) for r in range(plan.world_size)]
    t_skel, skel = _timed(manifest_skeleton, layout_of(plan), exchange.objects(), per_rank_objects, 1, block_size)
    pieces, files = _written(plan, lambda f, s, e: [CRC_SAMPLE] * max(0, -(-(e - s) // block_size)))
    t_crc, m = _timed(skel.with_pieces, pieces, files)
    t_enc, raw = _timed(m.to_json_bytes)
    return {"skeleton_s": t_skel, "with_crcs_s": t_crc, "encode_s": t_enc}, raw


def _gathered(meta: Any) -> bytes:
    """What a rank sends rank 0 in the metadata gather: its ``encode_meta`` bytes, pickled by ``Comm.gather``."""
    from nostall.planning.plan import encode_meta

    return pickle.dumps(encode_meta(meta), protocol=exchange.PICKLE)


class _Sent:
    """What every rank sends before the plan, one rank at a time: its report's and metadata message's lengths,
    its signature's time, and (``keep``) the messages themselves."""

    def __init__(self, ranks: int, tensors: int, keep: bool) -> None:
        self.ranks, self.tensors, self.keep = ranks, tensors, keep
        self.reports: List[bytes] = []  # kept: rank 0 unpickles them
        self.messages: List[bytes] = []  # kept when ``keep``
        self.report_bytes: List[int] = []
        self.message_bytes: List[int] = []
        self.own_bytes: List[int] = []  # encode_meta's bytes
        self.sig_s: List[float] = []
        self.boxes: set = set()  # hash of every (key, offset, shape): distinct pieces (when not ``keep``)
        self.per_rank = 0  # per-rank tensors (when not ``keep``)
        self.data_bytes = 0  # the distinct pieces' bytes (when not ``keep``)

    def metas(self) -> Iterator[Any]:
        """Every rank's metadata, recording what it sends as each is made."""
        from nostall.core.format import itemsize
        from nostall.planning.plan import encode_meta

        for r in range(self.ranks):
            m = synthetic_meta(r, self.ranks, self.tensors)
            t, _ = _timed(m.signature)
            self.sig_s.append(t)
            blob = encode_meta(m)
            msg = pickle.dumps(blob, protocol=exchange.PICKLE)
            self.own_bytes.append(len(blob))
            self.message_bytes.append(len(msg))
            rep = pickle.dumps(exchange.report(r), protocol=exchange.PICKLE)
            self.reports.append(rep)
            self.report_bytes.append(len(rep))
            if self.keep:
                self.messages.append(msg)
            else:
                boxes = self.boxes
                for t in m.tensors:
                    h = hash((t.key, t.offset, t.shape))
                    if h not in boxes:
                        boxes.add(h)
                        self.data_bytes += math.prod(t.shape) * itemsize(t.dtype)
                self.per_rank += len(m.per_rank)
                self.data_bytes += sum(math.prod(shape) * itemsize(dt) for _, dt, shape in m.per_rank)
            yield m


def _share_pickles(metas: Iterable[Any], copies: Sequence[Sequence[str]], owned: Callable[[int, Any], bytes],
                   total: int, check_now: bool) -> Tuple[List[int], List[int]]:
    """Each rank's share pickle and digests pickle lengths: ``owned(r, meta)`` its owned flags, ``copies[r]``
    its keys to checksum (found by index in its metadata, as rank 0 does)."""
    shares, digests = [], []
    for r, m in enumerate(metas):
        index = {t.key: i for i, t in enumerate(m.tensors)} if copies[r] else {}
        idx = [index[k] for k in copies[r]]
        shares.append(exchange.pickled(exchange.share(owned(r, m), idx, total, check_now)))
        digests.append(exchange.pickled(exchange.digests_message(m, idx, CRC_SAMPLE)) if idx else 0)
    return shares, digests


def _rank0(sent: _Sent, reps: int) -> Tuple[Dict[str, Any], Any, List[Any], List[List[str]], List[bytes]]:
    """Rank 0's planning at a first save as the central planner ran it before planning by key (the reference;
    the garbage collector paused): unpickle the reports and messages and decode every rank's metadata, ``build_plan``,
    ``check_objects``, ``shared_keys`` + ``copies_of``, every rank's share (``owned_pieces``, copy indices,
    pickled for the scatter) and its own file checked against the plan, then the replica check's verdict
    (``disagreements``) on every rank's digests. Returns the times, the plan, the metadata, the copies and
    the shares' pickles."""
    from nostall.planning import replicas
    from nostall.planning.plan import build_plan, check_objects, decode_meta, own_files, owned_pieces

    times: Dict[str, Any] = {}
    with gc_paused():
        t0 = time.perf_counter()
        reports = [pickle.loads(b) for b in sent.reports]
        metas = [decode_meta(pickle.loads(b)) for b in sent.messages]
        times["gather_decode_s"] = time.perf_counter() - t0
    sent.messages.clear()
    plan_s = []
    plan = None
    for _ in range(max(1, reps)):
        plan = None
        gc.collect()
        t, plan = _timed(build_plan, metas)
        plan_s.append(t)
    assert plan is not None
    times["plan_s"] = plan_s
    gc.collect()
    with gc_paused():
        times["check_objects_s"], _ = _timed(check_objects, [r.objects for r in reports], plan.tensors)
        t0 = time.perf_counter()
        shared = replicas.shared_keys(metas)
        copies = replicas.copies_of(shared, len(metas))
        times["shared_keys_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        total = sum(f.size for f in plan.files.values())
        index = [{k: i for i, k in enumerate(t.key for t in m.tensors)} if copies[r] else {}
                 for r, m in enumerate(metas)]
        shares = [exchange.share(owned_pieces(plan, m, r), tuple(index[r][k] for k in copies[r]), total,
                                 bool(shared)) for r, m in enumerate(metas)]
        if own_files(metas[0], 0, len(metas), shares[0][0][1]) != tuple(plan.files_of(0)):
            raise RuntimeError("rank 0's own file differs from the plan's")
        share_pickles = [pickle.dumps(s, protocol=exchange.PICKLE) for s in shares]
        times["shares_s"] = time.perf_counter() - t0
        del shares, index
        gathered = [{k: CRC_SAMPLE for k in c} for c in copies]
        times["verdict_s"], problem = _timed(replicas.disagreements, shared, gathered)
        if problem is not None:
            raise RuntimeError(f"the synthetic copies disagree: {problem}")
    return times, plan, metas, copies, share_pickles


def _other_rank(rank: int, ranks: int, tensors: int, share_pickle: bytes, owned: Optional[bytes],
                reps: int) -> Dict[str, Any]:
    """A non-zero rank's planning work on its training thread at a first save (medians of ``reps``, at least
    5): its signature, its metadata encoded and pickled for the gather, its own file laid out from its share
    (``own_files``: with every piece it holds, an upper bound, and, given ``owned``, with the plan's), its
    share's pickle decoded. Its metadata is made afresh each time (the signature is kept per instance)."""
    from nostall.planning.plan import own_files

    runs: Dict[str, List[float]] = {"signature_s": [], "encode_s": [], "own_files_s": [], "share_decode_s": []}
    if owned is not None:
        runs["own_files_owned_s"] = []
    for _ in range(max(5, reps)):
        m = synthetic_meta(rank, ranks, tensors)
        runs["signature_s"].append(_timed(m.signature)[0])
        runs["encode_s"].append(_timed(_gathered, m)[0])
        runs["own_files_s"].append(_timed(own_files, m, rank, ranks, b"\x01" * len(m.tensors))[0])
        if owned is not None:
            runs["own_files_owned_s"].append(_timed(own_files, m, rank, ranks, owned)[0])
        runs["share_decode_s"].append(_timed(pickle.loads, share_pickle)[0])
    out: Dict[str, Any] = {"rank": rank, **{k: median(v) for k, v in runs.items()}}
    out["thread_s"] = out["signature_s"] + out["encode_s"] + out["own_files_s"] + out["share_decode_s"]
    if owned is not None:
        out["owned_pieces"] = sum(owned)
    return out


def _commit_bytes(plan: Any, block_size: int) -> Dict[str, Any]:
    """The commit's bytes: every rank's done record built from ``plan``, encoded both ways."""
    jsons, pickles = [], []
    for r in range(plan.world_size):
        d = exchange.done_record(plan, r, block_size, CRC_SAMPLE)
        jsons.append(exchange.done_json(d))
        pickles.append(exchange.pickled(d))
    return exchange.commit_exchange(jsons, pickles)


def _manifest(plan: Any, reps: int, tensors: int) -> Dict[str, Any]:
    """The commit's bytes and the manifest of ``plan``; and what a shared load of it costs
    (:mod:`nostall.tools.bench.shares`: every rank asks for the boxes it saved)."""
    from nostall.core.format import DEFAULT_BLOCK_SIZE
    from nostall.tools.bench.shares import shared_load_costs

    pieces = sum(len(t.pieces) for t in plan.tensors.values()) + sum(len(d) for d in plan.per_rank)
    files = len(plan.files)
    commit = _commit_bytes(plan, DEFAULT_BLOCK_SIZE)
    times, raw = _synthetic_manifest(plan, DEFAULT_BLOCK_SIZE)
    parse_s = _parse_times(raw, reps)
    shared = shared_load_costs(raw, synthetic_metas(plan.world_size, tensors), median(parse_s))
    return {"plan_pieces": pieces, "files": files, **times, "manifest_bytes": len(raw),
            "parse_s": parse_s, "parse_memory_estimate": json_memory_estimate(raw), "commit": commit,
            "shared_load": shared}


def _parse_times(raw: bytes, reps: int) -> List[float]:
    """Times of ``Manifest.from_json_bytes(raw)``, with the parse's memory cap lifted for them: a manifest of
    millions of pieces is refused by default (see ``parse_memory_estimate`` and
    :data:`nostall.core.format.MAX_MANIFEST_MEMORY`), and how long it takes once accepted is the figure wanted."""
    from nostall.core import format as fmt

    cap = fmt.MAX_MANIFEST_MEMORY
    fmt.MAX_MANIFEST_MEMORY = max(cap, 2 * json_memory_estimate(raw))
    try:
        parse_s = []
        for _ in range(max(1, min(reps, 3))):
            gc.collect()
            parse_s.append(_timed(fmt.Manifest.from_json_bytes, raw, "synthetic")[0])
        return parse_s
    finally:
        fmt.MAX_MANIFEST_MEMORY = cap


def _planning_point(ranks: int, tensors: int, reps: int, measure: bool) -> Dict[str, Any]:
    """One (ranks, tensors) point: every message's bytes and a non-zero rank's work always; when ``measure``,
    rank 0's planning (:func:`_rank0`), the commit's bytes and the manifest (else computed later from the
    measured points, see :func:`compute_unmeasured`)."""
    from nostall.planning import replicas

    sent = _Sent(ranks, tensors, keep=measure)
    other = ranks - 1
    point: Dict[str, Any] = {"ranks": ranks, "tensors": tensors, "files": ranks, "computed": {}}
    if measure:
        for _ in sent.metas():
            pass
        gc.collect()
        times, plan, metas, copies, share_pickles = _rank0(sent, reps)
        point.update(times)
        point["pieces"] = distinct_pieces(metas)
        digests = _share_pickles(metas, copies, lambda r, m: b"", 0, False)[1]
        shares = [len(s) for s in share_pickles]
        from nostall.planning.plan import owned_pieces

        owned: Optional[bytes] = owned_pieces(plan, metas[other], other)
        own_meta = metas[min(1, other)]
        del metas, copies
        gc.collect()
        point.update(_manifest(plan, reps, tensors))
        del plan
        if point.pop("plan_pieces") != point["pieces"]:
            raise RuntimeError(f"{ranks} ranks x {tensors} tensors: the plan's pieces differ from the distinct boxes")
        share_pickle = share_pickles[other]
        del share_pickles
    else:
        shared = replicas.scan_shared_keys(sent.metas())
        point["pieces"] = len(sent.boxes) + sent.per_rank
        sent.boxes = set()
        copies = replicas.copies_of(shared, ranks)
        own_meta = synthetic_meta(min(1, other), ranks, tensors)
        total = sent.data_bytes  # the plan's total less its files' headers: as long an int once pickled
        regen = (synthetic_meta(r, ranks, tensors) for r in range(ranks))
        shares, digests = _share_pickles(regen, copies, lambda r, m: b"\x01" * len(m.tensors), total,
                                         bool(shared))
        m = synthetic_meta(other, ranks, tensors)
        idx = {t.key: i for i, t in enumerate(m.tensors)}
        share_pickle = pickle.dumps(exchange.share(b"\x01" * len(m.tensors), [idx[k] for k in copies[other]],
                                                   total, bool(shared)), protocol=exchange.PICKLE)
        owned = None
        del shared, copies
    gc.collect()
    own_pieces, own_bytes = rank_pieces_and_bytes(own_meta)
    point.update({
        "signature_s": median(sent.sig_s), "metadata_bytes": median(sent.own_bytes),
        "rank_pieces": own_pieces, "rank_bytes": own_bytes,
        "other": _other_rank(other, ranks, tensors, share_pickle, owned, reps),
        "exchange": exchange.plan_exchange(sent.report_bytes, sent.message_bytes, shares, digests, sent.own_bytes),
        "by_key": _by_key(ranks, tensors, reps),
    })
    return point


def _by_key(ranks: int, tensors: int, reps: int) -> Dict[str, Any]:
    """The metadata phase as :mod:`nostall.planning.rounds` runs it now, planners by key
    (:mod:`nostall.planning.planners`), on the same synthetic metadata, one rank at a time: the bytes each rank
    sends and receives in its two all-to-alls (its parts to the planners, their answers back), the gather to
    rank 0 and its answer; the work of rank 0 and of a non-zero rank on their training threads (medians of
    ``reps``, at least 3): route and pickle its parts, plan its keys as a planner from what every rank sent
    it, pickle its answers, merge the answers it got, lay out its own file; rank 0 besides settles the plan
    from every rank's facts (``Rounds._settle_plan``: the planners' headers, ``check_objects``, the layout)
    and builds the manifest skeleton from the layout."""
    from nostall.planning import planners
    from nostall.planning.comm import Comm
    from nostall.planning.plan import own_files
    from nostall.planning.rounds import Rounds
    from nostall.saving.saver import manifest_skeleton

    world = ranks
    keys = Counter(planners.planner_of(t.key, world) for t in synthetic_meta(0, ranks, tensors).tensors)
    busiest = max(range(world), key=lambda q: (keys[q], -q))
    # rank 0, a non-zero rank and the planner of the most keys, each as a planner and as a rank
    watch = sorted({0, min(1, world - 1), busiest})
    got: Dict[int, List[Optional[bytes]]] = {p: [None] * world for p in watch}
    received = [0] * world  # bytes each planner receives in the first all-to-all
    sent_parts = [0] * world
    routed: Dict[int, Tuple[List[Optional[bytes]], List[List[int]]]] = {}
    route_s: Dict[int, List[float]] = {p: [] for p in watch}
    for r in range(world):
        m = synthetic_meta(r, ranks, tensors)
        runs = max(3, reps) if r in watch else 1
        for _ in range(runs):
            t, (parts, index) = _timed(planners.route, m, world, False)
            t2, pickles = _timed(lambda ps: [len(pickle.dumps(x, protocol=exchange.PICKLE)) for x in ps], parts)
            if r in watch:
                route_s[r].append(t + t2)
        sent_parts[r] = sum(pickles)
        for q, n in enumerate(pickles):
            received[q] += n
        for q in watch:
            got[q][r] = parts[q]
        if r in watch:
            routed[r] = (parts, index)
    out: Dict[str, Any] = {"planner_received_bytes_max": max(received),
                           "planner_received_bytes_median": median(received), "busiest": busiest,
                           "keys_of_busiest": keys[busiest]}
    for r in watch:
        times: Dict[str, List[float]] = {"plan_keys_s": [], "answers_s": []}
        planned = None
        for _ in range(max(3, reps)):
            gc.collect()
            t, planned = _timed(planners.plan_keys, got[r], r)
            times["plan_keys_s"].append(t)
            times["answers_s"].append(_timed(lambda a: [pickle.dumps(x, protocol=exchange.PICKLE) for x in a],
                                             planned.answers)[0])
        assert planned is not None and planned.error is None, planned.error if planned else None
        answer_bytes = [len(pickle.dumps(a, protocol=exchange.PICKLE)) for a in planned.answers]
        # what rank r gets back: each planner's answer to the parts it sent (as long as a planner's answer to
        # parts of that length: its own planner's answers measured, the others' computed from the parts)
        parts, index = routed[r]
        m = synthetic_meta(r, ranks, tensors)
        answers = [(b"\x01" * len(idx), ()) if idx else None for idx in index]  # every piece owned: an upper bound
        back = sum(len(pickle.dumps(a, protocol=exchange.PICKLE)) for a in answers)
        merge_s, files_s = [], []
        for _ in range(max(3, reps)):
            t, (owned, _copies) = _timed(planners.merge, index, answers, len(m.tensors))
            merge_s.append(t)
            files_s.append(_timed(own_files, m, r, world, owned)[0])
        facts = (None, None, None, planned.headers, m.per_rank, [(f"rank{r}.safetensors", 1 << 30)],
                 bool(planned.shared))
        fact_bytes = len(pickle.dumps(facts, protocol=exchange.PICKLE))
        point = {"route_s": median(route_s[r]), "plan_keys_s": median(times["plan_keys_s"]),
                 "answers_s": median(times["answers_s"]), "merge_s": median(merge_s),
                 "own_files_s": median(files_s), "keys_planned": len(planned.headers),
                 "sent_bytes": sent_parts[r] + sum(answer_bytes) + fact_bytes,
                 "received_bytes": received[r] + back + 64, "facts_bytes": fact_bytes}
        point["thread_s"] = sum(point[k] for k in ("route_s", "plan_keys_s", "answers_s", "merge_s", "own_files_s"))
        out[f"rank{r}"] = point
        if r == busiest:
            out["busiest_planner"] = point
    # rank 0 settles the plan from every rank's facts: every key's header once (from its planner), each rank's
    # per-rank tensors and file
    metas0 = synthetic_meta(0, ranks, tensors)
    by_planner: List[Dict[str, Any]] = [{} for _ in range(world)]
    for t in metas0.tensors:
        by_planner[planners.planner_of(t.key, world)][t.key] = (t.dtype, t.global_shape, t.sharded, "")
    facts_all = [(None, None, None, by_planner[q], metas0.per_rank, [(f"rank{q}.safetensors", 1 << 30)], True)
                 for q in range(world)]
    blobs = [pickle.dumps(f, protocol=exchange.PICKLE) for f in facts_all]
    del facts_all
    rounds = Rounds(Comm())
    rounds._reports = [exchange.report(q) for q in range(world)]
    settle_s, skel_s = [], []
    per_rank_objects = [exchange.per_rank_objects(q) for q in range(world)]
    for _ in range(max(3, reps)):
        gc.collect()
        t0 = time.perf_counter()
        with gc_paused():
            outcome = rounds._settle_plan([pickle.loads(b) for b in blobs], None)
        settle_s.append(time.perf_counter() - t0)
        assert rounds._layout is not None, outcome
        skel_s.append(_timed(manifest_skeleton, rounds._layout, exchange.objects(), per_rank_objects, 1, 1 << 20)[0])
    out["rank0"]["settle_s"] = median(settle_s)
    out["rank0"]["skeleton_s"] = median(skel_s)
    out["rank0"]["gather_received_bytes"] = sum(len(b) for b in blobs)
    out["rank0"]["thread_s"] += out["rank0"]["settle_s"] + out["rank0"]["skeleton_s"]
    out["rank0"]["received_bytes"] += out["rank0"]["gather_received_bytes"]
    return out


def _power_law(xs: Sequence[float], ys: Sequence[float], x: float) -> Tuple[float, float]:
    """``y`` at ``x`` on the power law through the last two (x, y) points (one point: proportional); the exponent."""
    if len(xs) < 2 or xs[-1] == xs[-2] or min(ys[-2:]) <= 0:
        return ys[-1] * x / xs[-1], 1.0
    k = math.log(ys[-1] / ys[-2]) / math.log(xs[-1] / xs[-2])
    return ys[-1] * (x / xs[-1]) ** k, k


RANK0_TIMES = ("gather_decode_s", "plan_s", "check_objects_s", "shared_keys_s", "shares_s", "verdict_s")
"""Rank 0's planning steps at a first save (:func:`_rank0`), job-wide."""
COMPUTED_TIMES = RANK0_TIMES + ("skeleton_s", "with_crcs_s", "encode_s", "parse_s")
"""The planning point's times that :func:`compute_unmeasured` computes where they were not measured."""


def rank0_thread(p: Dict[str, Any]) -> float:
    """Rank 0's planning on its training thread at a first save: its own signature, encode and own file (as a
    non-zero rank's), its planning steps (:data:`RANK0_TIMES`), the manifest skeleton."""
    own = p["other"]["signature_s"] + p["other"]["encode_s"] + p["other"].get("own_files_owned_s",
                                                                              p["other"]["own_files_s"])
    return own + sum(median(p[f]) if isinstance(p[f], list) else p[f] for f in RANK0_TIMES) + p["skeleton_s"]


def compute_unmeasured(points: List[Dict[str, Any]]) -> None:
    """Fill in rank 0's planning, the manifest and the commit figures of the points not measured, from the
    measured points of the same tensor count (by pieces), each named in the point's ``computed`` with how."""
    for p in points:
        if "plan_s" in p:
            continue
        base = sorted((q for q in points if q["tensors"] == p["tensors"] and "plan_s" in q and not q["computed"]),
                      key=lambda q: q["pieces"])
        if not base:
            p["computed"]["all"] = "nothing measured at this tensor count"
            continue
        xs = [q["pieces"] for q in base[-2:]]
        src = " and ".join(f"{q['ranks']}" for q in base[-2:])
        for f in COMPUTED_TIMES:
            ys = [median(q[f]) if isinstance(q[f], list) else q[f] for q in base[-2:]]
            v, k = _power_law(xs, ys, p["pieces"])
            p[f] = [v] if isinstance(base[-1][f], list) else v
            p["computed"][f] = f"power law in pieces through the {src}-rank points (exponent {k:.2f})"
        last = base[-1]
        p["manifest_bytes"] = int(last["manifest_bytes"] / last["pieces"] * p["pieces"])
        p["computed"]["manifest_bytes"] = f"bytes per piece of the {last['ranks']}-rank point x pieces"
        p["parse_memory_estimate"] = int(last["parse_memory_estimate"] / last["manifest_bytes"] * p["manifest_bytes"])
        p["computed"]["parse_memory_estimate"] = f"per manifest byte as at {last['ranks']} ranks"
        p["commit"] = exchange.scaled_commit(last["commit"], p["ranks"], last["ranks"])
        p["computed"]["commit"] = (f"each rank's done record as at {last['ranks']} ranks; what rank 0 reads and "
                                   "receives scaled with the ranks")


def bench_planning(ranks_list: Sequence[int], tensors_list: Sequence[int], reps: int,
                   progress: bool = False, measure_up_to: Optional[int] = None) -> List[Dict[str, Any]]:
    """One point per (ranks, tensors): see the module docstring. Above ``measure_up_to`` ranks (None: no limit)
    rank 0's planning, the manifest and the commit are computed from the measured points, not measured."""
    points = []
    for tensors in tensors_list:
        for ranks in ranks_list:
            measure = measure_up_to is None or ranks <= measure_up_to
            _say(progress, f"planning: {ranks} ranks x {tensors} tensors{'' if measure else ' (rank 0 computed)'}")
            p = _planning_point(ranks, tensors, reps, measure)
            points.append(p)
            ex = p["exchange"]
            _say(progress, f"  a non-zero rank: {p['other']['thread_s'] * 1e3:.1f} ms on its training thread, sends "
                           f"{ex['other']['sent_bytes'] / 2**10:.1f} KiB, receives "
                           f"{ex['other']['received_bytes'] / 2**10:.1f} KiB; rank 0 receives "
                           f"{ex['rank0']['received_bytes'] / 2**20:.1f} MiB")
            bk = p["by_key"]
            _say(progress, f"  planners by key: rank 0 {bk['rank0']['thread_s'] * 1e3:.1f} ms on its training thread "
                           f"(receives {bk['rank0']['received_bytes'] / 2**10:.1f} KiB), a non-zero rank "
                           f"{bk['rank1']['thread_s'] * 1e3:.1f} ms (receives "
                           f"{bk['rank1']['received_bytes'] / 2**10:.1f} KiB, sends "
                           f"{bk['rank1']['sent_bytes'] / 2**10:.1f} KiB); the busiest planner "
                           f"({bk['keys_of_busiest']} keys) {bk['busiest_planner']['thread_s'] * 1e3:.1f} ms, receives "
                           f"{bk['busiest_planner']['received_bytes'] / 2**10:.1f} KiB" if "rank1" in bk else
                           f"  planners by key: rank 0 {bk['rank0']['thread_s'] * 1e3:.1f} ms")
            if measure:
                _say(progress, f"  rank 0: decode {p['gather_decode_s']:.2f} s, plan {median(p['plan_s']):.2f} s for "
                               f"{p['pieces']} pieces, shared_keys {p['shared_keys_s']:.2f} s, shares "
                               f"{p['shares_s']:.2f} s; manifest {p['manifest_bytes'] / 2**20:.1f} MiB parsed in "
                               f"{median(p['parse_s']):.2f} s")
            gc.collect()
    compute_unmeasured(points)
    return points


# --------------------------------------------------------------------------- many small tensors (spawned ranks)


def moe_sizes(n: int, kib_min: float, kib_max: float) -> List[int]:
    """Bytes of ``n`` small tensors, log-spaced from ``kib_min`` to ``kib_max`` KiB, in a fixed shuffle."""
    import random

    lo, hi = math.log(kib_min * 1024), math.log(kib_max * 1024)
    sizes = [int(math.exp(lo + (hi - lo) * (i + 0.5) / n)) // 1024 * 1024 or 1024 for i in range(n)]
    random.Random(n).shuffle(sizes)
    return sizes


def _moe_state(rank: int, world: int, n: int, kib: Tuple[float, float]) -> Tuple[Dict[str, Any], List[Any], int]:
    """``n`` expert tensors per rank (fp32, 256 columns), each this rank's rows of a global tensor."""
    import torch

    from nostall.core.model import ShardedTensor

    experts: Dict[str, Any] = {}
    tensors = []
    nbytes = 0
    g = torch.Generator().manual_seed(rank)
    for i, b in enumerate(moe_sizes(n, *kib)):
        rows = max(1, b // (256 * 4))
        t = torch.randn((rows, 256), generator=g)
        tensors.append(t)
        nbytes += t.numel() * 4
        experts[f"e{i}"] = ShardedTensor(t, (rows * world, 256), (rows * rank, 0))
    return {"experts": experts, "step": 0}, tensors, nbytes


def _copy_floor(tensors: Sequence[Any], buf: Any) -> float:
    """Seconds to copy ``tensors`` one after the other into the touched buffer ``buf``."""
    t0 = time.perf_counter()
    pos = 0
    for t in tensors:
        k = t.numel() * t.element_size()
        buf[pos: pos + k].view(t.dtype).view(t.shape).copy_(t)
        pos += k
    return time.perf_counter() - t0


def _moe_rank(rank: int, world: int, init: str, root: str, cfg: Dict[str, Any], q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    serve_rank(rank, world, init, q, lambda: _moe_run(rank, world, root, cfg, dist))


def _moe_run(rank: int, world: int, root: str, cfg: Dict[str, Any], dist: Any) -> List[Dict[str, Any]]:
    return [_moe_point(rank, world, root, cfg, dist, n) for n in cfg["tensors"]]


def _moe_point(rank: int, world: int, root: str, cfg: Dict[str, Any], dist: Any, n: int) -> Dict[str, Any]:
    """The async saves of ``n`` small expert tensors per rank, then where their metadata work goes."""
    import torch

    import nostall

    state, tensors, nbytes = _moe_state(rank, world, n, cfg["kib"])
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.zero_()  # touched: the copy floor pays no page faults
    d = os.path.join(root, f"moe-{n}")
    mgr = nostall.CheckpointManager(d, async_save=True, keep_last=2)
    res: Dict[str, Any] = {"tensors": n, "bytes_per_rank": nbytes, "stall_s": [], "plan_s": [], "stage_s": [],
                           "copy_floor_s": [], "breakdown": {}}
    for rep in range(cfg["reps"] + 1):
        _moe_save(rank, cfg, dist, mgr, state, tensors, buf, rep, res)
    mgr.finalize_pending_saves()
    res["breakdown"] = _moe_breakdown(state, world, cfg["reps"], dist)
    res.update(_manifest_parse(os.path.join(d, f"step_{mgr.latest_step()}"), cfg["reps"]))
    mgr.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(d, ignore_errors=True)
    return res


def _moe_save(rank: int, cfg: Dict[str, Any], dist: Any, mgr: Any, state: Dict[str, Any], tensors: Sequence[Any],
              buf: Any, rep: int, res: Dict[str, Any]) -> None:
    """One timed async save (``rep`` 0: the first, reported apart), its copy floor beside it."""
    n = res["tensors"]
    dist.barrier()
    floor = _copy_floor(tensors, buf)
    mgr.finalize_pending_saves()  # the previous save is finalized before the timer
    dist.barrier()
    t0 = time.perf_counter()
    h = mgr.save(rep, state)
    stall = time.perf_counter() - t0
    st = h.stats
    assert st is not None
    if cfg["progress"] and rank == 0:
        _say(True, f"moe {n} tensors {'first save' if rep == 0 else f'rep {rep}'}: stall "
                   f"{stall * 1e3:.1f} ms (plan {st.plan_s * 1e3:.1f} ms{' cached' if st.plan_cached else ''}, "
                   f"copy {st.stage_s * 1e3:.1f} ms), copy floor {floor * 1e3:.1f} ms")
    if rep == 0:
        res["first_save"] = {"stall_s": stall, "plan_s": st.plan_s, "stage_s": st.stage_s}
        return
    res["stall_s"].append(stall)
    res["plan_s"].append(st.plan_s)
    res["stage_s"].append(st.stage_s)
    res["copy_floor_s"].append(floor)
    res["plan_cached"] = st.plan_cached


def _moe_breakdown(state: Dict[str, Any], world: int, reps: int, dist: Any) -> Dict[str, List[float]]:
    """Where the metadata work of a save goes, step by step, outside a save."""
    from nostall.core.model import flatten
    from nostall.planning.plan import build_plan, local_meta

    bd: Dict[str, List[float]] = {k: [] for k in ("flatten_s", "local_meta_s", "signature_s", "gather_s",
                                                   "build_plan_s")}
    for _ in range(reps):
        dist.barrier()
        t, flat = _timed(flatten, state)
        bd["flatten_s"].append(t)
        t, meta = _timed(local_meta, flat)
        bd["local_meta_s"].append(t)
        bd["signature_s"].append(_timed(meta.signature)[0])
        gathered: List[Any] = [None] * world
        dist.barrier()
        bd["gather_s"].append(_timed(dist.all_gather_object, gathered, meta)[0])
        bd["build_plan_s"].append(_timed(build_plan, gathered)[0])
    return bd


def _manifest_parse(path: str, reps: int) -> Dict[str, Any]:
    """The size of the manifest of the checkpoint at ``path``, and the times to parse it."""
    from nostall.core.format import MANIFEST_NAME, Manifest

    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        raw = f.read()
    return {"manifest_bytes": len(raw),
            "parse_s": [_timed(Manifest.from_json_bytes, raw, "m")[0] for _ in range(max(1, reps))]}


def bench_moe(ranks: int, tensors_list: Sequence[int], kib: Tuple[float, float], reps: int, root: str,
              progress: bool = False, timeout: float = 3600.0) -> List[Dict[str, Any]]:
    """Spawn ``ranks`` gloo ranks; rank 0's points (one per tensor count), the slowest rank's stall beside."""

    cfg = {"tensors": list(tensors_list), "kib": kib, "reps": max(1, reps), "progress": progress}
    per_rank = gather_ranks(_moe_rank, ranks, root, cfg, timeout, "moe benchmark")
    points = per_rank[0]
    for i, p in enumerate(points):
        p["slowest_rank_stall_s"] = [max(per_rank[r][i]["stall_s"][k] for r in per_rank)
                                     for k in range(len(p["stall_s"]))]
    return points


# --------------------------------------------------------------------------- resharded loads as pieces grow


def _written(plan: Any, crcs: Callable[[str, int, int], Sequence[int]]) -> Tuple[List[Any], Dict[str, Any]]:
    """Every piece of ``plan`` as the done records report it once written in place (``crcs(file, start,
    end)``: its checksums), and the files: what ``Manifest.with_pieces`` assembles the manifest from."""
    from nostall.core.format import FileRecord, Placed

    pieces = [(f.rank, it.key, f.rank if it.per_rank else -1, it.offset, it.shape,
               Placed(f.name, it.start, it.end, tuple(crcs(f.name, it.start, it.end))))
              for f in plan.files.values() for it in f.items]
    return pieces, {n: FileRecord(n, f.rank, f.size) for n, f in plan.files.items()}


def write_pieces_checkpoint(path: str, tensors: Dict[str, Any], pieces: int, block_size: int) -> Dict[str, Any]:
    """Write, at ``path``, the checkpoint ``pieces`` ranks would save holding ``pieces`` row blocks of
    every tensor: planned by :func:`~nostall.planning.plan.build_plan` from their metadata, files laid out by
    the plan, checksums and manifest as the format says. Returns the plan."""
    from nostall.core.dtypes import dtype_code
    from nostall.core.tensorbuf import byte_view
    from nostall.core.format import MANIFEST_NAME, block_crcs
    from nostall.planning.plan import RankMeta, TensorMeta, build_plan, layout_of
    from nostall.saving.saver import manifest_skeleton

    metas = []
    for r in range(pieces):
        ts = []
        for k, t in tensors.items():
            rows = t.shape[0] // pieces
            ts.append(TensorMeta(k, str(dtype_code(t.dtype)), tuple(t.shape), (rows * r,) + (0,) * (t.dim() - 1),
                                 (rows,) + tuple(t.shape[1:]), True, True))
        metas.append(RankMeta(tuple(ts), ()))
    plan = build_plan(metas)
    os.makedirs(path, exist_ok=True)
    crcs = {}
    for f in plan.files.values():
        with open(os.path.join(path, f.name), "wb") as out:
            out.write(f.header)
            for it in f.items:
                t = tensors[it.key]
                rows = t.shape[0] // pieces
                part = t.narrow(0, it.offset[0], rows).contiguous()
                data = byte_view(part)
                assert out.tell() == it.start and len(data) == it.end - it.start
                out.write(data)
                crcs[(f.name, it.start, it.end)] = block_crcs(data, block_size)
    m = manifest_skeleton(layout_of(plan), {}, [{} for _ in range(pieces)], None, block_size).with_pieces(
        *_written(plan, lambda f, s, e: crcs[(f, s, e)]))
    with open(os.path.join(path, MANIFEST_NAME), "wb") as out:
        out.write(m.to_json_bytes())
    return {"plan": plan}


def _load_each(templates: Sequence[Any], path: str) -> None:
    """Load every template (the ranks of a resharded load, one after the other)."""
    import nostall

    for t in templates:
        nostall.load(t, path)


def _raw_read(paths: Sequence[str], buf: Any) -> float:
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def bench_load(pieces_list: Sequence[int], mb: int, n_tensors: int, reps: int, root: str,
               progress: bool = False) -> List[Dict[str, Any]]:
    """One point per piece count: the loads of the checkpoint :func:`write_pieces_checkpoint` writes."""
    import torch

    cols = 1024
    rows = max(max(pieces_list), (mb << 20) // (4 * cols * n_tensors))
    rows -= rows % max(pieces_list)
    g = torch.Generator().manual_seed(7)
    tensors = {f"w{i}": torch.randn((rows, cols), generator=g) for i in range(n_tensors)}
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    points = []
    for pieces in pieces_list:
        if rows % pieces:
            raise ValueError(f"{rows} rows do not split into {pieces} pieces")
        _say(progress, f"load: {n_tensors} tensors x {rows} x {cols} fp32 ({nbytes / 2**20:.0f} MiB) in {pieces} "
                       "pieces each")
        res = _load_point(tensors, pieces, reps, os.path.join(root, f"pieces-{pieces}"))
        _say(progress, f"  raw read {median(res['raw_read_s']) * 1e3:.0f} ms, "
                       f"full {median(res['full_s']) * 1e3:.0f} ms, "
                       f"resharded {median(res['resharded_s']) * 1e3:.0f} ms, one rank's pieces "
                       f"{median(res['same_layout_rank_s']) * 1e3:.1f} ms")
        points.append(res)
    return points


class _LoadTemplates:
    """The templates of the loads of one piece count: full tensors, two column halves, one rank's rows.

    Each template's memory is touched (zeroed) when made, outside the timers, as a model built (initialized)
    before it resumes is: a load into new untouched memory would time the kernel faulting its pages in (about as
    long as the read itself here), which the raw read into its reused buffer does not pay.
    """

    def __init__(self, tensors: Dict[str, Any], pieces: int) -> None:
        self.keys = list(tensors)
        self.rows, self.cols = next(iter(tensors.values())).shape
        self.h = self.rows // pieces

    def full(self) -> Dict[str, Any]:
        import torch

        return {k: torch.zeros((self.rows, self.cols)) for k in self.keys}

    def halves(self, i: int) -> Dict[str, Any]:
        import torch

        from nostall.core.model import ShardedTensor

        half = self.cols // 2
        return {k: ShardedTensor(torch.zeros((self.rows, half)), (self.rows, self.cols), (0, half * i))
                for k in self.keys}

    def own(self, r: int) -> Dict[str, Any]:
        import torch

        from nostall.core.model import ShardedTensor

        return {k: ShardedTensor(torch.zeros((self.h, self.cols)), (self.rows, self.cols), (self.h * r, 0))
                for k in self.keys}


def _load_point(tensors: Dict[str, Any], pieces: int, reps: int, path: str) -> Dict[str, Any]:
    """Write the checkpoint of ``pieces`` row blocks at ``path``, check one load, time the loads, remove it."""
    import torch

    import nostall
    from nostall.core.format import DEFAULT_BLOCK_SIZE

    write_pieces_checkpoint(path, tensors, pieces, DEFAULT_BLOCK_SIZE)
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    tm = _LoadTemplates(tensors, pieces)
    sample = sorted({0, pieces // 3, (2 * pieces) // 3, pieces - 1})
    buf = memoryview(bytearray(8 << 20))
    # correctness once, outside the timers
    out = nostall.load(tm.full(), path)
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)
    res: Dict[str, Any] = {"pieces": pieces, "tensors": len(tensors),
                           "bytes": sum(t.numel() * 4 for t in tensors.values()), "raw_read_s": [],
                           "full_s": [], "resharded_s": [], "same_layout_rank_s": [], "raw_read_rank_s": [],
                           "rank_bytes": tm.h * tm.cols * 4 * len(tensors)}
    for _ in range(max(1, reps)):
        res["raw_read_s"].append(_raw_read(files, buf))
        t_full, _ = _timed(nostall.load, tm.full(), path)
        res["full_s"].append(t_full)
        tmpl = [tm.halves(0), tm.halves(1)]
        res["resharded_s"].append(_timed(_load_each, tmpl, path)[0])
        per_rank, raw_rank = [], []
        for r in sample:
            own = tm.own(r)
            per_rank.append(_timed(nostall.load, own, path)[0])
            raw_rank.append(_raw_read([os.path.join(path, f"rank{r}.safetensors")], buf))
        res["same_layout_rank_s"].append(median(per_rank))
        res["raw_read_rank_s"].append(median(raw_rank))
    res.update(_manifest_parse(path, reps))
    shutil.rmtree(path, ignore_errors=True)
    return res


# --------------------------------------------------------------------------- the whole run, table, plots


def run_scale(parts: Sequence[str] = PARTS, ranks_list: Sequence[int] = (8, 64, 256, 1024),
              tensors_list: Sequence[int] = (100, 1000), moe_ranks: int = 2,
              moe_tensors: Sequence[int] = (100, 1000, 10000), moe_kib: Tuple[float, float] = (2, 128),
              pieces_list: Sequence[int] = (2, 8, 64, 256, 1024), load_mb: int = 64, load_tensors: int = 4,
              reps: int = 3, root: Optional[str] = None, progress: bool = False,
              measure_up_to: Optional[int] = None) -> Dict[str, Any]:
    """Run the chosen parts; returns the JSON-able result (schema in docs/benchmarks.md). Planning points above
    ``measure_up_to`` ranks have rank 0's planning, the manifest and the commit computed, not measured."""
    import torch

    own = root is None
    root = root or tempfile.mkdtemp(prefix="nostall-scale-")
    out: Dict[str, Any] = {
        "config": {"parts": list(parts), "ranks": list(ranks_list), "tensors": list(tensors_list),
                   "moe_ranks": moe_ranks, "moe_tensors": list(moe_tensors), "moe_kib": list(moe_kib),
                   "pieces": list(pieces_list), "load_mb": load_mb, "load_tensors": load_tensors, "reps": reps,
                   "measure_up_to": measure_up_to},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        if "planning" in parts:
            out["planning"] = bench_planning(ranks_list, tensors_list, reps, progress, measure_up_to)
        if "moe" in parts:
            out["moe"] = {"ranks": moe_ranks,
                          "points": bench_moe(moe_ranks, moe_tensors, moe_kib, reps, root, progress)}
        if "load" in parts:
            out["load"] = bench_load(pieces_list, load_mb, load_tensors, reps, root, progress)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    out["projection"] = projection(out)
    return out


def _planning_line(p: Dict[str, Any]) -> str:
    star = {f: "*" if f in p["computed"] else " " for f in COMPUTED_TIMES + ("manifest_bytes",)}
    ex, o = p["exchange"], p["other"]
    rank0 = (p["gather_decode_s"] + p["check_objects_s"] + p["shares_s"] + p["verdict_s"]) * 1e3
    return (f"{p['ranks']:>6}{p['tensors']:>8}{p['pieces']:>9}{o['thread_s'] * 1e3:>9.2f}"
            f"{ex['other']['sent_bytes'] / 1024:>8.1f}{ex['other']['received_bytes'] / 1024:>8.1f}"
            f"{median(p['plan_s']) * 1e3:>10.1f}{star['plan_s']}{p['shared_keys_s'] * 1e3:>9.1f}{star['shared_keys_s']}"
            f"{rank0:>10.1f}{star['gather_decode_s']}{p['skeleton_s'] * 1e3:>10.1f}{star['skeleton_s']}"
            f"{rank0_thread(p):>9.2f}{star['plan_s']}{ex['rank0']['received_bytes'] / 2**20:>9.1f}"
            f"{ex['rank0']['sent_bytes'] / 2**20:>8.1f}{p['manifest_bytes'] / 2**20:>10.2f}{star['manifest_bytes']}"
            f"{median(p['parse_s']) * 1e3:>9.1f}{star['parse_s']}")


def format_table(out: Dict[str, Any]) -> str:
    """The figures as text tables (medians)."""
    lines: List[str] = [f"nostall bench scale, {out['date']}, {out['machine']['cpus']} CPUs, "
                        f"torch {out['machine']['torch']} (medians of {out['config']['reps']} repetitions)"]
    if out.get("planning"):
        lines += ["", "planning at a first save from synthetic metadata (* computed, not measured). A non-zero rank "
                  "(the last): its training thread (signature, encode, own file with every piece it holds, share "
                  "decode) and the plan exchange's KiB it sends and receives. Rank 0: build_plan, shared_keys, "
                  "'other' (decode every rank's metadata, check_objects, shares, verdict), skeleton, its thread "
                  "in all (s), the MiB it receives and sends; the manifest",
                  f"{'ranks':>6}{'tensors':>8}{'pieces':>9}{'rank ms':>9}{'sent':>8}{'recv':>8}{'plan ms':>11}"
                  f"{'shared':>10}{'other ms':>11}{'skel ms':>11}{'rank0 s':>10}{'0 recv':>9}{'0 sent':>8}"
                  f"{'manif MiB':>11}{'parse ms':>10}"]
        lines += [_planning_line(p) for p in out["planning"] if "plan_s" in p]
    if out.get("projection"):
        lines += ["", "projection: one rank's cost as the job grows", format_projection(out["projection"])]
    moe = out.get("moe")
    if moe:
        lines += ["", f"many small tensors: {moe['ranks']} ranks, async save (steady state; rank 0)",
                  f"{'tensors':>8}{'MiB/rank':>9}{'stall ms':>10}{'plan ms':>9}{'copy ms':>9}{'floor ms':>10}"
                  f"{'stall/floor':>12}{'first ms':>10}{'flatten':>9}{'meta':>7}{'sig':>7}{'gather':>8}{'plan':>7}"
                  f"{'manifest KiB':>13}{'parse ms':>10}"]
        for p in moe["points"]:
            bd = {k: median(v) * 1e3 for k, v in p["breakdown"].items()}
            stall, floor = median(p["stall_s"]), median(p["copy_floor_s"])
            lines.append(f"{p['tensors']:>8}{p['bytes_per_rank'] / 2**20:>9.1f}{stall * 1e3:>10.1f}"
                         f"{median(p['plan_s']) * 1e3:>9.1f}{median(p['stage_s']) * 1e3:>9.1f}{floor * 1e3:>10.1f}"
                         f"{stall / floor if floor else float('nan'):>12.2f}{p['first_save']['stall_s'] * 1e3:>10.1f}"
                         f"{bd['flatten_s']:>9.1f}{bd['local_meta_s']:>7.1f}{bd['signature_s']:>7.1f}"
                         f"{bd['gather_s']:>8.1f}{bd['build_plan_s']:>7.1f}{p['manifest_bytes'] / 1024:>13.0f}"
                         f"{median(p['parse_s']) * 1e3:>10.1f}")
        lines.append("  (flatten .. plan: ms of each metadata step of a save, timed apart; a cached plan skips "
                     "gather and plan)")
    if out.get("load"):
        lines += ["", "loads as the pieces per tensor grow (one process; page cache warm; templates touched)",
                  f"{'pieces':>7}{'MiB':>6}{'raw ms':>8}{'full ms':>9}{'x raw':>7}{'reshard ms':>11}{'x raw':>7}"
                  f"{'rank ms':>9}{'rank raw':>9}{'manifest KiB':>13}{'parse ms':>10}"]
        for p in out["load"]:
            raw = median(p["raw_read_s"])
            lines.append(f"{p['pieces']:>7}{p['bytes'] / 2**20:>6.0f}{raw * 1e3:>8.1f}{median(p['full_s']) * 1e3:>9.1f}"
                         f"{median(p['full_s']) / raw:>7.2f}{median(p['resharded_s']) * 1e3:>11.1f}"
                         f"{median(p['resharded_s']) / raw:>7.2f}{median(p['same_layout_rank_s']) * 1e3:>9.2f}"
                         f"{median(p['raw_read_rank_s']) * 1e3:>9.2f}{p['manifest_bytes'] / 1024:>13.0f}"
                         f"{median(p['parse_s']) * 1e3:>10.1f}")
    return "\n".join(lines)


def plot_paths(target: str) -> Dict[str, str]:
    """Where each part's plot goes: ``<dir>/scale-<part>.png`` for a directory, else ``<prefix>-<part>.png``."""
    if os.path.isdir(target):
        return {p: os.path.join(target, f"scale-{p}.png") for p in PARTS}
    return {p: f"{target}-{p}.png" for p in PARTS}


def _style(ax: Any, xlabel: str, title: str, xbase: int = 10, ylog: bool = True) -> None:
    ax.set_xscale("log", base=xbase)
    if ylog:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds (median)")
    ax.set_title(title)
    ax.legend(fontsize=8)


def _save_figure(plt: Any, fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_planning(plt: Any, points: List[Dict[str, Any]], path: str) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for tensors in sorted({p["tensors"] for p in points}):
        pts = [p for p in points if p["tensors"] == tensors]
        x = [p["ranks"] for p in pts]
        axes[0].plot(x, [rank0_thread(p) for p in pts], "o-", label=f"rank 0's thread, {tensors} tensors")
        axes[0].plot(x, [median(p["plan_s"]) for p in pts], "^:", label=f"of which build_plan, {tensors}")
        axes[0].plot(x, [p["other"]["thread_s"] for p in pts], "s--", label=f"a non-zero rank's thread, {tensors}")
        axes[1].plot(x, [p["encode_s"] + p["skeleton_s"] + p["with_crcs_s"] for p in pts], "o-",
                     label=f"manifest build + encode, {tensors}")
        axes[1].plot(x, [median(p["parse_s"]) for p in pts], "s--", label=f"manifest parse, {tensors}")
    axes[0].axhline(0.5, color="tab:red", linestyle=":", label="goal at 1,024 ranks: 0.5 s")
    for ax, title in ((axes[0], "planning time"), (axes[1], "manifest")):
        _style(ax, "ranks", title, xbase=2)
    return _save_figure(plt, fig, path)


def _plot_moe(plt: Any, moe: Dict[str, Any], path: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = moe["points"]
    x = [p["tensors"] for p in pts]
    ax.plot(x, [median(p["stall_s"]) for p in pts], "o-", label="async save stall")
    ax.plot(x, [median(p["plan_s"]) for p in pts], "s-", label="its plan share")
    floor = [median(p["copy_floor_s"]) for p in pts]
    ax.plot(x, floor, "k--", label="copy floor")
    ax.plot(x, [2 * f for f in floor], "r:", label="goal: 2 x copy floor")
    _style(ax, "tensors per rank", f"many small tensors, {moe['ranks']} ranks")
    return _save_figure(plt, fig, path)


def _plot_load(plt: Any, pts: List[Dict[str, Any]], path: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [p["pieces"] for p in pts]
    for field, label, style in (("raw_read_s", "raw read of the files", "k--"), ("full_s", "load as full tensors",
                                                                                  "o-"),
                                ("resharded_s", "load as halves across the pieces", "s-")):
        ax.plot(x, [median(p[field]) for p in pts], style, label=label)
    _style(ax, "pieces per tensor", f"loads, {pts[0]['tensors']} tensors, {pts[0]['bytes'] / 2**20:.0f} MiB",
           xbase=2, ylog=False)
    return _save_figure(plt, fig, path)


def plot(out: Dict[str, Any], target: str) -> List[str]:
    """Draw each measured part's curves; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = plot_paths(target)
    written = []
    if out.get("planning"):
        written.append(_plot_planning(plt, out["planning"], paths["planning"]))
    if out.get("moe"):
        written.append(_plot_moe(plt, out["moe"], paths["moe"]))
    if out.get("load"):
        written.append(_plot_load(plt, out["load"], paths["load"]))
    return written


def merged_runs(paths: Sequence[str]) -> Dict[str, Any]:
    """The parts of the ``--json`` files at ``paths``, each from the last file that has it."""
    out: Dict[str, Any] = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        out.update({k: v for k, v in run.items() if k in PARTS and v})
    return out


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Optional[List[str]] = None) -> int:
    """``nostall bench scale [options]``."""
    ap = argparse.ArgumentParser(prog="nostall bench scale",
                                 description="Cost as the work grows: planning from synthetic metadata, async saves "
                                             "of many small tensors against the copy floor, manifest size and parse "
                                             "time, loads as the pieces per tensor grow. Progress on stderr, tables "
                                             "on stdout.")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of %(default)s")
    ap.add_argument("--ranks", default="8,64,256,1024", metavar="LIST",
                    help="planning: simulated ranks (default: %(default)s)")
    ap.add_argument("--tensors", default="100,1000", metavar="LIST",
                    help="planning: tensors per rank (default: %(default)s)")
    ap.add_argument("--measure-up-to", type=int, default=None, metavar="RANKS",
                    help="planning: above this many ranks rank 0's planning, the manifest and the commit are "
                         "computed from the measured points (their growth), not measured: what a plan of 16,384 "
                         "ranks x 1,000 tensors needs exceeds 24 GiB; a non-zero rank's work and the byte counts "
                         "are measured at every point (default: measure every point)")
    ap.add_argument("--moe-ranks", type=int, default=2, metavar="N", help="moe: gloo ranks (default: %(default)s)")
    ap.add_argument("--moe-tensors", default="100,1000,10000", metavar="LIST",
                    help="moe: small tensors per rank (default: %(default)s)")
    ap.add_argument("--moe-kib", default="2,128", metavar="MIN,MAX",
                    help="moe: tensor sizes, log-spaced between these KiB (default: %(default)s)")
    ap.add_argument("--pieces", default="2,8,64,256,1024", metavar="LIST",
                    help="load: pieces per tensor (default: %(default)s)")
    ap.add_argument("--load-mb", type=int, default=64, metavar="MIB", help="load: MiB in all (default: %(default)s)")
    ap.add_argument("--load-tensors", type=int, default=4, metavar="N", help="load: tensors (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, metavar="N", help="timed repetitions (default: %(default)s)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    ap.add_argument("--plot", default=None, metavar="PREFIX|DIR",
                    help="draw the curves: PREFIX-<part>.png, or DIR/scale-<part>.png for a directory")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--project", default=None, metavar="JSON,JSON",
                    help="run nothing: print the projection of earlier runs' --json files (each part from the "
                         "last file that has it; e.g. a planning run and a load run)")
    args = ap.parse_args(argv)
    if args.project:
        print(format_projection(projection(merged_runs(args.project.split(",")))))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from {PARTS}")
    kib = [float(x) for x in args.moe_kib.split(",")]
    if len(kib) != 2 or not 0 < kib[0] <= kib[1]:
        ap.error("--moe-kib takes MIN,MAX with 0 < MIN <= MAX")
    out = run_scale(parts, _ints(args.ranks), _ints(args.tensors), args.moe_ranks, _ints(args.moe_tensors),
                    (kib[0], kib[1]), _ints(args.pieces), args.load_mb, args.load_tensors, args.reps, args.dir,
                    progress=not args.quiet, measure_up_to=args.measure_up_to)
    print(format_table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        for p in plot(out, args.plot):
            print(f"plot: {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
