"""Reading a PLAN.toml for `hfrt plan`: the flow (its STAGES and ROLES), each role's model, the
workload, the cluster and efficiency factors, checked with every problem reported at once.

It knows the file format and how to turn it into a deploy.plan.Problem; it does not search,
print or write specs. The flow module is imported (flows never import torch) only for its STAGES
and ROLES constants. A PLAN.toml looks like::

    flow = "ppo"                        # a built-in flow or a .py file defining STAGES and ROLES
    [cluster]
    hardware = "H100"                   # H100 | H200 | A100 | cpu
    nodes = 16
    devices_per_node = 8
    [workload]
    prompts_per_step = 1024
    response_len = 1024
    [models]
    actor = "llama-13b"                 # a preset, a Hugging Face folder or Hub id, or a table of numbers
    critic = { layers = 80, hidden = 8192, heads = 64, vocab = 32000, kv_heads = 8, intermediate = 28672 }
    reward = "function"                 # a rule reward: no device time
    [lora]
    actor = 16                          # LoRA rank of a trained role (roles.<role>.options.lora)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfrt.deploy.plan.model import HARDWARE, MODELS, Efficiency, Hardware, ModelSpec, Workload, model_from_hf_config
from hfrt.deploy.plan.search import OPS, Problem, Stage
from hfrt.deploy.reader import Reader
from hfrt.deploy.spec import read_toml
from hfrt.wire import hub

FUNCTION = "function"
_HW_OVERRIDES = {  # PLAN key → (Hardware field, scale)
    "memory_gb": ("memory_bytes", 1e9), "peak_tflops": ("peak_flops", 1e12), "mem_bw_gbs": ("mem_bw", 1e9),
    "intra_bw_gbs": ("intra_bw", 1e9), "inter_bw_gbs": ("inter_bw", 1e9), "max_tp": ("max_tp", 1), "max_pp": ("max_pp", 1),
}


@dataclass(frozen=True)
class PlanInput:
    """A read PLAN.toml: the problem, and what writing a cluster spec needs besides the mapping."""

    problem: Problem
    flow: str
    flow_roles: dict[str, dict[str, Any]]
    model_sources: dict[str, str]  # role → preset name or folder ("" for numbers, "function")
    name: str = "hfrt-plan"
    node_names: tuple[str, ...] = ()
    launcher: str = "local"
    top: int = 5
    source: str = "<plan>"


def load_plan(path: str | Path, efficiency: Efficiency | None = None) -> PlanInput:
    return parse_plan(read_toml(path), str(path), efficiency)


def parse_plan(data: dict[str, Any], source: str = "<plan>", efficiency: Efficiency | None = None) -> PlanInput:
    """Check a parsed PLAN.toml; `efficiency` (from --calibrate) replaces its [efficiency] table."""
    r = Reader(source)
    top = r.section(data, "top level", {"name", "flow", "cluster", "workload", "models", "efficiency", "top", "lora"})
    flow = r.get(top, "top level", "flow", str, "")
    if not flow:
        r.problem("top level: missing flow (a built-in flow name such as \"ppo\", or a .py file)")
    stages, roles = flow_stages(flow, r) if flow else ((), {})
    hw, nodes, per_node, names, launcher = _cluster(r, top.get("cluster", {}))
    workload = _workload(r, top.get("workload", {}))
    models, sources = _models(r, top.get("models", {}), roles, source)
    models, stages = _lora(r, top.get("lora", {}), models, stages)
    eff = efficiency or read_efficiency(r, top.get("efficiency", {}))
    r.raise_if_any()
    used = {role for s in stages for role in s.calls}
    model_roles = {role: m for role, m in models.items() if role in used}
    problem = Problem(model_roles, tuple(_only(s, model_roles) for s in stages), workload, hw, nodes, per_node, eff)
    return PlanInput(
        problem, flow, roles, sources, r.get(top, "top level", "name", str, f"plan-{Path(flow).stem}"), names, launcher,
        r.get(top, "top level", "top", int, 5), source,
    )


def _lora(
    r: Reader, raw: Any, models: dict[str, ModelSpec], stages: tuple[Stage, ...]
) -> tuple[dict[str, ModelSpec], tuple[Stage, ...]]:
    """[lora] role = rank: those roles train adapters (ModelSpec.lora_rank). With LoRA on the actor
    the reference's passes run on the actor, adapters off (hfrt.flows.reference): no reference model."""
    t = r.section(raw, "[lora]", None)
    for role, rank in t.items():
        if role not in models:
            r.problem(f"[lora]: {role!r} is not a role with a model here ({', '.join(sorted(models))})")
        elif isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            r.problem(f"[lora] {role}: the LoRA rank must be an integer > 0, got {rank!r}")
        else:
            models[role] = dataclasses.replace(models[role], lora_rank=rank)
    if "actor" not in t or "reference" not in models or "actor" not in models:
        return models, stages
    moved = []
    for stage in stages:
        calls = dict(stage.calls)
        ops = calls.pop("reference", ())
        if ops:
            calls["actor"] = calls.get("actor", ()) + ops
        moved.append(Stage(stage.name, calls))
    return {role: m for role, m in models.items() if role != "reference"}, tuple(moved)


