"""Loads over a manager's group: rank 0 reads the manifest once and each rank gets its share (loading/collective.py)."""

from __future__ import annotations

import torch

from tests.dist_harness import RankPool

ROWS = 8


def _state(rank, world, step):
    import nostall

    rows = ROWS // world
    full = torch.arange(ROWS * 4.0).reshape(ROWS, 4) + step
    return {
        "w": nostall.ShardedTensor(full[rows * rank: rows * (rank + 1)].clone(), (ROWS, 4), (rows * rank, 0)),
        "b": torch.arange(3.0) + step,
        "pos": nostall.PerRank({"n": torch.tensor([rank * 10 + step])}),
        "step": step,
    }


def _template(rank, world):
    import nostall

    # columns, not the saved rows: a resharded load
    return {"w": nostall.ShardedTensor(torch.zeros(ROWS, 2), (ROWS, 4), (0, 2 * rank)), "b": torch.zeros(3),
            "pos": nostall.PerRank({"n": torch.zeros(1, dtype=torch.long)}), "step": 0}


def _job(rank, world, root):
    import nostall
    from nostall.loading import collective, manifests

    reads = []
    real = manifests.read_manifest

    def counting(*a, **k):
        reads.append(a[0])
        return real(*a, **k)

    collective.read_manifest = counting  # the module's name for it: every read of a shared load
    out = {}
    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, _state(rank, world, 1))
        mgr.save(2, _state(rank, world, 2))
        got = mgr.load(_template(rank, world))
        full = torch.arange(ROWS * 4.0).reshape(ROWS, 4) + 2
        out["w"] = torch.equal(got["w"].data, full[:, 2 * rank: 2 * rank + 2])
        out["b"] = torch.equal(got["b"], torch.arange(3.0) + 2)
        out["pos"] = int(got["pos"]["n"][0])
        out["step"] = got["step"]
        out["reads"] = len(reads)
        # the manifest this rank loaded from lists only the pieces its template needs
        m, _, files = collective.shared_manifest(mgr._comm, mgr.path_for(2), lambda head: {"w": nostall.ShardedTensor(
            torch.zeros(ROWS // world, 4), (ROWS, 4), ((ROWS // world) * rank, 0))})
        files.close()
        out["pieces"] = {k: len(t.pieces) for k, t in m.tensors.items()}
        out["keys"] = sorted(m.tensors)
        # ranks naming different checkpoints: refused on every rank
        try:
            mgr.load(_template(rank, world), step=1 + rank)
            out["mixed"] = None
        except nostall.CheckpointLoadError as e:
            out["mixed"] = str(e)
        # a rank whose template is wrong raises its own error; the other still loads
        try:
            got = mgr.load(["not a dict"] if rank == 1 else _template(rank, world))
            out["bad"] = ("ok", bool(torch.equal(got["b"], torch.arange(3.0) + 2)))
        except Exception as e:
            out["bad"] = (type(e).__name__, str(e))
        # a training load goes the same way
        torch.manual_seed(0)  # the same model on both ranks (a replicated tensor)
        model = torch.nn.Linear(4, 2)
        mgr.save(3, model=model)
        fresh = torch.nn.Linear(4, 2)
        mgr.load(model=fresh)
        out["model"] = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    return out


def test_each_rank_loads_its_share_and_only_rank_0_reads_the_manifest(pool2: RankPool, tmp_path):
    out = pool2.run(_job, str(tmp_path / "ck"))
    for r, o in enumerate(out):
        assert o["w"] and o["b"] and o["model"], o
        assert o["pos"] == r * 10 + 2 and o["step"] == 2
        # each rank's template asked for its rows of 'w': one of the two saved pieces; nothing of 'b'
        assert o["pieces"] == {"b": 0, "w": 1} and o["keys"] == ["b", "w"]
        assert o["mixed"] is not None and "different checkpoints" in o["mixed"] and "step_1" in o["mixed"]
    assert out[0]["reads"] >= 1 and out[1]["reads"] == 0
    assert out[0]["bad"] == ("ok", True)
    assert out[1]["bad"][0] == "InvalidStateError" and "dict" in out[1]["bad"][1]


def _missing(rank, world, root):
    import nostall

    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, _state(rank, world, 1))
        try:
            mgr.load(_template(rank, world), path=root + "/nowhere" if rank == 0 else root)
            return None
        except nostall.CheckpointError as e:
            return type(e).__name__, str(e)


def test_rank_0s_read_error_is_raised_on_every_rank(pool2: RankPool, tmp_path):
    out = pool2.run(_missing, str(tmp_path / "ck"))
    assert all(o is not None for o in out), out
    assert out[1][0] in ("CheckpointNotFoundError", "CheckpointLoadError"), out


def _replicas(rank, world, root, read_once):
    import nostall

    torch.manual_seed(0)  # data-parallel replicas: the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with nostall.CheckpointManager(root, read_once=read_once) as mgr:
        mgr.save(1, model=model)
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        got = mgr.load(model=fresh)
        equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return equal, got.bytes_read, got.bytes_received, nbytes


def test_replicas_read_each_stored_byte_once_and_pass_it_on(pool2: RankPool, tmp_path):
    out = pool2.run(_replicas, str(tmp_path / "a"), True)
    nbytes = out[0][3]
    assert all(o[0] for o in out)
    # the job read the checkpoint's bytes once from storage, split between the two readers
    assert sum(o[1] for o in out) == nbytes
    assert sum(o[2] for o in out) == nbytes and all(o[1] > 0 and o[2] > 0 for o in out), out
    # without it, each replica reads every byte
    out = pool2.run(_replicas, str(tmp_path / "b"), False)
    assert all(o[0] and o[1] == nbytes and o[2] == 0 for o in out), out


def _bad_reader(rank, world, root):
    import os

    import nostall

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with nostall.CheckpointManager(root, read_once=True) as mgr:
        mgr.save(1, model=model)
        mgr._comm.all_gather(None)
        if rank == 0:  # damage the middle of the one data file, which both ranks need whole
            path = os.path.join(mgr.path_for(1), "rank0.safetensors")
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) - 100)
                f.write(b"\xff" * 8)
        mgr._comm.all_gather(None)
        try:
            mgr.load(model=torch.nn.Linear(64, 64))
            return None
        except nostall.CheckpointError as e:
            return type(e).__name__, str(e)


def test_a_reader_that_finds_damage_tells_the_ranks_it_reads_for(pool2: RankPool, tmp_path):
    out = pool2.run(_bad_reader, str(tmp_path / "c"))
    assert all(o is not None and o[0] == "CheckpointCorruptError" or (o and "could not be read by rank" in o[1])
               for o in out), out
    assert any("checksum mismatch" in o[1] and "rank0.safetensors" in o[1] for o in out), out


def _one_rank_missing_step(rank, world, root):
    import nostall

    with nostall.CheckpointManager(root) as mgr:
        mgr.save(1, _state(rank, world, 1))
        try:
            got = mgr.load(_template(rank, world), step=1 if rank == 0 else 99)
            return "ok", got["step"]
        except nostall.CheckpointError as e:
            return type(e).__name__, str(e)


def test_a_rank_whose_path_fails_raises_its_own_error_and_the_others_load(pool2: RankPool, tmp_path):
    out = pool2.run(_one_rank_missing_step, str(tmp_path / "ck"))
    assert out[0] == ("ok", 1), out
    assert out[1][0] == "CheckpointNotFoundError" and "step 99" in out[1][1], out


def _refused_load_releases_files(rank, world, root):
    import os

    import nostall

    with nostall.CheckpointManager(root, read_once=True) as mgr:
        mgr.save(1, _state(rank, world, 1))
        mgr.load(_template(rank, world))  # warm: whatever a first load opens once
        before = len(os.listdir("/proc/self/fd"))
        bad = dict(_template(rank, world), extra=torch.zeros(2))  # a key the checkpoint lacks: strict refuses
        try:
            mgr.load(bad)
            return "loaded"
        except nostall.CheckpointLoadError as e:
            assert "extra" in str(e), e
        return len(os.listdir("/proc/self/fd")) - before


def test_a_refused_shared_load_closes_its_files(pool2: RankPool, tmp_path):
    assert pool2.run(_refused_load_releases_files, str(tmp_path / "ck")) == [0, 0]
