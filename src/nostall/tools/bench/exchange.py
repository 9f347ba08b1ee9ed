"""The bytes a save's metadata exchanges move per rank, counted from the real encodings.

No process group: each message is the real object a save sends (built from
synthetic metadata or a plan), encoded as the library encodes it
(``pickle.dumps`` for a collective, the JSON of a done record), and the
collectives are simulated from those lengths as :mod:`nostall.planning.comm`
runs them: an all-gather sends a :data:`~nostall.planning.comm.SLOT` of
every rank, then, when some rank's pickle does not fit in it, a second
message of every rank padded to the longest pickle.

A first save (no cached plan) exchanges, on every rank's training thread:

* ``round1``: every rank's outcome, signature, objects, step and save id;
* ``metadata``: every rank's :class:`~nostall.planning.plan.RankMeta`;
* ``digests``: the checksums of the replicated tensors each rank holds
  (when several ranks hold a copy of some key and the replica check runs).

Then the commit: an asynchronous save writes each rank's done record to
the storage root and rank 0 reads them all (the others read rank 0's
outcome); a synchronous one all-gathers the done records.
"""

from __future__ import annotations

import json
import pickle
from typing import Any, Dict, List, Sequence

from nostall.core.format import Placed, FileRecord
from nostall.core.jobs import Done, Outcome
from nostall.planning.comm import SLOT

PICKLE = pickle.HIGHEST_PROTOCOL
SAVE_ID = "0123456789abcdef0123456789abcdef"
"""A save id as long as a real one (``uuid4().hex``), sent by rank 0."""
DIGEST = "0" * 32
"""A content digest as long as a real one (xxh3-128, hex)."""


def objects() -> Dict[str, Any]:
    """The synthetic job's saved values (the same on every rank)."""
    return {"step": 1, "config": {"lr": 3e-4}}


def per_rank_objects(rank: int) -> Dict[str, Any]:
    """The synthetic job's per-rank values of ``rank``."""
    return {"loader/position": 1000 * rank, "loader/epoch": 0}


def round1_message(rank: int, signature: str) -> Any:
    """What ``rank`` all-gathers first in a save: (state error, target error, signature, objects, step, save id)."""
    return (None, None, signature, (objects(), per_rank_objects(rank)), 1, SAVE_ID if rank == 0 else "")


def digests_message(meta: Any, shared: Dict[str, Any], crc: int) -> Dict[str, int]:
    """The replica check's message of the rank of ``meta``: a checksum of each shared key it holds."""
    return {t.key: crc for t in meta.tensors if t.key in shared}


