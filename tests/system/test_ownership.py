"""Ownership (issue 24): nostall never deletes, replaces or follows anything it cannot prove it made.

A hypothesis state machine plays a user beside a single-process training job
(world size 1, no ``torch.distributed``), in a temporary directory::

    <base>/run/       the manager's root (CheckpointManager(run, keep_last=k, incremental=?, async_save=?))
    <base>/user/      caller-named checkpoints (nostall.save, mgr.save(path=), nostall.copy_checkpoint)
                      beside the user's own directories (user/mine, user/fake...)
    <base>/outside/   the user's files that symbolic links inside the roots point to

Operations, drawn at random: saves at new, repeated and older steps (small
tensors, a frozen part and a changing one, sometimes ``files=`` side files),
reopening the root with other options, caller-named saves (into ``user/``,
into ``run/exports/``, and into ``run/step_<N>``, which the live manager's lock
must refuse), copies, and the user's interference between them: ``eval-*.json``
files, sub-directories and symbolic links (to ``outside/``) dropped into step
directories, caller-named checkpoints, the root and its ``.tmp``; a step's
side-file folder replaced by a link to an outside folder holding files of the
same names; hand-made ``.retired-<hex>.json`` (a copy of a real manifest) in
step and user directories; hand-made ``*.nostall`` marks (with and without an
entry, ids that prove nothing) under ``.tmp``, beside caller-named checkpoints
and in step directories; hand-made ``manifest.json`` copies in user
directories; the user removing its own files; and, in some examples, a save in
a subprocess that SIGKILLs itself at one of the project's crash points
(``NOSTALL_TEST_CRASH``, nostall/_faults.py; the points are those the crash
harness uses, tests/crash_harness.py), after which a new manager takes the root.

After every operation:

* every file, directory and symbolic link the user made is there, byte for
  byte (link targets too), unless the user removed it;
* ``outside/`` is exactly as the user left it, and ``<base>`` holds nothing
  but ``run``, ``user`` and ``outside``;
* every step ``CheckpointManager(run, read_only=True).steps()`` lists was saved
  by the test, loads bit-exactly equal to the latest save of that step, passes
  ``check_checkpoint`` and holds the side files saved with it; every
  caller-named checkpoint and copy is still there and loads equal to what was
  saved (or copied) there last (a checkpoint whose side-file folder the user
  replaced by a link may refuse to load, with a CheckpointError, and is not
  verified).

And after particular operations: a refusal is always a ``CheckpointError``
(any other exception fails the test); a save into a place the user never
touched succeeds (its step is then listed and ``latest``); a caller-named save
or copy into ``run/step_<N>`` is refused while the manager holds ``run``; a
successful caller-named save leaves nothing of a crashed save to the same
place beside it (``.<name>.nostall-*``) but what the user made; a new manager
leaves nothing in ``run/.tmp`` but its lock, retired manifests' proofs and
the user's own entries.

Default: 100 derandomized examples of up to 15 operations (a subprocess crash
in about a quarter of them, at most one each; no shrinking), 30-45 s on 2
quiet cores. A longer, randomized run, shrinking what it finds:
``NOSTALL_OWNERSHIP_EXAMPLES=<n>`` (then up to 25 operations per example and
up to two crashes in half of them), e.g.
``NOSTALL_OWNERSHIP_EXAMPLES=300 .venv/bin/python -m pytest tests/test_ownership.py -q``
(shrinking a failure can take minutes). A failure prints the operations that
led to it (hypothesis's steps), as a program to replay.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import torch  # noqa: E402

import nostall  # noqa: E402

try:  # the layout of docs/architecture.md
    from nostall.loading.manifests import read_manifest, read_side_file  # noqa: E402
    from nostall.loading.verify import check_checkpoint  # noqa: E402
except ImportError:  # the flat layout before it
    from nostall.loading import check_checkpoint, read_manifest, read_side_file  # type: ignore  # noqa: E402
from tests.crash_harness import (  # noqa: E402
    COMMIT_POINTS,
    SYNC_POINTS,
    TRAINER_POINTS,
    WRITER_POINTS,
    _mark,
    _read_mark,
)
from tests.dist_harness import process_alive  # noqa: E402

CRASH_ENV = "NOSTALL_TEST_CRASH"  # a crash point's spec, <role>:<point>:<step> (nostall's test-only fault hooks)
LONG = os.environ.get("NOSTALL_OWNERSHIP_EXAMPLES")
EXAMPLES = int(LONG) if LONG else 100
STEPS = 25 if LONG else 15
TIMEOUT_S = 30.0  # the managers' timeout: every wait of theirs is bounded by it (a niced writer on a loaded machine)
CHILD_BOUND_S = 120.0  # a crash child that neither crashed nor finished by then is killed (and the test fails)
WRITER_GONE_BOUND_S = 10.0  # a crashed child's writer (async) exits after its trainer within this

# The crash points a save can stop at (tests/crash_harness.py), and those at or after the commit point
SYNC_CRASH = [("trainer", p) for p in SYNC_POINTS + COMMIT_POINTS]
ASYNC_CRASH = [("trainer", p) for p in TRAINER_POINTS] + [("writer", p) for p in WRITER_POINTS + COMMIT_POINTS]
NAMED_CRASH = [("trainer", p) for p in ("write.start", "write.done", "commit.ready", "commit.manifest",
                                        "commit.renamed")]
COMMITTED_POINTS = ("commit.renamed", "retain.moved")  # the save is committed when these are reached
EITHER_POINTS = ("staged",)  # async trainer killed after handing its job to the writer: either outcome

PICK = st.integers(0, 1 << 16)
HEX32 = st.binary(min_size=16, max_size=16).map(bytes.hex)
KEEP = st.sampled_from([None, 1, 2, 3])
NAMED = ["user/ckpt_a", "user/ckpt_b", "user/mine", "user/fake", "run/exports/ck", "run/step_old", "run/step_new"]
COPY_DST = ["user/copy_a", "user/copy_b", "user/ckpt_a", "user/mine", "user/fake", "run/step_new"]


# --------------------------------------------------------------------------- the state saved


class Exp(NamedTuple):
    """What a save wrote: the step in its state, its version (the changing tensors), side files or not."""

    step: int
    v: int
    side: bool


FROZEN = torch.arange(1024, dtype=torch.float32) * 0.25 - 7.0  # 4 KiB, the same at every save
FROZEN_I = torch.arange(256, dtype=torch.int16) * 3 - 100  # 512 B, the same at every save


def make_state(step: int, v: int) -> Dict[str, Any]:
    """The state of version ``v`` saved as ``step``: ``w`` and ``b`` change with the version only (a save
    that keeps the version writes only its JSON anew when incremental), the frozen tensors never."""
    return {"frozen": FROZEN.clone(), "frozen_i": FROZEN_I.clone(),
            "w": torch.arange(256, dtype=torch.float32) * 0.5 + v * 1000.0,
            "b": torch.full((64,), v, dtype=torch.int64) - step,
            "meta": {"step": step, "v": v}}


def template() -> Dict[str, Any]:
    return {"frozen": torch.zeros(1024), "frozen_i": torch.zeros(256, dtype=torch.int16), "w": torch.zeros(256),
            "b": torch.zeros(64, dtype=torch.int64), "meta": None}


def side_files(step: int, v: int) -> Dict[str, bytes]:
    return {"huggingface/config.json": f'{{"step": {step}, "v": {v}}}'.encode(), "notes.txt": f"notes {v}".encode()}


def _state_of(e: Exp) -> Dict[str, Any]:
    return make_state(e.step, e.v)


# --------------------------------------------------------------------------- the crash child (forkserver)


def _crash_child(out_dir: str, spec: str, root: str, target: Optional[str], steps: List[int], versions: List[int],
                 side: bool, keep_last: Optional[int], incremental: bool, async_save: bool) -> None:
    """Saves in a process of its own, ``spec`` armed (``NOSTALL_TEST_CRASH``, inherited by its writer).
    Markers: ``pids.json`` (its writer), ``outcome<i>.json`` per save that returned or raised a
    CheckpointError; any other exception: ``error.txt`` and exit status 1."""
    code = 0
    try:
        os.environ[CRASH_ENV] = spec
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        if target is not None:
            try:
                nostall.save(make_state(steps[0], versions[0]), target)
                _mark(out_dir, "outcome0.json", ok=True)
            except nostall.CheckpointError as e:
                _mark(out_dir, "outcome0.json", ok=False, error=str(e)[:800])
        else:
            mgr = nostall.CheckpointManager(root, keep_last=keep_last, incremental=incremental,
                                            async_save=async_save, timeout=TIMEOUT_S)
            _mark(out_dir, "pids.json", writer=mgr.writer_pid)
            try:
                for i, (s, v) in enumerate(zip(steps, versions)):
                    try:
                        mgr.save(s, make_state(s, v), files=side_files(s, v) if side else None)
                        mgr.finalize_pending_saves()
                        _mark(out_dir, f"outcome{i}.json", ok=True)
                    except nostall.CheckpointError as e:
                        _mark(out_dir, f"outcome{i}.json", ok=False, error=str(e)[:800])
            finally:
                try:
                    mgr.close()
                except nostall.CheckpointError:
                    pass  # the crashed save's failure, reported again
    except BaseException:
        code = 1
        with open(os.path.join(out_dir, "error.txt"), "w") as f:
            f.write(traceback.format_exc())
    os._exit(code)


_CTX: Any = None


def _ctx() -> Any:
    """Children forked from a server with torch and nostall imported (a start costs milliseconds)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "nostall", "nostall.manager", "nostall.api", __name__])
    return _CTX


