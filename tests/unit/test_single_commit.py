"""The commit protocol and CheckpointManager, in one process."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import nostall
import nostall.storage.files


def state_for(step: int) -> dict:
    return {
        "w": torch.full((3, 4), float(step)),
        "opt": {"state": {0: {"m": torch.arange(5) * step}}, "param_groups": [{"lr": 0.1 * step}]},
        "step": step,
    }


def template() -> dict:
    return {
        "w": torch.zeros(3, 4),
        "opt": {"state": {0: {"m": torch.zeros(5, dtype=torch.int64)}}, "param_groups": None},
        "step": None,
    }


def assert_is_step(restored: dict, step: int) -> None:
    assert torch.equal(restored["w"], torch.full((3, 4), float(step)))
    assert torch.equal(restored["opt"]["state"][0]["m"], torch.arange(5) * step)
    assert restored["opt"]["param_groups"] == [{"lr": 0.1 * step}]
    assert restored["step"] == step


def data_bytes(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))


def listing(root: Path) -> list:
    return sorted(os.listdir(root))


# --------------------------------------------------------------------------- steps / latest / retention


def test_empty_root_has_no_step(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path / "run")
    assert mgr.latest_step() is None
    assert mgr.steps() == []
    assert (tmp_path / "run").is_dir()
    with pytest.raises(nostall.CheckpointNotFoundError):
        mgr.load(template())


def test_keep_last_latest_and_load_by_step(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path, keep_last=2)
    for s in range(1, 6):
        h = mgr.save(s, state_for(s))
        assert h.path == str(tmp_path / f"step_{s}")
        assert mgr.latest_step() == s
        assert (tmp_path / "latest").read_text().strip() == str(s)
    assert [n for n in listing(tmp_path) if n.startswith("step_")] == ["step_4", "step_5"]
    assert mgr.steps() == [4, 5]
    assert (tmp_path / "latest").read_text().strip() == "5"
    assert (tmp_path / "step_5" / "manifest.json").is_file()
    assert_is_step(mgr.load(template()), 5)
    assert_is_step(mgr.load(template(), step=4), 4)
    with pytest.raises(nostall.CheckpointNotFoundError):
        mgr.load(template(), step=3)
    # a fresh manager on the same root sees the same steps
    assert nostall.CheckpointManager(tmp_path, read_only=True).steps() == [4, 5]


def test_keep_last_none_keeps_everything(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    for s in (0, 10, 2):
        mgr.save(s, state_for(s))
    assert mgr.steps() == [0, 2, 10]
    # a lower step saved after a higher one (resumed from an older checkpoint):
    # latest names the step saved last, so a restart continues this timeline
    assert mgr.latest_step() == 2
    assert (tmp_path / "latest").read_text().strip() == "2"
    assert_is_step(mgr.load(template()), 2)
    # without a valid pointer, the highest committed step is latest
    (tmp_path / "latest").write_text("7\n")
    assert mgr.latest_step() == 10


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_keep_last_must_be_positive_int(tmp_path: Path, bad) -> None:
    with pytest.raises(ValueError):
        nostall.CheckpointManager(tmp_path, keep_last=bad)


@pytest.mark.parametrize("bad", [-1, True, 1.0, "3", None])
def test_step_must_be_non_negative_int(tmp_path: Path, bad) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    with pytest.raises(ValueError):
        mgr.save(bad, state_for(1))
    assert mgr.steps() == []


# --------------------------------------------------------------------------- crash leftovers


def test_uncommitted_step_dir_is_not_a_checkpoint(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, state_for(1))
    crashed = tmp_path / "step_9"
    crashed.mkdir()
    (crashed / "rank0.safetensors").write_bytes(b"junk" * 10)
    assert mgr.latest_step() == 1
    assert mgr.steps() == [1]
    with pytest.raises(nostall.CheckpointNotFoundError, match="step_9"):
        mgr.load(template(), step=9)
    # a newer manager, and retention, leave it alone: it is not a step at all
    mgr.close()
    mgr2 = nostall.CheckpointManager(tmp_path, keep_last=1)
    assert mgr2.steps() == [1]
    mgr2.save(2, state_for(2))
    mgr2.save(3, state_for(3))
    assert mgr2.steps() == [3]
    assert crashed.is_dir() and (crashed / "rank0.safetensors").read_bytes() == b"junk" * 10
    assert_is_step(mgr2.load(template()), 3)


def test_not_step_names_are_ignored(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(4, state_for(4))
    # committed-looking directories whose names are not step_<N>
    for name in ("step_04", "step_x", "step_-1", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_bytes((tmp_path / "step_4" / "manifest.json").read_bytes())
    assert mgr.steps() == [4]


def test_leftover_staging_is_removed_by_a_new_manager(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(5, state_for(5))
    # what crashed saves leave: nostall's names, each with the marker holding its id
    left = tmp_path / ".tmp" / ("save-" + "7" * 32)
    left.mkdir(parents=True)
    (tmp_path / ".tmp" / ("save-" + "7" * 32 + ".nostall")).write_text("7" * 32)
    (left / "rank0.safetensors").write_bytes(b"partial")
    (left / "manifest.json").write_bytes(b"{}")
    trash = tmp_path / ".tmp" / ("trash-" + "0123" * 8)
    trash.mkdir()
    (tmp_path / ".tmp" / ("trash-" + "0123" * 8 + ".nostall")).write_text("0123" * 8)
    (trash / "x").write_bytes(b"x")
    # marks a crash cut short while they were written (their entry never came): nostall's too
    cut = [tmp_path / ".tmp" / ("trash-" + "a" * 32 + ".nostall"), tmp_path / ".tmp" / ("save-" + "b" * 32 + ".nostall")]
    cut[0].write_text("")
    cut[1].write_text("b" * 7)
    # and what nostall cannot prove it made: left alone
    foreign_mark = tmp_path / ".tmp" / ("save-" + "c" * 32 + ".nostall")
    foreign_mark.write_text("not an id")
    theirs = [tmp_path / ".tmp" / "step_7", tmp_path / ".tmp" / ("save-" + "8" * 32)]
    for d in theirs:
        d.mkdir()
        (d / "notes.txt").write_text("the user's")
    assert mgr.steps() == [5]  # a staging dir never counts
    # a second manager while the first is open is refused, naming the holder, and touches nothing
    with pytest.raises(nostall.CheckpointSaveError, match=f"in use by another CheckpointManager: pid {os.getpid()}"):
        nostall.CheckpointManager(tmp_path)
    other = nostall.CheckpointManager(tmp_path, read_only=True)  # an evaluation job
    assert_is_step(other.load(template()), 5)
    with pytest.raises(nostall.CheckpointError, match="read-only"):
        other.save(6, state_for(6))
    assert left.exists() and trash.exists()
    other.close()
    mgr.close()
    nostall.CheckpointManager(tmp_path).close()
    assert not left.exists()
    assert not trash.exists()
    assert all((d / "notes.txt").read_text() == "the user's" for d in theirs)
    assert not any(m.exists() for m in cut) and foreign_mark.read_text() == "not an id"
    assert (tmp_path / "step_5" / "manifest.json").is_file()
    assert_is_step(nostall.CheckpointManager(tmp_path).load(template()), 5)


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(3, state_for(3))
    mgr.save(4, state_for(4))
    mgr.save(3, state_for(30))
    assert mgr.steps() == [3, 4]
    assert_is_step(mgr.load(template(), step=3), 30)
    assert_is_step(mgr.load(template(), step=4), 4)
    # saving step 3 after step 4 means training went back to step 3: it is latest
    assert_is_step(mgr.load(template()), 30)
    assert (tmp_path / "latest").read_text().strip() == "3"
    assert [n for n in os.listdir(tmp_path / ".tmp") if n != ".lock"] == []  # the replaced copy is gone


def test_resave_with_different_structure_drops_old_files(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(1, {"a": torch.ones(100), "b": torch.ones(3)})
    mgr.save(1, {"a": torch.zeros(2)})
    out = mgr.load({"a": torch.empty(2)})
    assert torch.equal(out["a"], torch.zeros(2))
    with pytest.raises(nostall.CheckpointLoadError, match="'b'"):
        mgr.load({"a": torch.empty(2), "b": torch.empty(3)})


# --------------------------------------------------------------------------- one-shot save target


def test_one_shot_save_refuses_foreign_directory(tmp_path: Path) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("precious")
    (target / "sub").mkdir()
    (target / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = {str(p.relative_to(target)): (p.read_bytes() if p.is_file() else None) for p in target.rglob("*")}
    with pytest.raises(nostall.CheckpointSaveError, match="mine"):
        nostall.save({"w": torch.ones(2)}, str(target))
    after = {str(p.relative_to(target)): (p.read_bytes() if p.is_file() else None) for p in target.rglob("*")}
    assert after == before
    assert listing(tmp_path) == ["mine"]  # no staging directory left beside it


def test_one_shot_save_onto_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "afile"
    target.write_bytes(b"keep me")
    with pytest.raises(nostall.CheckpointSaveError):
        nostall.save({"w": torch.ones(2)}, str(target))
    assert target.read_bytes() == b"keep me"


def test_refused_target_is_not_reported_as_invalid_state(tmp_path: Path) -> None:
    """InvalidStateError (a ValueError) means "the state is bad"; a refused or
    unwritable target is a plain CheckpointSaveError."""
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("precious")
    with pytest.raises(nostall.CheckpointSaveError) as ei:
        nostall.save({"w": torch.ones(2)}, str(target))
    assert not isinstance(ei.value, nostall.InvalidStateError), repr(ei.value)


def test_one_shot_resave_leaves_nothing_beside_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "c"
    nostall.save({"w": torch.zeros(2)}, str(path))
    assert listing(tmp_path) == ["c"]
    nostall.save({"w": torch.ones(2)}, str(path))
    assert torch.equal(nostall.load({"w": torch.empty(2)}, str(path))["w"], torch.ones(2))
    assert listing(tmp_path) == ["c"]


def test_manager_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "root"
    f.write_text("x")
    with pytest.raises(nostall.CheckpointSaveError):
        nostall.CheckpointManager(f)
    assert f.read_text() == "x"


# --------------------------------------------------------------------------- failing writes


def _enospc_on_data_files(monkeypatch: pytest.MonkeyPatch) -> list:
    real = nostall.storage.files.FileWriter.write
    calls: list = []

    def failing(self, chunk):
        if str(self.path).endswith(".safetensors"):
            if self.pos == 0:  # a partial file, as a full disk leaves it: the first write lands
                calls.append(self.path)
                return real(self, chunk)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, chunk)

    monkeypatch.setattr(nostall.storage.files.FileWriter, "write", failing)
    return calls


def test_enospc_fails_the_save_and_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = nostall.CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, state_for(1))
    before = (tmp_path / "step_1" / "manifest.json").read_bytes()

    calls = _enospc_on_data_files(monkeypatch)
    with pytest.raises(nostall.CheckpointSaveError) as ei:
        mgr.save(2, state_for(2))
    assert calls, "the patched write_file was never called"
    msg = str(ei.value)
    assert "rank 0" in msg
    assert "no space" in msg.lower() or "enospc" in msg.lower(), msg
    assert not isinstance(ei.value, nostall.InvalidStateError)

    assert not (tmp_path / "step_2").exists()
    assert not (tmp_path / ".tmp" / "step_2").exists()
    assert [n for n in os.listdir(tmp_path / ".tmp") if n != ".lock"] == []
    assert mgr.steps() == [1] and mgr.latest_step() == 1
    assert (tmp_path / "latest").read_text().strip() == "1"
    assert (tmp_path / "step_1" / "manifest.json").read_bytes() == before
    assert_is_step(mgr.load(template()), 1)

    monkeypatch.undo()
    mgr.save(2, state_for(2))
    assert mgr.steps() == [2]
    assert_is_step(mgr.load(template()), 2)


def test_enospc_in_one_shot_save_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c"
    nostall.save(state_for(1), str(path))
    _enospc_on_data_files(monkeypatch)
    with pytest.raises(nostall.CheckpointSaveError, match=r"(?i)no space|enospc"):
        nostall.save(state_for(2), str(path))
    monkeypatch.undo()
    assert listing(tmp_path) == ["c"]
    assert_is_step(nostall.load(template(), str(path)), 1)


def test_failing_manifest_write_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(1, state_for(1))
    real = nostall.storage.files.write_file

    def failing(path, chunks):
        if os.path.basename(str(path)) == "manifest.json":
            raise OSError(errno.EIO, "Input/output error")
        return real(path, chunks)

    monkeypatch.setattr(nostall.storage.files, "write_file", failing)
    with pytest.raises(nostall.CheckpointSaveError, match="(?i)input/output"):
        mgr.save(2, state_for(2))
    monkeypatch.undo()
    assert mgr.steps() == [1]
    assert not (tmp_path / "step_2").exists()
    assert [n for n in os.listdir(tmp_path / ".tmp") if n != ".lock"] == []
    assert (tmp_path / "latest").read_text().strip() == "1"
    assert_is_step(mgr.load(template()), 1)


# --------------------------------------------------------------------------- lifetime


def test_context_manager_and_close(tmp_path: Path) -> None:
    with nostall.CheckpointManager(tmp_path) as mgr:
        assert mgr.rank == 0 and mgr.world_size == 1
        mgr.save(1, state_for(1))
        assert mgr.finalize_pending_saves() is None
        assert mgr.finalize_pending_saves(timeout=1.0) is None
    with pytest.raises(nostall.CheckpointError, match="closed"):
        mgr.save(2, state_for(2))
    with pytest.raises(nostall.CheckpointError, match="closed"):
        mgr.load(template())
    mgr.close()
    mgr.close()
    assert mgr.steps() == [1]  # info calls still work on the files
    assert not (tmp_path / "step_2").exists()


# --------------------------------------------------------------------------- handles and stats


def test_save_handle_and_stats(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    h1 = mgr.save(1, state_for(1))
    assert isinstance(h1, nostall.SaveHandle)
    assert h1.done()
    assert h1.exception() is None
    s1 = h1.result()
    assert isinstance(s1, nostall.SaveStats)
    assert s1 is h1.result(timeout=0) is h1.stats
    assert s1.step == 1 and s1.rank == 0 and s1.world_size == 1
    size1 = data_bytes(tmp_path / "step_1")
    assert s1.bytes_written > 0
    assert s1.bytes_written == size1 == s1.total_bytes
    assert s1.plan_cached is False
    assert s1.total_s >= 0 and s1.stall_s >= 0
    assert s1.as_dict()["bytes_written"] == size1

    s2 = mgr.save(2, state_for(2)).result()
    assert s2.plan_cached is True
    assert s2.bytes_written == data_bytes(tmp_path / "step_2")

    bigger = state_for(3)
    bigger["extra"] = torch.zeros(1000)
    s3 = mgr.save(3, bigger).result()
    assert s3.plan_cached is False
    assert s3.bytes_written == data_bytes(tmp_path / "step_3") > size1

    s4 = mgr.save(4, bigger).result()
    assert s4.plan_cached is True
    reshaped = state_for(5)
    reshaped["w"] = torch.zeros(4, 3)  # same key, same numel, other shape
    s5 = mgr.save(5, reshaped).result()
    assert s5.plan_cached is False
    retyped = state_for(6)
    retyped["w"] = torch.zeros(4, 3, dtype=torch.float64)
    s6 = mgr.save(6, retyped).result()
    assert s6.plan_cached is False

    assert [s.step for s in mgr.stats()] == [1, 2, 3, 4, 5, 6]
    assert mgr.stats()[0] is s1
    out = mgr.load({"w": torch.empty(4, 3, dtype=torch.float64), "opt": template()["opt"], "step": None})
    assert out["w"].dtype == torch.float64 and out["step"] == 6


def test_cached_plan_still_writes_new_values(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    for s in (1, 2, 3):
        assert mgr.save(s, state_for(s)).result().plan_cached is (s > 1)
    for s in (1, 2, 3):
        assert_is_step(mgr.load(template(), step=s), s)


def test_failed_save_is_not_in_stats(tmp_path: Path) -> None:
    mgr = nostall.CheckpointManager(tmp_path)
    mgr.save(1, state_for(1))
    with pytest.raises(nostall.InvalidStateError):
        mgr.save(2, {"w": object()})
    assert [s.step for s in mgr.stats()] == [1]
