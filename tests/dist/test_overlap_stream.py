"""Overlapped saves that stream: the job goes to the writer first, and the writer writes each chunk as it is staged.

The copy is held on purpose between two chunks (``_faults.stage_delay_s``, whose sleeps run on a clock
this module's :func:`held_copy` fixture replaces: the n-th sleep waits for the test), so "the first chunk
is staged, the rest is not" holds whatever the machine's speed. Nothing here asserts a time: the files the
writer has written while the copy is held, the checkpoints committed or not, and their bytes.
"""

from __future__ import annotations

import glob
import os
import random
import signal
import threading
import time
import types

import pytest
import torch

import nostall
from nostall.core.jobs import FileJob, SaveJob, Segment
from nostall.saving.area import STREAM_CHUNKS, stream_chunks
from nostall.saving.writer import stream_segments

BLOCK = 64 << 10
BOUND_S = 60.0  # only a hang reaches it


class HeldCopy:
    """A clock for the saver module whose ``hold_at``-th sleep waits until :meth:`release`; the others pass."""

    def __init__(self, hold_at: int) -> None:
        self.hold_at = hold_at
        self.calls = 0
        self.reached = threading.Event()
        self.released = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.calls += 1
        if self.calls == self.hold_at:
            self.reached.set()
            if not self.released.wait(BOUND_S):
                raise AssertionError(f"the held copy was not released within {BOUND_S:.0f} s")

    def wait_reached(self) -> None:
        assert self.reached.wait(BOUND_S), "the copy never reached the held chunk"

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def held_copy(monkeypatch):
    """Hold an overlapped copy before its second chunk (the first is staged and handed to the writer)."""
    from nostall.saving import saver

    held = HeldCopy(hold_at=2)
    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    clock.sleep = held.sleep
    monkeypatch.setattr(saver, "time", clock)  # the saver module's clock only
    yield held
    held.release()


def _data_files(step_dir):
    return {os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(f"{step_dir}/*.safetensors"))}


def _staged_data_sizes(root, committed):
    """Sizes of the data files being written under ``root``, outside committed checkpoints (any hidden dir)."""
    out = {}
    for d, _, names in os.walk(root):
        if any(os.path.commonpath([d, c]) == c for c in committed):
            continue
        for n in names:
            if n.endswith(".safetensors"):
                out[os.path.join(d, n)] = os.path.getsize(os.path.join(d, n))
    return out


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(1024, 1024, generator=g),  # 4 MiB: several chunks on its own
        "transposed": torch.randn(512, 1024, generator=g).t(),  # not contiguous
        "bn": {"running_mean": torch.randn(4096, generator=g)},
        "strided": torch.randn(600, 700, generator=g)[::2, 1::3],
        "half": torch.randn(300, 333, generator=g).to(torch.bfloat16),
        "flags": torch.rand(5000, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 7),
        "b": torch.randn(512, 1024, generator=g),  # last in the files: copied after "a"
    }


def _flat(state, prefix=""):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _zeros_like(state):
    return {k: _zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in state.items()}


