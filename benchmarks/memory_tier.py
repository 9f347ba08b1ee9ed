"""The memory tier (issue 27): restore after a trainer crash, per tier, beside DCP; ``nostall bench``'s restore section.

    .venv/bin/python benchmarks/memory_tier.py [--mb 256] [--ranks 1] [--rounds 3] [--memory-dir DIR] [--json FILE]

A thin caller of ``nostall bench`` (``nostall.tools.bench.restore``; docs/benchmarks.md,
"Restore per tier"): only the copy and write limits and the restore section run. The
ranks save their state to the persistent root, to the memory tier and with DCP, and
leave as crashed trainers; fresh processes restore it (start-up timed apart): the
memory tier (their first load), then ``--rounds`` times the memory tier again, the
persistent checkpoint of the same bytes, DCP's load and a memcpy of the rank's bytes.

What a memory save costs a training loop is ``nostall bench train`` (system
``nostall_memory``), e.g. ``nostall bench train --compute device --every 10
--systems nostall_memory,nostall_async``.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from nostall.tools.bench import compare


def main(argv: Optional[List[str]] = None) -> int:
    """Parse this script's options and run ``nostall bench`` with the restore section alone."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="MiB of state per rank (default: %(default)s)")
    ap.add_argument("--ranks", type=int, default=1, help="gloo ranks (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of each load (default: %(default)s)")
    ap.add_argument("--memory-dir", default=None, help="the memory tier's tmpfs directory (default: /dev/shm)")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    a = ap.parse_args(argv)
    args = ["--ranks", str(a.ranks), "--mb-per-rank", str(a.mb), "--reps", str(a.rounds), "--systems", "",
            "--no-load", "--no-train", "--small-mb", "", "--restore"]
    args += ["--memory-dir", a.memory_dir] if a.memory_dir else []
    args += ["--json", a.json] if a.json else []
    return compare.main(args)


if __name__ == "__main__":
    sys.exit(main())
