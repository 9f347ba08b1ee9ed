"""Issue 24: nothing nostall did not make is deleted, replaced or followed (defects 1, 2, 5, 7, 8, 9).

Each test builds the situation the red team found, on a real local root with real saves, and checks
what is on disk afterwards: the user's files byte for byte, the files outside the root, and that every
committed checkpoint loads as saved. tests/test_ownership.py runs the same rules as a property test.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
from typing import Any, Dict

import pytest
import torch

import nostall
from nostall.errors import CheckpointError


def _state(v: float = 1.0, frozen: float = 5.0) -> Dict[str, Any]:
    return {"frozen": torch.full((256, 64), float(frozen)), "w": torch.full((16,), float(v)), "step": int(v)}


def _loads_as(path: str, expected: Dict[str, Any]) -> None:
    got = nostall.load({"frozen": torch.zeros(256, 64), "w": torch.zeros(16), "step": 0}, path)
    assert torch.equal(got["frozen"], expected["frozen"]) and torch.equal(got["w"], expected["w"])
    assert got["step"] == expected["step"]


# --------------------------------------------------------------------------- 1. no link followed


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "full"])
def test_retention_never_deletes_through_a_symlinked_side_file_folder(tmp_path, incremental):
    root, outside = tmp_path / "run", tmp_path / "elsewhere"
    with nostall.CheckpointManager(str(root), keep_last=1, incremental=incremental) as mgr:
        mgr.save(1, _state(1), files={"huggingface/config.json": b'{"a": 1}'})
        # the user moves the folder out of the checkpoint and leaves a link in its place
        shutil.move(str(root / "step_1" / "huggingface"), str(outside))
        os.symlink(str(outside), str(root / "step_1" / "huggingface"))
        there = {p.name: p.read_bytes() for p in outside.iterdir()}
        assert list(there.values()) == [b'{"a": 1}']
        mgr.save(2, _state(2))  # retention retires step_1 (incremental: step_2 reads its frozen piece)
        mgr.save(3, _state(3))
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == there
    assert os.path.islink(root / "step_1" / "huggingface")  # a link is not nostall's: left, with its directory
    _loads_as(str(root / "step_3"), _state(3))


# --------------------------------------------------------------------------- 2. a root's lock is respected


def test_caller_named_save_into_a_held_root_is_refused(tmp_path):
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root)) as mgr:
        mgr.save(1, _state(1))
        with nostall.CheckpointManager(None) as other:
            with pytest.raises(CheckpointError, match="manager holds"):
                other.save(None, _state(9), path=str(root / "step_1"))
            with pytest.raises(CheckpointError, match="manager holds"):
                other.save(None, _state(9), path=str(root / "step_7"))
        with pytest.raises(CheckpointError, match="manager holds"):
            nostall.save(_state(9), str(root / "step_1"))
        assert not (root / "step_7").exists()
        assert not glob.glob(str(root / ".step_*"))  # no staging left beside
        _loads_as(str(root / "step_1"), _state(1))
        mgr.save(2, _state(2))  # the holder's own saves go on
    nostall.save(_state(9), str(root / "step_7"))  # once nobody holds the root, the caller's choice
    _loads_as(str(root / "step_7"), _state(9))


def test_copy_over_a_checkpoint_of_a_held_root_is_refused(tmp_path):
    root, src = tmp_path / "run", tmp_path / "src"
    nostall.save(_state(9), str(src))
    with nostall.CheckpointManager(str(root)) as mgr:
        mgr.save(1, _state(1))
        with pytest.raises(CheckpointError, match="manager holds"):
            nostall.copy_checkpoint(str(src), str(root / "step_1"), overwrite=True)
        _loads_as(str(root / "step_1"), _state(1))


def test_a_save_beside_a_root_inside_it_is_not_a_checkpoint_of_it(tmp_path):
    """Only step_<N> names are the root's: a caller-named directory elsewhere inside it is allowed."""
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root)) as mgr:
        mgr.save(1, _state(1))
        nostall.save(_state(4), str(root / "export"))
        _loads_as(str(root / "export"), _state(4))


# --------------------------------------------------------------------------- 7. crashed caller-named saves


_CRASHING_SAVE = textwrap.dedent("""
    import sys, torch, nostall
    state = {"frozen": torch.full((256, 64), 5.0), "w": torch.full((16,), 1.0), "step": 1}
    with nostall.CheckpointManager(None, async_save=sys.argv[2] == "async") as mgr:
        mgr.save(1, state, path=sys.argv[1]).result(120)
""")


@pytest.mark.parametrize("mode,point", [("sync", "trainer:write.done:1"), ("async", "writer:write.done:1"),
                                        ("async", "trainer:staged:1")])
