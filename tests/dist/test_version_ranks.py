"""Issue 27: one rank's writer runs other nostall code (say one host was reinstalled under the job).

Two gloo ranks (``run_ranks``); rank 1's writer claims other code
(``NOSTALL_TEST_WRITER_CODE``, read only in a writer process). The refusal is
reported in the save's collective rounds, so every rank raises the same
:class:`~nostall.WriterVersionError` naming rank 1 at that save, nothing is
written, and the ranks stay in step: the next save fails the same way on both
(before the fix, rank 0 waited out the timeout for rank 1's record, and the
next save's collectives fell out of step). No time is asserted; the manager's
timeout is far above what the test takes, so a wait for it shows as a
``CheckpointTimeoutError``, not as a slow test.
"""

from __future__ import annotations

import os

import torch

from tests.dist_harness import run_ranks

BOUND_S = 120.0  # only a hang reaches it


def _body(rank, world_size, root):
    import nostall
    from nostall.core.faults import TOKEN_ENV

    if rank == 1:
        os.environ[TOKEN_ENV] = "0.0.0+0123456789abcdef"  # read by the writer this manager starts
    out = []
    with nostall.CheckpointManager(root, async_save=True, timeout=BOUND_S) as mgr:
        for step in (1, 2):
            state = {"w": nostall.ShardedTensor(torch.ones(10) * rank, (20,), (rank * 10,))}
            try:
                mgr.save(step, state).result(timeout=BOUND_S)
                out.append((step, "ok", ""))
            except Exception as e:
                out.append((step, type(e).__name__, str(e)))
        out.append(("steps", mgr.steps(), ""))
    return out


def test_a_refused_writer_fails_the_save_on_every_rank_alike(tmp_path):
    root = str(tmp_path / "run")
    results = run_ranks(2, _body, root, timeout=BOUND_S * 3)
    for rank, out in enumerate(results):
        for step, kind, msg in out[:2]:
            assert kind == "WriterVersionError", (rank, step, kind, msg)
            assert f"save of step {step} failed on rank(s) [1]" in msg and "0.0.0+0123456789abcdef" in msg
            assert "Restart the job" in msg
        assert out[2][1] == [], out
    assert not os.path.exists(os.path.join(root, "step_1"))
