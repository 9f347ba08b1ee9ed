"""DataFiles serves the byte ranges it holds (:meth:`~nostall.loading.sources.DataFiles.keep`, what a read-once
load received from another rank or read here to send) and reads the rest from storage: reads spanning a held
range's end, adjacent held ranges, reads not held at all, and many ranges kept out of order."""

import os
import random
from typing import List, Tuple

import pytest
import torch

import nostall
from nostall.loading import sources
from nostall.loading.manifests import read_manifest

SIZE = 4096


@pytest.fixture
def held(tmp_path):
    """(files, name, stored bytes of the file): a one-file checkpoint of SIZE bytes of data, opened."""
    path = str(tmp_path / "c")
    nostall.save({"w": (torch.arange(SIZE) % 251).to(torch.uint8)}, path, block_size=256)
    m = read_manifest(path)
    name = m.tensors["w"].pieces[0].file
    with open(os.path.join(path, name), "rb") as f:
        stored = f.read()
    files = sources.open_files(path, m)
    yield files, name, stored
    files.close()


def mark(n: int, seed: int) -> bytes:
    """``n`` bytes unlike the stored ones (the stored bytes are < 251 in the data, these are >= 251)."""
    return bytes(251 + (seed + i) % 5 for i in range(n))


def keep(files: sources.DataFiles, name: str, start: int, data: bytes) -> None:
    files.keep(name, start, memoryview(bytearray(data)), received=True)


def expected(stored: bytes, kept: List[Tuple[int, bytes]], offset: int, length: int) -> bytes:
    """What a read of ``[offset, offset + length)`` returns: each byte from the held range that covers it
    (ranges disjoint), else the stored byte."""
    out = bytearray(stored[offset:offset + length])
    for s, data in kept:
        for i in range(max(s, offset), min(s + len(data), offset + length)):
            out[i - offset] = data[i - s]
    return bytes(out)


def test_a_read_spanning_a_held_ranges_end_takes_the_rest_from_storage(held):
    files, name, stored = held
    start = len(stored) - SIZE  # the data's first byte
    kept = [(start + 100, mark(200, 0))]
    keep(files, name, *kept[0])
    got = bytes(files.read(name, start + 250, 100))  # 50 held, 50 from storage
    assert got == expected(stored, kept, start + 250, 100)
    assert got[:50] == kept[0][1][150:] and got[50:] == stored[start + 300:start + 350]
    assert (files.bytes_read, files.bytes_received) == (50, 200)


def test_a_read_starting_before_a_held_range_and_one_inside_it(held):
    files, name, stored = held
    start = len(stored) - SIZE
    kept = [(start + 100, mark(200, 1))]
    keep(files, name, *kept[0])
    assert bytes(files.read(name, start + 60, 100)) == expected(stored, kept, start + 60, 100)
    assert files.bytes_read == 40
    assert bytes(files.read(name, start + 120, 30)) == kept[0][1][20:50]  # wholly held: nothing read
    assert files.bytes_read == 40


def test_adjacent_held_ranges_serve_a_read_over_both_without_storage(held):
    files, name, stored = held
    start = len(stored) - SIZE
    kept = [(start + 300, mark(100, 2)), (start + 200, mark(100, 3))]  # kept out of order, [200, 300) [300, 400)
    for s, d in kept:
        keep(files, name, s, d)
    into = memoryview(bytearray(150))
    got = files.read(name, start + 225, 150, into=into)
    assert got.obj is into.obj  # into the caller's buffer
    assert bytes(into) == kept[1][1][25:] + kept[0][1][:75]
    assert files.bytes_read == 0


def test_a_read_not_held_goes_to_storage(held):
    files, name, stored = held
    start = len(stored) - SIZE
    keep(files, name, start + 1000, mark(100, 4))
    assert bytes(files.read(name, start + 10, 500)) == stored[start + 10:start + 510]  # before the held range
    assert bytes(files.read(name, start + 1100, 64)) == stored[start + 1100:start + 1164]  # from its end on
    assert files.bytes_read == 564
    files.close()  # the held bytes go with the files: the same read now comes from storage
    assert bytes(files.read(name, start + 1000, 100)) == stored[start + 1000:start + 1100]
    assert files.bytes_read == 664


def test_many_held_ranges_kept_in_any_order_each_read_matches(held):
    files, name, stored = held
    start = len(stored) - SIZE
    rng = random.Random(5)
    cuts = sorted(rng.sample(range(1, SIZE), 600))
    spans = list(zip([0] + cuts, cuts + [SIZE]))
    kept = [(start + s, mark(e - s, i)) for i, (s, e) in enumerate(spans) if rng.random() < 0.6]
    for s, d in rng.sample(kept, len(kept)):
        keep(files, name, s, d)
    held_bytes = sum(len(d) for _, d in kept)
    assert files.bytes_received == held_bytes
    for _ in range(300):
        lo = rng.randrange(0, SIZE)
        n = rng.randrange(1, SIZE - lo + 1)
        before = files.bytes_read
        got = bytes(files.read(name, start + lo, n))
        assert got == expected(stored, kept, start + lo, n)
        covered = sum(max(0, min(s + len(d), start + lo + n) - max(s, start + lo)) for s, d in kept)
        assert files.bytes_read - before == n - covered  # storage reads only the bytes not held
    whole = bytes(files.read(name, start, SIZE))
    assert whole == expected(stored, kept, start, SIZE)
