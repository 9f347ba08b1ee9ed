"""The read side against hostile or unusual inputs: FIFOs and devices in place of files,
manifests built to exhaust memory or time, malformed fields, odd block sizes, and
templates that cannot receive data (one process)."""

from __future__ import annotations

import errno
import itertools
import json
import math
import mmap
import os
import random
import subprocess
import sys
import threading
import tracemalloc
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

import nostall
from nostall.core import boxes as _boxes, format as fmt
from nostall.loading import sources
from nostall.loading.sources import verify_window
from nostall.loading.verify import check_checkpoint
from nostall.storage import files as storage
from nostall.tools.cli import main as cli_main


def small_state() -> Dict[str, Any]:
    return {
        "w": torch.arange(48, dtype=torch.float32).reshape(8, 6),
        "epoch": 3,
        "rng": nostall.PerRank(torch.arange(4, dtype=torch.uint8)),
    }


def small_template() -> Dict[str, Any]:
    return {"w": torch.zeros(8, 6), "epoch": None, "rng": nostall.PerRank(torch.zeros(4, dtype=torch.uint8))}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    nostall.save(small_state(), str(path))
    return path


def manifest(path: Path) -> Dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def write_manifest(path: Path, doc: Dict[str, Any]) -> None:
    (path / "manifest.json").write_text(json.dumps(doc))


def returns_without_hanging(fn: Callable[[], Any], fifo: Path, limit: float = 60.0) -> Dict[str, Any]:
    """Run ``fn`` in a thread; fail if it is still blocked (on ``fifo``) after ``limit`` seconds.

    A reader stuck opening the FIFO is released by opening its write end, so a
    failing test does not leave a thread blocked forever.
    """
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass
        t.join(10)
        pytest.fail(f"blocked on the FIFO {fifo} for {limit:.0f} s")
    return box


def run_cli(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "nostall.tools.cli", *args], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"nostall {' '.join(args)} did not finish in {timeout:.0f} s (blocked?)")


# --------------------------------------------------------------------------- 1. FIFOs, devices, growing files


def test_read_small_file_reads_regular_files(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"12345")
    assert storage.read_small_file(str(f), 5) == b"12345"
    assert storage.read_small_file(str(f), 100) == b"12345"
    (tmp_path / "empty").write_bytes(b"")
    assert storage.read_small_file(str(tmp_path / "empty"), 0) == b""
    with pytest.raises(FileNotFoundError):
        storage.read_small_file(str(tmp_path / "missing"), 10)


def test_read_small_file_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "latest"
    os.mkfifo(fifo)
    box = returns_without_hanging(lambda: storage.read_small_file(str(fifo), 64), fifo)
    e = box.get("error")
    assert isinstance(e, OSError) and "FIFO" in str(e) and str(fifo) in str(e), box


def test_read_small_file_refuses_a_symlink_to_dev_zero(tmp_path: Path) -> None:
    link = tmp_path / "latest"
    link.symlink_to("/dev/zero")
    with pytest.raises(OSError) as info:
        storage.read_small_file(str(link), 64)
    assert info.value.errno == errno.ELOOP and "symbolic link" in str(info.value) and str(link) in str(info.value)


def test_read_small_file_refuses_a_device_and_a_directory(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="character device"):
        storage.read_small_file("/dev/zero", 64)
    with pytest.raises(OSError, match="directory"):
        storage.read_small_file(str(tmp_path), 64)


def test_read_small_file_refuses_a_file_over_the_limit_before_reading(tmp_path: Path, monkeypatch) -> None:
    f = tmp_path / "latest"
    f.write_bytes(b"7" * 1000)
    reads: List[int] = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    with pytest.raises(OSError) as info:
        storage.read_small_file(str(f), 999)
    assert info.value.errno == errno.EFBIG and str(f) in str(info.value) and "999" in str(info.value)
    assert reads == []


