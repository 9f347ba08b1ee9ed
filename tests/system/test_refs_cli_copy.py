"""Issue 24, defects 10, 12 and 13, on real checkpoints written by real saves, through the real CLI entry point:

* 10: a manifest whose reference is not ``step_<N>/<file>`` of another step of the same root (a non-step
  sibling directory, the checkpoint's own directory, a step name that is not one) is refused as damaged by
  every reader (load, verify, inspect, ls, copy, export, the DCP reader), naming the manifest and the reference;
* 12: ``inspect`` and ``ls`` of an incremental checkpoint whose base is gone name the missing file and exit 1
  (``ls`` still lists the other checkpoints);
* 13: ``copy`` refuses a destination inside its source (or equal to it through a symbolic link, or holding
  the source, or inside a checkpoint the source reads from), before anything is written; on object storage too.

No timing."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import nostall
from nostall.tools.cli import main as cli_main
from nostall.interop.copy import copy_checkpoint
from nostall.core.format import MANIFEST_NAME
from nostall.loading.manifests import read_manifest
from nostall.loading.verify import check_checkpoint

FROZEN = torch.randn(64, 64, generator=torch.Generator().manual_seed(24))  # 16 KiB, never changes


def _state(step: int) -> dict:
    return {"frozen": FROZEN, "head": torch.full((16,), float(step)), "step": step}


def _template() -> dict:
    return {"frozen": torch.empty(64, 64), "head": torch.empty(16), "step": 0}


def _snapshot(top: str) -> dict:
    """Every path under ``top`` (links not followed) with its size and modification time."""
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_size if n in files else 0, st.st_mtime_ns)
    return out


@pytest.fixture
def root(tmp_path) -> str:
    """An incremental root (``full_every=2``): steps 1 and 3 full, step 2 reads 'frozen' from step 1's file,
    step 4 from step 3's."""
    r = str(tmp_path / "run")
    with nostall.CheckpointManager(r, incremental=True, full_every=2) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(s, _state(s))
    for s, base in ((1, None), (2, 1), (3, None), (4, 3)):
        refs = read_manifest(os.path.join(r, f"step_{s}")).references
        assert [n.split("/")[0] for n in refs] == ([f"step_{base}"] if base else []), (s, refs)
    return r


# --------------------------------------------------------------------------- 10. references beyond the spec


