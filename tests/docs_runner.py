"""Runs the fenced code blocks of README.md and docs/*.md (driven by tests/system/test_docs.py).

What a fence's info string means (the first word is the language, as for
any Markdown renderer; the rest is read here):

    ```python            run, standing alone: a fresh process and an empty namespace
                         (see "Every block stands alone" below), in the file's working
                         directory, so it sees the files earlier blocks wrote but none
                         of their names.
    ```python ranks=2    run on 2 gloo ranks: 2 fresh processes with torchrun's
                         environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
                         LOCAL_RANK) in the file's working directory. The block
                         starts from an empty namespace; if it does not call
                         init_process_group itself, the runner does ("gloo") first.
                         The group is destroyed afterwards.
    ```sh                run its ``nostall ...`` command lines (the CLI), in order with
                         the python blocks, in the same working directory, so they see
                         the checkpoints those made. Every command line must be one.
                         A plain one calls the console script's entry point
                         (nostall.tools.cli:main) in the block's process; one with shell
                         syntax runs in bash. A nonzero exit fails the block.
    ```text              an output sample, a directory tree, a schema: not code.
    ```LANG norun: why   not run, for the reason given (a reason is required).

Any other fence (no language, ``json``, a ``sh`` block with other commands...)
is an error: every block either runs or says why not.

Hidden setup: ``<!-- setup: CODE -->`` right before a fence is python run
first, in the block's namespace (for a ranks block, on every rank). It sees
``_docs``, whose ``s3(bucket)`` creates ``bucket`` on a local S3-compatible
server (moto, tests/s3_server.py: the test session's server when the test
passes its URL in NOSTALL_DOCS_S3_URL, else one the runner starts for the
file), puts test credentials in the environment and returns the endpoint URL.

Every block stands alone: a reader may copy any one block and run it. Each
python and sh block runs in a process of its own, forked from the file's
runner before any block ran in it (the runner has only imported torch,
nostall and the modules the file's blocks import, so that a block does not
pay for those imports again), with an empty namespace: a block that uses a
name an earlier block defined fails with a NameError. Files (checkpoints an
earlier block wrote) are shared through the working directory, as they would
be for a reader running the blocks one after the other.

Notebook mode: a file with the line ``<!-- docs-runner: notebook -->`` runs
its python and sh blocks in order in the runner's process and one namespace,
each block seeing the names earlier ones defined (for a document written as
one continuing session).

Each file runs in its own process (``python -m tests.docs_runner FILE WORKDIR RESULT``),
so nothing of its blocks leaks into the test process. A failure names the
file, the line of the block's first line of code, and the traceback: code is
compiled under the Markdown file's path at its own line numbers, so
tracebacks point into the file. The file stops at its first failure.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import textwrap
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS_TIMEOUT_S = 90.0  # a ranks block (2 process starts + the block); a hang guard, not a speed check
SH_TIMEOUT_S = 60.0  # one CLI command
FAILED_RANK_GRACE_S = 5.0  # after one rank failed, how long the others get before they are killed
BLOCK_TIMEOUT_S = 180.0  # one python or sh block in its own process; a hang guard, not a speed check
NOTEBOOK = "<!-- docs-runner: notebook -->"  # a file's line: its blocks share one process and namespace

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_SETUP = re.compile(r"<!--\s*setup:(?P<code>.*?)-->\s*$", re.S)
_NORUN = re.compile(r"\bnorun\b:?\s*(?P<why>.*)$")
_RANKS = re.compile(r"\branks=(?P<n>\d+)\b")
_IMPORT = re.compile(r"^\s*(?:from\s+(?P<src>[\w.]+)\s+import\b|import\s+(?P<mods>[\w., ]+))", re.M)


@dataclass
class Block:
    path: str  # the Markdown file
    line: int  # 1-based line of the opening fence
    info: str  # the info string after the fence
    code: str  # the block's text
    setup: Optional[str] = None  # hidden setup code, from the comment right before the fence
    setup_line: int = 0  # 1-based line where the setup code starts

    @property
    def lang(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def code_line(self) -> int:
        return self.line + 1

    def where(self) -> str:
        return f"{os.path.relpath(self.path, REPO)}:{self.code_line}"


def parse(path: str) -> List[Block]:
    """The fenced code blocks of a Markdown file, with their hidden setup comments."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, info, start = m.group("fence"), m.group("info").strip(), i
        body: List[str] = []
        i += 1
        while i < len(lines):
            c = _FENCE.match(lines[i])
            if c is not None and c.group("fence")[0] == fence[0] and len(c.group("fence")) >= len(fence) \
                    and not c.group("info").strip():
                break
            body.append(lines[i])
            i += 1
        block = Block(path, start + 1, info, "\n".join(body) + "\n")
        _attach_setup(block, lines, start)
        blocks.append(block)
        i += 1
    return blocks


