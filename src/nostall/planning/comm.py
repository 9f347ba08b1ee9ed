"""Collectives between ranks: metadata, and the stored bytes a load reads once for several ranks.

The library talks to other ranks only through a :class:`Comm`: a single-process
stand-in when ``torch.distributed`` is not initialised, otherwise a gloo group
of its own, so that CUDA is never needed for metadata and every collective is
bounded by the library's timeout.

A gloo group is unusable for good once one of its collectives failed (a
timeout closes its connections: every later call fails at once with "pair
closure"). A group the Comm owns (a CheckpointManager's) is therefore replaced
after a failure, so that one late rank costs one save, not the manager: see
:meth:`_TorchComm._replace`.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import time
import uuid
from typing import Any, Callable, List, Optional, Sequence, Set

import torch
import torch.distributed as dist

from nostall.errors import CheckpointError, CheckpointSaveError, CheckpointTimeoutError

log = logging.getLogger("nostall")

_PACKAGE = __name__.split(".")[0]


class Comm:
    """Rank, size and object collectives of one process group."""

    rank: int = 0
    size: int = 1

    def all_gather(self, obj: Any) -> List[Any]:
        return [obj]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's ``obj`` on rank 0 (a list in rank order); None on the other ranks."""
        return [obj]

    def scatter(self, objs: Optional[Sequence[Any]]) -> Any:
        """Rank 0's ``objs[r]`` on each rank ``r`` (``objs``: given on rank 0 only)."""
        assert objs is not None
        return objs[0]

    def exchange(self, objs: Sequence[Any]) -> List[Any]:
        """All-to-all of objects: ``objs[r]`` goes to rank ``r``; returns what each rank sent this one
        (a list in rank order). What a rank sends and receives follows its own messages, not the job's."""
        assert len(objs) == self.size
        return [objs[0]]

    def receive(self, into: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving ``into`` (a uint8 CPU tensor) from rank ``src``; :meth:`wait` for the handle."""
        raise CheckpointError("a world of one has no other rank to receive from")

    def send(self, data: torch.Tensor, dst: int, tag: int) -> None:
        """Send ``data`` (a uint8 CPU tensor) to rank ``dst``, which receives it with the same tag; bounded."""
        raise CheckpointError("a world of one has no other rank to send to")

    def wait(self, handle: Any) -> None:
        """Wait (bounded) for what :meth:`receive` started."""

    def close(self) -> None:
        pass


def _is_timeout(e: BaseException) -> bool:
    # gloo: "Timed out waiting 3000ms for send operation to complete", and on the
    # rank that timed out, later calls: "Application timeout caused pair closure"
    return isinstance(e, TimeoutError) or "timed out" in str(e).lower() or "timeout" in str(e).lower()


def _to_bytes(t: torch.Tensor, n: int) -> bytes:
    return t[:n].numpy().tobytes()


SLOT = 4096
"""Bytes each rank sends in the first (and usually only) message of a collective: an 8-byte
length, then the pickled object when it fits in the rest (a save's per-save exchange does)."""


def _slot(data: bytes) -> torch.Tensor:
    """A collective's first message: ``len(data)``, then ``data`` when it fits in :data:`SLOT`."""
    slot = torch.zeros(SLOT, dtype=torch.uint8)
    slot[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if len(data) <= SLOT - 8:
        slot[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return slot


def _slot_length(slot: torch.Tensor) -> int:
    return int(slot[:8].view(torch.int64).item())


_TAIL_TAG = 7301
"""Tag of the point-to-point message that carries a pickle longer than its slot (gather, scatter)."""


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _padded(data: bytes, size: int) -> torch.Tensor:
    """``data`` in a buffer of ``size`` bytes (the second message, when an object did not fit)."""
    buf = torch.zeros(size, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


class _TorchComm(Comm):
    """Object collectives over a gloo process group.

    The collectives go straight to the group object (``allgather`` /
    ``broadcast`` on byte tensors, as ``all_gather_object`` does), so that the
    same code serves a group registered with ``torch.distributed`` and a
    replacement group built here (see :meth:`_replace`), which is not.
    """

    def __init__(self, group: Any, owned: bool, timeout: float, store: Any = None) -> None:
        self.group: Any = group
        self.owned = owned
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._registered = True  # self.group is known to torch.distributed (destroy it through it)
        # Replacement groups (owned groups only): they meet under this store, set by make_comm
        # once every rank agreed on a key prefix.
        self._store: Any = store
        self._round = 0  # the first replacement round this rank has not taken part in
        self._failure: Optional[CheckpointSaveError] = None  # the group broke: replace it before the next call

    # ------------------------------------------------------------------ failures
    def _raise(self, what: str, e: BaseException) -> None:
        if _is_timeout(e):
            fix = (
                "Every rank must call save() (and a manager's load()) at about the same point; if a rank is "
                f"legitimately that late (uneven work before a save), raise the timeout (now {self.timeout:g}s)."
            )
            err: CheckpointSaveError = CheckpointTimeoutError(
                f"rank {self.rank}: metadata {what} timed out after {self.timeout:g}s: another of the "
                f"{self.size} ranks did not reach it in time (it is late to save() or load(), stuck, or dead). {fix}"
                + (" The next save() replaces the broken group." if self._store is not None else "")
                + f" ({e})"
            )
        else:
            err = CheckpointSaveError(
                f"rank {self.rank}: metadata {what} with the other {self.size - 1} rank(s) failed "
                f"(timeout {self.timeout:g}s): {e}"
                + (" -- another rank gave up on it (it timed out waiting for this rank, if this rank was "
                   "late to save() or load()) or died; the next save() replaces the broken group"
                   if self._store is not None else "")
            )
        if self._store is not None:
            self._failure = err
        raise err from e

    def _unwinding(self) -> bool:
        """Whether this Comm's last failure is being handled, inside this library, right now.

        E.g. Saver.prepare tells the others that it gives up, with a broadcast,
        in its ``except`` clause. Such a call must not replace the group: a
        rank whose failure came at another call does not make it, and ranks
        that replace the group at different points of their call sequence
        would meet on a fresh group only to run mismatched collectives, and
        fail again, for ever. The replacement happens at the next operation's
        first collective instead, the same point on every rank. A ``save()``
        retried in the caller's own ``except`` clause is a next operation.
        (The failure, or an error raised ``from`` it, is the exception being
        handled, and the frame handling it belongs to this package.)
        """
        _, handled, tb = sys.exc_info()
        if handled is None or tb is None:
            return False
        if str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0] != _PACKAGE:
            return False  # handled by the caller
        seen: Set[int] = set()
        e: Optional[BaseException] = handled
        while e is not None and id(e) not in seen:
            if e is self._failure:
                return True
            seen.add(id(e))
            # explicit wrapping only: an exception merely raised while a caller handled the
            # failure (a save retried in its except clause) has it as __context__
            e = e.__cause__
        return False

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        if self._failure is not None:
            if self._unwinding():
                raise self._failure
            self._replace()
        try:
            return fn()
        except Exception as e:  # gloo raises RuntimeError on timeout / peer loss
            self._raise(what, e)

    # ------------------------------------------------------------------ replacing a broken group
    def _replace(self) -> None:
        """Replace the broken group by a fresh gloo group over the same ranks.

        Every rank that saw the group fail does this at its next operation's
        first collective. The ranks must agree on where the new group meets,
        which rules out the obvious ways:

        * ``dist.new_group`` names groups by a process-wide counter that every
          rank of the job must advance in the same order: a replacement on
          some ranks only, or at another time than the training loop's own
          ``new_group`` calls, would shift every later group of the job.
        * ``new_group(..., use_local_synchronization=True)`` names the group
          by its ranks: each replacement would rendezvous under the same
          store keys as the last one, whose stale addresses a rank may read.
        * counting failures on each rank: the counts differ whenever a
          collective failed on one rank but completed on another (the last
          collective of a save, a timeout at the very edge), and ranks would
          then never meet again.

        Instead the ranks agree through the default store, which does not
        break with the group, on a replacement round (:meth:`_join_round`). A
        full round is final: its ranks build a ``ProcessGroupGloo`` over the
        store prefix of that round (fresh keys) and go on to round ``r + 1``
        next time, whether the build worked or not, as do all the others.
        """
        self._destroy_group()  # first: a peer still inside a collective on it fails at once
        r = self._round
        self._join_round(r)
        self._round = r + 1  # final, whatever happens next
        try:
            group = dist.ProcessGroupGloo(
                dist.PrefixStore(f"group{r}/", self._store), self.rank, self.size,
                datetime.timedelta(seconds=self.timeout),
            )
        except Exception as e:
            self._raise(f"group replacement (round {r})", e)
        self.group, self._registered, self._failure = group, False, None
        log.info("rank %d: replaced the checkpoint group after a failed collective (round %d)", self.rank, r)

    def _join_round(self, r: int) -> None:
        """Join replacement round ``r`` and wait (up to ``timeout``) until every rank joined it.

        Round ``r`` is a key under this Comm's own store prefix (agreed when
        the group was made) that holds the set of ranks that joined it,
        updated with compare-and-set. A rank joins the lowest round it has
        not taken part in and waits for the set to fill -- a peer may still
        be in its own failing call, or on its way to its next save. A rank
        that gives up withdraws from the set, unless it filled meanwhile, and
        joins the same round next time, so the ranks meet again as soon as
        their attempts overlap. Any failure is kept as this Comm's failure
        (the next operation tries again) and raised.
        """
        deadline = time.monotonic() + self.timeout
        key = f"round{r}"
        try:
            joined = self._update(key, lambda m: None if self.rank in m else m | {self.rank})
            full = set(range(self.size))
            delay = 0.005
            while joined != full:
                if time.monotonic() >= deadline:
                    joined = self._update(key, lambda m: None if m == full else m - {self.rank})
                    if joined == full:
                        break
                    missing = sorted(full - joined - {self.rank})
                    raise CheckpointTimeoutError(
                        f"rank {self.rank}: a collective of the checkpoint group failed in an earlier save, and "
                        f"replacing the group needs every rank, but rank(s) {missing} did not come within "
                        f"{self.timeout:g}s (late to save(), stuck or dead; if late, raise the timeout). "
                        "The next save() tries again"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
                joined = _members(self._store.get(key))
        except CheckpointSaveError as e:
            self._failure = e
            raise
        except Exception as e:
            err = CheckpointSaveError(
                f"rank {self.rank}: replacing the broken checkpoint group failed: the default store of "
                f"torch.distributed is unreachable? ({e})"
            )
            self._failure = err
            raise err from e

    def _update(self, key: str, change: Callable[[Set[int]], Optional[Set[int]]]) -> Set[int]:
        """Apply ``change`` to the set of ranks at ``key`` atomically; the resulting set."""
        store = self._store
        cur = _text(store.compare_set(key, "", "-"))  # creates it empty, or returns it
        while True:
            members = _members(cur)
            new = change(members)
            if new is None:
                return members
            want = ",".join(str(i) for i in sorted(new)) or "-"
            got = _text(store.compare_set(key, cur, want))
            if got == want:
                return new
            cur = got

    def _destroy_group(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        if self._registered:
            try:
                dist.destroy_process_group(group)
            except Exception as e:  # best effort: it is broken, or torch.distributed is shut down
                log.debug("destroying nostall's gloo group failed: %s", e)
        # an unregistered group closes its connections once unreferenced (now)

    # ------------------------------------------------------------------ collectives
    def _wait(self, work: Any) -> None:
        work.wait()

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``: one collective when every pickle fits in :data:`SLOT`, else two
        (every rank sees every length after the first, so all take the same path)."""

        def run() -> List[Any]:
            g = self.group
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            slots = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(self.size)]
            self._wait(g.allgather([slots], [_slot(data)]))
            n = [_slot_length(s) for s in slots]
            if max(n) <= SLOT - 8:
                return [pickle.loads(_to_bytes(s[8:], k)) for s, k in zip(slots, n)]
            outs = [torch.empty(max(n), dtype=torch.uint8) for _ in range(self.size)]
            self._wait(g.allgather([outs], [_padded(data, max(n))]))
            return [pickle.loads(_to_bytes(t, k)) for t, k in zip(outs, n)]

        return self._call("all_gather", run)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank: one collective when its pickle fits in :data:`SLOT`, else two."""

        def run() -> Any:
            g = self.group
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            opts.rootTensor = 0
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == src else b""
            slot = _slot(data) if self.rank == src else torch.empty(SLOT, dtype=torch.uint8)
            self._wait(g.broadcast([slot], opts))
            n = _slot_length(slot)
            if n <= SLOT - 8:
                return obj if self.rank == src else pickle.loads(_to_bytes(slot[8:], n))
            buf = _padded(data, n) if self.rank == src else torch.empty(n, dtype=torch.uint8)
            self._wait(g.broadcast([buf], opts))
            return obj if self.rank == src else pickle.loads(_to_bytes(buf, n))

        return self._call("broadcast", run)

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's ``obj`` on rank 0, None elsewhere: one gather of :data:`SLOT`-sized messages, and a
        point-to-point message to rank 0 from each rank whose pickle does not fit in its slot (rank 0 reads
        the lengths from the slots). A rank other than 0 receives nothing: what it costs follows its own
        message, not the job."""

        def run() -> Optional[List[Any]]:
            g = self.group
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            opts = dist.GatherOptions()
            opts.rootRank = 0
            if self.rank != 0:
                self._wait(g.gather([], [_slot(data)], opts))
                if len(data) > SLOT - 8:
                    self._wait(g.send([_bytes_tensor(data)], 0, _TAIL_TAG))
                return None
            slots = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(self.size)]
            self._wait(g.gather([slots], [_slot(data)], opts))
            n = [_slot_length(s) for s in slots]
            tails = {r: torch.empty(n[r], dtype=torch.uint8) for r in range(1, self.size) if n[r] > SLOT - 8}
            for w in [g.recv([t], r, _TAIL_TAG) for r, t in tails.items()]:
                self._wait(w)
            out: List[Any] = [obj]
            for r in range(1, self.size):
                t = tails.get(r)
                out.append(pickle.loads(_to_bytes(slots[r][8:], n[r]) if t is None else _to_bytes(t, n[r])))
            return out

        return self._call("gather", run)

    def scatter(self, objs: Optional[Sequence[Any]]) -> Any:
        """Rank 0's ``objs[r]`` on each rank ``r``: one scatter of :data:`SLOT`-sized messages, and a
        point-to-point message from rank 0 to each rank whose pickle does not fit in its slot. A rank other
        than 0 receives its own object only."""

        def run() -> Any:
            g = self.group
            opts = dist.ScatterOptions()
            opts.rootRank = 0
            mine = torch.empty(SLOT, dtype=torch.uint8)
            if self.rank != 0:
                self._wait(g.scatter([mine], [], opts))
                n = _slot_length(mine)
                if n <= SLOT - 8:
                    return pickle.loads(_to_bytes(mine[8:], n))
                tail = torch.empty(n, dtype=torch.uint8)
                self._wait(g.recv([tail], 0, _TAIL_TAG))
                return pickle.loads(_to_bytes(tail, n))
            assert objs is not None and len(objs) == self.size
            data = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objs]
            self._wait(g.scatter([mine], [[_slot(d) for d in data]], opts))
            for w in [g.send([_bytes_tensor(d)], r, _TAIL_TAG) for r, d in enumerate(data)
                      if r and len(d) > SLOT - 8]:
                self._wait(w)
            return objs[0]

        return self._call("scatter", run)

    def exchange(self, objs: Sequence[Any]) -> List[Any]:
        """``objs[r]`` to each rank ``r``, and what each rank sent this one: two all-to-alls (the pickles'
        lengths, then their bytes), bounded like every collective of the group."""

        def run() -> List[Any]:
            g = self.group
            assert len(objs) == self.size
            data = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objs]
            sizes = torch.tensor([len(d) for d in data], dtype=torch.int64)
            got = torch.empty(self.size, dtype=torch.int64)
            self._wait(g.alltoall_base(got, sizes, [], [], dist.AllToAllOptions()))
            n = [int(x) for x in got.tolist()]
            out = torch.empty(sum(n), dtype=torch.uint8)
            self._wait(g.alltoall_base(out, _bytes_tensor(b"".join(data)), n, [len(d) for d in data],
                                       dist.AllToAllOptions()))
            raw = out.numpy().tobytes()
            res: List[Any] = []
            pos = 0
            for k in n:
                res.append(pickle.loads(raw[pos : pos + k]))
                pos += k
            return res

        return self._call("exchange", run)

    def receive(self, into: torch.Tensor, src: int, tag: int) -> Any:
        return self._call("receive", lambda: self.group.recv([into], src, tag))

    def send(self, data: torch.Tensor, dst: int, tag: int) -> None:
        self._call("send", lambda: self._wait(self.group.send([data], dst, tag)))

    def wait(self, handle: Any) -> None:
        self._call("receive", lambda: self._wait(handle))

    def close(self) -> None:
        if self.owned:
            self._destroy_group()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _members(value: Any) -> Set[int]:
    """The set of ranks stored as "0,2,3" ("-": none)."""
    text = _text(value)
    return set() if text in ("", "-") else {int(x) for x in text.split(",")}


def _default_store() -> Any:
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception as e:  # pragma: no cover - a torch without it: broken groups stay broken
        log.warning("nostall cannot reach torch.distributed's default store (%s): a checkpoint group "
                    "broken by a failed save will not be replaced (create a new CheckpointManager)", e)
        return None


def check_launch() -> None:
    """Refuse a multi-rank launch (``WORLD_SIZE`` > 1) whose ranks never formed a process group.

    torchrun and like launchers set ``WORLD_SIZE``; without
    ``init_process_group`` each rank would save (or load) as if alone: the
    checkpoint would hold one rank's pieces, a load would give every rank
    rank 0's values.
    """
    if dist.is_available() and dist.is_initialized():
        return
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        raise CheckpointError(
            f"WORLD_SIZE={launched} (RANK={os.environ.get('RANK', '?')}): this is a multi-rank launch, but "
            "torch.distributed is not initialised; call torch.distributed.init_process_group() on every "
            "rank before creating a CheckpointManager or calling nostall.save/load"
        )


def make_comm(process_group: Optional[Any], timeout: float, own_group: bool) -> Comm:
    """The Comm for ``process_group`` (None: the default group, if initialised).

    With ``own_group`` (managers), a dedicated gloo group with the library's
    timeout is created -- a collective call over the group's members -- and
    replaced after a failed collective. Otherwise a gloo group is reused as it
    is and only non-gloo groups get a gloo twin.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise CheckpointError("process_group given but torch.distributed is not initialised")
        check_launch()
        return Comm()
    group = process_group if process_group is not None else dist.group.WORLD
    if not own_group and dist.get_backend(group) == "gloo":
        return _TorchComm(group, owned=False, timeout=timeout)
    ranks = dist.get_process_group_ranks(group)
    td = datetime.timedelta(seconds=timeout)
    try:
        if group is dist.group.WORLD or group is None:
            sub = dist.new_group(backend="gloo", timeout=td)
        else:
            sub = dist.new_group(ranks=ranks, backend="gloo", timeout=td, use_local_synchronization=True)
    except Exception as e:  # gloo raises RuntimeError when a member is missing or gone
        raise CheckpointSaveError(
            f"rank {dist.get_rank()}: creating the checkpoint manager's gloo group over ranks {ranks} "
            f"failed (did a rank die or not call it?): {e}"
        ) from e
    comm = _TorchComm(sub, owned=True, timeout=timeout)
    # Every member finishes connecting before anyone may use -- or destroy -- the
    # group (a rank that closes a manager right away must not break a slower
    # peer's connection set-up): an all_gather, which also agrees on the store
    # prefix under which replacements of this group meet (unique to this group:
    # group names are reused once a group is destroyed).
    try:
        key = comm.all_gather(uuid.uuid4().hex if comm.rank == 0 else None)[0]
    except BaseException:
        comm.close()
        raise
    store = _default_store()
    if store is not None:
        comm._store = dist.PrefixStore(f"nostall/comm/{key}/", store)
    return comm
