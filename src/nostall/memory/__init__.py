"""The memory tier (issue 27): checkpoints in host memory that outlive the trainer, replicated across hosts.

A memory checkpoint is an ordinary checkpoint (same save id, files, checksums,
manifest and commit) in a *memory root*: a checkpoint root in tmpfs, one per
job and host, whose lifetime a per-host *holder* process owns
(docs/protocol.md, "Memory tier"; docs/reliability.md, "Tiers").

- :mod:`nostall.memory.rendezvous`: names (the memory root, the holder's mark
  and socket), finding a holder it can prove nostall made, or starting one.
- :mod:`nostall.memory.holder`: the holder process (torch-free).
- :mod:`nostall.memory.wire`: the holders' framed, checksummed, authenticated
  TCP messages between hosts.
- :mod:`nostall.memory.peers`: hosts, peers (``peer_jump``), replicas on the wire.
- :mod:`nostall.memory.roots`: the memory root of a job on several hosts
  (records held until the host's replica is acknowledged).
- :mod:`nostall.memory.relay`: a holder's part across hosts (replicate,
  forward the records, publish on every host).
- :mod:`nostall.memory.hosts`: the trainers' set-up across hosts (collective).
- :mod:`nostall.memory.tier`: the manager's side: where a save goes, the
  freshest complete tier on restore, releasing the holder at close.

This package does not import torch.
"""
