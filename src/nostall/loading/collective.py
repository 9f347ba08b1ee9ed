"""Collective loads: rank 0 reads a checkpoint's manifest once and gives each rank its share.

Alone, every rank of a job reads and parses the whole manifest: at 1,024
ranks x 1,000 tensors that is 60 MiB and seconds of parsing on each rank,
and the job reads it 1,024 times from shared storage. A load over a process
group (``CheckpointManager.load``) instead runs two exchanges
(docs/protocol.md, "Loading"):

1. **head** (broadcast from rank 0, which read the manifest): every key's
   record without its pieces, the objects, the files, every rank's per-rank
   keys (without pieces or values; ranks with alike keys share one record):
   what a rank builds and checks its template against (:func:`head_of`);
2. **share** (a gather to rank 0 and a scatter): each rank sends the boxes its
   template loads (:func:`~nostall.loading.reader.template_boxes`); rank 0
   answers with the pieces that overlap them and the rank's own per-rank
   pieces (:func:`share_of`).

The rank then loads with the head filled with its pieces (:func:`with_share`):
a manifest that lists what it reads, and every key for the strict checks. A
rank whose template cannot be built still takes part in the second exchange
(sending None), then raises its own error, so the others never wait for it.
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from nostall.core.format import Manifest, PieceRecord, RankRecord, TensorRecord
from nostall.errors import CheckpointError, CheckpointLoadError, describe
from nostall.loading import peers
from nostall.loading.engine import COALESCE_GAP, block_range
from nostall.loading.manifests import manifest_digest, read_manifest
from nostall.loading.peers import Check, Need, Transfer, error_from_wire, error_to_wire
from nostall.loading.sources import DataFiles, open_files
from nostall.storage.locate import split_checkpoint
from nostall.planning.comm import Comm
from nostall.core.format import gc_paused

__all__ = ["shared_manifest", "ManifestIndex", "head_of", "share_of", "plan_transfers", "with_share", "pack",
           "unpack"]

Shape = Tuple[int, ...]
Boxes = Dict[str, List[Tuple[Shape, Shape]]]
Share = Tuple[Dict[str, Tuple[PieceRecord, ...]], Optional[RankRecord]]
"""A rank's share: its pieces by key, its per-rank record."""
Copy = Tuple[str, Optional[str], Optional[Dict[str, str]], Optional[str]]
"""Loading copies, what a rank reports of its copy: its path, its manifest's digest, the data files it lacks
(with why), the error that kept it from telling (None: none; digest and files None: the rank failed)."""


# --------------------------------------------------------------------------- manifests cut and filled (no collective)


def _bare(t: TensorRecord) -> TensorRecord:
    return replace(t, pieces=()) if t.pieces else t


def head_of(m: Manifest) -> Manifest:
    """``m`` without any piece, and each rank's per-rank record as its keys alone (its tensors bare, its objects'
    values None: a rank gets its own record whole in its share): what every rank needs of it whatever it loads.
    Ranks whose per-rank keys are alike share one record, so the head does not grow with the job."""
    alike: Dict[Any, RankRecord] = {}

    def keys_of(r: RankRecord) -> RankRecord:
        tensors = {k: _bare(t) for k, t in r.tensors.items()}
        sig = (tuple((k, t.dtype, t.shape, t.sharded) for k, t in tensors.items()), tuple(r.objects))
        return alike.setdefault(sig, RankRecord(tensors, dict.fromkeys(r.objects)))

    return replace(m, tensors={k: _bare(t) for k, t in m.tensors.items()},
                   per_rank=tuple(keys_of(r) for r in m.per_rank))


