"""Asynchronous saves in one process (no process group), and commit-protocol units."""

from __future__ import annotations

import os

import pytest
import torch

import nostall


def _state(v: float):
    return {"w": torch.full((64, 64), float(v)), "n": {"step": int(v)}}


def _tmpl():
    return {"w": torch.zeros(64, 64), "n": {}}


def test_async_single_process_round_trip(tmp_path):
    with nostall.CheckpointManager(tmp_path, async_save=True, keep_last=2) as mgr:
        pid = mgr.writer_pid
        assert pid is not None and os.path.exists(f"/proc/{pid}")
        handles = [mgr.save(s, _state(s)) for s in range(1, 6)]
        mgr.finalize_pending_saves()
        assert all(h.done() and h.exception() is None for h in handles)
        assert mgr.steps() == [4, 5] and mgr.latest_step() == 5
        out = mgr.load(_tmpl())
        assert out["n"] == {"step": 5} and torch.equal(out["w"], torch.full((64, 64), 5.0))
        assert [s.step for s in mgr.stats()] == [1, 2, 3, 4, 5]
        assert all(s.async_save and s.bytes_written > 0 for s in mgr.stats())
    # close stopped the writer and released the staging area
    assert not os.path.exists(f"/proc/{pid}")
    assert mgr._writer.area.fd is None


def test_polling_done_does_not_swallow_a_failure(tmp_path):
    mgr = nostall.CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, _state(1)).result()
    mgr._faults.writer_fault = "enospc"
    h = mgr.save(2, _state(2))
    while not h.done():  # polling the handle observes the failure...
        pass
    assert isinstance(h.exception(), nostall.CheckpointSaveError)
    repr(h)
    mgr._faults.writer_fault = None
    with pytest.raises(nostall.CheckpointSaveError, match="step 2"):  # ...and the next save still raises it
        mgr.save(3, _state(3))
    mgr.save(3, _state(3)).result()
    assert mgr.steps() == [1, 3]
    mgr.close()


def test_result_reports_a_failure_once(tmp_path):
    mgr = nostall.CheckpointManager(tmp_path, async_save=True)
    mgr._faults.writer_fault = "enospc"
    h = mgr.save(1, _state(1))
    with pytest.raises(nostall.CheckpointSaveError, match="No space left"):
        h.result()
    mgr._faults.writer_fault = None
    mgr.save(2, _state(2)).result()  # the caller saw the error already: not raised again
    assert mgr.steps() == [2]
    mgr.close()


def test_close_raises_a_pending_failure_after_releasing_everything(tmp_path):
    mgr = nostall.CheckpointManager(tmp_path, async_save=True)
    pid = mgr.writer_pid
    mgr._faults.writer_fault = "enospc"
    mgr.save(1, _state(1))
    with pytest.raises(nostall.CheckpointSaveError):
        mgr.close()
    assert not os.path.exists(f"/proc/{pid}")
    mgr.close()  # idempotent
    assert mgr.latest_step() is None


def test_staging_failure_is_reported_at_the_next_call(tmp_path):
    mgr = nostall.CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, _state(1)).result()

    def boom(*a, **k):
        raise RuntimeError("device lost")

    mgr._writer.area.stage = boom
    h = mgr.save(2, _state(2))  # returns: the failure is reported like any other
    with pytest.raises(nostall.CheckpointSaveError, match="staging step 2 failed.*device lost"):
        mgr.finalize_pending_saves()
    assert isinstance(h.exception(), nostall.CheckpointSaveError)
    del mgr._writer.area.stage
    mgr.save(3, _state(3)).result()
    assert mgr.steps() == [1, 3]
    mgr.close()


def test_prepare_allocates_once(tmp_path):
    with nostall.CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.prepare(_state(0))
        area = mgr._writer.area
        gen, size = area.generation, area.size
        assert size >= 64 * 64 * 4
        for s in range(5):
            mgr.save(s, _state(s))
        mgr.finalize_pending_saves()
        assert (area.generation, area.size) == (gen, size)
        # a bigger state grows the area once
        big = {"w": torch.ones(1024, 1024), "n": {"step": 9}}
        mgr.save(9, big).result()
        assert area.generation == gen + 1 and area.size >= 1024 * 1024 * 4
        mgr.save(10, big).result()
        assert area.generation == gen + 1


