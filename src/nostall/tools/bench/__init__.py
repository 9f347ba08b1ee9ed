"""Benchmarks: nostall against other checkpointers (:mod:`.compare`), a training run
(:mod:`.train`), planning at scale (:mod:`.scale`) and incremental saves (:mod:`.incremental`).

:func:`main` is the one entry point of ``nostall bench``: each benchmark has its own
argument table and ``main(argv)`` in its module, imported (with torch) only when run.
Helpers the benchmarks share are in :mod:`.common`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, List, Optional

MODES = {"train": "nostall.tools.bench.train", "scale": "nostall.tools.bench.scale",
         "incremental": "nostall.tools.bench.incremental"}
"""``nostall bench MODE ...``: the other benchmarks, each in its own module with its own ``main(argv)``."""

DEFAULT = "nostall.tools.bench.compare"
"""``nostall bench [OPTIONS]``: nostall side by side with DCP, torch.save and the machine's limits."""


def main(argv: Optional[List[str]] = None) -> int:
    """``nostall bench [MODE] ...``: run the benchmark MODE names (default: the comparison) with the rest.

    Ctrl-C: the benchmark's ranks stop quietly, and it returns 130."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in MODES:
        module, argv = MODES[argv[0]], argv[1:]
    else:
        module = DEFAULT
    run: Callable[[List[str]], int] = importlib.import_module(module).main
    try:
        return run(argv)
    except KeyboardInterrupt:  # Ctrl-C where a benchmark does not print its partial table itself
        print("nostall bench: interrupted", file=sys.stderr)
        return 130