def test_a_crashed_caller_named_save_leaves_nothing_after_the_next_save_there(tmp_path, mode, point):
    target = tmp_path / "out" / "export"
    env = {**os.environ, "NOSTALL_TEST_CRASH": point}
    proc = subprocess.run([sys.executable, "-c", _CRASHING_SAVE, str(target), mode], env=env, timeout=300,
                          capture_output=True)
    assert proc.returncode != 0, proc.stderr.decode()[-2000:]
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert any(".nostall-" in n for n in left), left  # what the crash left
    (tmp_path / "out" / ".user.nostall-save-notes").write_text("mine")  # a name like ours, no mark: not ours
    with nostall.CheckpointManager(None) as mgr:
        mgr.save(2, _state(2), path=str(target))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".user.nostall-save-notes", "export"]
    _loads_as(str(target), _state(2))


def test_a_live_saves_staging_is_never_swept(tmp_path):
    """A save still running (its maker alive) keeps its staging while another save goes to the same place."""
    out = tmp_path / "out"
    code = textwrap.dedent("""
        import sys, time, torch, nostall
        from nostall.core.faults import Faults
        state = {"w": torch.ones(16)}
        mgr = nostall.CheckpointManager(None, async_save=True)
        mgr._faults.writer_delay_s = 1e9  # the writer never gets to write: the save stays in flight
        mgr.save(1, state, path=sys.argv[1])
        print("staged", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code, str(out / "a")], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"staged"
        before = sorted(p.name for p in out.iterdir() if ".nostall-" in p.name)
        assert before
        nostall.save(_state(2), str(out / "b"))
        assert sorted(p.name for p in out.iterdir() if ".nostall-" in p.name) == before
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    nostall.save(_state(3), str(out / "b"))  # its maker is gone now: swept
    assert sorted(p.name for p in out.iterdir()) == ["b"]


# --------------------------------------------------------------------------- 8, 9. proof before deletion


@pytest.mark.parametrize("rid", ["0123456789abcdef", "0123456789abcdef0123456789abcdef"])
def test_a_hand_made_retired_manifest_proves_nothing(tmp_path, rid):
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root), keep_last=1, incremental=True) as mgr:
        mgr.save(1, _state(1), files={"notes.txt": b"nostall's"})
        user = root / "step_99"
        user.mkdir()
        (user / "notes.txt").write_bytes(b"the user's notes")
        shutil.copy(root / "step_1" / "manifest.json", user / f".retired-{rid}.json")
        (root / "step_1" / f".retired-{rid}.json").write_bytes((root / "step_1" / "manifest.json").read_bytes())
        mgr.save(2, _state(2))
        mgr.save(3, _state(3))
    assert (user / "notes.txt").read_bytes() == b"the user's notes"
    assert (user / f".retired-{rid}.json").exists()
    _loads_as(str(root / "step_3"), _state(3))


def test_retention_deletes_only_what_the_checkpoint_lists(tmp_path):
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root), keep_last=1) as mgr:
        mgr.save(1, _state(1), files={"huggingface/config.json": b"{}"})
        (root / "step_1" / "eval.json").write_text('{"loss": 1}')
        (root / "step_1" / "huggingface" / "tokenizer.json").write_text("{}")
        nostall.save(_state(4), str(root / "step_1" / "export"))
        mgr.save(2, _state(2))
        assert mgr.steps() == [2]
    left = sorted(str(p.relative_to(root / "step_1")) for p in (root / "step_1").rglob("*") if p.is_file())
    assert (root / "step_1" / "eval.json").read_text() == '{"loss": 1}'
    assert (root / "step_1" / "huggingface" / "tokenizer.json").exists()
    assert "huggingface/config.json" not in left and "manifest.json" not in left
    assert not any(n.endswith(".safetensors") for n in left if "/" not in n)  # step_1's own data files are gone
    _loads_as(str(root / "step_1" / "export"), _state(4))
    assert not [n for n in os.listdir(root / ".tmp") if n.startswith("retired-")]  # proofs go with what they prove


def test_a_step_directory_left_empty_is_removed(tmp_path):
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root), keep_last=1, incremental=True) as mgr:
        for s in range(1, 5):
            mgr.save(s, _state(s), files={"hf/config.json": b"{}"})
    kept = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    # step_1 holds the frozen piece every later save reads: retired, the rest gone
    assert kept == ["step_1", "step_4"]
    assert json.loads(next((root / "step_1").glob(".retired-*.json")).read_bytes())
    assert not (root / "step_1" / "hf").exists()
    _loads_as(str(root / "step_4"), _state(4))


def test_resaving_a_step_that_holds_user_files_is_refused(tmp_path):
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root)) as mgr:
        mgr.save(1, _state(1))
        (root / "step_1" / "eval.json").write_text("user")
        with pytest.raises(CheckpointError, match="eval.json"):
            mgr.save(1, _state(2))
        assert (root / "step_1" / "eval.json").read_text() == "user"
        _loads_as(str(root / "step_1"), _state(1))
        (root / "step_1" / "eval.json").unlink()
        mgr.save(1, _state(2))  # nothing foreign: replaced
        _loads_as(str(root / "step_1"), _state(2))


# --------------------------------------------------------------------------- 5. referenced bytes verified


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("damage", ["bitflip", "replaced"])
@pytest.mark.parametrize("when", [1, 2], ids=["before-first-reference", "after-verified"])
def test_an_incremental_save_never_relies_on_damaged_referenced_bytes(tmp_path, async_save, damage, when):
    """The base file is damaged after save ``when``: the first save after it rewrites the pieces from the
    trainer's copy (read back the first time a piece is referenced; afterwards whenever the file changed)."""
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root), keep_last=5, incremental=True, async_save=async_save) as mgr:
        for s in range(1, when + 1):
            mgr.save(s, _state(s)).result(120)
        (base,) = glob.glob(str(root / "step_1" / "rank0.*.safetensors"))
        raw = bytearray(pathlib.Path(base).read_bytes())
        if damage == "bitflip":
            raw[len(raw) // 2] ^= 0x10  # inside the frozen tensor's bytes
            with open(base, "r+b") as f:
                f.write(raw)
        else:  # another file of the same size in its place
            tmp = base + ".other"
            pathlib.Path(tmp).write_bytes(bytes(len(raw)))
            os.replace(tmp, base)
        for s in range(when + 1, when + 3):
            mgr.save(s, _state(s)).result(120)
    for s in range(when + 1, when + 3):
        _loads_as(str(root / f"step_{s}"), _state(s))
        m = json.loads((root / f"step_{s}" / "manifest.json").read_bytes())
        assert "step_1/" not in json.dumps(m.get("references", {})), m.get("references")


# --------------------------------------------------------------------------- object storage


def test_s3_retention_deletes_only_listed_files_and_trusts_only_proven_retired_manifests(s3, tmp_path):
    bucket = s3.make_bucket("ownership")
    url, so = f"s3://{bucket}/run", s3.storage_options
    fs = s3.filesystem()
    kw: Dict[str, Any] = dict(storage_options=so, local_staging_dir=str(tmp_path / "staging"))
    with nostall.CheckpointManager(url, keep_last=1, incremental=True, **kw) as mgr:
        mgr.save(1, _state(1), files={"notes.txt": b"nostall's"})
        manifest = fs.cat_file(f"{bucket}/run/step_1/manifest.json")
        fs.pipe_file(f"{bucket}/run/step_1/eval.json", b"the user's")
        # a copy of step_1 the user keeps (its files under the names the manifest lists, and the manifest
        # under a retired name): nostall never retired it, so it proves nothing
        (listed,) = [f.get("stored") or n for n, f in json.loads(manifest)["side_files"].items()]
        fs.pipe_file(f"{bucket}/run/step_99/{listed}", b"the user's notes")
        fs.pipe_file(f"{bucket}/run/step_99/.retired-{'ab' * 8}.json", manifest)
        mgr.save(2, _state(2))
        mgr.save(3, _state(3))
    assert fs.cat_file(f"{bucket}/run/step_1/eval.json") == b"the user's"
    assert fs.cat_file(f"{bucket}/run/step_99/{listed}") == b"the user's notes"
    left = [p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/run/step_1", refresh=True)]
    assert "manifest.json" not in left and not any(n.startswith("notes.") for n in left), left
    got = nostall.load({"frozen": torch.zeros(256, 64), "w": torch.zeros(16), "step": 0}, f"{url}/step_3",
                       storage_options=so)
    assert torch.equal(got["w"], _state(3)["w"]) and torch.equal(got["frozen"], _state(3)["frozen"])


def test_a_file_named_like_a_proof_that_proves_nothing_stays(tmp_path):
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root)) as mgr:
        mgr.save(1, _state(1))
    mark = root / ".tmp" / f"retired-{'ab' * 16}.nostall"
    mark.write_text("the user's notes, not a proof\n")
    nostall.CheckpointManager(str(root)).close()  # a claim drops only proofs of nothing
    assert mark.read_text() == "the user's notes, not a proof\n"


