"""Bad inputs that must be refused with an error naming what failed (issue 24, defects 6, 11, 14, 15).

Each test checks the outcome a user sees: the error's type, the key (``files=``
key, state key, rank) its message names, and that nothing was committed (the
previous checkpoint is still latest and loads) or nothing was written.
"""

from __future__ import annotations

import io
import os
import pathlib
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import nostall
from nostall.core.format import MAX_SIDE_FILE_BYTES


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _sparse(path: pathlib.Path, size: int) -> pathlib.Path:
    """A file of ``size`` bytes that takes no disk space (reading it yields zeros)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def _only_step_1(root: pathlib.Path, model: torch.nn.Module) -> None:
    """Step 1 is the only checkpoint, still latest, nothing left in staging, and it loads."""
    with nostall.CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [1] and mgr.latest_step() == 1
        assert [n for n in os.listdir(root / ".tmp") if n != ".lock"] == []
        fresh = torch.nn.Linear(4, 3)
        mgr.load(model=fresh)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


# --------------------------------------------------------------------------- 6: a total bound on side files


@pytest.mark.parametrize("async_save", [False, True])
def test_side_files_over_the_total_bound_are_refused_before_anything_is_read(tmp_path, async_save):
    """Each file is under the per-file cap, their sum is over the total bound: refused, naming the keys."""
    from nostall.saving.side_files import MAX_SIDE_FILES_TOTAL_BYTES

    per = 48 << 20
    assert per <= MAX_SIDE_FILE_BYTES
    n = MAX_SIDE_FILES_TOTAL_BYTES // per + 1  # just over the total
    tok = tmp_path / "tokenizer"
    for i in range(n - 1):
        _sparse(tok / f"part{i}.bin", per)
    m = _model()
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root), async_save=async_save) as mgr:
        mgr.save(1, model=m).result()
        files = {"tokenizer": tok, "notes.bin": bytes(per)}  # a directory and a value: both counted
        with pytest.raises(nostall.InvalidStateError) as ei:
            mgr.save(2, model=m, files=files).result()
    msg = str(ei.value)
    assert "'tokenizer'" in msg and "'notes.bin'" in msg, msg
    assert str((n - 1) * per) in msg and str(per) in msg, msg  # each key's size
    assert str(MAX_SIDE_FILES_TOTAL_BYTES) in msg, msg  # the bound
    assert "tensors" in msg, msg  # the fix
    _only_step_1(root, m)


def test_side_files_at_the_total_bound_are_saved(tmp_path):
    """Up to the bound is fine (sparse files: no disk space, zeros read back)."""
    from nostall.saving.side_files import MAX_SIDE_FILES_TOTAL_BYTES

    m = _model()
    a = _sparse(tmp_path / "a.bin", MAX_SIDE_FILE_BYTES)
    rest = MAX_SIDE_FILES_TOTAL_BYTES - MAX_SIDE_FILE_BYTES
    with nostall.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, model=m, files={"a.bin": a, "b.txt": "x" * rest})
        path = mgr.path_for(1)
    assert os.path.getsize(os.path.join(path, "a.bin")) + os.path.getsize(os.path.join(path, "b.txt")) \
        == MAX_SIDE_FILES_TOTAL_BYTES


# --------------------------------------------------------------------------- 11: errors naming what failed


def test_a_side_file_path_over_the_cap_is_refused_naming_its_key(tmp_path):
    big = _sparse(tmp_path / "weights" / "huge.bin", MAX_SIDE_FILE_BYTES + 1)
    m = _model()
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root)) as mgr:
        mgr.save(1, model=m)
        with pytest.raises(nostall.InvalidStateError) as ei:
            mgr.save(2, model=m, files={"extra_weights": big.parent})
    msg = str(ei.value)
    assert "'extra_weights/huge.bin'" in msg and "'extra_weights'" in msg, msg  # the file and its files= key
    assert str(MAX_SIDE_FILE_BYTES + 1) in msg and str(MAX_SIDE_FILE_BYTES) in msg, msg  # its size, the cap
    assert "tensors" in msg and "unexpected" not in msg and "Errno" not in msg, msg
    _only_step_1(root, m)


def test_a_missing_side_file_path_is_refused_naming_its_key(tmp_path):
    m = _model()
    with nostall.CheckpointManager(str(tmp_path / "run")) as mgr:
        with pytest.raises(nostall.InvalidStateError) as ei:
            mgr.save(1, model=m, files={"config.json": tmp_path / "nope.json"})
    msg = str(ei.value)
    assert "'config.json'" in msg and "nope.json" in msg and "unexpected" not in msg, msg


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_a_driver_value_nested_too_deep_is_refused_naming_the_key(tmp_path, kind):
    from nostall.core.model import MAX_DEPTH

    deep: object = 0
    for _ in range(100_000):
        deep = [deep] if kind == "list" else {"a": deep}
    m = _model()
    root = tmp_path / "run"
    with nostall.CheckpointManager(str(root)) as mgr:
        mgr.save(1, model=m)
        with pytest.raises(nostall.InvalidStateError) as ei:
            mgr.save(2, model=m, driver=deep)
    msg = str(ei.value)
    assert "'driver'" in msg and str(MAX_DEPTH) in msg and "RecursionError" not in msg, msg
    assert "json.dumps" in msg, msg  # the fix
    _only_step_1(root, m)


def test_a_value_at_the_depth_limit_round_trips(tmp_path):
    from nostall.core.model import MAX_DEPTH

    deep: object = 7
    for _ in range(MAX_DEPTH - 1):  # "driver" is the first level
        deep = [deep]
    m = _model()
    with nostall.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, model=m, driver=deep)
        assert mgr.load(model=torch.nn.Linear(4, 3)).driver == deep
        with pytest.raises(nostall.InvalidStateError, match="'driver'"):
            mgr.save(2, model=m, driver=[deep])


# --------------------------------------------------------------------------- 14: driver= on a rank other than 0


def _driver_on_rank_1(rank, world, root):
    results = []
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, model=m, driver={"position": 1} if rank == 0 else None)
        for step, driver in ((2, {"position": 2} if rank == 1 else None),  # rank 1 alone
                             (3, {"position": 3})):  # every rank
            try:
                mgr.save(step, model=m, driver=driver)
                results.append("saved")
            except nostall.InvalidStateError as e:
                results.append(str(e))
        steps = mgr.steps()
        loaded = mgr.load(model=torch.nn.Linear(4, 3)).driver
        dist.barrier()
        mgr.save(4, model=m, driver={"position": 4} if rank == 0 else None)  # the manager still works
        after = mgr.load(model=torch.nn.Linear(4, 3)).driver
    return results, steps, loaded, after


def test_driver_given_by_a_rank_other_than_0_is_refused_on_every_rank(pool2, tmp_path):
    out = pool2.run(_driver_on_rank_1, str(tmp_path / "run"))
    assert out[0] == out[1]  # every rank raised the same errors (none hung)
    results, steps, loaded, after = out[0]
    for msg in results:
        assert msg != "saved" and "rank 1" in msg and "driver=" in msg and "rank 0" in msg, msg
    assert "rank 0:" not in results[0], results[0]  # rank 0 did nothing wrong at step 2
    assert steps == [1] and loaded == {"position": 1}
    assert after == {"position": 4}


# --------------------------------------------------------------------------- 15: templates over immutable memory


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ckpt")
    nostall.save({"w": torch.arange(6, dtype=torch.float32), "n": 1}, path)
    return path


def _frombuffer(buf) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The given buffer is not writable": torch only warns
        return torch.frombuffer(buf, dtype=torch.float32)


def test_a_load_never_writes_into_a_bytes_object(saved):
    data = bytes(24)
    tpl = {"w": _frombuffer(data), "n": None}
    with pytest.raises(nostall.CheckpointLoadError) as ei:
        nostall.load(tpl, saved)
    assert "'w'" in str(ei.value) and "clone" in str(ei.value), str(ei.value)
    assert data == bytes(24)


def test_a_load_into_a_slice_of_a_bytes_object_is_refused(saved):
    """The resharding path (a slice of the template: torch's copy) is refused alike."""
    data = bytes(48)
    part = nostall.ShardedTensor(_frombuffer(data)[2:5], (6,), (2,))
    with pytest.raises(nostall.CheckpointLoadError, match="'w'"):
        nostall.load({"w": part}, saved)
    assert data == bytes(48)


def test_a_load_into_torch_or_file_mapped_memory_works(saved, tmp_path):
    """Memory torch allocated, and a mapping of a file (torch.from_file, safetensors, torch.load(mmap=True))."""
    want = torch.arange(6, dtype=torch.float32)
    own = {"w": torch.zeros(6), "n": None}
    nostall.load(own, saved)
    assert torch.equal(own["w"], want)
    f = tmp_path / "buf"
    f.write_bytes(bytes(24))
    mapped = {"w": torch.from_file(str(f), shared=False, size=6, dtype=torch.float32), "n": None}
    nostall.load(mapped, saved)
    assert torch.equal(mapped["w"], want)


def _digest(t: torch.Tensor) -> bytes:
    """What nostall bench train's verification does with a loaded tensor: read it through numpy."""
    return bytes(memoryview(t.contiguous().view(torch.uint8).numpy()))


def test_a_load_into_torch_memory_that_numpy_or_torch_load_made_not_resizable_works(saved):
    """``Tensor.numpy()`` marks torch's storage not resizable for good, and ``torch.load`` makes its storages
    so: still torch's memory. A template read through numpy after a load (the bench's verification) loads
    again; so does a view of such a storage, and a state from ``torch.load``."""
    want = torch.arange(6, dtype=torch.float32)
    base = torch.zeros(2, 6)
    tpl = {"w": base[1], "n": None}  # a view, as a DTensor's to_local() is
    nostall.load(tpl, saved)
    assert _digest(tpl["w"]) == _digest(want)
    assert not base.untyped_storage().resizable()  # what made the load refuse it (bench train, rank 0 and 1)
    base.zero_()
    nostall.load(tpl, saved)
    assert torch.equal(base[1], want) and torch.equal(base[0], torch.zeros(6))

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(6)}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert not loaded["w"].untyped_storage().resizable()
    nostall.load({**loaded, "n": None}, saved)
    assert torch.equal(loaded["w"], want)


