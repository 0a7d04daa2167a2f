"""agent_grpo: GRPO over the trajectories of a user's agent function (hfrt.flows.agent.loop), with
its config (AgentGRPOConfig, which tool flows import as `Config`), roles and step functions.

A step: push the actor's weights to the rollout role → run the agents (turns batched on the rollout
role, token-in/token-out) → trajectories assembled into a rollout batch on the rollout daemons →
(reference log-probs ∥ reward) → advantages → actor update. With `agent_on = "actor"` the turns
run on the actor's own generation engine instead (colocated, verl's AgentLoop on the hybrid
engine): no rollout daemon is launched, no weights are sent anywhere, the actor stays in its
generation phase across a step's turns (one weight push into its generation engine per step) and
goes back to training for the update. With `max_staleness` ≥ 1 (agent_on = "rollout" only) the
agents of the next steps run ahead on the rollout role while the actor trains (AReaL / slime style
agentic async RL): a RolloutPipeline whose rollout is "run the agents and assemble"; each
sample's `weight_version` is its oldest turn's, so staleness, tis_cap and decoupled PPO work as in
grpo_async. It knows endpoints, not engines, and no agent: the agent function is the caller's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hfrt.flows.agent.loop import AGENT_COLUMNS, AgentConfig, AgentFn, Trajectory, agent_metrics, assemble, run_agents
from hfrt.flows.async_steps import PipelinedSteps, check_pipeline_settings, run_and_close
from hfrt.flows.batches import non_tensor
from hfrt.flows.grpo_family import GRPO_ROLES, ROLLOUT_ROLE, GRPOFlowConfig, train_on
from hfrt.flows.pipeline import StalenessPolicy, WeightSync
from hfrt.flows.timing import Stage, StageTimer
from hfrt.flows.trainer import Trainer, get_roles, sampling_seed
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Reference, Reward, Rollout, Turns

#: where the agent loop's turns run: a separate rollout role (weights synced to it every step), or
#: the actor's own generation engine (colocated)
AGENT_ON = ("rollout", "actor")
#: grpo's roles, a rollout daemon for the turns (not launched with agent_on = "actor", see
#: roles_for), and the reward role reading the agents' rewards (a reward function may also declare
#: the other columns an agent rollout carries: row_fields).
ROLES: dict[str, dict[str, Any]] = {
    **GRPO_ROLES,
    "rollout": ROLLOUT_ROLE,
    "reward": {"impl": "reward", "options": {"kind": "function", "function": "hfrt.flows.agent.loop:agent_reward",
                                             "row_fields": list(AGENT_COLUMNS)}},
}


@dataclass(frozen=True)
class AgentGRPOConfig(GRPOFlowConfig):
    """grpo's settings plus the agent's bounds and where its turns run; with max_staleness ≥ 1 the
    agents of later steps run while the actor trains, bounded as in grpo_async (GRPOAsyncConfig)."""

    steps: int = 300
    n: int = 8
    prompts_per_step: int = 8
    #: new tokens per turn at most
    max_new_tokens: int = 8
    #: tokens per conversation at most, prompt included
    max_total_tokens: int = 48
    #: model turns per conversation at most
    max_turns: int = 6
    #: seconds one sample may run; a sample running longer ends with an error
    sample_timeout_s: float = 60.0
    #: "rollout": the turns on the rollout role, weights synced to it each step; "actor": the turns
    #: on the actor's generation engine (the run has no rollout role)
    agent_on: str = "rollout"
    #: policy versions a sample may lag behind the actor (agent_on = "rollout"; 0: the synchronous step)
    max_staleness: int = 0
    #: "wait": agents never run further ahead than max_staleness; "drop": rollout_ahead rollouts
    #: stay in flight and samples found too old are generated again
    stale_policy: str = "wait"
    #: rollouts in flight under "drop" (-1: max_staleness)
    rollout_ahead: int = -1
    #: under "drop", too-old prompt groups are dropped one by one; when fewer than this share of a
    #: step's groups survive, the dropped prompts are generated again
    stale_min_keep: float = 0.5
    #: the weight sync's bucket size, in MiB
    sync_bucket_mb: float = 64.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.agent_on not in AGENT_ON:
            raise ValueError(f"config agent_on={self.agent_on!r}: use one of {', '.join(AGENT_ON)}")
        if self.agent_on == "actor" and self.max_staleness > 0:
            raise ValueError(
                f"config max_staleness={self.max_staleness} with agent_on=actor: the colocated actor cannot "
                "run agents while it trains; use agent_on=rollout for asynchronous agent rollouts, or max_staleness=0")
        check_pipeline_settings(self)
        if self.val_every or self.val_only:
            key = f"val_every={self.val_every}" if self.val_every else "val_only=true"
            raise ValueError(f"config {key}: agent_calc has no validation pass (its reward comes from the agent loop); "
                             "use val_every=0, val_only=false")
        if self.max_total_tokens < 2 or self.max_turns < 1:
            raise ValueError(f"config max_total_tokens={self.max_total_tokens}, max_turns={self.max_turns}: need at least 2 and 1")

    def agent(self, step: int) -> AgentConfig:
        return AgentConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                           max_total_tokens=self.max_total_tokens, max_turns=self.max_turns,
                           sample_timeout_s=self.sample_timeout_s, seed=sampling_seed(self, step))

    def staleness(self) -> StalenessPolicy:
        return StalenessPolicy(self.max_staleness, self.stale_policy, self.rollout_ahead, self.stale_min_keep)


#: the name tool flows and the agent_calc recipe have imported it by
AgentCalcConfig = AgentGRPOConfig


def roles_for(config: dict[str, Any], roles: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The roles a run launches (read by hfrt.flows.load_flow): all of them, but no rollout role
    with agent_on = "actor". A tool flow built on agent_grpo re-exports it with ROLES and Config."""
    if config.get("agent_on", "rollout") == "actor":
        return {name: settings for name, settings in roles.items() if name != "rollout"}
    return roles


