"""Loads from copies that lack data files, on real gloo ranks (issue 27; docs/protocol.md, "Loading").

Each rank names its own copy of one checkpoint (a directory of its own here; on real hosts the same path
names a directory per host, as a memory root does), from which some data files are deleted. What a rank's
copy lacks is read by a rank whose copy has it and sent over the group; the values must be bit-exact against
a load of the whole checkpoint, a file no rank has is an error on every rank naming it, and damage in the one
copy that has a file is a CheckpointCorruptError naming the file and the reading rank.
"""

from __future__ import annotations

import torch

from tests.dist_harness import RankPool

ROWS, COLS = 64, 256
BLOCK = 4096


def _model():
    torch.manual_seed(0)  # data-parallel replicas: the same model on every rank
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 16))


def _saved_extra(rank, world):
    """FSDP/TP-like sharded state: 'w' saved by rows, 'v' a flat vector saved in equal parts."""
    import nostall

    rows, n = ROWS // world, 4096 // world
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    v = torch.arange(4096, dtype=torch.float32) * 0.5
    return {"w": nostall.ShardedTensor(w[rows * rank: rows * (rank + 1)].clone(), (ROWS, COLS), (rows * rank, 0)),
            "v": nostall.ShardedTensor(v[n * rank: n * (rank + 1)].clone(), (4096,), (n * rank,))}


def _template(rank, world):
    """Loaded otherwise than saved: 'w' by columns (each saved piece needed in part by every rank), 'v' shifted
    by half a part (two pieces met in part)."""
    import nostall

    cols, n = COLS // world, 4096 // world
    lo = min(n * rank + n // 2, 4096 - n)
    return {"w": nostall.ShardedTensor(torch.zeros(ROWS, cols), (ROWS, COLS), (0, cols * rank)),
            "v": nostall.ShardedTensor(torch.zeros(n), (4096,), (lo,))}


def _load(mgr, path, own_copies):
    """The manager's load of ``path`` (training objects: the model and the sharded extra)."""
    from nostall.manager import _training

    model = _model()
    for p in model.parameters():
        p.data.zero_()
    training = _training(None, model, None, None, False, _template(mgr.rank, mgr.world_size), None, "load")
    with mgr._lock:
        got = mgr._load_locked(training, None, path, None, True, True, "error", own_copies=own_copies)
    return got, model


def _same(a, b):
    ga, ma = a
    gb, mb = b
    return (all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values()))
            and all(torch.equal(ga.extra[k].data, gb.extra[k].data) for k in ("w", "v")))


