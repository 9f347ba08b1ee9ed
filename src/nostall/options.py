"""Options: one validated value shared by the manager, ``Strategy``, the saver and the interop writers.

Every rule about what a valid option is lives here, once (``block_size`` among
them), so that a bad value is refused with the same message wherever it
enters. This module does not import torch.

Example::

    >>> from nostall.options import Options
    >>> Options(keep_last=3, async_save=True).keep_last
    3
    >>> Options(block_size=1000)
    Traceback (most recent call last):
    ...
    ValueError: block_size must be a power of two between 8 and 1073741824 bytes, got 1000

Its defaults are the only ones: ``CheckpointManager``, ``Strategy`` and
``nostall.save`` take each setting as a keyword argument defaulting to
:data:`NOT_GIVEN`, or all of them as ``options=`` (never both for one
setting: :func:`options_from`).
"""

from __future__ import annotations

import enum
import mmap
import signal
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, Mapping, Optional

from nostall.core.exports import ExportTarget
from nostall.core.format import DEFAULT_BLOCK_SIZE

__all__ = ["Options", "NOT_GIVEN", "NotGiven", "check_block_size", "check_preemption_signal", "options_from"]

MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 1 << 30


def check_block_size(value: Any) -> int:
    """``value`` as a checksum block size, or ``ValueError`` saying the rule.

    A power of two from 8 bytes to 1 GiB: it divides every read window and
    every page-aligned staging chunk, so a checkpoint written with it loads
    and verifies everywhere (4 MiB by default; small values only make sense
    for tests of partial reads).
    """
    if (isinstance(value, bool) or not isinstance(value, int) or value < MIN_BLOCK_SIZE
            or value > MAX_BLOCK_SIZE or value & (value - 1)):
        raise ValueError(f"block_size must be a power of two between {MIN_BLOCK_SIZE} and {MAX_BLOCK_SIZE} "
                         f"bytes, got {value!r}")
    return value


def check_preemption_signal(value: Any) -> signal.Signals:
    """``value`` as a signal a manager may handle for preemption, or ``ValueError`` saying the rule.

    A signal number of this platform that a process can catch (not SIGKILL
    or SIGSTOP).

    >>> check_preemption_signal(15).name
    'SIGTERM'
    >>> check_preemption_signal(signal.SIGKILL)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: preemption_signal must be a signal a process can catch (SIGTERM, SIGUSR1...) or None, got <...KILL...>
    """
    uncatchable = {signal.SIGKILL} | ({signal.SIGSTOP} if hasattr(signal, "SIGSTOP") else set())
    try:
        sig = signal.Signals(value)
        ok = not isinstance(value, bool) and sig in signal.valid_signals() and sig not in uncatchable
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"preemption_signal must be a signal a process can catch (SIGTERM, SIGUSR1...) or None, "
                         f"got {value!r}")
    return sig


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int of at least {minimum}, got {value!r}")