async def agent_grpo(
    ctl: Any, config: AgentGRPOConfig | dict[str, Any], agent: AgentFn, *, config_cls: type[AgentGRPOConfig] = AgentGRPOConfig,
) -> dict[str, Any]:
    """GRPO over `agent`'s trajectories, with this module's ROLES: what a user's tool flow calls
    (`async def flow(ctl, config): return await agent_grpo(ctl, config, my_agent)`). The turns and
    the assembly run on the rollout role, or on the actor itself with config agent_on = "actor"
    (metrics agent/weight_pushes, agent/weight_version). With config max_staleness ≥ 1 the agents
    of later steps run on the rollout role while the actor trains (metrics async/*, sync/*)."""
    cfg = config_cls.read(config)
    needed = ("actor", "reference", "reward") if cfg.agent_on == "actor" else ("actor", "rollout", "reference", "reward")
    roles = await get_roles(ctl, *needed)
    trainer = Trainer(ctl, cfg, roles)
    return await run_and_close(trainer, step_function(cfg, roles, trainer, agent))


def step_function(cfg: AgentGRPOConfig, roles: dict[str, Any], trainer: Trainer, agent: AgentFn) -> AgentSteps | AsyncAgentSteps:
    """agent_grpo's step function for these settings (call it with (step, prompts), as Trainer
    does; then `close()`): synchronous with max_staleness = 0, the rollout pipeline beyond."""
    if cfg.max_staleness > 0:
        return AsyncAgentSteps(cfg, roles, trainer, agent)
    return AgentSteps(cfg, roles, agent)


class AgentSteps:
    """The synchronous step (max_staleness = 0): agent_step with the turns on the rollout role
    (weights pushed to it first) or, with agent_on = "actor", on the actor itself."""

    def __init__(self, cfg: AgentGRPOConfig, roles: dict[str, Any], agent: AgentFn) -> None:
        self.cfg, self.agent = cfg, agent
        self.actor: Actor = roles["actor"]
        self.reference: Reference = roles["reference"]
        self.reward: Reward = roles["reward"]
        self.generator: Turns = roles["actor"] if cfg.agent_on == "actor" else roles["rollout"]
        self.sync = None if cfg.agent_on == "actor" else WeightSync(roles["actor"], roles["rollout"])
        self.pushes = PushCounter(roles["actor"]) if cfg.agent_on == "actor" else None

    async def __call__(self, step: int, prompts: BatchHandle) -> dict[str, Any]:
        return await agent_step(self.cfg, step, prompts, self.generator, self.agent, self.sync, self.pushes,
                                actor=self.actor, reference=self.reference, reward=self.reward)

    async def close(self, *, abort: bool = False) -> None:
        """Nothing runs between steps."""


class PushCounter:
    """agent/weight_pushes for a step on the actor: how many times the actor pushed its weights into
    its generation engine since the previous step (1 per step however many turns it ran)."""

    def __init__(self, actor: Actor) -> None:
        self.actor, self.seen = actor, 0

    async def since_last(self) -> dict[str, float]:
        [first, *_] = await self.actor.hybrid_phase()
        count, self.seen = int(first["to_generate"]) - self.seen, int(first["to_generate"])
        return {"agent/weight_pushes": float(count), "agent/weight_version": float(first["weight_version"])}


async def agent_step(cfg: AgentGRPOConfig, step: int, prompts: BatchHandle, generator: Turns, agent: AgentFn,
                     sync: WeightSync | None, pushes: PushCounter | None, *,
                     actor: Actor, reference: Reference, reward: Reward) -> dict[str, Any]:
    """One step on a batch of prompts (each row sampled n times, a sample dict of its columns
    and a `uid` per prompt); its metrics, agent/* included (agent/tool_calls_mean from the
    samples' `tool_calls` where the agent sets it). `generator`: the role the turns and the
    assembly run on (the rollout role, weights pushed by `sync` first; or the actor itself)."""
    t = StageTimer()
    info: dict[str, Any] = {}
    if sync is not None:
        await sync.publish(step)
        info = await t.one(Stage.SYNC, sync.drain())
    names = prompt_columns(prompts)
    trajectories = await t.one(Stage.GENERATE, run_agents(generator, agent, agent_samples(cfg, step, prompts), cfg.agent(step)))
    batch = await t.one(Stage.ASSEMBLE, assemble(generator, trajectories, carry=(*names, "uid", "tool_calls")))
    if pushes is not None:
        info |= await pushes.since_last()
    record = await train_on(cfg, t, batch, actor=actor, reference=reference, reward=reward)
    return record | trajectory_metrics(trajectories) | info


