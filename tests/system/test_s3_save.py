"""Saving to object storage: async and sync saves to s3:// on 2 ranks, commit by manifest, retention, failures.

A real S3-compatible server on 127.0.0.1 (moto's server mode), s3fs over HTTP.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
from typing import Any, Dict, List, Tuple

import pytest

pytest.importorskip("s3fs", reason="object-storage tests need s3fs (pip install 'nostall[s3]')")

import torch  # noqa: E402

import nostall  # noqa: E402


def _state(step, rank, world):
    w = torch.arange(128 * 256, dtype=torch.float32).reshape(128, 256) + step * 1000 + rank
    return {"w": nostall.ShardedTensor(w, (128 * world, 256), (128 * rank, 0)), "b": torch.full((8,), float(step)),
            "meta": {"step": step}, "rng": nostall.PerRank(torch.full((4,), step * 10 + rank, dtype=torch.uint8))}


def _expected_full(step, world):
    return torch.cat([_state(step, r, world)["w"].data for r in range(world)])


def _save_remote(rank, world, root, so, async_save, fallback_sync, local):
    import torch

    import nostall

    mgr = nostall.CheckpointManager(root, keep_last=2, async_save=async_save, storage_options=so, timeout=60,
                                    fallback_sync=fallback_sync, local_staging_dir=f"{local}/rank-host{rank}")
    handles = []
    for step in (1, 2, 3):
        st = _state(step, rank, world)
        handles.append(mgr.save(step, st))
        st["w"].data.fill_(-1)  # may change once save() returns
    mgr.finalize_pending_saves()
    stats = [h.result() for h in handles]
    tmpl = _state(0, rank, world)
    got = mgr.load(tmpl)
    ok = torch.equal(tmpl["w"].data, _state(3, rank, world)["w"].data) and got["meta"] == {"step": 3}
    ok = ok and torch.equal(got["rng"], _state(3, rank, world)["rng"].value)
    result = (mgr.steps(), mgr.latest_step(), ok, [s.async_save for s in stats])
    mgr.close()
    return result


@pytest.mark.parametrize("mode", ["async", "fallback_sync"])
def test_two_ranks_save_to_s3_and_load_resharded(pool2, s3, tmp_path, mode):
    bucket = s3.make_bucket(f"run-{mode.replace('_', '-')}")
    root = f"s3://{bucket}/job1"
    out = pool2.run(_save_remote, root, s3.storage_options, True, mode == "fallback_sync", str(tmp_path))
    for rank, (steps, latest, ok, modes) in enumerate(out):
        # rank 0 finalized its own writer's retention; another rank may look before rank 0's writer got there
        assert (steps == [2, 3] if rank == 0 else steps in ([2, 3], [1, 2, 3])) and latest == 3 and ok
        assert modes == [mode == "async"] * 3
    fs = s3.filesystem()
    listing = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/job1", refresh=True))
    assert listing == [".tmp", "latest", "step_2", "step_3"] or listing == ["latest", "step_2", "step_3"]
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/job1/step_3", refresh=True))
    assert len(names) == 3 and names[0] == "manifest.json", names
    assert names[1].startswith("rank0.") and names[2].startswith("rank1.") and names[1].endswith(".safetensors")
    # resharded: one process reads the whole tensor back from the bucket
    whole = torch.zeros(256, 256)
    got = nostall.load({"w": whole, "b": torch.zeros(8), "meta": None}, f"{root}/step_3",
                       storage_options=s3.storage_options)
    assert torch.equal(whole, _expected_full(3, 2)) and got["meta"] == {"step": 3}
    # nothing is left in the ranks' local staging
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def _missing_bucket(rank, world, root, so):
    import nostall

    mgr = nostall.CheckpointManager(root, async_save=True, storage_options=so, timeout=30)
    try:
        mgr.save(1, _state(1, rank, world))
        mgr.finalize_pending_saves()
    except nostall.CheckpointSaveError as e:
        return str(e), mgr.steps()
    finally:
        mgr.close()
    return None, None


def test_save_to_a_missing_bucket_is_a_clear_error_on_every_rank(pool2, s3):
    out = pool2.run(_missing_bucket, "s3://no-such-bucket/run", s3.storage_options)
    for err, steps in out:
        assert err is not None and "no-such-bucket" in err and "step 1" in err, err
        assert steps == []


_CRASH_TIMEOUT = 6.0  # the bound under test; the first (good) save must fit in it on a loaded machine too


def _crash_mid_upload(rank, world, root, so, local):
    import os
    import time

    import nostall

    if rank == 1:  # this rank's trainer dies right after staging step 2 (its upload never happens)
        os.environ["NOSTALL_TEST_CRASH"] = "trainer:staged:2"
    mgr = nostall.CheckpointManager(root, async_save=True, storage_options=so, timeout=_CRASH_TIMEOUT,
                                    local_staging_dir=f"{local}/r{rank}")
    mgr.save(1, _state(1, rank, world))
    mgr.finalize_pending_saves()
    mgr.save(2, _state(2, rank, world))
    t0 = time.monotonic()
    try:
        mgr.finalize_pending_saves()
        err = None
    except nostall.CheckpointError as e:  # the writer's error, or the bound on waiting for it
        err = str(e)
    import json

    with open(f"{local}/outcome{rank}.json", "w") as f:
        json.dump({"error": err, "waited": time.monotonic() - t0, "latest": mgr.latest_step()}, f)
    mgr.close()


def test_trainer_killed_mid_upload_leaves_the_previous_checkpoint_latest(s3, tmp_path):
    from tests.dist_harness import run_ranks

    bucket = s3.make_bucket("crash-mid-upload")
    root = f"s3://{bucket}/run"
    with pytest.raises(AssertionError) as ei:  # rank 1 dies: the harness reports it
        # rank 0 needs up to 1.5 x its timeout to hear of it, then closes: more than the default grace on a busy machine
        run_ranks(2, _crash_mid_upload, root, s3.storage_options, str(tmp_path), timeout=90, grace=30)
    assert "rank 1" in str(ei.value)
    # rank 0 is told, within its timeout, and the bucket still says step 1
    import json

    out = json.loads((tmp_path / "outcome0.json").read_text())
    # bounded, not timed: up to 1.5 x its timeout, plus slack that only a hang (not a busy machine) runs past
    assert out["error"] and "step 2" in out["error"] and out["waited"] < _CRASH_TIMEOUT * 1.5 + 30 and out["latest"] == 1
    mgr = nostall.CheckpointManager(root, read_only=True, storage_options=s3.storage_options)
    assert mgr.latest_step() == 1 and mgr.steps() == [1]
    w = torch.zeros(256, 256)
    mgr.load({"w": w, "b": torch.zeros(8), "meta": None})
    assert torch.equal(w, _expected_full(1, 2))
    fs = s3.filesystem()
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/run/step_2/manifest.json")
    mgr.close()


def test_resaving_a_step_keeps_the_old_one_valid_until_the_new_commit(s3, tmp_path):
    bucket = s3.make_bucket("resave")
    root = f"s3://{bucket}/run"
    mgr = nostall.CheckpointManager(root, async_save=True, storage_options=s3.storage_options, timeout=30,
                                    local_staging_dir=str(tmp_path))
    mgr.save(5, {"w": torch.full((1024,), 1.0)})
    mgr.finalize_pending_saves()
    # a failed re-save of step 5 leaves the first one intact
    mgr._faults.writer_fault = "enospc"
    mgr.save(5, {"w": torch.full((1024,), 2.0)})
    with pytest.raises(nostall.CheckpointSaveError, match="step 5"):
        mgr.finalize_pending_saves()
    w = torch.zeros(1024)
    mgr.load({"w": w}, 5)
    assert torch.equal(w, torch.full((1024,), 1.0))
    # a successful one replaces it; the older data file is removed after the commit
    mgr._faults.writer_fault = None
    mgr.save(5, {"w": torch.full((1024,), 3.0)})
    mgr.finalize_pending_saves()
    mgr.load({"w": w}, 5)
    assert torch.equal(w, torch.full((1024,), 3.0))
    fs = s3.filesystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/run/step_5", refresh=True))
    assert len(names) == 2 and names[0] == "manifest.json" and names[1].startswith("rank0."), names
    mgr.close()


class _UploadFaults:
    """A TCP proxy on 127.0.0.1 in front of the S3 server that fails chosen requests, by count.

    A request is recognised by its request line (``PUT /bucket/...rank0.<id>.safetensors``):
    ``fail(n)`` answers the next ``n`` matching requests with a connection reset (``failed``
    counts them); ``hang(True)`` holds every matching request from then on unanswered, as a
    stuck endpoint would, until ``hang(False)`` resets them. Other requests pass. Whatever
    the machine's speed, the faults hit exactly the requests they name: nothing is timed.
    """

    def __init__(self, upstream_port: int, match: "re.Pattern[bytes]") -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.match = match
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.failed = 0  # matching requests reset
        self.passed = 0  # matching requests forwarded
        self.held = 0  # matching requests held (hang)
        self.log: List[Tuple[str, bytes]] = []  # (verdict, request line) of every matching request
        self._fail_left = 0
        self._hang = False
        self._holding: List[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def storage_options(self) -> Dict[str, Any]:
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.url, "region_name": "us-east-1"},
                "config_kwargs": {"retries": {"max_attempts": 1}}}  # leave retrying to nostall (and s3fs)

    def fail(self, n: int) -> None:
        with self._lock:
            self._fail_left = n

    def hang(self, on: bool) -> None:
        with self._lock:
            self._hang = on
            if not on:
                for s in self._holding:
                    self._reset(s)
                self._holding.clear()

    @staticmethod
    def _reset(s: socket.socket) -> None:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _verdict(self, data: bytes) -> str:
        """What to do with a client chunk that may start a request: pass, fail or hang."""
        line = data.split(b"\r\n", 1)[0]
        if not self.match.match(line):
            return "pass"
        with self._lock:
            if self._fail_left > 0:
                self._fail_left -= 1
                self.failed += 1
                verdict = "fail"
            elif self._hang:
                self.held += 1
                verdict = "hang"
            else:
                self.passed += 1
                verdict = "pass"
            self.log.append((verdict, line))
            return verdict

    def _serve(self, client: socket.socket) -> None:
        up = None
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                verdict = self._verdict(data)
                if verdict == "fail":
                    self._reset(client)
                    break
                if verdict == "hang":
                    with self._lock:
                        if self._hang:
                            self._holding.append(client)
                            client = None  # hang(False) resets it
                            break
                    self._reset(client)
                    break
                if up is None:
                    up = socket.create_connection(self.upstream)
                    threading.Thread(target=self._back, args=(up, client), daemon=True).start()
                up.sendall(data)
        except OSError:
            pass
        finally:
            for s in (client, up):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass

    @staticmethod
    def _back(up: socket.socket, client: socket.socket) -> None:
        try:
            while True:
                data = up.recv(65536)
                if not data:
                    break
                client.sendall(data)
        except OSError:
            pass
        finally:
            for s in (up, client):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.hang(False)
        self.sock.close()


def test_transient_upload_failure_is_retried_and_a_lasting_one_fails_cleanly(s3, tmp_path):
    """The data file's upload fails 3 times in a row (connection reset), then the endpoint is back:
    the retries ride it out. Then the upload hangs for good: the writer abandons it at its deadline
    and reports it, nothing is committed. The faults are counted in requests, not timed."""
    bucket = s3.make_bucket("flaky")
    proxy = _UploadFaults(s3.port, re.compile(rb"^PUT /flaky/run/step_\d+/rank0\.[0-9a-f]+\.safetensors[? ]"))
    so = proxy.storage_options()
    root = f"s3://{bucket}/run"
    mgr = nostall.CheckpointManager(root, async_save=True, storage_options=so, timeout=30,
                                    local_staging_dir=str(tmp_path / "a"))
    try:
        mgr.save(1, {"w": torch.full((1 << 18,), 1.0)})
        mgr.finalize_pending_saves()
        assert (proxy.failed, proxy.passed) == (0, 1)  # the pattern names the data file's upload
        proxy.fail(3)
        mgr.save(2, {"w": torch.full((1 << 18,), 2.0)})
        mgr.finalize_pending_saves(timeout=90)
        assert (proxy.failed, proxy.passed) == (3, 2) and mgr.latest_step() == 2
    finally:
        mgr.close()
    # an upload that never ends: an error naming the step, the file and the abandoned upload; nothing
    # committed, the step before still latest
    mgr = nostall.CheckpointManager(root, async_save=True, storage_options=so, timeout=30,
                                    local_staging_dir=str(tmp_path / "b"))
    try:
        # first a save that succeeds, once: it warms the new writer up. Its deadline (30 s from when it
        # takes the job) covers setting up its object-storage client too, which a new writer, niced,
        # has been seen to take seconds for on a busy machine: only a hang runs past 30 s
        mgr.save(3, {"w": torch.full((1 << 18,), 3.0)})
        mgr.finalize_pending_saves(timeout=120)
        proxy.hang(True)
        mgr.save(4, {"w": torch.full((1 << 18,), 4.0)})
        # the writer abandons the stuck upload at its deadline and reports it. Waiting longer than
        # that makes its report, not the trainer's own bound on waiting for it (1.5 x the timeout from
        # the call: a niced writer on a busy machine can report later), what arrives, whatever the speed
        with pytest.raises(nostall.CheckpointSaveError, match=r"step 4.*rank0\..*safetensors.*abandoned"):
            mgr.finalize_pending_saves(timeout=120)
        step4 = [v for v, line in proxy.log if b"/step_4/" in line]
        assert step4 and set(step4) == {"hang"}  # its upload was held, and nothing of it got through
        proxy.hang(False)
        assert mgr.latest_step() == 3 and mgr.steps() == [1, 2, 3]
        w = torch.zeros(1 << 18)
        mgr.load({"w": w})
        assert torch.equal(w, torch.full((1 << 18,), 3.0))
    finally:
        mgr.close()
        proxy.close()


def test_large_file_goes_up_in_parallel_multipart_parts_with_progress(s3, tmp_path, monkeypatch, caplog):
    """A data file over two parts is uploaded multipart (S3's ETag says how many parts), logged, and loads."""
    from nostall.storage import objects

    monkeypatch.setattr(objects, "UPLOAD_PART_BYTES", 5 << 20)  # S3's smallest part
    monkeypatch.setattr(objects, "PROGRESS_EVERY_S", 0.0)
    bucket = s3.make_bucket("multipart")
    root = f"s3://{bucket}/run"
    w = torch.randn(3 << 20)  # 12 MiB: three parts
    mgr = nostall.CheckpointManager(root, fallback_sync=True, storage_options=s3.storage_options, timeout=60,
                                    local_staging_dir=str(tmp_path))
    with caplog.at_level("INFO", logger="nostall"):
        mgr.save(1, {"w": w})
    got = torch.zeros_like(w)
    mgr.load({"w": got})
    mgr.close()
    assert torch.equal(got, w)
    fs = s3.filesystem()
    data = [p for p in fs.ls(f"{bucket}/run/step_1", refresh=True) if p.rsplit("/", 1)[-1].startswith("rank0.")]
    etag = fs.info(data[0], refresh=True)["ETag"].strip('"')
    assert etag.endswith("-3"), etag  # a multipart upload's ETag is "<md5 of the part md5s>-<parts>"
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("uploading ")]
    assert progress and "of 13 MB" in progress[-1], progress


