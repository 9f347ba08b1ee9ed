"""Every fenced code block of README.md and docs/*.md runs, or says why not.

How blocks are marked and run: tests/docs_runner.py. Each file runs in its
own process, in a fresh working directory, and each of its blocks in a process
of its own with an empty namespace (every block stands alone), unless the file
is marked for notebook mode. The files run two at a time (the first test of
the module starts them all, each test waits for its own file's result): one
runner per file, so the second core is not idle meanwhile.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict

import pytest

from tests import docs_runner
from tests.docs_runner import REPO, Block, classify, parse, problems, sh_commands

FILES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
FILE_TIMEOUT_S = 240  # a hang guard for one file, not a speed check
FILES_AT_ONCE = 2  # doc files whose runners run at the same time


def run_doc(path: str, workdir: str, s3_url: str | None = None) -> dict:
    result_path = os.path.join(workdir, ".docs-result.json")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    if s3_url is not None:
        env["NOSTALL_DOCS_S3_URL"] = s3_url
    try:
        p = subprocess.run([sys.executable, "-m", "tests.docs_runner", path, workdir, result_path], cwd=REPO,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=FILE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.output.decode() if isinstance(e.output, bytes) else (e.output or "")
        pytest.fail(f"{path}: its blocks did not finish within {FILE_TIMEOUT_S}s\n--- output ---\n{out[-6000:]}")
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        pytest.fail(f"{path}: the runner exited with {p.returncode} without a result\n--- output ---\n"
                    f"{p.stdout[-6000:]}")
    result["output"] = p.stdout
    result["returncode"] = p.returncode
    return result


@pytest.mark.parametrize("name", FILES)
def test_every_block_runs_or_says_why_not(name):
    assert not problems(parse(os.path.join(REPO, name))), "\n".join(problems(parse(os.path.join(REPO, name))))


def _needs_s3(blocks) -> bool:
    return any("_docs.s3(" in (b.setup or "") for b in blocks)


@pytest.fixture(scope="module")
def doc_runs(request, tmp_path_factory):
    """Every runnable file's runner, started at once (FILES_AT_ONCE at a time), each in its own
    process and fresh working directory: name -> the Future of its run_doc() result."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_blocks_run" and item.module is request.module}
    todo = {name: parse(os.path.join(REPO, name)) for name in FILES if name in selected}
    todo = {name: blocks for name, blocks in todo.items() if docs_runner.runnable(blocks)}
    s3_url = None
    if any(_needs_s3(blocks) for blocks in todo.values()):
        try:
            s3_url = request.getfixturevalue("s3").url  # the session's server
        except pytest.skip.Exception:  # no moto/s3fs: those files' tests skip, the others run
            todo = {name: blocks for name, blocks in todo.items() if not _needs_s3(blocks)}
    # the files with ranks blocks (process starts) first, so that the slowest do not end up last
    order = sorted(todo, key=lambda n: -sum(classify(b)[0] == "ranks" for b in todo[n]))
    pool = ThreadPoolExecutor(max_workers=FILES_AT_ONCE)
    try:
        runs: Dict[str, Future] = {}
        for name in order:
            workdir = str(tmp_path_factory.mktemp("doc"))
            runs[name] = pool.submit(run_doc, os.path.join(REPO, name), workdir,
                                     s3_url if _needs_s3(todo[name]) else None)
        yield runs
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", FILES)
def test_blocks_run(name, doc_runs):
    path = os.path.join(REPO, name)
    blocks = parse(path)
    if not docs_runner.runnable(blocks):
        pytest.skip(f"{name}: no runnable block (each one is marked, see the test above)")
    if name not in doc_runs:
        pytest.skip(f"{name}: needs the session's S3-compatible server (moto, s3fs)")
    result = doc_runs[name].result()  # run_doc's own failure (a hang, no result) is raised here
    failure = result["failure"]
    if failure is not None:
        pytest.fail(f"{name}:{failure['line']}: block failed\n{failure['error']}\n"
                    f"--- output of the file's blocks ---\n{result['output'][-6000:]}", pytrace=False)
    want = [b.code_line for b in blocks if classify(b)[0] in ("python", "ranks", "sh")]
    assert result["ran"] == want
    assert result["returncode"] == 0, result["output"][-6000:]


# --------------------------------------------------------------------------- the runner itself