def test_read_small_file_reads_at_most_limit_plus_one_of_a_growing_file(tmp_path: Path, monkeypatch) -> None:
    """The size seen by fstat is stale (the file grew since): the read still stops after limit + 1 bytes."""
    f = tmp_path / "latest"
    f.write_bytes(b"7" * (1 << 20))
    real_fstat, real_read = os.fstat, os.read
    got: List[int] = []

    class Small:
        def __init__(self, st: os.stat_result) -> None:
            self.st_mode, self.st_size = st.st_mode, 10

    monkeypatch.setattr(os, "fstat", lambda fd: Small(real_fstat(fd)))

    def reading(fd: int, n: int) -> bytes:
        b = real_read(fd, n)
        got.append(len(b))
        return b

    monkeypatch.setattr(os, "read", reading)
    with pytest.raises(OSError) as info:
        storage.read_small_file(str(f), 100)
    assert info.value.errno == errno.EFBIG
    assert sum(got) <= 101


def test_read_small_file_refuses_a_nul_in_the_name(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="NUL"):
        storage.read_small_file(str(tmp_path / "a\x00b"), 10)


def test_load_with_a_fifo_for_the_data_file_fails_naming_it(ckpt: Path) -> None:
    data = ckpt / "rank0.safetensors"
    data.unlink()
    os.mkfifo(data)
    box = returns_without_hanging(lambda: nostall.load(small_template(), str(ckpt)), data)
    e = box.get("error")
    assert isinstance(e, nostall.CheckpointCorruptError), box
    assert "rank0.safetensors" in str(e) and "FIFO" in str(e)


def test_load_with_a_fifo_for_the_manifest_fails_naming_it(ckpt: Path) -> None:
    m = ckpt / "manifest.json"
    m.unlink()
    os.mkfifo(m)
    box = returns_without_hanging(lambda: nostall.load(small_template(), str(ckpt)), m)
    e = box.get("error")
    assert isinstance(e, nostall.CheckpointLoadError), box
    assert "manifest.json" in str(e) and "FIFO" in str(e)


def test_check_checkpoint_with_a_fifo_data_file_reports_it(ckpt: Path) -> None:
    data = ckpt / "rank0.safetensors"
    data.unlink()
    os.mkfifo(data)
    box = returns_without_hanging(lambda: check_checkpoint(str(ckpt)), data)
    report = box.get("value")
    assert report is not None and not report.ok, box
    assert any("rank0.safetensors" in p and "FIFO" in p for p in report.problems), report.problems