class ManifestIndex:
    """Rank 0's index of a manifest's pieces: per key, sorted by their first offset, to find a box's pieces by
    bisection (not by a scan of every piece, for every rank)."""

    def __init__(self, m: Manifest) -> None:
        self.m = m
        self._keys: Dict[str, Tuple[List[int], List[PieceRecord], int]] = {}
        self._exact: Dict[str, Dict[Tuple[Shape, Shape], PieceRecord]] = {}

    def exact(self, key: str, box: Tuple[Shape, Shape]) -> Optional[PieceRecord]:
        """The non-empty piece of ``key`` whose box is ``box`` (a load in the saved layout asks for those)."""
        by_box = self._exact.get(key)
        if by_box is None:
            by_box = self._exact[key] = {(p.offset, p.shape): p for p in self.m.tensors[key].pieces}
        p = by_box.get(box)
        return p if p is not None and p.end > p.start else None

    def _of(self, key: str) -> Tuple[List[int], List[PieceRecord], int]:
        got = self._keys.get(key)
        if got is None:
            pieces = sorted(self.m.tensors[key].pieces, key=lambda p: p.offset[:1])
            starts = [p.offset[0] if p.offset else 0 for p in pieces]
            longest = max((p.shape[0] if p.shape else 1 for p in pieces), default=0)
            got = self._keys[key] = (starts, pieces, longest)
        return got

    def overlapping(self, key: str, boxes: Sequence[Tuple[Shape, Shape]]) -> Tuple[PieceRecord, ...]:
        """The pieces of ``key`` that overlap any of ``boxes`` (few pieces: in the manifest's order; else by
        their first offset)."""
        rec = self.m.tensors[key]
        if len(boxes) == 1:
            p = self.exact(key, boxes[0])
            if p is not None:  # the pieces tile the tensor: a piece with the box is all the box meets
                return (p,)
        if len(rec.pieces) <= 8:
            cands: Sequence[PieceRecord] = rec.pieces
            return tuple(p for p in cands if any(_meets(p, b) for b in boxes))
        starts, pieces, longest = self._of(key)
        found: Set[int] = set()
        for off, shape in boxes:
            if not off:  # a scalar: its one piece
                return rec.pieces
            lo = bisect.bisect_left(starts, off[0] - longest + 1)
            hi = bisect.bisect_left(starts, off[0] + shape[0])
            found.update(i for i in range(lo, hi) if _meets(pieces[i], (off, shape)))
        return tuple(pieces[i] for i in sorted(found))


def _meets(p: PieceRecord, box: Tuple[Shape, Shape]) -> bool:
    """Whether piece ``p`` and ``box`` share an element (an empty box or piece meets nothing)."""
    off, shape = box
    return all(po < o + s and o < po + ps for po, ps, o, s in zip(p.offset, p.shape, off, shape)) \
        and all(shape) and all(p.shape)


def share_of(index: ManifestIndex, rank: int, boxes: Optional[Boxes], parts: bool = False, world: int = 0
             ) -> Tuple[Share, List[Need]]:
    """Rank ``rank``'s share of the indexed manifest: the pieces overlapping ``boxes`` (None: every piece), and
    its per-rank record when the manifest has one for it; and the byte ranges of the pieces it needs whole
    (which another rank may read for it, :mod:`nostall.loading.peers`). ``parts`` (loading copies): every byte
    range its load reads, also the blocks of the pieces its boxes meet in part and, when ``world`` is the
    saving world size, its own per-rank pieces."""
    m = index.m
    whole: List[Need] = []
    if boxes is None:
        pieces = {k: t.pieces for k, t in m.tensors.items() if t.pieces}
        if parts:
            whole = [((p.file, p.start, p.end), ((k, p),)) for k, ps in pieces.items() for p in ps if p.end > p.start]
    else:
        pieces = {}
        tensors, exact = m.tensors, index.exact
        for k, bs in boxes.items():
            if k not in tensors:
                continue
            p = exact(k, bs[0]) if len(bs) == 1 else None
            if p is not None:  # a box that is a saved piece (a load in the saved layout): that piece, whole
                pieces[k] = (p,)
                whole.append(((p.file, p.start, p.end), ((k, p),)))
                continue
            pieces[k] = ps = index.overlapping(k, bs)
            for p in ps:
                if p.end <= p.start:
                    continue
                if any(_contains(b, p) for b in bs):
                    whole.append(((p.file, p.start, p.end), ((k, p),)))
                elif parts:  # the blocks of the piece each box meeting it reads
                    whole += [((p.file, *block_range(p, *_overlap(p, b), m.block_size)), ((k, p),))
                              for b in bs if _meets(p, b)]
    mine = m.per_rank[rank] if 0 <= rank < len(m.per_rank) else None
    if parts and mine is not None and world == m.world_size:
        whole += [((p.file, p.start, p.end), ((k, p),)) for k, t in mine.tensors.items() for p in t.pieces
                  if p.end > p.start]
    return (pieces, mine), whole