def _attach_setup(block: Block, lines: List[str], fence_index: int) -> None:
    """The ``<!-- setup: ... -->`` comment that ends on the line right before the fence, if any."""
    j = fence_index - 1
    if j < 0 or not lines[j].rstrip().endswith("-->"):
        return
    k = j
    while k > 0 and "<!--" not in lines[k]:
        k -= 1
    m = _SETUP.search("\n".join(lines[k:j + 1]))
    if m is None:
        return
    code, line = m.group("code"), k + 1
    if "\n" in code and not code.split("\n", 1)[0].strip():  # the code starts on the next line
        code, line = code.split("\n", 1)[1], k + 2
    block.setup, block.setup_line = textwrap.dedent(code.strip(" ")).rstrip() + "\n", line


def sh_commands(block: Block) -> List[Tuple[int, str]]:
    """(line, command) of each command of a sh block: continuation lines joined, comments and blanks left out."""
    out: List[Tuple[int, str]] = []
    pending: Optional[Tuple[int, str]] = None
    for n, raw in enumerate(block.code.split("\n"), start=block.code_line):
        line = raw.rstrip()
        if pending is not None:
            start, text = pending
            text += " " + line.strip()
        else:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start, text = n, line.strip()
        if text.endswith("\\"):
            pending = (start, text[:-1].rstrip())
            continue
        pending = None
        out.append((start, text))
    if pending is not None:
        out.append(pending)
    return out


def classify(block: Block) -> Tuple[str, str]:
    """("python" | "ranks" | "sh" | "skip" | "error", detail)."""
    m = _NORUN.search(block.info)
    if m is not None:
        why = m.group("why").strip()
        if not why:
            return "error", "`norun` needs a reason in the info string (```LANG norun: why)"
        return "skip", why
    lang = block.lang
    if lang == "text":
        return "skip", "text: not code"
    if lang == "python":
        r = _RANKS.search(block.info)
        if r is not None:
            n = int(r.group("n"))
            if n < 1:
                return "error", f"ranks={n}"
            return "ranks", str(n)
        return "python", ""
    if lang == "sh":
        commands = sh_commands(block)
        others = [c for _, c in commands if not c.startswith("nostall ")]
        if others:
            return "error", (f"sh block with commands other than `nostall ...` ({others[0]!r}): "
                             "mark it ```sh norun: <why>")
        if not commands:
            return "error", "sh block without a command: mark it ```text or ```sh norun: <why>"
        return "sh", ""
    if not lang:
        return "error", "fence without a language: use ```text for samples, or mark it ```LANG norun: <why>"
    return "error", f"```{lang} blocks are not run: mark it ```{lang} norun: <why>, or ```text"


def problems(blocks: List[Block]) -> List[str]:
    out = []
    for b in blocks:
        kind, detail = classify(b)
        if kind == "error":
            out.append(f"{os.path.relpath(b.path, REPO)}:{b.line}: {detail}")
    return out


def runnable(blocks: List[Block]) -> bool:
    return any(classify(b)[0] in ("python", "ranks", "sh") for b in blocks)


# --------------------------------------------------------------------------- in the file's process


