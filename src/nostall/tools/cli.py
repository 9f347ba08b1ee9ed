"""Command line: ``nostall inspect|verify|ls|copy|convert|bench``.

``inspect PATH`` shows what a checkpoint holds, ``verify PATH`` re-reads every
byte, ``ls ROOT`` lists a run root's committed steps, ``copy SRC DST`` makes a
self-contained copy of one checkpoint (an incremental one's references
resolved), ``convert SRC DST`` imports DCP checkpoints and exports
safetensors / torch.save files, ``bench`` compares against DCP. ``--json``
gives machine-readable output. A path may also be a run root's ``latest``
file: the checkpoint it names.

Errors are one line on stderr (``nostall CMD: FAILED: ...``) and exit status 1;
usage errors exit 2; ``NOSTALL_DEBUG=1`` adds the traceback. A damaged
checkpoint also gives exit status 1 where the command finds it: ``verify``
(any byte), ``inspect`` (a file of an earlier checkpoint that an incremental
one reads is missing or of another size: checked with a stat, no data read),
``ls`` (a listed checkpoint is unreadable or, as ``inspect`` checks, broken;
the others are still listed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from nostall import __version__
from nostall.storage.locate import local_path, open_root, resolve, split_checkpoint
from nostall.storage.root import LATEST, Root, step_name
from nostall.errors import CheckpointError, CheckpointNotFoundError
from nostall.core.format import Manifest
from nostall.tools.argtypes import parse_size, storage_options_arg

# torch is imported only by the commands that need it (convert, bench), not here: `nostall --version`,
# `ls`, `inspect`, `verify` and `copy` run without it (tests/dist/test_cli_torch_free.py)


def _latest_file_root(path: str, so: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """The run root when ``path`` is that root's ``latest`` pointer (a file), else None."""
    root, name = split_checkpoint(path, so)
    if name != LATEST or root.url.endswith(":"):  # ("s3://latest" is in no root)
        return None
    return root.url if root.is_file(name) else None


def _resolve(path: str, so: Optional[Dict[str, Any]] = None) -> str:
    """A checkpoint directory (or URL), a manager root, or a root's ``latest`` file: then the
    checkpoint its ``load()`` would use."""
    try:
        root, name, _ = resolve(_latest_file_root(path, so) or path, storage_options=so)
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(_why_not_found(path, so, e)) from e
    return root.path(name)


def _why_not_found(path: str, so: Optional[Dict[str, Any]], err: CheckpointNotFoundError) -> str:
    """Why ``path`` names no checkpoint: a step its run root does not hold (the steps it does hold
    listed), nothing there at all (as ``ls`` says), or else ``err``'s own reason."""
    try:
        parent, _ = split_checkpoint(path, so)
        steps, latest = parent.steps(), parent.latest_step()
    except Exception:  # only a better message is at stake
        steps, latest = [], None
    if steps:
        shown = ("..., " if len(steps) > 5 else "") + ", ".join(str(s) for s in steps[-5:])
        return (f"{path}: no committed checkpoint there; {parent.url} is a run root holding steps {shown} "
                f"(latest {latest}): pass {parent.path(step_name(steps[-1]))}, or the run root for its latest "
                f"('nostall ls {parent.url}' lists them)")
    try:
        open_root(path, storage_options=so).check_present()
    except CheckpointError as missing:  # nothing at all there: say so, as `ls` does
        return str(missing)
    except Exception:  # only a better message is at stake
        pass
    return str(err)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _read_from(m: Manifest) -> Dict[str, int]:
    """Tensor bytes read from each data file (own and referenced), each piece counted once (a tied key's
    pieces are its target's)."""
    seen = set()
    out = {n: 0 for n in m.all_files()}
    recs = list(m.tensors.values()) + [t for r in m.per_rank for t in r.tensors.values()]
    for t in recs:
        for p in t.pieces:
            if (p.file, p.start, p.end) not in seen:
                seen.add((p.file, p.start, p.end))
                out[p.file] = out.get(p.file, 0) + p.nbytes
    return out


