"""Checks a role table's options before launch, loading no model: `python -m hfrt.roles.check`
reads {"role": {"impl", "world_size", "dp_size", "options"}} as JSON on stdin and prints a JSON
list of problems, each naming the role ("roles.actor: unknown option(s) ['modle'] ...").

It runs in its own short-lived process, so the controller never imports torch; it knows the
implementation lookup and each Daemon class's `check_config`, nothing of flows.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from hfrt.daemon.base import DaemonContext
from hfrt.roles import resolve_impl


def problems(roles: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What is wrong with each role's settings (checked as its rank 0 would check them)."""
    found = []
    for name, settings in roles.items():
        impl = str(settings.get("impl", name))
        try:
            cls = resolve_impl(impl)
            context = DaemonContext(
                name, 0, int(settings.get("world_size", 1)), dp_size=int(settings.get("dp_size", -1)),
                impl=impl, options=dict(settings.get("options") or {}),
            )
            cls.check_config(context)
        except Exception as exc:  # every problem is reported, named by role
            found.append(f"roles.{name}: {exc}")
    return found


def main() -> int:
    print(json.dumps(problems(json.load(sys.stdin))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
