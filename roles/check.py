"""Checks a role table's options before launch, loading no model: `python -m hfrt.roles.check`
reads {"role": {"impl", "world_size", "dp_size", "options"}} as JSON on stdin and prints a JSON
list of problems, each naming the role ("roles.actor: unknown option(s) ['modle'] ...").

It runs in its own short-lived process, so the controller never imports torch; it knows the
implementation lookup and each Daemon class's `check_config`, nothing of flows. A `model` that is a
Hugging Face Hub id is checked from the Hub cache, or by its config.json alone when not cached.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from hfrt.daemon.base import DaemonContext
from hfrt.roles import resolve_impl
from hfrt.roles.models import check_before_launch


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
    return found + budget_problems(roles)


def _option(settings: Mapping[str, Any], *keys: str) -> Any:
    value: Any = settings.get("options") or {}
    for key in keys:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def budget_problems(roles: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A token budget (engine.max_tokens_per_micro_batch) smaller than the longest prompt a
    generating role accepts (sampling.max_prompt_tokens): every prompt must fit a budget."""
    limits = {name: _option(s, "sampling", "max_prompt_tokens") for name, s in roles.items()}
    limits = {name: v for name, v in limits.items() if _positive_int(v)}
    if not limits:
        return []
    source, longest = max(limits.items(), key=lambda kv: kv[1])
    found = []
    for name, settings in roles.items():
        budget = _option(settings, "engine", "max_tokens_per_micro_batch")
        if _positive_int(budget) and budget < longest:
            found.append(f"roles.{name}: engine.max_tokens_per_micro_batch={budget} is smaller than "
                         f"roles.{source}.options.sampling.max_prompt_tokens={longest}: a budget must hold every prompt")
    return found


def main() -> int:
    check_before_launch()  # a Hub id's weights are the daemons' to fetch, not this check's
    print(json.dumps(problems(json.load(sys.stdin))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
