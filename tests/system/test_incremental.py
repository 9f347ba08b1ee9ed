"""Incremental saves (issue 19): each save writes only the pieces whose bytes changed.

Real saves and loads on a local root, two gloo ranks and an S3 server (moto); no mocks and no timing:
what a save wrote is read from the files on storage and from ``SaveStats.bytes_written``; every
retained checkpoint is loaded bit-exactly against the state at its save and verified with
``check_checkpoint`` after every step of each scenario.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any, Dict, List

import pytest
import torch

import nostall
from nostall.errors import CheckpointError
from nostall.loading.verify import check_checkpoint
from tests.dist_harness import run_ranks

# --------------------------------------------------------------------------- a LoRA-shaped state

BASE = (432, 1024)  # float32, frozen: 1.6875 MiB
EMBED = (64, 512)  # bfloat16, frozen: 64 KiB
ADAPTER = {"lora_A": (32, 256), "lora_B": (256, 32)}  # float32, 32 KiB each, changed every step
CHANGED = 3 * sum(4 * a * b for a, b in ADAPTER.values())  # adapter + exp_avg + exp_avg_sq: 192 KiB
FROZEN = 4 * BASE[0] * BASE[1] + 2 * EMBED[0] * EMBED[1]


def _frozen(seed: int = 1234) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"base.weight": torch.randn(BASE, generator=g),
            "embed.weight": torch.randn(EMBED, generator=g).to(torch.bfloat16)}


def _adapter(step: int, seed: int = 0) -> Dict[str, Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(10_000 * seed + step)
    return {part: {n: torch.randn(shape, generator=g) for n, shape in ADAPTER.items()}
            for part in ("model", "exp_avg", "exp_avg_sq")}


def _lora(step: int, seed: int = 0) -> Dict[str, Any]:
    """The state at ``step`` (``seed``: another run's adapter values)."""
    a = _adapter(step, seed)
    return {"model": {**_frozen(), **a["model"]}, "optim": {"exp_avg": a["exp_avg"], "exp_avg_sq": a["exp_avg_sq"]},
            "step": step, "seed": seed}


def _advance(state: Dict[str, Any], step: int, seed: int = 0) -> None:
    """A training step: the adapter and its moments change in place, the base does not."""
    a = _adapter(step, seed)
    for n in ADAPTER:
        state["model"][n].copy_(a["model"][n])
        state["optim"]["exp_avg"][n].copy_(a["exp_avg"][n])
        state["optim"]["exp_avg_sq"][n].copy_(a["exp_avg_sq"][n])
    state["step"], state["seed"] = step, seed


def _zeros_like(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.full_like(x, 7)  # not zeros: a piece left unread would show
    if isinstance(x, dict):
        return {k: _zeros_like(v) for k, v in x.items()}
    return None


def _same(a: Any, b: Any, where: str = "") -> None:
    """Bit-exact equality of two states (tensors compared byte for byte)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _load(path: str, like: Dict[str, Any], **kw: Any) -> Dict[str, Any]:
    """The checkpoint at ``path`` loaded into a fresh state shaped like ``like`` (objects included)."""
    got = _zeros_like(like)
    objs = nostall.load(got, path, **kw)
    return {**got, **{k: objs[k] for k in like if not isinstance(like[k], (dict, torch.Tensor))}}


# --------------------------------------------------------------------------- what is on a local root


def _manifest(root: str, step: int) -> Dict[str, Any]:
    with open(os.path.join(root, f"step_{step}", "manifest.json")) as f:
        return json.load(f)


def _own_bytes(root: str, step: int) -> int:
    """Bytes of the data files in a checkpoint's own directory that its manifest names (checked on disk)."""
    m = _manifest(root, step)
    total = 0
    for name, rec in m["files"].items():
        assert os.path.getsize(os.path.join(root, f"step_{step}", name)) == rec["size"]
        total += rec["size"]
    return total


def _retired(root: str, step: int) -> List[str]:
    return sorted(glob.glob(os.path.join(root, f"step_{step}", ".retired-*.json")))


def _audit(root: str, expected: Dict[int, Dict[str, Any]], like: Dict[str, Any]) -> None:
    """Every retained checkpoint of ``root`` verifies and loads as saved; every file a retained manifest
    references exists; every data file left on disk is named by a manifest (retained or retired)."""
    steps = nostall.CheckpointManager(root, read_only=True).steps()
    assert steps, "no checkpoint retained"
    live = set()
    for s in steps:
        path = os.path.join(root, f"step_{s}")
        report = check_checkpoint(path)
        assert report.ok, (s, report.problems)
        _same(_load(path, like), expected[s], f"step {s}")
        m = _manifest(root, s)
        for ref, rec in m.get("references", {}).items():
            assert os.path.getsize(os.path.join(root, ref)) == rec["size"], ref
            live.add(ref)
    named = set()
    for d in glob.glob(os.path.join(root, "step_*")):
        for mf in [os.path.join(d, "manifest.json")] + glob.glob(os.path.join(d, ".retired-*.json")):
            if os.path.exists(mf):
                with open(mf) as f:
                    named.update(f"{os.path.basename(d)}/{n}" for n in json.load(f)["files"])
    on_disk = {os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "step_*", "*.safetensors"))}
    assert on_disk <= named, f"data files no manifest names: {on_disk - named}"
    assert live <= on_disk


