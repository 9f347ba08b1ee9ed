"""The memory tier across hosts (issue 27): restore after losing 1 of 2 hosts against the link's time for its bytes.

    sudo .venv/bin/python benchmarks/memory_multihost.py --mb 64 --reps 3

Needs root (network namespaces: tests/netns_hosts.py). Two hosts (namespaces on a bridge, private disks), one
rank each, each host's memory directory on its private disk. Each repetition:

1. a job saves one memory step (``--mb`` MiB of float32 per rank, sharded), replicated on the peer host, and
   its trainers SIGKILL themselves;
2. host b is lost whole (every process, its holder too) and its memory directory emptied (a replacement host);
3. a new job restores: rank 0 from its own host's memory, rank 1 (the replacement) taking its pieces from
   rank 0 over the load's gloo group (tier "peer"). ``mgr.last_restore.seconds`` is the load (agreement
   included; the process start-up is not);
4. the baseline, in the same run, between the same namespaces: a plain TCP transfer of the replacement rank's
   bytes (its data file's size) from host a to host b, timed from connect to the last byte received.

Prints one JSON object: per repetition the replacement rank's restore time, the link time, their ratio, the
tiers and the bytes read from the persistent root; and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trainer(args: Dict[str, Any]) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment): ``save`` (one memory step, then SIGKILL
    itself) or ``restore`` (writes its last_restore to ``args["out"]/rank<R>.json``)."""
    import torch
    import torch.distributed as dist

    import nostall
    from nostall.options import MemoryTier

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args["mb"] << 18  # float32 elements
    tier = MemoryTier(persist_every=1000, memory_dir=args["memory_dir"], idle_s=120.0)
    mgr = nostall.CheckpointManager(args["root"], async_save=True, timeout=120, memory_tier=tier)
    if args["mode"] == "save":
        w = torch.arange(n, dtype=torch.float32) + rank * n
        mgr.save(1, {"w": nostall.ShardedTensor(w, (world * n,), (rank * n,))})
        mgr.finalize_pending_saves()
        with open(os.path.join(args["out"], f"rank{rank}.json"), "w") as f:
            json.dump({"file": os.path.getsize(os.path.join(tier_root(mgr), "step_1", f"rank{rank}.safetensors"))}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    t = {"w": nostall.ShardedTensor(torch.zeros(n), (world * n,), (rank * n,))}
    mgr.load(t)
    r = mgr.last_restore
    exact = torch.equal(t["w"].data, torch.arange(n, dtype=torch.float32) + rank * n)
    with open(os.path.join(args["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"tier": r.tier, "seconds": r.seconds, "persistent_bytes_read": r.persistent_bytes_read,
                   "bytes_read": r.bytes_read, "exact": exact}, f)
    mgr.close()
    dist.destroy_process_group()


def tier_root(mgr: Any) -> str:
    return str(mgr._tiers.root.url)


_SERVER = """import socket,sys,time
s=socket.socket(); s.bind((sys.argv[1],0)); s.listen(1); print(s.getsockname()[1],flush=True)
c,_=s.accept(); n=int(sys.argv[2]); buf=bytearray(4<<20); mv=memoryview(buf); sent=0
while sent<n:
    sent+=c.send(mv[:min(len(buf),n-sent)])
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""
_CLIENT = """import socket,sys,time
n=int(sys.argv[3]); buf=bytearray(4<<20); t0=time.perf_counter()
c=socket.create_connection((sys.argv[1],int(sys.argv[2]))); got=0
while got<n:
    k=c.recv_into(buf)
    if not k: break
    got+=k
dt=time.perf_counter()-t0; c.send(b"x"); c.close(); print(got, dt)
"""


def link_seconds(a: Any, b: Any, nbytes: int) -> float:
    """A plain TCP transfer of ``nbytes`` from host ``a`` to host ``b`` (connect to the last byte received)."""
    server = a.popen([sys.executable, "-c", _SERVER, a.addr, str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        got = b.run([sys.executable, "-c", _CLIENT, a.addr, port, str(nbytes)], timeout=120)
        n, dt = got.stdout.split()
        assert int(n) == nbytes, got
        return float(dt)
    finally:
        server.wait(30)
        server.stdout.close()


def _job(a: Any, b: Any, args: Dict[str, Any], run_id: str, port: int) -> List[int]:
    """One job: rank 0 on host ``a``, rank 1 on host ``b``; their exit statuses."""
    os.makedirs(args["out"], exist_ok=True)
    procs = []
    for rank, h in enumerate((a, b)):
        env = h.env({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": a.addr, "MASTER_PORT": str(port),
                     "TORCHELASTIC_RUN_ID": run_id,
                     "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])})
        procs.append(h.popen([sys.executable, os.path.abspath(__file__), "--trainer", json.dumps(args)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return [p.wait(600) for p in procs]


def run(args: argparse.Namespace) -> Dict[str, Any]:
    sys.path.insert(0, REPO)
    from tests.netns_hosts import HostNet

    base = tempfile.mkdtemp(prefix="nostall-mh-bench-")
    reps: List[Dict[str, Any]] = []
    try:
        with HostNet(2, base) as net:
            a, b = net.hosts
            for i in range(args.reps):
                common = {"root": os.path.join(base, f"run{i}"), "memory_dir": os.path.join(net.local_path, "shm"),
                          "mb": args.mb}
                for h in (a, b):
                    os.makedirs(os.path.join(h.disk, "shm"), exist_ok=True)
                port = 32000 + os.getpid() % 300 * 10 + 2 * i

                saved = os.path.join(base, f"save{i}")
                assert _job(a, b, {**common, "mode": "save", "out": saved}, f"bench{i}", port) == [-signal.SIGKILL] * 2
                lost = json.load(open(os.path.join(saved, "rank1.json")))["file"]
                b.kill_all()
                shutil.rmtree(os.path.join(b.disk, "shm"))
                os.makedirs(os.path.join(b.disk, "shm"))
                restored = os.path.join(base, f"restore{i}")
                assert _job(a, b, {**common, "mode": "restore", "out": restored}, f"bench{i}", port + 1) == [0, 0]
                got = [json.load(open(os.path.join(restored, f"rank{r}.json"))) for r in range(2)]
                link = link_seconds(a, b, lost)
                reps.append({"restore_s": got[1]["seconds"], "restore_s_rank0": got[0]["seconds"], "link_s": link,
                             "ratio": got[1]["seconds"] / link, "tiers": [g["tier"] for g in got],
                             "exact": all(g["exact"] for g in got), "lost_bytes": lost,
                             "persistent_bytes_read": [g["persistent_bytes_read"] for g in got]})
                for h in (a, b):
                    h.kill_all()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"mb_per_rank": args.mb, "reps": reps,
            "median_restore_s": statistics.median(r["restore_s"] for r in reps),
            "median_link_s": statistics.median(r["link_s"] for r in reps),
            "median_ratio": statistics.median(r["ratio"] for r in reps)}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trainer":
        trainer(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=64, help="MiB of state per rank")
    p.add_argument("--reps", type=int, default=3)
    print(json.dumps(run(p.parse_args()), indent=1))


if __name__ == "__main__":
    main()
