"""The command line's messages for paths that name no checkpoint, and the time ``ls`` shows."""

from __future__ import annotations

import calendar
import json
import os
from pathlib import Path

import pytest
import torch

import nostall
from nostall.core.format import MANIFEST_NAME
from nostall.tools.argtypes import parse_size
from nostall.tools.cli import main as cli_main


def _run(root: Path, steps=(1, 2, 3)) -> None:
    with nostall.CheckpointManager(str(root), async_save=False, keep_last=None) as mgr:
        for s in steps:
            mgr.save(s, {"w": torch.full((8,), float(s))})


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_a_path_with_nothing_there_says_so(tmp_path: Path, capsys, cmd: str) -> None:
    missing = tmp_path / "no" / "run"
    assert cli_main([cmd, str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"{missing}: no such directory" in err
    assert "interrupted save" not in err


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_a_step_the_run_root_does_not_hold_lists_the_steps_it_does(tmp_path: Path, capsys, cmd: str) -> None:
    root = tmp_path / "run"
    _run(root)
    assert cli_main([cmd, str(root / "step_99")]) == 1
    err = capsys.readouterr().err
    assert f"{root / 'step_99'}: no committed checkpoint there" in err
    assert f"{root} is a run root holding steps 1, 2, 3 (latest 3)" in err
    assert f"pass {root / 'step_3'}" in err


def test_an_uncommitted_step_directory_lists_the_committed_steps(tmp_path: Path, capsys) -> None:
    root = tmp_path / "run"
    _run(root, steps=(1, 2))
    (root / "step_7").mkdir()  # e.g. a copy cut short: no manifest
    assert cli_main(["inspect", str(root / "step_7")]) == 1
    assert "holding steps 1, 2 (latest 2)" in capsys.readouterr().err


def test_ls_shows_the_manifest_files_time_not_the_directorys(tmp_path: Path, capsys) -> None:
    root = tmp_path / "run"
    _run(root, steps=(1, 2))
    saved = calendar.timegm((2001, 2, 3, 4, 5, 6, 0, 0, 0))
    for step in (1, 2):
        os.utime(root / f"step_{step}" / MANIFEST_NAME, (saved, saved))
        os.utime(root / f"step_{step}", (saved + 10**8, saved + 10**8))  # a directory touched later
    assert cli_main(["ls", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "manifest mtime (UTC)" in lines[1]  # the column says what the time is
    assert all("2001-02-03T04:05:06Z" in line for line in lines[2:4]), lines
    assert cli_main(["ls", "--json", str(root)]) == 0
    assert [c["modified"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == ["2001-02-03T04:05:06Z"] * 2


def test_parse_size() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("64KiB") == 64 << 10
    assert parse_size("5GB") == 5 << 30
    assert parse_size(" 1.5M ") == 3 << 19
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
