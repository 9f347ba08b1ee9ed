"""The bytes a save's metadata exchanges move, counted from the real encodings, for rank 0 and the others.

No process group: each message is the real object a save sends (built from
synthetic metadata or a plan), encoded as the library encodes it
(``pickle.dumps`` for a collective, the JSON of a done record), and the
collectives are simulated from those lengths as :mod:`nostall.planning.comm`
runs them:

* ``gather`` (every rank to rank 0): each rank sends a
  :data:`~nostall.planning.comm.SLOT` (its pickle's length, and the pickle when
  it fits), then, when its pickle does not fit, the whole pickle point to
  point; a rank other than 0 receives nothing; rank 0 receives every other
  rank's slot and long pickles;
* ``broadcast`` (rank 0's object to every rank): a slot, then, when the pickle
  does not fit, a second message of the pickle's length; each rank receives
  it, rank 0 sends it to every other rank (counted as direct sends: gloo may
  forward it along a tree, moving some of rank 0's sending to the others);
* ``scatter`` (rank 0's object ``r`` to rank ``r``): a slot each, and the whole
  pickle point to point to each rank whose pickle does not fit.

A first save (no cached plan) exchanges, on every rank's training thread
(:mod:`nostall.planning.rounds`):

* ``reports`` (gather): every rank's :class:`~nostall.planning.rounds.Report`;
  ``answer`` (broadcast): ``(error, save id, replan, check now)``;
* ``metadata`` (gather): every rank's :func:`~nostall.planning.plan.encode_meta`;
  ``shares`` (scatter): each rank's ``((plan id, owned, copy indices, total), check now)``;
* ``digests`` (gather): each rank's ``{key: crc32c}`` of the copies its share
  names (when several ranks hold a copy of some key); ``verdict`` (broadcast).

Then the commit: an asynchronous save writes each rank's done record to
the storage root and rank 0 reads them all (the others read rank 0's
outcome); a synchronous one gathers the done records to rank 0 and
broadcasts the outcome.
"""

from __future__ import annotations

import json
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nostall.core.format import Placed, FileRecord
from nostall.core.jobs import Done, Outcome
from nostall.planning.comm import SLOT
from nostall.planning.rounds import Report

PICKLE = pickle.HIGHEST_PROTOCOL
SAVE_ID = "0123456789abcdef0123456789abcdef"
"""A save id as long as a real one (``uuid4().hex``), sent by rank 0."""
PLAN_ID = "fedcba9876543210fedcba9876543210"
"""A plan id as long as a real one (``uuid4().hex``)."""
DIGEST = "0" * 32
"""A content digest as long as a real one (xxh3-128, hex)."""
FITS = SLOT - 8
"""The longest pickle a slot carries (after its 8-byte length)."""


def objects() -> Dict[str, Any]:
    """The synthetic job's saved values (the same on every rank)."""
    return {"step": 1, "config": {"lr": 3e-4}}


def per_rank_objects(rank: int) -> Dict[str, Any]:
    """The synthetic job's per-rank values of ``rank``."""
    return {"loader/position": 1000 * rank, "loader/epoch": 0}


def report(rank: int) -> Report:
    """What ``rank`` gathers to rank 0 first in a first save (it holds no plan yet)."""
    return Report(None, None, "", objects(), per_rank_objects(rank), 1)


def answer() -> Tuple[Any, ...]:
    """Rank 0's answer to the reports of a first save: no error, the save id, plan afresh, no check yet."""
    return None, SAVE_ID, True, False


def share(owned: bytes, copies: Sequence[int], total: int, check_now: bool) -> Tuple[Any, ...]:
    """What rank 0 scatters to a rank at a first save: ``((plan id, owned, copy indices, total bytes), check
    now)`` (the central planner's scatter, before planning by key)."""
    return (PLAN_ID, owned, tuple(copies), total), check_now


def digests_message(meta: Any, copies: Sequence[int], crc: int) -> Dict[str, int]:
    """The replica check's message of the rank of ``meta``: a checksum of each key its share names (by index)."""
    return {meta.tensors[i].key: crc for i in copies}