def _summary(path: str, m: Manifest) -> Dict[str, Any]:
    read = _read_from(m)
    tensors = []
    for k, t in sorted(m.tensors.items()):
        # a tied key's bytes are its tie's (stored once): counted there only
        nbytes = 0 if t.tied_to else sum(p.nbytes for p in t.pieces)
        tensors.append({
            "key": k, "dtype": t.dtype, "shape": list(t.shape), "sharded": t.sharded,
            "pieces": [{"offset": list(p.offset), "shape": list(p.shape), "file": p.file,
                        "byte_range": [p.start, p.end]} for p in t.pieces],
            "bytes": nbytes, "tied_to": t.tied_to or None,
        })
    return {
        "path": path,
        "step": m.step,
        "format_version": m.version,
        "world_size": m.world_size,
        "files": [{"name": f.name, "rank": f.rank, "size": f.size, "tensor_bytes": read.get(f.name, 0)}
                  for f in sorted(m.files.values(), key=lambda f: f.name)],
        "total_bytes": sum(f.size for f in m.files.values()),
        # incremental checkpoints: what is read from data files of earlier checkpoints of the root
        "incremental": bool(m.references),
        "own_bytes": sum(b for n, b in read.items() if "/" not in n),
        "referenced_bytes": sum(b for n, b in read.items() if "/" in n),
        "references": [{"name": f.name, "checkpoint": f.name.split("/")[0], "rank": f.rank, "size": f.size,
                        "tensor_bytes": read.get(f.name, 0)}
                       for f in sorted(m.references.values(), key=lambda f: f.name)],
        "tensors": tensors,
        "objects": sorted(m.objects),
        "per_rank": [{"tensors": sorted(r.tensors), "objects": sorted(r.objects)} for r in m.per_rank],
        "side_files": [{"name": f.name, "size": f.size} for f in sorted(m.side_files.values(), key=lambda f: f.name)],
    }


def _print_summary(s: Dict[str, Any]) -> None:
    print(f"checkpoint  {s['path']}")
    if s["step"] is None:  # nostall.save and `nostall convert --from dcp` record no step
        print("step        none recorded (a one-shot save or an imported checkpoint)")
    else:
        print(f"step        {s['step']}")
    print(f"world size  {s['world_size']}  (format version {s['format_version']})")
    print(f"data        {len(s['files'])} file(s), {_human(s['total_bytes'])}")
    refs = s["references"]
    w = max([len(f["name"]) for f in s["files"] + refs] + [28])
    for f in s["files"]:
        own = f"  {_human(f['tensor_bytes'])} of tensor data" if refs else ""
        print(f"  {f['name']:<{w}} rank {f['rank']:<5} {_human(f['size']):>12}{own}")
    if refs:
        total = s["own_bytes"] + s["referenced_bytes"]
        share = 100.0 * s["referenced_bytes"] / total if total else 0.0
        print(f"incremental {_human(s['own_bytes'])} of tensor data in its own files, "
              f"{_human(s['referenced_bytes'])} ({share:.0f}%) read from {len(refs)} file(s) of earlier "
              f"checkpoint(s) ({', '.join(sorted({f['checkpoint'] for f in refs}))}):")
        for f in refs:
            print(f"  {f['name']:<{w}} rank {f['rank']:<5} {_human(f['size']):>12}  "
                  f"{_human(f['tensor_bytes'])} of tensor data read")
    print(f"tensors     {len(s['tensors'])}")
    w = max([len(t["key"]) for t in s["tensors"]] + [3])
    for t in s["tensors"]:
        kind = f"{len(t['pieces'])} piece(s)" if t["sharded"] else "replicated"
        size = f"tied to {t['tied_to']}" if t["tied_to"] else f"{_human(t['bytes']):>10}"
        print(f"  {t['key']:<{w}}  {t['dtype']:<5} {str(t['shape']):<20} {kind:<12} {size}")
    if s["objects"]:
        print(f"objects     {', '.join(s['objects'])}")
    pr = s["per_rank"]
    if pr and any(r["tensors"] or r["objects"] for r in pr):
        keys = sorted(set(pr[0]["tensors"]) | set(pr[0]["objects"]))
        print(f"per rank    {', '.join(keys)}  (x {len(pr)} ranks)")
    side = s["side_files"]
    if side:
        print(f"side files  {len(side)} file(s), {_human(sum(f['size'] for f in side))}")
        w = max(len(f["name"]) for f in side)
        for f in side:
            print(f"  {f['name']:<{w}}  {_human(f['size']):>10}")


