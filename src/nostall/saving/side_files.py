"""Side files: small files committed with a checkpoint (a model config, tokenizer files, any bytes or JSON).

They land at ``<checkpoint>/<name>`` in the same commit as the tensors (so a
``huggingface/`` folder is there exactly when the checkpoint is), are listed
in the manifest with their size and checksum (docs/format.md), are checked by
``nostall verify``, listed by ``nostall inspect`` and carried by ``nostall
convert --to safetensors``.

Rank 0's files are saved; the other ranks' ``files=`` are ignored. This
module does not import torch (the writer process writes them).

Example::

    >>> from nostall.saving.side_files import collect
    >>> [(n, len(b)) for n, b in collect({"huggingface/config.json": {"model_type": "gpt2"}, "note.txt": "hi"})]
    [('huggingface/config.json', 27), ('note.txt', 2)]
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Mapping, Set, Tuple, Union

from nostall.storage import files as storage
from nostall.errors import InvalidStateError
from nostall.core.format import MAX_SIDE_FILE_BYTES, SideFileRecord, crc, side_file_problem

__all__ = ["MAX_SIDE_FILES_TOTAL_BYTES", "SideFiles", "collect", "records", "write"]

MAX_SIDE_FILES_TOTAL_BYTES = 128 << 20
"""Most bytes all of one save's side files may hold together (a writer's limit: readers check each
file against :data:`~nostall.core.format.MAX_SIDE_FILE_BYTES` only).

