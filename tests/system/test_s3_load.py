"""Loading from object storage: a real S3-compatible server on 127.0.0.1, s3fs over HTTP.

A checkpoint saved locally is copied into a bucket; ranks then load it from
``s3://`` with resharding, fetching only the byte ranges they need, with the
same checksum verification as local loads.
"""

from __future__ import annotations

import pytest

pytest.importorskip("s3fs", reason="object-storage tests need s3fs (pip install 'nostall[s3]')")
pytest.importorskip("moto", reason="object-storage tests need moto[server]")

import torch  # noqa: E402

import nostall  # noqa: E402


def _full():
    return torch.arange(64 * 1024, dtype=torch.float32).reshape(256, 256)


@pytest.fixture(scope="module")
def uploaded(s3, tmp_path_factory):
    """A 2-rank-style checkpoint (two row shards, small checksum blocks) copied into s3://ckpts/run/step_7."""
    local = tmp_path_factory.mktemp("s3src") / "step_7"
    nostall.save({"w": _full(), "meta": {"step": 7}}, str(local), block_size=4096)
    s3.make_bucket("ckpts")
    fs = s3.filesystem()
    for f in sorted(local.iterdir(), key=lambda p: p.name == "manifest.json"):  # manifest last
        fs.put_file(str(f), f"ckpts/run/step_7/{f.name}")
    return "s3://ckpts/run/step_7"


def test_load_from_s3_reads_only_the_needed_ranges(s3, uploaded, monkeypatch):
    from nostall.loading.sources import DataFiles

    fetched = []
    real = DataFiles.read

    def counting(self, name, offset, length, into=None):
        fetched.append(length)
        return real(self, name, offset, length, into)

    monkeypatch.setattr(DataFiles, "read", counting)
    part = nostall.ShardedTensor(torch.zeros(16, 256), (256, 256), (100, 0))  # 16 rows = 16 KiB
    got = nostall.load({"w": part, "meta": None}, uploaded, storage_options=s3.storage_options)
    assert torch.equal(part.data, _full()[100:116]) and got["meta"] == {"step": 7}
    assert 16 * 1024 <= sum(fetched) <= 16 * 1024 + 2 * 4096  # block-aligned, not the whole 256 KiB
    whole = torch.zeros(256, 256)
    nostall.load({"w": whole, "meta": None}, uploaded, storage_options=s3.storage_options)
    assert torch.equal(whole, _full())


def test_s3_corruption_is_detected(s3, uploaded, tmp_path):
    fs = s3.filesystem()
    key = "ckpts/run/step_7/rank0.safetensors"
    good = fs.cat_file(key)
    bad = bytearray(good)
    bad[-100] ^= 0xFF
    fs.pipe_file(key, bytes(bad))
    try:
        with pytest.raises(nostall.CheckpointCorruptError, match="checksum mismatch"):
            nostall.load({"w": torch.zeros(256, 256), "meta": None}, uploaded, storage_options=s3.storage_options)
        from nostall.loading.verify import check_checkpoint

        report = check_checkpoint(uploaded, s3.storage_options)
        assert len(report.problems) == 1 and "s3://ckpts/run/step_7/rank0.safetensors" in report.problems[0]
        fs.pipe_file(key, bytes(good[:-10]))  # truncated
        with pytest.raises(nostall.CheckpointCorruptError, match="truncated"):
            nostall.load({"w": torch.zeros(256, 256), "meta": None}, uploaded, storage_options=s3.storage_options)
    finally:
        fs.pipe_file(key, good)


def test_s3_missing_checkpoint_is_not_found(s3, uploaded):
    with pytest.raises(nostall.CheckpointNotFoundError, match="not a committed checkpoint"):
        nostall.load({"w": torch.zeros(1)}, "s3://ckpts/run/step_99", storage_options=s3.storage_options)


def _rank_load(rank, world_size, url, storage_options):
    import torch

    import nostall

    rows = 256 // world_size
    t = nostall.ShardedTensor(torch.zeros(rows, 256), (256, 256), (rank * rows, 0))
    nostall.load({"w": t, "meta": None}, url, storage_options=storage_options)
    full = torch.arange(64 * 1024, dtype=torch.float32).reshape(256, 256)
    return torch.equal(t.data, full[rank * rows : (rank + 1) * rows])


def test_two_ranks_load_their_shards_from_s3(pool2, s3, uploaded):
    assert pool2.run(_rank_load, uploaded, s3.storage_options) == [True, True]


def test_cli_inspect_and_verify_an_s3_checkpoint(s3, uploaded, capsys):
    import json

    from nostall.tools.cli import main as cli_main

    so = json.dumps(s3.storage_options)
    assert cli_main(["verify", uploaded, "--storage-options", so]) == 0
    assert "OK  s3://ckpts/run/step_7" in capsys.readouterr().out
    # a run root resolves to its newest checkpoint
    assert cli_main(["inspect", "--json", "s3://ckpts/run", "--storage-options", so]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == uploaded and [t["key"] for t in doc["tensors"]] == ["w"]