# --------------------------------------------------------------------------- 1. LoRA, sync and async


def _resume_fresh(rank: int, world: int, root: str, async_save: bool) -> Any:
    """A fresh process: a new manager resumes bit-exactly from each retained step, then trains on from the last."""
    out = {}
    mgr = nostall.CheckpointManager(root, incremental=True, keep_last=2, async_save=async_save)
    for s in mgr.steps():
        got = _zeros_like(_lora(s))
        objs = mgr.load(got, s)
        got["step"], got["seed"] = objs["step"], objs["seed"]
        _same(got, _lora(s), f"resumed step {s}")
        out[s] = True
    state = _lora(mgr.latest_step())
    stats = []
    for step in (6, 7):
        _advance(state, step)
        stats.append(mgr.save(step, state))
    mgr.finalize_pending_saves()
    out["bytes"] = [h.result().bytes_written for h in stats]
    mgr.close()
    return out


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_lora_base_written_once_retired_then_collected(tmp_path, async_save):
    root = str(tmp_path / "run")
    mgr = nostall.CheckpointManager(root, incremental=True, keep_last=2, async_save=async_save)
    state = _lora(0)
    handles = []
    for step in range(1, 6):
        _advance(state, step)
        handles.append(mgr.save(step, state))  # async: the next _advance changes the state right after
    mgr.finalize_pending_saves()
    written = [h.result().bytes_written for h in handles]
    assert written[0] >= FROZEN + CHANGED
    for w in written[1:]:  # the base is written once: later saves write what changed (and a header)
        assert CHANGED <= w <= 1.1 * CHANGED, written
    assert mgr.steps() == [4, 5] and mgr.latest_step() == 5
    mgr.close()

    # step 1 (the base) was retired by retention: manifest gone, the retired manifest and the base file stay
    step1 = os.path.join(root, "step_1")
    assert not os.path.exists(os.path.join(step1, "manifest.json"))
    assert len(_retired(root, 1)) == 1
    files1 = glob.glob(os.path.join(step1, "*.safetensors"))
    assert len(files1) == 1 and os.path.getsize(files1[0]) == written[0]
    assert not os.path.exists(os.path.join(root, "step_2")) and not os.path.exists(os.path.join(root, "step_3"))
    for s, w in ((4, written[3]), (5, written[4])):
        assert _own_bytes(root, s) == w
        m = _manifest(root, s)
        assert m["version"] == 2 and list(m["references"]) == [f"step_1/{os.path.basename(files1[0])}"]
    assert _manifest(root, 5)["references"] == _manifest(root, 4)["references"]
    _audit(root, {s: _lora(s) for s in (4, 5)}, _lora(0))

    # a fresh process (or manager) resumes from each retained step; its first save is full (a fresh chain), so once
    # retention deletes steps 4 and 5 nothing reads step 1's base: its file and retired manifest go
    # (a fresh process costs seconds of imports: the async variant resumes in a new manager here)
    out = run_ranks(1, _resume_fresh, root, async_save)[0] if not async_save else _resume_fresh(0, 1, root, True)
    assert out[4] and out[5]
    assert out["bytes"][0] >= FROZEN + CHANGED and CHANGED <= out["bytes"][1] <= 1.1 * CHANGED
    assert sorted(os.listdir(root)) == [".tmp", "latest", "step_6", "step_7"]
    assert list(_manifest(root, 7)["references"]) == [f"step_6/{n}" for n in _manifest(root, 6)["files"]]
    _audit(root, {s: _lora(s) for s in (6, 7)}, _lora(0))


