"""What every benchmark shares: the machine facts stamped on a result and how a result is emitted.

Knows JSON and stdout; nothing of what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--out", help="also write the JSON result to this file")


def machine() -> dict[str, Any]:
    """Facts that make two results comparable (or not)."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "load_avg": [round(x, 2) for x in os.getloadavg()],  # other work on the machine during the run
    }


def emit(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Write the result to --out, and print it as the last stdout line with --json."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.json:
        print(json.dumps(result))