def _overlap(p: PieceRecord, box: Tuple[Shape, Shape]) -> Tuple[Shape, Shape]:
    """The region piece ``p`` and ``box`` share (they meet): its global offset and shape."""
    lo = tuple(max(o, po) for o, po in zip(box[0], p.offset))
    return lo, tuple(min(o + s, po + ps) - a for o, s, po, ps, a in zip(box[0], box[1], p.offset, p.shape, lo))


def pack(share: Share) -> Any:
    """``share`` as it travels: each piece a plain tuple (pickled several times faster than the record)."""
    pieces, mine = share
    return {k: [(p.offset, p.shape, p.file, p.start, p.end, p.crc32c, p.digest) for p in ps]
            for k, ps in pieces.items()}, mine


def unpack(packed: Any) -> Share:
    """The share :func:`pack` packed."""
    pieces, mine = packed
    return {k: tuple(PieceRecord(*f) for f in ps) for k, ps in pieces.items()}, mine


def _contains(box: Tuple[Shape, Shape], p: PieceRecord) -> bool:
    off, shape = box
    return all(o <= po and po + ps <= o + s for po, ps, o, s in zip(p.offset, p.shape, off, shape))


def with_share(head: Manifest, share: Share, rank: int) -> Manifest:
    """``head`` with this rank's pieces: its share's pieces and its per-rank record."""
    pieces, mine = share
    tensors = {k: replace(t, pieces=pieces[k]) if k in pieces else t for k, t in head.tensors.items()}
    per_rank = head.per_rank
    if mine is not None:
        per_rank = per_rank[:rank] + (mine,) + per_rank[rank + 1:]
    return replace(head, tensors=tensors, per_rank=per_rank)


# --------------------------------------------------------------------------- the exchanges


def shared_manifest(comm: Comm, path: str, template_of: Callable[[Manifest], Any],
                    storage_options: Optional[Dict[str, Any]] = None, error: Optional[BaseException] = None,
                    read_once: Optional[bool] = None, verify: bool = True, timeout: Optional[float] = None,
                    own_copies: bool = False) -> Tuple[Manifest, Any, DataFiles]:
    """Both exchanges, then the transfers of what is read once (collective): ``(this rank's manifest, its
    template, its data files)``, the template built by ``template_of(head)``, the files open (the caller
    loads through them and closes them). An error building the template is raised here once the exchanges
    are over.

    ``error``: this rank failed before the load could start (its path did not resolve): on rank 0 every
    rank raises it; on another rank it takes part in the exchanges, then raises it. ``read_once``: see
    ``Options.read_once`` (rank 0's decides; None: where the storage says it pays).

    ``own_copies`` (the same on every rank): each rank's ``path`` is its own copy of one checkpoint, which may
    lack data files (docs/protocol.md, "Loading"): each rank reports its manifest's digest and the files it
    lacks, and what it reads of those comes from a rank that has them. Copies of different checkpoints, and
    bytes no rank has, are a :class:`~nostall.CheckpointLoadError` on every rank.
    """
    from nostall.loading.reader import template_boxes

    once = False
    if comm.rank == 0 and error is None:
        try:
            once = read_once if read_once is not None else split_checkpoint(path, storage_options)[0].read_once_pays
        except Exception:  # the manifest read below reports what is wrong with the path
            once = False
    head, index = fetch_head(comm, path, storage_options, error if comm.rank == 0 else None)
    try:
        if error is not None:
            raise error
        template = template_of(head)
        boxes = template_boxes(template)
    except BaseException:
        fetch_share(comm, head, index, path, None, failed=True,
                    copy=(path, None, None, None) if own_copies else None)
        raise
    files: Optional[DataFiles] = None
    try:
        copy: Optional[Copy] = None
        if own_copies:
            files = open_files(path, head, storage_options, timeout)
            try:
                copy = (path, manifest_digest(path, storage_options), files.absent(), None)
            except Exception as e:  # rank 0 refuses the load on every rank, naming this one
                copy = (path, None, None, describe(e))
        m, plan = fetch_share(comm, head, index, path, boxes, read_once=once, copy=copy)
        if files is None:
            files = open_files(path, m, storage_options, timeout)
        if plan.send or plan.recv:
            peers.exchange(comm, plan, files, m.block_size, verify)
    except BaseException:
        if files is not None:
            files.close()
        raise
    return m, template, files


