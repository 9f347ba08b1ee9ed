"""Command line: ``nostall inspect PATH``, ``nostall verify PATH``, ``nostall bench ...``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

from . import commit, commit_remote, remote
from .errors import CheckpointError
from .format import MANIFEST_NAME, Manifest
from .loading import check_checkpoint, read_manifest


def _resolve(path: str, so: Optional[Dict[str, Any]] = None) -> str:
    """A checkpoint directory (or URL), or a manager root (then its newest checkpoint)."""
    if remote.is_remote(path):
        path = path.rstrip("/")
        step = commit_remote.latest_step(path, so)
        fs, key = remote.filesystem(path, so)
        if step is not None and not fs.exists(f"{key}/{MANIFEST_NAME}"):
            return commit_remote.join(path, f"step_{step}")
        return path
    if commit.is_committed(path):
        return path
    steps = commit.committed_steps(path)
    if steps:
        return commit.step_dir(path, steps[-1])
    return path


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _summary(path: str, m: Manifest) -> Dict[str, Any]:
    tensors = []
    for k, t in sorted(m.tensors.items()):
        nbytes = sum(p.nbytes for p in t.pieces)
        tensors.append({
            "key": k, "dtype": t.dtype, "shape": list(t.shape), "sharded": t.sharded,
            "pieces": [{"offset": list(p.offset), "shape": list(p.shape), "file": p.file,
                        "byte_range": [p.start, p.end]} for p in t.pieces],
            "bytes": nbytes,
        })
    return {
        "path": path if remote.is_remote(path) else os.path.abspath(path),
        "step": m.step,
        "format_version": m.version,
        "world_size": m.world_size,
        "files": [{"name": f.name, "rank": f.rank, "size": f.size} for f in sorted(m.files.values(), key=lambda f: f.name)],
        "total_bytes": sum(f.size for f in m.files.values()),
        "tensors": tensors,
        "objects": sorted(m.objects),
        "per_rank": [{"tensors": sorted(r.tensors), "objects": sorted(r.objects)} for r in m.per_rank],
    }


def _print_summary(s: Dict[str, Any]) -> None:
    print(f"checkpoint  {s['path']}")
    print(f"step        {s['step']}")
    print(f"world size  {s['world_size']}  (format version {s['format_version']})")
    print(f"data        {len(s['files'])} file(s), {_human(s['total_bytes'])}")
    for f in s["files"]:
        print(f"  {f['name']:<28} rank {f['rank']:<5} {_human(f['size']):>12}")
    print(f"tensors     {len(s['tensors'])}")
    w = max([len(t["key"]) for t in s["tensors"]] + [3])
    for t in s["tensors"]:
        kind = f"{len(t['pieces'])} piece(s)" if t["sharded"] else "replicated"
        print(f"  {t['key']:<{w}}  {t['dtype']:<5} {str(t['shape']):<20} {kind:<12} {_human(t['bytes']):>10}")
    if s["objects"]:
        print(f"objects     {', '.join(s['objects'])}")
    pr = s["per_rank"]
    if pr and any(r["tensors"] or r["objects"] for r in pr):
        keys = sorted(set(pr[0]["tensors"]) | set(pr[0]["objects"]))
        print(f"per rank    {', '.join(keys)}  (x {len(pr)} ranks)")


def _options(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    return json.loads(args.storage_options) if args.storage_options else None


def cmd_inspect(args: argparse.Namespace) -> int:
    so = _options(args)
    path = _resolve(args.path, so)
    m = read_manifest(path, so)
    s = _summary(path, m)
    if args.json:
        json.dump(s, sys.stdout, indent=1)
        print()
    else:
        _print_summary(s)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    so = _options(args)
    path = _resolve(args.path, so)
    report = check_checkpoint(path, so)
    where = path if remote.is_remote(path) else os.path.abspath(path)
    if report.problems:
        print(f"FAILED  {where}: {len(report.problems)} problem(s)", file=sys.stderr)
        for problem in report.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"OK  {where}: {report.files} file(s), {_human(report.bytes)} of tensor data, every checksum matches")
    return 0


def _bench(rest: List[str]) -> int:
    from .bench import main as bench_main

    return bench_main(rest)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="nostall", description="Inspect, verify and benchmark nostall checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("inspect", help="show what a checkpoint holds")
    pi.add_argument("path", help="checkpoint directory, or a run root (its newest checkpoint)")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pi.set_defaults(fn=cmd_inspect)
    so_help = "object storage: fsspec options as JSON, e.g. '{\"client_kwargs\": {\"endpoint_url\": ...}}'"
    pi.add_argument("--storage-options", default=None, help=so_help)
    pv = sub.add_parser("verify", help="re-read every byte and check every checksum")
    pv.add_argument("path", help="checkpoint directory, or a run root (its newest checkpoint)")
    pv.set_defaults(fn=cmd_verify)
    pv.add_argument("--storage-options", default=None, help=so_help)
    pb = sub.add_parser("bench", help="benchmark against PyTorch DCP, torch.save and the machine's limits",
                        add_help=False)
    pb.add_argument("rest", nargs=argparse.REMAINDER)
    pb.set_defaults(fn=lambda a: _bench(a.rest))
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except CheckpointError as e:
        print(f"nostall {args.cmd}: FAILED: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"nostall {args.cmd}: FAILED: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
