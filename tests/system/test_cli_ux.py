"""The command line as a user meets it (issue 16): a run root's ``latest`` file as a path,
``| head``, ``--keys`` before SRC DST, object-storage errors as one line, ``--version``,
bare ``nostall``, ``--storage-options`` errors, imported checkpoints' step, and the
benchmark's progress on stderr."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import nostall
from nostall.tools import cli
from nostall.tools.cli import main as cli_main


def _nostall(*args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nostall", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _run_root(path) -> str:
    root = str(path)
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(3, {"w": torch.ones(4)})
        mgr.save(7, {"w": torch.arange(4.0)})
    return root


# --------------------------------------------------------------------------- 1. a root's `latest` file


def test_inspect_verify_ls_take_a_run_roots_latest_file(tmp_path, capsys):
    root = _run_root(tmp_path / "run")
    latest = os.path.join(root, "latest")
    assert os.path.isfile(latest)
    assert cli_main(["inspect", "--json", latest]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == os.path.join(root, "step_7")
    assert cli_main(["verify", latest]) == 0
    assert f"OK  {os.path.join(root, 'step_7')}" in capsys.readouterr().out
    assert cli_main(["ls", "--json", latest]) == 0
    assert json.loads(capsys.readouterr().out)["latest"] == 7
    # another file is still refused, in one line
    other = tmp_path / "notes.txt"
    other.write_text("x")
    assert cli_main(["inspect", str(other)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_demos_hint_names_commands_that_work(tmp_path, capsys):
    """The demo ends with `try: CLI ls CKPTS; CLI inspect CKPTS` (CKPTS: its run root; CLI: the venv's
    console script, which runs as it stands)."""
    import nostall.tools.reference.demo as demo

    with open(demo.__file__) as f:
        hints = [line for line in f if "(try: {cli}" in line]
    assert len(hints) == 1, hints
    commands = re.findall(r"\{cli\} (\w+) \{ckpts\}", hints[0])
    assert set(commands) >= {"ls", "inspect"}, hints[0]
    root = _run_root(tmp_path / "ckpts")
    for cmd in commands:
        assert cli_main([cmd, root]) == 0, cmd
    capsys.readouterr()
    script = demo.console_script()
    assert os.path.dirname(os.path.abspath(script)) == os.path.dirname(sys.executable) or script == "nostall"
    if script != "nostall":
        assert subprocess.run([script, "ls", root], capture_output=True, timeout=120).returncode == 0


# --------------------------------------------------------------------------- 2. | head -1


def test_output_into_a_closed_pipe_is_quiet_and_exits_0(tmp_path):
    """`nostall inspect --json X | head -1`: no traceback, no error line, exit status 0."""
    ck = str(tmp_path / "many")
    nostall.save({"t": {f"k{i}": torch.zeros(1) for i in range(3000)}}, ck)  # ~500 KB of JSON: > a pipe's buffer
    proc = subprocess.Popen([sys.executable, "-m", "nostall", "inspect", "--json", ck], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()  # as head does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "Broken pipe" not in err and "Exception ignored" not in err, err


# --------------------------------------------------------------------------- 3. --keys


def test_convert_keys_before_src_and_dst(tmp_path, capsys):
    from safetensors.torch import load_file

    ck = str(tmp_path / "ck")
    nostall.save({"model": {"w": torch.ones(2)}, "optim": {"m": torch.zeros(3)}, "extra": {"e": torch.ones(1)}}, ck)
    out = str(tmp_path / "a")
    assert cli_main(["convert", "--keys", "model", ck, out]) == 0, capsys.readouterr().err
    assert sorted(load_file(os.path.join(out, "model.safetensors"))) == ["model.w"]
    for i, keys in enumerate((["--keys", "model,optim"], ["--keys", "model", "--keys", "optim"])):
        out = str(tmp_path / f"b{i}")
        assert cli_main(["convert", *keys, ck, out]) == 0, capsys.readouterr().err
        assert sorted(load_file(os.path.join(out, "model.safetensors"))) == ["model.w", "optim.m"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli_main(["convert", "--help"])
    text = capsys.readouterr().out
    assert "comma-separated" in text and "--keys model,optim" in text
    assert "docs/interop.md" not in text  # not in an installed package


# --------------------------------------------------------------------------- 4. object storage errors


def _no_aws_env() -> dict:
    """No credentials anywhere and an endpoint nothing listens on: botocore fails fast."""
    from tests.dist_harness import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}",
               AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull, AWS_MAX_ATTEMPTS="1",
               AWS_METADATA_SERVICE_TIMEOUT="1", AWS_METADATA_SERVICE_NUM_ATTEMPTS="1")
    env.pop("NOSTALL_DEBUG", None)
    return env


@pytest.mark.parametrize("cmd", ["ls", "inspect"])
def test_s3_without_storage_options_is_one_line(cmd):
    pytest.importorskip("s3fs", reason="needs s3fs")
    res = _nostall(cmd, "s3://missing-bucket/run", env=_no_aws_env())
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nostall {cmd}: FAILED: "), res.stderr
    assert "--storage-options" in lines[0]


def _upload(s3, bucket: str, local_root: str, prefix: str) -> None:
    fs = s3.filesystem()
    for dirpath, _, files in os.walk(local_root):
        for name in sorted(files, key=lambda n: n == "manifest.json"):  # manifests last
            path = os.path.join(dirpath, name)
            fs.put_file(path, f"{bucket}/{prefix}/{os.path.relpath(path, local_root)}")


def test_ls_of_a_missing_s3_root_fails(s3, tmp_path, capsys):
    so = json.dumps(s3.storage_options)
    bucket = s3.make_bucket("uxls")
    assert cli_main(["ls", "s3://missing-bucket/run", "--storage-options", so]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no such bucket 'missing-bucket'" in err, err
    assert cli_main(["ls", f"s3://{bucket}/nothing", "--storage-options", so]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nothing there" in err, err
    # a real root there lists, and its `latest` file names its checkpoint
    _upload(s3, bucket, _run_root(tmp_path / "run"), "run")
    assert cli_main(["ls", "--json", f"s3://{bucket}/run", "--storage-options", so]) == 0
    assert [c["step"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == [3, 7]
    assert cli_main(["inspect", "--json", f"s3://{bucket}/run/latest", "--storage-options", so]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == f"s3://{bucket}/run/step_7"


def test_errors_at_the_boundary_are_one_line_but_interrupts_pass(tmp_path, capsys, monkeypatch):
    ck = str(tmp_path / "ck")
    nostall.save({"w": torch.ones(1)}, ck)

    def boom(args):
        raise RuntimeError("the storage library failed")

    monkeypatch.setattr(cli, "cmd_inspect", boom)
    assert cli_main(["inspect", ck]) == 1
    assert capsys.readouterr().err == "nostall inspect: FAILED: RuntimeError: the storage library failed\n"

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_inspect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli_main(["inspect", ck])


# --------------------------------------------------------------------------- 5. small things


def test_version_and_bare_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"nostall {nostall.__version__}"
    assert cli_main([]) == 2
    err = capsys.readouterr().err
    for cmd, words in (("inspect", "what a checkpoint holds"), ("verify", "checksum"), ("ls", "committed"),
                       ("convert", "safetensors"), ("bench", "DCP")):
        assert re.search(rf"^\s+{cmd}\s+.*{words}", err, re.M), (cmd, err)


def test_bare_command_in_a_fresh_interpreter():
    res = _nostall()
    assert res.returncode == 2 and "inspect" in res.stderr and "show what a checkpoint holds" in res.stderr


@pytest.mark.parametrize("cmd", ["inspect", "verify", "ls", "convert"])
def test_bad_storage_options_name_the_option(tmp_path, capsys, cmd):
    args = [cmd, str(tmp_path), "--storage-options", "{bad"] + ([str(tmp_path / "out")] if cmd == "convert" else [])
    with pytest.raises(SystemExit) as e:
        cli_main(args)
    assert e.value.code == 2
    assert "argument --storage-options: not valid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main([cmd, str(tmp_path), "--storage-options", "[1]"] + args[4:])
    assert "--storage-options: not a JSON object" in capsys.readouterr().err


def test_bench_bad_storage_options_name_the_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--storage-options", "{bad"])
    assert e.value.code == 2 and "argument --storage-options: not valid JSON" in capsys.readouterr().err


def test_inspect_of_an_imported_checkpoint_says_no_step(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    src = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=src, no_dist=True)
    ns = str(tmp_path / "ns")
    assert cli_main(["convert", "--from", "dcp", src, ns, "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", ns]) == 0
    out = capsys.readouterr().out
    assert "None" not in out
    assert re.search(r"^step\s+none recorded", out, re.M), out
    assert cli_main(["inspect", "--json", ns]) == 0
    assert json.loads(capsys.readouterr().out)["step"] is None  # machine-readable: still null


# --------------------------------------------------------------------------- 6. bench


def test_bench_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--ranks N processes" in out and "(default: 2)" in out
    assert "--mb-per-rank MIB MiB of training state per rank" in out and "(default: 512)" in out
    assert "(default: 3)" in out


def test_bench_prints_progress_and_no_dcp_info_lines(tmp_path):
    """The smallest run of tests/test_bench.py (2 ranks x 2 MiB, 1 rep), with DCP's process executor:
    the system whose background process logged ~20 INFO lines."""
    res = _nostall("bench", "--ranks", "2", "--mb-per-rank", "2", "--reps", "1", "--systems", "dcp_async_process",
                   "--no-load", "--no-train", "--dir", str(tmp_path / "b"), timeout=280)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert lines and lines[0].startswith("[bench] starting 2 ranks x 2 MiB"), res.stderr
    for system in ("copy", "write", "dcp_async_process"):
        assert any(re.match(rf"\[bench\] {system} first run .*: stall [\d.]+ ms", x) for x in lines), res.stderr
        assert any(re.match(rf"\[bench\] {system} rep 1/1: stall [\d.]+ ms, until durable", x) for x in lines)
    assert not [x for x in lines if "INFO" in x], res.stderr
    assert "dcp_async_process" in res.stdout  # the table
    assert not res.stdout.startswith("[bench]")