def _copies(rank, world, base, deletions, damage=None, other_step=()):
    """Save step 1 (and 2), load it whole, then load it from each rank's own copy less ``deletions[rank]``.

    ``damage``: (rank, file) whose copy gets one byte flipped in the middle of the file; ``other_step``: ranks
    whose copy is of step 2. Returns the full load's bytes, and the copy load's outcome: bytes and whether the
    values equal, or the error."""
    import os
    import shutil

    import nostall

    with nostall.CheckpointManager(base + "/ck", block_size=BLOCK) as mgr:
        mgr.save(1, model=_model(), extra=_saved_extra(rank, world))
        mgr.save(2, model=_model(), extra={k: nostall.ShardedTensor(v.data + 1, v.global_shape, v.global_offset)
                                           for k, v in _saved_extra(rank, world).items()})
        full = _load(mgr, mgr.path_for(1), False)
        mine = f"{base}/copy{rank}/step_1"
        shutil.copytree(mgr.path_for(2 if rank in other_step else 1), mine)
        for name in deletions.get(rank, ()):
            os.remove(os.path.join(mine, name))
        if damage is not None and damage[0] == rank:
            where = os.path.join(mine, damage[1])
            with open(where, "r+b") as f:
                f.seek(os.path.getsize(where) // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0xFF]))
        mgr._comm.all_gather(None)  # every copy made before any load
        out = {"full": (full[0].bytes_read, full[0].bytes_received), "files": sorted(os.listdir(mgr.path_for(1)))}
        try:
            got = _load(mgr, mine, True)
            out["copy"] = (got[0].bytes_read, got[0].bytes_received, _same(got, full))
        except nostall.CheckpointError as e:
            out["error"] = (type(e).__name__, str(e))
        mgr._comm.all_gather(None)
    return out


def test_a_rank_missing_its_own_file_gets_it_from_the_rank_that_has_it(pool2: RankPool, tmp_path):
    out = pool2.run(_copies, str(tmp_path), {1: ["rank1.safetensors"]})
    assert all("copy" in o and o["copy"][2] for o in out), out  # bit-exact against the whole load
    (r0, s0, _), (r1, s1, _) = out[0]["copy"], out[1]["copy"]
    assert s0 == 0 and r0 >= out[0]["full"][0]  # rank 0 has every file: reads its own (and rank 1's share)
    assert 0 < r1 < out[1]["full"][0] and s1 > 0  # rank 1 reads from the file it has, receives the rest
    assert r1 + s1 == out[1]["full"][0]  # and no byte more than the whole load reads


def test_each_file_on_exactly_one_rank(pool2: RankPool, tmp_path):
    out = pool2.run(_copies, str(tmp_path), {0: ["rank1.safetensors"], 1: ["rank0.safetensors"]})
    assert all("copy" in o and o["copy"][2] for o in out), out
    assert all(o["copy"][0] > 0 and o["copy"][1] > 0 for o in out), out


def test_a_file_no_rank_has_is_an_error_on_every_rank_naming_it(pool2: RankPool, tmp_path):
    out = pool2.run(_copies, str(tmp_path), {0: ["rank1.safetensors"], 1: ["rank1.safetensors"]})
    for o in out:
        name, msg = o["error"]
        assert name == "CheckpointLoadError", o
        assert "'rank1.safetensors'" in msg and "needed by ranks 0, 1" in msg and "data file missing" in msg
        assert "copy0/step_1/rank1.safetensors" in msg and "copy1/step_1/rank1.safetensors" in msg
    assert out[0]["error"] == out[1]["error"]


def test_damage_in_the_one_copy_with_the_file_is_named_on_every_receiver(pool2: RankPool, tmp_path):
    out = pool2.run(_copies, str(tmp_path), {0: ["rank1.safetensors"]}, (1, "rank1.safetensors"))
    for o in out:
        name, msg = o["error"]
        assert name == "CheckpointCorruptError" and "checksum mismatch" in msg and "rank1.safetensors" in msg, o
    assert "could not be read by rank 1" in out[0]["error"][1]  # the receiver names the reader


def test_copies_of_different_checkpoints_are_refused_naming_the_ranks(pool2: RankPool, tmp_path):
    out = pool2.run(_copies, str(tmp_path), {}, None, (1,))
    for o in out:
        name, msg = o["error"]
        assert name == "CheckpointLoadError" and "manifests differ" in msg, o
        assert "rank 0 (e.g." in msg and "rank 1 (e.g." in msg and "copy1/step_1" in msg
    assert out[0]["error"] == out[1]["error"]


def test_a_lost_host_reads_nothing_and_receives_its_share(pool4: RankPool, tmp_path):
    # ranks 0 and 1 (one host) hold every file (theirs and their peer host's replica); ranks 2 and 3 (a
    # replacement host) hold none
    every = [f"rank{r}.safetensors" for r in range(4)]
    out = pool4.run(_copies, str(tmp_path), {2: every, 3: every})
    assert set(every) <= set(out[0]["files"]), out[0]["files"]
    assert all("copy" in o and o["copy"][2] for o in out), out
    for r in (0, 1):
        assert out[r]["copy"][1] == 0, out  # they read everything they need themselves
    for r in (2, 3):
        read, received, _ = out[r]["copy"]
        assert read == 0 and received == out[r]["full"][0], out  # nothing from their empty copies
    # the replacement ranks' bytes were read by the ranks that hold them, beside their own
    assert sum(out[r]["copy"][0] for r in (0, 1)) > sum(out[r]["full"][0] for r in (0, 1))


def _replicas(rank, world, base, deletions, read_once=None):
    """A data-parallel job: the same model on every rank, every piece needed whole by every rank."""
    import os
    import shutil

    import nostall

    with nostall.CheckpointManager(base + "/ck", block_size=BLOCK, read_once=read_once) as mgr:
        mgr.save(1, model=_model())
        full = _load_model(mgr, mgr.path_for(1), False)
        mine = f"{base}/copy{rank}/step_1"
        shutil.copytree(mgr.path_for(1), mine)
        for name in deletions.get(rank, ()):
            if os.path.exists(os.path.join(mine, name)):
                os.remove(os.path.join(mine, name))
        mgr._comm.all_gather(None)
        got = _load_model(mgr, mine, True)
        mgr._comm.all_gather(None)
    same = all(torch.equal(a, b) for a, b in zip(full[1].state_dict().values(), got[1].state_dict().values()))
    return full[0].bytes_read, got[0].bytes_read, got[0].bytes_received, same


def _load_model(mgr, path, own_copies):
    from nostall.manager import _training

    model = _model()
    for p in model.parameters():
        p.data.zero_()
    training = _training(None, model, None, None, False, None, None, "load")
    with mgr._lock:
        return mgr._load_locked(training, None, path, None, True, True, "error", own_copies=own_copies), model


def test_replicated_pieces_one_rank_has_are_read_once_and_sent(pool2: RankPool, tmp_path):
    # rank 1's copy has no data file: every piece it needs, rank 0 reads once for both
    out = pool2.run(_replicas, str(tmp_path), {1: ["rank0.safetensors", "rank1.safetensors"]})
    assert all(o[3] for o in out), out
    full = out[0][0]
    assert out[0][1:3] == (full, 0)  # rank 0 read each byte once, for itself and rank 1
    assert out[1][1:3] == (0, full)  # rank 1 read nothing and received what it would have read


def test_read_once_across_holders_and_ranks_with_empty_copies(pool4: RankPool, tmp_path):
    # ranks 2 and 3 hold nothing; with read_once each stored byte is read once in the job, by rank 0 or 1
    every = [f"rank{r}.safetensors" for r in range(4)]
    out = pool4.run(_replicas, str(tmp_path), {2: every, 3: every}, True)
    assert all(o[3] for o in out), out
    total = sum(o[0] for o in out)  # the whole load, read once too: each stored byte once in the job
    assert sum(o[1] for o in out) == total and out[2][1] == out[3][1] == 0, out
    assert out[2][2] == out[3][2] == total and all(o[1] + o[2] == total for o in out), out
