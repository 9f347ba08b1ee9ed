"""Benchmarks: nostall against other checkpointers (:mod:`.compare`), a training run
(:mod:`.train`), planning at scale (:mod:`.scale`) and incremental saves (:mod:`.incremental`).
"""