@pytest.mark.parametrize("which", ["manifest.json", "rank0.safetensors"])
def test_cli_verify_and_inspect_with_a_fifo_do_not_hang(ckpt: Path, which: str) -> None:
    target = ckpt / which
    target.unlink()
    os.mkfifo(target)
    for cmd in ("verify", "inspect"):
        if cmd == "inspect" and which != "manifest.json":
            continue  # inspect reads the manifest only
        res = run_cli(cmd, str(ckpt))
        assert res.returncode == 1, (cmd, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr and str(ckpt) in res.stderr, (cmd, res.stderr)
    res = run_cli("verify", str(ckpt))
    if which == "rank0.safetensors":
        assert "rank0.safetensors" in res.stderr and "FIFO" in res.stderr, res.stderr


def test_remote_read_small_reads_at_most_limit_plus_one(monkeypatch) -> None:
    fsspec = pytest.importorskip("fsspec")
    from fsspec.implementations.memory import MemoryFileSystem

    from nostall.storage import remote

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/seams/latest", b"9" * 10000)
    calls: List[Tuple[Any, Any]] = []
    real_cat = MemoryFileSystem.cat_file

    def cat(self, path, start=None, end=None, **kw):
        calls.append((start, end))
        return real_cat(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat)
    monkeypatch.setattr(MemoryFileSystem, "size", lambda self, path: 10)  # a stale (or lying) size
    with pytest.raises(nostall.CheckpointCorruptError, match="memory://seams/latest"):
        remote.read_small("memory://seams/latest", 100)
    assert calls and all(end is not None and end - (start or 0) <= 101 for start, end in calls), calls
    monkeypatch.setattr(MemoryFileSystem, "size", lambda self, path: len(fs.cat_file(path)))
    fs.pipe_file("/seams/small", b"42")
    assert remote.read_small("memory://seams/small", 100) == b"42"
    fs.pipe_file("/seams/empty", b"")
    assert remote.read_small("memory://seams/empty", 100) == b""


# --------------------------------------------------------------------------- 2. manifest memory


_HWM_SCRIPT = r"""
import json, sys
import nostall
from nostall.loading.manifests import read_manifest

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
except OSError:
    pass
before = status("VmRSS")
try:
    read_manifest(sys.argv[1])
    out = {"error": None}
except nostall.CheckpointError as e:
    out = {"error": type(e).__name__, "message": str(e)}
out["growth"] = status("VmHWM") - before
print(json.dumps(out))
"""


def test_manifest_of_many_empty_objects_is_refused_with_bounded_memory(ckpt: Path) -> None:
    """64 MiB of ``{},`` (22 million dicts: ~1.9 GB once parsed) is refused before it is parsed."""
    doc = manifest(ckpt)
    head = json.dumps(doc)[:-1] + ',"junk":['  # an extra field: the manifest itself is otherwise valid
    n = (64 << 20) // 3
    (ckpt / "manifest.json").write_bytes(head.encode() + b",".join([b"{}"] * n) + b"]}")
    res = subprocess.run([sys.executable, "-c", _HWM_SCRIPT, str(ckpt)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["error"] == "CheckpointCorruptError", out
    assert "manifest.json" in out["message"] and "memory" in out["message"], out
    assert out["growth"] < 600 << 20, out


def _pathological_texts() -> Dict[str, bytes]:
    n = 20000
    return {
        "empty objects": b"[" + b",".join([b"{}"] * n) + b"]",
        "empty arrays": b"[" + b",".join([b"[]"] * n) + b"]",
        "one-key objects": b"[" + b",".join([b'{"a":0}'] * n) + b"]",
        "nested arrays": b"[" + b",".join([b"[[0]]"] * n) + b"]",
        "floats": b"[" + b",".join([b"1e0"] * n) + b"]",
        "big ints": b"[" + b",".join([b"123456789012"] * n) + b"]",
        "unique keys": b"{" + b",".join(b'"%d":0' % i for i in range(n)) + b"}",
        "strings": b"[" + b",".join(b'"%d"' % i for i in range(n)) + b"]",
        "pieces": json.dumps([{"offset": [0, i], "shape": [4, 1], "file": f"rank{i % 64}.safetensors",
                               "byte_range": [i * 16, i * 16 + 16], "crc32c": [3735928559]}
                              for i in range(n)], separators=(",", ":")).encode(),
    }


@pytest.mark.parametrize("name", list(_pathological_texts()))
def test_json_memory_estimate_is_an_upper_bound(name: str) -> None:
    raw = _pathological_texts()[name]
    tracemalloc.start()
    try:
        json.loads(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert fmt.json_memory_estimate(raw) >= peak + len(raw), (name, fmt.json_memory_estimate(raw), peak)


def test_a_safetensors_header_of_empty_objects_is_refused_before_parsing() -> None:
    text = b'{"__metadata__":{},"x":[' + b",".join([b"{}"] * ((24 << 20) // 3)) + b"]}"
    raw = len(text).to_bytes(8, "little") + text
    with pytest.raises(nostall.CheckpointCorruptError, match="safetensors header"):
        fmt.parse_file_header(raw, "rank0.safetensors")


# --------------------------------------------------------------------------- 3. tiling checks


def _manifest_with_pieces(boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]], gshape: Tuple[int, ...]) -> bytes:
    pieces = []
    pos = 0
    for off, shp in boxes:
        n = math.prod(shp) * 4
        pieces.append({"offset": list(off), "shape": list(shp), "file": "rank0.safetensors",
                       "byte_range": [pos, pos + n], "crc32c": [0] * -(-n // (4 << 20))})
        pos += n
    doc = {"format": "nostall", "version": 1, "step": 1, "world_size": 1,
           "checksum": {"algorithm": "crc32c", "block_size": 4 << 20},
           "files": {"rank0.safetensors": {"rank": 0, "size": pos}},
           "tensors": {"w": {"dtype": "F32", "shape": list(gshape), "sharded": True, "pieces": pieces}},
           "objects": {}, "per_rank": [{"tensors": {}, "objects": {}}]}
    return json.dumps(doc, separators=(",", ":")).encode()


def _brute_tiles(g: Tuple[int, ...], boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> bool:
    count: Dict[Tuple[int, ...], int] = {}
    for off, shp in boxes:
        for idx in itertools.product(*[range(o, o + s) for o, s in zip(off, shp)]):
            count[idx] = count.get(idx, 0) + 1
    return all(count.get(idx, 0) == 1 for idx in itertools.product(*[range(n) for n in g])) and (
        sum(count.values()) == math.prod(g)
    )


def _random_layout(rng: random.Random) -> Tuple[Tuple[int, ...], List[Tuple[Tuple[int, ...], Tuple[int, ...]]]]:
    """A random tiling (recursive cuts), then often damaged keeping the total volume (a box moved or reshaped)."""
    d = rng.randint(1, 4)
    g = tuple(0 if rng.random() < 0.02 else rng.randint(1, 4) for _ in range(d))
    boxes = [((0,) * d, g)]
    for _ in range(rng.randint(0, 9)):
        i = rng.randrange(len(boxes))
        off, shp = boxes[i]
        k = rng.randrange(d)
        if shp[k] < 2:
            continue
        c = rng.randint(1, shp[k] - 1)
        boxes[i : i + 1] = [(off, shp[:k] + (c,) + shp[k + 1 :]),
                            (off[:k] + (off[k] + c,) + off[k + 1 :], shp[:k] + (shp[k] - c,) + shp[k + 1 :])]
    r = rng.random()
    if r < 0.5:  # move one box by one step (same volume: overlaps one neighbour, uncovers elsewhere)
        i, k = rng.randrange(len(boxes)), rng.randrange(d)
        off, shp = boxes[i]
        moved = off[k] + rng.choice((-1, 1))
        if 0 <= moved and moved + shp[k] <= g[k]:
            boxes[i] = (off[:k] + (moved,) + off[k + 1 :], shp)
    elif r < 0.7 and len(boxes) >= 2:  # swap two boxes' shapes
        i, j = rng.sample(range(len(boxes)), 2)
        (oi, si), (oj, sj) = boxes[i], boxes[j]
        if all(o + s <= n for o, s, n in zip(oi, sj, g)) and all(o + s <= n for o, s, n in zip(oj, si, g)):
            boxes[i], boxes[j] = (oi, sj), (oj, si)
    if rng.random() < 0.1:
        boxes.append(((0,) * d, (0,) + g[1:]))  # an empty piece
    rng.shuffle(boxes)
    return g, boxes


def test_cover_check_agrees_with_brute_force() -> None:
    rng = random.Random(20240611)
    valid = invalid = 0
    for _ in range(3000):
        g, boxes = _random_layout(rng)
        want = _brute_tiles(g, boxes)
        problem = _boxes.cover_problem(g, boxes)
        assert (problem is None) == want, (g, boxes, problem)
        valid += want
        invalid += not want
    assert valid > 500 and invalid > 500  # both kinds exercised


def test_cover_check_within_a_tiny_budget_never_accepts_a_bad_layout(monkeypatch) -> None:
    """Past its work budget the check falls back to pairwise comparison, then refuses: never a wrong yes."""
    rng = random.Random(7)
    for floor, per_box in ((0, 0), (0, 3), (8, 1)):
        monkeypatch.setattr(_boxes, "WORK_FLOOR", floor)
        monkeypatch.setattr(_boxes, "WORK_PER_BOX", per_box)
        for _ in range(600):
            g, boxes = _random_layout(rng)
            problem = _boxes.cover_problem(g, boxes)
            if problem is None:
                assert _brute_tiles(g, boxes), (g, boxes)
            elif "too irregular" not in problem:
                assert not _brute_tiles(g, boxes), (g, boxes, problem)


@pytest.mark.parametrize("g, boxes, words", [
    # 2-D: volumes add up (6 + 6 + 4 = 16) but the first two overlap on [1:2, 1:3]
    ((4, 4), [((0, 0), (2, 3)), ((1, 1), (2, 3)), ((3, 0), (1, 4))], ["[0:2, 0:3]", "[1:3, 1:4]", "overlap"]),
    # 3-D: every pair of boxes overlaps on axis 0, only one pair overlaps in all three axes
    ((2, 2, 2), [((0, 0, 0), (2, 1, 1)), ((0, 1, 0), (2, 1, 1)), ((0, 0, 1), (2, 1, 1)), ((0, 1, 1), (1, 1, 1)),
                 ((0, 1, 1), (1, 1, 1))], ["overlap"]),
    # the same piece twice, another missing
    ((4,), [((0,), (2,)), ((0,), (2,))], ["overlap"]),
    # more volume than the tensor
    ((4,), [((0,), (3,)), ((1,), (3,))], ["overlap"]),
    # a gap
    ((2, 3), [((0, 0), (2, 2))], ["cover", "held by no rank"]),
    # a piece outside the tensor
    ((4,), [((2,), (3,))], ["outside"]),
])
def test_cover_check_names_what_is_wrong(g, boxes, words) -> None:
    problem = _boxes.cover_problem(g, boxes)
    assert problem is not None and all(w in problem for w in words), problem
    assert not _brute_tiles(g, boxes)


@pytest.mark.parametrize("g, boxes", [
    # a pinwheel: five boxes tiling 3x3 with no straight cut through it
    ((3, 3), [((0, 0), (2, 1)), ((2, 0), (1, 2)), ((1, 2), (2, 1)), ((0, 1), (1, 2)), ((1, 1), (1, 1))]),
    # a brick wall: rows split at different columns
    ((2, 6), [((0, 0), (1, 2)), ((0, 2), (1, 4)), ((1, 0), (1, 3)), ((1, 3), (1, 3))]),
    # 3-D pinwheel layers and a 0-d tensor
    ((3, 3, 2), [((0, 0, 0), (2, 1, 2)), ((2, 0, 0), (1, 2, 2)), ((1, 2, 0), (2, 1, 2)), ((0, 1, 0), (1, 2, 2)),
                 ((1, 1, 0), (1, 1, 1)), ((1, 1, 1), (1, 1, 1))]),
    ((), [((), ())]),
    # empty pieces are ignored; an empty tensor needs no piece
    ((2,), [((0,), (2,)), ((1,), (0,))]),
    ((0,), [((0,), (0,))]),
    ((2, 0, 3), []),
])
def test_cover_check_accepts_irregular_tilings(g, boxes) -> None:
    assert _brute_tiles(g, boxes)
    assert _boxes.cover_problem(g, boxes) is None


def test_cover_check_is_not_quadratic(monkeypatch) -> None:
    """2,000 pieces along the second axis (the old check compared every pair: ~2 million comparisons)."""
    calls = [0]
    real = _boxes.overlap

    def counting(*a: Any) -> bool:
        calls[0] += 1
        return real(*a)

    monkeypatch.setattr(_boxes, "overlap", counting)
    n = 2000
    raw = _manifest_with_pieces([((0, 4 * i), (3, 4)) for i in range(n)], (3, 4 * n))
    m = fmt.Manifest.from_json_bytes(raw, "manifest.json")
    assert len(m.tensors["w"].pieces) == n
    assert calls[0] <= 10 * n
    # an overlap among them is still found, and named
    bad = [((0, 4 * i), (3, 4)) for i in range(n)]
    bad[1500] = ((0, 4 * 1500 - 1), (3, 5))
    with pytest.raises(nostall.CheckpointCorruptError, match=r"\[0:3, 5996:6000\] and \[0:3, 5999:6004\] overlap"):
        fmt.Manifest.from_json_bytes(_manifest_with_pieces(bad, (3, 4 * n)), "manifest.json")


@pytest.mark.parametrize("layout", ["columns", "grid"])
def test_manifest_with_100k_pieces_of_one_tensor_parses(layout: str) -> None:
    if layout == "columns":
        boxes = [((0, i), (2, 1)) for i in range(100_000)]
        g: Tuple[int, ...] = (2, 100_000)
    else:
        boxes = [((i, j), (1, 1)) for i in range(317) for j in range(317)]
        g = (317, 317)
    random.Random(3).shuffle(boxes)
    raw = _manifest_with_pieces(boxes, g)
    m = fmt.Manifest.from_json_bytes(raw, "manifest.json")
    assert len(m.tensors["w"].pieces) == len(boxes)


def test_save_plan_checks_tiling_without_quadratic_work(monkeypatch) -> None:
    from nostall.planning.plan import RankMeta, TensorMeta, build_plan

    calls = [0]
    real = _boxes.overlap
    monkeypatch.setattr(_boxes, "overlap", lambda *a: calls.__setitem__(0, calls[0] + 1) or real(*a))
    n = 2000
    metas = [RankMeta((TensorMeta("w", "F32", (3, n), (0, r), (3, 1), True, True),), ()) for r in range(n)]
    plan = build_plan(metas)
    assert len(plan.tensors["w"].pieces) == n
    assert calls[0] <= 10 * n
    metas[7] = RankMeta((TensorMeta("w", "F32", (3, n), (0, 6), (3, 2), True, True),), ())
    with pytest.raises(nostall.InvalidStateError, match="'w'.*overlap"):
        build_plan(metas)


# --------------------------------------------------------------------------- 4. raw exceptions


def test_nul_byte_in_a_manifest_file_name_is_corruption(ckpt: Path) -> None:
    doc = manifest(ckpt)
    bad = "rank0\x00.safetensors"
    doc["files"][bad] = doc["files"].pop("rank0.safetensors")
    for t in list(doc["tensors"].values()) + [t for r in doc["per_rank"] for t in r["tensors"].values()]:
        for p in t["pieces"]:
            p["file"] = bad
    write_manifest(ckpt, doc)
    with pytest.raises(nostall.CheckpointCorruptError, match="file name"):
        nostall.load(small_template(), str(ckpt))


def test_open_regular_turns_a_nul_byte_into_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="NUL"):
        storage.open_regular(str(tmp_path / "x\x00y"))


def _rewrite_header(ckpt: Path, edit: Callable[[Dict[str, Any]], None]) -> None:
    f = ckpt / "rank0.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    f.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])


@pytest.mark.parametrize("shape", [5, None, "48", {"a": 1}])
def test_cli_verify_reports_a_header_shape_that_is_not_a_list(ckpt: Path, capsys, shape: Any) -> None:
    _rewrite_header(ckpt, lambda h: h["w"].__setitem__("shape", shape))
    assert cli_main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "rank0.safetensors" in err and "key 'w'" in err and "header" in err, err


@pytest.mark.parametrize("objects", [[["a", 1], [2, 3]], [["epoch", 3]], "epoch", 3])
def test_cli_inspect_refuses_objects_that_are_not_a_json_object(ckpt: Path, capsys, objects: Any) -> None:
    doc = manifest(ckpt)
    doc["objects"] = objects
    write_manifest(ckpt, doc)
    assert cli_main(["inspect", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "manifest.json" in err and "objects" in err, err
    with pytest.raises(nostall.CheckpointCorruptError, match="objects"):
        nostall.load(small_template(), str(ckpt))


@pytest.mark.parametrize("field, value", [
    (("files", "rank0.safetensors"), [0, 1]),
    (("tensors", "w", "shape"), "86"),
    (("tensors", "w", "pieces", 0, "offset"), "00"),
    (("tensors", "w", "pieces", 0, "byte_range"), [0, 1, 2]),
    (("tensors", "w", "sharded"), "no"),
    (("tensors", "w", "dtype"), 7),
    (("per_rank",), {"0": {}}),
    (("per_rank", 0), []),
    (("world_size",), 1.5),
])
def test_malformed_manifest_fields_are_corruption(ckpt: Path, field: Tuple[Any, ...], value: Any) -> None:
    doc = manifest(ckpt)
    target = doc
    for k in field[:-1]:
        target = target[k]
    target[field[-1]] = value
    write_manifest(ckpt, doc)
    with pytest.raises(nostall.CheckpointCorruptError, match="manifest.json"):
        nostall.load(small_template(), str(ckpt))


def test_an_int_too_long_for_json_is_refused_naming_its_key(tmp_path: Path) -> None:
    state = {"w": torch.zeros(2), "sched": {"seed": 10**5000}}
    with pytest.raises(nostall.InvalidStateError, match="'sched/seed'.*digits"):
        nostall.save(state, str(tmp_path / "c"))
    with pytest.raises(nostall.InvalidStateError, match="'rng/1'"):
        nostall.save({"rng": nostall.PerRank([1, -(10**4300)])}, str(tmp_path / "d"))
    nostall.save({"ok": 10**4299, "neg": -(10**4299)}, str(tmp_path / "e"))  # 4300 digits: accepted
    assert nostall.load({"ok": None, "neg": None}, str(tmp_path / "e")) == {"ok": 10**4299, "neg": -(10**4299)}


# --------------------------------------------------------------------------- 5. verify with any block size


def test_verify_window_is_a_whole_number_of_blocks() -> None:
    for bs in (8, 8000, 4 << 20, 3 * 2**20 + 8, (64 << 20) + 8, 1 << 30):
        w = verify_window(bs)
        assert w % bs == 0 and w >= bs


def reblock(path: Path, block_size: int) -> None:
    """Rewrite the checkpoint's checksums for another block size (any multiple of 8 is valid in a manifest,
    e.g. from an import, though save itself takes powers of two)."""
    doc = manifest(path)
    doc["checksum"]["block_size"] = block_size
    for t in list(doc["tensors"].values()) + [t for r in doc["per_rank"] for t in r["tensors"].values()]:
        for p in t["pieces"]:
            a, b = p["byte_range"]
            with open(path / p["file"], "rb") as f:
                f.seek(a)
                p["crc32c"] = fmt.block_crcs(memoryview(f.read(b - a)), block_size)
    write_manifest(path, doc)


@pytest.mark.parametrize("block_size", [8000, 3 * 2**10 + 8])
def test_verify_with_a_block_size_that_does_not_divide_the_window(tmp_path: Path, monkeypatch,
                                                                  block_size: int) -> None:
    monkeypatch.setattr(sources, "READ_CHUNK", 64 << 10)  # several windows in a small tensor
    path = tmp_path / "c"
    w = torch.arange(100_000, dtype=torch.float32)  # 400 KB: about 6 windows
    nostall.save({"w": w}, str(path))
    reblock(path, block_size)
    assert torch.equal(nostall.load({"w": torch.zeros(100_000)}, str(path))["w"], w)
    report = check_checkpoint(str(path))
    assert report.ok, report.problems
    # real damage is still found, in the right block
    p = manifest(path)["tensors"]["w"]["pieces"][0]
    pos = p["byte_range"][0] + 300_001
    f = path / p["file"]
    raw = bytearray(f.read_bytes())
    raw[pos] ^= 0xFF
    f.write_bytes(bytes(raw))
    report = check_checkpoint(str(path))
    assert len(report.problems) == 1, report.problems
    lo = p["byte_range"][0] + (300_001 // block_size) * block_size
    assert "in 1 of" in report.problems[0] and f"[{lo}, {lo + block_size})" in report.problems[0]


def test_verify_with_an_odd_block_size_over_the_real_window(tmp_path: Path) -> None:
    """A 72 MiB tensor spans two of the real 64 MiB windows; 3 MiB + 8 does not divide 64 MiB."""
    path = tmp_path / "c"
    w = torch.arange(18 << 20, dtype=torch.int32)
    nostall.save({"w": w}, str(path))
    del w
    reblock(path, 3 * 2**20 + 8)
    report = check_checkpoint(str(path))
    assert report.ok, report.problems
    assert cli_main(["verify", str(path)]) == 0


# --------------------------------------------------------------------------- 6. templates that cannot receive data


def test_loading_into_a_meta_template_is_refused(ckpt: Path) -> None:
    tpl = small_template()
    tpl["w"] = torch.empty(8, 6, device="meta")
    with pytest.raises(nostall.CheckpointLoadError, match=r"'w'.*meta.*to_empty"):
        nostall.load(tpl, str(ckpt))
    tpl = small_template()
    tpl["w"] = nostall.ShardedTensor(torch.empty(4, 6, device="meta"), (8, 6), (4, 0))
    with pytest.raises(nostall.CheckpointLoadError, match=r"'w'.*meta"):
        nostall.load(tpl, str(ckpt))
    tpl = small_template()
    tpl["rng"] = nostall.PerRank(torch.empty(4, dtype=torch.uint8, device="meta"))
    with pytest.raises(nostall.CheckpointLoadError, match=r"'rng'.*meta"):
        nostall.load(tpl, str(ckpt))


def test_a_refused_load_leaves_the_template_untouched(ckpt: Path) -> None:
    """The writability probe of earlier tensors writes back what it read."""
    tpl = small_template()
    tpl["w"].fill_(-1.5)
    tpl["rng"] = nostall.PerRank(torch.empty(4, dtype=torch.uint8, device="meta"))
    with pytest.raises(nostall.CheckpointLoadError):
        nostall.load(tpl, str(ckpt))
    assert torch.equal(tpl["w"], torch.full((8, 6), -1.5))


@pytest.mark.parametrize("make", [
    lambda: torch.eye(3).to_sparse(),
    lambda: torch.eye(3).to_sparse_csr(),
    lambda: torch.empty(3, device="meta"),
])
def test_saving_a_sparse_or_meta_tensor_is_refused_naming_its_key(tmp_path: Path, make) -> None:
    with pytest.raises(nostall.InvalidStateError, match=r"'opt/m'"):
        nostall.save({"opt": {"m": make()}}, str(tmp_path / "a"))
    with pytest.raises(nostall.InvalidStateError, match=r"'rng/x'"):
        nostall.save({"rng": nostall.PerRank({"x": make()})}, str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_loading_into_a_sparse_template_is_refused(tmp_path: Path) -> None:
    nostall.save({"e": torch.eye(3)}, str(tmp_path / "c"))
    with pytest.raises(nostall.CheckpointLoadError, match=r"'e'.*layout"):
        nostall.load({"e": torch.zeros(3, 3).to_sparse()}, str(tmp_path / "c"))


def _read_only_tensor(tmp_path: Path, n: int) -> Tuple[torch.Tensor, Any]:
    f = tmp_path / "buf"
    f.write_bytes(b"\0" * (n * 4))
    fd = os.open(f, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, n * 4, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The given buffer is not writable"
        return torch.frombuffer(mm, dtype=torch.float32), mm


def test_loading_into_read_only_memory_is_refused_naming_the_key(ckpt: Path, tmp_path: Path) -> None:
    ro, mm = _read_only_tensor(tmp_path, 48)
    tpl = small_template()
    tpl["w"] = ro.view(8, 6)
    with pytest.raises(nostall.CheckpointLoadError, match=r"'w'.*read-only"):
        nostall.load(tpl, str(ckpt))
    del tpl, ro
    mm.close()


_READ_ONLY_RESHARD = r"""
import mmap, os, sys, warnings
import torch, nostall
ckpt, buf = sys.argv[1], sys.argv[2]
with open(buf, "wb") as f:
    f.write(b"\0" * 4096)
fd = os.open(buf, os.O_RDONLY)
mm = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ro = torch.frombuffer(mm, dtype=torch.float32)
part = nostall.ShardedTensor(ro[:18].view(3, 6), (8, 6), (2, 0))  # a slice: the copying path
try:
    nostall.load({"w": part, "epoch": None, "rng": nostall.PerRank(torch.zeros(4, dtype=torch.uint8))}, ckpt)
    print("LOADED")
except nostall.CheckpointLoadError as e:
    print("REFUSED", e)
"""


def test_loading_a_slice_into_read_only_memory_is_refused_not_a_crash(ckpt: Path, tmp_path: Path) -> None:
    """The slice path copies with torch (a write to read-only memory would kill the process: SIGSEGV)."""
    res = subprocess.run([sys.executable, "-c", _READ_ONLY_RESHARD, str(ckpt), str(tmp_path / "buf")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert "REFUSED" in res.stdout and "'w'" in res.stdout and "read-only" in res.stdout, res.stdout


def test_loading_into_an_expanded_template_is_refused(ckpt: Path) -> None:
    tpl = small_template()
    tpl["w"] = torch.zeros(1, 6).expand(8, 6)
    with pytest.raises(nostall.CheckpointLoadError, match=r"'w'.*clone"):
        nostall.load(tpl, str(ckpt))
