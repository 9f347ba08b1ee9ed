"""Issue 27, the memory tier across hosts (docs/protocol.md, "Memory tier", "Several hosts: the commit rule").

Hosts are network namespaces with private disks (tests/netns_hosts.py); each
rank is a plain process of its host (gloo over the hosts' bridge, rendezvous
at host a), and each host's memory directory is a path on its *private* disk
(the namespaces share this machine's /dev/shm, so ``/dev/shm`` would make
them one host). The same file is the trainer (``python <this file> <json>``).

* memory saves commit only with every host's replica on its peer: both hosts'
  memory roots hold the same ``step_N`` (every rank's file, bytes equal,
  the same manifest); trainers SIGKILLed, the job restarted: restored from
  its own host's memory, bit-exact, 0 bytes from the persistent root; a
  clean close leaves no process of the job on any host. 2 hosts x 1 and x 2
  ranks.
* a whole host lost (every process, its holder too) and replaced by one with
  an empty memory directory: the job restores the newest memory step, its
  ranks taking their pieces from the surviving host's ranks (tier "peer"),
  bit-exact, 0 bytes from the persistent root (whose data files are
  zero-filled first: a read of any would fail its checksum).
* 4 hosts x 1 rank: each host holds its own rank's file and its source
  host's (peer_jump=1), nothing else; a lost host restores from peers.
* 2 hosts x 1 rank, 2,000 small tensors each: the records (and the manifest) of
  a realistic model cross between the holders (more than a frame's header).
* a peer host killed while a save is in flight, or only its holder killed
  before a save: the save fails (reported on the
  training side), the previous memory step stays latest on both hosts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List

import pytest

_N = 40000
_PERSIST = 2  # steps 1 and 3 go to memory, step 2 to the persistent root


def _tier(memory_dir: str):
    from nostall.options import MemoryTier

    return MemoryTier(persist_every=_PERSIST, memory_dir=memory_dir, idle_s=120.0)


def _state(step: int, rank: int, world: int, many: int = 0):
    """The state of ``rank`` at ``step``; ``many`` more small sharded tensors (each rank's done record then lists
    that many pieces: a realistic model's record, far over a frame header's 64 KiB)."""
    import torch

    import nostall

    state = {"w": nostall.ShardedTensor(torch.arange(_N, dtype=torch.float32) * (step + 1) + rank * _N,
                                        (world * _N,), (rank * _N,)),
             "b": torch.full((100,), float(step)), "step": step}
    for i in range(many):
        state[f"layers.{i}.weight"] = nostall.ShardedTensor(torch.full((4,), float(step * 10000 + i + rank)),
                                                            (world * 4,), (rank * 4,))
    return state


def trainer(args: Dict[str, Any]) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment): ``args["mode"]`` is ``save`` (steps
    ``first..last``, each finalized; a failed save is recorded) or ``restore``; then ``die`` (SIGKILL itself)
    or a clean close. Writes what it saw to ``args["out"]/rank<R>.json``."""
    import torch
    import torch.distributed as dist

    import nostall

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: Dict[str, Any] = {"rank": rank}
    mgr = nostall.CheckpointManager(args["root"], async_save=True, timeout=args.get("timeout", 20),
                                    memory_tier=_tier(args["memory_dir"]))
    tiers = mgr._tiers
    out.update(holder=tiers._link.pid, memory_root=tiers.root.url)
    if args["mode"] == "save":
        failed = {}
        for step in range(args["first"], args["last"] + 1):
            if step in args.get("pause_before", []):
                open(os.path.join(args["out"], f"rank{rank}.paused"), "w").close()
                while not os.path.exists(os.path.join(args["out"], "go")):
                    time.sleep(0.05)
            if step in args.get("pause_after_save", []) and rank == world - 1:
                mgr._faults.writer_delay_s = 5.0  # the last host's part is still being written when it is killed
            try:
                mgr.save(step, _state(step, rank, world, args.get("many", 0)))
                if step in args.get("pause_after_save", []):  # staged on every rank; the test kills a host now
                    open(os.path.join(args["out"], f"rank{rank}.saved"), "w").close()
                    while not os.path.exists(os.path.join(args["out"], "go")):
                        time.sleep(0.05)
                mgr.finalize_pending_saves()
            except nostall.CheckpointError as e:
                failed[step] = str(e)
        out.update(failed=failed, memory_steps=tiers.root.steps(), memory_latest=tiers.root.latest_step())
    else:
        t = {"w": nostall.ShardedTensor(torch.zeros(_N), (world * _N,), (rank * _N,)), "b": torch.zeros(100),
             "step": -1}
        got = mgr.load(t)
        step = got["step"]
        want = _state(step, rank, world)
        r = mgr.last_restore
        out.update(step=step, exact=torch.equal(t["w"].data, want["w"].data) and torch.equal(t["b"], want["b"]),
                   tier=r.tier, persistent_bytes_read=r.persistent_bytes_read, fell_back=r.fell_back)
        for later in args.get("then_save", []):  # training goes on after the restore: memory saves again
            mgr.save(later, _state(later, rank, world))
            mgr.finalize_pending_saves()
        out.update(memory_latest=tiers.root.latest_step())
    if args.get("die"):
        with open(os.path.join(args["out"], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        mgr.close()
    except nostall.CheckpointError as e:  # a save that failed and was not reported yet
        out["close_error"] = str(e)
    with open(os.path.join(args["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------- the test side
_port = [31000 + os.getpid() % 300 * 10]


class Job:
    """One process per rank, ``per_host`` ranks on each host (ranks in host order), rendezvous at the first."""

    def __init__(self, hosts, per_host: int, args: Dict[str, Any], logdir: str, name: str) -> None:
        _port[0] += 1
        self.procs: List[subprocess.Popen] = []
        self.logs: List[str] = []
        os.makedirs(args["out"], exist_ok=True)
        world = len(hosts) * per_host
        for i, h in enumerate(hosts):
            for j in range(per_host):
                rank = i * per_host + j
                log = os.path.join(logdir, f"{name}-rank{rank}.log")
                self.logs.append(log)
                env = h.env({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(j),
                             "MASTER_ADDR": hosts[0].addr, "MASTER_PORT": str(_port[0]),
                             "TORCHELASTIC_RUN_ID": args["job"], "PYTHONUNBUFFERED": "1"})
                with open(log, "w") as f:
                    self.procs.append(h.popen([sys.executable, __file__, json.dumps(args)], env=env, stdout=f,
                                              stderr=subprocess.STDOUT))

    def wait_for_marks(self, out: str, what: str, ranks: int, timeout: float = 180.0) -> None:
        """Until every rank wrote ``<out>/rank<R>.<what>`` (its trainer reached that point); fails naming the
        logs if a trainer exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(os.path.join(out, f"rank{r}.{what}")) for r in range(ranks)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in self.procs), self.tails()
            time.sleep(0.05)

    def tails(self) -> str:
        out = []
        for log in self.logs:
            with open(log, errors="replace") as f:
                out.append(f"--- {log}\n{f.read()[-3000:]}")
        return "\n".join(out)

    def wait(self, timeout: float = 240.0) -> List[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                pytest.fail(f"a rank did not finish within {timeout:.0f}s\n{self.tails()}")
        return codes


def _results(out: str, world: int) -> List[Dict[str, Any]]:
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def _memory_root(host, res: Dict[str, Any], net) -> str:
    """A host's memory root as the root namespace sees it (on the host's private disk)."""
    rel = os.path.relpath(res["memory_root"], host.local)
    return os.path.join(host.disk, rel)


def _wait_no_pids(net, bound: float = 60.0) -> Dict[str, List[int]]:
    deadline = time.monotonic() + bound
    while net.leftover_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    return net.leftover_pids()


def _zero_fill_persistent(root: str) -> int:
    """Overwrite every data file of the persistent root with zeros (same size): a read of any of them would fail
    its checksum. Returns how many."""
    n = 0
    for d in os.listdir(root):
        if d.startswith("step_"):
            for f in os.listdir(os.path.join(root, d)):
                if f.endswith(".safetensors"):
                    p = os.path.join(root, d, f)
                    size = os.path.getsize(p)
                    with open(p, "r+b") as fh:
                        fh.write(b"\0" * size)
                    n += 1
    return n


def _common(tmp_path, net, job: str) -> Dict[str, Any]:
    for h in net.hosts:  # each host's memory directory, on its private disk
        os.makedirs(os.path.join(h.disk, "shm"), exist_ok=True)
    return {"root": str(tmp_path / "run"), "memory_dir": os.path.join(net.local_path, "shm"), "job": job}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("per_host", [1, 2])
def test_two_hosts_commit_with_the_replica_and_restore_from_own_memory(tmp_path, per_host):
    from tests.netns_hosts import HostNet

    world = 2 * per_host
    with HostNet(2, str(tmp_path)) as net:
        a, b = net.hosts
        logs = str(tmp_path / "logs")
        os.makedirs(logs)
        common = _common(tmp_path, net, "mh1")
        out1 = str(tmp_path / "out1")
        job = Job([a, b], per_host, {**common, "mode": "save", "first": 1, "last": 3, "die": True, "out": out1},
                  logs, "save")
        codes = job.wait()
        assert codes == [-signal.SIGKILL] * world, job.tails()
        got = _results(out1, world)
        for g in got:  # (step 1 may still be there on host 0: its retention runs after the outcome is reported)
            assert g["failed"] == {} and g["memory_steps"][-1] == 3 and g["memory_latest"] == 3, (g, job.tails())
            assert set(g["memory_steps"]) <= {1, 3}, g
        ra, rb = _memory_root(a, got[0], net), _memory_root(b, got[-1], net)
        # one step, on both hosts: every rank's file (own and replica), bytes equal, the same manifest
        names = ["manifest.json"] + [f"rank{r}.safetensors" for r in range(world)]
        assert sorted(os.listdir(os.path.join(ra, "step_3"))) == sorted(names)
        assert sorted(os.listdir(os.path.join(rb, "step_3"))) == sorted(names)
        for name in names:
            with open(os.path.join(ra, "step_3", name), "rb") as fa, open(os.path.join(rb, "step_3", name), "rb") as fb:
                assert fa.read() == fb.read(), name
        assert not os.path.exists(os.path.join(str(tmp_path / "run"), "step_3"))  # memory only
        assert _zero_fill_persistent(str(tmp_path / "run")) == world  # step 2's files: never read below
        # the trainers died; the holders did not: the job restarts and restores from its own hosts' memory
        assert all(h.pids() for h in (a, b))
        out2 = str(tmp_path / "out2")
        job = Job([a, b], per_host, {**common, "mode": "restore", "out": out2}, logs, "restore")
        assert job.wait() == [0] * world, job.tails()
        for g in _results(out2, world):
            assert (g["step"], g["tier"], g["exact"], g["persistent_bytes_read"]) == (3, "memory", True, 0), g
        # a clean close on every rank releases both holders: nothing of the job is left on either host
        assert _wait_no_pids(net) == {}
        assert not os.path.exists(ra) and not os.path.exists(rb)


@pytest.mark.timeout(600)
def test_a_model_of_thousands_of_tensors_commits_on_both_hosts(tmp_path):
    from tests.netns_hosts import HostNet

    with HostNet(2, str(tmp_path)) as net:
        a, b = net.hosts
        logs = str(tmp_path / "logs")
        os.makedirs(logs)
        out = str(tmp_path / "out")
        job = Job([a, b], 1, {**_common(tmp_path, net, "mh-many"), "mode": "save", "first": 1, "last": 1,
                              "many": 2000, "die": True, "out": out}, logs, "save")
        assert job.wait() == [-signal.SIGKILL] * 2, job.tails()
        got = _results(out, 2)
        for g in got:
            assert g["failed"] == {} and g["memory_latest"] == 1, (g, job.tails())
        ra, rb = _memory_root(a, got[0], net), _memory_root(b, got[1], net)
        names = ["manifest.json", "rank0.safetensors", "rank1.safetensors"]
        assert sorted(os.listdir(os.path.join(ra, "step_1"))) == names
        assert sorted(os.listdir(os.path.join(rb, "step_1"))) == names
        for name in names:
            with open(os.path.join(ra, "step_1", name), "rb") as fa, open(os.path.join(rb, "step_1", name), "rb") as fb:
                assert fa.read() == fb.read(), name
        with open(os.path.join(ra, "step_1", "manifest.json")) as f:
            assert "layers.1999.weight" in f.read()


@pytest.mark.timeout(600)
def test_a_peer_holder_killed_before_a_save_leaves_the_previous_step_latest(tmp_path):
    from tests.netns_hosts import HostNet

    with HostNet(2, str(tmp_path)) as net:
        a, b = net.hosts
        logs = str(tmp_path / "logs")
        os.makedirs(logs)
        out = str(tmp_path / "out")
        job = Job([a, b], 1, {**_common(tmp_path, net, "mh2"), "mode": "save", "first": 1, "last": 3,
                              "pause_before": [3], "timeout": 8, "out": out}, logs, "save")
        job.wait_for_marks(out, "paused", 2)
        # step 1 is committed in memory on both hosts (step 2 went to the persistent root); host b's holder dies
        # (its trainer lives on)
        base_b = os.path.join(b.disk, "shm", f"nostall-{os.getuid()}")
        mark = [n for n in os.listdir(base_b) if n.endswith(".holder")]
        assert len(mark) == 1
        holder_b = json.load(open(os.path.join(base_b, mark[0])))["pid"]
        os.kill(holder_b, signal.SIGKILL)
        open(os.path.join(out, "go"), "w").close()
        assert job.wait() == [0, 0], job.tails()
        got = _results(out, 2)
        # reported on the training side: on host 0 with the cause; on host 1 (whose holder is gone, so no
        # outcome reaches its writer) as a save that did not finish in time
        assert "replica of host 0 (ranks [0]) on host 1 failed" in got[0]["failed"].get("3", ""), (got, job.tails())
        assert "3" in got[1]["failed"] or "step 3" in got[1].get("close_error", ""), got[1]
        # memory step 1 stays latest on both hosts (as each rank saw it after the failed save; host b's root outlives
        # its dead holder, host a's was released by the clean close)
        for g in got:
            assert (g["memory_steps"], g["memory_latest"]) == ([1], 1), g
        rb = _memory_root(b, got[1], net)
        assert sorted(n for n in os.listdir(rb) if n.startswith("step_")) == ["step_1"]
        assert not os.path.exists(_memory_root(a, got[0], net))
        assert _wait_no_pids(net, 150) == {}


@pytest.mark.timeout(600)
def test_a_lost_host_is_restored_from_its_peer_with_nothing_from_the_persistent_root(tmp_path):
    import shutil

    from tests.netns_hosts import HostNet

    with HostNet(2, str(tmp_path)) as net:
        a, b = net.hosts
        logs = str(tmp_path / "logs")
        os.makedirs(logs)
        common = _common(tmp_path, net, "mh3")
        out1 = str(tmp_path / "out1")
        job = Job([a, b], 1, {**common, "mode": "save", "first": 1, "last": 3, "die": True, "out": out1}, logs, "save")
        assert job.wait() == [-signal.SIGKILL] * 2, job.tails()
        assert all(g["memory_latest"] == 3 for g in _results(out1, 2))
        # host b is lost whole (its holder too); a replacement host starts with an empty memory directory
        b.kill_all()
        shutil.rmtree(os.path.join(b.disk, "shm"))
        os.makedirs(os.path.join(b.disk, "shm"))
        assert not b.pids() and a.pids()  # host a's holder lives on
        assert _zero_fill_persistent(str(tmp_path / "run")) == 2  # step 2's files: never read below
        out2 = str(tmp_path / "out2")
        job = Job([a, b], 1, {**common, "mode": "restore", "then_save": [5], "out": out2}, logs, "restore")
        assert job.wait() == [0, 0], job.tails()
        got = _results(out2, 2)
        assert [(g["step"], g["exact"], g["persistent_bytes_read"]) for g in got] == [(3, True, 0)] * 2, got
        assert [g["tier"] for g in got] == ["memory", "peer"], got
        # the replacement host takes part in the next memory save (replica and all): step 5 on both hosts
        assert [g["memory_latest"] for g in got] == [5, 5], got
        assert _wait_no_pids(net) == {}


@pytest.mark.timeout(600)
def test_four_hosts_each_holds_its_source_hosts_replica_and_a_lost_one_restores_from_peers(tmp_path):
    import shutil

    from tests.netns_hosts import HostNet

    with HostNet(4, str(tmp_path)) as net:
        hosts = net.hosts
        logs = str(tmp_path / "logs")
        os.makedirs(logs)
        common = _common(tmp_path, net, "mh4")
        out1 = str(tmp_path / "out1")
        job = Job(hosts, 1, {**common, "mode": "save", "first": 1, "last": 1, "die": True, "out": out1}, logs, "save")
        assert job.wait() == [-signal.SIGKILL] * 4, job.tails()
        got = _results(out1, 4)
        assert all(g["memory_latest"] == 1 and g["failed"] == {} for g in got), got
        # peer_jump=1: host h holds its own rank's file and host h-1's (its source), nothing else
        for h in range(4):
            step = os.path.join(_memory_root(hosts[h], got[h], net), "step_1")
            want = {"manifest.json", f"rank{h}.safetensors", f"rank{(h - 1) % 4}.safetensors"}
            assert set(os.listdir(step)) == want, (h, os.listdir(step))
        # host c (rank 2) is lost whole; its replacement starts empty: rank 2's file survives on host d
        hosts[2].kill_all()
        shutil.rmtree(os.path.join(hosts[2].disk, "shm"))
        os.makedirs(os.path.join(hosts[2].disk, "shm"))
        out2 = str(tmp_path / "out2")
        job = Job(hosts, 1, {**common, "mode": "restore", "out": out2}, logs, "restore")
        assert job.wait() == [0] * 4, job.tails()
        got = _results(out2, 4)
        assert [(g["step"], g["exact"], g["persistent_bytes_read"]) for g in got] == [(1, True, 0)] * 4, got
        assert got[2]["tier"] == "peer", got
        assert _wait_no_pids(net) == {}


@pytest.mark.timeout(600)
def test_a_peer_host_killed_mid_save_leaves_the_previous_step_latest(tmp_path):
    from tests.netns_hosts import HostNet

    with HostNet(2, str(tmp_path)) as net:
        a, b = net.hosts
        logs = str(tmp_path / "logs")
        os.makedirs(logs)
        out = str(tmp_path / "out")
        job = Job([a, b], 1, {**_common(tmp_path, net, "mh5"), "mode": "save", "first": 1, "last": 3,
                              "pause_after_save": [3], "timeout": 8, "out": out}, logs, "save")
        job.wait_for_marks(out, "saved", 2)
        b.kill_all()  # step 3 is staged on both ranks, host b's part still being written: host b goes, holder and all
        open(os.path.join(out, "go"), "w").close()
        codes = job.wait()
        assert codes[0] == 0, job.tails()
        got = json.load(open(os.path.join(out, "rank0.json")))
        assert "3" in got["failed"], (got, job.tails())  # reported on the training side
        assert (got["memory_steps"], got["memory_latest"]) == ([1], 1), got  # the previous memory step stays
        assert _wait_no_pids(net, 150) == {}


if __name__ == "__main__":
    trainer(json.loads(sys.argv[1]))