# --------------------------------------------------------------------------- 2. full_every


def test_full_every_starts_a_fresh_chain(tmp_path):
    root = str(tmp_path / "run")
    mgr = nostall.CheckpointManager(root, incremental=True, full_every=3, keep_last=2)
    state = _lora(0)
    written = []
    for step in range(1, 8):
        _advance(state, step)
        written.append(mgr.save(step, state).result().bytes_written)
        full = step in (1, 4, 7)
        assert (_own_bytes(root, step) >= FROZEN + CHANGED) if full else (
            CHANGED <= _own_bytes(root, step) <= 1.1 * CHANGED), (step, written)
        assert ("references" in _manifest(root, step)) != full
        if step == 5:  # nothing retained reads step 1 any more (4 is a fresh chain, 3 is gone)
            assert not os.path.exists(os.path.join(root, "step_1"))
        _audit(root, {s: _lora(s) for s in range(1, step + 1)}, _lora(0))
    mgr.close()
    assert [w >= FROZEN for w in written] == [True, False, False, True, False, False, True]
    assert written[0] == written[3] == written[6]
    # step 4 (read by 6) is retired; step 5 is gone
    assert sorted(os.listdir(root)) == [".tmp", "latest", "step_4", "step_6", "step_7"]
    assert len(_retired(root, 4)) == 1


# --------------------------------------------------------------------------- 3. chunked staging, overlap

BIG = (256, 512)  # float32, 512 KiB: spans several staging chunks, changes every other step