def _options(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    return args.storage_options or None


def cmd_inspect(args: argparse.Namespace) -> int:
    from nostall.loading.manifests import read_manifest, referenced_file_problems

    so = _options(args)
    path = _resolve(args.path, so)
    m = read_manifest(path, so)
    s = _summary(path, m)
    # an incremental checkpoint is whole only with the files it reads from earlier ones: a stat each
    problems = referenced_file_problems(path, m, so)
    s.update(ok=not problems, problems=problems)
    if args.json:
        json.dump(s, sys.stdout, indent=1)
        print()
    else:
        _print_summary(s)
        if problems:
            print(f"BROKEN  {path}: {len(problems)} file(s) of earlier checkpoints that it reads are not there as "
                  "listed: it cannot be loaded", file=sys.stderr)
            for problem in problems:
                print(f"  - {problem}", file=sys.stderr)
    return 1 if problems else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from nostall.loading.manifests import read_manifest
    from nostall.loading.verify import check_checkpoint

    so = _options(args)
    path = _resolve(args.path, so)
    referenced = sorted(read_manifest(path, so).references)  # (check_checkpoint reads them, and raises the same)
    report = check_checkpoint(path, so)
    where = path
    if getattr(args, "json", False):
        json.dump({"path": where, "ok": report.ok, "files": report.files, "bytes": report.bytes,
                   "referenced": referenced, "problems": report.problems}, sys.stdout, indent=1)
        print()
        return 0 if report.ok else 1
    refs = (f" ({len(referenced)} of them of earlier checkpoints, read by this incremental one: "
            f"{', '.join(referenced)})") if referenced else ""
    if report.problems:
        print(f"FAILED  {where}: {len(report.problems)} problem(s) in {report.files} file(s){refs}", file=sys.stderr)
        for problem in report.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"OK  {where}: {report.files} file(s){refs}, {_human(report.bytes)} of tensor data, every checksum "
          "matches")
    return 0


# --------------------------------------------------------------------------- ls


def _entry(root: Root, name: str, step: Optional[int], so: Optional[Dict[str, Any]],
           latest: Optional[int]) -> Dict[str, Any]:
    from nostall.loading.manifests import read_manifest, referenced_file_problems

    path = root.path(name)
    e: Dict[str, Any] = {"step": step, "path": path, "latest": step is not None and step == latest}
    try:
        m = read_manifest(path, so)
        e.update(bytes=sum(f.size for f in m.files.values()), files=len(m.files), tensors=len(m.tensors),
                 world_size=m.world_size,
                 referenced_bytes=sum(b for n, b in _read_from(m).items() if "/" in n),
                 references=sorted({n.split("/")[0] for n in m.references}))
        problems = referenced_file_problems(path, m, so)  # a stat per referenced file, as inspect
        e.update(broken=bool(problems), problems=problems)
    except (CheckpointError, OSError) as err:
        e.update(bytes=None, files=None, tensors=None, world_size=None, referenced_bytes=None, references=None,
                 error=str(err), broken=True, problems=[str(err)])
    e["modified"] = root.committed_at(name)
    return e


