"""Each built-in RL recipe's STAGES (what `hfrt plan` prices) against the calls one real step makes.

One step of each recipe runs through `load_flow(name).run` on a recording controller: its role
groups answer every endpoint with a batch of the right shape and record (stage, role, op), where the
stage is the StageTimer name the call was awaited under and the op is what `hfrt plan` calls it
(generate, forward, train; *_greedy for a greedy generation and what is computed on it). A second
run with ppo_epochs=2 shows which forward passes the recipe skips when the update is on-policy:
those are STAGES' forward_offpolicy. The stage names every StageTimer of the step recorded are
STAGES' names plus the unpriced ones (hfrt.flows.timing.UNPRICED), all of them Stage members: a
stage renamed on one side only, or timed under a string of its own, fails here. No daemon, no torch.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
from collections import Counter
from typing import Any

import pytest

from hfrt.flows import load_flow
from hfrt.flows.timing import UNPRICED, Stage, StageTimer
from hfrt.protocols import BatchHandle

#: the RL recipes that declare STAGES (ping runs no RL step; agent_calc's turns are not planned)
RECIPES = ("ppo", "grpo", "rloo", "reinforce_pp", "remax", "safe_rlhf", "dapo", "grpo_async", "distill", "distill_async")
#: one quiet step: no validation, no files, few prompts
QUIET = {"steps": 1, "prompts_per_step": 2, "val_every": 0, "progress": "off", "tensorboard": False,
         "export_hf": False, "run_dir": ""}
#: endpoint → the op `hfrt plan` prices (endpoints absent here cost nothing in the plan)
OPS = {"generate": "generate", "generate_partial": "generate", "compute_log_prob": "forward",
       "compute_values": "forward", "score": "forward", "update": "train"}
Call = tuple[str | None, str, str]  # (stage, role, op)
#: every StageTimer made since the last one_step began (the stages it recorded: `timer.stages`)
TIMERS: list[StageTimer] = []


class Recorded:
    """One endpoint call: awaitable once, its stage set by the StageTimer that awaits it."""

    def __init__(self, log: list[Recorded], role: str, op: str | None, result: Any) -> None:
        self.role, self.op, self.result, self.stage = role, op, result, None
        log.append(self)

    def __await__(self) -> Any:
        yield from asyncio.sleep(0).__await__()
        return self.result


class Role:
    """A role group whose endpoints answer at once with batches shaped like the real ones."""

    def __init__(self, name: str, ctl: RecordingController) -> None:
        self.name, self.ctl, self.world_size, self.endpoints = name, ctl, 1, {}

    def __getattr__(self, endpoint: str) -> Any:
        if endpoint.startswith("_"):
            raise AttributeError(endpoint)
        return lambda *args, **kwargs: self.ctl.call(self.name, endpoint, args, kwargs)


class RecordingController:
    """Enough of Controller for a flow's step: role groups, stats, no recovery."""

    recovery = None

    def __init__(self) -> None:
        self.calls: list[Recorded] = []
        self.greedy: list[BatchHandle] = []  # rollouts generated greedily: what is computed on them is *_greedy
        self.uids = itertools.count()

    async def role(self, name: str, timeout_s: float = 0.0) -> Role:
        return Role(name, self)

    def stats(self) -> dict[str, Any]:
        return {"controller_bulk_bytes": 0}

    def call(self, role: str, endpoint: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Recorded:
        batch = args[0] if args and isinstance(args[0], BatchHandle) else None
        op = OPS.get(endpoint)
        greedy = endpoint.startswith("generate") and kwargs.get("temperature") == 0.0
        if op is not None and (greedy or any(batch is g for g in self.greedy)):
            op += "_greedy"
        result = self.result(endpoint, batch, kwargs)
        if greedy:
            self.greedy.append(result)
        return Recorded(self.calls, role, op, result)

    def result(self, endpoint: str, batch: BatchHandle | None, kwargs: dict[str, Any]) -> Any:
        rows = len(batch) if batch is not None else 0
        if endpoint in ("generate", "generate_partial"):
            return self.rollout(batch, int(kwargs.get("n", 1)))
        if endpoint == "score":  # scores that differ within every group (DAPO keeps them all)
            values = [float(i % 2) for i in range(rows)]
            return BatchHandle.inline({"score": values, "cost": values, "score_error": [""] * rows})
        if endpoint == "compute_advantages":
            return BatchHandle.inline({"advantages": [0.0] * rows}, {"metrics": {}})
        if endpoint == "update":
            return [{"loss": 0.0}]
        if endpoint == "publish_weights":
            return [{"timing/publish_s": 0.0}]
        if endpoint == "load_weights":
            return [{"timing/load_s": 0.0, "bytes": 0, "buckets": 1}]
        return BatchHandle.inline({"values": [0.0] * rows})

    def rollout(self, prompts: BatchHandle, n: int) -> BatchHandle:
        """n samples per prompt, adjacent, sharing the prompt's uid; weight version 0."""
        uids = [u for shard in prompts.shards for u in shard.non_tensor.get("uid", [])]
        uids = uids or [f"p{next(self.uids)}" for _ in range(len(prompts))]
        rows = [u for u in uids for _ in range(n)]
        return BatchHandle.inline({"uid": rows, "weight_version": [0] * len(rows)}, {"response_tokens": float(len(rows))})


@pytest.fixture(autouse=True)
def stage_of_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """StageTimer marks each Recorded call it awaits with its stage's name."""
    one, together = StageTimer.one, StageTimer.together

    def mark(call: Any, stage: str) -> None:
        if isinstance(call, Recorded) and call.stage is None:
            call.stage = stage

    async def one_marked(self: StageTimer, name: str, call: Any) -> Any:
        mark(call, name)
        return await one(self, name, call)

    async def together_marked(self: StageTimer, stage: str, **calls: Any) -> list[Any]:
        for call in calls.values():
            mark(call, stage)
        return await together(self, stage, **calls)

    init = StageTimer.__init__

    def init_kept(self: StageTimer) -> None:
        init(self)
        TIMERS.append(self)

    monkeypatch.setattr(StageTimer, "one", one_marked)
    monkeypatch.setattr(StageTimer, "together", together_marked)
    monkeypatch.setattr(StageTimer, "__init__", init_kept)


def one_step(name: str, **settings: Any) -> tuple[Counter[Call], list[str | None]]:
    """(stage, role, op) of every priced call one step of the recipe makes, and their stages in
    the order the calls were sent."""
    ctl = RecordingController()
    TIMERS.clear()
    asyncio.run(asyncio.wait_for(load_flow(name).run(ctl, QUIET | settings), timeout=30))
    priced = [c for c in ctl.calls if c.op is not None]
    return Counter((c.stage, c.role, c.op) for c in priced), [c.stage for c in priced]


def real_calls(name: str) -> tuple[Counter[Call], list[str | None]]:
    """One step's calls, the forward passes made only off-policy (ppo_epochs=2) as
    forward_offpolicy; and the stages in call order (off-policy)."""
    (on, _), (off, order) = one_step(name), one_step(name, ppo_epochs=2)
    assert not on - off, f"{name}: calls made on-policy only: {on - off}"
    extra = off - on
    assert all(op == "forward" for _, _, op in extra), f"{name}: off-policy adds more than forward passes: {extra}"
    return on + Counter({(stage, role, "forward_offpolicy"): k for (stage, role, _), k in extra.items()}), order


def declared(name: str) -> list[Call]:
    module = importlib.import_module(f"hfrt.flows.recipes.{name}")
    return [(stage, role, op) for stage, calls in module.STAGES for role, ops in calls.items() for op in ops]


@pytest.mark.parametrize("name", RECIPES)
def test_stages_match_the_calls_of_one_step(name: str) -> None:
    (calls, order), stages = real_calls(name), declared(name)
    # every priced call is declared, and nothing more (per role and op)
    assert Counter((r, o) for _, r, o in calls.elements()) == Counter((r, o) for _, r, o in stages), name
    # a call awaited under a declared stage's name is declared in that stage (remax's greedy calls,
    # timed as greedy_generate / greedy_reward, run beside the declared stages they are listed in)
    names = list(dict.fromkeys(stage for stage, _, _ in stages))
    misplaced = [c for c in calls if c[0] in names and c not in stages]
    assert not misplaced, f"{name}: calls in another stage than STAGES says: {misplaced}"
    # the declared stages come in the order the step first calls into them
    seen = list(dict.fromkeys(stage for stage in order if stage in names))
    assert seen == [stage for stage in names if stage in seen], f"{name}: stages called in the order {seen}"


def timed_stages(name: str, **settings: Any) -> list[str]:
    """The stage names the StageTimers of one step recorded, in the order they first began."""
    one_step(name, **settings)
    return list(dict.fromkeys(stage for timer in TIMERS for stage in timer.stages))


@pytest.mark.parametrize("name", RECIPES)
def test_the_timer_records_exactly_the_declared_stages(name: str) -> None:
    declared = [stage for stage, _ in importlib.import_module(f"hfrt.flows.recipes.{name}").STAGES]
    assert all(isinstance(stage, Stage) for stage in declared), declared
    assert not set(declared) & UNPRICED, f"{name}: an unpriced stage is declared"
    timed = timed_stages(name) + timed_stages(name, ppo_epochs=2)  # off-policy: the old log-probs pass too
    strays = [stage for stage in timed if not isinstance(stage, Stage)]
    assert strays == [], f"{name}: stages timed under names of their own, not Stage members: {strays}"
    assert set(timed) - UNPRICED == set(declared), f"{name}: timed {sorted(set(timed))}, STAGES {declared}"


def test_a_stage_renamed_on_one_side_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: rloo timing its stage 2 under a name of its own fails it."""
    together = StageTimer.together

    async def renamed(self: StageTimer, stage: str, **calls: Any) -> list[Any]:
        return await together(self, "experience" if stage == Stage.STAGE2 else stage, **calls)

    monkeypatch.setattr(StageTimer, "together", renamed)
    with pytest.raises(AssertionError, match=r"rloo: stages timed under names of their own.*experience"):
        test_the_timer_records_exactly_the_declared_stages("rloo")


def test_every_rl_recipe_with_stages_is_checked() -> None:
    from hfrt.flows import BUILTIN

    with_stages = {n for n, module in BUILTIN.items() if hasattr(importlib.import_module(module), "STAGES")}
    assert with_stages == set(RECIPES)