def fetch_head(comm: Comm, path: str, storage_options: Optional[Dict[str, Any]] = None,
               error: Optional[BaseException] = None) -> Tuple[Manifest, Any]:
    """The first exchange (collective): the head of the manifest at ``path`` on every rank, and on rank 0 the
    whole manifest's index (None elsewhere), which :func:`fetch_share` takes. Rank 0's read error (or
    ``error``, given on rank 0) is raised on every rank."""
    index: Optional[ManifestIndex] = None
    answer: Any = None
    if comm.rank == 0:
        try:
            if error is not None:
                raise error
            with gc_paused():
                full = read_manifest(path, storage_options)
            index = ManifestIndex(full)
            answer = (None, head_of(full))
        except Exception as e:  # every rank raises it
            answer = (error_to_wire(e), None)
    failure, head = comm.broadcast(answer)
    if failure is not None:
        if error is not None:
            raise error  # rank 0's own, as it was
        raise error_from_wire(failure)
    return head, index


def fetch_share(comm: Comm, head: Manifest, index: Any, path: str, boxes: Optional[Boxes],
                failed: bool = False, read_once: bool = False, copy: Optional[Copy] = None
                ) -> Tuple[Manifest, peers.Plan]:
    """The second exchange (collective): this rank's manifest, the head with the pieces ``boxes`` need.

    ``failed``: this rank could not build its template (it raises its own error afterwards): it asks for
    nothing. Ranks loading checkpoints of different names are refused on every rank. ``read_once`` (rank 0's
    decides): pieces several ranks need whole are assigned to one reader each; returns this rank's part.
    ``copy``: loading copies (given on every rank), what this rank's copy is (:data:`Copy`): copies of
    different checkpoints are refused on every rank, and what a rank's copy lacks comes from another's.
    """
    name = path.rstrip("/").rsplit("/", 1)[-1]
    asks = comm.gather((name, boxes, failed, copy))
    answers: Any = None
    if asks is not None:
        answers = _answers(index, asks, read_once)
    got = comm.scatter(answers)
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], str):
        raise error_from_wire(got)
    packed, plan = got
    return with_share(head, unpack(packed), comm.rank), plan


Ask = Tuple[str, Optional[Boxes], bool, Optional[Copy]]
"""What a rank asks of rank 0: its checkpoint's name, its boxes, whether it failed, its copy (loading copies)."""


def _answers(index: Optional[ManifestIndex], asks: Sequence[Ask], read_once: bool) -> List[Any]:
    """Rank 0: each rank's share and its part in the transfers, or the error every rank raises."""
    assert index is not None
    copies = any(a[3] is not None for a in asks)
    refused = _copies_refused(asks) if copies else _names_refused(asks)
    if refused is not None:
        return [("CheckpointLoadError", refused)] * len(asks)
    try:
        with gc_paused():  # millions of records, in no cycle
            world = len(asks)
            shares = [share_of(index, r, boxes, copies, world) if not failed else (({}, None), [])
                      for r, (_, boxes, failed, _c) in enumerate(asks)]
            if copies or read_once:
                absent = [None if a[2] or a[3] is None else a[3][2] for a in asks] if copies else None
                plans = plan_transfers([w for _, w in shares], read_once, absent, index.m.block_size)
            else:
                plans = [peers.Plan() for _ in shares]
            return [(pack(share), plan) for (share, _), plan in zip(shares, plans)]
    except CheckpointError as e:  # a range no rank has: every rank raises it
        return [error_to_wire(e)] * len(asks)
    except Exception as e:  # the others wait for their share: the error must reach them
        err = error_to_wire(CheckpointLoadError(f"rank 0: cutting the manifest into shares failed: {describe(e)}"))
        return [err] * len(asks)


def _names_refused(asks: Sequence[Ask]) -> Optional[str]:
    """Why the ranks' load is refused: they name checkpoints of different names (None: they do not)."""
    names = {a[0] for a in asks if not a[2]}  # a rank that failed named nothing it will load
    if len(names) <= 1:
        return None
    by = "; ".join(f"rank {r}: {a[0]}" for r, a in enumerate(asks) if not a[2])
    return (f"the ranks load different checkpoints ({by}): a load over the group must name the same checkpoint "
            "on every rank")


