"""Read once across ranks: a stored byte range that ranks need is read by one rank and sent to the others.

Data-parallel replicas (and every rank loading a replicated norm) need the
same stored bytes; read alone, N replicas read them N times from storage.
And in a load of copies (``own_copies``: each rank names its own copy of one
checkpoint, which may lack data files), a rank whose copy lacks a file needs
its bytes from a rank whose copy has it. In a load over a group
(:mod:`nostall.loading.collective`), rank 0 sees what every rank needs (and,
loading copies, which files each has) and :func:`assign`\\s each such range
to one reader (largest ranges first, to the one with the fewest bytes so
far). :func:`exchange` runs the transfers: every rank posts its receives,
reads what it sends (checking each whole block against the manifest's
checksums, so a damaged file is named by the rank that read it) and sends
it, with a status word in front; a reader that failed sends its error
instead, and each of its receivers raises it (its class kept), naming the
reader. The rank then loads as usual: its data files serve the received byte
ranges from memory (checked again like any read) and the rest from storage.
The messages use the load's gloo group (tensor data over the group, bounded
by its timeout like every collective); the bytes a rank holds of ranges it
could read itself stay below ``cap`` (past it, a rank reads for itself).

>>> needs = [[(("rank0.safetensors", 0, 100), ())], [(("rank0.safetensors", 0, 100), ())]]
>>> plans = assign(needs, cap=1 << 20)
>>> plans[0].send, plans[1].recv
([(0, ('rank0.safetensors', 0, 100), (1,))], [(0, ('rank0.safetensors', 0, 100), 0)])
>>> plans = assign(needs, cap=1 << 20, absent=[{"rank0.safetensors": "missing"}, {}], once=False)
>>> plans[1].send, plans[0].recv
([(0, ('rank0.safetensors', 0, 100), (0,))], [(0, ('rank0.safetensors', 0, 100), 1)])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

import nostall.errors as errors
from nostall.core.format import PieceRecord
from nostall.core.tensorbuf import byte_view
from nostall.errors import CheckpointError, CheckpointLoadError, describe
from nostall.loading.sources import DataFiles, check_range
from nostall.planning.comm import Comm

__all__ = ["Transfer", "Check", "Need", "Plan", "assign", "exchange", "error_to_wire", "error_from_wire", "ranks_text"]

Transfer = Tuple[str, int, int]
"""A stored byte range: (file, start, end): a whole piece, or (loading copies) the blocks a rank reads of a file."""
Check = Tuple[str, PieceRecord]
"""A piece (with its key) whose whole checksum blocks inside a transfer its reader checks."""
Need = Tuple[Transfer, Tuple[Check, ...]]
"""A range a rank's load reads, and the pieces it holds blocks of."""

RECEIVE_CAP = 1 << 30
"""The most bytes of ranges a rank could read itself that it holds in one load, read once for others or
received (held in memory until the load copies them)."""
MESSAGE_MAX = 256 << 20
"""Loading copies, the most bytes of one transfer (one message), about: a longer range a rank lacks is cut in
several, each at a checksum block boundary of the piece it cuts, so that its reader still checks every block
whole (:func:`nostall.loading.collective.plan_transfers`)."""
_TAG = 8000  # + the transfer's number: each message of a load has a tag of its own
_HEAD = 8  # status word in front of each message: byte 0: 0 the bytes follow, else an error message does (byte 1:
# its class, an index in _KINDS)
_KINDS = ("CheckpointError",) + tuple(sorted(
    n for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, CheckpointError)
    and n != "CheckpointError"))


@dataclass
class Plan:
    """One rank's part in the transfers: what it reads and sends to whom, what it receives from whom.
    Each transfer carries its number (the same on every rank), which tags its messages. ``checks``: for each
    transfer it sends, the pieces whose blocks it checks; ``relayed``: those it reads for others only (its own
    load does not read them)."""

    send: List[Tuple[int, Transfer, Tuple[int, ...]]] = field(default_factory=list)
    recv: List[Tuple[int, Transfer, int]] = field(default_factory=list)
    checks: Dict[int, Tuple[Check, ...]] = field(default_factory=dict)
    relayed: Set[int] = field(default_factory=set)