def prompt_columns(prompts: BatchHandle) -> list[str]:
    """The prompts' columns a sample carries (its `uid` is made per sample)."""
    return [name for name in prompts.shards[0].non_tensor if name != "uid"]


def agent_samples(cfg: AgentGRPOConfig, step: int, prompts: BatchHandle, tag: str = "") -> list[dict[str, Any]]:
    """Each prompt row as a sample dict, `cfg.n` times in a row, with a `uid` per prompt
    (`{step}-{tag}{row}`: a tag keeps the uids of a step's later rollouts apart)."""
    names = prompt_columns(prompts)
    rows = [dict(zip(names, values, strict=True)) for values in zip(*(non_tensor(prompts, c) for c in names), strict=True)]
    return [row | {"uid": f"{step}-{tag}{i}"} for i, row in enumerate(rows) for _ in range(cfg.n)]


def trajectory_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """agent/* of a step's trajectories, agent/tool_calls_mean from the samples' `tool_calls`."""
    calls = [float(tr.sample.get("tool_calls") or 0) for tr in trajectories]
    return agent_metrics(trajectories) | {"agent/tool_calls_mean": sum(calls) / max(len(calls), 1)}


def spanning_share(trajectories: list[Trajectory]) -> float:
    """The share of trajectories whose turns were sampled with more than one weight version (a
    load reached the rollout role between two of its turns; its `weight_version` is the oldest)."""
    spanning = sum(1 for tr in trajectories if len(set(tr.weight_versions)) > 1)
    return spanning / max(len(trajectories), 1)


class AsyncAgentSteps(PipelinedSteps):
    """agent_grpo's step function with max_staleness ≥ 1 (call it with (step, prompts), as Trainer
    does). It owns a RolloutPipeline whose rollout for a step is "run the agents on its prompts on
    the rollout role and assemble the trajectories there": the agents of step s + 1 (up to
    s + depth) run while the actor trains step s, their turns sampled with whatever version the
    rollout daemon holds when each turn's call arrives (a load sent meanwhile is applied between
    turns); a sample's `weight_version` is its oldest turn's. Then grpo_async's stages after
    generation (train_on): reference ∥ reward, old log-probs, advantages, update (tis_cap and
    decoupled PPO with the turns' own log-probs). Prompts keep data order, as in AsyncGRPO."""

    def __init__(self, cfg: AgentGRPOConfig, roles: dict[str, Any], trainer: Trainer, agent: AgentFn) -> None:
        self.cfg, self.agent = cfg, agent
        self._trajectories: dict[int, list[Trajectory]] = {}  # step → the trajectories of its rollouts
        self.actor: Actor = roles["actor"]
        self.rollout: Rollout = roles["rollout"]
        self.reference: Reference = roles["reference"]
        self.reward: Reward = roles["reward"]
        super().__init__(cfg, roles, trainer)

    async def _generate(self, step: int, prompts: BatchHandle) -> BatchHandle:
        """The pipeline's rollout: the agents on `prompts`, assembled on the rollout role."""
        done = self._trajectories.setdefault(step, [])
        tag = f"r{len(done)}-" if done else ""  # a top-up's prompts: uids apart from the kept groups'
        start = time.perf_counter()
        trajectories = await run_agents(self.rollout, self.agent, agent_samples(self.cfg, step, prompts, tag), self.cfg.agent(step))
        batch = await assemble(self.rollout, trajectories, carry=(*prompt_columns(prompts), "uid", "tool_calls"))
        done.extend(trajectories)
        # what the pipeline reads as the rollout side's busy time and tokens/s
        batch.meta["timing/generate_s"] = time.perf_counter() - start
        return batch

    async def __call__(self, step: int, prompts: BatchHandle) -> dict[str, Any]:
        t = StageTimer()
        batch, info = await self._take(t, step, prompts)
        trajectories = self._trajectories.pop(step, [])
        if info.get("async/dropped_groups"):  # agent/* of the samples trained on only
            kept = set(non_tensor(batch, "uid"))
            trajectories = [tr for tr in trajectories if tr.sample.get("uid") in kept]
        record = await train_on(self.cfg, t, batch, actor=self.actor, reference=self.reference, reward=self.reward)
        info |= await self._publish(t, step)
        info["async/rows_spanning_versions"] = spanning_share(trajectories)
        return record | trajectory_metrics(trajectories) | info | {"timing/step_s": t.step_s()}