class _DocsHelpers:
    """``_docs`` in hidden setups."""

    def __init__(self) -> None:
        self._s3: Any = None
        self._buckets: set = set()

    def s3(self, bucket: str = "bucket") -> str:
        """A local S3-compatible server with ``bucket`` in it; returns the endpoint URL.

        The server is the test session's (``NOSTALL_DOCS_S3_URL``, from the ``s3`` fixture) when there is
        one, else one started for this file (tests/s3_server.py).
        """
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        url = os.environ.get("NOSTALL_DOCS_S3_URL")
        if url is None:
            if self._s3 is None:
                from tests.s3_server import S3Server

                self._s3 = S3Server()
            url = self._s3.url
        if bucket not in self._buckets:
            import boto3

            client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
            try:
                client.create_bucket(Bucket=bucket)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
            self._buckets.add(bucket)
        return url

    def serve(self) -> None:
        """Start this file's S3-compatible server now, unless the test session's is given, and name it in
        NOSTALL_DOCS_S3_URL for the blocks' processes."""
        if os.environ.get("NOSTALL_DOCS_S3_URL") is None:
            from tests.s3_server import S3Server

            self._s3 = S3Server()
            os.environ["NOSTALL_DOCS_S3_URL"] = self._s3.url

    def close(self) -> None:
        if self._s3 is not None:
            self._s3.stop()


def _compiled(code: str, path: str, line: int) -> Any:
    """``code`` compiled under ``path`` so that its first line is line ``line`` of the file."""
    return compile("\n" * (line - 1) + code, path, "exec")


class BlockFailed(Exception):
    def __init__(self, block: Block, line: int, error: str) -> None:
        super().__init__(error)
        self.block, self.line, self.error = block, line, error


def _run_python(block: Block, ns: Dict[str, Any]) -> None:
    for code, line in ((block.setup, block.setup_line), (block.code, block.code_line)):
        if code is None:
            continue
        try:
            exec(_compiled(code, block.path, line), ns)
        except BaseException:
            what = "hidden setup" if line != block.code_line else "block"
            raise BlockFailed(block, block.code_line, f"{what} failed:\n{traceback.format_exc()}") from None


_SHELL_OPS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>&1"}


