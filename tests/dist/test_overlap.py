"""Overlapped staging (the copy runs while training goes on) and the host-memory budget (chunked staging).

The copy is held on purpose (``_faults.stage_delay_s`` under the ``staging_gate``
fixture, tests/conftest.py) until the test releases it, so that the optimizer step
really comes before the copy is done, whatever the machine's speed.
"""

from __future__ import annotations

import glob
import os
import random

import pytest
import torch

import nostall
from nostall.saving.area import _copy_elements, cut_chunks

BLOCK = 64 << 10


def _data_files(step_dir):
    return {os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(f"{step_dir}/*.safetensors"))}


def _sync_copy(root, state, step=1):
    """The same state saved synchronously: the reference bytes."""
    with nostall.CheckpointManager(root, block_size=BLOCK) as m:
        m.save(step, state)
        return _data_files(m.path_for(step))


def _model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 64))
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(8, 256)).sum().backward()
    opt.step()  # Adam state exists from here on
    return net, opt


def _state(net, opt):
    return {"model": net.state_dict(), "optim": {str(i): s for i, s in enumerate(opt.state.values())}}


def _snapshot(state):
    return {k: _snapshot(v) if isinstance(v, dict) else v.clone() if torch.is_tensor(v) else v
            for k, v in state.items()}


def _flat(state, prefix=""):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        elif torch.is_tensor(v):
            out[f"{prefix}{k}"] = v
    return out


def _zeros_like(state):
    return {k: (_zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) if torch.is_tensor(v) else v)
            for k, v in state.items()}


def _equal(a, b):
    fa, fb = _flat(a), _flat(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def _train_step(net, opt):
    opt.zero_grad()
    net(torch.randn(8, 256)).sum().backward()  # forward updates BatchNorm's running statistics in place
    opt.step()


def test_optimizer_step_right_after_an_overlapped_save_waits_for_the_copy(tmp_path, staging_gate):
    net, opt = _model()
    mgr = nostall.CheckpointManager(tmp_path / "run", async_save=True, overlap=True, block_size=BLOCK)
    opt.register_step_pre_hook(lambda *_: staging_gate.release())  # runs first: the copy starts as step() does
    mgr.attach(opt)
    mgr._faults.stage_delay_s = 1.0  # held by the gate
    state = _state(net, opt)
    at_save = _snapshot(state)
    h = mgr.save(1, state, stage_now="model/1.")  # BatchNorm's buffers change in the next forward
    assert not h.done()  # still copying
    _train_step(net, opt)  # forward, backward, then step() mutates parameters and Adam state in place
    assert not _equal(_state(net, opt), at_save)  # training really changed the state
    stats = h.result()
    assert stats.overlap and stats.staged_wait_s > 0 and stats.stall_s >= stats.staged_wait_s
    got = _zeros_like(at_save)
    mgr.load(got, 1)
    assert _equal(got, at_save)
    overlapped = _data_files(mgr.path_for(1))
    mgr.close()
    assert overlapped == _sync_copy(tmp_path / "sync", at_save)  # byte-identical to a sync save of that state


def test_without_the_hook_the_copy_would_see_the_step(tmp_path, staging_gate):
    """The hazard the hook removes is real: unattached, a mutation during the copy lands in the checkpoint."""
    w = torch.zeros(256, 256)
    mgr = nostall.CheckpointManager(tmp_path, async_save=True, overlap=True, block_size=BLOCK)
    mgr._faults.stage_delay_s = 1.0  # held by the gate
    h = mgr.save(1, {"w": w})
    w.add_(1.0)  # no wait_until_staged(): breaks the contract
    staging_gate.release()
    h.result()
    got = torch.full_like(w, -1.0)
    mgr.load({"w": got}, 1)
    mgr.close()
    assert torch.equal(got, torch.ones_like(w))


def test_stage_now_copies_the_selected_keys_before_save_returns(tmp_path, staging_gate):
    w, running = torch.zeros(1000), torch.zeros(1000)
    mgr = nostall.CheckpointManager(tmp_path, async_save=True, overlap=True, block_size=BLOCK)
    mgr._faults.stage_delay_s = 1.0  # held by the gate
    mgr.save(1, {"bn": {"running_mean": running}, "w": w}, stage_now=lambda key: key.startswith("bn/"))
    running.add_(5.0)  # "forward" changes it before the optimizer step, while the rest is not copied yet
    staging_gate.release()
    mgr.wait_until_staged()
    w.add_(1.0)
    got = {"bn": {"running_mean": torch.ones(1000)}, "w": torch.ones(1000)}
    mgr.load(got, 1)
    mgr.close()
    assert torch.equal(got["bn"]["running_mean"], torch.zeros(1000)) and torch.equal(got["w"], torch.zeros(1000))


def test_load_save_and_close_wait_for_an_overlapped_copy(tmp_path):
    w = torch.arange(4096, dtype=torch.float32)
    mgr = nostall.CheckpointManager(tmp_path, async_save=True, overlap=True, keep_last=1, block_size=BLOCK)
    mgr._faults.stage_delay_s = 0.2
    mgr.save(1, {"w": w})
    got = torch.zeros_like(w)
    mgr.load({"w": got}, 1)  # finalizes: waits for the copy, then the commit
    assert torch.equal(got, w)
    mgr.save(2, {"w": w * 2})
    mgr.save(3, {"w": w * 3})  # waits for step 2's copy and commit first
    mgr.close()  # and for step 3's
    with nostall.CheckpointManager(tmp_path, read_only=True) as ro:
        assert ro.steps() == [3]
        ro.load({"w": got})
    assert torch.equal(got, w * 3)


def test_close_detaches_the_optimizer(tmp_path):
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=1.0)
    mgr = nostall.CheckpointManager(tmp_path, async_save=True, overlap=True)
    mgr.attach(opt)
    assert len(opt._optimizer_step_pre_hooks) == 1
    mgr.close()
    assert len(opt._optimizer_step_pre_hooks) == 0


