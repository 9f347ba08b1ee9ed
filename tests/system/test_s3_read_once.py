"""Read once across replicas, measured where it costs: the bytes the object store serves.

Two gloo ranks hold the same model (data-parallel replicas), save it to an
``s3://`` root on the real S3-compatible server (moto, 127.0.0.1), and load
it back with ``CheckpointManager.load``. Between the ranks and the server sits
:class:`tests.s3_server.CountingProxy`, which forwards every request and logs
the response body bytes of each GET by object key, server side: no client
code is patched. The ranks mark the load's start and end on the proxy (after
a barrier each), so only the load's requests are counted.

With the default ``read_once`` (on for object storage) the job GETs each
stored byte of the data files once, 1.0x the checkpoint's data bytes, and the
manifest once; with ``read_once=False`` each replica reads every byte, 2.0x.
"""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("s3fs", reason="object-storage tests need s3fs (pip install 'nostall[s3]')")
pytest.importorskip("moto", reason="object-storage tests need moto[server]")

import torch  # noqa: E402

from tests.dist_harness import RankPool  # noqa: E402
from tests.s3_server import CountingProxy  # noqa: E402

JOB_TIMEOUT_S = 120.0


def _model():
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))


def _mark(proxy_url, name):
    import urllib.request

    urllib.request.urlopen(f"{proxy_url}{CountingProxy.MARK}{name}", timeout=30).close()


def _save(rank, world, root, storage_options):
    import nostall

    torch.manual_seed(0)  # data-parallel replicas: the same model on every rank
    with nostall.CheckpointManager(root, storage_options=storage_options) as mgr:
        mgr.save(1, model=_model())
        mgr.finalize_pending_saves()
    return True


def _load(rank, world, root, storage_options, read_once, proxy_url, label):
    """Load step 1 into a fresh model between two marks; (values equal, bytes_read, bytes_received)."""
    import torch.distributed as dist

    import nostall

    torch.manual_seed(0)
    saved = _model()
    torch.manual_seed(1)  # different values: the load must bring the saved ones
    fresh = _model()
    kwargs = {} if read_once == "default" else {"read_once": read_once}
    with nostall.CheckpointManager(root, storage_options=storage_options, **kwargs) as mgr:
        dist.barrier()  # every rank's set-up requests are answered before the start mark
        if rank == 0:
            _mark(proxy_url, f"{label}:start")
        dist.barrier()
        got = mgr.load(model=fresh)
        dist.barrier()  # every rank's load requests are answered before the end mark
        if rank == 0:
            _mark(proxy_url, f"{label}:end")
        dist.barrier()
    equal = all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), fresh.state_dict().values()))
    return equal, got.bytes_read, got.bytes_received


@pytest.fixture
def proxy(s3):
    p = CountingProxy(s3.port)
    try:
        yield p
    finally:
        p.close()  # on failure too


def _data_bytes(s3, root):
    """The checkpoint's data bytes (the sum of its manifest's piece sizes), its data files' sizes by key, its
    pieces' byte ranges by key and its step dir, read straight from the server (not through the proxy)."""
    from nostall.core.format import Manifest

    step_dir = root[len("s3://"):] + "/step_1"
    fs = s3.filesystem()
    fs.invalidate_cache()
    m = Manifest.from_json_bytes(fs.cat_file(f"{step_dir}/manifest.json"), f"{root}/step_1")
    pieces = [p for t in m.tensors.values() for p in t.pieces] + [
        p for r in m.per_rank for t in r.tensors.values() for p in t.pieces]
    ranges = {}
    for p in pieces:
        ranges.setdefault(f"{step_dir}/{p.file}", []).append((p.start, p.end))
    files = {f"{step_dir}/{n}": f.size for n, f in m.files.items()}
    return sum(p.end - p.start for p in pieces), files, ranges, step_dir


