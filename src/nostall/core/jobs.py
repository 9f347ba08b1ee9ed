"""The contracts between the trainer and the writer: save jobs, results and messages.

A *save job* is everything one rank needs to write its files and take part
in the commit, whether it runs inline in the trainer (a synchronous save) or
in the rank's background writer process (an asynchronous one): the same job,
run by the same routine (:func:`nostall.saving.commit.run_job`). Jobs and messages are
plain picklable dataclasses. This module does not import torch; a test
checks that the writer process never does.

Messages between a trainer and its writer (one :class:`Msg` each, over a
socket pair). The writer's first message is a PONG whose ``text`` is the code it
runs (:func:`nostall.saving.writer.code_token`) and ``size`` its pid: the
trainer reads it before the first save's collective rounds, and a writer of
other code than the trainer's is refused (docs/protocol.md, "Which code"):

=============  ===========  ==================================================
op             direction    meaning
=============  ===========  ==================================================
ATTACH         to writer    map the staging area (its fd follows); ``size``
SAVE           to writer    run ``job``
CHUNK          to writer    chunk ``index`` of the job in flight: ``segments``; of a
                            streamed job, ``size``: the area is staged up to there
CHUNK_ABORT    to writer    staging failed part-way: ``text`` says why
WARM           to writer    get ready to write to ``root`` (object storage: its client), off any deadline
PING / STOP    to writer    liveness / exit after answering
ATTACHED       to trainer   the area of ``size`` bytes is mapped
CHUNK_DONE     to trainer   chunk ``index`` is written: its half may be reused
                            (never for a streamed job: nothing is reused)
RESULT         to trainer   the job's :class:`JobResult`
PONG/STOPPED   to trainer   answers to PING / STOP; the first message of all is a PONG
                            (hello): ``text`` the writer's code token, ``size`` its pid
=============  ===========  ==================================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from nostall.core.faults import Faults
from nostall.core.format import FileRecord, Manifest, Placed

Crcs = Dict[Tuple[str, int, int], Tuple[int, ...]]
"""(file, start, end) -> block checksums of that piece."""
PlannedPiece = Tuple[str, int, int]
"""A piece as the plan lays it out: (file, start, end)."""
PieceWhat = Tuple[str, int, Tuple[int, ...], Tuple[int, ...]]
"""What a planned piece is: (key, the rank whose per-rank tensor it is or -1 for a tensor saved once for all
ranks, global offset, shape). The commit builds the manifest's piece
records from these (:meth:`~nostall.core.format.Manifest.with_pieces`)."""
PieceId = Tuple[str, str, str, Tuple[int, ...]]
"""What makes a piece the same piece from one save to the next: (planned file, its safetensors entry name,
dtype, shape)."""


@dataclass
class Written:
    """What a rank's writer reports: where each planned piece's bytes are, and the data files they are in.

    ``files``: own files under the names written in the staging directory
    (their actual sizes: an incremental save leaves unchanged pieces out),
    plus the files of earlier checkpoints that pieces are read from, as
    ``<checkpoint>/<file>``. ``ids``: each planned piece's :data:`PieceId`
    (incremental saves only), so that the next save can find it.
    """

    placed: Dict[PlannedPiece, Placed] = field(default_factory=dict)
    files: Dict[str, FileRecord] = field(default_factory=dict)
    ids: Dict[PlannedPiece, PieceId] = field(default_factory=dict)


@dataclass
class Destination:
    """Where one save goes inside a storage root, and what its commit moves.

    ``name``: the checkpoint's name in the root (``step_<N>``, or a one-shot
    directory's name). ``move_latest``: the commit moves the root's
    ``latest`` to ``step``. ``keep_last``: retention after the commit (None:
    keep all). ``save_id``: drawn by rank 0 for each save; every name a save
    creates carries it, so that nostall can prove what it made.
    """

    root: Any  # a nostall.storage.root.Root (picklable)
    name: str
    step: Optional[int]
    save_id: str
    move_latest: bool = False
    keep_last: Optional[int] = None
    tagged: bool = False  # data file names carry the save id (incremental saves; always on object storage)

    @property
    def path(self) -> str:
        """The checkpoint's location (a directory or a URL)."""
        return str(self.root.path(self.name))


@dataclass
class FileJob:
    """One data file of a save: its size and layout, and where its image lies in the staging area."""

    name: str
    area_offset: int
    size: int
    header_size: int
    pieces: Tuple[Tuple[int, int], ...]  # (start, end) within the file, in order
    what: Tuple[PieceWhat, ...] = ()  # beside each piece: what it is (its done record's entries; a solo save's
    # are filled in by solo.save_solo)


@dataclass
class Segment:
    """Bytes [start, end) of file ``file`` (an index into the job's files), at ``area_offset`` in the area."""

    file: int
    start: int
    end: int
    area_offset: int


