"""The `agent_calc` flow: GRPO on multi-turn, tool-using rollouts of the addition task. The policy
may write `<calc>EXPR</calc>`; the agent loop runs the calculator and appends `[RESULT]` (masked out
of training); the policy then answers. Reward: 1 when the answer (the text after the last tool
output) starts with the right sum, else 0.

A step: push the actor's weights to the rollout role → run the agents (turns batched on the rollout
role, token-in/token-out) → trajectories assembled into a rollout batch on the rollout daemons →
(reference log-probs ∥ reward) → advantages → actor update. With `agent_on = "actor"` the turns
run on the actor's own generation engine instead (colocated, verl's AgentLoop on the hybrid
engine): no rollout daemon is launched, no weights are sent anywhere, the actor stays in its
generation phase across a step's turns (one weight push into its generation engine per step) and
goes back to training for the update. It knows endpoints, not engines.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from typing import Any

from .agent import AgentConfig, AgentFn, Conversation, agent_metrics, assemble, run_agents
from .async_rollout import WeightSync
from .common import CALL_TIMEOUT_S, StageTimer, get_roles, non_tensor, reduce_rank_metrics, step_metrics
from .grpo import GRPOFlowConfig, actor_loss_options
from .grpo import ROLES as GRPO_ROLES
from .tasks import leading_number
from .trainer import Trainer, sampling_seed

#: where the agent loop's turns run: a separate rollout role (weights synced to it every step), or
#: the actor's own generation engine (colocated)
AGENT_ON = ("rollout", "actor")
#: grpo's roles, a rollout daemon for the turns (not launched with agent_on = "actor", see
#: roles_for), and the reward role reading the agents' rewards.
ROLES: dict[str, dict[str, Any]] = {
    **GRPO_ROLES,
    "rollout": {"impl": "rollout", "options": {"model": "tiny", "sampling": {"top_k": 0}}},
    "reward": {"impl": "reward", "options": {"kind": "function", "function": "hfrt.flows.agent:agent_reward"}},
}
CALL = re.compile(r"<calc>([^<>]{0,40})</calc>$")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> int:
    """+, - and * of integers (ValueError on anything else)."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return int(OPS[type(node.op)](value(node.left), value(node.right)))
        raise ValueError(f"calculator: {expression!r} is not +, - or * of integers")
    return value(ast.parse(expression.strip(), mode="eval").body)


async def calc_agent(conv: Conversation, sample: dict[str, Any], *, max_calls: int = 2) -> float:
    """Generate until a turn ends outside a tool call; run each `<calc>…</calc>` and append its result."""
    segment, calls = "", 0
    while True:
        turn = await conv.generate(stop=[">", "\n"])
        segment += turn.text
        found = CALL.search(segment)
        if found and calls < max_calls:
            result = await conv.tool(calculator, found.group(1), timeout_s=2.0)
            conv.add(f"[{result}]")
            segment, calls = "", calls + 1
        elif not segment.endswith("<calc>") or not turn.ids:
            break
    sample["tool_calls"] = calls
    got = leading_number(segment)
    return 1.0 if got is not None and got == int(sample["ground_truth"]) else 0.0


@dataclass(frozen=True)
class AgentCalcConfig(GRPOFlowConfig):
    """grpo's settings (max_new_tokens per turn) plus max_total_tokens per conversation (prompt
    included), max_turns and sample_timeout_s (a sample running longer ends with an error), and
    agent_on: "rollout" (default; the turns on the rollout role, weights synced to it each step)
    or "actor" (the turns on the actor's generation engine; the run has no rollout role)."""

    steps: int = 300
    n: int = 8
    prompts_per_step: int = 8
    max_new_tokens: int = 8
    max_total_tokens: int = 48
    max_turns: int = 6
    sample_timeout_s: float = 60.0
    agent_on: str = "rollout"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.agent_on not in AGENT_ON:
            raise ValueError(f"config agent_on={self.agent_on!r}: use one of {', '.join(AGENT_ON)}")
        if self.val_every:
            raise ValueError(f"config val_every={self.val_every}: agent_calc has no validation pass (its reward comes from the agent loop); use 0")
        if self.max_total_tokens < 2 or self.max_turns < 1:
            raise ValueError(f"config max_total_tokens={self.max_total_tokens}, max_turns={self.max_turns}: need at least 2 and 1")

    def agent(self, step: int) -> AgentConfig:
        return AgentConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                           max_total_tokens=self.max_total_tokens, max_turns=self.max_turns,
                           sample_timeout_s=self.sample_timeout_s, seed=sampling_seed(self, step))


Config = AgentCalcConfig