def test_memory_torch_was_handed_is_refused_writable_or_not(saved):
    """torch.frombuffer over bytes at an offset, a bytearray, from_numpy over a writable array: the storage does
    not say whose memory it is nor whether it may be written, so each is refused, naming its key, unchanged."""
    data = bytes(32)
    arr = np.zeros(6, dtype=np.float32)
    ba = bytearray(24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        at_offset = torch.frombuffer(data, dtype=torch.float32, offset=8)
    for t in (at_offset, torch.frombuffer(ba, dtype=torch.float32), torch.from_numpy(arr)):
        with pytest.raises(nostall.CheckpointLoadError, match="'w'.*clone"):
            nostall.load({"w": t, "n": None}, saved)
    assert data == bytes(32) and not arr.any() and ba == bytearray(24)


def _bench_like_load(rank, world, root):
    """nostall bench train's flow: Adam moments and parameters as DTensor Shard(0) views, saved; a template of
    DTensor.from_local(zeros_like(local)); each load's result read through numpy, then loaded again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    p = torch.randn((5, 8), generator=g)
    p.grad = torch.randn((5, 8), generator=g)
    opt = torch.optim.Adam([p], foreach=False)
    opt.step()

    def view(t):
        return DTensor.from_local(t, mesh, [Shard(0)], shape=torch.Size((5 * world, 8)), stride=(8, 1))

    state = {"model": {"p": view(p)}, "optim": {"p": {k: view(opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")}}}
    nostall.save(state, root)

    def zero(v):
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        return DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, shape=v.shape,
                                  stride=v.stride())

    tpl = zero(state)
    locals_ = [tpl["model"]["p"], tpl["optim"]["p"]["exp_avg"], tpl["optim"]["p"]["exp_avg_sq"]]
    digests = []
    for _ in range(2):
        for d in locals_:
            d.to_local().zero_()
        nostall.load(tpl, root)
        digests.append([_digest(d.to_local()) for d in locals_])
    want = [_digest(t) for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    return digests == [want, want], tpl["model"]["p"].to_local().untyped_storage().resizable()


def test_a_bench_like_dtensor_template_read_through_numpy_loads_again(pool2, tmp_path):
    out = pool2.run(_bench_like_load, str(tmp_path / "ckpt"))
    assert out[0] == out[1] == (True, False)  # equal both times; the storage was not resizable for the 2nd load
