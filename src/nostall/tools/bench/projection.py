"""The projection of ``nostall bench scale``: what one rank pays as the job grows, each figure labelled.

From the planning points (one per rank count, at the largest tensor count
measured) and, when the load part ran, the load points:

* the plan on a rank's training thread at a first save: on a non-zero rank its
  signature, its metadata encoded, its own file laid out from its share and the
  share decoded; on rank 0 the same for its own, and the whole job's planning
  (every rank's metadata decoded, ``build_plan``, ``check_objects``,
  ``shared_keys``, every rank's share, the replica check's verdict) and the
  manifest skeleton;
* the bytes rank 0 and a non-zero rank (the largest figures of any) send and
  receive in the plan exchange, and the done records rank 0 reads at a
  background save's commit;
* at load, the manifest bytes a rank reads and its parse time (every rank
  reads and parses the whole manifest);
* the load of one rank's share in its saved layout, computed: the manifest
  parse, plus the load part's per-piece cost times the rank's pieces; and,
  beside it, the rank's bytes at the load part's raw read pace.

A figure is ``measured``, or ``computed (how)``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from nostall.tools.bench.common import median

MEASURED = "measured"
MIN_PIECES = 64
"""Pieces per tensor from which the load part's points give the per-piece cost (:func:`load_fit`)."""
COUNTED = "measured (counted from the real encodings)"


def _cell(value: float, how: str) -> Dict[str, Any]:
    return {"value": value, "how": how}


def load_fit(load: Sequence[Dict[str, Any]]) -> Optional[Dict[str, float]]:
    """The load part's per-piece cost and raw read pace, or None without load points.

    ``per_piece``: the median, over the points with at least :data:`MIN_PIECES` pieces per tensor (else all), of
    a full load's time less the raw read of its bytes and its manifest parse, per piece (every piece located,
    read, checksummed and copied; thousands of pieces, where one rank's load there has a handful).
    ``raw_bytes_per_s``: the median raw read pace of the files."""
    if not load:
        return None
    many = [p for p in load if p["pieces"] >= MIN_PIECES] or list(load)
    per_piece = median([(median(p["full_s"]) - median(p["raw_read_s"]) - median(p["parse_s"]))
                        / (p["pieces"] * p["tensors"]) for p in many])
    return {"per_piece": max(0.0, per_piece),
            "raw_bytes_per_s": median([p["bytes"] / median(p["raw_read_s"]) for p in load])}


def _how(point: Dict[str, Any], fields: Sequence[str], what: str) -> str:
    notes = [f"{f}: {point['computed'][f]}" for f in fields if f in point["computed"]]
    return MEASURED + f" ({what})" if not notes else "computed: " + "; ".join(notes)


def _load_share(p: Dict[str, Any], fit: Dict[str, float]) -> Dict[str, Dict[str, Any]]:
    parse = median(p["parse_s"])
    how_parse = "measured" if "parse_s" not in p["computed"] else "computed"
    return {
        "load_share": _cell(parse + fit["per_piece"] * p["rank_pieces"],
                            f"computed: the manifest parse ({how_parse}) + the load part's per-piece cost "
                            f"({fit['per_piece'] * 1e6:.1f} us: a full load less its raw read and parse, per piece, "
                            f"median of the points of {MIN_PIECES}+ pieces per tensor) x the rank's pieces"),
        "load_data": _cell(p["rank_bytes"] / fit["raw_bytes_per_s"],
                           f"computed: the rank's bytes at the load part's raw read pace "
                           f"({fit['raw_bytes_per_s'] / 2**30:.1f} GiB/s, page cache)"),
    }