# --------------------------------------------------------------------------- host-memory budget


def _big_state():
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(1024, 1024, generator=g),  # 4 MiB: larger than the budget on its own
        "transposed": torch.randn(512, 1024, generator=g).t(),  # 2 MiB, not contiguous
        "strided": torch.randn(600, 700, generator=g)[::2, 1::3],  # not contiguous, odd sizes
        "half": torch.randn(300, 333, generator=g).to(torch.bfloat16),
        "flags": torch.rand(5000, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 7),
        "meta": {"step": 5},
    }


def _state_bytes(state):
    return sum(v.numel() * v.element_size() for v in _flat(state).values())


def _shmem_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    raise AssertionError("no RssShmem")


@pytest.mark.parametrize("overlap", [False, True])
def test_budget_of_a_quarter_of_the_state_bounds_staging_memory_and_the_bytes_are_identical(tmp_path, overlap):
    state = _big_state()
    budget = _state_bytes(state) // 4
    mgr = nostall.CheckpointManager(tmp_path / "run", async_save=True, overlap=overlap, block_size=BLOCK,
                                    staging_budget_bytes=budget)
    stats = mgr.save(1, state).result()
    assert stats.chunks > 4 and 0 < stats.staging_bytes <= budget
    assert _shmem_kb(mgr.writer_pid) * 1024 <= budget  # what the writer maps of the area, resident
    got = _zeros_like(state)
    got["meta"] = None
    restored = mgr.load(got, 1)
    assert _equal(got, state) and restored["meta"] == {"step": 5}
    budgeted = _data_files(mgr.path_for(1))
    mgr.close()
    assert budgeted == _sync_copy(tmp_path / "sync", state)


def test_a_state_within_the_budget_is_staged_at_once_within_it(tmp_path):
    state = {"w": torch.randn(1000, 100)}
    mgr = nostall.CheckpointManager(tmp_path, async_save=True, staging_budget_bytes=1 << 20, block_size=BLOCK)
    stats = mgr.save(1, state).result()
    mgr.close()
    assert stats.chunks == 0 and stats.staging_bytes <= 1 << 20


def test_a_chunked_save_that_fails_to_write_commits_nothing_and_the_next_one_works(tmp_path):
    state = _big_state()
    mgr = nostall.CheckpointManager(tmp_path, async_save=True, staging_budget_bytes=1 << 20, block_size=BLOCK)
    mgr.save(1, state).result()
    mgr._faults.writer_fault = "enospc"
    with pytest.raises(nostall.CheckpointSaveError, match="step 2"):
        mgr.save(2, state).result()
    assert mgr.steps() == [1]
    mgr._faults.writer_fault = None
    mgr.save(3, state).result()
    assert mgr.steps() == [1, 3]
    mgr.close()


def test_a_budget_too_small_for_a_header_is_a_clear_error(tmp_path):
    state = {f"k{i:05d}": torch.zeros(1) for i in range(3000)}  # a header of ~200 KB
    state["big"] = torch.zeros(1 << 18)
    mgr = nostall.CheckpointManager(tmp_path, async_save=True, staging_budget_bytes=4 * BLOCK, block_size=BLOCK)
    with pytest.raises(nostall.CheckpointSaveError, match="staging_budget_bytes"):
        mgr.save(1, state).result()
    assert mgr.steps() == []
    mgr.close()
    with pytest.raises(ValueError, match="staging_budget_bytes"):
        nostall.CheckpointManager(tmp_path / "x", staging_budget_bytes=1000, block_size=BLOCK)


# --------------------------------------------------------------------------- the pieces, property-checked


