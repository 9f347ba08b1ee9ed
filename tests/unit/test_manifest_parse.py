"""The manifest parser's field checks, one wrong field at a time: each refused as a damaged checkpoint naming
the key and the field; a valid manifest parses to the record it was written from, with one tuple per distinct
shape or offset (a manifest of millions of pieces repeats a few)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import nostall
from nostall.core.format import Manifest


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("parse") / "ckpt"
    nostall.save({"a": torch.zeros(4, 3), "b": torch.ones(4, 3), "n": torch.arange(5)}, str(path))
    return json.loads((path / "manifest.json").read_bytes())


def _parse(doc):
    return Manifest.from_json_bytes(json.dumps(doc).encode(), "ckpt")


def test_valid_manifest_round_trips_and_shares_equal_shapes(doc):
    m = _parse(doc)
    assert Manifest.from_json_bytes(m.to_json_bytes(), "again") == m
    a, b = m.tensors["a"], m.tensors["b"]
    assert a.shape == (4, 3) and a.shape is b.shape  # one tuple per distinct value
    assert a.pieces[0].shape is b.pieces[0].shape and a.pieces[0].offset is b.pieces[0].offset
    assert [p.nbytes for p in a.pieces] == [48]


@pytest.mark.parametrize("field, value, words", [
    ("shape", [4, True], "'a: shape' must be an integer, not a boolean"),
    ("offset", [0, 1.5], "'a: offset' must be an integer, not a number"),
    ("offset", "0,0", "'a: offset' must be a JSON array, not a string"),
    ("byte_range", [0, 8, 16], "byte_range must hold 2 integers, not 3"),
    ("byte_range", [0, "48"], "'a: byte_range' must be an integer, not a string"),
    ("byte_range", None, "'a: byte_range' must be a JSON array, not null"),
    ("crc32c", [None], "'a: crc32c' must be an integer, not null"),
    ("file", 3, "file must be a string, not an integer"),
    ("xxh3_128", "XYZ", "xxh3_128 must be 32 lowercase hex digits"),
])
def test_a_wrong_piece_field_is_refused_naming_key_and_field(doc, field, value, words):
    bad = copy.deepcopy(doc)
    bad["tensors"]["a"]["pieces"][0][field] = value
    with pytest.raises(nostall.CheckpointCorruptError, match="malformed manifest") as e:
        _parse(bad)
    assert words in str(e.value) and "ckpt" in str(e.value)


def test_a_piece_that_is_not_an_object_and_a_bad_tensor_shape_are_refused(doc):
    bad = copy.deepcopy(doc)
    bad["tensors"]["a"]["pieces"][0] = [1, 2]
    with pytest.raises(nostall.CheckpointCorruptError, match="'a: piece' must be a JSON object, not an array"):
        _parse(bad)
    bad = copy.deepcopy(doc)
    bad["tensors"]["n"]["shape"] = [-1]
    with pytest.raises(nostall.CheckpointCorruptError, match="negative dimension"):
        _parse(bad)
    bad = copy.deepcopy(doc)
    bad["tensors"]["n"]["pieces"][0]["shape"] = [6]
    with pytest.raises(nostall.CheckpointCorruptError, match="outside"):
        _parse(bad)
