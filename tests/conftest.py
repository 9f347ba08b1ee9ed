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