def _staged_state(step: int) -> Dict[str, Any]:
    s = _lora(step)
    g = torch.Generator().manual_seed(99 + step // 2)
    s["model"]["big"] = torch.randn(BIG, generator=g)
    return s


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_chunked_and_overlapped_saves_leave_out_unchanged_pieces(tmp_path, mode):
    opts: Dict[str, Any] = (dict(staging_budget_bytes=192 << 10, block_size=4096) if mode == "chunked"
                            else dict(overlap=True, block_size=64 << 10))
    inc_root, full_root = str(tmp_path / "inc"), str(tmp_path / "full")
    inc = nostall.CheckpointManager(inc_root, incremental=True, async_save=True, **opts)
    full = nostall.CheckpointManager(full_root, async_save=True, **opts)
    state = _staged_state(1)
    big_bytes = 4 * BIG[0] * BIG[1]
    handles = []
    for step in range(1, 6):
        new = _staged_state(step)
        _advance(state, step)
        state["model"]["big"].copy_(new["model"]["big"])
        for m in (inc, full):
            handles.append((m, step, m.save(step, state)))
            m.wait_until_staged()
    inc.finalize_pending_saves()
    full.finalize_pending_saves()
    for m, step, h in handles:
        st = h.result()
        if mode == "chunked":
            assert st.chunks is not None and st.chunks > 2, st  # pieces go through the area in chunks
        else:
            assert st.overlap
        if m is full or step == 1:
            assert st.bytes_written >= FROZEN + CHANGED + big_bytes
        else:  # big changes at even steps only: written then, dropped (position moved back) otherwise
            want = CHANGED + (big_bytes if step % 2 == 0 else 0)
            assert want <= st.bytes_written <= 1.1 * want, (step, st.bytes_written, want)
            assert _own_bytes(inc_root, step) == st.bytes_written
    inc.close()
    full.close()
    like = _staged_state(0)
    for step in range(1, 6):
        a = _load(os.path.join(inc_root, f"step_{step}"), like)
        b = _load(os.path.join(full_root, f"step_{step}"), like)
        _same(a, _staged_state(step), f"incremental step {step}")
        _same(b, a, f"full vs incremental step {step}")
        assert check_checkpoint(os.path.join(inc_root, f"step_{step}")).ok
    # a piece that did not change since step 1 reads step 1's file; big at odd steps reads the even step's
    pieces = _manifest(inc_root, 5)["tensors"]
    assert pieces["model/base.weight"]["pieces"][0]["file"].startswith("step_1/")
    assert pieces["model/big"]["pieces"][0]["file"].startswith("step_4/")


# --------------------------------------------------------------------------- 4. two ranks, DTensor


def _dist_state(step: int) -> Dict[str, torch.Tensor]:
    """Global tensors: a frozen base (sharded), a frozen replicated tensor, an adapter (sharded) that changes."""
    g = torch.Generator().manual_seed(7)
    base, frozen = torch.randn(512, 1024, generator=g), torch.randn(64, 256, generator=g)
    g = torch.Generator().manual_seed(1000 + step)
    return {"base": base, "frozen": frozen, "adapter": torch.randn(64, 512, generator=g),
            "moment": torch.randn(64, 512, generator=g)}


def _dist_save(rank: int, world: int, root: str, async_save: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g0 = _dist_state(1)
    state = {"base": distribute_tensor(g0["base"], mesh, [Shard(0)]),
             "frozen": distribute_tensor(g0["frozen"], mesh, [Replicate()]),
             "adapter": distribute_tensor(g0["adapter"], mesh, [Shard(1)]),
             "moment": distribute_tensor(g0["moment"], mesh, [Shard(0)]),
             "step": 0}
    mgr = nostall.CheckpointManager(root, incremental=True, keep_last=2, async_save=async_save)
    handles = []
    for step in range(1, 5):
        g = _dist_state(step)
        for k in ("adapter", "moment"):
            state[k].to_local().copy_(distribute_tensor(g[k], mesh, state[k].placements).to_local())
        state["step"] = step
        handles.append(mgr.save(step, state))
    mgr.finalize_pending_saves()
    written = [h.result().bytes_written for h in handles]
    steps = mgr.steps()
    mgr.close()
    return written, steps


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_two_ranks_dtensor_incremental_resharded_load(tmp_path, pool2, async_save):
    root = str(tmp_path / "run")
    out = pool2.run(_dist_save, root, async_save)
    changed = 2 * 4 * 64 * 512
    frozen = 4 * (512 * 1024 + 64 * 256)
    per_step = [sum(w[i] for w, _ in out) for i in range(4)]
    assert per_step[0] >= changed + frozen
    for w in per_step[1:]:
        assert changed <= w <= 1.1 * changed, per_step
    assert out[0][1] == [3, 4]
    assert len(_retired(root, 1)) == 1 and not os.path.exists(os.path.join(root, "step_1", "manifest.json"))
    for s in (3, 4):
        path = os.path.join(root, f"step_{s}")
        assert check_checkpoint(path).ok
        refs = _manifest(root, s)["references"]
        assert sorted(r.split(".")[0] for r in refs) == ["step_1/rank0", "step_1/rank1"]
        # resharded to one process, full tensors
        want = _dist_state(s)
        got = {k: torch.full_like(v, 7) for k, v in want.items()}
        objs = nostall.load({**got, "step": None}, path)
        assert objs["step"] == s
        _same(got, want, f"step {s}")


# --------------------------------------------------------------------------- 5. object storage


def _s3_ls(fs: Any, prefix: str) -> List[str]:
    try:
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix, refresh=True))
    except FileNotFoundError:
        return []


def _s3_audit(url: str, so: Dict[str, Any], steps: List[int], expected: Dict[int, Dict[str, Any]]) -> None:
    for s in steps:
        report = check_checkpoint(f"{url}/step_{s}", storage_options=so)
        assert report.ok, (s, report.problems)
        _same(_load(f"{url}/step_{s}", _lora(0), storage_options=so), expected[s], f"step {s}")