def _equal(a, b):
    fa, fb = _flat(a), _flat(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def _sync_copy(root, state, step=1):
    with nostall.CheckpointManager(root, block_size=BLOCK) as m:
        m.save(step, state)
        return _data_files(m.path_for(step))


# --------------------------------------------------------------------------- the stream, end to end


def test_the_writer_writes_the_first_chunk_while_the_copy_is_held_and_the_files_equal_a_sync_save(tmp_path,
                                                                                                    held_copy):
    state = _state()
    mgr = nostall.CheckpointManager(tmp_path / "run", async_save=True, overlap=True, block_size=BLOCK)
    mgr._faults.stage_delay_s = 0.001  # a sleep before each chunk: the second one is held
    h = mgr.save(1, state, stage_now="bn/")  # one key staged before save() returns, in the middle of the files
    held_copy.wait_reached()  # chunk 0 staged and handed over; the rest not copied yet
    deadline = time.monotonic() + BOUND_S
    written = {}
    while not any(written.values()) and time.monotonic() < deadline:
        written = _staged_data_sizes(tmp_path / "run", [])
        time.sleep(0.01)
    assert any(written.values()), "the writer wrote nothing of the first chunk while the copy was held"
    assert not h.done()
    held_copy.release()
    stats = h.result()
    assert stats.overlap and stats.bytes_written == sum(len(b) for b in _data_files(mgr.path_for(1)).values())
    got = _zeros_like(state)
    mgr.load(got, 1)
    assert _equal(got, state)
    streamed = _data_files(mgr.path_for(1))
    mgr.close()
    assert streamed == _sync_copy(tmp_path / "sync", state)


def test_a_writer_killed_mid_stream_commits_nothing_the_previous_checkpoint_loads_and_the_next_save_works(
        tmp_path, held_copy):
    state = _state()
    mgr = nostall.CheckpointManager(tmp_path, async_save=True, overlap=True, block_size=BLOCK, timeout=60)
    mgr.save(1, state).result()
    mgr._faults.stage_delay_s = 0.001
    changed = {k: v * 2 if v.dtype.is_floating_point else v for k, v in _flat(state).items()}
    changed_state = {"bn": {"running_mean": changed.pop("bn/running_mean")}, **changed}
    h = mgr.save(2, changed_state)
    held_copy.wait_reached()  # the writer has the job and chunk 0
    pid = mgr.writer_pid
    os.kill(pid, signal.SIGKILL)
    mgr._writer.proc.wait(BOUND_S)
    held_copy.release()  # the copy goes on and finds no writer
    with pytest.raises(nostall.CheckpointSaveError, match="step 2"):
        h.result()
    assert mgr.steps() == [1]
    got = _zeros_like(state)
    mgr.load(got, 1)
    assert _equal(got, state)
    mgr.save(3, changed_state).result()  # a fresh writer
    assert mgr.writer_pid != pid and mgr.steps() == [1, 3]
    mgr.load(got, 3)
    assert _equal(got, changed_state)
    mgr.close()


def test_a_copy_error_mid_stream_commits_nothing_the_previous_checkpoint_loads_and_the_next_save_works(
        tmp_path, held_copy):
    state = _state()
    mgr = nostall.CheckpointManager(tmp_path, async_save=True, overlap=True, block_size=BLOCK, timeout=60)
    mgr.save(1, state).result()
    pid = mgr.writer_pid
    mgr._faults.stage_delay_s = 0.001
    b = state["b"]
    h = mgr.save(2, state)
    held_copy.wait_reached()  # chunk 0 (of "a") is with the writer
    state["b"] = torch.zeros(3)  # breaks the contract: the copy of "b", later in the stream, fails
    keep = b.clone()
    b.set_(torch.zeros(3))
    held_copy.release()
    with pytest.raises(nostall.CheckpointSaveError, match="step 2.*'b'"):
        h.result()
    assert mgr.steps() == [1] and mgr.writer_pid == pid  # the writer failed the job and lives on
    assert _staged_data_sizes(tmp_path, [str(mgr.path_for(1))]) == {}  # its partial files removed
    state["b"] = keep
    got = _zeros_like(state)
    mgr.load(got, 1)
    assert _equal(got, state)
    mgr.save(3, state).result()
    assert mgr.steps() == [1, 3]
    got3 = _zeros_like(state)
    mgr.load(got3, 3)
    mgr.close()
    assert _equal(got3, state)


def test_an_incremental_overlapped_save_streams_whole_pieces_and_writes_only_what_changed(tmp_path):
    state = _state()
    with nostall.CheckpointManager(tmp_path, async_save=True, overlap=True, block_size=BLOCK, incremental=True) as m:
        full = m.save(1, state).result()
        state["b"].add_(1.0)  # only "b" changes
        part = m.save(2, state).result()
        assert part.bytes_written < full.bytes_written // 4 and part.bytes_written >= state["b"].numel() * 4
        got = _zeros_like(state)
        m.load(got, 2)
    assert _equal(got, state)


# --------------------------------------------------------------------------- the pieces, property-checked


def _random_files(rng, block):
    from nostall.planning.plan import FilePlan, WriteItem

    files, offsets, pos_area = [], [], 0
    for fi in range(rng.randint(1, 3)):
        pos = hdr = rng.randint(8, 300)
        items = []
        for i in range(rng.randint(0, 6)):
            n = rng.choice([0, rng.randint(1, 40) * 8, rng.randint(1, 40) * block // 4 * 8 // 8])
            items.append(WriteItem(f"k{fi}.{i}", False, (0,), f"f{fi}", pos, pos + n))
            pos += n
        files.append(FilePlan(f"f{fi}", 0, b"h" * hdr, pos, tuple(items)))
        offsets.append(pos_area)
        pos_area += -(-pos // 64) * 64
    return files, offsets, pos_area


def test_stream_chunks_cover_every_piece_once_in_order_and_the_writer_reads_back_the_same_segments():
    rng = random.Random(7)
    for _ in range(400):
        block = rng.choice([8, 64, 256])
        files, offsets, total = _random_files(rng, block)
        now = {it.key for f in files for it in f.items if rng.random() < 0.2}  # staged before: not in a chunk
        todo = [(off + it.start, it) for f, off in zip(files, offsets) for it in f.items if it.key not in now]
        whole = rng.random() < 0.3
        chunks = stream_chunks(todo, total, block, whole_pieces=whole)
        if not any(it.end > it.start for _, it in todo):
            assert all(not c.copies for c in chunks)
        copied = {}
        last_upto = 0
        for c in chunks:
            assert c.upto >= last_upto
            last_upto = c.upto
            for pos, it, a, b in c.copies:
                assert a == copied.get(it.key, 0) and a < b <= it.end - it.start  # in order, no gaps
                assert a % block == 0 and (b % block == 0 or b == it.end - it.start)
                assert not whole or (a == 0 and b == it.end - it.start)
                assert pos + (b - a) <= c.upto
                copied[it.key] = b
        assert copied == {it.key: it.end - it.start for _, it in todo if it.end > it.start}
        assert not chunks or chunks[-1].upto == total
        assert len(chunks) <= STREAM_CHUNKS + 1 or whole

        # the writer's side: the uptos give every header and piece once, in file order, cut on block boundaries
        jobs = tuple(FileJob(f.name, off, f.size, len(f.header), tuple((i.start, i.end) for i in f.items))
                     for f, off in zip(files, offsets))
        job = SaveJob(None, 0, 1, jobs, block, 60.0)  # type: ignore[arg-type]
        upto = stream_segments(job)
        segs = [s for c in chunks for s in upto(c.upto)] + ([] if chunks else upto(total))
        pos = {fi: 0 for fi in range(len(files))}
        for s in segs:
            assert isinstance(s, Segment) and s.start == pos[s.file] and s.end > s.start
            assert s.area_offset == offsets[s.file] + s.start
            pos[s.file] = s.end
        assert pos == {fi: f.size for fi, f in enumerate(files)}


def test_a_stream_offset_inside_a_block_is_refused_by_the_writer():
    job = SaveJob(None, 0, 1, (FileJob("f0", 0, 100 + 4096, 100, ((100, 4196),)),), 1024, 60.0)  # type: ignore
    upto = stream_segments(job)
    assert [(s.start, s.end) for s in upto(100 + 2048)] == [(0, 100), (100, 2148)]  # two blocks: fine
    with pytest.raises(RuntimeError, match="checksum-block boundary"):
        upto(100 + 2048 + 512)
    with pytest.raises(RuntimeError, match="header"):
        stream_segments(job)(50)


# --------------------------------------------------------------------------- two ranks


def _one_rank_breaks_its_stream(rank, world, root):
    import time as _time
    import types as _types

    import torch

    import nostall
    from nostall.saving import saver

    def shard(t):
        return nostall.ShardedTensor(t, (2 * t.shape[0], t.shape[1]), (rank * t.shape[0], 0))

    g = torch.Generator().manual_seed(rank)
    a, b = torch.randn(1024, 1024, generator=g), torch.randn(256, 1024, generator=g)
    mgr = nostall.CheckpointManager(f"{root}/run", async_save=True, overlap=True, block_size=BLOCK, timeout=60)
    mgr.save(1, {"a": shard(a), "b": shard(b)}).result()
    held = HeldCopy(hold_at=2)
    clock = _types.SimpleNamespace(**{n: getattr(_time, n) for n in dir(_time) if not n.startswith("_")})
    clock.sleep = held.sleep
    saver.time = clock  # this rank process's saver clock, put back below
    try:
        if rank == 1:
            mgr._faults.stage_delay_s = 0.001  # rank 1's copy is held after its first chunk, then fails
        keep = b.clone()
        h = mgr.save(2, {"a": shard(a * 2), "b": shard(b)})
        if rank == 1:
            held.wait_reached()
            b.set_(torch.zeros(3))
            held.release()
        try:
            h.result()
            failed = ""
        except nostall.CheckpointSaveError as e:
            failed = str(e)
        b.set_(keep)
        mgr._faults.stage_delay_s = 0.0
    finally:
        held.release()
        saver.time = _time
    steps = mgr.steps()
    mgr.save(3, {"a": shard(a * 3), "b": shard(b)}).result()
    got = {"a": shard(torch.zeros_like(a)), "b": shard(torch.zeros_like(b))}
    mgr.load(got, 3)
    ok = torch.equal(got["a"].data, a * 3) and torch.equal(got["b"].data, b)
    mgr.load(got, 1)
    ok1 = torch.equal(got["a"].data, a) and torch.equal(got["b"].data, b)
    final = mgr.steps()
    mgr.close()
    return failed, steps, ok, ok1, final


def test_a_copy_error_mid_stream_on_one_rank_fails_the_save_on_every_rank_and_the_next_one_works(pool2, tmp_path):
    out = pool2.run(_one_rank_breaks_its_stream, str(tmp_path))
    for rank, (failed, steps, ok, ok1, final) in enumerate(out):
        assert "step 2" in failed and "rank 1" in failed, (rank, failed)
        assert steps == [1] and final == [1, 3] and ok and ok1, (rank, steps, final, ok, ok1)