SAMPLE = '''# sample

<!-- docs-runner: notebook -->

```python
x = 1
```

<!-- setup: y = 41 -->
```python
z = x + y + 1
print("z", z)
```

```text
just text
```

```sh norun: needs a cluster
torchrun --nnodes 2 train.py
```

<!-- setup:
import os
os.makedirs("made", exist_ok=True)
-->
```sh
nostall --help
```

```python
assert z == 43
raise ValueError("boom")
```
'''


def test_runner_classifies_and_reports_the_failing_line(tmp_path):
    doc = tmp_path / "sample.md"
    doc.write_text(SAMPLE)
    blocks = parse(str(doc))
    assert [classify(b)[0] for b in blocks] == ["python", "python", "skip", "skip", "sh", "python"]
    assert blocks[1].setup == "y = 41\n" and blocks[4].setup.startswith("import os")
    assert sh_commands(blocks[4]) == [(blocks[4].code_line, "nostall --help")]
    work = tmp_path / "work"
    work.mkdir()
    result = run_doc(str(doc), str(work))
    assert result["ran"] == [b.code_line for b in blocks[:2]] + [blocks[4].code_line]
    assert result["failure"]["line"] == blocks[5].code_line
    assert "ValueError: boom" in result["failure"]["error"]
    assert f'File "{doc}", line {blocks[5].code_line + 1}' in result["failure"]["error"]
    assert "z 43" in result["output"] and (work / "made").is_dir()


STANDALONE = '''# a README

```python
import torch, nostall
model = torch.nn.Linear(2, 2)
nostall.save({"w": model.weight}, "ckpt")
```

```python
import os
assert os.path.isfile("ckpt/manifest.json")   # files are shared through the working directory
```

```python
nostall.load({"w": model.weight}, "ckpt")     # names are not: this block forgot its imports
```
'''


def test_each_block_stands_alone(tmp_path):
    """A block that uses a name an earlier block defined fails (a NameError at its line), unless the file
    is in notebook mode; files earlier blocks wrote are there."""
    doc = tmp_path / "README.md"
    doc.write_text(STANDALONE)
    blocks = parse(str(doc))
    work = tmp_path / "work"
    work.mkdir()
    result = run_doc(str(doc), str(work))
    assert result["mode"] == "standalone"
    assert result["ran"] == [blocks[0].code_line, blocks[1].code_line]
    assert result["failure"]["line"] == blocks[2].code_line
    assert "NameError: name 'nostall' is not defined" in result["failure"]["error"]

    doc.write_text(STANDALONE.replace("# a README\n", "# a session\n\n" + docs_runner.NOTEBOOK + "\n"))
    notebook_work = tmp_path / "notebook"
    notebook_work.mkdir()
    result = run_doc(str(doc), str(notebook_work))
    assert result["mode"] == "notebook" and result["failure"] is None, result
    assert len(result["ran"]) == 3


def test_a_block_runs_in_a_process_of_its_own(tmp_path):
    """Module state, process ids and open managers do not carry from one block to the next."""
    doc = tmp_path / "doc.md"
    doc.write_text("```python\nimport os, nostall\nnostall._docs_mark = os.getpid()\n"
                   "open('pids', 'w').write(str(os.getpid()))\n"
                   "mgr = nostall.CheckpointManager('ckpts', async_save=True)\n"
                   "import torch\nmgr.save(1, {'w': torch.ones(2)})\n```\n\n"
                   "```python\nimport os, nostall\nassert not hasattr(nostall, '_docs_mark')\n"
                   "assert open('pids').read() != str(os.getpid())\n"
                   "assert nostall.CheckpointManager('ckpts').latest_step() == 1   # the pending save committed\n```\n")
    work = tmp_path / "work"
    work.mkdir()
    result = run_doc(str(doc), str(work))
    assert result["failure"] is None, result
    assert result["ran"] == [b.code_line for b in parse(str(doc))]


def test_runner_refuses_unmarked_blocks(tmp_path):
    doc = tmp_path / "bad.md"
    doc.write_text("```\nplain\n```\n\n```json\n{}\n```\n\n```sh\nmake test\n```\n\n```sh norun:\nx\n```\n")
    found = problems(parse(str(doc)))
    assert len(found) == 4, found
    assert [classify(b)[0] for b in parse(str(doc))] == ["error"] * 4


def test_block_dataclass_where():
    b = Block(os.path.join(REPO, "README.md"), 10, "python", "x\n")
    assert b.where() == "README.md:11" and b.lang == "python"
