"""Fuzzing the parsers a hostile checkpoint reaches: the manifest and the safetensors header.

Bounded (a few hundred examples each, derandomized so CI is repeatable);
``NOSTALL_FUZZ_EXAMPLES=20000`` runs longer. Every input must either parse,
or raise a nostall error; loading a checkpoint whose manifest was mutated must
either load or raise a nostall error: never another exception, a hang or
an unbounded allocation.
"""

from __future__ import annotations

import copy
import json
import os
import resource

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import torch  # noqa: E402

import nostall  # noqa: E402
from nostall.core.format import Manifest, parse_file_header  # noqa: E402

N = int(os.environ.get("NOSTALL_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=N, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(st.binary(max_size=400))
def test_header_reader_random_bytes(raw):
    try:
        header, start = parse_file_header(raw, "f")
    except nostall.CheckpointCorruptError:
        return
    assert isinstance(header, dict) and 8 <= start <= len(raw)


@FUZZ
@given(st.integers(0, 2**64 - 1), st.binary(max_size=64))
def test_header_reader_declared_lengths(n, rest):
    raw = n.to_bytes(8, "little") + rest
    try:
        parse_file_header(raw, "f")
    except nostall.CheckpointCorruptError:
        pass


@FUZZ
@given(st.binary(max_size=600) | st.text(max_size=300).map(str.encode))
def test_manifest_parser_random_bytes(raw):
    try:
        Manifest.from_json_bytes(raw, "m")
    except nostall.CheckpointCorruptError:
        pass


def test_manifest_parser_deep_nesting():
    for raw in (b"[" * 100_000, b'{"a":' * 100_000):
        with pytest.raises(nostall.CheckpointCorruptError):
            Manifest.from_json_bytes(raw, "m")
        with pytest.raises(nostall.CheckpointCorruptError):
            parse_file_header(len(raw).to_bytes(8, "little") + raw, "f")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    state = {
        "w": torch.arange(64, dtype=torch.float32).reshape(8, 8),
        "opt": {"m": torch.arange(5, dtype=torch.int64), "lr": 0.1},
        "rng": nostall.PerRank(torch.arange(4, dtype=torch.uint8)),
    }
    nostall.save(state, str(path))
    return path, json.loads((path / "manifest.json").read_text())


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _template():
    return {"w": torch.zeros(8, 8), "opt": {"m": torch.zeros(5, dtype=torch.int64), "lr": None},
            "rng": nostall.PerRank(torch.zeros(4, dtype=torch.uint8))}


@FUZZ
@given(data=st.data())
def test_mutated_manifest_loads_or_raises_a_nostall_error(saved, data):
    path, doc = saved
    paths = [p for p in _paths(doc) if p]
    mutated = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(paths))
        parent = mutated
        try:
            for k in where[:-1]:
                parent = parent[k]
            kind = data.draw(st.sampled_from(["replace", "delete", "number"]))
            if kind == "delete" and isinstance(parent, dict):
                parent.pop(where[-1], None)
            elif kind == "number":
                parent[where[-1]] = data.draw(st.sampled_from([-1, 0, 1, 7, 2**31, 2**62, 2**64, 1e300]))
            else:
                parent[where[-1]] = data.draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced this path
    (path / "manifest.json").write_text(json.dumps(mutated))
    limit = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, limit[1]))  # a huge allocation fails, not swaps
    try:
        nostall.load(_template(), str(path))
    except nostall.CheckpointError:
        pass
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)
        (path / "manifest.json").write_text(json.dumps(doc))
