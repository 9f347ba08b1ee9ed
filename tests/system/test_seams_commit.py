"""The commit path's seams: nothing touched that nostall did not make, and the caller told the truth.

Each test here failed before the single commit routine and storage-root
interface (issue 15): symlinks inside a root, a user's directories under
``.tmp``, a directory that merely holds a ``manifest.json``, ``latest``
failing to move, a hostile ``latest``, the CLI's idea of the newest
checkpoint, the SIGTERM handler after ``close()``, and the writer's imports.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import nostall
from nostall.tools import cli


def _state(v: float) -> dict:
    return {"w": torch.full((64,), float(v)), "meta": {"v": v}}


def _tmpl() -> dict:
    return {"w": torch.zeros(64), "meta": None}


def _value(out: dict) -> float:
    return float(out["w"][0])


# --------------------------------------------------------------------------- nothing touched that is not ours


def test_a_symlinked_tmp_is_refused_and_nothing_outside_is_touched(tmp_path):
    outside = tmp_path / "outside"
    (outside / "precious").mkdir(parents=True)
    (outside / "precious" / "data").write_text("keep me")
    root = tmp_path / "run"
    root.mkdir()
    os.symlink(outside, root / ".tmp")
    with pytest.raises(nostall.CheckpointSaveError, match=r"\.tmp is a symbolic link"):
        nostall.CheckpointManager(root)
    assert (outside / "precious" / "data").read_text() == "keep me"
    assert sorted(os.listdir(outside)) == ["precious"]  # no lock file created outside either


@pytest.mark.parametrize("entry", ["step_3", "latest"])
def test_a_symlinked_step_or_latest_is_refused_by_name(tmp_path, entry):
    elsewhere = tmp_path / "elsewhere"
    with nostall.CheckpointManager(elsewhere) as m:
        m.save(3, _state(3))
    root = tmp_path / "run"
    with nostall.CheckpointManager(root) as m:
        m.save(1, _state(1))
    target = elsewhere / "step_3" if entry == "step_3" else elsewhere / "latest"
    if (root / entry).exists():
        os.unlink(root / entry)
    os.symlink(target, root / entry)
    with pytest.raises(nostall.CheckpointError, match=f"{entry} is a symbolic link"):
        nostall.CheckpointManager(root)
    reader = nostall.CheckpointManager(root, read_only=True)
    with pytest.raises(nostall.CheckpointError, match=f"{entry} is a symbolic link"):
        reader.load(_tmpl())
    reader.close()
    assert subprocess.run([sys.executable, "-m", "nostall.tools.cli", "verify", str(root)],
                          capture_output=True).returncode != 0


def test_oneshot_save_never_replaces_a_directory_that_is_not_a_nostall_checkpoint(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"my": "own manifest"}))
    (d / "notes.txt").write_text("keep me")
    with pytest.raises(nostall.CheckpointSaveError, match="not a nostall checkpoint"):
        nostall.save(_state(1), d)
    assert sorted(os.listdir(d)) == ["manifest.json", "notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["mine"]  # no staging left beside it
    nostall.save(_state(2), tmp_path / "ck")  # a nostall checkpoint is replaced, as before
    nostall.save(_state(3), tmp_path / "ck")
    assert _value(nostall.load(_tmpl(), tmp_path / "ck")) == 3


def test_object_storage_sweep_touches_only_nostall_names(s3, tmp_path):
    import s3fs

    bucket = s3.make_bucket("sweep-names")
    root = f"s3://{bucket}/run"
    fs = s3fs.S3FileSystem(**s3.storage_options)
    theirs = [f"{bucket}/run/best_step_3/model.bin", f"{bucket}/run/eval_step_100/scores.json",
              f"{bucket}/run/step_7/notes.txt"]
    for key in theirs:
        fs.pipe_file(key, b"the user's")
    with nostall.CheckpointManager(root, async_save=True, storage_options=s3.storage_options, timeout=60,
                                   local_staging_dir=str(tmp_path), keep_last=1) as m:
        for step in (1, 2, 3):
            m.save(step, _state(step))
    fs.invalidate_cache()
    for key in theirs:
        assert fs.cat_file(key) == b"the user's", key
    with nostall.CheckpointManager(root, read_only=True, storage_options=s3.storage_options) as m:
        assert m.steps() == [3] and _value(m.load(_tmpl())) == 3


# --------------------------------------------------------------------------- the caller told the truth


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("where", ["latest", "latest.move"])
def test_latest_that_cannot_move_fails_the_save_and_nothing_stays_committed(tmp_path, async_save, where):
    m = nostall.CheckpointManager(tmp_path, async_save=async_save, keep_last=2)
    m.save(1, _state(1)).result()
    m._faults.fail[where] = errno.ENOSPC
    with pytest.raises(nostall.CheckpointSaveError, match="latest|No space"):
        m.save(2, _state(2)).result()
    assert m.steps() == [1] and m.latest_step() == 1  # what is on disk equals what the caller was told
    assert not (tmp_path / "step_2").exists()
    del m._faults.fail[where]
    m.save(3, _state(3)).result()  # space is back: the next save works
    assert m.steps() == [1, 3] and m.latest_step() == 3
    assert _value(m.load(_tmpl())) == 3
    m.close()
    assert sorted(os.listdir(tmp_path / ".tmp")) in ([".lock"], [".lock", *sorted(
        n for n in os.listdir(tmp_path / ".tmp") if n.startswith("commit-"))])


def test_async_outcome_needs_no_space_once_committed(tmp_path):
    """The outcome of a committed save is announced by a rename: a full disk cannot make it a failure."""
    m = nostall.CheckpointManager(tmp_path, async_save=True, keep_last=1)
    m.save(1, _state(1)).result()
    m._faults.fail["outcome"] = errno.ENOSPC  # writing any outcome file fails
    stats = m.save(2, _state(2)).result()
    assert stats.step == 2 and m.steps() == [2] and m.latest_step() == 2  # committed, and retention ran
    m.close()


def test_a_hostile_latest_is_bounded(tmp_path):
    with nostall.CheckpointManager(tmp_path) as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
    with open(tmp_path / "latest", "wb") as f:
        f.write(b"1" * (64 << 20))  # a huge pointer: never read whole, refused by name
    with pytest.raises(nostall.CheckpointError, match="latest: cannot read the latest pointer"):
        nostall.CheckpointManager(tmp_path, read_only=True).latest_step()
    with open(tmp_path / "latest", "wb") as f:
        f.write(b"garbage\n")  # not a step: the newest committed one, with a warning
    assert nostall.CheckpointManager(tmp_path, read_only=True).latest_step() == 2
    os.unlink(tmp_path / "latest")
    os.symlink("/dev/zero", tmp_path / "latest")
    with pytest.raises(nostall.CheckpointError, match="latest is a symbolic link"):
        nostall.CheckpointManager(tmp_path, read_only=True).latest_step()
    os.unlink(tmp_path / "latest")
    os.mkfifo(tmp_path / "latest")  # never opened blocking
    with pytest.raises(nostall.CheckpointError, match="latest"):
        nostall.CheckpointManager(tmp_path, read_only=True).latest_step()


def test_cli_newest_checkpoint_is_the_one_load_uses(tmp_path, capsys):
    with nostall.CheckpointManager(tmp_path) as m:
        for s in (1, 2, 3):
            m.save(s, _state(s))
        m.save(2, _state(20))  # training went back to step 2: `latest` names it
        assert m.latest_step() == 2
    assert cli.main(["inspect", "--json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    assert cli.main(["verify", "--json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["path"].endswith("step_2")
    assert _value(nostall.load(_tmpl(), tmp_path)) == 20  # nostall.load takes the run root as the CLI does


# --------------------------------------------------------------------------- lifetime and contracts


def test_sigterm_handler_is_removed_by_close(tmp_path):
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (another test's library, Ray, may have set one)
    try:
        m = nostall.CheckpointManager(tmp_path, async_save=True)
        assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL  # drains the pending save on SIGTERM
        m.close()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_writer_side_never_imports_torch():
    code = ("import sys; import nostall.saving.writer, nostall.saving.commit, nostall.storage.root, nostall.storage.posix, "
            "nostall.storage.objects, nostall.storage.locate, nostall.core.jobs, nostall.options; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_live_writer_process_has_not_imported_torch(tmp_path):
    with nostall.CheckpointManager(tmp_path, async_save=True) as m:
        m.save(1, _state(1)).result()
        with open(f"/proc/{m.writer_pid}/maps") as f:
            maps = f.read()
    assert "libtorch" not in maps


def test_timeouts_are_save_errors():
    assert issubclass(nostall.CheckpointTimeoutError, nostall.CheckpointSaveError)


def test_options_are_validated_once_with_the_rule():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        nostall.Options(block_size=1000)
    with pytest.raises(ValueError, match="keep_last"):
        nostall.Options(keep_last=0)
    assert nostall.Options(block_size=4096, staging_budget_bytes=(1 << 20) + 5).staging_budget_bytes == 1 << 20