def test_s3_incremental_retention_and_collection(s3, tmp_path):
    bucket = s3.make_bucket("incremental")
    url, so = f"s3://{bucket}/run", s3.storage_options
    fs = s3.filesystem()
    mgr = nostall.CheckpointManager(url, incremental=True, keep_last=2, async_save=True, storage_options=so,
                                    local_staging_dir=str(tmp_path / "staging"))
    state = _lora(0)
    handles = []
    for step in range(1, 5):
        _advance(state, step)
        handles.append(mgr.save(step, state))
    mgr.finalize_pending_saves()
    written = [h.result().bytes_written for h in handles]
    assert written[0] >= FROZEN and all(CHANGED <= w <= 1.1 * CHANGED for w in written[1:]), written
    assert mgr.steps() == [3, 4]
    mgr.close()
    step1 = _s3_ls(fs, f"{bucket}/run/step_1")
    assert "manifest.json" not in step1 and len(step1) == 2 and step1[0].startswith(".retired-"), step1
    assert _s3_ls(fs, f"{bucket}/run/step_2") == []
    base_file = f"step_1/{step1[1]}"
    for s in (3, 4):
        m = json.loads(fs.cat_file(f"{bucket}/run/step_{s}/manifest.json"))
        assert list(m["references"]) == [base_file]
    _s3_audit(url, so, [3, 4], {s: _lora(s) for s in (3, 4)})
    # a trailing slash in the checkpoint's URL: the references are still found beside it
    _same(_load(f"{url}/step_4/", _lora(0), storage_options=so), _lora(4), "step 4/")

    # a full (non-incremental) manager saves on: nothing referenced is deleted while 3 or 4 is retained
    plain = nostall.CheckpointManager(url, keep_last=2, storage_options=so, local_staging_dir=str(tmp_path / "s2"))
    _advance(state, 5)
    plain.save(5, state)
    assert plain.steps() == [4, 5]
    assert _s3_ls(fs, f"{bucket}/run/step_1") == step1
    _s3_audit(url, so, [4, 5], {s: _lora(s) for s in (4, 5)})
    _advance(state, 6)
    plain.save(6, state)
    plain.close()
    assert _s3_ls(fs, f"{bucket}/run/step_1") == []  # nothing reads it any more: collected
    _s3_audit(url, so, [5, 6], {s: _lora(s) for s in (5, 6)})


# --------------------------------------------------------------------------- 6. re-saving existing steps


def _slow_state(step: int, seed: int = 0) -> Dict[str, Any]:
    """A LoRA state plus a tensor that changes every other step: later checkpoints read non-base steps too."""
    s = _lora(step, seed)
    g = torch.Generator().manual_seed(500 + 37 * seed + step // 2)
    s["model"]["slow"] = torch.randn(128, 256, generator=g)
    return s


@pytest.mark.parametrize("where", ["posix", "s3"])
def test_resaving_existing_steps_keeps_every_retained_checkpoint_whole(tmp_path, where, request):
    if where == "s3":
        s3 = request.getfixturevalue("s3")
        root = f"s3://{s3.make_bucket('resave')}/run"
        kw: Dict[str, Any] = dict(storage_options=s3.storage_options, local_staging_dir=str(tmp_path / "staging"))
    else:
        root, kw = str(tmp_path / "run"), {}
    expected: Dict[int, Dict[str, Any]] = {}

    def audit() -> None:
        steps = nostall.CheckpointManager(root, read_only=True, **kw).steps()
        for s in steps:
            path = f"{root}/step_{s}"
            report = check_checkpoint(path, storage_options=kw.get("storage_options"))
            assert report.ok, (s, report.problems)
            _same(_load(path, _slow_state(0), storage_options=kw.get("storage_options")), expected[s], f"step {s}")
        if where == "posix":
            _audit(root, expected, _slow_state(0))

    first = nostall.CheckpointManager(root, incremental=True, keep_last=3, **kw)
    for step in range(1, 6):
        expected[step] = _slow_state(step)
        first.save(step, expected[step])
        audit()
    assert first.steps() == [3, 4, 5]
    first.close()

    # another run resumes from step 3 and saves steps 4, 5, ... again, with other values
    second = nostall.CheckpointManager(root, incremental=True, keep_last=3, **kw)
    got = _zeros_like(_slow_state(3))
    second.load(got, 3)
    _same(got["model"], _slow_state(3)["model"])
    for step in range(4, 9):
        expected[step] = _slow_state(step, seed=1)
        second.save(step, expected[step])
        audit()
    assert second.steps() == [6, 7, 8]
    second.close()
    if where == "posix":  # nothing of the first run is left once nothing reads it; the second run's
        # chain starts at its full save of step 4, which 6, 7 and 8 read: step 4 is retired, its base stays
        assert sorted(os.listdir(root)) == [".tmp", "latest", "step_4", "step_6", "step_7", "step_8"]
        assert len(_retired(root, 4)) == 1
        live = {ref for s in (6, 7, 8) for ref in _manifest(root, s).get("references", {})}
        live |= {f"step_{s}/{n}" for s in (6, 7, 8) for n in _manifest(root, s)["files"]}
        on_disk = {os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "step_*", "*.safetensors"))}
        assert on_disk == live and all(n.startswith("step_4/") for n in live - {
            f"step_{s}/{n}" for s in (6, 7, 8) for n in _manifest(root, s)["files"]}), (on_disk, live)


