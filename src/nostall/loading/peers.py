"""Read once across replicas: a stored piece that several ranks need is read by one and sent to the others.

Data-parallel replicas (and every rank loading a replicated norm) need the
same stored bytes; read alone, N replicas read them N times from storage.
In a load over a group (:mod:`nostall.loading.collective`), rank 0 sees what
every rank needs and :func:`assign`\\s each piece that two or more ranks need
whole to one reader among them (largest pieces first, to the one with the
fewest bytes so far). :func:`exchange` runs the transfers: every rank posts
its receives, reads what it sends (checking each block against the
manifest's checksums, so a damaged file is named by the rank that read it)
and sends it, with a status word in front; a reader that failed sends its
error instead, and each of its receivers raises it, naming the reader. The
rank then loads as usual: its data files serve the received byte ranges
from memory (checked again like any read) and the rest from storage. The
messages use the load's gloo group (tensor data over the group, bounded by
its timeout like every collective); the bytes a rank holds so stay below
``cap`` (past it, a rank reads for itself).

>>> needs = [[("rank0.safetensors", 0, 100)], [("rank0.safetensors", 0, 100)]]
>>> plans = assign(needs, cap=1 << 20)
>>> plans[0].send, plans[1].recv
([(0, ('rank0.safetensors', 0, 100), (1,))], [(0, ('rank0.safetensors', 0, 100), 0)])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from nostall.core.tensorbuf import byte_view
from nostall.core.format import Manifest, PieceRecord, TensorRecord
from nostall.errors import CheckpointLoadError, describe
from nostall.loading.sources import DataFiles, check_blocks
from nostall.planning.comm import Comm

__all__ = ["Transfer", "Plan", "assign", "exchange"]

Transfer = Tuple[str, int, int]
"""A stored byte range: (file, start, end), a whole piece."""

RECEIVE_CAP = 1 << 30
"""The most bytes of pieces read once a rank holds in one load (read to send, or received; held in memory
until the load copies them)."""
_TAG = 8000  # + the transfer's number: each message of a load has a tag of its own
_HEAD = 8  # status word in front of each message: 0 the bytes follow, else an error message does


@dataclass
class Plan:
    """One rank's part in the transfers: what it reads and sends to whom, what it receives from whom.
    Each transfer carries its number (the same on every rank), which tags its messages."""

    send: List[Tuple[int, Transfer, Tuple[int, ...]]] = field(default_factory=list)
    recv: List[Tuple[int, Transfer, int]] = field(default_factory=list)


def assign(needs: Sequence[Sequence[Transfer]], cap: int) -> List[Plan]:
    """Each rank's :class:`Plan` from the whole pieces each rank needs (rank 0, while cutting shares).

    A piece two or more ranks need goes to one of them to read (largest first, to the rank with the fewest
    bytes to read and send so far; lowest rank on a tie); the others receive it, each at most ``cap`` bytes in
    all (past it, a rank reads the piece itself).
    """
    holders: Dict[Transfer, List[int]] = {}
    for r, ts in enumerate(needs):
        for t in ts:
            holders.setdefault(t, []).append(r)
    shared = sorted((t for t, rs in holders.items() if len(rs) > 1), key=lambda t: (t[1] - t[2], t))
    load = [0] * len(needs)
    received = [0] * len(needs)
    plans = [Plan() for _ in needs]
    for n, t in enumerate(shared):
        size = t[2] - t[1]
        rs = holders[t]
        fits = [r for r in rs if received[r] + size <= cap]
        if len(fits) < 2:
            continue
        reader = min(fits, key=lambda r: (load[r], r))
        to = tuple(r for r in fits if r != reader)
        load[reader] += size
        received[reader] += size
        plans[reader].send.append((n, t, to))
        for r in to:
            received[r] += size
            plans[r].recv.append((n, t, reader))
    return plans


def _pieces(m: Manifest) -> Dict[Transfer, Tuple[PieceRecord, TensorRecord]]:
    """Every piece of ``m`` (this rank's share) by its byte range."""
    out: Dict[Transfer, Tuple[PieceRecord, TensorRecord]] = {}
    for rec in list(m.tensors.values()) + [t for r in m.per_rank for t in r.tensors.values()]:
        for p in rec.pieces:
            out.setdefault((p.file, p.start, p.end), (p, rec))
    return out


def exchange(comm: Comm, plan: Plan, files: DataFiles, m: Manifest, verify: bool) -> None:
    """Run this rank's transfers of ``plan`` over ``comm`` (every rank of the load calls it); what it
    received, ``files`` serves from then on (:meth:`~nostall.loading.sources.DataFiles.keep`). Raises the
    first failure once every message is through."""
    bufs = [(n, t, src, torch.empty(_HEAD + t[2] - t[1], dtype=torch.uint8)) for n, t, src in plan.recv]
    works = [comm.receive(b, src, _TAG + n) for n, _t, src, b in bufs]
    pieces = _pieces(m) if plan.send else {}
    own_error: Optional[BaseException] = None
    for n, t, to in plan.send:
        msg = torch.zeros(_HEAD + t[2] - t[1], dtype=torch.uint8)
        data = byte_view(msg)
        try:
            files.read(t[0], t[1], t[2] - t[1], into=data[_HEAD:])
            if verify:
                p, rec = pieces[t]
                check_blocks(data[_HEAD:], 0, p, rec, files.path(t[0]), m.block_size)
        except Exception as e:  # its receivers must learn it, and not wait
            own_error = own_error or e
            text = describe(e).encode()[: t[2] - t[1]]
            msg.zero_()
            msg[0] = 1
            data[_HEAD:_HEAD + len(text)] = text
        for r in to:
            comm.send(msg, r, _TAG + n)
        if not msg[0]:
            files.keep(t[0], t[1], data[_HEAD:], received=False)  # this rank loads it too
    for w in works:
        comm.wait(w)
    if own_error is not None:
        raise own_error
    for _n, t, src, b in bufs:
        view = byte_view(b)
        if view[0]:
            why = bytes(view[_HEAD:]).split(b"\0", 1)[0].decode(errors="replace")
            raise CheckpointLoadError(f"{files.path(t[0])}: bytes [{t[1]}, {t[2]}) could not be read by rank {src}, "
                                      f"which reads them for this rank too: {why}")
        files.keep(t[0], t[1], view[_HEAD:], received=True)