def _point_reference_at(root: str, step: int, where: str) -> str:
    """Move step ``step``'s one reference to ``<where>/<same file name>`` (a copy of the real file put there,
    so that the bytes are right and only the reference's place is wrong); the manifest stays valid otherwise.
    Returns the new reference."""
    mpath = os.path.join(root, f"step_{step}", MANIFEST_NAME)
    doc = json.load(open(mpath))
    (old,) = doc["references"]
    new = f"{where}/{old.split('/')[1]}"
    os.makedirs(os.path.join(root, where), exist_ok=True)
    shutil.copyfile(os.path.join(root, old), os.path.join(root, new))
    doc["references"] = {new: doc["references"][old]}
    for tensors in [doc["tensors"]] + [r["tensors"] for r in doc["per_rank"]]:
        for t in tensors.values():
            for p in t["pieces"]:
                if p["file"] == old:
                    p["file"] = new
    with open(mpath, "w") as f:
        f.write(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")
    return new


@pytest.mark.parametrize("where", ["userdir", "step_2", "step_01", "step_-1"],
                         ids=["non-step-sibling", "own-directory", "padded-step", "negative-step"])
def test_a_reference_outside_the_spec_is_refused_by_every_reader(root, tmp_path, where, capsys):
    bad = _point_reference_at(root, 2, where)
    ck = os.path.join(root, "step_2")
    mpath = os.path.join(ck, MANIFEST_NAME)

    def refused(text: str) -> None:
        assert bad in text and mpath in text, text

    with pytest.raises(nostall.CheckpointCorruptError) as e:
        nostall.load(_template(), ck)
    refused(str(e.value))
    with pytest.raises(nostall.CheckpointCorruptError) as e:
        nostall.CheckpointManager(root).load(_template(), step=2)
    refused(str(e.value))
    with pytest.raises(nostall.CheckpointCorruptError) as e:
        check_checkpoint(ck)
    refused(str(e.value))
    with pytest.raises(nostall.CheckpointCorruptError) as e:
        copy_checkpoint(ck, str(tmp_path / "api-copy"))
    refused(str(e.value))
    assert not os.path.exists(tmp_path / "api-copy")

    for argv in (["verify", ck], ["inspect", ck], ["inspect", "--json", ck], ["copy", ck, str(tmp_path / "c")],
                 ["convert", ck, str(tmp_path / "hf")]):
        assert cli_main(argv) == 1, argv
        captured = capsys.readouterr()
        refused(captured.err)
        assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert not os.path.exists(tmp_path / "c") and not os.path.exists(tmp_path / "hf")

    # ls: the damaged checkpoint is marked, the others listed as they are; exit status 1
    assert cli_main(["ls", "--json", root]) == 1
    out = json.loads(capsys.readouterr().out)
    by_step = {e["step"]: e for e in out["checkpoints"]}
    assert sorted(by_step) == [1, 2, 3, 4]
    refused(by_step[2]["error"])
    assert all(by_step[s].get("error") is None and by_step[s]["tensors"] == 2 for s in (1, 3, 4))
    assert cli_main(["ls", root]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("step_2 "))
    assert "UNREADABLE" in line and bad in line

    import torch.distributed.checkpoint as dcp

    state = {"frozen": torch.zeros(64, 64), "head": torch.zeros(16)}
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException (a BaseException), carrying ours
        dcp.load(state, storage_reader=nostall.dcp.Reader(ck), no_dist=True)
    assert "CheckpointCorruptError" in str(e.value) or "the manifest is damaged" in str(e.value), e.value
    assert bad in str(e.value), e.value

    # the intact checkpoints of the root still load
    assert torch.equal(nostall.load(_template(), os.path.join(root, "step_4"))["frozen"], FROZEN)


def test_a_reference_into_the_checkpoints_own_directory_is_refused_when_loading(root, capsys):
    """A manifest that records another step than its directory's name (a directory renamed by hand): the rule
    of the manifest alone cannot see that ``step_2/...`` is its own directory; the loader does."""
    bad = _point_reference_at(root, 2, "step_2")
    mpath = os.path.join(root, "step_2", MANIFEST_NAME)
    doc = json.load(open(mpath))
    doc["step"] = 7
    with open(mpath, "w") as f:
        f.write(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")
    ck = os.path.join(root, "step_2")
    assert read_manifest(ck).step == 7
    with pytest.raises(nostall.CheckpointCorruptError) as e:
        nostall.load(_template(), ck)
    assert bad in str(e.value) and "own directory" in str(e.value)
    assert cli_main(["verify", ck]) == 1
    assert bad in capsys.readouterr().err
    assert cli_main(["inspect", ck]) == 1
    assert bad in capsys.readouterr().err


def test_a_nested_or_dotted_reference_is_refused(root):
    """What the rule already refused stays refused: more than one folder, ``..``, an absolute path."""
    ck = os.path.join(root, "step_2")
    mpath = os.path.join(ck, MANIFEST_NAME)
    raw = open(mpath).read()
    (old,) = json.loads(raw)["references"]
    for bad in (f"step_1/sub/{old.split('/')[1]}", f"../run/{old}", f"/{old}", f"step_1/.{old.split('/')[1]}"):
        with open(mpath, "w") as f:
            f.write(raw.replace(json.dumps(old), json.dumps(bad)))
        with pytest.raises(nostall.CheckpointCorruptError) as e:
            read_manifest(ck)
        assert bad in str(e.value) and mpath in str(e.value)


# --------------------------------------------------------------------------- 12. a base that is gone


def test_inspect_and_ls_name_a_referenced_file_that_is_gone(root, capsys):
    (ref,) = read_manifest(os.path.join(root, "step_2")).references
    assert ref.startswith("step_1/")
    shutil.rmtree(os.path.join(root, "step_1"))  # the base of step 2, deleted by hand
    gone = os.path.join(root, ref)
    ck = os.path.join(root, "step_2")

    assert cli_main(["inspect", ck]) == 1
    captured = capsys.readouterr()
    assert "checkpoint  " + ck in captured.out  # what it holds is still shown
    assert gone in captured.err and "missing" in captured.err

    assert cli_main(["inspect", "--json", ck]) == 1
    s = json.loads(capsys.readouterr().out)
    assert s["ok"] is False and len(s["problems"]) == 1 and gone in s["problems"][0]
    assert [r["name"] for r in s["references"]] == [ref]

    # an intact incremental checkpoint of the same root: as before
    assert cli_main(["inspect", "--json", os.path.join(root, "step_4")]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["ok"] is True and s["problems"] == []

    # ls: step 2 marked broken with the file it misses, steps 3 and 4 listed as they are; exit status 1
    assert cli_main(["ls", root]) == 1
    lines = capsys.readouterr().out.splitlines()
    step2 = next(x for x in lines if x.strip().startswith("step_2 "))
    assert "BROKEN" in step2 and gone in step2 and "reads 16.0 KiB from step_1" not in step2
    for s in (3, 4):
        line = next(x for x in lines if x.strip().startswith(f"step_{s} "))
        assert "BROKEN" not in line and "UNREADABLE" not in line
    assert "reads 16.0 KiB from step_3" in next(x for x in lines if x.strip().startswith("step_4 "))

    assert cli_main(["ls", "--json", root]) == 1
    out = json.loads(capsys.readouterr().out)
    by_step = {e["step"]: e for e in out["checkpoints"]}
    assert sorted(by_step) == [2, 3, 4]
    assert by_step[2]["broken"] is True and len(by_step[2]["problems"]) == 1 and gone in by_step[2]["problems"][0]
    assert all(by_step[s]["broken"] is False and by_step[s]["problems"] == [] for s in (3, 4))
    assert by_step[4]["references"] == ["step_3"] and by_step[4]["referenced_bytes"] == FROZEN.numel() * 4

    # a referenced file that is there with another size is named too (a stat, no data read)
    (ref4,) = read_manifest(os.path.join(root, "step_4")).references
    with open(os.path.join(root, ref4), "ab") as f:
        f.write(b"x")
    assert cli_main(["inspect", os.path.join(root, "step_4")]) == 1
    err = capsys.readouterr().err
    assert os.path.join(root, ref4) in err and "size" in err
    # verify still says the same as before
    assert cli_main(["verify", ck]) == 1
    assert gone in capsys.readouterr().err


def test_ls_of_a_sound_root_exits_0(root, capsys):
    assert cli_main(["ls", "--json", root]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(e["broken"] is False and e["problems"] == [] for e in out["checkpoints"])


# --------------------------------------------------------------------------- 13. copy into itself


def test_copy_refuses_a_destination_inside_its_source(tmp_path, capsys):
    r = str(tmp_path / "run")
    with nostall.CheckpointManager(r) as mgr:
        mgr.save(3, _state(3))
    src = os.path.join(r, "step_3")
    before = _snapshot(str(tmp_path))

    assert cli_main(["copy", src, os.path.join(src, "sub")]) == 1
    err = capsys.readouterr().err
    assert "inside" in err and src in err and len(err.strip().splitlines()) == 1, err
    assert _snapshot(str(tmp_path)) == before

    with pytest.raises(nostall.CheckpointSaveError, match="inside"):
        copy_checkpoint(src, os.path.join(src, "deeper", "sub"))
    with pytest.raises(nostall.CheckpointSaveError, match="inside"):
        copy_checkpoint(r, os.path.join(src, "sub"))  # a run root: its latest, which is step 3
    assert _snapshot(str(tmp_path)) == before

    # through a symbolic link to the root: the real paths are compared
    os.symlink(r, str(tmp_path / "alias"))
    before = _snapshot(str(tmp_path))
    alias = os.path.join(str(tmp_path / "alias"), "step_3")
    assert cli_main(["copy", src, os.path.join(alias, "sub")]) == 1
    assert "inside" in capsys.readouterr().err
    assert cli_main(["copy", "--overwrite", src, alias]) == 1  # the same directory under another name
    assert "is the checkpoint being copied" in capsys.readouterr().err
    assert _snapshot(str(tmp_path)) == before
    assert torch.equal(nostall.load(_template(), src)["head"], torch.full((16,), 3.0))


def test_copy_refuses_a_destination_holding_its_source(tmp_path, capsys):
    outer = str(tmp_path / "outer")
    nostall.save(_state(1), outer)
    inner = os.path.join(outer, "inner")
    nostall.save(_state(2), inner)
    before = _snapshot(str(tmp_path))
    assert cli_main(["copy", "--overwrite", inner, outer]) == 1
    err = capsys.readouterr().err
    assert "inside" in err and inner in err and outer in err, err
    assert _snapshot(str(tmp_path)) == before
    assert torch.equal(nostall.load(_template(), inner)["head"], torch.full((16,), 2.0))


def test_copy_refuses_a_destination_inside_a_checkpoint_it_reads(root, tmp_path, capsys):
    before = _snapshot(str(tmp_path))
    assert cli_main(["copy", os.path.join(root, "step_2"), os.path.join(root, "step_1", "sub")]) == 1
    err = capsys.readouterr().err
    assert "inside" in err and os.path.join(root, "step_1") in err, err
    assert _snapshot(str(tmp_path)) == before
    # beside them is fine
    assert cli_main(["copy", os.path.join(root, "step_2"), str(tmp_path / "c")]) == 0
    assert cli_main(["verify", str(tmp_path / "c")]) == 0


def test_copy_refuses_a_url_inside_its_source_on_object_storage(tmp_path, s3, capsys):
    bucket = s3.make_bucket("nestcopy")
    so = json.dumps(s3.storage_options)
    local = str(tmp_path / "ck")
    nostall.save(_state(5), local)
    url = f"s3://{bucket}/models/step_5"
    assert cli_main(["copy", local, url, "--storage-options", so]) == 0
    capsys.readouterr()
    fs = s3.filesystem()
    before = sorted(fs.find(bucket))
    for dst in (f"{url}/sub", f"{url}/sub/", f"{url}/a/b", f"{url}/", f"{url}//"):
        assert cli_main(["copy", "--overwrite", url, dst, "--storage-options", so]) == 1, dst
        err = capsys.readouterr().err
        assert ("inside" if dst.rstrip("/") != url else "is the checkpoint being copied") in err, (dst, err)
        fs.invalidate_cache()
        assert sorted(fs.find(bucket)) == before, dst
    # beside it is fine
    assert cli_main(["copy", url, f"s3://{bucket}/models/step_5_copy", "--storage-options", so]) == 0