# --------------------------------------------------------------------------- 7. safety


def _chain(root: str, n: int, **kw: Any) -> None:
    mgr = nostall.CheckpointManager(root, incremental=True, **kw)
    state = _lora(0)
    for step in range(1, n + 1):
        _advance(state, step)
        mgr.save(step, state)
    mgr.close()


def test_a_checkpoint_copied_without_its_root_fails_clearly(tmp_path):
    root = str(tmp_path / "run")
    _chain(root, 3)
    ref = list(_manifest(root, 3)["references"])[0]
    alone = str(tmp_path / "elsewhere" / "step_3")
    shutil.copytree(os.path.join(root, "step_3"), alone)
    with pytest.raises(CheckpointError) as e:
        _load(alone, _lora(0))
    msg = str(e.value)
    assert ref in msg and "missing" in msg and "copy the whole root" in msg, msg
    report = check_checkpoint(alone)
    assert not report.ok and any(ref in p for p in report.problems), report.problems
    # the original still loads
    _same(_load(os.path.join(root, "step_3"), _lora(0)), _lora(3))


def test_full_saves_stay_version_1_and_load(tmp_path):
    root = str(tmp_path / "run")
    mgr = nostall.CheckpointManager(root)
    mgr.save(1, _lora(1))
    mgr.close()
    m = _manifest(root, 1)
    assert m["version"] == 1 and "references" not in m
    assert not any("xxh3_128" in p for t in m["tensors"].values() for p in t["pieces"])
    assert os.path.exists(os.path.join(root, "step_1", "rank0.safetensors"))  # untagged, as before
    _same(_load(os.path.join(root, "step_1"), _lora(0)), _lora(1))
    assert check_checkpoint(os.path.join(root, "step_1")).ok


def test_a_full_manager_in_an_incremental_root_never_deletes_referenced_files(tmp_path):
    root = str(tmp_path / "run")
    _chain(root, 3, keep_last=2)  # step 1 retired, read by 2 and 3
    expected = {s: _lora(s) for s in (1, 2, 3)}
    _audit(root, expected, _lora(0))
    plain = nostall.CheckpointManager(root, keep_last=2)
    # a new run starts over at step 1, where the retired base's file (read by 2 and 3) still is
    expected[1] = _lora(1, seed=2)
    plain.save(1, expected[1])
    assert plain.steps() == [1, 2, 3]
    _audit(root, expected, _lora(0))
    for step in (4, 5, 6):
        expected[step] = _lora(step, seed=2)
        plain.save(step, expected[step])
        _audit(root, expected, _lora(0))
    plain.close()
    assert sorted(os.listdir(root)) == [".tmp", "latest", "step_5", "step_6"]


# --------------------------------------------------------------------------- 8. everything changes


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_when_everything_changes_incremental_writes_what_full_writes(tmp_path, async_save):
    roots = {k: str(tmp_path / k) for k in ("inc", "full")}
    mgrs = {"inc": nostall.CheckpointManager(roots["inc"], incremental=True, async_save=async_save),
            "full": nostall.CheckpointManager(roots["full"], async_save=async_save)}
    written: Dict[str, List[Any]] = {"inc": [], "full": []}
    for step in range(1, 4):
        state = _lora(step, seed=step)
        state["model"].update(_frozen(seed=step))  # the base too
        for k, m in mgrs.items():
            written[k].append(m.save(step, state))
    for m in mgrs.values():
        m.close()
    assert ([h.result().bytes_written for h in written["inc"]] == [h.result().bytes_written for h in written["full"]])
    for step in range(1, 4):
        assert "references" not in _manifest(roots["inc"], step)
        assert _own_bytes(roots["inc"], step) == _own_bytes(roots["full"], step)
        a, b = (_load(os.path.join(roots[k], f"step_{step}"), _lora(0)) for k in ("inc", "full"))
        want = _lora(step, seed=step)
        want["model"].update(_frozen(seed=step))
        _same(a, want)
        _same(a, b)
        assert check_checkpoint(os.path.join(roots["inc"], f"step_{step}")).ok


