"""What a save does every time, kept small: the manifest's tensor records reach the writer once per
plan, the root is checked without listing it while it is the directory last checked, a DTensor state
is flattened without autograd; and none of it changes what is written or refused."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
import torch.distributed as dist

import nostall
from nostall.core.jobs import Destination, Msg
from nostall.core.model import flatten
from nostall.storage import root as root_module
from nostall.storage.posix import PosixRoot


def _state(n: int = 3) -> dict:
    g = torch.Generator().manual_seed(n)
    return {"model": {f"w{i}": torch.randn(64, 8, generator=g) for i in range(n)}, "step": n}


def _files(step_dir) -> dict:
    return {n: open(os.path.join(step_dir, n), "rb").read() for n in sorted(os.listdir(step_dir))}


def _spy_messages(mgr: nostall.CheckpointManager) -> list:
    writer = mgr._writer
    assert writer is not None
    sent: list = []
    conn = writer._conn
    send = conn.send

    def spy(msg: Msg) -> None:
        sent.append(msg)
        send(msg)

    conn.send = spy
    return sent


def test_the_writer_gets_the_tensor_records_once_per_plan_and_the_manifests_stay_the_same(tmp_path):
    """Saves of one plan send the records once; a new plan sends its own; every manifest equals a synchronous
    save's byte for byte (the writer fills in the records it holds)."""
    states = [_state(3), _state(3), _state(3), _state(4), _state(4)]
    with nostall.CheckpointManager(tmp_path / "async", async_save=True) as m:
        m.save(0, states[0]).result()  # the writer's first job: records sent
        sent = _spy_messages(m)
        for step, s in enumerate(states[1:], start=1):
            m.save(step, s).result()
        saves = [msg for msg in sent if msg.op.value == "save"]
    with nostall.CheckpointManager(tmp_path / "sync") as m:
        for step, s in enumerate(states):
            m.save(step, s)
    assert [msg.records is not None for msg in saves] == [False, False, True, False]  # step 3: a new structure
    assert all(not msg.job.manifest.tensors for msg in saves)  # the job itself never carries them
    for step in range(len(states)):
        assert _files(tmp_path / "sync" / f"step_{step}") == _files(tmp_path / "async" / f"step_{step}"), step


def test_a_new_writer_gets_the_records_again(tmp_path):
    """A writer that died is replaced; the fresh one holds nothing, so the records go again."""
    with nostall.CheckpointManager(tmp_path, async_save=True) as m:
        m.save(1, _state()).result()
        m._writer.proc.kill()
        m._writer.proc.wait()
        m._writer.ensure_alive()
        sent = _spy_messages(m)
        m.save(2, _state()).result()
        assert [msg.records is not None for msg in sent if msg.op.value == "save"] == [True]
    with nostall.CheckpointManager(tmp_path, read_only=True) as m:
        out = m.load({"model": {f"w{i}": torch.zeros(64, 8) for i in range(3)}, "step": 0})
    assert torch.equal(out["model"]["w2"], _state()["model"]["w2"]) and out["step"] == 3


def _dest(root: PosixRoot, step: int) -> Destination:
    return Destination(root, f"step_{step}", step, uuid.uuid4().hex, move_latest=True)


def test_the_root_is_listed_once_then_checked_without_listing(tmp_path, monkeypatch):
    root = PosixRoot(str(tmp_path / "run"))
    claim = root.claim()
    assert claim.held
    listed: list = []
    real = os.listdir

    def spy(path=".") -> list:
        listed.append(os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", spy)
    for step in range(3):
        dest = _dest(root, step)
        root.make_staging(dest)
        root.abort(dest)
    claim.release()
    assert listed.count(root.url) == 1  # the first save's full check; the same directory after that


def test_a_replaced_root_is_checked_in_full_again(tmp_path):
    """A root moved away and made again (with a linked step in it) is refused by name."""
    run = tmp_path / "run"
    root = PosixRoot(str(run))
    claim = root.claim()
    assert claim.held
    dest = _dest(root, 1)
    root.make_staging(dest)
    root.abort(dest)
    os.rename(run, tmp_path / "old")
    os.makedirs(tmp_path / "elsewhere" / "step_5")
    run.mkdir()
    os.symlink(tmp_path / "elsewhere" / "step_5", run / "step_5")
    with pytest.raises(nostall.CheckpointError, match="step_5 is a symbolic link"):
        root.make_staging(_dest(root, 2))
    assert sorted(os.listdir(tmp_path / "elsewhere" / "step_5")) == []
    claim.release()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_linked_mid_run_fails_the_save_before_its_commit_point(tmp_path, async_save):
    """A step_<N> replaced by a link while the manager runs: the next save fails naming it, nothing of that
    save is committed, ``latest`` still names the last good step, and the link's target is untouched."""
    elsewhere = tmp_path / "elsewhere"
    with nostall.CheckpointManager(elsewhere) as m:
        m.save(7, _state())
    run = tmp_path / "run"
    with nostall.CheckpointManager(run, async_save=async_save, keep_last=None) as m:
        for step in (1, 2):
            h = m.save(step, _state())
            if async_save:
                h.result()
        os.symlink(elsewhere / "step_7", run / "step_7")
        with pytest.raises(nostall.CheckpointSaveError, match="step_7 is a symbolic link"):
            h = m.save(3, _state())
            if async_save:
                h.result()
        os.unlink(run / "step_7")
    assert not (run / "step_3").exists()
    assert (run / "latest").read_text().strip() == "2"
    assert sorted(os.listdir(elsewhere / "step_7")) == sorted(_files(elsewhere / "step_7"))


def test_the_mark_names_this_process_and_its_start(tmp_path):
    """The start time is read once per process, and is this process's (the sweep tells a live maker by it)."""
    first = root_module.mark_content("a" * 32).decode().split("\n")
    again = root_module.mark_content("b" * 32).decode().split("\n")
    host, pid, start = first[1].split()
    assert (first[0], again[0]) == ("a" * 32, "b" * 32) and first[1] == again[1]
    assert int(pid) == os.getpid() and start == root_module._start_time(os.getpid()) != ""
    assert not root_module.maker_gone("\n".join(first).encode())


@pytest.fixture
def one_rank():
    """A one-rank gloo group on an in-memory store (no server), for DTensors."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_dtensor_state_is_flattened_without_autograd(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    local = torch.randn(4, 3)
    param = torch.nn.Parameter(DTensor.from_local(local.clone(), mesh, [Shard(0)]))
    state = {"p": param, "m": DTensor.from_local(local, mesh, [Shard(0)]), "x": torch.ones(2, requires_grad=True)}
    assert torch.is_grad_enabled()
    flat = flatten(state)
    assert torch.is_grad_enabled()  # the caller's mode is left as it was
    p, m = flat.tensors["p"], flat.tensors["m"]
    assert p.data.grad_fn is None and m.data.grad_fn is None  # no autograd node per leaf
    assert m.data.data_ptr() == local.data_ptr()  # the DTensor's own memory, not a copy
    assert torch.equal(p.data, local) and p.sharded and p.main and p.global_shape == (4, 3)
    assert p.global_offset == (0, 0) and flat.tensors["x"].data is state["x"]
