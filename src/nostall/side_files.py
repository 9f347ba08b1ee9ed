"""Side files: small files committed with a checkpoint (a model config, tokenizer files, any bytes or JSON).

They land at ``<checkpoint>/<name>`` in the same commit as the tensors (so a
``huggingface/`` folder is there exactly when the checkpoint is), are listed
in the manifest with their size and checksum (docs/format.md), are checked by
``nostall verify``, listed by ``nostall inspect`` and carried by ``nostall
convert --to safetensors``.

Rank 0's files are saved; the other ranks' ``files=`` are ignored. This
module does not import torch (the writer process writes them).

Example::

    >>> from nostall.side_files import collect
    >>> [(n, len(b)) for n, b in collect({"huggingface/config.json": {"model_type": "gpt2"}, "note.txt": "hi"})]
    [('huggingface/config.json', 27), ('note.txt', 2)]
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Dict, Iterable, Mapping, Tuple

from . import storage
from .errors import InvalidStateError
from .format import MAX_SIDE_FILE_BYTES, SideFileRecord, crc, side_file_problem

__all__ = ["SideFiles", "collect", "records", "write"]

SideFiles = Tuple[Tuple[str, bytes], ...]
"""(name, bytes) of each side file, by name."""


def collect(files: Mapping[str, Any], reserved: Iterable[str] = ()) -> SideFiles:
    """The side files ``files`` describes: name -> bytes, str (UTF-8), a JSON value (dict or list,
    written indented), or a path: a file's bytes, or every regular file under a directory, named
    ``<name>/<its relative path>`` (hidden entries, ``.name``, are left out; symbolic links are
    refused, not followed). A name given twice (by a key and by a directory) is refused.

    Raises :class:`~nostall.InvalidStateError` naming the file for a bad name, a value of another
    type, a file too large (over 64 MiB) or a name in ``reserved`` (the data files' names).
    """
    if not isinstance(files, Mapping):
        raise InvalidStateError(f"files= must be a dict of name -> bytes, str, JSON value or path, got "
                                f"{type(files).__name__}")
    out: Dict[str, bytes] = {}
    origin: Dict[str, str] = {}  # name -> the key of files= it came from

    def put(rel: str, data: bytes, key: str) -> None:
        if rel in out:
            raise InvalidStateError(f"side file {rel!r} is given twice: by {origin[rel]!r} and by {key!r}")
        out[rel], origin[rel] = data, key

    for name, value in files.items():
        if isinstance(value, os.PathLike):
            for rel, data in _from_path(str(name), os.fspath(value)):
                put(rel, data, str(name))
            continue
        if isinstance(value, (bytes, bytearray, memoryview)):
            data = bytes(value)
        elif isinstance(value, str):
            data = value.encode()
        elif isinstance(value, (dict, list)):
            try:
                data = (json.dumps(value, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
            except (TypeError, ValueError) as e:
                raise InvalidStateError(f"side file {name!r}: not a JSON value ({e})") from None
        else:
            raise InvalidStateError(f"side file {name!r}: a {type(value).__name__}; give bytes, str, a JSON dict or "
                                    "list, or a pathlib.Path of a file or directory")
        put(str(name), data, str(name))
    reserved = set(reserved)
    for name, data in out.items():
        problem = side_file_problem(name) or ("it is a data file's name" if name in reserved else None)
        if problem:
            raise InvalidStateError(f"side file {name!r}: invalid name ({problem})")
        if len(data) > MAX_SIDE_FILE_BYTES:
            raise InvalidStateError(f"side file {name!r}: {len(data)} bytes, more than the {MAX_SIDE_FILE_BYTES} a "
                                    "side file may hold; save large data as tensors")
    names = sorted(out)
    for a, b in zip(names, names[1:]):
        if b.startswith(a + "/"):
            raise InvalidStateError(f"side files {a!r} and {b!r}: one would be a file and a directory at once")
    return tuple((n, out[n]) for n in names)


def _from_path(name: str, path: str) -> Iterable[Tuple[str, bytes]]:
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise InvalidStateError(f"side file {name!r}: {path} is a symbolic link; give the file it points to")
    if stat.S_ISREG(mode):
        yield name, storage.read_small_file(path, MAX_SIDE_FILE_BYTES)
        return
    if not stat.S_ISDIR(mode):
        raise InvalidStateError(f"side file {name!r}: {path} is neither a regular file nor a directory")
    for entry in sorted(os.listdir(path)):
        if entry.startswith("."):  # .gitattributes, .cache/: not the directory's content
            continue
        yield from _from_path(f"{name}/{entry}", os.path.join(path, entry))


def records(files: SideFiles) -> Dict[str, SideFileRecord]:
    """The manifest's records of ``files`` (size and crc32c)."""
    return {n: SideFileRecord(n, len(b), crc(b)) for n, b in files}


def write(directory: str, files: SideFiles) -> None:
    """Write ``files`` under ``directory`` (a save's staging), each fsynced, then the directories made."""
    made = set()
    for name, data in files:
        path = os.path.join(directory, *name.split("/"))
        parent = os.path.dirname(path)
        if parent != directory and parent not in made:
            os.makedirs(parent, exist_ok=True)
            d = parent
            while d != directory and d not in made:  # each new directory's own entry must be durable too
                made.add(d)
                d = os.path.dirname(d)
        storage.write_file(path, [memoryview(data)])
    for d in sorted(made, key=len, reverse=True):  # deepest first, then the staging itself is fsynced on publish
        storage.fsync_dir(d)