@dataclass
class SaveJob:
    """One rank's part of one save (see the module docstring).

    ``manifest`` (rank 0 only): the checkpoint's manifest without checksums;
    rank 0 fills them in from every rank's done record and commits it.
    """

    dest: Destination
    rank: int
    world_size: int
    files: Tuple[FileJob, ...]
    block_size: int
    timeout: float
    incremental: bool = False  # digest every piece, so that the next save can reuse what did not change
    base: str = ""  # the save id of the committed save whose pieces this one may reuse ("": write everything)
    manifest: Optional[Manifest] = None
    faults: Faults = field(default_factory=Faults)
    chunked: bool = False  # the files' bytes come chunk by chunk after the job
    streamed: bool = False  # chunked, the files lying whole in the area: each CHUNK says how far it is staged
    side_files: Tuple[Tuple[str, bytes], ...] = ()  # rank 0: small files committed with the checkpoint
    max_write_rate: Optional[float] = None  # bytes/s cap on this rank's writes (Options.max_write_rate)
    drop_records: Optional[Destination] = None  # rank 0: the previous async save, whose records it drops first
    # Rank 0's writer holds the root's lock (its trainer's claim, shared with it: Root.held_lock), as every rank
    # learns when the manager claims the root: only then may an orphan writer of another rank finish this job
    # (a restarted job waits for that lock; docs/protocol.md, "Lifetime").
    root_locked: bool = False

    @property
    def step(self) -> Optional[int]:
        return self.dest.step

    @property
    def save_id(self) -> str:
        return self.dest.save_id


@dataclass
class Done:
    """A rank's done record: where its pieces are (with their checksums) and its files, or why it failed.

    Names are as the manifest gives them (stored names on object storage). ``what``: beside each placed
    piece, what it is (key, per-rank, offset, shape), from which the commit assembles the manifest's piece
    records; ``rank``: whose record it is.
    """

    ok: bool
    placed: Dict[PlannedPiece, Placed] = field(default_factory=dict)
    files: Dict[str, FileRecord] = field(default_factory=dict)
    error: str = ""
    rank: int = -1
    what: Dict[PlannedPiece, List[PieceWhat]] = field(default_factory=dict)  # several: empty pieces at one place

    def pieces(self, own_only: bool = True) -> Iterator[Tuple[int, str, int, Tuple[int, ...], Tuple[int, ...], Placed]]:
        """Each placed piece as :meth:`~nostall.core.format.Manifest.with_pieces` takes it: (rank, key,
        per-rank record's rank or -1, offset, shape, where it is). Raises ValueError naming the rank when a
        placed piece is not said what it is, or (``own_only``: a rank writes only its own per-rank tensors)
        is another rank's per-rank tensor."""
        what = self.what
        for k, w in self.placed.items():
            gots = what.get(k)
            if not gots:
                raise ValueError(f"rank {self.rank}: its done record places bytes [{k[1]}, {k[2]}) of {k[0]} but "
                                 "does not say which piece they are")
            for got in gots:
                if own_only and got[1] >= 0 and got[1] != self.rank:
                    raise ValueError(f"rank {self.rank} wrote per-rank tensor {got[0]!r} of rank {got[1]}")
                yield (self.rank, got[0], got[1], got[2], got[3], w)

    def to_doc(self) -> Dict[str, Any]:
        if not self.ok:
            return {"ok": False, "error": self.error}
        return {"ok": True, "rank": self.rank,
                "placed": [[n, s, e, w.file, w.start, w.end, list(w.crc32c), w.digest,
                            [[k, r, list(o), list(z)] for k, r, o, z in self.what.get((n, s, e), ())]]
                           for (n, s, e), w in self.placed.items()],
                "files": [[f.name, f.rank, f.size] for f in self.files.values()]}

    @classmethod
    def from_doc(cls, doc: Any) -> "Done":
        if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
            return cls(False, error=f"unreadable done record {str(doc)[:200]!r}")
        if not doc["ok"]:
            return cls(False, error=str(doc.get("error") or "unknown error"))
        placed = {}
        what: Dict[PlannedPiece, List[PieceWhat]] = {}
        for n, s, e, f, a, b, c, d, ws in doc["placed"]:
            k = (str(n), int(s), int(e))
            placed[k] = Placed(str(f), int(a), int(b), tuple(int(x) for x in c), str(d))
            what[k] = [(str(key), int(of), tuple(int(x) for x in off), tuple(int(x) for x in shp))
                       for key, of, off, shp in ws]
        files = {str(n): FileRecord(str(n), int(r), int(z)) for n, r, z in doc["files"]}
        return cls(True, placed, files, rank=int(doc.get("rank", -1)), what=what)


@dataclass
class Outcome:
    """Rank 0's decision on a save: committed, or why not."""

    ok: bool
    error: str = ""


@dataclass
class JobResult:
    save_id: str
    ok: bool
    error: Optional[str] = None
    write_s: float = 0.0
    commit_s: float = 0.0
    bytes_written: int = 0
    timed_out: bool = False  # a wait ran out (another rank, the writer, storage)


class Op(enum.Enum):
    ATTACH = "attach"
    WARM = "warm"
    SAVE = "save"
    CHUNK = "chunk"
    CHUNK_ABORT = "chunk_abort"
    PING = "ping"
    STOP = "stop"
    ATTACHED = "attached"
    CHUNK_DONE = "chunk_done"
    RESULT = "result"
    PONG = "pong"
    STOPPED = "stopped"


@dataclass
class Msg:
    """One message between a trainer and its writer; which fields matter depends on ``op``."""

    op: Op
    size: int = 0
    index: int = 0
    job: Optional[SaveJob] = None
    result: Optional[JobResult] = None
    segments: Optional[List[Segment]] = None
    text: str = ""
    root: Any = None
    records: Any = None  # SAVE, rank 0: a plan's tensor records (nostall.saving.writer.without_records)
