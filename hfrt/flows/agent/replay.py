"""The `agent_replay` flow: policy-gradient training on recorded conversations — the trajectories
`hfrt serve-openai --record DIR` wrote (hfrt.serve.record: token ids, the mask of sampled tokens,
the serving policy's log-probs and version, a reward given with the conversation or POSTed later) —
with a reward function over the recorded conversation for those that have none.

A step takes `rows_per_step` recorded trajectories (seeded, reshuffled each epoch, as sft's rows)
→ assembled into a rollout batch on the actor (response_mask 1 on sampled tokens only) → reward
scores (the recorded rewards, read by the reward role) → the actor's current log-probs →
advantages (REINFORCE++ by default: one sample per conversation, so the baseline is the batch's,
not a group's) → actor update with truncated importance sampling against the recorded log-probs
(`tis_cap`: the samples are another policy's). No rollout role, no reference (`kl_loss_coef` is
not read: there is none); checkpoints, resume, metrics and the export are the offline loop's.
It knows endpoints and the recorded format's fields; nothing of HTTP, engines or tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hfrt.flows.agent.external import load_callable
from hfrt.flows.agent.loop import AGENT_COLUMNS
from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
from hfrt.flows.offline import OfflineConfig, OfflineLoop, Rows
from hfrt.flows.timing import Stage, StageTimer
from hfrt.flows.trainer import get_roles
from hfrt.protocols import BatchHandle
from hfrt.serve.record import RecordError, read_recorded
from hfrt.wire.loss_options import ESTIMATORS, GROUP_ESTIMATORS
from hfrt.wire.role_views import Actor, Reward

__all__ = ["ROLES", "AgentReplayConfig", "Config", "flow", "replay_columns"]

#: The embedded default: the actor (the policy that served, e.g. `roles.actor.options.model` the
#: served model's folder) and the reward role reading each trajectory's reward (agent_reward).
ROLES: dict[str, dict[str, Any]] = {
    "actor": {"impl": "actor", "options": {"model": "tiny", "engine": {"micro_batch_size": 16, "optim": {"lr": 1e-3}}}},
    "reward": {"impl": "reward", "options": {"kind": "function", "function": "hfrt.flows.agent.loop:agent_reward",
                                             "row_fields": list(AGENT_COLUMNS)}},
}


@dataclass(frozen=True)
class AgentReplayConfig(OfflineConfig):
    """The `agent_replay` flow's settings (the `#:` comment above a field is its description)."""

    #: a folder `hfrt serve-openai --record` wrote (its conversations-*.jsonl files), or one such file
    data: str = ""
    #: "module:function" scoring a trajectory that has no reward: reward(answer, sample) → float,
    #: `answer` the conversation's last reply text, `sample` its recorded line (messages, text,
    #: session, ...); "": every trajectory must carry a reward (given at its end or POSTed later)
    reward_function: str = ""
    #: trajectories per optimizer step
    rows_per_step: int = 16
    #: compute_advantages' estimator: reinforce_plus_plus (returns whitened over the batch; one
    #: sample per conversation) or another that needs no group, critic or reference
    estimator: str = "reinforce_plus_plus"
    #: truncated importance sampling: each token's loss weighted by min(π_now / π_recorded, tis_cap)
    #: against the serving policy's log-probs (0: off)
    tis_cap: float = 2.0
    #: the actor's policy loss (vanilla, decoupled, gspo, ...)
    policy_loss_mode: str = "vanilla"
    #: the actor's entropy bonus
    entropy_coeff: float = 0.0
    #: no held-out pass: recorded conversations have no on-policy validation here
    val_before_train: bool = False

    FLOW: ClassVar[str] = "agent_replay"

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("config data: name the folder `hfrt serve-openai --record DIR` wrote (or one of its files)")
        if self.estimator not in ESTIMATORS or self.estimator in GROUP_ESTIMATORS or self.estimator in ("gae", "remax", "on_policy_distill"):
            raise ValueError(f"config estimator={self.estimator!r}: one sample per conversation, no critic, baseline or "
                             "teacher: use reinforce_plus_plus (or another such estimator)")
        if self.tis_cap < 0:
            raise ValueError(f"config tis_cap={self.tis_cap!r}: must be >= 0 (0: off)")
        super().__post_init__()

    def rows(self) -> tuple[Rows, Rows]:
        """(every recorded trajectory, rewarded, []): checked before launch."""
        try:
            rows = read_recorded(self.data)
        except (RecordError, OSError) as exc:
            raise ValueError(f"config data: {exc}") from None
        score = load_callable(self.reward_function, "reward_function") if self.reward_function else None
        missing = [r for r in rows if r["reward"] is None]
        if missing and score is None:
            raise ValueError(f"config data: {len(missing)} recorded trajectories have no reward (first: session "
                             f"{missing[0]['session']!r}, {missing[0]['where']}); POST one to /v1/sessions/ID/reward "
                             "while serving, or set reward_function")
        for row in missing:
            row["reward"] = float(score(row.get("answer") or "", row))  # type: ignore[misc]
        return rows, []

    def update_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"ppo_epochs": 1, "entropy_coeff": self.entropy_coeff, "policy_loss_mode": self.policy_loss_mode}
        return options | ({"tis_cap": self.tis_cap} if self.tis_cap > 0 else {})


Config = AgentReplayConfig


def replay_columns(rows: Rows) -> dict[str, list[Any]]:
    """Recorded trajectories as assemble_trajectories' columns (hfrt.flows.agent.loop's layout)."""
    return {
        "prompt_ids": [r["prompt_ids"] for r in rows], "response_ids": [r["response_ids"] for r in rows],
        "response_gen_mask": [r["gen_mask"] for r in rows], "response_log_probs": [r["log_probs"] for r in rows],
        "agent_reward": [float(r["reward"]) for r in rows], "agent_error": ["" for _ in rows],
        "agent_turns": [int(r.get("turns", 1)) for r in rows], "weight_version": [int(r.get("policy_version", -1)) for r in rows],
        "uid": [f"{r['session']}/{r.get('part', 0)}" for r in rows], "tool_calls": [0 for _ in rows],
    }


async def flow(ctl: Any, config: AgentReplayConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = AgentReplayConfig.read(config)
    train, val = cfg.rows()
    roles = await get_roles(ctl, "actor", "reward")
    actor: Actor = roles["actor"]
    reward: Reward = roles["reward"]
    loop = OfflineLoop(cfg, trained={"actor": actor}, actor=actor, train=train, val=val, columns=replay_columns, ctl=ctl)

    async def step(index: int, rows: BatchHandle, t: StageTimer) -> dict[str, float]:
        batch = await t.one(Stage.ASSEMBLE, actor.assemble_trajectories(rows))
        scores = await t.one(Stage.STAGE2, reward.score(batch))
        old = await t.one(Stage.OLD_LOG_PROB, actor.compute_log_prob(batch))
        adv = await t.one(Stage.ADVANTAGES, actor.compute_advantages(batch, scores, old, estimator=cfg.estimator))
        ranks = await t.one(Stage.UPDATE, actor.update(batch, old, adv, **cfg.update_options()))
        return step_metrics(t, scores, batch, adv.meta["metrics"], reduce_rank_metrics(ranks))

    async def validate() -> dict[str, float]:
        return {}

    return await loop.run(step, validate)