def _only(stage: Stage, models: dict[str, ModelSpec]) -> Stage:
    return Stage(stage.name, {role: ops for role, ops in stage.calls.items() if role in models})


def flow_stages(flow: str, r: Reader) -> tuple[tuple[Stage, ...], dict[str, dict[str, Any]]]:
    """The flow's STAGES (checked) and ROLES, from its module (built-in name or .py file)."""
    import importlib
    import importlib.util

    from hfrt.flows import BUILTIN

    try:
        if flow in BUILTIN:
            module: Any = importlib.import_module(BUILTIN[flow])
        elif flow.endswith(".py") and Path(flow).is_file():
            spec = importlib.util.spec_from_file_location(f"hfrt_plan_flow_{Path(flow).stem}", flow)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            r.problem(f"flow {flow!r}: not a built-in flow ({', '.join(sorted(BUILTIN))}) nor an existing .py file")
            return (), {}
    except Exception as exc:  # a user's flow file may fail in any way; name it
        r.problem(f"flow {flow!r}: cannot import it: {type(exc).__name__}: {exc}")
        return (), {}
    raw, roles = getattr(module, "STAGES", None), getattr(module, "ROLES", {})
    if raw is None:
        r.problem(f"flow {flow!r} declares no STAGES (a tuple of (stage name, {{role: (op, ...)}}))")
        return (), roles
    return parse_stages(raw, f"flow {flow!r} STAGES", r), roles


def parse_stages(raw: Any, where: str, r: Reader) -> tuple[Stage, ...]:
    stages = []
    for i, item in enumerate(raw if isinstance(raw, (list, tuple)) else [None]):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], dict)):
            r.problem(f"{where}: item {i} must be (stage name, {{role: (op, ...)}}), got {item!r}")
            continue
        calls = {}
        for role, ops in item[1].items():
            ops = (ops,) if isinstance(ops, str) else tuple(ops)
            bad = [o for o in ops if o not in OPS]
            if bad:
                r.problem(f"{where}: stage {item[0]!r} role {role!r}: unknown ops {bad} (known: {', '.join(OPS)})")
            calls[role] = ops
        stages.append(Stage(item[0], calls))
    return tuple(stages)