They are held whole in the trainer's memory and, for an async save, copied to
the writer process in the job's message: without a total, a directory of many
files each under the per-file cap would cost the trainer and the writer its
whole size in memory at every save. 128 MiB (twice the per-file cap) leaves
room for a model's configuration and a large tokenizer; larger data belongs
in tensors."""

SideFiles = Tuple[Tuple[str, bytes], ...]
"""(name, bytes) of each side file, by name."""


def collect(files: Mapping[str, Any], reserved: Iterable[str] = ()) -> SideFiles:
    """The side files ``files`` describes: name -> bytes, str (UTF-8), a JSON value (dict or list,
    written indented), or a path: a file's bytes, or every regular file under a directory, named
    ``<name>/<its relative path>`` (hidden entries, ``.name``, are left out; symbolic links are
    refused, not followed). A name given twice (by a key and by a directory) is refused.

    At most :data:`~nostall.core.format.MAX_SIDE_FILE_BYTES` (64 MiB) a file and
    :data:`MAX_SIDE_FILES_TOTAL_BYTES` (128 MiB) in all: they are
    held whole in memory (and copied to an async save's writer). Files given as
    paths are sized before any is read, so files over either bound are refused
    without being read.

    Raises :class:`~nostall.InvalidStateError` naming the file and its ``files=`` key for a bad
    name, a value of another type, a file too large, side files too large in all, a path that
    cannot be read, or a name in ``reserved`` (the data files' names).
    """
    if not isinstance(files, Mapping):
        raise InvalidStateError(f"files= must be a dict of name -> bytes, str, JSON value or path, got "
                                f"{type(files).__name__}")
    out: Dict[str, Union[bytes, _OnDisk]] = {}  # name -> its bytes, or the file to read them from
    origin: Dict[str, str] = {}  # name -> the key of files= it came from

    def put(rel: str, data: Union[bytes, _OnDisk], key: str) -> None:
        if rel in out:
            raise InvalidStateError(f"side file {rel!r} is given twice: by {origin[rel]!r} and by {key!r}")
        out[rel], origin[rel] = data, key

    for name, value in files.items():
        if isinstance(value, os.PathLike):
            for rel, found in _from_path(str(name), os.fspath(value), str(name)):
                put(rel, found, str(name))
            continue
        put(str(name), _encode(str(name), value), str(name))
    _check_each(out, origin, set(reserved))
    names = sorted(out)
    _check_total({n: d.size if isinstance(d, _OnDisk) else len(d) for n, d in out.items()}, origin)
    read = {n: d.read(n, origin[n]) if isinstance(d, _OnDisk) else d for n, d in out.items()}
    _check_total({n: len(d) for n, d in read.items()}, origin)  # a file that grew while it was read
    return tuple((n, read[n]) for n in names)


def _encode(name: str, value: Any) -> bytes:
    """The bytes of a side file given by value: bytes as they are, str as UTF-8, a dict or list as
    indented JSON (sorted keys, so that equal values give equal files)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (dict, list)):
        try:
            return (json.dumps(value, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
        except (TypeError, ValueError, RecursionError) as e:
            raise InvalidStateError(f"side file {name!r}: not a JSON value ({type(e).__name__}: {e})") from None
    raise InvalidStateError(f"side file {name!r}: a {type(value).__name__}; give bytes, str, a JSON dict or "
                            "list, or a pathlib.Path of a file or directory")


def _check_each(out: Mapping[str, Union[bytes, _OnDisk]], origin: Mapping[str, str], reserved: Set[str]) -> None:
    """Every name valid and not a data file's, every file within the per-file cap, no name both a
    file and a directory; before any file given as a path is read."""
    for name, item in out.items():
        problem = side_file_problem(name) or ("it is a data file's name" if name in reserved else None)
        if problem:
            raise InvalidStateError(f"side file {name!r}: invalid name ({problem})")
        size = item.size if isinstance(item, _OnDisk) else len(item)
        if size > MAX_SIDE_FILE_BYTES:
            raise _too_large(name, origin[name], size, item)
    names = sorted(out)
    for a, b in zip(names, names[1:]):
        if b.startswith(a + "/"):
            raise InvalidStateError(f"side files {a!r} and {b!r}: one would be a file and a directory at once")


@dataclass(frozen=True)
class _OnDisk:
    """A side file given as a path: sized when found, read once every bound is checked."""

    path: str
    size: int

    def read(self, name: str, key: str) -> bytes:
        try:
            return storage.read_small_file(self.path, MAX_SIDE_FILE_BYTES)
        except OSError as e:
            if e.errno == errno.EFBIG:  # it grew past the cap since it was sized
                raise _too_large(name, key, MAX_SIDE_FILE_BYTES + 1, self) from None
            raise _unreadable(name, key, self.path, e) from None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _too_large(name: str, key: str, size: int, data: Union[bytes, _OnDisk]) -> InvalidStateError:
    src = f", from {data.path}" if isinstance(data, _OnDisk) else ""
    return InvalidStateError(
        f"side file {name!r} (files= key {key!r}{src}): {size} bytes, more than the {MAX_SIDE_FILE_BYTES} bytes "
        f"({_mib(MAX_SIDE_FILE_BYTES)}) a side file may hold (nostall.core.format.MAX_SIDE_FILE_BYTES); side files are "
        "held whole in memory: save large data as tensors (in the state, or extra=), or leave it out of files="
    )


def _unreadable(name: str, key: str, path: str, e: OSError) -> InvalidStateError:
    return InvalidStateError(
        f"side file {name!r} (files= key {key!r}): cannot read {path}: {e.strerror or e}; give an existing regular "
        "file or directory that this process may read"
    )


def _check_total(sizes: Mapping[str, int], origin: Mapping[str, str]) -> None:
    """Refuse side files larger in all than MAX_SIDE_FILES_TOTAL_BYTES, naming each files= key's share."""
    total = sum(sizes.values())
    if total <= MAX_SIDE_FILES_TOTAL_BYTES:
        return
    per_key: Dict[str, Tuple[int, int]] = {}  # key -> (bytes, files)
    for name, size in sizes.items():
        b, n = per_key.get(origin[name], (0, 0))
        per_key[origin[name]] = (b + size, n + 1)
    shares = ", ".join(f"{k!r}: {b} bytes" + (f" ({n} files)" if n > 1 else "")
                       for k, (b, n) in sorted(per_key.items(), key=lambda kv: (-kv[1][0], kv[0])))
    raise InvalidStateError(
        f"side files (files=) hold {total} bytes ({_mib(total)}) in all, more than the {MAX_SIDE_FILES_TOTAL_BYTES} "
        f"bytes ({_mib(MAX_SIDE_FILES_TOTAL_BYTES)}) one save's side files may hold "
        f"(nostall.saving.side_files.MAX_SIDE_FILES_TOTAL_BYTES); by files= key: {shares}. Side files are held "
        "whole in memory (and copied to an async save's writer): save large data as tensors (in the state, or "
        "extra=), or leave it out of files="
    )


def _from_path(name: str, path: str, key: str) -> Iterable[Tuple[str, _OnDisk]]:
    """The regular files at ``path`` (a file, or every one under a directory), sized, not read."""
    try:
        st = os.lstat(path)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise _unreadable(name, key, path, e if isinstance(e, OSError) else OSError(str(e))) from None
    where = f"side file {name!r} (files= key {key!r})"
    if stat.S_ISLNK(st.st_mode):
        raise InvalidStateError(f"{where}: {path} is a symbolic link; give the file it points to")
    if stat.S_ISREG(st.st_mode):
        yield name, _OnDisk(path, st.st_size)
        return
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidStateError(f"{where}: {path} is neither a regular file nor a directory")
    if name.count("/") >= 7:  # its files' names would have more than 8 components: stop walking here
        raise InvalidStateError(f"{where}: the files under {path} would have names of more than 8 components; "
                                "give a shallower directory")
    try:
        entries = sorted(os.listdir(path))
    except OSError as e:
        raise _unreadable(name, key, path, e) from None
    for entry in entries:
        if entry.startswith("."):  # .gitattributes, .cache/: not the directory's content
            continue
        yield from _from_path(f"{name}/{entry}", os.path.join(path, entry), key)


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