def done_record(plan: Any, rank: int, block_size: int, crc: int) -> Done:
    """The done record ``rank`` reports once it wrote its files of ``plan`` (checksum values ``crc``)."""
    d = Done(True, rank=rank)
    for f in plan.files_of(rank):
        d.files[f.name] = FileRecord(f.name, rank, f.size)
        for it in f.items:
            blocks = max(0, -(-(it.end - it.start) // block_size))
            d.placed[(f.name, it.start, it.end)] = Placed(f.name, it.start, it.end, (crc,) * blocks, DIGEST)
            d.what.setdefault((f.name, it.start, it.end), []).append(
                (it.key, rank if it.per_rank else -1, it.offset, it.shape))
    return d


def pickled(obj: Any) -> int:
    """Bytes of ``obj`` as a collective sends it."""
    return len(pickle.dumps(obj, protocol=PICKLE))


def done_json(done: Done) -> int:
    """Bytes of a done record as a background save writes it to the storage root."""
    return len(json.dumps(done.to_doc(), sort_keys=True).encode())


def _tail(n: int) -> int:
    """Bytes sent point to point after the slot for a pickle ``n`` long (0 when it fits)."""
    return n if n > FITS else 0


def gather(lengths: Sequence[int]) -> Dict[str, Any]:
    """One ``Comm.gather`` of pickles ``lengths`` long (one per rank, rank 0 first).

    ``sent[r]`` / ``received[r]`` per rank: a rank other than 0 sends its slot and, when its pickle does not
    fit, the pickle; it receives nothing. Rank 0 receives every other rank's slot and long pickles."""
    world = len(lengths)
    sent = [0] + [SLOT + _tail(n) for n in lengths[1:]]
    received = [sum(sent)] + [0] * (world - 1)
    messages = [0] + [1 + (1 if _tail(n) else 0) for n in lengths[1:]]
    return {"kind": "gather", "sent": sent, "received": received, "messages": messages,
            "longest_pickle": max(lengths), "point_to_point": sum(1 for n in lengths[1:] if _tail(n))}


def broadcast(length: int, world: int) -> Dict[str, Any]:
    """One ``Comm.broadcast`` from rank 0 of a pickle ``length`` long: each other rank receives the slot (and a
    second message of ``length`` bytes when it does not fit); rank 0 sends that to each of them."""
    message = SLOT + _tail(length)
    n = 1 + (1 if _tail(length) else 0)
    return {"kind": "broadcast", "sent": [(world - 1) * message] + [0] * (world - 1),
            "received": [0] + [message] * (world - 1), "messages": [n * (world - 1)] + [n] * (world - 1),
            "longest_pickle": length, "point_to_point": 0}


def scatter(lengths: Sequence[int]) -> Dict[str, Any]:
    """One ``Comm.scatter`` from rank 0 of pickles ``lengths`` long (one per rank): each other rank receives its
    slot and, when its pickle does not fit, the pickle point to point; rank 0 sends all of that."""
    world = len(lengths)
    received = [0] + [SLOT + _tail(n) for n in lengths[1:]]
    messages = [0] + [1 + (1 if _tail(n) else 0) for n in lengths[1:]]
    return {"kind": "scatter", "sent": [sum(received)] + [0] * (world - 1), "received": received,
            "messages": [sum(messages)] + messages, "longest_pickle": max(lengths),
            "point_to_point": sum(1 for n in lengths[1:] if _tail(n))}


def _figures(step: Dict[str, Any], ranks: Sequence[int]) -> Dict[str, Dict[str, int]]:
    return {"rank0": {"sent_bytes": step["sent"][0], "received_bytes": step["received"][0],
                      "messages": step["messages"][0]},
            "other": {"sent_bytes": max((step["sent"][r] for r in ranks), default=0),
                      "received_bytes": max((step["received"][r] for r in ranks), default=0),
                      "messages": max((step["messages"][r] for r in ranks), default=0)}}


def summarize(steps: Dict[str, Dict[str, Any]], own: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Per step and in all, rank 0's figures and the largest of the other ranks' (``other``: the figures of
    the non-zero rank that sends the most, and of the one that receives the most; ``own[r]``: rank ``r``'s own
    metadata bytes, named beside the rank that receives the most)."""
    world = len(next(iter(steps.values()))["sent"])
    others = range(1, world)
    sent = [sum(s["sent"][r] for s in steps.values()) for r in range(world)]
    received = [sum(s["received"][r] for s in steps.values()) for r in range(world)]
    messages = [sum(s["messages"][r] for s in steps.values()) for r in range(world)]
    out: Dict[str, Any] = {
        "steps": {k: {"kind": s["kind"], "longest_pickle": s["longest_pickle"], "point_to_point": s["point_to_point"],
                      **_figures(s, others)} for k, s in steps.items()},
        "rank0": {"sent_bytes": sent[0], "received_bytes": received[0], "messages": messages[0]},
    }
    if world > 1:
        top_sent = max(others, key=lambda r: (sent[r], r))
        top_recv = max(others, key=lambda r: (received[r], r))
        out["other"] = {"sent_bytes": sent[top_sent], "received_bytes": received[top_recv],
                        "messages": max(messages[r] for r in others), "rank_sending_most": top_sent,
                        "rank_receiving_most": top_recv}
        if own is not None:
            out["other"]["own_metadata_bytes"] = own[top_recv]
            out["other"]["own_metadata_bytes_min"] = min(own[r] for r in others)
    else:
        out["other"] = {"sent_bytes": 0, "received_bytes": 0, "messages": 0}
    return out


def plan_exchange(reports: Sequence[int], metadata: Sequence[int], shares: Sequence[int], digests: Sequence[int],
                  own_metadata: Sequence[int]) -> Dict[str, Any]:
    """A first save's metadata collectives from each rank's pickle lengths (``metadata``: the gathered pickles
    of ``encode_meta``'s bytes; ``own_metadata``: those bytes' lengths; ``digests`` empty when no rank holds a
    copy), rank 0's figures and the largest of the others'."""
    world = len(reports)
    steps = {"reports": gather(reports), "answer": broadcast(pickled(answer()), world),
             "metadata": gather(metadata), "shares": scatter(shares)}
    if any(digests):
        steps["digests"] = gather(digests)
        steps["verdict"] = broadcast(pickled(None), world)
    out = summarize(steps, own_metadata)
    out["own_pickles"] = {"rank0": {"report": reports[0], "metadata": metadata[0], "share": shares[0],
                                    "digests": digests[0] if digests else 0},
                          "largest": {"report": max(reports), "metadata": max(metadata), "share": max(shares),
                                      "digests": max(digests, default=0)}}
    out["note"] = ("gathers to rank 0 and its answers (broadcast, scatter): a non-zero rank sends its own "
                   "messages and receives its own answers; rank 0 receives every rank's and sends every answer")
    return out


def commit_exchange(done_json_bytes: Sequence[int], done_pickle_bytes: Sequence[int]) -> Dict[str, Any]:
    """The commit's bytes: a background save's done records (each rank writes its own, rank 0 reads every rank's),
    a synchronous save's gather of them to rank 0 and the outcome broadcast."""
    world = len(done_json_bytes)
    outcome_json = len(json.dumps({"ok": True, "error": ""}).encode())
    sync = summarize({"gather": gather(done_pickle_bytes), "outcome": broadcast(pickled(Outcome(True)), world)})
    return {
        "async": {"rank0_reads_bytes": sum(done_json_bytes), "rank0_writes_bytes": done_json_bytes[0],
                  "other_writes_bytes_max": max(done_json_bytes[1:], default=0),
                  "other_reads_bytes": outcome_json if world > 1 else 0},
        "sync": {"rank0": sync["rank0"], "other": sync["other"]},
        "done_json_bytes": {"rank0": done_json_bytes[0], "largest": max(done_json_bytes),
                            "total": sum(done_json_bytes)},
        "done_pickle_bytes": {"rank0": done_pickle_bytes[0], "largest": max(done_pickle_bytes),
                              "total": sum(done_pickle_bytes)},
    }


def scaled_commit(measured: Dict[str, Any], world: int, from_world: int) -> Dict[str, Any]:
    """``measured`` (a :func:`commit_exchange` at ``from_world`` ranks) for ``world`` ranks: what rank 0 reads,
    receives and sends scaled with the ranks (each rank's done record keeps its size: its own pieces); a
    non-zero rank's figures unchanged."""
    f = world / from_world
    g = (world - 1) / max(1, from_world - 1)
    a, s = measured["async"], measured["sync"]
    return {
        "async": {**a, "rank0_reads_bytes": int(a["rank0_reads_bytes"] * f)},
        "sync": {"rank0": {k: int(v * g) for k, v in s["rank0"].items()}, "other": s["other"]},
        "done_json_bytes": {**measured["done_json_bytes"], "total": int(measured["done_json_bytes"]["total"] * f)},
        "done_pickle_bytes": {**measured["done_pickle_bytes"],
                              "total": int(measured["done_pickle_bytes"]["total"] * f)},
    }


def exchange_summary(plan: Dict[str, Any], commit: Dict[str, Any]) -> List[str]:
    """Short lines of the figures, for the progress output."""
    r0, o = plan["rank0"], plan["other"]
    return [f"plan exchange: a non-zero rank sends {o['sent_bytes'] / 2**10:.1f} KiB, receives "
            f"{o['received_bytes'] / 2**10:.1f} KiB; rank 0 receives {r0['received_bytes'] / 2**20:.1f} MiB, sends "
            f"{r0['sent_bytes'] / 2**20:.1f} MiB",
            f"commit: rank 0 reads {commit['async']['rank0_reads_bytes'] / 2**20:.1f} MiB of done records (async)"]