def _cluster(r: Reader, raw: Any) -> tuple[Hardware, int, int, tuple[str, ...], str]:
    w = "[cluster]"
    t = r.section(raw, w, {"hardware", "nodes", "devices_per_node", "node_names", "launcher", *_HW_OVERRIDES})
    name = r.choice(t, w, "hardware", tuple(HARDWARE), "H100")
    hw = HARDWARE[name]
    changes: dict[str, Any] = {}
    for key, (attr, scale) in _HW_OVERRIDES.items():
        if key in t:
            value = r.get(t, w, key, float, 0.0)
            if value <= 0:
                r.problem(f"{w}: {key} must be > 0 (got {value})")
            changes[attr] = int(value) if attr.startswith("max_") else value * scale
    hw = dataclasses.replace(hw, **changes)
    nodes, per_node = r.get(t, w, "nodes", int, 1), r.get(t, w, "devices_per_node", int, 8 if name != "cpu" else 2)
    if nodes < 1 or per_node < 1:
        r.problem(f"{w}: nodes and devices_per_node must be >= 1 (got {nodes}, {per_node})")
    local = name == "cpu" and nodes == 1
    names = tuple(r.get(t, w, "node_names", list, ["localhost"] if local else [f"node{i}" for i in range(nodes)]))
    if len(names) != nodes:
        r.problem(f"{w}: node_names has {len(names)} names for {nodes} nodes")
    launcher = r.choice(t, w, "launcher", ("local", "ssh", "slurm"), "local" if local else "ssh")
    return hw, max(nodes, 1), max(per_node, 1), names, launcher


def _workload(r: Reader, raw: Any) -> Workload:
    w = "[workload]"
    t = r.section(raw, w, {f.name for f in dataclasses.fields(Workload)})
    values = {f.name: r.get(t, w, f.name, int, f.default) for f in dataclasses.fields(Workload)}
    try:
        return Workload(**values)
    except ValueError as exc:
        r.problem(f"{w}: {exc}")
        return Workload()


def read_efficiency(r: Reader, raw: Any) -> Efficiency:
    w = "[efficiency]"
    t = r.section(raw, w, {f.name for f in dataclasses.fields(Efficiency)})
    values = {f.name: r.get(t, w, f.name, float, f.default) for f in dataclasses.fields(Efficiency)}
    for key, value in values.items():
        if value < 0 or (value == 0 and key != "call_s"):
            r.problem(f"{w}: {key} must be > 0 (got {value})")
            values[key] = getattr(Efficiency(), key)
    return Efficiency(**values)


def _models(
    r: Reader, raw: Any, flow_roles: dict[str, dict[str, Any]], source: str
) -> tuple[dict[str, ModelSpec], dict[str, str]]:
    """Each flow role's model: [models] first, else the flow's default options (model, or a
    function reward). Function roles are left out of the returned specs."""
    t = r.section(raw, "[models]", None)
    for role in sorted(set(t) - set(flow_roles)):
        r.problem(f"[models]: unknown role {role!r} (the flow's roles: {', '.join(flow_roles)})")
    models, sources = {}, {}
    for role, settings in flow_roles.items():
        options = settings.get("options", {}) if isinstance(settings, dict) else {}
        value = t.get(role, FUNCTION if options.get("kind") == FUNCTION else options.get("model"))
        where = f"[models] {role}"
        if value is None:
            r.problem(f"{where}: the flow gives no model for this role; name a preset ({', '.join(MODELS)}), a folder, or numbers")
            continue
        sources[role] = value if isinstance(value, str) else ""
        if value == FUNCTION:
            continue
        try:
            models[role] = resolve_model(value, role, source)
        except (ValueError, TypeError) as exc:
            r.problem(f"{where}: {exc}")
    return models, sources


def resolve_model(value: Any, role: str, source: str) -> ModelSpec:
    """A preset name, a Hugging Face folder (relative to the PLAN file), a Hub id (its config.json
    alone, from the Hub cache or downloaded: hfrt.wire.hub) or a table of numbers."""
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(ModelSpec)} - {"name"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown keys {unknown} (known: {', '.join(sorted(known))})")
        return ModelSpec(role, **value)
    if not isinstance(value, str):
        raise ValueError(f"must be a preset name, a folder, \"function\" or a table, got {value!r}")
    if value in MODELS:
        return MODELS[value]
    folder = Path(value).expanduser()
    if not folder.is_absolute():
        folder = Path(source).parent / folder if not folder.exists() else folder
    if folder.exists():
        return model_from_hf_config(folder)
    hub_id = hub.parse_hub_id(value)
    if hub_id is None:
        raise ValueError(f"{value!r} is neither a preset ({', '.join(MODELS)}), an existing folder nor {hub.HUB_ID_FORM}")
    return dataclasses.replace(model_from_hf_config(hub.config_file(hub_id)), name=value)
