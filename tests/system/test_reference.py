"""The reference trainer: exact resume for each loop and layout, TP2 -> TP1, end-of-training finalize.

Every run is a real multi-rank job (gloo, persistent rank pools). Resume is
checked bit for bit: a run of 2N steps stopped after N and resumed from the
latest checkpoint produces exactly the losses of an uninterrupted 2N-step run.
"""

from __future__ import annotations

import os

import pytest
import torch

N = 4  # steps before the interruption; runs are 2N steps


def _cfg(**kw):
    from nostall.tools.reference.model import GPTConfig
    from nostall.tools.reference.trainer import TrainConfig

    base = dict(steps=2 * N, ckpt_interval=2, keep_last=2, global_batch=8, prompt_len=4, gen_len=4,
                model=GPTConfig(seq_len=16, d_model=32, n_head=4, n_layer=2), timeout=60.0)
    base.update(kw)
    return TrainConfig(**base)


def _train(rank, world_size, kw):
    import torch

    from nostall.tools.reference.train import train

    torch.set_num_threads(1)
    return train(_cfg(**kw)).as_dict()


def _resume_roundtrip(pool, tmp_path, loop, tp, async_save):
    full = pool.run(_train, dict(loop=loop, tp=tp, ckpt_dir=str(tmp_path / "a"), async_save=async_save))
    first = pool.run(_train, dict(loop=loop, tp=tp, ckpt_dir=str(tmp_path / "b"), async_save=async_save,
                                  stop_after=N + 1))
    # the trainer's marker names the last committed step (N), not the step the run stopped at
    from nostall.tools.reference.trainer import read_marker

    marker = read_marker(str(tmp_path / "b"))  # written by rank 0 before its run() returned
    assert marker["step"] == N and marker["loop"] == loop
    assert marker["checkpoint"] == str(tmp_path / "b" / f"step_{N}")
    second = pool.run(_train, dict(loop=loop, tp=tp, ckpt_dir=str(tmp_path / "b"), async_save=async_save,
                                   resume="latest"))
    ref = {int(k): v for k, v in full[0]["losses"].items()}
    assert sorted(ref) == list(range(1, 2 * N + 1))
    # the interrupted run trained one step past its last checkpoint (step N): that step is lost
    assert second[0]["resumed_from"] == N
    got = {int(k): v for k, v in second[0]["losses"].items()}
    assert sorted(got) == list(range(N + 1, 2 * N + 1))
    for s in got:
        assert got[s] == ref[s], f"{loop}: step {s} loss {got[s]!r} after resume, {ref[s]!r} uninterrupted"
    before = {int(k): v for k, v in first[0]["losses"].items()}
    assert all(before[s] == ref[s] for s in before)
    # every rank saw the same DP-averaged losses
    for r in second[1:]:
        assert r["losses"] == second[0]["losses"]
    # training actually moved (an RL loss is 0 when a batch's rewards tie, so not every step differs)
    assert len(set(ref.values())) > len(ref) // 2
    return full, second


@pytest.mark.parametrize("loop", ["sft", "sync_rl", "async_rl"])
def test_exact_resume_tp2(pool2, tmp_path, loop):
    full, second = _resume_roundtrip(pool2, tmp_path, loop, tp=2, async_save=True)
    saves = [s["step"] for s in full[0]["saves"]]
    assert saves == [2, 4, 6, 8] and all(s["async"] for s in full[0]["saves"])
    # keep_last=2: only the two newest checkpoints remain, and the trainer's marker
    assert sorted(os.listdir(tmp_path / "a")) == [".tmp", "latest", "step_6", "step_8", "trainer_marker.json"]
    from nostall.tools.reference.trainer import read_marker

    assert read_marker(str(tmp_path / "a"))["step"] == 2 * N  # moved by the last save's commit callback


@pytest.mark.parametrize("loop", ["sft", "sync_rl", "async_rl"])
def test_exact_resume_tp2_dp2(pool4, tmp_path, loop):
    _resume_roundtrip(pool4, tmp_path, loop, tp=2, async_save=loop != "sft")


def _resume_state(rank, world_size, kw):
    """Load a checkpoint into a fresh trainer; return the full (TP-gathered) model and Adam state."""
    import torch

    from nostall.tools.reference.parallel import gather_full_state
    from nostall.tools.reference.trainer import Trainer

    torch.set_num_threads(1)
    t = Trainer(_cfg(**kw))
    try:
        step = t.resume()
        loss = t.train_step()
        t2 = Trainer(_cfg(**kw))  # a second, untouched copy of the loaded state
        t2.resume()
        model = gather_full_state(t2.model, t2.groups)
        exp_avg = {}
        names = {id(p): n for n, p in t2.model.named_parameters()}
        for p, st in t2.optimizer.state.items():
            exp_avg[names[id(p)]] = st["exp_avg"].clone()
        lay = t2.layout
        t2.close()
        return step, loss, model, exp_avg, (lay.tp_rank, lay.tp_size), t.loader.state_dict()
    finally:
        t.close()