def test_fresh_optimizer_template_gets_a_helpful_error(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    nostall.save({"opt": opt.state_dict()}, tmp_path / "c")
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())
    with pytest.raises(nostall.CheckpointLoadError, match="holds tensors under it.*load\\(model=..., optimizer=...\\)"):
        nostall.load({"opt": fresh.state_dict()}, tmp_path / "c")


def test_commit_refuses_missing_or_short_data_files(tmp_path):
    from nostall.core.jobs import Destination
    from nostall.storage.posix import PosixRoot

    root = PosixRoot(str(tmp_path))
    root.claim().release()
    dest = Destination(root, "step_1", 1, "a" * 32, move_latest=True)
    root.make_staging(dest)
    staging = root.open_staging(dest, 0)
    with open(os.path.join(staging, "rank0.safetensors"), "wb") as f:
        f.write(b"x" * 10)
    with pytest.raises(nostall.CheckpointSaveError, match="rank1.safetensors is missing"):
        root.check_files(dest, {"rank0.safetensors": 10, "rank1.safetensors": 5})
    with pytest.raises(nostall.CheckpointSaveError, match="has 10 bytes"):
        root.check_files(dest, {"rank0.safetensors": 11})
    root.abort(dest)
    assert not (tmp_path / "step_1").exists() and os.listdir(tmp_path / ".tmp") == [".lock"]


def test_resave_swaps_atomically_and_leaves_nothing(tmp_path):
    p = tmp_path / "ck"
    nostall.save(_state(1), p)
    nostall.save(_state(2), p)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert nostall.load(_tmpl(), p)["n"] == {"step": 2}


def test_bad_block_size_is_refused_before_anything_is_written(tmp_path):
    for bad in (0, 100, -8):
        with pytest.raises(ValueError, match="block_size"):
            nostall.save(_state(1), tmp_path / "x", block_size=bad)
    assert not (tmp_path / "x").exists()


def test_latest_step_prefers_a_valid_pointer(tmp_path):
    mgr = nostall.CheckpointManager(tmp_path)
    for s in (100, 200, 300):
        mgr.save(s, _state(s))
    mgr.load(_tmpl(), step=100)
    mgr.save(150, _state(150))  # resumed from 100: the 200/300 timeline is abandoned
    assert mgr.latest_step() == 150
    assert nostall.CheckpointManager(tmp_path, read_only=True).load(_tmpl())["n"] == {"step": 150}
    (tmp_path / "latest").unlink()
    assert mgr.latest_step() == 300  # without a pointer: the highest committed step


def test_a_slice_reads_only_the_blocks_it_needs(tmp_path, monkeypatch):
    from nostall.storage import files as storage

    full = torch.arange(4 * 1024 * 1024, dtype=torch.float32).reshape(1024, 4096)  # 16 MiB
    nostall.save({"w": full}, tmp_path / "c", block_size=64 * 1024)
    read = []
    real = storage.read_exact

    def counting(fd, offset, length, path, into=None):
        if path.endswith(".safetensors"):  # data, not the manifest
            read.append(length)
        return real(fd, offset, length, path, into)

    monkeypatch.setattr(storage, "read_exact", counting)
    # rows 300..310 of 1024: 10 rows x 16 KiB, contiguous in the file
    part = nostall.ShardedTensor(torch.zeros(10, 4096), (1024, 4096), (300, 0))
    nostall.load({"w": part}, tmp_path / "c")
    assert torch.equal(part.data, full[300:310])
    needed = 10 * 4096 * 4
    assert needed <= sum(read) <= needed + 2 * 64 * 1024, sum(read)
    # a column slice needs every row: bounded by the rows' span, not more
    read.clear()
    col = nostall.ShardedTensor(torch.zeros(1024, 2), (1024, 4096), (0, 100))
    nostall.load({"w": col}, tmp_path / "c")
    assert torch.equal(col.data, full[:, 100:102])
    assert sum(read) <= full.numel() * 4
