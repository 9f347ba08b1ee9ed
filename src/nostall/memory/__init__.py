"""The memory tier (issue 27, same-host slice): checkpoints in host shared memory that outlive the trainer.

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
- :mod:`nostall.memory.tier`: the manager's side: where a save goes, the
  freshest complete tier on restore, releasing the holder at close.

This package does not import torch.
"""