def test_tp2_checkpoint_resumes_on_tp1(pool2, tmp_path):
    d = str(tmp_path / "c")
    full = pool2.run(_train, dict(loop="sft", tp=2, ckpt_dir=str(tmp_path / "ref"), steps=N + 1))
    pool2.run(_train, dict(loop="sft", tp=2, ckpt_dir=d, steps=N, async_save=True))
    on_tp2 = pool2.run(_resume_state, dict(loop="sft", tp=2, ckpt_dir=d, resume="latest"))
    on_tp1 = pool2.run(_resume_state, dict(loop="sft", tp=1, ckpt_dir=d, resume="latest"))
    assert on_tp1[0][0] == on_tp2[0][0] == N
    assert on_tp1[0][4] == (0, 1) and on_tp2[0][4] == (0, 2)
    # TP=1 holds the whole weight: exactly the TP=2 shards put together
    for name, t in on_tp2[0][2].items():
        assert torch.equal(on_tp1[0][2][name], t), name
        assert torch.equal(on_tp1[1][2][name], t), name
    # the optimizer state is resharded too (local exp_avg on TP=1 is the full tensor)
    up = "blocks.0.up.weight"
    shards = [r[3][up] for r in on_tp2]
    assert torch.equal(on_tp1[0][3][up], torch.cat(shards, dim=0))
    # the data loader continues at the same global position
    assert on_tp1[0][5] == on_tp2[0][5]
    # training continues: the first step after resume matches the uninterrupted TP=2 run up to summation order
    ref = full[0]["losses"][N + 1]
    assert on_tp1[0][1] == pytest.approx(ref, rel=1e-4)
    assert on_tp2[0][1] == ref


def _late_manual_save(rank, world_size, root):
    import torch

    from nostall.tools.reference.trainer import Trainer

    torch.set_num_threads(1)
    # no periodic saves; one save issued late (as a callback would), still in flight when training ends
    t = Trainer(_cfg(loop="sft", tp=2, ckpt_dir=root, ckpt_interval=0, save_at=(2 * N,), async_save=True))
    mgr = t.strategy.manager(root)
    mgr._faults.writer_delay_s = 1.5
    try:
        result = t.run()
        # checked before close(): run()'s own end-of-training finalize committed the save
        return result.saves, t.strategy.latest_step(root), sorted(os.listdir(root))
    finally:
        t.close()


def test_end_of_training_finalize_is_unconditional(pool2, tmp_path):
    root = str(tmp_path / "late")
    out = pool2.run(_late_manual_save, root)
    saves, latest, listing = out[0]
    assert [s["step"] for s in saves] == [2 * N]
    assert saves[0]["async"]
    assert latest == 2 * N
    assert f"step_{2 * N}" in listing


def _marker_around_a_failed_save(rank, world_size, root, async_save):
    """Save at step 2, a save at step 4 whose write fails (a full disk), a save at step 5; rank 0 reads the
    trainer's marker after each (written once finalize() returns)."""
    import torch

    from nostall.errors import CheckpointSaveError
    from nostall.tools.reference.trainer import Trainer, read_marker

    torch.set_num_threads(1)
    t = Trainer(_cfg(loop="sft", tp=2, ckpt_dir=root, ckpt_interval=0, async_save=async_save))
    seen, loader, error = [], {}, None
    try:
        for step in range(1, 6):
            t.train_step()
            if step not in (2, 4, 5):
                continue
            loader[step] = t.loader.state_dict()
            if step == 4:
                t.strategy.manager(root)._faults.writer_fault = "enospc"
            try:
                t.save_checkpoint()
                t.finalize()
            except CheckpointSaveError as e:
                error = (step, type(e).__name__)
            t.strategy.manager(root)._faults.writer_fault = None
            seen.append(read_marker(root))
        return seen, loader, error, t.strategy.latest_step(root)
    finally:
        t.close()


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_trainer_marker_moves_only_when_a_save_commits(pool2, tmp_path, async_save):
    root = str(tmp_path / "m")
    seen, loader, error, latest = pool2.run(_marker_around_a_failed_save, root, async_save)[0]
    assert error == (4, "CheckpointSaveError") and latest == 5
    assert loader[2] != loader[4]
    after2, after_failed4, after5 = seen
    assert after2 == {"step": 2, "loop": "sft", "loader": loader[2], "checkpoint": os.path.join(root, "step_2")}
    assert after_failed4 == after2  # the failed save never reached the callback
    assert after5 == {"step": 5, "loop": "sft", "loader": loader[5], "checkpoint": os.path.join(root, "step_5")}


def test_trainer_marker_on_object_storage(s3, tmp_path):
    """The marker of a ckpt_dir on s3:// is one object, replaced by one PUT."""
    from nostall.tools.reference.trainer import read_marker, write_marker

    root = f"s3://{s3.make_bucket('marker')}/run"
    assert read_marker(root, s3.storage_options) is None
    write_marker(root, {"step": 2, "loader": {"epoch": 0, "index": 2}}, s3.storage_options)
    write_marker(root, {"step": 4, "loader": {"epoch": 0, "index": 4}}, s3.storage_options)
    assert read_marker(root, s3.storage_options) == {"step": 4, "loader": {"epoch": 0, "index": 4}}
    assert [p.rsplit("/", 1)[-1] for p in s3.filesystem().ls("marker/run", refresh=True)] == ["trainer_marker.json"]