def test_a_commit_sweeps_what_crashed_saves_left_and_nothing_else(s3, tmp_path):
    bucket = s3.make_bucket("sweep")
    root = f"s3://{bucket}/run"
    fs = s3.filesystem()
    mgr = nostall.CheckpointManager(root, async_save=True, storage_options=s3.storage_options, timeout=30,
                                    local_staging_dir=str(tmp_path))
    mgr.save(1, {"w": torch.full((1024,), 1.0)})
    mgr.finalize_pending_saves()
    # what a job killed mid-save leaves: data without a manifest, and its records
    fs.pipe_file(f"{bucket}/run/step_7/rank0.0123456789abcdef.safetensors", b"x" * 100)
    fs.pipe_file(f"{bucket}/run/.tmp/commit-0123456789abcdef0123456789abcdef/rank0.json", b"{}")
    mgr.save(2, {"w": torch.full((1024,), 2.0)})
    mgr.finalize_pending_saves()
    assert mgr.steps() == [1, 2]
    top = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/run", refresh=True))
    assert top == [".tmp", "latest", "step_1", "step_2"], top
    records = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/run/.tmp", refresh=True)]
    assert len(records) == 1 and records[0].startswith("commit-"), records  # only the last save's
    for step in (1, 2):
        w = torch.zeros(1024)
        mgr.load({"w": w}, step)
        assert torch.equal(w, torch.full((1024,), float(step)))
    mgr.close()
