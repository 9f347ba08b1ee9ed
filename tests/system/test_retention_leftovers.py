"""A retention cut short stays until the next job that claims the root: a job that only loads leaves it.

The multihost host-kill test once found a retired ``step_N`` after its final job, which resumes and trains
without saving (``--ckpt-interval 0``): the reference trainer loads through ``Strategy.load_checkpoint``,
which opens no manager, so nothing claimed the root and nothing finished the retention the last kill had
cut short. That is the protocol (docs/protocol.md, "Crash outcomes": removed at the next start of a manager;
a load never claims the root, another job may be saving there). Here the same state is made on purpose:
rank 0's background writer is killed (``NOSTALL_TEST_CRASH``) right after retention retired ``step_1``.
"""

from __future__ import annotations

import os

from nostall.storage.posix import PosixRoot
from tests.dist_harness import run_ranks
from tests.leftovers import proven_retired, retired_left

TIMEOUT_S = 120.0


def _train(rank, world_size, root, steps, ckpt_interval, save_at, resume):
    """The reference trainer (TP=2 over the 2 ranks, async saves, keep_last=1); rank 0's run record."""
    import torch

    from nostall.tools.reference.model import GPTConfig
    from nostall.tools.reference.train import train
    from nostall.tools.reference.trainer import TrainConfig

    torch.set_num_threads(1)
    cfg = TrainConfig(steps=steps, ckpt_interval=ckpt_interval, save_at=tuple(save_at), resume=resume,
                      keep_last=1, async_save=True, ckpt_dir=root, global_batch=8,
                      model=GPTConfig(seq_len=16, d_model=32, n_head=2, n_layer=1), timeout=60.0)
    return train(cfg).as_dict()


def test_a_retention_cut_short_is_left_by_a_load_only_job_and_finished_by_the_next_save(tmp_path):
    root = str(tmp_path / "ckpts")
    # saves steps 1 and 2; after step 2's commit, rank 0's writer retires step_1 and is killed there
    run_ranks(2, _train, root, 2, 1, [], "none", timeout=TIMEOUT_S,
              env={"NOSTALL_TEST_CRASH": "writer:retain.moved:2"})
    r = PosixRoot(root)
    assert r.steps() == [2] and r.latest_step() == 2
    assert retired_left(root) == ["step_1"] and proven_retired(root, "step_1")

    # what the multihost test's final job does: resume from the latest, train on, save nothing
    out = run_ranks(2, _train, root, 4, 0, [], "latest", timeout=TIMEOUT_S)
    assert out[0]["resumed_from"] == 2 and sorted(int(s) for s in out[0]["losses"]) == [3, 4]
    # it never claimed the root: the retired step_1 is still there, still no checkpoint, never latest
    assert retired_left(root) == ["step_1"], sorted(os.listdir(root))
    assert r.steps() == [2] and r.latest_step() == 2

    # the next job that saves claims the root: it finishes the retention at its start
    out = run_ranks(2, _train, root, 5, 0, [5], "latest", timeout=TIMEOUT_S)
    assert out[0]["resumed_from"] == 2 and [s["step"] for s in out[0]["saves"]] == [5]
    assert retired_left(root) == []
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_5"]  # keep_last=1
    assert not [n for n in os.listdir(os.path.join(root, ".tmp")) if n.startswith("retired-")]