def cmd_ls(args: argparse.Namespace) -> int:
    so = _options(args)
    where = _latest_file_root(args.root, so) or args.root
    root = open_root(where, storage_options=so)
    steps = root.steps()
    latest = root.latest_step()
    entries = [_entry(root, step_name(s), s, so, latest) for s in steps]
    if not steps:
        parent, name = split_checkpoint(where, so)
        if parent.is_checkpoint(name):  # a one-shot checkpoint directory: list it alone
            entries = [_entry(parent, name, None, so, None)]
        else:
            root.check_present()  # (object storage has no directories: nothing under it, or no bucket)
    out = {"root": root.url, "latest": latest,
           "checkpoints": entries}
    rc = 1 if any(e["broken"] for e in entries) else 0  # listed all the same
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return rc
    if not entries:
        print(f"{out['root']}: no committed checkpoint")
        return 0
    print(f"{out['root']}: {len(entries)} committed checkpoint(s)"
          + (f", latest step {latest}" if latest is not None else ""))
    # the manifest records no time: its file's modification time is the commit's (a copy that kept no
    # times shows the copy's; the directory's own time would change with any file added or removed)
    print(f"  {'checkpoint':<14} {'size':>11}  {'manifest mtime (UTC)':<20}  contents")
    for e in entries:
        size = _human(e["bytes"]) if e["bytes"] is not None else "?"
        name = f"step_{e['step']}" if e["step"] is not None else os.path.basename(e["path"].rstrip("/"))
        mark = "  <- latest" if e["latest"] else ""
        detail = (f"{e['tensors']} tensors, world size {e['world_size']}" if e.get("error") is None
                  else f"UNREADABLE: {e['error']}")
        if e.get("error") is None and e["broken"]:
            detail += f", BROKEN: {'; '.join(e['problems'])}"
        elif e.get("references"):
            detail += f", reads {_human(e['referenced_bytes'])} from {', '.join(e['references'])}"
        print(f"  {name:<14} {size:>11}  {e['modified'] or '?':<20}  {detail}{mark}")
    if rc:
        bad = sum(e["broken"] for e in entries)
        print(f"nostall ls: {bad} of {len(entries)} checkpoint(s) unreadable or broken (exit status 1)",
              file=sys.stderr)
    return rc


# --------------------------------------------------------------------------- convert


