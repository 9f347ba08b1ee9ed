"""The trainers' side of a memory tier on several hosts: the set-up at a manager's creation (collective).

docs/protocol.md, "Memory tier", "Several hosts: the commit rule", step 1.
Rank 0 draws the job's secret; the ranks all-gather it with the address
their host is reached on; each rank hands its holder the secret and address
(``listen``: the holder answers the TCP port it listens on), the ranks
all-gather the ports, and each rank gives its holder the host table
(``peers``). Every step that can fail on one rank is followed by an
exchange of errors, so every rank raises the same :class:`MemoryTierError`
and none waits. This module does not import torch.
"""

from __future__ import annotations

import os
from typing import Any, Hashable, List, Optional, Sequence

from nostall.memory.peers import HostTable, check_jump, number_hosts, reachable_address
from nostall.memory.rendezvous import HolderLink, MemoryTierError
from nostall.memory.roots import MemoryRoot
from nostall.memory.wire import new_secret
from nostall.options import MemoryTier

__all__ = ["join_hosts"]


def _raise_any(every: Sequence[Any], what: str) -> None:
    errors = [e for e in every if e]
    if errors:
        raise MemoryTierError(f"the memory tier across hosts cannot start ({what}): {'; '.join(errors)}")


def join_hosts(comm: Any, link: HolderLink, idents: Sequence[Hashable], settings: MemoryTier, root_path: str,
               timeout: float) -> Optional[MemoryRoot]:
    """Set up the holders of a job whose ranks run on several hosts (collective over ``comm``, a
    :class:`~nostall.planning.comm.Comm`); None on one host (nothing to set up). ``idents``: every rank's host
    identity, all-gathered already."""
    host_of = number_hosts(idents)
    hosts = max(host_of) + 1
    if hosts == 1:
        return None
    check_jump(settings.peer_jump, hosts)  # the same on every rank: raised alike
    me = host_of[comm.rank]
    error: Optional[str] = None
    addr = ""
    secret = new_secret() if comm.rank == 0 else ""
    try:
        addr = reachable_address(os.environ.get("MASTER_ADDR"))
    except MemoryTierError as e:
        error = f"rank {comm.rank}: {e}"
    every = comm.all_gather((error, addr, secret))
    _raise_any([e for e, _, _ in every], "finding each host's address")
    secret = every[0][2]
    port = -1
    try:
        got = link.ask({"op": "listen", "secret": secret, "addr": addr, "timeout": timeout}, timeout)
        if not got.get("ok") or not isinstance(got.get("port"), int):
            raise MemoryTierError(f"its holder (pid {link.pid}) cannot listen on {addr}: {got.get('error')}")
        port = got["port"]
    except MemoryTierError as e:
        error = f"rank {comm.rank} (host {me}): {e}"
    every = comm.all_gather((error, addr, port))
    _raise_any([e for e, _, _ in every], "listening for the other hosts' holders")
    first = {h: host_of.index(h) for h in range(hosts)}  # each host's lowest rank speaks for its holder
    table = HostTable(tuple(host_of), tuple((every[first[h]][1], every[first[h]][2]) for h in range(hosts)),
                      settings.peer_jump)
    try:
        got = link.ask({"op": "peers", "table": table.to_doc(), "host": me, "keep": settings.keep,
                        "rate": settings.peer_bytes_per_s, "timeout": timeout}, timeout)
        if not got.get("ok"):
            raise MemoryTierError(f"its holder (pid {link.pid}) refused the host table: {got.get('error')}")
    except MemoryTierError as e:
        error = f"rank {comm.rank} (host {me}): {e}"
    _raise_any(comm.all_gather(error), "giving the holders the host table")
    own: List[int] = table.ranks_of(me)
    return MemoryRoot(root_path, set(own), set(own) | set(table.ranks_of(table.source(me))))