def test_chunks_cover_every_byte_once_in_order_on_block_boundaries():
    from nostall.planning.plan import FilePlan, WriteItem

    rng = random.Random(5)
    for _ in range(300):
        block = rng.choice([8, 64, 256])
        files = []
        for fi in range(rng.randint(1, 3)):
            pos = hdr = rng.randint(8, 300)
            items = []
            for i in range(rng.randint(0, 5)):
                n = rng.randint(0, 2000) // 8 * 8
                items.append(WriteItem(f"k{i}", False, (0,), f"f{fi}", pos, pos + n))
                pos += n
            files.append(FilePlan(f"f{fi}", 0, b"h" * hdr, pos, tuple(items)))
        capacity = rng.randint(max(block, 300), 3000)
        chunks = cut_chunks(files, capacity, block)
        expect = [(fi, 0) for fi in range(len(files))]
        covered = {fi: 0 for fi in range(len(files))}
        for chunk in chunks:
            end = 0
            for c in chunk:
                s = c.seg
                assert s.start == covered[s.file] and s.area_offset % 64 == 0 and s.area_offset >= end
                end = s.area_offset + s.end - s.start
                assert end <= capacity
                if c.item is not None:
                    assert c.item_offset % block == 0 and c.item.start <= s.start and s.end <= c.item.end
                covered[s.file] = s.end
        assert [covered[fi] for fi, _ in expect] == [f.size for f in files]


def test_element_ranges_of_strided_tensors_copy_exactly():
    rng = random.Random(9)
    g = torch.Generator().manual_seed(9)
    for _ in range(300):
        base = torch.randn(rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9), generator=g)
        views = [base, base.transpose(0, 2), base[:, ::2], base.permute(1, 0, 2)[1:], base[..., 0]]
        t = rng.choice(views)
        n = t.numel()
        if n == 0:
            continue
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        out = torch.full((b - a,), float("nan"))
        _copy_elements(t, a, b, out, False)
        assert torch.equal(out, t.reshape(-1)[a:b])


# --------------------------------------------------------------------------- two ranks


def _two_ranks(rank, world, root, overlap, budget):
    import torch

    import nostall

    full = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)
    p = torch.nn.Parameter(full[256 * rank : 256 * (rank + 1)].clone())
    opt = torch.optim.SGD([p], lr=1.0)
    state = {"w": nostall.ShardedTensor(p.data, (512, 1024), (256 * rank, 0)), "b": torch.ones(3000) * 2}
    mgr = nostall.CheckpointManager(f"{root}/run", async_save=True, overlap=overlap, staging_budget_bytes=budget,
                                    block_size=64 << 10)
    mgr.attach(opt)
    mgr._faults.stage_delay_s = 0.1
    h = mgr.save(1, state)
    p.grad = torch.ones_like(p)
    opt.step()  # waits for the copy (overlap), then changes w
    stats = h.result()
    mgr.close()
    with nostall.CheckpointManager(f"{root}/sync", block_size=64 << 10) as ref:  # the state at save time
        ref.save(1, {"w": nostall.ShardedTensor(full[256 * rank : 256 * (rank + 1)].clone(), (512, 1024),
                                                (256 * rank, 0)), "b": torch.ones(3000) * 2})
    return stats.chunks, stats.staging_bytes


@pytest.mark.parametrize("overlap,budget", [(True, None), (True, 256 << 10), (False, 256 << 10)])
def test_two_ranks_overlapped_and_budgeted_saves_equal_a_sync_save(pool2, tmp_path, overlap, budget):
    out = pool2.run(_two_ranks, str(tmp_path), overlap, budget)
    if budget:
        assert all(chunks > 2 and size <= budget for chunks, size in out)
    assert _data_files(tmp_path / "run" / "step_1") == _data_files(tmp_path / "sync" / "step_1")
    full = torch.zeros(512, 1024)
    nostall.load({"w": full}, str(tmp_path / "run" / "step_1"), strict=False)
    assert torch.equal(full, torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024))


# --------------------------------------------------------------------------- CUDA (skipped without a GPU)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("budget", [None, 1 << 20])
def test_cuda_overlapped_copy_on_a_side_stream_sees_the_state_at_save_time(tmp_path, budget):
    net = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    mgr = nostall.CheckpointManager(tmp_path, async_save=True, overlap=True, staging_budget_bytes=budget)
    mgr.attach(opt)
    net.weight.data.mul_(3.0)  # queued on the current stream before save(): the copy must see it
    expect = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
    h = mgr.save(1, {"model": net.state_dict()})
    net(torch.randn(64, 1024, device="cuda")).sum().backward()
    opt.step()  # waits for the copy, then changes the weights on the default stream
    stats = h.result()
    assert stats.overlap and (budget is None or stats.staging_bytes <= budget)
    assert mgr._writer.area._pinned
    got = {k: torch.zeros_like(v) for k, v in expect.items()}
    mgr.load({"model": got}, 1)
    mgr.close()
    assert all(torch.equal(got[k], expect[k]) for k in expect)