def _coverage_problems(served, files, ranges, times):
    """Where the data-file bytes served differ from each piece's bytes served ``times`` times and nothing else
    (no safetensors header byte, no byte twice more): a list of (file, first byte, last byte + 1, times served)."""
    counts = {k: bytearray(n) for k, n in files.items()}
    for s in served:
        if s.method == "GET" and s.key in counts:
            start = int(s.range.split("=", 1)[1].split("-", 1)[0]) if s.range else 0
            for i in range(start, start + s.nbytes):
                counts[s.key][i] += 1
    problems = []
    for k, c in counts.items():
        want = bytearray(len(c))
        for a, b in ranges.get(k, ()):
            want[a:b] = bytes([times]) * (b - a)
        i = 0
        while i < len(c):
            if c[i] != want[i]:
                j = i
                while j < len(c) and c[j] == c[i] and want[j] == want[i]:
                    j += 1
                problems.append((k, i, j, c[i]))
                i = j
            else:
                i += 1
    return problems


def _check_load(proxy, label, out, times, data_bytes, files, ranges, step_dir):
    """Check the load marked ``label`` (``out``: each rank's ``_load`` result) against what the store served
    for it: the values loaded, no failed request, the manifest GET once, each data-file byte of a piece GET
    ``times`` times and nothing else, and the ranks' own counts agreeing (each rank's bytes read and received
    make the checkpoint's data bytes; the bytes read by the job, ``times`` x them)."""
    served = proxy.between(f"{label}:start", f"{label}:end")
    data = {k: n for k, n in CountingProxy.get_bytes(served).items() if k.endswith(".safetensors")}
    manifest_gets = [s for s in served if s.method == "GET" and s.key == f"{step_dir}/manifest.json"]
    failed = [s for s in served if s.status >= 400]
    log = "\n".join(map(str, served))
    assert all(o[0] for o in out), f"{label}: loaded values differ from the saved ones: {out}"
    assert not failed, f"{label}: failed requests during the load:\n{log}"
    assert set(data) <= set(files), (data, files)
    assert sum(data.values()) == times * data_bytes, (
        f"{label}: the store served {sum(data.values())} bytes of data files for the load "
        f"({sum(data.values()) / data_bytes:.2f}x), not {times}.0x the checkpoint's {data_bytes} data bytes; "
        f"by file: {data}\n{log}")
    assert len(manifest_gets) == 1, f"{label}: the manifest was GET {len(manifest_gets)} times, not once:\n{log}"
    problems = _coverage_problems(served, files, ranges, times)
    assert not problems, (
        f"{label}: data-file bytes not served exactly {times} time(s), (file, start, end, times): {problems}\n{log}")
    assert all(o[1] + o[2] == data_bytes for o in out), out
    assert sum(o[1] for o in out) == times * data_bytes, out


def test_replicas_get_each_stored_byte_once_from_s3(pool2: RankPool, s3, proxy):
    bucket = s3.make_bucket(f"readonce-{uuid.uuid4().hex[:12]}")
    root = f"s3://{bucket}/run"
    so = proxy.storage_options()
    assert pool2.run(_save, root, so, timeout=JOB_TIMEOUT_S) == [True, True]

    torch.manual_seed(0)
    model_bytes = sum(t.numel() * t.element_size() for t in _model().state_dict().values())
    data_bytes, files, ranges, step_dir = _data_bytes(s3, root)
    assert data_bytes == model_bytes, (data_bytes, model_bytes)  # each replicated tensor stored once
    assert sum(files.values()) > data_bytes  # the files' safetensors headers: not read by a load

    # default read_once (on for object storage): each stored byte GET once by the job, the rest received
    out = pool2.run(_load, root, so, "default", proxy.url, "once", timeout=JOB_TIMEOUT_S)
    _check_load(proxy, "once", out, 1, data_bytes, files, ranges, step_dir)
    # read_once=False: each replica reads every byte for itself
    out = pool2.run(_load, root, so, False, proxy.url, "each", timeout=JOB_TIMEOUT_S)
    _check_load(proxy, "each", out, 2, data_bytes, files, ranges, step_dir)