def roles_for(config: dict[str, Any], roles: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The roles a run launches (read by hfrt.flows.load_flow): all of them, but no rollout role
    with agent_on = "actor". A tool flow built on agent_grpo re-exports it with ROLES and Config."""
    if config.get("agent_on", "rollout") == "actor":
        return {name: settings for name, settings in roles.items() if name != "rollout"}
    return roles


async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
    return await agent_grpo(ctl, config, calc_agent)


async def agent_grpo(ctl: Any, config: dict[str, Any], agent: AgentFn, *, config_cls: type[AgentCalcConfig] = AgentCalcConfig) -> dict[str, Any]:
    """GRPO over `agent`'s trajectories, with this module's ROLES: what a user's tool flow calls
    (`async def flow(ctl, config): return await agent_grpo(ctl, config, my_agent)`). The turns and
    the assembly run on the rollout role, or on the actor itself with config agent_on = "actor"
    (metrics agent/weight_pushes, agent/weight_version)."""
    cfg = config_cls.read(config)
    if cfg.agent_on == "actor":
        roles = await get_roles(ctl, "actor", "reference", "reward")
        pushes = PushCounter(roles["actor"])
        return await Trainer(ctl, cfg, roles).run(
            lambda step, prompts: agent_step(cfg, step, prompts, roles["actor"], agent, None, pushes, **roles))
    roles = await get_roles(ctl, "actor", "rollout", "reference", "reward")
    sync = WeightSync(roles["actor"], roles["rollout"])
    train = {k: v for k, v in roles.items() if k != "rollout"}
    return await Trainer(ctl, cfg, roles).run(
        lambda step, prompts: agent_step(cfg, step, prompts, roles["rollout"], agent, sync, None, **train))


class PushCounter:
    """agent/weight_pushes for a step on the actor: how many times the actor pushed its weights into
    its generation engine since the previous step (1 per step however many turns it ran)."""

    def __init__(self, actor: Any) -> None:
        self.actor, self.seen = actor, 0

    async def since_last(self) -> dict[str, float]:
        [first, *_] = await self.actor.hybrid_phase(timeout_s=CALL_TIMEOUT_S)
        count, self.seen = int(first["to_generate"]) - self.seen, int(first["to_generate"])
        return {"agent/weight_pushes": float(count), "agent/weight_version": float(first["weight_version"])}


async def agent_step(cfg: AgentCalcConfig, step: int, prompts: Any, generator: Any, agent: AgentFn, sync: WeightSync | None,
                     pushes: PushCounter | None, *, actor: Any, reference: Any, reward: Any) -> dict[str, Any]:
    """One step on a batch of prompts (each row sampled n times, a sample dict of its columns
    and a `uid` per prompt); its metrics, agent/* included (agent/tool_calls_mean from the
    samples' `tool_calls` where the agent sets it). `generator`: the role the turns and the
    assembly run on (the rollout role, weights pushed by `sync` first; or the actor itself)."""
    t, kw = StageTimer(), {"timeout_s": CALL_TIMEOUT_S}
    info: dict[str, Any] = {}
    if sync is not None:
        await sync.publish(step)
        info = await t.one("sync", sync.drain())
    names = [name for name in prompts.shards[0].non_tensor if name != "uid"]
    rows = [dict(zip(names, values, strict=True)) for values in zip(*(non_tensor(prompts, c) for c in names), strict=True)]
    samples = [row | {"uid": f"{step}-{i}"} for i, row in enumerate(rows) for _ in range(cfg.n)]
    trajectories = await t.one("generate", run_agents(generator, agent, samples, cfg.agent(step)))
    batch = await t.one("assemble", assemble(generator, trajectories, carry=(*names, "uid", "tool_calls")))
    if pushes is not None:
        info |= await pushes.since_last()
    ref, scores = await t.together("stage2", ref_log_prob=reference.compute_log_prob(batch, **kw), reward=reward.score(batch, **kw))
    old = [] if cfg.on_policy(len(batch)) else [await t.one("old_log_prob", actor.compute_log_prob(batch, **kw))]
    adv = await t.one("advantages", actor.compute_advantages(
        batch, scores, *old, ref, estimator="grpo", norm_adv_by_std=cfg.norm_adv_by_std, **kw))
    ranks = await t.one("update", actor.update(batch, *old, ref, adv, **actor_loss_options(cfg), **kw))
    calls = [float(tr.sample.get("tool_calls") or 0) for tr in trajectories]
    extra = agent_metrics(trajectories) | {"agent/tool_calls_mean": sum(calls) / max(len(calls), 1)} | info
    return step_metrics(t, scores, batch, adv.meta["metrics"], reduce_rank_metrics(ranks)) | extra