def test_resaving_a_retired_incremental_step_never_references_its_own_directory(tmp_path):
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root), keep_last=2, incremental=True) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s))  # step 1 retired: 2 and 3 read its frozen piece
        mgr.save(1, _state(9))  # training resumed from an older point saves step 1 again
        assert mgr.steps() == [1, 2, 3]
    m = json.loads((root / "step_1" / "manifest.json").read_bytes())
    assert not any(r.startswith("step_1/") for r in m.get("references", {}))
    _loads_as(str(root / "step_1"), _state(9))
    for s in (2, 3):
        _loads_as(str(root / f"step_{s}"), _state(s))


def test_a_collection_cut_after_its_last_file_is_finished_at_the_next_claim(tmp_path):
    """A crash between the last deletion in a retired step directory and its rmdir leaves it empty, with the
    proof (deleted last): the next claim removes the directory; an empty one without a proof stays."""
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root)) as mgr:
        mgr.save(1, _state(1))
    rid = "cd" * 16
    (root / "step_5").mkdir()
    (root / ".tmp" / f"retired-{rid}.nostall").write_text(f"{rid} step_5\n")
    (root / "step_6").mkdir()  # the user's
    nostall.CheckpointManager(str(root)).close()
    assert not (root / "step_5").exists() and not (root / ".tmp" / f"retired-{rid}.nostall").exists()
    assert (root / "step_6").is_dir()
