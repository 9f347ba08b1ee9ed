"""The storage layer: everything that touches storage. The root contract (:mod:`.root`), its POSIX
and object-storage implementations (:mod:`.posix`, :mod:`.objects`), finding a root or checkpoint
from a location (:mod:`.locate`), file I/O (:mod:`.files`) and fsspec access (:mod:`.remote`).
"""