def _run_child(out_dir: str, *args: Any) -> Tuple[Optional[int], Dict[str, Any]]:
    """Run :func:`_crash_child`, bounded; wait (bounded) for its writer to be gone too. (exit code, markers)."""
    os.makedirs(out_dir)
    p = _ctx().Process(target=_crash_child, args=(out_dir, *args))
    p.start()
    p.join(CHILD_BOUND_S)
    hung = p.is_alive()
    if hung:
        p.kill()
        p.join(10)
    pids = _read_mark(out_dir, "pids.json") or {}
    writer = pids.get("writer")
    if writer:
        until = time.monotonic() + WRITER_GONE_BOUND_S
        while process_alive(writer) and time.monotonic() < until:
            time.sleep(0.01)
        if process_alive(writer):
            os.kill(writer, signal.SIGKILL)
            raise AssertionError(f"the crashed save's writer (pid {writer}) outlived its trainer by "
                                 f"{WRITER_GONE_BOUND_S:.0f} s")
    assert not hung, f"a crash child neither crashed nor finished within {CHILD_BOUND_S:.0f} s"
    if p.exitcode == 1:
        with open(os.path.join(out_dir, "error.txt")) as f:
            raise AssertionError(f"a save in the crash child raised something else than a CheckpointError:\n"
                                 f"{f.read()}")
    assert p.exitcode in (0, -signal.SIGKILL), p.exitcode
    outcomes = {n: _read_mark(out_dir, n) for n in sorted(os.listdir(out_dir)) if n.startswith("outcome")}
    return p.exitcode, outcomes


