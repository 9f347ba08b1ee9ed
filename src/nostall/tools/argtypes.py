"""Argument types shared by the command line and the benches (torch-free: imported by ``nostall --version``)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, Dict


def storage_options_arg(text: str) -> Dict[str, Any]:
    """``--storage-options``: a JSON object; anything else is a usage error (exit 2) naming the option."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text}")
    return value


def parse_size(text: str) -> int:
    """``"5GB"``, ``"512MiB"``, ``"100M"``, ``"4096"`` -> bytes (K, M, G, T are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgGtT]?)(?:[iI]?[bB])?\s*", str(text))
    if m is None:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512MiB, 5GB)")
    return int(float(m.group(1)) * (1 << (10 * " KMGT".index(m.group(2).upper() or " "))))
