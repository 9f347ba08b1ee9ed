"""Destinations that fail: a full disk, a read-only or forbidden root, a root deleted mid-save.

Each failure must give a clear CheckpointSaveError on every rank, commit
nothing, keep the previous checkpoint loadable, and let the next save succeed
once the cause is gone. The disk-full and read-only cases mount a small tmpfs,
and are skipped with the reason where mounting is not permitted; a
directory is made unwritable with ``chattr +i`` when running as root (mode
bits do not stop root), with ``chmod`` otherwise. ENOSPC
injected at the write layer (``test_writer_fault``) is covered everywhere by
test_single_async.py and test_dist_async.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


@pytest.fixture
def small_fs(tmp_path):
    """A 6 MiB tmpfs at tmp_path/fs (skipped where mounting is refused)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _state(step, rank, world):
    import torch

    import nostall

    w = torch.full((256, 1024), float(step * 10 + rank))  # 1 MiB per rank
    return {"w": nostall.ShardedTensor(w, (256 * world, 1024), (256 * rank, 0)), "meta": {"step": step}}


def _check_loads(mgr, step, rank, world):
    import torch

    tmpl = _state(0, rank, world)
    got = mgr.load(tmpl, step)
    assert got["meta"] == {"step": step} and torch.equal(tmpl["w"].data, _state(step, rank, world)["w"].data)


def _save_outcome(mgr, step, state):
    """Save (async or not) and wait; returns the error message or None."""
    import nostall

    try:
        mgr.save(step, state)
        mgr.finalize_pending_saves()
    except nostall.CheckpointSaveError as e:
        return str(e)
    return None


def _disk_full(rank, world, root, filler, async_save):
    import torch.distributed as dist

    import nostall

    mgr = nostall.CheckpointManager(root, keep_last=None, async_save=async_save, timeout=20)
    assert _save_outcome(mgr, 1, _state(1, rank, world)) is None
    dist.barrier()
    if rank == 0:  # leave about 1 MiB: the next 2 MiB checkpoint cannot fit
        st = os.statvfs(root)
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - (1 << 20)))
    dist.barrier()
    err = _save_outcome(mgr, 2, _state(2, rank, world))
    after_failure = (mgr.latest_step(), mgr.steps(), sorted(os.listdir(root)))
    _check_loads(mgr, 1, rank, world)
    dist.barrier()
    if rank == 0:
        os.unlink(filler)
    dist.barrier()
    ok_again = _save_outcome(mgr, 3, _state(3, rank, world))
    _check_loads(mgr, 3, rank, world)
    mgr.close()
    return err, after_failure, ok_again


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_disk_full_fails_cleanly_and_recovers(pool2, small_fs, async_save):
    root = str(small_fs / "run")
    out = pool2.run(_disk_full, root, str(small_fs / "filler"), async_save)
    for rank, (err, (latest, steps, listing), ok_again) in enumerate(out):
        assert err is not None, f"rank {rank}: the save on a full disk did not fail"
        assert "step 2" in err and "No space left on device" in err, err
        assert latest == 1 and steps == [1] and "step_2" not in listing
        assert ok_again is None
    assert sorted(os.listdir(small_fs / "run")) == [".tmp", "latest", "step_1", "step_3"]
    assert [n for n in os.listdir(small_fs / "run" / ".tmp") if not n.startswith(("commit-", ".lock"))] == []


def _lock_dir(path):
    """Make ``path`` refuse new entries: chattr +i as root (mode bits do not stop root), else chmod."""
    if os.geteuid() == 0:
        r = subprocess.run(["chattr", "+i", path], capture_output=True, text=True)
        if r.returncode != 0:
            return None
        return ["chattr", "-i", path]
    os.chmod(path, 0o500)
    return ["chmod", "700", path]


def _unwritable_mid_run(rank, world, root, async_save):
    import torch.distributed as dist

    import nostall

    mgr = nostall.CheckpointManager(root, keep_last=None, async_save=async_save, timeout=20)
    assert _save_outcome(mgr, 1, _state(1, rank, world)) is None
    dist.barrier()
    undo = _lock_dir(os.path.join(root, ".tmp")) if rank == 0 else None
    locked = [undo is not None]
    dist.broadcast_object_list(locked, src=0)
    if not locked[0]:
        mgr.close()
        return "skip"
    try:
        err = _save_outcome(mgr, 2, _state(2, rank, world))
        _check_loads(mgr, 1, rank, world)
        latest = mgr.latest_step()
    finally:
        dist.barrier()
        if undo:
            subprocess.run(undo, check=True)
    dist.barrier()
    ok_again = _save_outcome(mgr, 3, _state(3, rank, world))
    mgr.close()
    return err, latest, ok_again


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_destination_becomes_unwritable_mid_run(pool2, tmp_path, async_save):
    out = pool2.run(_unwritable_mid_run, str(tmp_path / "run"), async_save)
    if out[0] == "skip":
        pytest.skip("running as root and chattr +i is not supported here")
    for err, latest, ok_again in out:
        assert err is not None and "step 2" in err, err
        assert "Operation not permitted" in err or "ermission denied" in err, err
        assert latest == 1 and ok_again is None


def _open_manager(rank, world, root):
    """The error creating a manager on ``root`` gives on this rank (None: it worked)."""
    import nostall

    try:
        nostall.CheckpointManager(root, timeout=20).close()
    except nostall.CheckpointSaveError as e:
        return str(e)
    return None


def test_read_only_filesystem_is_a_clear_error_on_every_rank(pool2, tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        out = pool2.run(_open_manager, str(mnt / "run"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    for msg in out:
        assert msg is not None and "Read-only file system" in msg and str(mnt / "run") in msg, msg


def test_forbidden_destination_is_a_clear_error_on_every_rank(pool2, tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir()
    undo = _lock_dir(str(parent))
    if undo is None:
        pytest.skip("running as root and chattr +i is not supported here")
    try:
        out = pool2.run(_open_manager, str(parent / "run"))
    finally:
        subprocess.run(undo, check=False)
    for msg in out:
        assert msg is not None and str(parent / "run") in msg, msg
        assert "ermission denied" in msg or "Operation not permitted" in msg, msg


def _deleted_mid_save(rank, world, root):
    import time

    import torch.distributed as dist

    import nostall

    mgr = nostall.CheckpointManager(root, keep_last=None, async_save=True, timeout=20)
    assert _save_outcome(mgr, 1, _state(1, rank, world)) is None
    mgr._faults.writer_delay_s = 1.0
    mgr.save(2, _state(2, rank, world))  # returns at once; the writers start after 1 s
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)  # an operator (or a cleanup script) deletes the run directory
    t0 = time.monotonic()
    try:
        mgr.finalize_pending_saves()
        err = None
    except nostall.CheckpointSaveError as e:
        err = str(e)
    waited = time.monotonic() - t0
    mgr._faults.writer_delay_s = 0.0
    dist.barrier()
    ok_again = _save_outcome(mgr, 3, _state(3, rank, world))
    _check_loads(mgr, 3, rank, world)
    mgr.close()
    return err, waited, ok_again


def test_destination_deleted_mid_save(pool2, tmp_path):
    root = str(tmp_path / "run")
    out = pool2.run(_deleted_mid_save, root)
    for err, waited, ok_again in out:
        assert err is not None and "step 2" in err, err
        assert waited < 30  # bounded (manager timeout 20 s), not a hang
        assert ok_again is None
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["latest", "step_3"]
