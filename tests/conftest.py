"""Shared fixtures: persistent gloo rank pools (see tests/dist_harness.py).

``pool2`` / ``pool4`` hand a test the session's :class:`RankPool` of 2 / 4
ranks; ``rank_pools.get(n)`` gives any size.  Pools start lazily, at most two
run at once (each worker is a ~300 MB torch process), a pool broken by a
failed test restarts on its next use, and all are closed at session end.
Tests that kill ranks or need a pristine interpreter use ``run_ranks``.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import RankPool, RankPools


@pytest.fixture(scope="session")
def rank_pools():
    pools = RankPools(max_alive=2)
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture
def pool2(rank_pools) -> RankPool:
    return rank_pools.get(2)


@pytest.fixture
def pool4(rank_pools) -> RankPool:
    return rank_pools.get(4)


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server (moto, subprocess) on 127.0.0.1 for the session; skipped without moto/s3fs."""
    pytest.importorskip("s3fs", reason="object-storage tests need s3fs (pip install 'nostall[s3]')")
    pytest.importorskip("moto", reason="object-storage tests need moto[server]")
    from tests.s3_server import S3Server

    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


class StagingGate:
    """Holds an overlapped save's copy until the test releases it: event-driven, not timed.

    Arming a save's ``_faults.stage_delay_s`` (any value > 0) makes its staging thread sleep before
    copying (``nostall.saving.saver``); under this gate that sleep waits for :meth:`release` instead,
    so "the copy is still running" holds whatever the machine's speed. Only a hang reaches its bound.
    """

    BOUND_S = 60.0

    def __init__(self) -> None:
        import threading

        self.released = threading.Event()

    def release(self) -> None:
        self.released.set()

    def sleep(self, seconds: float) -> None:
        if seconds > 0 and not self.released.wait(self.BOUND_S):
            raise AssertionError(f"the staging gate was not released within {self.BOUND_S:.0f} s")


@pytest.fixture
def staging_gate(monkeypatch) -> StagingGate:
    import time
    import types

    from nostall.saving import saver

    gate = StagingGate()
    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    clock.sleep = gate.sleep
    monkeypatch.setattr(saver, "time", clock)  # the saver module's clock only; time.sleep elsewhere is untouched
    yield gate
    gate.release()  # a test that failed before releasing leaves no staging thread waiting


# --------------------------------------------------------------------------- tiers and markers

TIERS = ("unit", "dist", "system")  # tests/unit, tests/dist, tests/system (pyproject.toml registers them)
_SLOW = {"test_crash", "test_multihost", "test_docs", "test_bench", "test_bench_train", "test_bench_scale",
         "test_bench_incremental", "test_ownership", "test_megatron_real", "test_ray"}
_MEGATRON = {"test_megatron_real", "test_interop_megatron"}


def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker from its directory (a doctest of src/nostall is ``unit``),
    and ``s3`` / ``ray`` / ``megatron`` / ``slow`` where it needs a server, Ray, Megatron, or minutes."""
    import pathlib

    here = pathlib.Path(__file__).resolve().parent
    for item in items:
        path = pathlib.Path(str(item.path)).resolve()
        try:
            parts = path.relative_to(here).parts
        except ValueError:  # outside tests/: the doctests of src/nostall
            parts = ()
            item.add_marker(pytest.mark.unit)
        if parts and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
        name = path.stem
        if "s3" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
        if name == "test_ray":
            item.add_marker(pytest.mark.ray)
        if name in _MEGATRON:
            item.add_marker(pytest.mark.megatron)
        if name in _SLOW:
            item.add_marker(pytest.mark.slow)
