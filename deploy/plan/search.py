"""Auto device mapping, the HybridFlow paper's Algorithm 1, procedure by procedure: get_placements,
get_min_alloc, enum_alloc, auto_parallel, simu and d_cost, and `search` that ties them together.

It knows roles, stages, devices and the cost model (deploy.plan_model); it does not read files or
write cluster specs (deploy.plan_cli does) and never starts anything. Search is kept fast by
memoising auto_parallel per (role, devices, memory budget) — the same role on the same number of
devices gets the same layout whatever the rest of the placement — and by skipping allocations that
cannot be laid out on whole nodes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from hfrt.deploy.plan.model import (
    Cost,
    Efficiency,
    Hardware,
    Layout,
    Memory,
    ModelSpec,
    Workload,
    activation_memory,
    forward_cost,
    generate_cost,
    kv_bytes_per_seq,
    static_memory,
    train_cost,
)

#: generate / forward / train a call's work; *_greedy on one sequence per prompt; forward_offpolicy
#: is a pass the flow skips when the update is one optimizer step (GRPO's old log-probs).
OPS = ("generate", "generate_greedy", "forward", "forward_greedy", "forward_offpolicy", "train")
BUDGET_STEPS = 64


@dataclass(frozen=True)
class Stage:
    """One stage of a step: the calls made at once, as role → ops (one role's ops run in turn)."""

    name: str
    calls: dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class Problem:
    """What to map: model roles (function roles take no device time and are left out), the flow's
    stages, the step's workload and a cluster of nodes × per_node devices."""

    models: dict[str, ModelSpec]
    stages: tuple[Stage, ...]
    workload: Workload
    hw: Hardware
    nodes: int
    per_node: int
    eff: Efficiency = Efficiency()

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node

    def trained(self, role: str) -> bool:
        return any("train" in s.calls.get(role, ()) for s in self.stages)

    def sizes(self) -> list[int]:
        """Device counts a colocated set may get: any up to a node, then whole nodes."""
        small = list(range(1, min(self.per_node, self.devices) + 1))
        return small + [k * self.per_node for k in range(2, self.nodes + 1)]


@dataclass(frozen=True)
class Choice:
    """auto_parallel's answer for one role on n devices: its training/inference layout, the actor's
    generation layout, memory per device, and its cost in each stage."""

    role: str
    layout: Layout
    gen: Layout | None
    static: float
    transient: tuple[float, ...]
    costs: tuple[Cost, ...]

    def seconds(self, eff: Efficiency) -> float:
        return sum(c.seconds(eff) for c in self.costs)


@dataclass(frozen=True)
class Mapping:
    """One candidate: colocated sets, devices per set, each role's choice, and predicted times."""

    placement: tuple[tuple[str, ...], ...]
    alloc: tuple[int, ...]
    choices: dict[str, Choice]
    stage_s: tuple[float, ...]
    memory: tuple[Memory, ...]

    @property
    def step_s(self) -> float:
        return sum(self.stage_s)


@dataclass
class Result:
    """The best mapping of each feasible placement, fastest first, and what the search cost."""

    ranked: list[Mapping]
    candidates_evaluated: int
    plan_s: float
    infeasible: list[str] = field(default_factory=list)


# -- Algorithm 1's procedures -----------------------------------------------------------------


def get_placements(roles: Sequence[str]) -> list[tuple[tuple[str, ...], ...]]:
    """Every partition of the roles into colocated sets (Bell(k) of them: 15 for 4 roles)."""
    if not roles:
        return [()]
    first, rest = roles[0], list(roles[1:])
    out: list[tuple[tuple[str, ...], ...]] = []
    for part in get_placements(rest):
        out.append(((first,), *part))
        for i in range(len(part)):
            out.append((*part[:i], (first, *part[i]), *part[i + 1:]))
    return out


def min_memory(p: Problem, role: str, n: int) -> Memory | None:
    """The least static and transient memory per device any layout of `role` on n devices needs."""
    layouts = candidate_layouts(p, role, n)
    if not layouts:
        return None
    trained = p.trained(role)
    static = min(static_memory(p.models[role], lay, trained, p.hw) for lay in layouts)
    transient = min(activation_memory(p.models[role], lay, p.workload, trained, p.hw) for lay in layouts)
    return Memory(static, transient)


def get_min_alloc(p: Problem, placement: tuple[tuple[str, ...], ...]) -> tuple[int, ...] | None:
    """The fewest devices each set needs so its roles' weights, grads, optimizer state and
    activations fit in device memory together; None when a set fits on no size."""
    out = []
    for group in placement:
        for n in p.sizes():
            mems = [min_memory(p, r, n) for r in group]
            if all(m is not None for m in mems):
                if sum(m.peak for m in mems if m) <= p.hw.memory_bytes:
                    out.append(n)
                    break
        else:
            return None
    return tuple(out)


def enum_alloc(p: Problem, a_min: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every way to give all N devices to the sets, each at least its minimum, that lays out on
    the nodes (sets of a node or less packed into nodes, larger sets on whole nodes)."""
    sizes = p.sizes()

    def rec(i: int, left: int) -> Iterator[tuple[int, ...]]:
        if i == len(a_min):
            if left == 0:
                yield ()
            return
        for n in sizes:
            if a_min[i] <= n <= left:
                for tail in rec(i + 1, left - n):
                    yield (n, *tail)

    for alloc in rec(0, p.devices):
        if layout_slots(p, alloc) is not None:
            yield alloc


def layout_slots(p: Problem, alloc: Sequence[int]) -> list[list[tuple[int, int]]] | None:
    """(node, device) slots per set: whole-node sets first, then smaller sets packed first-fit
    (largest first) into the remaining nodes, contiguous within one node; None if they do not fit."""
    slots: list[list[tuple[int, int]]] = [[] for _ in alloc]
    node = 0
    for i, n in enumerate(alloc):
        if n > p.per_node:
            slots[i] = [(node + k // p.per_node, k % p.per_node) for k in range(n)]
            node += n // p.per_node
    free = [0] * p.nodes
    for i in sorted((i for i, n in enumerate(alloc) if n <= p.per_node), key=lambda i: -alloc[i]):
        target = next((k for k in range(node, p.nodes) if free[k] + alloc[i] <= p.per_node), None)
        if target is None:
            return None
        slots[i] = [(target, free[target] + d) for d in range(alloc[i])]
        free[target] += alloc[i]
    return slots


def candidate_layouts(p: Problem, role: str, n: int) -> list[Layout]:
    """(pp, tp, dp) with pp·tp·dp = n: tp a power of two within a node dividing the heads, pp
    dividing the layers, each within the hardware's limits, and dp no more than the sequences of
    the role's smallest call (a data-parallel rank needs at least one)."""
    m = p.models[role]
    seqs = min(p.workload.batch(op) for s in p.stages for op in s.calls.get(role, ()))
    out = []
    tp = 1
    while tp <= min(p.hw.max_tp, p.per_node, n):
        if m.heads % tp == 0 and n % tp == 0:
            for pp in range(1, min(p.hw.max_pp, m.layers) + 1):
                if m.layers % pp == 0 and (n // tp) % pp == 0 and n // (tp * pp) <= seqs:
                    out.append(Layout(pp, tp, n // (tp * pp)))
        tp *= 2
    return out


def gen_layouts(p: Problem, role: str, train: Layout) -> list[Layout]:
    """Generation layouts the 3D-HybridEngine can reach from `train`: pp 1, tp a power of two
    dividing the training tp·pp (and the heads), dp the rest."""
    m = p.models[role]
    group = train.tp * train.pp
    out, tp = [], 1
    seqs = min((p.workload.batch(op) for s in p.stages for op in s.calls.get(role, ()) if op.startswith("generate")), default=1)
    while tp <= min(group, p.per_node):
        if group % tp == 0 and m.heads % tp == 0 and train.devices // tp <= seqs:
            out.append(Layout(1, tp, train.devices // tp))
        tp *= 2
    return out


def simu(p: Problem, role: str, op: str, layout: Layout, gen: Layout | None, kv_budget: float) -> Cost | None:
    """One call's cost: generate (prefill + bandwidth-bound decode + transition), forward, or
    train (forward, backward, optimizer, TP/PP/DP communication). None if it cannot run."""
    m, w = p.models[role], p.workload
    if op.startswith("generate"):
        if gen is None:
            return None
        return generate_cost(m, layout, gen, w, op, p.hw, p.per_node, kv_budget)
    if op == "train":
        return train_cost(m, layout, w, p.hw, p.per_node)
    if op == "forward_offpolicy" and w.ppo_epochs * w.ppo_mini_batches == 1:
        return Cost()
    return forward_cost(m, layout, w, op, p.hw, p.per_node)


def auto_parallel(p: Problem, role: str, n: int, budget: float, layouts: list[Layout] | None = None) -> Choice | None:
    """The fastest layout of `role` on n devices (and, for the actor, generation layout) whose
    memory fits `budget` bytes per device; None if none fits. `layouts` narrows the candidates
    (calibration prices a run's own layout)."""
    trained = p.trained(role)
    ops = [s.calls.get(role, ()) for s in p.stages]
    generates = any(o.startswith("generate") for stage in ops for o in stage)
    best: Choice | None = None
    for layout in candidate_layouts(p, role, n) if layouts is None else layouts:
        static = static_memory(p.models[role], layout, trained, p.hw)
        act = activation_memory(p.models[role], layout, p.workload, trained, p.hw)
        if static + act > budget:
            continue
        for gen in gen_layouts(p, role, layout) if generates else [None]:
            choice = _evaluate(p, role, layout, gen, ops, static, act, budget)
            if choice is not None and (best is None or choice.seconds(p.eff) < best.seconds(p.eff)):
                best = choice
    return best


def _evaluate(
    p: Problem, role: str, layout: Layout, gen: Layout | None, ops: list[tuple[str, ...]], static: float, act: float,
    budget: float,
) -> Choice | None:
    costs, transient = [], []
    kv_budget = budget - static
    for stage_ops in ops:
        total, peak = Cost(), 0.0
        for op in stage_ops:
            c = simu(p, role, op, layout, gen, kv_budget)
            if c is None:
                return None
            total += c
            peak = max(peak, _kv_used(p, role, gen, op, kv_budget) if op.startswith("generate") else act)
        costs.append(total)
        transient.append(peak)
    return Choice(role, layout, gen, static, tuple(transient), tuple(costs))


def _kv_used(p: Problem, role: str, gen: Layout | None, op: str, kv_budget: float) -> float:
    if gen is None:
        return 0.0
    need = math.ceil(p.workload.batch(op) / gen.dp) * kv_bytes_per_seq(p.models[role], gen, p.workload, p.hw)
    return min(need, kv_budget)


def d_cost(p: Problem, placement: tuple[tuple[str, ...], ...], choices: dict[str, Choice]) -> tuple[float, ...]:
    """Per stage: the max over colocated sets of the sum of their roles' times in it (roles in
    one set take turns on its devices; sets run at once). The step time is the sum."""
    out = []
    for i in range(len(p.stages)):
        out.append(max(sum(choices[r].costs[i].seconds(p.eff) for r in group) for group in placement))
    return tuple(out)


# -- the search -------------------------------------------------------------------------------


class _Memo:
    """auto_parallel and min_memory answers, reused across placements and allocations."""

    def __init__(self, p: Problem) -> None:
        self.p = p
        self.choices: dict[tuple[str, int, int], Choice | None] = {}
        self.mins: dict[tuple[str, int], Memory | None] = {}

    def min_peak(self, role: str, n: int) -> float:
        if (role, n) not in self.mins:
            self.mins[role, n] = min_memory(self.p, role, n)
        m = self.mins[role, n]
        return math.inf if m is None else m.peak

    def budgets(self, group: Sequence[str], n: int) -> dict[str, float]:
        """Each role's share of device memory: its least need, plus the room left over shared
        in proportion to those needs (so the set's roles fit together whatever each picks)."""
        need = {r: self.min_peak(r, n) for r in group}
        total = sum(need.values())
        if not math.isfinite(total) or total <= 0:
            return {r: self.p.hw.memory_bytes for r in group} if total == 0 else {r: 0.0 for r in group}
        return {r: self.p.hw.memory_bytes * v / total for r, v in need.items()}

    def choice(self, role: str, n: int, budget: float) -> Choice | None:
        """Budgets are rounded down to 1/64 of device memory, so near-equal ones share an answer."""
        step = self.p.hw.memory_bytes / BUDGET_STEPS
        key = (role, n, int(budget // step))
        if key not in self.choices:
            self.choices[key] = auto_parallel(self.p, role, n, key[2] * step)
        return self.choices[key]


def set_memory(p: Problem, group: Sequence[str], choices: dict[str, Choice]) -> Memory:
    """A set's bytes per device: every role's static memory, plus the largest stage's transients
    (roles of a set called in one stage run at once)."""
    static = sum(choices[r].static for r in group)
    transient = max((sum(choices[r].transient[i] for r in group) for i in range(len(p.stages))), default=0.0)
    return Memory(static, transient)


def evaluate_alloc(p: Problem, memo: _Memo, placement: tuple[tuple[str, ...], ...], alloc: tuple[int, ...]) -> Mapping | None:
    """Lines 11–17 of Algorithm 1: auto_parallel every role of every set, then d_cost."""
    choices: dict[str, Choice] = {}
    for group, n in zip(placement, alloc, strict=True):
        for role, budget in memo.budgets(group, n).items():
            c = memo.choice(role, n, budget)
            if c is None:
                return None
            choices[role] = c
    memory = tuple(set_memory(p, g, choices) for g in placement)
    if any(m.peak > p.hw.memory_bytes * 1.0001 for m in memory):
        return None
    return Mapping(placement, alloc, choices, d_cost(p, placement, choices), memory)


def search(p: Problem) -> Result:
    """Algorithm 1: for every placement, every allocation from its minimum; keep the best per
    placement and rank the placements by predicted step time."""
    start = time.perf_counter()
    memo = _Memo(p)
    ranked: list[Mapping] = []
    infeasible: list[str] = []
    evaluated = 0
    for placement in get_placements(list(p.models)):
        a_min = get_min_alloc(p, placement)
        best: Mapping | None = None
        if a_min is not None:
            for alloc in enum_alloc(p, a_min):
                evaluated += 1
                m = evaluate_alloc(p, memo, placement, alloc)
                if m is not None and (best is None or m.step_s < best.step_s):
                    best = m
        if best is None:
            infeasible.append(_why_not(p, placement, a_min))
        else:
            ranked.append(best)
    ranked.sort(key=lambda m: m.step_s)
    return Result(ranked, evaluated, time.perf_counter() - start, infeasible)


def _why_not(p: Problem, placement: tuple[tuple[str, ...], ...], a_min: tuple[int, ...] | None) -> str:
    name = " | ".join("+".join(g) for g in placement)
    if len(placement) > p.devices:
        return f"{name} (more sets than devices)"
    if a_min is None:
        return f"{name} (a set does not fit device memory)"
    return f"{name} (no allocation of {p.devices} devices fits memory and the nodes)"