def _run_sh(block: Block, workdir: str) -> None:
    """Each command of the block, in order. A plain ``nostall ARGS`` line calls the console script's
    entry point (``nostall.tools.cli:main``) in this process, which has torch imported already; a line
    with shell syntax (pipes, redirections) goes through bash with this venv's ``nostall``."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for line, command in sh_commands(block):
        print(f"$ {command}", flush=True)
        argv = shlex.split(command, comments=True)
        if not _SHELL_OPS.intersection(argv) and not any("$" in a or "*" in a for a in argv):
            from nostall.tools.cli import main

            try:
                rc = main(argv[1:])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                raise BlockFailed(block, line, f"`{command}` raised:\n{traceback.format_exc()}") from None
            sys.stdout.flush()
            if rc != 0:
                raise BlockFailed(block, line, f"`{command}` exited with {rc} (its output is above)")
            continue
        try:
            p = subprocess.run(["bash", "-c", "set -o pipefail; " + command], cwd=workdir, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=SH_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise BlockFailed(block, line,
                              f"`{command}` did not finish within {SH_TIMEOUT_S:g}s:\n{e.output or ''}") from None
        print(p.stdout, end="", flush=True)
        if p.returncode != 0:
            raise BlockFailed(block, line, f"`{command}` exited with {p.returncode}:\n{p.stdout}")


def _run_ranks(block: Block, n: int, workdir: str) -> None:
    from tests.dist_harness import free_port

    tmp = tempfile.mkdtemp(prefix="nostall-docs-ranks-")
    try:
        spec = os.path.join(tmp, "block.json")
        with open(spec, "w") as f:
            json.dump({"path": block.path, "code": block.code, "code_line": block.code_line,
                       "setup": block.setup, "setup_line": block.setup_line}, f)
        port = free_port()
        procs = []
        for r in range(n):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n),
                       LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
            out = os.path.join(tmp, f"rank{r}.json")
            procs.append((r, out, subprocess.Popen([sys.executable, "-m", "tests.docs_runner", "--rank", spec, out],
                                                  cwd=workdir, env=env)))
        deadline = time.monotonic() + RANKS_TIMEOUT_S
        failed_at: Optional[float] = None
        errors: Dict[int, str] = {}
        while any(p.poll() is None for _, _, p in procs):
            now = time.monotonic()
            for _, _, p in procs:
                if p.poll() not in (None, 0) and failed_at is None:
                    failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + FAILED_RANK_GRACE_S):
                for r, _, p in procs:
                    if p.poll() is None:
                        p.kill()
                        errors[r] = ("did not finish within the runner's bound" if failed_at is None
                                     else "still running after another rank failed: killed")
                for _, _, p in procs:
                    p.wait()
                break
            time.sleep(0.05)
        for r, out, p in procs:
            if r in errors:
                continue
            try:
                with open(out) as f:
                    result = json.load(f)
            except (OSError, ValueError):
                errors[r] = f"exited with code {p.returncode} without a result"
                continue
            if result["error"] is not None:
                errors[r] = result["error"]
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{errors[r].rstrip()}" for r in sorted(errors))
            raise BlockFailed(block, block.code_line, f"{len(errors)} of {n} ranks failed:\n{text}")
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _rank_main(spec_path: str, out_path: str) -> None:
    """One rank of a ``ranks=N`` block (torchrun's environment is set by the launcher)."""
    with open(spec_path) as f:
        spec = json.load(f)
    error: Optional[str] = None
    dist: Any = None
    try:
        import torch.distributed as dist

        if "init_process_group(" not in spec["code"]:
            dist.init_process_group("gloo")
        ns: Dict[str, Any] = {"__name__": "__main__", "_docs": _DocsHelpers()}
        if spec["setup"] is not None:
            exec(_compiled(spec["setup"], spec["path"], spec["setup_line"]), ns)
        exec(_compiled(spec["code"], spec["path"], spec["code_line"]), ns)
    except BaseException:
        error = traceback.format_exc()
    finally:
        if dist is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                error = error or traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump({"error": error}, f)
    sys.exit(0 if error is None else 1)


def notebook(path: str) -> bool:
    """Whether the file asks for notebook mode (its blocks in one process and namespace)."""
    with open(path, encoding="utf-8") as f:
        return any(line.strip() == NOTEBOOK for line in f)


def _run_block(b: Block, kind: str, ns: Dict[str, Any], workdir: str) -> None:
    """A python or sh block (its hidden setup first) in namespace ``ns``, in this process."""
    if kind == "python":
        _run_python(b, ns)
    else:
        if b.setup is not None:
            _run_python(Block(b.path, b.line, "python", "", b.setup, b.setup_line), ns)
        _run_sh(b, workdir)


def _warm_imports(blocks: List[Block]) -> None:
    """Import torch, nostall, the CLI and the modules the file's python blocks import, in the runner,
    before any block runs: each block's process is forked from it and finds them imported. A module
    that fails to import is left to the block that imports it (it fails there, with its own line)."""
    names = {"torch", "torch.distributed", "torch._dynamo", "nostall", "nostall.tools.cli"}  # an optimizer's
    # first step imports torch._dynamo (about 800 modules)
    for b in blocks:
        if classify(b)[0] != "python":
            continue
        for m in _IMPORT.finditer(b.code):
            if m.group("src"):
                names.add(m.group("src"))
            else:
                names.update(part.split()[0] for part in m.group("mods").split(",") if part.strip())
    import importlib

    for name in sorted(names):
        try:
            importlib.import_module(name)
        except Exception:
            pass
    import nostall

    for public in nostall.__all__:  # nostall imports the modules behind its public names on first use
        getattr(nostall, public)
    import gc

    gc.collect()
    gc.freeze()  # the forked blocks' collections then skip (and do not copy-on-write) the runner's objects


def _in_own_process(b: Block, kind: str, workdir: str) -> None:
    """Run a python or sh block in a child forked from this runner, with an empty namespace; raise its
    failure here. The child closes what the block left open (pending saves, process groups) before it
    exits, and is killed if it runs past BLOCK_TIMEOUT_S."""
    fd, out = tempfile.mkstemp(prefix="nostall-docs-block-", suffix=".json")
    os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the block's process: never returns into the runner's loop
        code = 1
        try:
            helpers = _DocsHelpers()
            ns: Dict[str, Any] = {"__name__": "__main__", "_docs": helpers}
            failure: Optional[Dict[str, Any]] = None
            try:
                _run_block(b, kind, ns, workdir)
            except BlockFailed as e:
                failure = {"line": e.line, "error": e.error}
            except BaseException:
                failure = {"line": b.code_line, "error": traceback.format_exc()}
            try:
                _finish(ns)
            except BaseException:
                failure = failure or {"line": b.code_line, "error": "closing what the block left open failed:\n"
                                                                    + traceback.format_exc()}
            helpers.close()
            with open(out, "w") as f:
                json.dump({"failure": failure}, f)
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise BlockFailed(b, b.code_line, f"did not finish within the runner's bound ({BLOCK_TIMEOUT_S:g}s)")
            time.sleep(0.02)
        try:
            with open(out) as f:
                failure = json.load(f)["failure"]
        except (OSError, ValueError):
            raise BlockFailed(b, b.code_line, "the block's process ended without a result") from None
        if failure is not None:
            raise BlockFailed(b, failure["line"], failure["error"])
    finally:
        os.unlink(out)


def run_file(path: str, workdir: str, result_path: str) -> None:
    """Run every runnable block of ``path`` in order, with ``workdir`` as the working directory: each
    in a process of its own (see the module's docstring), or all in this one (notebook mode).

    Stops at the first failure. Writes ``{"ran": [lines], "failure": null | {"line", "error"},
    "mode": "standalone" | "notebook"}`` to ``result_path``.
    """
    blocks = parse(path)
    helpers = _DocsHelpers()
    ns: Dict[str, Any] = {"__name__": "__main__", "_docs": helpers}
    shared = notebook(path)
    result: Dict[str, Any] = {"ran": [], "failure": None, "mode": "notebook" if shared else "standalone"}
    old = os.getcwd()
    os.chdir(workdir)
    try:
        if not shared:
            if any("_docs.s3(" in (b.setup or "") for b in blocks):
                helpers.serve()
            _warm_imports(blocks)
        for b in blocks:
            kind, detail = classify(b)
            if kind == "skip":
                continue
            print(f"=== {b.where()} ({kind}{' ' + detail if detail else ''})", flush=True)
            if kind == "error":
                raise BlockFailed(b, b.line, detail)
            if kind == "ranks":  # its setup runs on each rank
                _run_ranks(b, int(detail), workdir)
            elif shared:
                _run_block(b, kind, ns, workdir)
            else:
                _in_own_process(b, kind, workdir)
            result["ran"].append(b.code_line)
    except BlockFailed as e:
        result["failure"] = {"line": e.line, "error": e.error}
    except BaseException:
        result["failure"] = {"line": 0, "error": traceback.format_exc()}
    finally:
        with open(result_path, "w") as f:
            json.dump(result, f)
        try:
            _finish(ns)
        finally:
            helpers.close()
            os.chdir(old)


def _finish(ns: Dict[str, Any]) -> None:
    """Close what the blocks left open while the working directory and the S3 server still exist, in the
    order of an interpreter's exit: the exit handlers first (pending saves of managers the blocks did not
    close: a manager's handler holds it weakly, so it must still be alive), then the names."""
    import atexit
    import gc

    atexit._run_exitfuncs()
    ns.clear()
    gc.collect()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        _rank_main(sys.argv[2], sys.argv[3])
    else:
        run_file(os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3])