def _copies_refused(asks: Sequence[Ask]) -> Optional[str]:
    """Loading copies, why the load is refused: a rank could not tell what its copy is, or the copies' manifests
    differ (rank 0's is the reference); None: they are copies of one checkpoint."""
    copies = [(r, a[3]) for r, a in enumerate(asks) if not a[2] and a[3] is not None]
    failed = [f"rank {r} ({c[0]}): {c[3]}" for r, c in copies if c[3] is not None]
    if failed:
        return (f"the copies of the checkpoint cannot be loaded: {'; '.join(failed[:8])}"
                f"{'; ...' if len(failed) > 8 else ''}: restore them, or load another copy (another tier)")
    by: Dict[str, List[Tuple[int, str]]] = {}
    for r, c in copies:
        by.setdefault(c[1] or "", []).append((r, c[0]))
    if len(by) <= 1:
        return None
    groups = "; ".join(f"{peers.ranks_text([r for r, _ in rs])} (e.g. {rs[0][1]}): manifest sha256 {d[:16]}"
                       for d, rs in by.items())
    return (f"the ranks' copies are not copies of one checkpoint, their manifests differ ({groups}): a load of "
            "copies needs every rank's copy of the same checkpoint (rank 0's is the reference); give each rank a "
            "copy of it, or load another checkpoint")


def plan_transfers(needs: Sequence[Sequence[Need]], once: bool,
                   absent: Optional[Sequence[Optional[Dict[str, str]]]], block_size: int = 1,
                   most: Optional[int] = None) -> List[peers.Plan]:
    """Each rank's part in the transfers (:func:`peers.assign`), each send with the pieces its reader checks.
    Loading copies (``absent`` given), a rank's ranges of one file within :data:`~nostall.loading.engine.
    COALESCE_GAP` of each other are one range: the spans the read engine reads (it coalesces such ranges) are
    then held whole by a rank that lacks the file; a range several ranks name holds the pieces of each; a
    range longer than ``most`` bytes (:data:`~nostall.loading.peers.MESSAGE_MAX`) goes in several, cut at
    checksum blocks of ``block_size`` bytes."""
    if absent is None:  # whole pieces, as they are
        return peers.assign(needs, peers.RECEIVE_CAP, absent, once)
    merged = [_merged(ns) for ns in needs]
    every: Dict[Transfer, Dict[Tuple[str, int], Check]] = {}
    for ms in merged:
        for t, cs in ms:
            into = every.setdefault(t, {})
            for c in cs:
                into.setdefault((c[0], c[1].start), c)
    cut = {t: _cut(t, tuple(cs.values()), block_size, most or peers.MESSAGE_MAX) for t, cs in every.items()}
    return peers.assign([[n for t, _ in ms for n in cut[t]] for ms in merged], peers.RECEIVE_CAP, absent, once)


def _cut(t: Transfer, cs: Tuple[Check, ...], bs: int, most: int) -> List[Need]:
    """``t`` in ranges of about ``most`` bytes at most, each ending at a checksum block boundary of the piece it
    cuts (a block over ``most`` bytes is one range's), each with the pieces it holds bytes of."""
    name, a, hi = t
    out: List[Need] = []
    while hi - a > most:
        x = a + most
        for _, p in cs:
            if p.start < x < p.end:  # the start of the block holding x, or its end when that start is not past a
                down = p.start + (x - p.start) // bs * bs
                x = down if down > a else min(p.end, down + bs)
                break
        out.append(((name, a, x), tuple(c for c in cs if c[1].start < x and c[1].end > a)))
        a = x
    out.append(((name, a, hi), tuple(c for c in cs if c[1].start < hi and c[1].end > a)))
    return out


def _merged(needs: Sequence[Need]) -> List[Need]:
    """A rank's ranges by file and offset, those of one file within :data:`~nostall.loading.engine.COALESCE_GAP`
    of each other as one, each with the pieces its parts are of."""
    out: List[Tuple[List[Any], List[Check]]] = []  # [file, lo, hi], its pieces
    for (name, lo, hi), cs in sorted(needs, key=lambda n: n[0]):
        if out and out[-1][0][0] == name and lo <= out[-1][0][2] + COALESCE_GAP:
            out[-1][0][2] = max(out[-1][0][2], hi)
            out[-1][1].extend(cs)
        else:
            out.append(([name, lo, hi], list(cs)))
    return [((t[0], t[1], t[2]), tuple(cs)) for t, cs in out]
