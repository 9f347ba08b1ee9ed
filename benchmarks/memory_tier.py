"""The memory tier (issue 27) against its copy floor: save stall and restore after a trainer crash, one rank.

    .venv/bin/python benchmarks/memory_tier.py --mb 256 --saves 8 [--memory-dir DIR]

Phase 1 (a child process): a manager with ``memory_tier=MemoryTier(persist_every=1000)`` and
``async_save=True`` saves ``--saves`` times a step to the persistent root (an async disk save) and
the next step to memory (each save settled before the next, so that no save waits for another),
timing a plain copy of the same tensors into a pre-touched buffer (the copy floor) before each;
then it SIGKILLs itself, leaving the newest memory snapshot with the holder.

Phase 2 (a fresh child process, as a restarted trainer): the process start-up (interpreter,
``import torch``, the manager attaching to the holder) is timed apart; then ``load()`` restores
the newest memory step (the freshest tier; the first load of the process, as a restarted trainer
pays it); then three rounds of the same restore again, a memcpy of the rank's bytes into the same
tensors, and ``load(step=<newest persistent>)`` of the persistent checkpoint of the same size
(from the page cache, most likely: a cold read from a disk or a shared filesystem is slower), the
best of each taken, and DCP's load of the same state saved once by ``dcp.save`` in phase 1 (what a
DCP job restarts from: its checkpoint on disk, from the page cache here; DCP has no memory tier).
Every nostall load verifies every checksum (DCP's has none to verify). Prints one JSON object:
medians, bests and ratios (stall / copy, restore / memcpy, disk load / memcpy, restore / DCP load).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

T0 = time.perf_counter()


def _state(mb: int, fill: float):
    import torch

    n = mb // 16
    return {f"t{i}": torch.full((16 << 18,), fill + i, dtype=torch.float32) for i in range(n)}  # 16 MiB each


def _save(root: str, mb: int, saves: int, out: str, memory_dir: str) -> None:
    import torch

    import nostall
    from nostall.options import MemoryTier

    torch.set_num_threads(1)
    state = _state(mb, 0.0)
    floor = {k: torch.empty_like(v) for k, v in state.items()}
    for v in floor.values():
        v.zero_()  # touched, as the staging area is
    tier = MemoryTier(persist_every=1000, memory_dir=memory_dir or None)
    mgr = nostall.CheckpointManager(root, async_save=True, timeout=120, memory_tier=tier)
    stalls, copies, stages, disk_stalls = [], [], [], []
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=os.path.join(os.path.dirname(root), "dcp"))  # what a DCP job restarts from
    for i in range(1, saves + 1):
        for step in (1000 * i, 1000 * i + 1):  # persistent (an async disk save), then memory
            for v in state.values():
                v.add_(1.0)
            t = time.perf_counter()
            for k, v in state.items():
                floor[k].copy_(v)
            copy = time.perf_counter() - t
            h = mgr.save(step, state)
            if step % 1000:
                stalls.append(h.stats.stall_s)
                stages.append(h.stats.stage_s)
                copies.append(copy)
            else:
                disk_stalls.append(h.stats.stall_s)
            h.result()
    with open(out, "w") as f:
        json.dump({"stalls": stalls, "copies": copies, "stages": stages, "disk_stalls": disk_stalls,
                   "memory_path": h.path}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def _restore(root: str, mb: int, out: str, memory_dir: str) -> None:
    import torch

    import nostall
    from nostall.options import MemoryTier

    torch.set_num_threads(1)
    tier = MemoryTier(persist_every=1000, memory_dir=memory_dir or None)
    mgr = nostall.CheckpointManager(root, async_save=True, timeout=120, memory_tier=tier)
    startup = time.perf_counter() - T0
    template = _state(mb, -1.0)  # touched
    src = _state(mb, 7.0)
    t = time.perf_counter()
    got = mgr.load(template)
    restore = time.perf_counter() - t
    r = mgr.last_restore
    persistent = mgr.latest_step()  # the newest persistent step, of the same size
    import torch.distributed.checkpoint as dcp

    memcpys, warm, disks, dcps = [], [], [], []
    for _ in range(3):  # then, alternating: the memory restore again, a memcpy, the persistent load, DCP's load
        t = time.perf_counter()
        mgr.load(template)
        warm.append(time.perf_counter() - t)
        assert mgr.last_restore is not None and mgr.last_restore.tier == "memory"
        t = time.perf_counter()
        for k, v in template.items():
            v.copy_(src[k])
        memcpys.append(time.perf_counter() - t)
        t = time.perf_counter()
        mgr.load(template, step=persistent)
        disks.append(time.perf_counter() - t)
        t = time.perf_counter()
        dcp.load(template, checkpoint_id=os.path.join(os.path.dirname(root), "dcp"))
        dcps.append(time.perf_counter() - t)
    mgr.close()
    with open(out, "w") as f:
        json.dump({"startup_s": startup, "restore_s": restore, "tier": r.tier, "step": r.step,
                   "persistent_bytes_read": r.persistent_bytes_read, "memcpys": memcpys, "disk_loads": disks,
                   "dcp_loads": dcps,
                   "warm_restores": warm,
                   "restored_first": float(next(iter(got.values()))[0])}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="MiB of state (multiples of 16)")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--memory-dir", default="", help="the memory tier's tmpfs directory (default: /dev/shm)")
    ap.add_argument("--phase", choices=["save", "restore"], help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase == "save":
        return _save(a.root, a.mb, a.saves, a.out, a.memory_dir)
    if a.phase == "restore":
        return _restore(a.root, a.mb, a.out, a.memory_dir)
    with tempfile.TemporaryDirectory(prefix="nostall-memtier-") as tmp:
        root = os.path.join(tmp, "run")
        one, two = os.path.join(tmp, "save.json"), os.path.join(tmp, "restore.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        base = [sys.executable, os.path.abspath(__file__), "--mb", str(a.mb), "--saves", str(a.saves), "--root", root,
                "--memory-dir", a.memory_dir]
        subprocess.run(base + ["--phase", "save", "--out", one], env=env)  # ends with SIGKILL
        subprocess.run(base + ["--phase", "restore", "--out", two], env=env, check=True)
        s, r = json.load(open(one)), json.load(open(two))
    stall, copy = statistics.median(s["stalls"]), statistics.median(s["copies"])
    stage, disk_stall = statistics.median(s["stages"]), statistics.median(s["disk_stalls"])
    memcpy, disk, warm = min(r["memcpys"]), min(r["disk_loads"]), min(r["warm_restores"])
    dcp_load = min(r["dcp_loads"])
    print(json.dumps({
        "mb": a.mb, "saves": a.saves, "memory_dir": a.memory_dir or "/dev/shm",
        "memory_save_stall_s": stall, "plain_copy_s": copy, "stall_over_copy": stall / copy,
        "memory_save_copy_part_s": stage, "disk_async_save_stall_s": disk_stall,
        "memory_over_disk_async_stall": stall / disk_stall,
        "restored": {"tier": r["tier"], "step": r["step"], "persistent_bytes_read": r["persistent_bytes_read"]},
        "process_startup_s": r["startup_s"], "restore_from_memory_s": r["restore_s"], "memcpy_s": memcpy,
        "restore_over_memcpy": r["restore_s"] / memcpy, "restore_again_s": warm, "again_over_memcpy": warm / memcpy,
        "load_from_disk_s": disk, "disk_over_memcpy": disk / memcpy,
        "dcp_load_s": dcp_load, "restore_over_dcp_load": r["restore_s"] / dcp_load,
        "again_over_dcp_load": warm / dcp_load,
        "stalls_s": s["stalls"], "copies_s": s["copies"], "memcpys_s": r["memcpys"], "disk_loads_s": r["disk_loads"],
        "restores_again_s": r["warm_restores"], "dcp_loads_s": r["dcp_loads"],
    }, indent=1))


if __name__ == "__main__":
    main()