@dataclass(frozen=True)
class Options:
    """How a manager (or ``Strategy``, or an interop writer) saves; validated once, on creation.

    Args:
        keep_last: keep only this many newest committed checkpoints (None: all).
        async_save: write in a background process per rank.
        timeout: bound, in seconds, of every wait (other ranks, the writer,
            object storage).
        errors: ``"raise"`` or ``"log"``: what a failed background save does.
        block_size: checksum block size in bytes (see :func:`check_block_size`).
        storage_options: fsspec options for an object-storage root.
        local_staging_dir: object storage: where each rank stages its files
            before uploading them.
        fallback_sync: object storage: save synchronously.
        overlap: async saves copy into host memory while training goes on.
        staging_budget_bytes: the most host memory the staging area may take
            (rounded down to whole pages).
        check_replicas: compare, across the ranks holding it, every tensor
            that is saved once for several ranks (a plain tensor, a replica
            of a ShardedTensor piece); a save whose copies differ fails on
            every rank, naming the key and the ranks. ``None`` (default): on
            a manager's first save and whenever the plan changes; ``True``:
            every save; ``False``: never.
        max_write_rate: async saves: the most bytes per second the
            background writer writes (None: as fast as it can). A cap trades
            time until durable for less interference with training (disk,
            memory bandwidth, CPU); ``nostall bench train`` shows the trade.
            Local and shared filesystems; an object-storage upload is not
            paced. Pacing never costs a save its deadline: it sleeps only
            within the first half of ``timeout``, then writes the rest at
            full speed (with a warning).
        export: an export at save time (``nostall.interop.hf_export.HFExport("hf/step_{step}")``): after each
            committed save, every rank writes its share of a ``from_pretrained``-loadable directory from
            the committed checkpoint, off the training thread, made visible at once (docs/interop.md,
            "Exporting at save time"); ``save(..., export=False)`` skips it for one save. None: no export.
        incremental: each save writes only the pieces whose bytes changed
            since the manager's previous committed save in its root; the
            others are read from the earlier checkpoint's files (proven equal
            by an xxh3-128 digest, taken in the process that writes). Every
            checkpoint stays complete and verifiable, and retention keeps any
            file a retained checkpoint still reads. Opt-in: see
            docs/incremental.md.
        full_every: with ``incremental``, write everything every this many
            saves (a fresh chain); None: only the manager's first save.
        shared_loads: a manager's load over more than one rank is a
            collective call: rank 0 reads the manifest once and sends each
            rank the part it needs (docs/protocol.md, "Loading"), so a rank
            neither reads nor holds the whole job's. False: each rank reads
            the manifest itself, and a rank may load alone.
        read_once: in a shared load, a stored piece that several ranks need
            whole (data-parallel replicas) is read by one of them and sent to
            the others over the group (docs/protocol.md, "Loading"). None
            (default): on object storage, where each read costs; True: also
            on a filesystem (a shared one: NFS, Lustre); False: never.
        preemption_signal: the signal a scheduler sends before it kills the
            job (SIGTERM by default: Kubernetes, SLURM, torchrun); None: the
            manager installs no handler. A saving manager created on the main
            thread handles it: ``mgr.preempted`` becomes True, a save running
            in the main thread finishes first, and the save already handed to
            the background writer is committed by the writer without the
            training loop (docs/reliability.md, "Preemption"). Not SIGKILL or
            SIGSTOP, which cannot be caught.
        grace_s: seconds between that signal and the SIGKILL that follows it
            (Kubernetes' ``terminationGracePeriodSeconds`` and SLURM's
            ``KillWait`` default to 30, torchrun's shutdown too). Once the
            signal came, closing the manager (``with`` exit, ``close()``, the
            exit handler) waits at most what is left of it for the pending
            save, so a preempted process exits within ``grace_s``.
        exit_on_preemption: True (default): the signal ends the process as
            its default action would, but as a normal exit (``SystemExit(128
            + signal)``, raised in the main thread once the manager call it
            interrupts, if any, has returned), so that ``with`` blocks and
            the exit handler commit the pending save. False: the signal only
            sets ``mgr.preempted``; the loop checks it and stops (``if
            mgr.preempted: mgr.save(step, ...); break``). A handler of the
            signal installed before the manager (yours, a framework's) is
            called after the manager's and decides instead.
        memory_tier: a :class:`MemoryTier` (``persist_every`` and the
            rest): saves that are not persistent go to the job's memory root
            in host shared memory, ordinary checkpoints that outlive the
            trainer; ``load()`` restores the freshest complete tier
            (docs/protocol.md, "Memory tier"). None (default): off.
    """

    keep_last: Optional[int] = None
    async_save: bool = False
    timeout: float = 600.0
    errors: str = "raise"
    block_size: int = DEFAULT_BLOCK_SIZE
    storage_options: Optional[Dict[str, Any]] = field(default=None, compare=False)
    local_staging_dir: Optional[str] = None
    fallback_sync: bool = False
    overlap: bool = False
    staging_budget_bytes: Optional[int] = None
    check_replicas: Optional[bool] = None
    export: Optional[ExportTarget] = None
    max_write_rate: Optional[float] = None
    incremental: bool = False
    full_every: Optional[int] = None
    shared_loads: bool = True
    read_once: Optional[bool] = None
    preemption_signal: Optional[int] = signal.SIGTERM
    grace_s: float = 30.0
    exit_on_preemption: bool = True
    memory_tier: Optional["MemoryTier"] = None

    def __post_init__(self) -> None:
        if self.keep_last is not None:
            _positive_int("keep_last", self.keep_last)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.errors not in ("raise", "log"):
            raise ValueError(f"errors must be 'raise' or 'log', got {self.errors!r}")
        check_block_size(self.block_size)
        if self.export is not None and not isinstance(self.export, ExportTarget):
            raise ValueError(f"export must be None or an export target (nostall.interop.hf_export.HFExport), got "
                             f"{type(self.export).__name__}")
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ValueError(f"storage_options must be a dict, got {type(self.storage_options).__name__}")
        if self.staging_budget_bytes is not None:
            _positive_int("staging_budget_bytes", self.staging_budget_bytes, 4 * self.block_size)
            # the area is mapped (and resident) in whole pages: a budget is a number of them
            object.__setattr__(self, "staging_budget_bytes",
                               self.staging_budget_bytes - self.staging_budget_bytes % mmap.PAGESIZE)
        object.__setattr__(self, "timeout", float(self.timeout))
        if not isinstance(self.shared_loads, bool):
            raise ValueError(f"shared_loads must be True or False, got {self.shared_loads!r}")
        if self.read_once is not None and not isinstance(self.read_once, bool):
            raise ValueError(f"read_once must be None, True or False, got {self.read_once!r}")
        if self.check_replicas is not None and not isinstance(self.check_replicas, bool):
            raise ValueError(f"check_replicas must be None, True or False, got {self.check_replicas!r}")
        if self.max_write_rate is not None and (isinstance(self.max_write_rate, bool)
                                                or not isinstance(self.max_write_rate, (int, float))
                                                or not self.max_write_rate >= 1 << 20):
            raise ValueError(f"max_write_rate must be None or a number of bytes per second of at least 1 MiB/s "
                             f"(1048576), got {self.max_write_rate!r}")
        if self.full_every is not None:
            _positive_int("full_every", self.full_every)
        if self.preemption_signal is not None:
            object.__setattr__(self, "preemption_signal", check_preemption_signal(self.preemption_signal))
        if isinstance(self.grace_s, bool) or not isinstance(self.grace_s, (int, float)) or not self.grace_s > 0:
            raise ValueError(f"grace_s must be a positive number of seconds, got {self.grace_s!r}")
        object.__setattr__(self, "grace_s", float(self.grace_s))
        self._check_memory_tier()
        for name in ("async_save", "fallback_sync", "overlap", "incremental", "exit_on_preemption"):
            object.__setattr__(self, name, bool(getattr(self, name)))

    def _check_memory_tier(self) -> None:
        if self.memory_tier is not None:
            if not isinstance(self.memory_tier, MemoryTier):
                raise ValueError(f"memory_tier must be None or a nostall.MemoryTier, got {self.memory_tier!r}")
            if self.incremental:
                raise ValueError("memory_tier and incremental cannot be combined: an incremental save would reuse "
                                 "pieces across the two roots; drop one of them")

    def but(self, **changes: Any) -> "Options":
        """A copy with ``changes`` applied (and validated)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class MemoryTier:
    """The memory tier's settings (``Options.memory_tier``; docs/protocol.md, "Memory tier").

    Args:
        persist_every: ``save(step)`` (without ``path=``) goes to the
            persistent root when ``step % persist_every == 0``, and to the
            job's memory root otherwise: an ordinary checkpoint (same files,
            checksums, manifest and commit) in host shared memory, which
            outlives the trainer (a crash, a ``torchrun`` restart on the same
            host). On several hosts, each host's snapshots are replicated on
            a peer host (``peer_jump``).
        keep: committed memory snapshots kept per rank (1 or 2); the tier
            holds at most this many plus the one being written.
        idle_s: the holder releases the tier once no manager was attached for
            this long (a job that crashed and was not restarted).
        memory_dir: the tmpfs directory it lives under (None: ``/dev/shm``).
        peer_jump: with ranks on several hosts (numbered by their lowest
            rank), host ``h``'s snapshots are replicated on host
            ``(h + peer_jump) % hosts`` (NVRx's ``replication_jump``: space it
            by the failure blast radius); a jump that maps a host to itself is
            refused when the job starts.
        peer_bytes_per_s: the pace at which a holder streams a replica to its
            peer (bytes per second; None: as fast as the link goes).

    >>> MemoryTier(persist_every=100).keep
    1
    >>> MemoryTier(persist_every=100, keep=3)
    Traceback (most recent call last):
    ...
    ValueError: MemoryTier keep must be 1 or 2, got 3
    """

    persist_every: int
    keep: int = 1
    idle_s: float = 600.0
    memory_dir: Optional[str] = None
    peer_jump: int = 1
    peer_bytes_per_s: Optional[float] = None

    def __post_init__(self) -> None:
        _positive_int("MemoryTier persist_every", self.persist_every)
        _positive_int("MemoryTier peer_jump", self.peer_jump)
        rate = self.peer_bytes_per_s
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0):
            raise ValueError(f"MemoryTier peer_bytes_per_s must be None or a positive number, got {rate!r}")
        if isinstance(self.keep, bool) or self.keep not in (1, 2):
            raise ValueError(f"MemoryTier keep must be 1 or 2, got {self.keep!r}")
        if isinstance(self.idle_s, bool) or not isinstance(self.idle_s, (int, float)) or not self.idle_s > 0:
            raise ValueError(f"MemoryTier idle_s must be a positive number of seconds, got {self.idle_s!r}")
        object.__setattr__(self, "idle_s", float(self.idle_s))
        if self.memory_dir is not None and not isinstance(self.memory_dir, str):
            raise ValueError(f"MemoryTier memory_dir must be None or a directory path (str), got {self.memory_dir!r}")


class NotGiven(enum.Enum):
    """The type of :data:`NOT_GIVEN`: "this keyword argument was not passed" (its value is Options')."""

    NOT_GIVEN = "NOT_GIVEN"

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN = NotGiven.NOT_GIVEN
"""Default of every option keyword argument: the setting's value comes from ``options=`` or Options' default."""

_FIELDS = frozenset(f.name for f in fields(Options))


def options_from(options: Optional[Options], given: Mapping[str, Any], where: str) -> Options:
    """The Options of a call that takes them as keyword arguments (``given``) or as ``options=``.

    ``given`` maps setting names to the keyword arguments' values; those
    that are :data:`NOT_GIVEN` are not counted. Without ``options``: an
    Options of the given settings (the others at their defaults). With
    ``options``: it, as it is; a setting given beside it too is refused with
    a ``TypeError`` naming it (as Python refuses an argument given twice),
    because ``options`` already holds every setting: change one with
    ``options.but(name=value)``.

    >>> options_from(None, {"keep_last": 2, "timeout": NOT_GIVEN}, "f()").keep_last
    2
    >>> options_from(Options(), {"keep_last": 2}, "f()")
    Traceback (most recent call last):
    ...
    TypeError: f(): keep_last given twice, as keyword argument and in options= (options.but(keep_last=...) changes one)
    """
    named = {k: v for k, v in given.items() if v is not NOT_GIVEN}
    unknown = sorted(set(named) - _FIELDS)
    if unknown:
        raise TypeError(f"{where}: not settings of Options: {', '.join(unknown)}")
    if options is None:
        return Options(**named)
    if not isinstance(options, Options):
        raise TypeError(f"{where}: options must be a nostall.Options, got {type(options).__name__}")
    if named:
        both = ", ".join(named)
        raise TypeError(f"{where}: {both} given twice, as keyword argument and in options= "
                        f"(options.but({next(iter(named))}=...) changes one)")
    return options