def done_record(plan: Any, rank: int, block_size: int, crc: int) -> Done:
    """The done record ``rank`` reports once it wrote its files of ``plan`` (checksum values ``crc``)."""
    d = Done(True)
    for f in plan.files_of(rank):
        d.files[f.name] = FileRecord(f.name, rank, f.size)
        for it in f.items:
            blocks = max(0, -(-(it.end - it.start) // block_size))
            d.placed[(f.name, it.start, it.end)] = Placed(f.name, it.start, it.end, (crc,) * blocks, DIGEST)
    return d


def pickled(obj: Any) -> int:
    """Bytes of ``obj`` as a collective sends it."""
    return len(pickle.dumps(obj, protocol=PICKLE))


def done_json(done: Done) -> int:
    """Bytes of a done record as a background save writes it to the storage root."""
    return len(json.dumps(done.to_doc(), sort_keys=True).encode())


def all_gather(lengths: Sequence[int]) -> Dict[str, int]:
    """One ``Comm.all_gather`` of pickles ``lengths`` long (one per rank), per rank (every rank alike).

    ``sent_bytes``: the rank's own message(s); ``received_bytes``: the other ranks' messages, which any
    all-gather delivers to every rank; ``ring_sent_bytes``: what a rank puts on the wire in gloo's ring
    all-gather, which forwards the others' messages (as many as it receives)."""
    world, longest = len(lengths), max(lengths)
    two = longest > SLOT - 8
    message = SLOT + (longest if two else 0)
    return {"collectives": 2 if two else 1, "longest_pickle": longest, "message_bytes": message,
            "sent_bytes": message, "received_bytes": (world - 1) * message, "ring_sent_bytes": (world - 1) * message}


def broadcast(length: int, world: int) -> Dict[str, int]:
    """One ``Comm.broadcast`` of a pickle ``length`` long: bytes per receiving rank (the source sends them to
    each, or forwards them along a tree)."""
    message = SLOT + (length if length > SLOT - 8 else 0)
    return {"collectives": 2 if length > SLOT - 8 else 1, "message_bytes": message, "received_bytes": message,
            "world": world}


def plan_exchange(round1: Sequence[int], metadata: Sequence[int], digests: Sequence[int]) -> Dict[str, Any]:
    """The first save's metadata collectives from each rank's pickle lengths, and their totals per rank."""
    steps = {"round1": all_gather(round1), "metadata": all_gather(metadata)}
    if any(digests):
        steps["digests"] = all_gather(digests)
    total = {k: sum(s[k] for s in steps.values()) for k in ("collectives", "sent_bytes", "received_bytes",
                                                             "ring_sent_bytes")}
    return {"steps": steps, "per_rank": total,
            "own_pickles": {"rank0": {"round1": round1[0], "metadata": metadata[0], "digests": digests[0]},
                            "largest": {"round1": max(round1), "metadata": max(metadata), "digests": max(digests)}},
            "note": "all-gathers: rank 0 and the others send and receive alike"}


def commit_exchange(done_json_bytes: Sequence[int], done_pickle_bytes: Sequence[int]) -> Dict[str, Any]:
    """The commit's bytes per rank: a background save's done records (each rank writes its own, rank 0 reads
    every rank's), a synchronous save's all-gather of them and the outcome broadcast."""
    world = len(done_json_bytes)
    outcome_json = len(json.dumps({"ok": True, "error": ""}).encode())
    return {
        "async": {"rank0_reads_bytes": sum(done_json_bytes), "rank0_writes_bytes": done_json_bytes[0],
                  "other_writes_bytes_max": max(done_json_bytes[1:], default=0),
                  "other_reads_bytes": outcome_json if world > 1 else 0},
        "sync": {"gather": all_gather(done_pickle_bytes), "outcome": broadcast(pickled(Outcome(True)), world)},
        "done_json_bytes": {"rank0": done_json_bytes[0], "largest": max(done_json_bytes),
                            "total": sum(done_json_bytes)},
    }


def scaled_commit(measured: Dict[str, Any], world: int, from_world: int) -> Dict[str, Any]:
    """``measured`` (a :func:`commit_exchange` at ``from_world`` ranks) for ``world`` ranks: the rank-0 reads and
    the all-gather scaled with the ranks (each rank's done record keeps its size: its own pieces)."""
    f = (world - 1) / max(1, from_world - 1)
    a, g = measured["async"], measured["sync"]["gather"]
    return {
        "async": {**a, "rank0_reads_bytes": int(a["rank0_reads_bytes"] * world / from_world)},
        "sync": {"gather": {**g, "received_bytes": int(g["received_bytes"] * f),
                            "ring_sent_bytes": int(g["ring_sent_bytes"] * f)},
                 "outcome": measured["sync"]["outcome"]},
        "done_json_bytes": {**measured["done_json_bytes"],
                            "total": int(measured["done_json_bytes"]["total"] * world / from_world)},
    }


def exchange_summary(plan: Dict[str, Any], commit: Dict[str, Any]) -> List[str]:
    """Short lines of the figures, for the progress output."""
    pr = plan["per_rank"]
    return [f"plan exchange per rank: sends {pr['sent_bytes'] / 2**20:.2f} MiB, receives "
            f"{pr['received_bytes'] / 2**20:.1f} MiB in {pr['collectives']} collectives",
            f"commit: rank 0 reads {commit['async']['rank0_reads_bytes'] / 2**20:.1f} MiB of done records (async)"]