def _rows(p: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The projection's cells of one planning point."""
    from nostall.tools.bench.scale import RANK0_TIMES, rank0_thread

    ex = p["exchange"]
    commit = p["commit"]["async"]
    how_commit = COUNTED if "commit" not in p["computed"] else "computed: " + p["computed"]["commit"]
    own = "with the plan's owned pieces" if "own_files_owned_s" in p["other"] else "with every piece it holds"
    return {
        "pieces": _cell(p["pieces"], MEASURED + " (distinct boxes, the plan's where measured)"),
        "rank_share": _cell(p["rank_bytes"], f"{MEASURED} (its {p['rank_pieces']:,} pieces' bytes)"),
        "plan_thread_other": _cell(p["other"]["thread_s"],
                                   MEASURED + " (the last rank: signature + encode_meta + own_files with every "
                                   "piece it holds, an upper bound + its share decoded)"),
        "plan_thread_rank0": _cell(rank0_thread(p), _how(p, list(RANK0_TIMES) + ["skeleton_s"],
                                                          "its own signature, encode and own file (the last "
                                                          "rank's times, own_files " + own + ") + every rank's "
                                                          "metadata decoded + build_plan + "
                                                          "check_objects + shared_keys + every rank's share + "
                                                          "verdict + manifest skeleton")),
        "exchange_sent_other": _cell(ex["other"]["sent_bytes"], COUNTED),
        "exchange_received_other": _cell(ex["other"]["received_bytes"], COUNTED),
        "exchange_sent_rank0": _cell(ex["rank0"]["sent_bytes"], COUNTED),
        "exchange_received_rank0": _cell(ex["rank0"]["received_bytes"], COUNTED),
        "commit_rank0_reads": _cell(commit["rank0_reads_bytes"], how_commit),
        "commit_other_reads": _cell(commit["other_reads_bytes"], COUNTED),
        "manifest_read": _cell(p["manifest_bytes"], _how(p, ["manifest_bytes"], "the manifest's size")),
        "manifest_parse": _cell(median(p["parse_s"]), _how(p, ["parse_s"], "Manifest.from_json_bytes")),
        "manifest_memory": _cell(p["parse_memory_estimate"], _how(p, ["parse_memory_estimate"],
                                                                   "format.json_memory_estimate")),
        **_shared_rows(p),
    }


def _shared_rows(p: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The shared load's cells (measured points only: tools/bench/shares.py)."""
    sl = p.get("shared_load")
    if sl is None:
        return {}
    return {
        "shared_received": _cell(sl["other_received_bytes"], MEASURED + " (the head + its share, pickled)"),
        "shared_decode": _cell(sl["other_decode_s"], MEASURED + " (unpickle the head and its share, fill the head)"),
        "shared_rank0": _cell(sl["rank0_parse_s"] + sl["rank0_head_s"] + sl["rank0_cut_s"] + sl["rank0_assign_s"]
                              + sl["rank0_pickle_s"],
                              MEASURED + " (parse + head + every rank's share + read-once assignment + pickling)"),
    }


ROWS = (
    ("pieces", "count", "pieces in the checkpoint"),
    ("rank_share", "bytes", "one rank's share of the data"),
    ("plan_thread_other", "s", "plan on the training thread at a first save, a non-zero rank"),
    ("plan_thread_rank0", "s", "plan on the training thread at a first save, rank 0"),
    ("exchange_sent_other", "bytes", "plan exchange: bytes a non-zero rank sends (the most of any)"),
    ("exchange_received_other", "bytes", "plan exchange: bytes a non-zero rank receives (the most of any)"),
    ("exchange_sent_rank0", "bytes", "plan exchange: bytes rank 0 sends"),
    ("exchange_received_rank0", "bytes", "plan exchange: bytes rank 0 receives"),
    ("commit_rank0_reads", "bytes", "commit of a background save: done records rank 0 reads"),
    ("commit_other_reads", "bytes", "commit of a background save: what a non-zero rank reads (the outcome)"),
    ("manifest_read", "bytes", "load alone (nostall.load; shared_loads=False): manifest bytes each rank reads"),
    ("manifest_parse", "s", "load alone: manifest parse on each rank"),
    ("manifest_memory", "bytes", "load: the parse's memory estimate (a load refuses the manifest above "
                                 "MAX_MANIFEST_MEMORY, 4 GiB by default; manifests above MAX_MANIFEST_BYTES, 1 GiB)"),
    ("shared_received", "bytes", "shared load (a manager's, default): metadata a non-zero rank receives"),
    ("shared_decode", "s", "shared load: a non-zero rank's metadata work"),
    ("shared_rank0", "s", "shared load: rank 0's metadata work, which every rank waits for (the manifest is "
                          "read once by the job)"),
    ("load_share", "s", "load of one rank's share alone (saved layout): manifest parse + per-piece work"),
    ("load_data", "s", "load of one rank's share: its bytes at the raw read's pace (beside the row above)"),
)
"""The projection's rows: key, unit, what."""


def projection(out: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The projection rows of ``out`` (a ``nostall bench scale`` result): ``{"key", "unit", "what", "tensors",
    "cells": {ranks: {"value", "how"}}}``; empty without planning points."""
    points = [p for p in out.get("planning") or [] if "plan_s" in p]
    if not points:
        return []
    tensors = max(p["tensors"] for p in points)
    points = sorted((p for p in points if p["tensors"] == tensors), key=lambda p: p["ranks"])
    fit = load_fit(out.get("load") or [])
    cells = {p["ranks"]: _rows(p) for p in points}
    if fit is not None:
        for p in points:
            cells[p["ranks"]].update(_load_share(p, fit))
    return [{"key": key, "unit": unit, "what": what, "tensors": tensors,
             "cells": {r: c[key] for r, c in cells.items() if key in c}}
            for key, unit, what in ROWS if any(key in c for c in cells.values())]


def _value(v: float, unit: str) -> str:
    if unit == "count":
        return f"{v:,}"
    if unit == "bytes":
        if v >= 2**30:
            return f"{v / 2**30:,.2f} GiB"
        return f"{v / 2**20:,.1f} MiB" if v >= 2**20 else f"{v / 2**10:,.1f} KiB" if v >= 2**10 else f"{v} B"
    return f"{v:,.2f} s" if v >= 1 else f"{v * 1e3:,.1f} ms"


def format_projection(rows: List[Dict[str, Any]]) -> str:
    """The projection as a Markdown table (value and label per cell), then the labels' notes."""
    if not rows:
        return ""
    ranks = sorted({r for row in rows for r in row["cells"]})
    lines = [f"| per rank, {rows[0]['tensors']:,} tensors a rank | " + " | ".join(f"{r:,} ranks" for r in ranks)
             + " |", "|---|" + "---|" * len(ranks)]
    notes: List[str] = []
    for row in rows:
        out = []
        for r in ranks:
            c = row["cells"].get(r)
            if c is None:
                out.append("")
                continue
            if c["how"] not in notes:
                notes.append(c["how"])
            out.append(f"{_value(c['value'], row['unit'])} [{notes.index(c['how']) + 1}]")
        lines.append(f"| {row['what']} | " + " | ".join(out) + " |")
    lines.append("")
    lines += [f"[{i + 1}] {n}" for i, n in enumerate(notes)]
    return "\n".join(lines)