def assign(needs: Sequence[Sequence[Need]], cap: int,
           absent: Optional[Sequence[Optional[Mapping[str, str]]]] = None, once: bool = True) -> List[Plan]:
    """Each rank's :class:`Plan` from the byte ranges each rank's load reads, each with the pieces its reader
    checks (rank 0, while cutting shares; a range's pieces are those of the first rank that names it).

    ``absent``: loading copies, the files each rank's copy lacks, with why (None for a rank: it has none, it
    failed before the load); None: every rank has every file. A rank that has a range's file reads it itself;
    for the ranks that lack it, one reader with the file reads it and sends it: a needing rank that has it
    when there is one, else the rank with the file that has read the fewest bytes for others (lowest on a
    tie). ``once``: a range two or more ranks need is read by one of those that have it (the fewest bytes
    read for others so far) and sent to the others that have it too, each holding at most ``cap`` bytes of
    such ranges in all (past it, a rank reads the range itself). Raises
    :class:`~nostall.CheckpointLoadError` when no rank has a needed range's file, naming the file, the ranks
    that need it and why each rank lacks it.
    """
    world = len(needs)
    needers: Dict[Transfer, List[int]] = {}
    checks: Dict[Transfer, Tuple[Check, ...]] = {}
    for r, ns in enumerate(needs):
        for t, cs in ns:
            rs = needers.get(t)
            if rs is None:
                needers[t] = [r]
                checks[t] = cs
            elif rs[-1] != r:  # a range a rank needs twice (tied keys) is still its own
                rs.append(r)

    def has(r: int, name: str) -> bool:
        if absent is None:
            return True
        lacks = absent[r]
        return lacks is not None and name not in lacks

    load = [0] * world  # bytes read for others
    received = [0] * world  # bytes of ranges held that the rank could have read itself
    plans = [Plan() for _ in range(world)]
    unreadable: List[Tuple[Transfer, List[int]]] = []
    n = 0
    # every rank has every file: only ranges two or more ranks need move (none without ``once``)
    todo = list(needers) if absent is not None else [t for t, rs in needers.items() if once and len(rs) > 1]
    for t in sorted(todo, key=lambda t: (t[1] - t[2], t)):
        size = t[2] - t[1]
        rs = needers[t]
        local = [r for r in rs if has(r, t[0])] if absent is not None else rs
        lack = [r for r in rs if r not in local] if absent is not None else []
        shared = once and len(rs) > 1
        if not lack and not shared:
            continue  # each reads its own
        fits = [r for r in local if received[r] + size <= cap] if shared else []
        pool = fits or local or [r for r in range(world) if has(r, t[0])]
        if not pool:
            unreadable.append((t, rs))
            continue
        reader = min(pool, key=lambda r: (load[r], r))
        to = tuple(sorted(set(lack).union(fits) - {reader}))
        if not to:
            continue
        load[reader] += size
        received[reader] += size
        plans[reader].send.append((n, t, to))
        plans[reader].checks[n] = checks[t]
        if reader not in rs:
            plans[reader].relayed.add(n)
        for r in fits:  # (what a rank that lacks the file receives is not held against the cap)
            if r != reader:
                received[r] += size
        for r in to:
            plans[r].recv.append((n, t, reader))
        n += 1
    if unreadable:
        raise CheckpointLoadError(_unreadable(unreadable, absent or []))
    return plans


def ranks_text(rs: Sequence[int], most: int = 8) -> str:
    """``rs`` as a message names them: "rank 3", "ranks 0, 2, ..." (the first ``most``)."""
    shown = ", ".join(str(r) for r in rs[:most])
    return f"{'rank' if len(rs) == 1 else 'ranks'} {shown}{', ...' if len(rs) > most else ''}"


