"""The load path: reading a checkpoint back into a state (:mod:`.reader`), and checking one."""
