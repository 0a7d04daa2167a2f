"""Writing a planned mapping as a cluster spec TOML that `hfrt controller --cluster` and `hfrt
launch` read unchanged: nodes, one pool per colocated set, each role's pool and parallel sizes.

It knows the spec format (deploy.spec) and a small TOML writer; it does not plan or validate
(load the written file with deploy.spec.load_spec for that).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from hfrt.deploy.plan.file import FUNCTION, PlanInput
from hfrt.deploy.plan.model import MODELS
from hfrt.deploy.plan.search import Mapping, layout_slots

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")
#: Presets the role daemons can load (roles/models.py); the planner's other presets are shapes only.
ROLE_PRESETS = ("tiny", "smollm2-135m")


def toml_value(value: Any) -> str:
    """One TOML value: strings, numbers, booleans, arrays and inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def toml_key(key: str) -> str:
    return key if _BARE.match(key) else json.dumps(key)


def pool_names(mapping: Mapping) -> list[str]:
    """One pool per colocated set, named after its roles."""
    return ["_".join(group) for group in mapping.placement]


def spec_text(plan: PlanInput, mapping: Mapping) -> str:
    """The whole spec file for `mapping`."""
    p = plan.problem
    slots = layout_slots(p, mapping.alloc)
    assert slots is not None, "a ranked mapping always lays out"
    lines = [
        f"# Written by `hfrt plan {plan.source}`: flow {plan.flow}, predicted step {mapping.step_s:.3f} s",
        f"# ({', '.join(f'{s.name} {t:.3f} s' for s, t in zip(p.stages, mapping.stage_s, strict=True))}).",
        f"name = {toml_value(plan.name)}",
        f"launcher = {toml_value(plan.launcher)}",
        "",
    ]
    for name in plan.node_names:
        lines += ["[[nodes]]", f"name = {toml_value(name)}", f"devices = {p.per_node}",
                  f"device_type = {toml_value(p.hw.device_type)}", ""]
    pools = pool_names(mapping)
    for pool, group_slots in zip(pools, slots, strict=True):
        nodes = sorted({n for n, _ in group_slots})
        devices = sorted({d for _, d in group_slots})
        lines += [f"[pools.{toml_key(pool)}]", f"nodes = {toml_value([plan.node_names[n] for n in nodes])}"]
        if len(devices) < p.per_node:
            lines.append(f"devices = {toml_value(devices)}")
        lines.append("")
    lines += _roles(plan, mapping, pools)
    return "\n".join(lines)


def _roles(plan: PlanInput, mapping: Mapping, pools: list[str]) -> list[str]:
    pool_of = {role: pools[i] for i, group in enumerate(mapping.placement) for role in group}
    home = pool_of.get("actor", pools[0])
    lines: list[str] = []
    for role, settings in plan.flow_roles.items():
        options, note = role_options(settings.get("options", {}), plan.model_sources.get(role, ""))
        choice = mapping.choices.get(role)
        if choice is not None and choice.layout.devices > 1 and plan.problem.trained(role):
            engine = options.setdefault("engine", {})
            if engine.get("backend", "local") == "local":  # one rank's engine cannot train across ranks
                engine["backend"] = "fsdp2"
        lines.append(f"[roles.{toml_key(role)}]")
        if note:
            lines.append(note)
        if choice is None:  # a function role: one rank, beside the actor
            lines += [f"pool = {toml_value(home)}", f"impl = {toml_value(settings.get('impl', role))}", "world_size = 1"]
        else:
            lay = choice.layout
            lines += [
                f"pool = {toml_value(pool_of[role])}", f"impl = {toml_value(settings.get('impl', role))}",
                f"world_size = {lay.devices}", f"dp_size = {lay.dp}", f"tp_size = {lay.tp}", f"pp_size = {lay.pp}",
            ]
            if choice.gen is not None:
                g = choice.gen
                lines.append(f"# generation layout (3D-HybridEngine): tp {g.tp}, pp {g.pp}, dp {g.dp}")
        if options:
            lines.append(f"options = {toml_value(options)}")
        lines.append("")
    return lines


def role_options(flow_options: dict[str, Any], source: str) -> tuple[dict[str, Any], str]:
    """The flow's options for a role with the planned model in: a role preset or a folder goes in
    as `model` (a rule reward becomes `kind = "model"`); a planner-only shape preset (llama-*)
    cannot be loaded, so it is left to the user with a comment."""
    options = copy.deepcopy(flow_options)
    if not source or source == FUNCTION:
        return options, ""
    if source in MODELS and source not in ROLE_PRESETS:
        return options, f"# planned as {source}: set options.model to that model's folder"
    if options.get("kind") == FUNCTION:
        options = {k: v for k, v in options.items() if k not in ("function", "kind")} | {"kind": "model"}
    options["model"] = source
    return options, ""
