"""Tools on top of the library: the ``nostall`` command line (:mod:`.cli`), the benchmarks
(:mod:`.bench`) and the reference trainer and demo (:mod:`.reference`). Nothing below imports them.
"""
