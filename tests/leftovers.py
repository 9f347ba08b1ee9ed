"""What a retention cut short legitimately leaves under a POSIX checkpoint root, and the check that nothing
else is there.

Retention retires a checkpoint first (its manifest renamed to ``.retired-<id>.json``, proven by the mark
``.tmp/retired-<id>.nostall`` made before the rename), then deletes the files it lists, then that manifest,
then the directory, then the mark. A process killed in between leaves a ``step_<N>`` that is no checkpoint
(not listed by ``steps()``, never ``latest``); the next job that claims the root (a manager on it: a job that
saves) finishes the collection. A job that only loads never claims the root and leaves it as it is.
"""

from __future__ import annotations

import os
from typing import Any, List

from nostall.storage.posix import PosixRoot
from nostall.storage.root import RETIRED_MARK_RE, TMP_DIR, retired_proof


def proven_retired(root: str, name: str) -> bool:
    """Whether ``root/name`` is a retirement cut short: it holds a retired manifest whose proof mark in ``.tmp``
    names it, or it is empty and a proof mark names it (cut after its last retired manifest went, before the
    directory did)."""
    d = os.path.join(root, name)
    entries = os.listdir(d)
    tmp = os.path.join(root, TMP_DIR)
    for mark in os.listdir(tmp) if os.path.isdir(tmp) else []:
        m = RETIRED_MARK_RE.match(mark)
        if m is None:
            continue
        with open(os.path.join(tmp, mark), "rb") as fh:
            if fh.read() != retired_proof(m.group(1), name):
                continue
        if not entries or f".retired-{m.group(1)}.json" in entries:
            return True
    return False


def retired_left(root: str, context: Any = None) -> List[str]:
    """The ``step_<N>`` directories under ``root`` that are no checkpoint, each checked to be a retirement cut
    short (:func:`proven_retired`) and not listed as a step; fails naming it (and ``context``) otherwise."""
    r = PosixRoot(root)
    steps = r.steps()
    left = []
    for n in sorted(os.listdir(root)):
        if n.startswith("step_") and not r.is_checkpoint(n):
            entries = sorted(os.listdir(os.path.join(root, n)))
            assert proven_retired(root, n), (f"{n} is neither a checkpoint nor a proven retired one", entries, context)
            assert int(n[len("step_"):]) not in steps, (n, steps, context)
            left.append(n)
    return left