class _ProgressLine:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        frac = done / total if total else 1.0
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        sys.stderr.write(f"\r{self.label} [{bar}] {100 * frac:5.1f}%  {_human(done)} of {_human(total)}")
        sys.stderr.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _block_size_arg(text: str) -> int:
    """``--block-size``: a size (``65536``, ``64KiB``, ``4MiB``) that passes the one block-size
    rule, :func:`nostall.options.check_block_size`; anything else is a usage error (exit 2)."""
    from nostall.options import check_block_size

    try:
        return check_block_size(parse_size(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _keys(given: Optional[List[str]]) -> Optional[List[str]]:
    """``--keys a,b --keys c``: every comma-separated value of every use; None when not given."""
    keys = [k.strip() for v in given or [] for k in v.split(",") if k.strip()]
    return keys or None


def _with_progress(show: bool, label: str, fn: Callable[[Optional[_ProgressLine]], Any]) -> Any:
    """``fn(bar)``, with a progress line on stderr when ``show`` (else ``bar`` is None), closed however it ends."""
    bar = _ProgressLine(label) if show else None
    try:
        return fn(bar)
    finally:
        if bar is not None:
            bar.close()


def _temp_beside(dst: str, made: Any) -> str:
    """DCP -> nostall -> export: a temporary directory next to the destination (its missing parents are
    made, and recorded in ``made``) for the intermediate checkpoint."""
    parent = os.path.dirname(os.path.abspath(dst))
    made.makedirs(parent)
    return tempfile.mkdtemp(prefix=".nostall-convert-", dir=parent)


def _import_dcp(args: argparse.Namespace, out: str, show: bool) -> Dict[str, int]:
    """``convert --from dcp``: import SRC as a nostall checkpoint at ``out``; what it holds."""
    from nostall.interop.dcp import import_dcp

    unsupported = "skip" if args.skip_unsupported else "error"
    m = _with_progress(show, "import", lambda p: import_dcp(args.src, out, unsupported_objects=unsupported,
                                                             progress=p, block_size=args.block_size))
    return {"tensors": len(m.tensors), "objects": len(m.objects), "bytes": sum(f.size for f in m.files.values())}


def _export(args: argparse.Namespace, src: str, dst_kind: str, so: Optional[Dict[str, Any]], memory_limit: int,
            show: bool) -> Dict[str, Any]:
    """``convert --to safetensors|torch``: export the nostall checkpoint ``src`` to DST; the report."""
    from nostall.interop.export import export

    rep = _with_progress(show, "export", lambda p: export(
        src, args.dst, to=dst_kind, keys=_keys(args.keys), strip_prefix=args.strip_prefix, separator=args.separator,
        dtype=args.dtype, max_shard_size=parse_size(args.max_shard_size), memory_limit=memory_limit,
        overwrite=args.overwrite, storage_options=so, progress=p))
    return rep.to_json()


def _print_convert(args: argparse.Namespace, result: Dict[str, Any]) -> None:
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    elif "files" in result:
        print(f"wrote {len(result['files'])} file(s), {result['tensors']} tensor(s), {_human(result['bytes'])} "
              f"to {args.dst}")
    else:
        print(f"imported {result['tensors']} tensor(s) and {result['objects']} value(s) into {args.dst}")


def cmd_convert(args: argparse.Namespace) -> int:
    so = _options(args)
    src_kind = args.from_
    dst_kind = args.to or ("nostall" if src_kind == "dcp" else "safetensors")
    if src_kind == "nostall" and dst_kind == "nostall":
        raise CheckpointError("convert: --from nostall needs --to safetensors or --to torch")
    if src_kind == "dcp" and local_path(args.src) is None:
        raise CheckpointError("convert --from dcp reads a local DCP directory")
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    memory_limit = parse_size(args.memory_limit)
    result: Dict[str, Any] = {"src": args.src, "dst": args.dst, "from": src_kind, "to": dst_kind}
    tmp: Optional[str] = None
    made: Any = None  # the directories made for the temporary checkpoint: removed again on failure
    done = False
    try:
        src = args.src
        if src_kind == "dcp":
            out = args.dst
            if dst_kind != "nostall":  # DCP -> nostall (next to the destination) -> export
                from nostall.interop.export import CreatedFiles

                made = CreatedFiles()
                tmp = _temp_beside(args.dst, made)
                out = os.path.join(tmp, "ckpt")
            result.update(_import_dcp(args, out, show))
            src, so = out, None
        else:
            src = _resolve(src, so)
            result["src"] = src
        if dst_kind in ("safetensors", "torch"):
            result.update(_export(args, src, dst_kind, so, memory_limit, show))
        done = True
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if made is not None and not done:
            made.undo()
    _print_convert(args, result)
    return 0


# --------------------------------------------------------------------------- copy


def cmd_copy(args: argparse.Namespace) -> int:
    from nostall.interop.copy import copy_checkpoint

    so = _options(args)
    dso = args.dst_storage_options or so
    src = _resolve(args.src, so)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    rep = _with_progress(show, "copy", lambda bar: copy_checkpoint(
        src, args.dst, overwrite=args.overwrite, storage_options=so, dst_storage_options=dso, progress=bar))
    if args.json:
        json.dump(rep.to_json(), sys.stdout, indent=1)
        print()
        return 0
    print(f"copied {rep.src} to {rep.dst}: {len(rep.files)} data file(s), {_human(rep.bytes)} of tensor data"
          + (f", {rep.side_files} side file(s)" if rep.side_files else ""))
    if rep.referenced:
        print(f"  {_human(rep.referenced_bytes)} of it read from {len(rep.referenced)} file(s) of earlier "
              f"checkpoints, now in the copy's own files: {', '.join(rep.referenced)}")
    print("  self-contained: it loads and verifies on its own ('nostall verify' it where it lands)")
    return 0


_COPY_EPILOG = """\
examples:
  nostall copy ckpts/run1 handoff/step_1000
      the newest checkpoint of run root ckpts/run1, self-contained, in handoff/step_1000
  nostall copy ckpts/run1/step_1000 s3://bucket/models/step_1000 --storage-options '{...}'
      to object storage (and back the other way, or bucket to bucket)

An incremental checkpoint (CheckpointManager(root, incremental=True)) reads
unchanged pieces from data files of earlier checkpoints of its root; the copy
holds every piece in its own files (one plain safetensors file per rank, only
the byte ranges the checkpoint reads), checksums unchanged and checked as they
are read, and its manifest names no other checkpoint. A full checkpoint is
copied as it is. DST must not exist, or be an empty directory, or, with
--overwrite, be a nostall checkpoint; the copy appears whole or not at all.
DST inside SRC, SRC inside DST, or either inside a checkpoint whose files SRC
reads is refused before anything is written (real paths are compared).
A run root's 'latest' is never moved by a copy.
"""


def _bench(rest: List[str]) -> int:
    from nostall.tools.bench import main as bench_main  # its own argument tables; imports torch

    return bench_main(rest)


_CONVERT_EPILOG = """\
examples:
  nostall convert --from dcp dcp_ckpt/ ns_ckpt/
      import a PyTorch DCP (or Megatron torch_dist) directory as a nostall checkpoint
  nostall convert --keys model --strip-prefix model ckpts/run1 hf/
      export the full tensors under 'model' of the newest checkpoint of run root ckpts/run1
      as safetensors files (hf/model.safetensors, sharded past --max-shard-size)
  nostall convert --to torch --keys 'model/*.weight' ckpts/run1/step_100 weights.pt
      one torch.save file of the selected tensors
  nostall convert --from dcp --to safetensors dcp_ckpt/ hf/
      both at once (through a temporary checkpoint next to the destination)

--keys selects by key prefix (model) or glob (model/*.weight); give several
comma-separated (--keys model,optim) or repeat the option. Keys are the state's
nested dict keys joined with '/'; exported names join them with --separator.
Side files saved with the checkpoint (save(files=...)) are copied into a
safetensors export, checksums checked: those under huggingface/ at its top
level (huggingface/config.json -> DST/config.json, for from_pretrained(DST)),
others under their own names. --to torch writes one file and leaves them out.
DCP's .metadata file is a pickle: import only checkpoints you trust.
"""


_SRC_DST = {
    "copy": {
        "help": "make a self-contained copy of one checkpoint (an incremental one's references resolved)",
        "description": "Copy one checkpoint to DST (a directory or URL) so that it needs nothing else: every piece\n"
                       "it reads, from its own files and from earlier checkpoints' (incremental saves), lands in\n"
                       "DST's own files. For handing a checkpoint to someone else, or moving it between buckets.",
        "epilog": _COPY_EPILOG,
        "dst": "the copy: a new (or empty) directory, or an object-storage URL",
    },
    "convert": {
        "help": "import a DCP checkpoint, or export to safetensors / torch.save",
        "description": "Convert checkpoints. --from dcp SRC DST imports a PyTorch DCP (or Megatron torch_dist)\n"
                       "directory into the nostall format; --to safetensors / --to torch exports consolidated\n"
                       "full tensors with bounded memory.",
        "epilog": _CONVERT_EPILOG,
        "src": "source: nostall checkpoint (or run root: its newest), or a DCP directory",
        "dst": "destination: directory (nostall, safetensors) or file (torch)",
    },
}
"""The ``nostall COMMAND SRC DST`` commands: their texts (description and epilog shown as written)."""


def _src_dst_parser(sub: Any, name: str, src: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of ``nostall NAME SRC DST`` (:data:`_SRC_DST`), its two positional arguments added."""
    t = _SRC_DST[name]
    raw = argparse.RawDescriptionHelpFormatter
    p: argparse.ArgumentParser = sub.add_parser(name, help=t["help"], description=t["description"],
                                                epilog=t["epilog"], formatter_class=raw)
    p.add_argument("src", help=src or t["src"])
    p.add_argument("dst", help=t["dst"])
    return p


def _add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="draw a progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nostall",
                                description="Inspect, verify, list, copy, convert and benchmark nostall checkpoints.",
                                epilog="A checkpoint path may be a checkpoint directory or URL, a run root (its "
                                       "newest checkpoint) or a run root's 'latest' file. Run 'nostall COMMAND -h' "
                                       "for a command's options.")
    p.add_argument("--version", action="version", version=f"nostall {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, title="commands", metavar="COMMAND")
    so_help = "object storage: fsspec options as a JSON object, e.g. '{\"client_kwargs\": {\"endpoint_url\": ...}}'"
    ck_help = "checkpoint directory or URL, a run root (its newest checkpoint), or a run root's 'latest' file"
    pi = sub.add_parser("inspect", help="show what a checkpoint holds (exit status 1 if a file of an earlier "
                                        "checkpoint that it reads is missing)",
                        description="Show what a checkpoint holds: files, tensors, values, side files. An incremental "
                                    "checkpoint's files of earlier checkpoints are checked to be there with their "
                                    "listed sizes (a stat each, no data read): a missing one is named on stderr and "
                                    "the exit status is 1. 'nostall verify' reads and checks every byte.")
    pi.add_argument("path", help=ck_help)
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pi.set_defaults(fn=cmd_inspect)
    pi.add_argument("--storage-options", type=storage_options_arg, default=None, help=so_help)
    pv = sub.add_parser("verify", help="re-read every byte and check every checksum")
    pv.add_argument("path", help=ck_help)
    pv.add_argument("--json", action="store_true", help="machine-readable output (exit status 1 if damaged)")
    pv.set_defaults(fn=cmd_verify)
    pv.add_argument("--storage-options", type=storage_options_arg, default=None, help=so_help)
    pl = sub.add_parser("ls", help="list the committed checkpoints of a run root: steps, sizes, dates (exit "
                                   "status 1 if one is unreadable or broken: a file it reads is missing)",
                        description="List the committed checkpoints of a run root: steps, sizes, when each was "
                                    "committed (its manifest file's modification time, UTC: a copy that kept no "
                                    "times shows the copy's; 'modified' in --json), what an "
                                    "incremental one reads from earlier ones. A checkpoint whose manifest cannot be "
                                    "read is marked UNREADABLE, one that reads a file of an earlier checkpoint that "
                                    "is missing or of another size (a stat each, no data read) BROKEN, naming the "
                                    "file ('broken' and 'problems' in --json); the others are listed as usual, and "
                                    "the exit status is 1.")
    pl.add_argument("root", help="run root (directory or URL)")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument("--storage-options", type=storage_options_arg, default=None, help=so_help)
    pl.set_defaults(fn=cmd_ls)
    pk = _src_dst_parser(sub, "copy", src=ck_help)
    pk.add_argument("--overwrite", action="store_true", help="replace a nostall checkpoint at DST")
    pk.add_argument("--json", action="store_true", help="machine-readable summary")
    _add_progress(pk)
    pk.add_argument("--storage-options", type=storage_options_arg, default=None, help=so_help)
    pk.add_argument("--dst-storage-options", type=storage_options_arg, default=None,
                    help="fsspec options for DST when they differ from SRC's (default: --storage-options)")
    pk.set_defaults(fn=cmd_copy)
    pc = _src_dst_parser(sub, "convert")
    pc.add_argument("--from", dest="from_", choices=["nostall", "dcp"], default="nostall",
                    help="source format (default: nostall)")
    pc.add_argument("--to", choices=["nostall", "safetensors", "torch"], default=None,
                    help="destination format (default: nostall from dcp, safetensors from nostall)")
    pc.add_argument("--keys", action="append", default=None, metavar="KEY[,KEY...]",
                    help="export only these keys: prefixes (model) or globs (model/*.weight); comma-separated, "
                         "or repeat the option (default: all)")
    pc.add_argument("--strip-prefix", default=None, help="leading key components to drop from exported names")
    pc.add_argument("--separator", default=".", help="joins key components in exported names (default '.')")
    pc.add_argument("--dtype", default=None, help="cast floating-point tensors on export: bf16, fp16, fp32, fp64")
    pc.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    pc.add_argument("--memory-limit", default="1GB", help="buffer memory the export may hold (default 1GB)")
    pc.add_argument("--block-size", type=_block_size_arg, default=4 << 20,
                    help="checksum block size of an imported checkpoint: a power of two from 4KiB to 1GiB "
                         "(default 4MiB)")
    pc.add_argument("--skip-unsupported", action="store_true",
                    help="import: leave out DCP values that are not JSON (default: refuse)")
    pc.add_argument("--overwrite", action="store_true", help="write into a non-empty destination")
    _add_progress(pc)
    pc.add_argument("--json", action="store_true", help="machine-readable summary")
    pc.add_argument("--storage-options", type=storage_options_arg, default=None, help=so_help)
    pc.set_defaults(fn=cmd_convert)
    pb = sub.add_parser("bench", help="benchmark against PyTorch DCP, torch.save and the machine's limits "
                                      "('nostall bench -h' for its options)", add_help=False)
    pb.add_argument("rest", nargs=argparse.REMAINDER)
    pb.set_defaults(fn=lambda a: _bench(a.rest))
    return p


def _failed(cmd: str, e: BaseException, path: Optional[str], so: Optional[Dict[str, Any]]) -> int:
    """One line on stderr for an error at the command line's boundary; exit status 1."""
    if os.environ.get("NOSTALL_DEBUG"):
        traceback.print_exc()
    known = isinstance(e, (CheckpointError, OSError, ValueError))
    msg = str(e).strip() if known else f"{type(e).__name__}: {str(e).strip()}"  # e.g. botocore's NoCredentialsError
    if not str(e).strip():
        msg = type(e).__name__
    if path is not None and local_path(path) is None and so is None and not isinstance(e, CheckpointError):
        msg += " (object storage: pass --storage-options, or set the credentials and endpoint in the environment)"
    print(f"nostall {cmd}: FAILED: {msg}", file=sys.stderr)
    return 1


def _run(args_in: List[str]) -> int:
    p = _parser()
    if not args_in:  # the commands, not just "required: cmd"
        p.print_help(sys.stderr)
        return 2
    args = p.parse_args(args_in)
    try:
        return args.fn(args)
    except BrokenPipeError:
        raise
    except Exception as e:  # the boundary: any library's error is one line (KeyboardInterrupt passes)
        where = getattr(args, "path", None) or getattr(args, "root", None) or getattr(args, "src", None)
        return _failed(args.cmd, e, where, getattr(args, "storage_options", None))


def _stdout_gone() -> None:
    """The reader of stdout went away (``nostall inspect --json X | head -1``): send what is left
    to /dev/null, so that the interpreter's own flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (captured output)
        pass


def main(argv: Optional[List[str]] = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    try:
        if args_in[:1] == ["bench"]:  # its own parser: argparse's REMAINDER drops leading options
            try:
                rc = _bench(args_in[1:])
            except BrokenPipeError:
                raise
            except Exception as e:
                return _failed("bench", e, None, None)
        else:
            rc = _run(args_in)
        sys.stdout.flush()  # inside the try: a closed pipe is noticed here, not at exit
        return rc
    except BrokenPipeError:
        _stdout_gone()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
