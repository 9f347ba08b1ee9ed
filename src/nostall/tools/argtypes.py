"""Argument types shared by the command line and the benches (torch-free: imported by ``nostall --version``)."""

from __future__ import annotations

import argparse
import json
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