# --------------------------------------------------------------------------- unchanged pieces are proven equal


def test_a_piece_is_left_out_only_when_its_bytes_are_equal(tmp_path):
    """One element of the base changes (same shape, same dtype): that piece is written again."""
    root = str(tmp_path / "run")
    mgr = nostall.CheckpointManager(root, incremental=True)
    state = _lora(1)
    mgr.save(1, state)
    state["model"]["base.weight"][-1, -1] = float("nan")  # the last byte range of the piece changes
    _advance(state, 2)
    mgr.save(2, state)
    _advance(state, 3)
    mgr.save(3, state)
    mgr.close()
    assert _own_bytes(root, 2) >= 4 * BASE[0] * BASE[1] + CHANGED
    assert CHANGED <= _own_bytes(root, 3) <= 1.1 * CHANGED
    want = _lora(3)
    want["model"]["base.weight"][-1, -1] = float("nan")
    _same(_load(os.path.join(root, "step_3"), _lora(0)), want)
    assert _manifest(root, 3)["tensors"]["model/base.weight"]["pieces"][0]["file"].startswith("step_2/")


def test_a_checkpoint_named_from_inside_it_verifies_and_loads(tmp_path, monkeypatch):
    """``check_checkpoint('.')`` from the checkpoint's own directory: the references are found in the root
    (they were looked for inside the checkpoint: ``dirname('.')`` is empty)."""
    root = str(tmp_path / "run")
    _chain(root, 3)
    monkeypatch.chdir(os.path.join(root, "step_3"))
    for path in (".", "./", "../step_3"):
        report = check_checkpoint(path)
        assert report.ok, (path, report.problems)
        _same(_load(path, _lora(0)), _lora(3), path)


def test_a_save_whose_base_file_is_gone_writes_those_pieces_again(tmp_path):
    """A file the chain reads is gone (deleted by hand): the next save reads back what it would reference
    (issue 24), finds it missing and writes those pieces again from the trainer's copy, so it commits
    whole; the saves after it reference it as usual."""
    root = str(tmp_path / "run")
    mgr = nostall.CheckpointManager(root, incremental=True, keep_last=2)
    state = _lora(0)
    for step in (1, 2, 3):
        _advance(state, step)
        mgr.save(step, state)
    shutil.rmtree(os.path.join(root, "step_1"))  # the retired base, read by 2 and 3
    _advance(state, 4)
    assert mgr.save(4, state).result().bytes_written >= FROZEN + CHANGED
    assert not any(r.startswith("step_1/") for r in _manifest(root, 4).get("references", {}))
    _advance(state, 5)
    assert mgr.save(5, state).result().bytes_written <= 1.1 * CHANGED
    mgr.close()
    _audit(root, {4: _lora(4), 5: _lora(5)}, _lora(0))


def test_retention_deletes_nothing_a_manifest_it_cannot_read_may_reference(tmp_path, caplog):
    """A retained manifest naming references that this nostall cannot parse (here: a newer format
    version): which files it reads is unknown, so retention deletes nothing (it deleted step 1's base)."""
    root = str(tmp_path / "run")
    _chain(root, 3, keep_last=2)  # step 1 retired, read by 2 and 3
    path = os.path.join(root, "step_3", "manifest.json")
    doc = _manifest(root, 3)
    doc["version"] = 99
    with open(path, "w") as f:
        json.dump(doc, f)
    plain = nostall.CheckpointManager(root, keep_last=2)
    with caplog.at_level("WARNING", logger="nostall"):
        plain.save(4, _lora(4))
    plain.close()
    assert "retention after step 4 failed" in caplog.text and "version 99" in caplog.text, caplog.text
    for ref, rec in doc["references"].items():
        assert os.path.getsize(os.path.join(root, ref)) == rec["size"]
    for s in (2, 4):
        assert check_checkpoint(os.path.join(root, f"step_{s}")).ok
        _same(_load(os.path.join(root, f"step_{s}"), _lora(0)), _lora(s))
