"""Hosts on one machine: network namespaces joined by a bridge, each with a private "local disk".

    with HostNet(2, base_dir) as net:          # skips the test when namespaces are not allowed
        a, b = net.hosts                       # a.addr == "10.213.X.2", b.addr == "10.213.X.3"
        p = a.popen([sys.executable, "-m", ...], env=a.env(), stdout=log)
        ...
        b.kill_all()                           # SIGKILL every process of host b (loop until none is left)

What each host is:

* its own network namespace ``<prefix>-<i>`` with ``lo`` up and one
  interface, ``eth0``, at ``10.213.X.<i+2>/24``: a veth pair whose other end
  is enslaved to a bridge in the root namespace. The bridge holds
  ``10.213.X.1`` (:attr:`HostNet.bridge_addr`), where a server that every host
  must reach (the S3-compatible one) listens. ``X`` is picked from the test's
  pid among subnets no interface uses, and every name carries the pid, so
  parallel or leftover runs do not collide. Nothing is routed outside the
  subnet: there is no default route in the namespaces.
* its own "local disk": the directory ``<base_dir>/disk-<name>``, which the
  host sees (bind-mounted, in a mount namespace of its own) at the *same*
  path on every host, :attr:`HostNet.local_path`. ``TMPDIR`` and ``HOME``
  point into it. So a host-local path that a program mistakes for a shared
  one names a different directory on each host, as on real machines; the
  test reads each host's disk from the root namespace under
  :attr:`Host.disk`. (Where bind mounts are refused, each host gets its own
  directory at its own path instead; :attr:`HostNet.private_disks` says
  which.)

Every process a host runs is started with ``ip netns exec``, so
``ip netns pids`` lists all of them (the torchrun agent, its ranks, their
writer processes) and :meth:`Host.kill_all` kills them all, as a host that
loses power would lose them. :meth:`HostNet.close` (and leaving the ``with``
block, even on error) kills what is left, deletes the namespaces, the veth
pairs and the bridge, and :meth:`HostNet.leftover_pids` lets a test assert
that nothing of it is still running. Namespaces left by a run that was
SIGKILLed are removed by the next run (their pid is gone).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from typing import Dict, List, Optional, Sequence

PREFIX = "nsh"
SUBNET = "10.213"
IFNAME = "eth0"  # the host's interface inside its namespace (GLOO_SOCKET_IFNAME)


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _skip(reason: str) -> None:
    import pytest

    pytest.skip(reason)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def netns_pids(ns: str) -> List[int]:
    """Pids of the processes in namespace ``ns`` (``ip netns pids``; zombies are not listed)."""
    p = _ip("netns", "pids", ns, check=False)
    if p.returncode != 0:
        return []
    return [int(x) for x in p.stdout.split()]


def kill_netns(ns: str, timeout: float = 20.0) -> int:
    """SIGKILL every process of namespace ``ns`` until none is left (bounded); returns how many were killed."""
    killed: set = set()
    deadline = time.monotonic() + timeout
    while True:
        pids = netns_pids(ns)
        if not pids:
            return len(killed)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of namespace {ns} survive SIGKILL after {timeout:.0f}s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _remove_stale() -> None:
    """Delete namespaces and bridges left by earlier runs whose process is gone."""
    p = _ip("netns", "list", check=False)
    for line in p.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-\d+", name)
        if m and not _pid_alive(int(m.group(1))):
            kill_netns(name)
            _ip("netns", "del", name, check=False)
    p = _ip("-o", "link", "show", check=False)
    for m in re.finditer(rf"^\d+: ({PREFIX}(\d+)(?:br|v\d+))[:@]", p.stdout, re.M):
        if not _pid_alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)


def _free_subnet() -> int:
    used = set(re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", _ip("-4", "-o", "addr", "show").stdout))
    start = os.getpid() % 200 + 20
    for k in range(200):
        x = (start + k - 20) % 200 + 20
        if str(x) not in used:
            return x
    raise RuntimeError(f"no free {SUBNET}.X.0/24 subnet")


class Host:
    """One host: a network namespace, its address, its private disk."""

    def __init__(self, net: "HostNet", index: int, ns: str, addr: str, disk: str) -> None:
        self.net = net
        self.index = index
        self.name = chr(ord("a") + index)
        self.ns = ns
        self.addr = addr
        self.disk = disk  # the host's local disk, as the root namespace sees it
        self.procs: List[subprocess.Popen] = []

    @property
    def local(self) -> str:
        """The host's local disk as the host sees it (the same path on every host when private)."""
        return self.net.local_path if self.net.private_disks else self.disk

    def env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """An environment for this host: gloo on its interface, TMPDIR and HOME on its local disk, no proxies."""
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(
            GLOO_SOCKET_IFNAME=IFNAME,
            TP_SOCKET_IFNAME=IFNAME,
            TMPDIR=os.path.join(self.local, "tmp"),
            HOME=os.path.join(self.local, "home"),
            OMP_NUM_THREADS="1",
            NOSTALL_TEST_HOST=self.name,
        )
        env.update(extra or {})
        return env

    def command(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run on this host: in its namespace, its disk mounted at the shared local path."""
        cmd = ["ip", "netns", "exec", self.ns]
        if self.net.private_disks:
            # ip netns exec gives the command a mount namespace of its own (slave to the root one):
            # the bind mount is seen by this host's processes only
            cmd += ["sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", self.disk,
                    self.net.local_path]
        return cmd + list(argv)

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        kw.setdefault("env", self.env())
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(self.command(argv), **kw)
        self.procs.append(p)
        return p

    def run(self, argv: Sequence[str], timeout: float = 60.0, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env())
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(argv), timeout=timeout, **kw)

    def pids(self) -> List[int]:
        return netns_pids(self.ns)

    def kill_all(self, timeout: float = 20.0) -> int:
        """SIGKILL every process of this host (agent, ranks, writers), loop until none is left; reap ours."""
        n = kill_netns(self.ns, timeout)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - the namespace is empty
                p.kill()
                p.wait(timeout=5)
        return n

    def __repr__(self) -> str:
        return f"Host({self.name}, ns={self.ns}, addr={self.addr})"


class HostNet:
    """``n`` hosts in network namespaces on a bridge; see the module doc. A context manager."""

    def __init__(self, n: int, base_dir: str) -> None:
        if shutil.which("ip") is None:
            _skip("multi-host tests need iproute2's `ip` (not installed)")
        if os.geteuid() != 0:
            _skip("multi-host tests need root for `ip netns add` (network namespaces)")
        _remove_stale()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.hosts: List[Host] = []
        self.bridge = f"{self.tag}br"
        self._made_bridge = False
        self._ns: List[str] = []
        self._veths: List[str] = []
        x = _free_subnet()
        self.bridge_addr = f"{SUBNET}.{x}.1"
        self.local_path = os.path.join(base_dir, "local")
        os.makedirs(self.local_path, exist_ok=True)
        self.private_disks = True
        try:
            self._setup(n, x, base_dir)
        except BaseException:
            self.close()
            raise

    def _setup(self, n: int, x: int, base_dir: str) -> None:
        first = f"{self.tag}-0"
        p = _ip("netns", "add", first, check=False)
        if p.returncode != 0:
            _skip(f"`ip netns add` is not permitted here: {p.stderr.strip()}")
        self._ns.append(first)
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(n):
            ns = f"{self.tag}-{i}"
            if i > 0:
                _ip("netns", "add", ns)
                self._ns.append(ns)
            veth = f"{self.tag}v{i}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            self._veths.append(veth)
            _ip("link", "set", veth, "master", self.bridge, "up")
            addr = f"{SUBNET}.{x}.{i + 2}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            disk = os.path.join(base_dir, f"disk-{chr(ord('a') + i)}")
            for sub in ("tmp", "home"):
                os.makedirs(os.path.join(disk, sub), exist_ok=True)
            self.hosts.append(Host(self, i, ns, addr, disk))
        # can a host have a private mount of its disk? (else: a directory per host, at its own path)
        probe = self.hosts[0].run(["true"], timeout=30)
        if probe.returncode != 0:
            self.private_disks = False
            probe = self.hosts[0].run(["true"], timeout=30)
            if probe.returncode != 0:
                _skip(f"`ip netns exec` is not permitted here: {probe.stderr.strip()}")
        self._wait_reachable()

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """The bridge forwards once its ports are up: wait until every host reaches the first one."""
        a = self.hosts[0]
        code = ("import socket,sys,time\n"
                "s=socket.socket(); s.bind((sys.argv[1],0)); s.listen(8); print(s.getsockname()[1],flush=True)\n"
                "s.settimeout(%r)\n"
                "for _ in range(int(sys.argv[2])): s.accept()[0].close()\n" % timeout)
        import sys

        others = self.hosts[1:]
        if not others:
            return
        server = a.popen([sys.executable, "-c", code, a.addr, str(len(others))], stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            probe = ("import socket,sys,time\n"
                     "d=time.monotonic()+%r\n"
                     "while True:\n"
                     "    try: socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=1).close(); break\n"
                     "    except OSError:\n"
                     "        if time.monotonic()>d: raise\n"
                     "        time.sleep(0.05)\n" % timeout)
            for h in others:
                r = h.run([sys.executable, "-c", probe, a.addr, str(port)], timeout=timeout + 10)
                if r.returncode != 0:
                    raise RuntimeError(f"host {h.name} cannot reach host {a.name}: {r.stderr.strip()[-500:]}")
            server.wait(timeout=timeout)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(5)
            server.stdout.close()

    def leftover_pids(self) -> Dict[str, List[int]]:
        """Processes still running in this net's namespaces, by namespace (empty when all is gone)."""
        out = {}
        for ns in self._ns:
            pids = netns_pids(ns)
            if pids:
                out[ns] = pids
        return out

    def close(self) -> None:
        """Kill every process of every host, delete the namespaces, the veth pairs and the bridge. Idempotent."""
        errors = []
        for h in self.hosts:
            try:
                h.kill_all()
            except Exception as e:  # pragma: no cover - keep cleaning
                errors.append(e)
        for ns in self._ns:
            try:
                kill_netns(ns)
            except Exception as e:  # pragma: no cover
                errors.append(e)
        for veth in self._veths:  # the pair goes with the namespace too, but the kernel frees that one lazily
            _ip("link", "del", veth, check=False)
        self._veths = []
        for ns in self._ns:
            _ip("netns", "del", ns, check=False)
        self._ns = []
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._made_bridge = False
        if errors:
            raise errors[0]

    def __enter__(self) -> "HostNet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
