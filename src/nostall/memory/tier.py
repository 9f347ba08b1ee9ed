"""The manager's side of the memory tier: where a save goes, the freshest complete tier on restore, release.

docs/protocol.md, "Memory tier". One :class:`Tiers` per manager with
``Options.memory_tier``: it attaches to the job's holder on this host
(starting it if none runs), sets up the holders of a job on several hosts
(:mod:`nostall.memory.hosts`: replicas on peer hosts), claims the memory
root on rank 0 (which removes what a crashed memory save left there),
routes the saves that are not persistent to the memory root, and at restore
picks the newest step complete in the memory tier (on every rank's host, or
across hosts) when it is newer than the persistent root's latest. For the
last save on preemption it tells the holder (rank 0) where the persistent
root is, with its lock, and reports the preemption signal to the holder
(:meth:`Tiers.watch`). This module does not import torch.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from nostall.core.jobs import Destination
from nostall.errors import CheckpointLoadError
from nostall.memory.hosts import join_hosts
from nostall.memory.roots import MemoryRoot
from nostall.memory.rendezvous import (HolderLink, MemoryTierError, base_dir, connect, ensure_holder, job_id,
                                       job_key)
from nostall.options import Options
from nostall.planning.comm import Comm
from nostall.storage.posix import PosixRoot
from nostall.storage.files import lstat_beneath
from nostall.storage.root import Claim, listed, step_name

log = logging.getLogger("nostall")

__all__ = ["Tiers", "Restored", "MemoryTierError"]


@dataclass(frozen=True)
class Restored:
    """How one rank's last ``load()`` of a manager with a memory tier went (``mgr.last_restore``).

    ``tier``: ``"memory"`` (this rank's host held every file of the step), ``"peer"`` (several hosts: some
    of its pieces came from ranks whose host held them) or ``"persistent"``. ``bytes_read``: data-file
    bytes this rank read from that tier (None when the load does not say: a
    state-dict load). ``persistent_bytes_read``: those read from the
    persistent root (0 for a memory restore: its data files are not opened).
    ``seconds``: the load, agreement included (not the process start-up).
    ``bytes_received``: data-file bytes other ranks read and sent (a ``"peer"`` restore; None when the load
    does not say). ``fell_back``: why the memory checkpoint was refused, on which rank(s),
    when the restore fell back to the persistent root.
    """

    tier: str
    step: Optional[int]
    path: str
    bytes_read: Optional[int]
    persistent_bytes_read: Optional[int]
    seconds: float
    fell_back: Optional[str] = None
    bytes_received: Optional[int] = None


def _host_identity(base: str) -> Tuple[str, str, int, int]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    st = os.stat(base)
    return socket.gethostname(), boot, st.st_dev, st.st_ino


def complete_step(every: Sequence[Tuple[Optional[int], Optional[Tuple[List[str], List[str]]]]]
                  ) -> Tuple[Optional[int], bool]:
    """Several hosts: the newest memory step whose every listed file some rank's host holds (each rank's latest
    committed memory step, with the files its manifest lists and those held there), and whether some rank's
    host lacks files of it (a restore then needs its peers' copies). (None, False) when no step is complete.

    >>> full = (["rank0.safetensors", "rank1.safetensors"],) * 2
    >>> complete_step([(5, full), (None, None)])        # a replacement host: its files are held by the other
    (5, True)
    >>> complete_step([(5, full), (5, full)])
    (5, False)
    >>> complete_step([(5, (full[0], ["rank0.safetensors"])), (4, full)])
    (4, True)
    """
    for step in sorted({m for m, _ in every if m is not None}, reverse=True):
        holders = [h for m, h in every if m == step and h is not None]
        if not holders or not holders[0][0]:
            continue
        need = set(holders[0][0])
        held = set().union(*(set(h[1]) for h in holders))
        if need <= held:
            partial = any(m != step or h is None or set(h[1]) != need for m, h in every)
            return step, partial
    return None, False


class Tiers:
    """A manager's memory tier (collective to create: every rank of ``comm``).

    ``lock_fd``: rank 0's descriptor of the persistent root's lock (POSIX; None: none), handed to the holder
    for the last save on preemption."""

    def __init__(self, options: Options, root_url: str, comm: Comm, lock_fd: Optional[int] = None) -> None:
        settings = options.memory_tier
        assert settings is not None
        self.settings = settings
        self.comm = comm
        self.persist_every = settings.persist_every
        self._timeout = options.timeout
        self._claim: Optional[Claim] = None
        self._proc: Optional[subprocess.Popen] = None
        self._link: Optional[HolderLink] = None
        self._drops = comm.rank == 0  # this rank drops the snapshots newer than a step loaded, on its host
        self.multi = False  # ranks on several hosts (a MemoryRoot per host, replicas on peers)
        self.partial = False  # the last freshest(): some rank's host lacks files of the memory step
        self._complete_here = True  # ... and whether this rank's host holds every file of it
        self._wake: Optional[socket.socket] = None  # the connection that reports the preemption signal
        self._wakeup_fd = False  # it is this process's signal wakeup fd
        self._handler: Any = None  # the manager's preemption handler, while it notifies the holder
        error: Optional[str] = None
        ident: Any = None
        try:
            base = base_dir(settings.memory_dir)
            key = job_key(root_url, job_id())
            self._link, self._proc = ensure_holder(base, key, settings.idle_s, options.timeout)
            attach, fds = _attach(options, root_url, comm.rank, lock_fd)
            got = self._link.ask(attach, options.timeout, fds)
            if got.get("root") != os.path.join(base, key):
                raise MemoryTierError(f"the holder (pid {self._link.pid}) serves {got.get('root')!r}, not "
                                      f"{os.path.join(base, key)!r}")
            self.root = PosixRoot(os.path.join(base, key))
            ident = _host_identity(base)
        except Exception as e:  # every rank must learn it: the others would wait in the exchange below
            error = f"rank {comm.rank}: {e}"
        try:
            every = comm.all_gather((error, ident)) if comm.size > 1 else [(error, ident)]
            errors = [e for e, _ in every if e]
            if errors:
                raise MemoryTierError(f"the memory tier (persist_every={self.persist_every}) cannot start: "
                                      f"{'; '.join(errors)}")
            idents = [i for _, i in every]
            assert self._link is not None  # (no error on any rank)
            multi = join_hosts(comm, self._link, idents, settings, self.root.url, options.timeout)
            if multi is not None:  # several hosts: records wait for the replica (docs/protocol.md, "Memory tier")
                self.root = multi
                self.multi = True
                self._drops = comm.rank == min(multi.own)
            if comm.rank == 0:
                claim = self.root.claim()  # also removes what a crashed memory save left in the memory root
                if not claim.held:
                    pid = self._link.pid if self._link else -1
                    raise MemoryTierError(f"rank 0: the memory root {self.root.url} (holder pid {pid}) "
                                          f"is in use by {claim.owner}: stop that job (or wait for it) before "
                                          "starting this one, or drop memory_tier")
                self._claim = claim
            log.info("rank %d: memory tier in %s (holder pid %d): a save is persistent every %d steps, in memory "
                     "otherwise", comm.rank, self.root.url, self._link.pid if self._link else -1, self.persist_every)
        except BaseException:
            self.close(release=False)  # a failed start keeps the snapshots it came to restore (idle bound)
            raise

    # ------------------------------------------------------------------ preemption
    def watch(self, handler: Any) -> None:
        """Report the preemption signal to the holder (docs/protocol.md, "A last save on preemption"): a wake
        connection whose descriptor is this process's signal wakeup fd (the byte is written by CPython's C-level
        handler, even while the main thread is stuck in a C call) when none is set and this is the main thread;
        else ``handler`` (the manager's :class:`~nostall.manager._Preemption`) writes it when Python runs it.
        A holder that cannot be reached is logged; the tier works on without the last save."""
        link = self._link
        signum = handler.signum
        if link is None:
            return
        try:
            wake = connect(link.base, link.key, self._timeout)
            if wake is None:
                raise MemoryTierError("no holder listens")
            wake.ask({"op": "wake", "rank": self.comm.rank, "signal": int(signum)}, 10.0)
        except (MemoryTierError, OSError) as e:
            log.warning("rank %d: the memory tier's holder will not learn of %s (%s): no last save on preemption",
                        self.comm.rank, signal.Signals(signum).name, e)
            return
        sock = wake.sock
        sock.setblocking(False)
        self._wake = sock
        if threading.current_thread() is threading.main_thread():
            old = signal.set_wakeup_fd(sock.fileno(), warn_on_full_buffer=False)
            if old == -1:
                self._wakeup_fd = True
                return
            signal.set_wakeup_fd(old, warn_on_full_buffer=False)  # someone else's (an event loop's): left to it
        log.debug("rank %d: the signal wakeup fd is taken (or this is not the main thread): the holder learns of %s "
                  "when Python runs the manager's handler (late while the main thread is in a long C call)",
                  self.comm.rank, signal.Signals(signum).name)
        self._handler = handler
        handler.notify = self._notify

    def _notify(self, signum: int) -> None:
        """From the manager's signal handler: one byte to the holder, never waiting, never raising."""
        sock = self._wake
        if sock is not None:
            try:
                sock.send(bytes([signum]))
            except OSError:
                pass

    def _unwatch(self) -> None:
        """close(): the wakeup fd put back (main thread), the handler's notification off, the connection closed.
        Where the wakeup fd cannot be put back (another thread), the descriptor is left open (never closed under
        CPython's handler, which would write into whatever reuses its number)."""
        if self._handler is not None:
            self._handler.notify = None
            self._handler = None
        sock, self._wake = self._wake, None
        if sock is None:
            return
        if self._wakeup_fd:
            self._wakeup_fd = False
            try:
                old = signal.set_wakeup_fd(-1)
            except ValueError:  # not the main thread
                log.debug("rank %d: the signal wakeup fd could not be put back here: its connection stays open",
                          self.comm.rank)
                sock.detach()
                return
            if old not in (-1, sock.fileno()):  # set by someone else after ours: theirs stays
                signal.set_wakeup_fd(old, warn_on_full_buffer=False)
        sock.close()

    # ------------------------------------------------------------------ saves
    def takes(self, step: Optional[int], path: Any) -> bool:
        """Whether ``save(step, path=path)`` goes to the memory tier."""
        return path is None and step is not None and step % self.persist_every != 0

    def destination(self, step: int) -> Destination:
        """The memory root's ``step_<N>``, moving its ``latest``, keeping ``memory_keep`` snapshots."""
        return Destination(self.root, step_name(step), step, "", move_latest=True, keep_last=self.settings.keep)

    def holds(self, path: str) -> bool:
        """Whether ``path`` (a save's checkpoint) is in the memory root."""
        return os.path.dirname(path) == self.root.url

    # ------------------------------------------------------------------ restore
    def restore(self, persistent_latest: Callable[[], Optional[int]], load_memory: Callable[[str], Any],
                load_persistent: Callable[[], Any],
                bytes_of: Callable[[Any], Tuple[Optional[int], Optional[int]]],
                path_of: Callable[[int], str],
                load_partial: Optional[Callable[[str], Any]] = None) -> Tuple[Any, Restored]:
        """Load from the freshest complete tier (collective): the memory root's latest committed step, the same
        on every rank, when it is newer than the persistent root's latest (rank 0's view of it), else the
        persistent root; a memory load that fails on any rank makes every rank fall back to the persistent
        root. Snapshots newer than the step restored are then dropped (:meth:`drop_newer`).

        Several hosts: the newest step complete across the hosts' memory roots (:func:`complete_step`); when
        some rank's host lacks files of it, every rank loads it with ``load_partial`` (each from its own host's
        copy, the pieces it lacks sent by ranks that hold them: tier ``"peer"`` on the ranks that lacked some),
        and without ``load_partial`` the persistent root is restored."""
        comm = self.comm
        t0 = time.perf_counter()
        step, latest = self.freshest(persistent_latest)
        fell_back: Optional[str] = None
        partial = self.partial
        if step is not None and step != latest and partial and load_partial is None:
            fell_back = (f"memory step {step} is complete only across hosts (a host lacks some of its files) and "
                         "this load cannot take pieces from peers")
            log.warning("rank %d: %s: restoring from the persistent root (latest: %s)", comm.rank, fell_back, latest)
            step = latest
        if step is not None and step != latest:
            path = self.root.path(step_name(step))
            error: Optional[str] = None
            result: Any = None
            tier = "peer" if partial and not self._complete_here else "memory"
            made: Optional[str] = None
            try:
                if partial and load_partial is not None:
                    path, made = self._own_copy(step)
                    result = load_partial(path)
                else:
                    result = load_memory(path)
            except Exception as e:  # any failure: every rank must agree before falling back
                error = f"rank {comm.rank}: {type(e).__name__}: {e}"
            finally:
                if made is not None:
                    assert isinstance(self.root, MemoryRoot)
                    self.root.drop_replica_dir(made)
            errors = [e for e in (comm.all_gather(error) if comm.size > 1 else [error]) if e]
            if not errors:
                read, received = bytes_of(result)
                if received is not None:  # the load says: a rank that received nothing read only its own host's
                    tier = "peer" if received > 0 else "memory"
                restored = Restored(tier, step, path, read, 0, time.perf_counter() - t0, bytes_received=received)
                log.info("rank %d: restored step %d from the memory tier (%s, %s) in %.3fs, 0 bytes from the "
                         "persistent root", comm.rank, step, tier, path, restored.seconds)
                self.drop_newer(step)
                return result, restored
            fell_back = "; ".join(errors)
            log.warning("rank %d: the memory checkpoint of step %d is refused (%s): restoring from the persistent "
                        "root (latest: %s)", comm.rank, step, fell_back, latest)
            if latest is None:
                raise CheckpointLoadError(f"the memory checkpoint of step {step} in {self.root.url} is refused "
                                          f"({fell_back}) and the persistent root has no checkpoint: nothing to "
                                          "restore; start from scratch")
        result = load_persistent()
        n, _ = bytes_of(result)
        where = path_of(latest) if latest is not None else ""
        if latest is not None:
            self.drop_newer(latest)
        return result, Restored("persistent", latest, where, n, n, time.perf_counter() - t0, fell_back)

    def freshest(self, persistent_latest: Callable[[], Optional[int]]) -> Tuple[Optional[int], Optional[int]]:
        """(the step a restore loads, the persistent root's latest), both None when there is nothing (collective).

        The step is the memory root's latest committed step (its ``latest``
        when that names a committed step, as a persistent load reads it; not
        the highest step number: a snapshot of an abandoned timeline may be
        higher) when every rank sees the same one and it is newer than the
        persistent root's latest (rank 0's view of it, the same on every
        rank), else that latest. An error on any rank is raised on every rank
        (each reaches the exchange with it).
        """
        comm = self.comm
        mine: Optional[int] = None
        latest: Optional[int] = None
        error: Optional[str] = None
        holding: Optional[Tuple[List[str], List[str]]] = None
        try:
            mine = self.root.latest_step()
            latest = persistent_latest() if comm.rank == 0 else None
            if self.multi and mine is not None:
                holding = self._holding(mine)
        except Exception as e:  # every rank must learn it: the others would wait in the exchange below
            error = f"rank {comm.rank}: {type(e).__name__}: {e}"
        every = comm.all_gather((mine, latest, error, holding)) if comm.size > 1 else [(mine, latest, error, holding)]
        errors = [e for _, _, e, _ in every if e]
        if errors:
            raise CheckpointLoadError(f"the freshest checkpoint of the memory tier ({self.root.url}) and the "
                                      f"persistent root cannot be found: {'; '.join(errors)}")
        latest = every[0][1]
        self.partial = False
        seen = {m for m, _, _, _ in every}
        if self.multi:
            memory, self.partial = complete_step([(m, h) for m, _, _, h in every])
            self._complete_here = mine == memory and holding is not None and set(holding[1]) == set(holding[0])
        else:
            if len(seen) > 1:
                log.warning("rank %d: the ranks see different latest memory steps (%s): the memory tier is not used "
                            "for this restore", comm.rank, sorted(seen, key=lambda m: -1 if m is None else m))
            memory = every[0][0] if len(seen) == 1 else None
        if memory is not None and (latest is None or memory > latest):
            return memory, latest
        self.partial = False
        return latest, latest

    def _own_copy(self, step: int) -> Tuple[str, Optional[str]]:
        """Several hosts, a restore of ``step`` that takes pieces from peers (collective): this rank's copy of the
        step: its host's ``step_N`` when that has the manifest, else a directory holding only the manifest
        (broadcast by the lowest rank whose host has it; :meth:`MemoryRoot.manifest_copy`), with its id to drop
        after the load."""
        root = self.root
        assert isinstance(root, MemoryRoot)
        name = step_name(step)
        try:
            raw = root.manifest_bytes(name) if step in root.steps() else None
        except Exception:  # (taken as absent here: every rank must reach the exchanges below)
            raw = None
        src = next((r for r, has in enumerate(self.comm.all_gather(raw is not None)) if has), -1)
        if src < 0:  # (the same on every rank)
            raise CheckpointLoadError(f"no host holds the manifest of memory step {step} any more")
        manifest = self.comm.broadcast(raw if self.comm.rank == src else None, src)
        if raw is not None:
            return root.path(name), None
        return root.manifest_copy(manifest)

    def _holding(self, step: int) -> Tuple[List[str], List[str]]:
        """(the files the manifest of memory step ``step`` lists, those this host holds: regular files of the
        listed size, nothing followed; stat only)."""
        name = step_name(step)
        m = self.root.manifest(name)
        if m is None:
            return [], []
        need = listed(m)
        sizes = {n: f.size for n, f in m.files.items()}
        have = []
        for n in need:
            st = lstat_beneath(self.root.path(name), n)
            if st is not None and stat.S_ISREG(st.st_mode) and (n not in sizes or st.st_size == sizes[n]):
                have.append(n)
        return need, have

    def drop_newer(self, step: int) -> None:
        """After a load restored ``step``: rank 0 deletes the committed memory snapshots newer than it (a timeline
        the job left: they must never be restored later, and retention keeps the highest steps). Only
        checkpoints nostall committed are deleted (``delete_step`` leaves anything else alone). Failures are
        logged, not raised: the load is done; such a snapshot stays below the memory root's ``latest``, which
        the next memory save moves."""
        if not self._drops:
            return
        try:
            newer = [s for s in self.root.steps() if s > step]
            for s in newer:
                self.root.delete_step(s)
        except Exception as e:
            log.warning("rank 0: could not drop the memory snapshots newer than step %d from %s: %s", step,
                        self.root.url, e)
            return
        if newer:
            log.info("rank 0: dropped the memory snapshots of steps %s (newer than step %d, which was loaded)", newer,
                     step)

    # ------------------------------------------------------------------ lifetime
    def close(self, release: bool = True, timeout: float = 10.0) -> None:
        """Release the root's claim and the holder (``release``: this rank's manager is done with the memory
        tier: the holder deletes it once every attached manager released it). Bounded; idempotent."""
        self._unwatch()
        if self._claim is not None:
            self._claim.release()
            self._claim = None
        link, self._link = self._link, None
        if link is not None:
            if release:
                try:
                    link.ask({"op": "release"}, timeout)
                except MemoryTierError as e:
                    log.warning("rank %d: could not release the memory tier: %s", self.comm.rank, e)
            link.close()
        proc, self._proc = self._proc, None
        if proc is not None:  # started by this process: reaped if it exits now (else it goes on for the others)
            try:
                proc.wait(0.5 if release else 0.0)
            except subprocess.TimeoutExpired:
                pass



def _attach(options: Options, root_url: str, rank: int, lock_fd: Optional[int]) -> Tuple[Dict[str, Any], List[int]]:
    """The ``attach`` message of a rank, and the descriptors it carries: rank 0's tells the holder where to persist
    on preemption (the persistent root, its ``storage_options``, ``grace_s``) and hands it the root's lock."""
    msg: Dict[str, Any] = {"op": "attach", "rank": rank, "pid": os.getpid()}
    if rank != 0 or options.preemption_signal is None:
        return msg, []
    so = options.storage_options
    try:
        json.dumps(so)
    except (TypeError, ValueError):
        log.warning("rank 0: the storage_options of %s are not JSON: the holder cannot write there, so there is no "
                    "last save on preemption from the memory tier", root_url)
        return msg, []
    msg["persist"] = {"root": root_url, "storage_options": so, "grace_s": options.grace_s}
    if lock_fd is None:
        return msg, []
    msg["lock"] = True
    return msg, [lock_fd]