def _unreadable(unreadable: Sequence[Tuple[Transfer, List[int]]],
                absent: Sequence[Optional[Mapping[str, str]]]) -> str:
    """The message of ranges no rank can read: per file, who needs it and why each rank lacks it."""
    by_file: Dict[str, List[Tuple[Transfer, List[int]]]] = {}
    for t, rs in unreadable:
        by_file.setdefault(t[0], []).append((t, rs))
    parts = []
    for name, ts in by_file.items():
        needing = sorted({r for _, rs in ts for r in rs})
        why = [f"rank {r}: {'it failed before the load' if a is None else a.get(name, '?')}"
               for r, a in enumerate(absent)]
        shown = "; ".join(why[:8]) + ("; ..." if len(why) > 8 else "")
        parts.append(f"data file {name!r} ({len(ts)} byte range(s), e.g. [{ts[0][0][1]}, {ts[0][0][2]})) is needed "
                     f"by {ranks_text(needing)} and no rank's copy has it as listed ({shown})")
    return ("; ".join(parts) + ": the checkpoint cannot be loaded from these copies; restore the file in one "
            "rank's copy, or load another copy of the checkpoint (another tier)")


def error_to_wire(e: BaseException) -> Tuple[str, str]:
    """An error as it travels between ranks: the name of its nostall class (CheckpointError otherwise), its
    message."""
    name = type(e).__name__ if isinstance(e, CheckpointError) and isinstance(getattr(errors, type(e).__name__, None),
                                                                             type) else ""
    return name or "CheckpointError", str(e) if isinstance(e, CheckpointError) else describe(e)


def error_from_wire(error: Tuple[str, str]) -> CheckpointError:
    """The error :func:`error_to_wire` sent, of its class."""
    cls = getattr(errors, error[0], CheckpointError)
    return cls(error[1]) if isinstance(cls, type) and issubclass(cls, CheckpointError) else CheckpointError(error[1])


def exchange(comm: Comm, plan: Plan, files: DataFiles, block_size: int, verify: bool) -> None:
    """Run this rank's transfers of ``plan`` over ``comm`` (every rank of the load calls it); what it
    received, and what it read to send and loads too, ``files`` serves from then on
    (:meth:`~nostall.loading.sources.DataFiles.keep`). Raises the first failure once every message is through:
    its own read's, or the error a reader sent, of the reader's class, naming the reader."""
    bufs = [(n, t, src, torch.empty(_HEAD + t[2] - t[1], dtype=torch.uint8)) for n, t, src in plan.recv]
    works = [comm.receive(b, src, _TAG + n) for n, _t, src, b in bufs]
    own_error: Optional[BaseException] = None
    for n, t, to in plan.send:
        msg = torch.zeros(_HEAD + t[2] - t[1], dtype=torch.uint8)
        data = byte_view(msg)
        try:
            files.read(t[0], t[1], t[2] - t[1], into=data[_HEAD:])
            if verify:
                check_range(data[_HEAD:], t[1], plan.checks.get(n, ()), files.path(t[0]), block_size)
        except Exception as e:  # its receivers must learn it, and not wait
            own_error = own_error or e
            name, why = error_to_wire(e)
            text = why.replace("\0", " ").encode()[: t[2] - t[1]]
            msg.zero_()
            msg[0] = 1
            msg[1] = _KINDS.index(name) if name in _KINDS else 0
            data[_HEAD:_HEAD + len(text)] = text
        for r in to:
            comm.send(msg, r, _TAG + n)
        if not msg[0] and n not in plan.relayed:
            files.keep(t[0], t[1], data[_HEAD:], received=False)  # this rank loads it too
    for w in works:
        comm.wait(w)
    if own_error is not None:
        raise own_error
    for _n, t, src, b in bufs:
        view = byte_view(b)
        if view[0]:
            why = bytes(view[_HEAD:]).split(b"\0", 1)[0].decode(errors="replace")
            kind = _KINDS[view[1]] if view[1] < len(_KINDS) else "CheckpointError"
            raise error_from_wire((kind, f"{files.path(t[0])}: bytes [{t[1]}, {t[2]}) could not be read by rank "
                                         f"{src}, which reads them for this rank: {why}"))
        files.keep(t[0], t[1], view[_HEAD:], received=True)