# --------------------------------------------------------------------------- the machine


def _read_nofollow(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _is_dir(path: str) -> bool:
    try:
        return os.path.isdir(path) and not os.path.islink(path)
    except OSError:
        return False


def _snapshot(top: str) -> Dict[str, Tuple[Any, ...]]:
    """Every entry under ``top`` (relative path -> ("d",) / ("f", bytes) / ("l", target)), no link followed."""
    out: Dict[str, Tuple[Any, ...]] = {}
    for d, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, top)
            if os.path.islink(p):
                out[rel] = ("l", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("d",)
            else:
                out[rel] = ("f", _read_nofollow(p))
    return out


class Ownership(RuleBasedStateMachine):
    """The user's model of the world (what it made, what was saved where) against the disk."""

    def __init__(self) -> None:
        super().__init__()
        self.base = tempfile.mkdtemp(prefix="nostall-own-")
        self.root = os.path.join(self.base, "run")
        self.user = os.path.join(self.base, "user")
        self.outside = os.path.join(self.base, "outside")
        self.files: Dict[str, bytes] = {}  # what the user wrote (absolute path -> bytes), outside/ too
        self.links: Dict[str, str] = {}  # the user's symbolic links -> their targets
        self.dirs: Set[str] = set()  # the user's directories
        self.touched: Set[str] = set()  # directories the user put something into (a save there may be refused)
        self.damaged: Set[str] = set()  # checkpoints whose side-file folder the user replaced by a link
        self.saved: Dict[int, Exp] = {}  # step -> its latest save in the root
        self.named: Dict[str, Exp] = {}  # a caller-named checkpoint or copy -> what was saved there last
        self.top = 0  # the highest step any save tried
        self.last: Optional[int] = None  # the step saved last
        self.version = 0
        self.n = 0
        self.crashes = 0
        self.crash_budget = 0
        self.mgr: Optional[nostall.CheckpointManager] = None
        for d in (self.user, self.outside, os.path.join(self.outside, "sub"), os.path.join(self.user, "mine")):
            self._mkdir(d)
        self._write(os.path.join(self.outside, "notes.txt"), b"the user's notes, outside every root\n")
        self._write(os.path.join(self.outside, "sub", "deep.bin"), bytes(range(256)))
        self._write(os.path.join(self.user, "mine", "data.txt"), b"mine, not nostall's\n")
        self.touched.add(os.path.join(self.user, "mine"))

    def teardown(self) -> None:
        try:
            self._close_manager()
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    # ------------------------------------------------------------------ the user's own acts
    def _mkdir(self, path: str) -> None:
        os.mkdir(path)
        self.dirs.add(path)

    def _write(self, path: str, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
        self.files[path] = data

    def _link(self, path: str, target: str) -> None:
        os.symlink(target, path)
        self.links[path] = target

    def _next(self) -> int:
        self.n += 1
        return self.n

    def _user_made(self, path: str) -> bool:
        return path in self.files or path in self.links or path in self.dirs

    def _abs(self, rel: str) -> str:
        return os.path.join(self.base, rel)

    def _users_under(self, d: str) -> List[str]:
        """What the user made inside directory ``d`` (a save must not replace ``d`` then: rule 5)."""
        return sorted(p for p in [*self.files, *self.links, *self.dirs] if p.startswith(d + os.sep))

    # ------------------------------------------------------------------ nostall, as the user sees it
    def _open_manager(self, keep_last: Optional[int], incremental: bool, async_save: bool) -> None:
        self._close_manager()
        self.mgr = nostall.CheckpointManager(self.root, keep_last=keep_last, incremental=incremental,
                                             async_save=async_save, timeout=TIMEOUT_S)
        self._check_tmp_clean()

    def _close_manager(self) -> None:
        mgr, self.mgr = self.mgr, None
        if mgr is not None:
            mgr.close()

    def _listed(self) -> Tuple[List[int], Optional[int]]:
        """The committed steps and the latest one, the public way (a read-only manager)."""
        with nostall.CheckpointManager(self.root, read_only=True) as ro:
            return ro.steps(), ro.latest_step()

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step}")

    def _ckpt_dirs(self) -> List[str]:
        """Directories that are (or were) checkpoints: the root's step_* and the caller-named ones."""
        out = []
        if _is_dir(self.root):
            out += [os.path.join(self.root, n) for n in sorted(os.listdir(self.root))
                    if n.startswith("step_") and _is_dir(os.path.join(self.root, n))]
        out += [p for p in sorted(self.named) if _is_dir(p)]
        return out

    def _manifests(self) -> List[str]:
        """Paths of committed manifests (to copy by hand)."""
        out = []
        for d in self._ckpt_dirs():
            m = os.path.join(d, "manifest.json")
            if os.path.isfile(m) and not os.path.islink(m) and not self._user_made(m):
                out.append(m)
        return out

    def _hf_dirs(self) -> List[str]:
        return [d for d in self._ckpt_dirs() if _is_dir(os.path.join(d, "huggingface"))]

    def _loads_as(self, path: str, e: Exp) -> bool:
        tmpl = template()
        try:
            got = nostall.load(tmpl, path)
        except nostall.CheckpointError:
            return False
        want = _state_of(e)
        return got["meta"] == want["meta"] and all(torch.equal(tmpl[k], want[k]) for k in ("frozen", "frozen_i",
                                                                                           "w", "b"))

    def _assert_loads(self, path: str, e: Exp, what: str) -> None:
        damaged = path in self.damaged
        tmpl = template()
        try:
            got = nostall.load(tmpl, path)
        except nostall.CheckpointError as err:
            if damaged:
                return
            raise AssertionError(f"{what} ({path}) does not load: {err}") from None
        want = _state_of(e)
        assert got["meta"] == want["meta"], f"{what} ({path}): {got['meta']} loaded, {want['meta']} saved"
        for k in ("frozen", "frozen_i", "w", "b"):
            assert torch.equal(tmpl[k], want[k]), f"{what} ({path}): {k!r} loads other values than were saved"
        report = check_checkpoint(path)
        if damaged:  # its side files are reachable only through the user's link: verifying must not follow it
            assert not report.ok, f"{what} ({path}): verification read side files through the user's link"
            return
        assert report.ok, f"{what} ({path}) fails verification: {report.problems}"
        m = read_manifest(path)
        want_side = side_files(e.step, e.v) if e.side else {}
        assert sorted(m.side_files) == sorted(want_side), f"{what} ({path}): side files {sorted(m.side_files)}"
        for name, rec in m.side_files.items():
            assert read_side_file(path, rec) == want_side[name], f"{what} ({path}): side file {name!r} differs"

    def _check_tmp_clean(self) -> None:
        """A new manager removed what crashed saves left in .tmp (and nothing of the user's)."""
        tmp = os.path.join(self.root, ".tmp")
        left = [n for n in sorted(os.listdir(tmp)) if n != ".lock" and not self._user_made(os.path.join(tmp, n))
                and not re.fullmatch(r"retired-[0-9a-f]{32}\.nostall", n)]
        assert not left, f"a new manager left {left} in {tmp}"

    def _check_beside_clean(self, target: str) -> None:
        """Rule 4: a save to ``target`` removed what crashed saves to it left beside it."""
        parent, name = os.path.split(target)
        left = [n for n in sorted(os.listdir(parent))
                if n.startswith(f".{name}.nostall-") and not self._user_made(os.path.join(parent, n))]
        assert not left, f"a save to {target} left {left} beside it (a crashed save's leftovers)"

    # ------------------------------------------------------------------ set-up
    @initialize(keep_last=KEEP, incremental=st.booleans(), async_save=st.booleans(), first=st.integers(1, 3),
                side=st.booleans(), crashy=st.integers(0, 3))
    def start(self, keep_last: Optional[int], incremental: bool, async_save: bool, first: int, side: bool,
              crashy: int) -> None:
        self.crash_budget = (2 if crashy <= 1 else 0) if LONG else (1 if crashy == 0 else 0)
        self._open_manager(keep_last, incremental, async_save)
        for i in range(first):
            self._root_save(self.top + 1, side and i % 2 == 0, change=i == 0)

    # ------------------------------------------------------------------ saves
    def _root_save(self, step: int, side: bool, change: bool) -> None:
        assert self.mgr is not None
        if change or not self.version:
            self.version += 1
        e = Exp(step, self.version, side)
        where = self._step_dir(step)
        held = self._users_under(where)
        self.top = max(self.top, step)
        try:
            self.mgr.save(step, _state_of(e), files=side_files(step, e.v) if side else None)
            self.mgr.finalize_pending_saves()
        except nostall.CheckpointError as err:
            assert where in self.touched, f"save of step {step} refused though the user never touched {where}: {err}"
            return
        assert not held, f"rule 5: step {step} was saved over {where}, which holds the user's {held}"
        self.saved[step] = e
        self.last = step
        self.damaged.discard(where)
        steps, latest = self._listed()
        assert step in steps and latest == step, f"step {step} saved, but listed {steps}, latest {latest}"

    def _pick_step(self, kind: str, pick: int) -> int:
        if kind == "again" and self.last is not None:
            return self.last
        if kind == "old" and self.saved:
            return sorted(self.saved)[pick % len(self.saved)]
        return self.top + 1 + pick % 2

    @rule(kind=st.sampled_from(["next", "next", "again", "old"]), pick=PICK, side=st.booleans(),
          change=st.booleans())
    def save(self, kind: str, pick: int, side: bool, change: bool) -> None:
        self._root_save(self._pick_step(kind, pick), side, change)

    @rule(pick=PICK, side=st.booleans(), change=st.booleans())
    def save_next(self, pick: int, side: bool, change: bool) -> None:
        self._root_save(self._pick_step("next", pick), side, change)

    @rule(keep_last=KEEP, incremental=st.booleans(), async_save=st.booleans())
    def reopen(self, keep_last: Optional[int], incremental: bool, async_save: bool) -> None:
        self._open_manager(keep_last, incremental, async_save)

    def _named_target(self, rel: str, pick: int) -> str:
        if rel == "run/step_old":
            steps = sorted(self.saved) or [1]
            return self._step_dir(steps[pick % len(steps)])
        if rel == "run/step_new":
            return self._step_dir(self.top + 1 + pick % 3)
        return self._abs(rel)

    @rule(place=st.sampled_from(NAMED), how=st.sampled_from(["api", "mgr", "mgr_no_step"]), pick=PICK,
          side=st.booleans())
    def named_save(self, place: str, how: str, pick: int, side: bool) -> None:
        assert self.mgr is not None
        path = self._named_target(place, pick)
        self.version += 1
        e = Exp(0 if how == "api" else pick % 100, self.version, side and how != "api")
        in_root = os.path.dirname(path) == self.root
        ours = path in self.named and os.path.lexists(path)
        must_succeed = not in_root and path not in self.touched and (ours or not os.path.lexists(path))
        held = self._users_under(path)
        try:
            if how == "api":
                nostall.save(_state_of(e), path)
            else:
                self.mgr.save(None if how == "mgr_no_step" else e.step, _state_of(e), path=path,
                              files=side_files(e.step, e.v) if e.side else None)
                self.mgr.finalize_pending_saves()
        except nostall.CheckpointError as err:
            assert not must_succeed, f"save to {path} ({how}) refused though the user never touched it: {err}"
            return
        assert not in_root, (f"rule 3: a caller-named save into {path} succeeded while a manager holds "
                             f"{self.root}")
        assert not held, f"rule 5: a save replaced {path}, which holds the user's {held}"
        self.named[path] = e
        self.damaged.discard(path)
        self._check_beside_clean(path)

    @rule(src=st.sampled_from(["root", "step", "named"]), dst=st.sampled_from(COPY_DST), overwrite=st.booleans(),
          pick=PICK)
    def copy(self, src: str, dst: str, overwrite: bool, pick: int) -> None:
        steps, latest = self._listed()
        if src == "step" and steps:
            s = steps[pick % len(steps)]
            spath, e = self._step_dir(s), self.saved.get(s)
        elif src == "named" and self.named:
            spath = sorted(self.named)[pick % len(self.named)]
            e = self.named[spath]
        else:
            spath, e = self.root, (self.saved.get(latest) if latest is not None else None)
        sdir = self._step_dir(latest) if spath == self.root and latest is not None else spath
        dpath = self._named_target(dst, pick)
        in_root = os.path.dirname(dpath) == self.root
        ours = dpath in self.named and os.path.lexists(dpath)
        must_succeed = (e is not None and sdir not in self.damaged and sdir != dpath and not in_root
                        and dpath not in self.touched and (not os.path.lexists(dpath) or (ours and overwrite)))
        # a source whose side files are reachable only through the user's link must be refused, not followed
        must_refuse = sdir in self.damaged
        held = self._users_under(dpath)
        try:
            nostall.copy_checkpoint(spath, dpath, overwrite=overwrite)
        except nostall.CheckpointError as err:
            assert not must_succeed, f"copy {spath} -> {dpath} (overwrite={overwrite}) refused: {err}"
            return
        assert e is not None, f"copy of {spath}, which holds no checkpoint, succeeded"
        assert not must_refuse, f"copy of {spath} read its side files through the user's link to outside"
        assert not in_root, f"rule 3: a copy into {dpath} succeeded while a manager holds {self.root}"
        assert not held, f"rule 5: a copy replaced {dpath}, which holds the user's {held}"
        self.named[dpath] = e
        self.damaged.discard(dpath)
        self._check_beside_clean(dpath)

    # ------------------------------------------------------------------ the user's interference
    @rule(kind=st.sampled_from(["eval", "subdir", "link_file", "link_dir"]),
          where=st.sampled_from(["ckpt", "ckpt", "root", "tmp", "user"]), pick=PICK, payload=st.binary(max_size=48))
    def put_file(self, kind: str, where: str, pick: int, payload: bytes) -> None:
        if where == "ckpt":
            dirs = self._ckpt_dirs()
            d = dirs[pick % len(dirs)] if dirs else self.root
        else:
            d = {"root": self.root, "tmp": os.path.join(self.root, ".tmp"), "user": self.user}[where]
        n = self._next()
        if kind == "eval":
            self._write(os.path.join(d, f"eval-{n}.json"), payload)
        elif kind == "subdir":
            self._mkdir(os.path.join(d, f"extra-{n}"))
            self._write(os.path.join(d, f"extra-{n}", "log.txt"), payload)
        elif kind == "link_file":
            self._link(os.path.join(d, f"link-{n}"), os.path.join(self.outside, "notes.txt"))
        else:
            self._link(os.path.join(d, f"linkdir-{n}"), os.path.join(self.outside, "sub"))
        self.touched.add(d)

    @precondition(lambda self: bool(self._hf_dirs()))
    @rule(pick=PICK)
    def link_side_folder(self, pick: int) -> None:
        """The user replaces a checkpoint's side-file folder by a link to an outside folder holding the same
        files (same names and bytes: a reader that followed the link would not notice; nostall's files there
        are the user's to delete)."""
        dirs = self._hf_dirs()
        d = dirs[pick % len(dirs)]
        hf = os.path.join(d, "huggingface")
        names = sorted(os.listdir(hf))
        out = os.path.join(self.outside, f"hf_{self._next()}")
        self._mkdir(out)
        for n in names:
            self._write(os.path.join(out, n), _read_nofollow(os.path.join(hf, n)))
        shutil.rmtree(hf)
        self._link(hf, out)
        self.touched.add(d)
        self.damaged.add(d)

    @precondition(lambda self: bool(self._manifests()))
    @rule(where=st.sampled_from(["ckpt", "ckpt", "user"]), pick=PICK, src=PICK,
          rid=st.sampled_from([8, 16]).flatmap(lambda k: st.binary(min_size=k, max_size=k).map(bytes.hex)))
    def drop_retired(self, where: str, pick: int, src: int, rid: str) -> None:
        """A hand-made ``.retired-<hex>.json``: a valid copy of a real manifest."""
        manifests = self._manifests()
        raw = _read_nofollow(manifests[src % len(manifests)])
        if where == "ckpt":
            dirs = self._ckpt_dirs()
        else:
            dirs = [p for p in (os.path.join(self.user, "mine"), os.path.join(self.user, "fake")) if _is_dir(p)]
        d = dirs[pick % len(dirs)]
        path = os.path.join(d, f".retired-{rid}.json")
        if os.path.lexists(path) and not self._user_made(path):
            return
        self._write(path, raw)
        self.touched.add(d)

    @rule(place=st.sampled_from(["tmp", "tmp_retired", "beside", "ckpt", "root"]), rid=HEX32, other=HEX32,
          entry=st.booleans(), pick=PICK)
    def drop_mark(self, place: str, rid: str, other: str, entry: bool, pick: int) -> None:
        """A hand-made ``*.nostall`` mark whose content proves nothing (not its name's id, nor a prefix of it),
        with or without an entry beside it."""
        if other == rid:
            other = rid[::-1] if rid[::-1] != rid else "0" + rid[1:] if rid[0] != "0" else "1" + rid[1:]
        content = f"{other}\n{socket.gethostname()} 999999999 1\n".encode()  # no process has that pid
        tmp = os.path.join(self.root, ".tmp")
        if place == "tmp":
            d, name = tmp, f"{('save', 'commit', 'trash', 'latest')[pick % 4]}-{rid}"
        elif place == "tmp_retired":
            d, name, content = tmp, f"retired-{rid}", f"{other} user-notes\n".encode()
        elif place == "beside":
            target, kind = ("ckpt_a", "ckpt_b", "copy_a")[pick % 3], ("save", "trash")[pick % 2]
            d, name = self.user, f".{target}.nostall-{kind}-{rid}"
        elif place == "ckpt":
            dirs = self._ckpt_dirs()
            d, name = (dirs[pick % len(dirs)] if dirs else self.root), f"mine-{rid[:8]}"
        else:
            d, name = self.root, f"save-{rid}"
        mark = os.path.join(d, name + ".nostall")
        if os.path.lexists(mark) or os.path.lexists(os.path.join(d, name)):
            return
        self._write(mark, content)
        if entry:
            self._mkdir(os.path.join(d, name))
            self._write(os.path.join(d, name, "junk.bin"), os.urandom(16))
        self.touched.add(d)

    @precondition(lambda self: bool(self._manifests()))
    @rule(where=st.sampled_from(["mine", "fake", "fake_bare"]), src=PICK)
    def drop_manifest_copy(self, where: str, src: int) -> None:
        """A hand-made ``manifest.json`` (a copy of a real one) in a user directory."""
        manifests = self._manifests()
        raw = _read_nofollow(manifests[src % len(manifests)])
        d = os.path.join(self.user, where)
        if d in self.named:  # nostall's checkpoint there now: not a user directory
            return
        if not _is_dir(d):
            self._mkdir(d)
            if where == "fake":
                self._write(os.path.join(d, "eval.json"), b'{"user": true}')
        self._write(os.path.join(d, "manifest.json"), raw)
        # A nostall manifest makes the directory a caller-named checkpoint as far as nostall can tell
        # (docs/reliability.md): a save there may replace it when nothing else is in it, so the manifest is not
        # counted among the bytes that must never change (the directory's other files still are).
        self.files.pop(os.path.join(d, "manifest.json"))
        self.touched.add(d)

    @precondition(lambda self: any(not p.startswith(self.outside + os.sep) for p in [*self.files, *self.links]))
    @rule(pick=PICK)
    def user_removes(self, pick: int) -> None:
        """The user deletes one of its own files or links (inside the roots)."""
        mine = sorted(p for p in [*self.files, *self.links] if not p.startswith(self.outside + os.sep))
        p = mine[pick % len(mine)]
        os.unlink(p)
        self.files.pop(p, None)
        self.links.pop(p, None)

    # ------------------------------------------------------------------ crashes
    @precondition(lambda self: self.crashes < self.crash_budget)
    @rule(kind=st.sampled_from(["root", "root", "named"]), mode=st.sampled_from(["next2", "resave"]),
          keep_last=KEEP, incremental=st.booleans(), async_save=st.booleans(), point=PICK, pick=PICK,
          side=st.booleans())
    def crash(self, kind: str, mode: str, keep_last: Optional[int], incremental: bool, async_save: bool, point: int,
              pick: int, side: bool) -> None:
        self.crashes += 1
        out_dir = os.path.join(tempfile.gettempdir(), f"nostall-own-crash-{os.getpid()}-{self._next()}")
        try:
            if kind == "named":
                self._crash_named(out_dir, point, pick)
            else:
                self._crash_root(out_dir, mode, keep_last, incremental, async_save, point, pick, side)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)

    def _crash_named(self, out_dir: str, point: int, pick: int) -> None:
        target = self._abs(("user/ckpt_a", "user/ckpt_b")[pick % 2])
        role, name = NAMED_CRASH[point % len(NAMED_CRASH)]
        self.version += 1
        new, old = Exp(0, self.version, False), self.named.get(target)
        _, outcomes = _run_child(out_dir, f"{role}:{name}:None", self.root, target, [0], [self.version], False,
                                 None, False, False)
        done = outcomes.get("outcome0.json")
        exists = os.path.isfile(os.path.join(target, "manifest.json"))
        if done is not None:
            if done["ok"]:
                self.named[target] = new
            return
        # killed at the point: the place holds the old checkpoint before the commit point, the new one after
        if name == "commit.renamed" and target not in self.touched:
            assert exists and self._loads_as(target, new), f"{target}: killed after its commit, the save is lost"
            self.named[target] = new
        elif old is not None:
            assert exists and self._loads_as(target, old), f"{target}: a crashed save lost what was there"
        else:
            assert not exists, f"{target}: killed before its commit point ({name}), yet a checkpoint is there"
        # rule 4: the next save to that place removes what the crashed one left beside it (its maker is dead)
        self.version += 1
        again = Exp(0, self.version, False)
        try:
            nostall.save(_state_of(again), target)
        except nostall.CheckpointError as err:
            assert target in self.touched, f"save to {target} after a crashed one refused: {err}"
            return
        self.named[target] = again
        self._check_beside_clean(target)

    def _crash_root(self, out_dir: str, mode: str, keep_last: Optional[int], incremental: bool, async_save: bool,
                    point: int, pick: int, side: bool) -> None:
        if mode == "resave" and self.saved:
            steps = [sorted(self.saved)[pick % len(self.saved)]]
        else:
            steps = [self.top + 1, self.top + 2]
        versions = [self.version + 1 + i for i in range(len(steps))]
        self.version += len(steps)
        points = ASYNC_CRASH if async_save else SYNC_CRASH
        role, name = points[point % len(points)]
        held = {s: self._users_under(self._step_dir(s)) for s in steps}
        self._close_manager()  # the child takes the root
        _, outcomes = _run_child(out_dir, f"{role}:{name}:{steps[-1]}", self.root, None, steps, versions, side,
                                 keep_last, incremental, async_save)
        self._open_manager(keep_last, incremental, async_save)  # a new manager takes the root after the crash
        listed, _ = self._listed()
        for i, (s, v) in enumerate(zip(steps, versions)):
            self.top = max(self.top, s)
            new, where = Exp(s, v, side), self._step_dir(s)
            done = outcomes.get(f"outcome{i}.json")
            if done is not None and done["ok"]:
                assert not held[s], f"rule 5: step {s} was saved over {where}, which holds the user's {held[s]}"
                self.saved[s], self.last = new, s
                continue
            if done is not None and i < len(steps) - 1:  # refused before the crash point's save
                assert where in self.touched, f"save of step {s} refused (no crash yet): {done['error']}"
                continue
            # the save killed at the point (or failed because its writer was): before the commit point the old
            # checkpoint stays, after it the new one is committed
            is_new = s in listed and self._loads_as(where, new)
            if name in COMMITTED_POINTS and where not in self.touched:
                assert is_new, f"step {s}: killed at {role} {name}, after its commit point, the save is lost"
            elif name not in EITHER_POINTS and name not in COMMITTED_POINTS:
                assert not is_new, f"step {s}: killed at {role} {name}, before the commit point, yet committed"
            if is_new:
                assert not held[s], f"rule 5: step {s} was saved over {where}, which holds the user's {held[s]}"
                self.saved[s], self.last = new, s

    # ------------------------------------------------------------------ after every operation
    @invariant()
    def nothing_of_the_users_changed(self) -> None:
        for p, data in sorted(self.files.items()):
            assert os.path.lexists(p), f"the user's file {p} was deleted"
            assert not os.path.islink(p) and os.path.isfile(p), f"the user's file {p} was replaced"
            assert _read_nofollow(p) == data, f"the user's file {p} was changed"
        for p, target in sorted(self.links.items()):
            assert os.path.islink(p), f"the user's link {p} was " + ("replaced" if os.path.lexists(p) else "deleted")
            assert os.readlink(p) == target, f"the user's link {p} now points elsewhere"
        for p in sorted(self.dirs):
            assert _is_dir(p), f"the user's directory {p} was " + ("replaced" if os.path.lexists(p) else "deleted")
        out = self.outside + os.sep
        want = {os.path.relpath(p, self.outside): ("f", b) for p, b in self.files.items() if p.startswith(out)}
        want.update({os.path.relpath(p, self.outside): ("d",) for p in self.dirs if p.startswith(out)})
        got = _snapshot(self.outside)
        assert got == want, f"outside the roots changed: {sorted(set(got.items()) ^ set(want.items()))[:6]}"
        assert sorted(os.listdir(self.base)) == ["outside", "run", "user"], sorted(os.listdir(self.base))

    @invariant()
    def every_checkpoint_loads(self) -> None:
        steps, _ = self._listed()
        for s in steps:
            assert s in self.saved, f"step {s} is committed, but no save of it succeeded"
            self._assert_loads(self._step_dir(s), self.saved[s], f"step {s}")
        for p, e in sorted(self.named.items()):
            assert os.path.isfile(os.path.join(p, "manifest.json")), f"the checkpoint saved at {p} is gone"
            self._assert_loads(p, e, "caller-named checkpoint")


SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=not LONG,
                    database=None, print_blob=bool(LONG),
                    # no shrinking by default: an example costs up to a second, and shrinking a failure took
                    # over five minutes; the failing example (<= 15 operations) is printed as it was drawn
                    phases=[Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if LONG else []),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


@pytest.mark.timeout(600 if not LONG else max(600, 20 * EXAMPLES))
def test_ownership() -> None:
    run_state_machine_as_test(Ownership, settings=SETTINGS)
