"""The `safe_rlhf` flow: PPO-Lagrangian (Safe RLHF, Dai et al. 2023) on the built-in addition task —
maximise reward subject to mean cost ≤ cost_limit, with a Lagrange multiplier λ ≥ 0 in the
controller. A step: generate → (critic values ∥ reference log-probs ∥ reward scores ∥ cost scores)
→ λ update from the step's mean cost → old log-probs → advantages of reward − λ·cost (on the
actor's rank 0) → (critic update ∥ actor update).

Design: one critic on the Lagrangian reward. The actor's `compute_advantages` subtracts
λ × the cost model's token-level costs from the scores (cost_column / cost_coef) before GAE, so
the policy sees reward − λ·cost at the last response token, like the scores. The paper's two
critics and (A_r − λ·A_c)/(1 + λ) differ from this by the 1/(1 + λ) scale, which GAE's advantage
whitening removes, and by the value baseline tracking a moving λ; one critic less is one daemon
less. λ follows projected gradient ascent, λ ← max(0, λ + lambda_lr·(mean cost − cost_limit)),
updated from a step's own costs before its advantages (as the paper's trainer does), and is saved
in checkpoints. The controller moves handles and the per-row score lists only; it knows nothing of
engines, and imports no torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from hfrt.flows.batches import non_tensor
from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
from hfrt.flows.ppo_family import PPO_ROLES, PPOConfig
from hfrt.flows.tasks import COST
from hfrt.flows.timing import Stage, StageTable, StageTimer
from hfrt.flows.trainer import Trainer, get_roles, sampling_seed
from hfrt.protocols import BatchHandle
from hfrt.wire.role_views import Actor, Critic, Reference, Reward

#: The cost model's output columns (the reward daemon's token_column / score_column options).
COST_TOKENS, COST_SCORE = "token_level_costs", "cost"
#: The embedded default: PPO's roles plus a rule cost model (a second reward daemon).
ROLES: dict[str, dict[str, Any]] = PPO_ROLES | {
    "cost": {"impl": "reward", "options": {
        "kind": "function", "function": COST, "token_column": COST_TOKENS, "score_column": COST_SCORE}},
}
#: The step's stages for `hfrt plan` (torch-free): each stage's name (its timing/<name>_s metric)
#: and the calls made in it, role → ops (generate, forward, train; *_greedy: one per prompt).
STAGES: StageTable = (
    (Stage.GENERATE, {"actor": ("generate",)}),
    (Stage.STAGE2, {"critic": ("forward",), "reference": ("forward",), "reward": ("forward",), "cost": ("forward",)}),
    (Stage.OLD_LOG_PROB, {"actor": ("forward",)}),
    (Stage.UPDATE, {"critic": ("train",), "actor": ("train",)}),
)


@dataclass(frozen=True)
class SafeRLHFConfig(PPOConfig):
    """PPOConfig plus the cost constraint and its Lagrange multiplier λ."""

    #: the allowed mean episode cost
    cost_limit: float = 0.1
    #: λ at step 0 (≥ 0)
    lambda_init: float = 1.0
    #: λ's step size (0 keeps λ fixed)
    lambda_lr: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("lambda_init", "lambda_lr"):
            if getattr(self, name) < 0:
                raise ValueError(f"config {name}={getattr(self, name)!r}: must not be negative")


Config = SafeRLHFConfig


class LagrangeMultiplier:
    """λ ≥ 0 of the cost constraint, kept in the controller (a FlowState: saved in checkpoints).

    update(mean_cost): λ ← max(0, λ + lr·(mean_cost − limit)) — it grows while the policy's mean
    cost is over the limit and shrinks (to 0 at least) while it is under.
    """

    def __init__(self, value: float, lr: float, limit: float) -> None:
        self.value, self.lr, self.limit = float(value), float(lr), float(limit)

    def update(self, mean_cost: float) -> float:
        self.value = max(0.0, self.value + self.lr * (mean_cost - self.limit))
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"lambda": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["lambda"])


async def flow(ctl: Any, config: SafeRLHFConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = SafeRLHFConfig.read(config)
    roles = await get_roles(ctl, "actor", "critic", "reference", "reward", "cost")
    lam = LagrangeMultiplier(cfg.lambda_init, cfg.lambda_lr, cfg.cost_limit)
    trainer = Trainer(ctl, cfg, roles, trained=("actor", "critic"), state=lam)
    return await trainer.run(lambda step, prompts: safe_rlhf_step(cfg, lam, step, prompts, **roles))


async def safe_rlhf_step(
    cfg: SafeRLHFConfig, lam: LagrangeMultiplier, step: int, prompts: BatchHandle, *,
    actor: Actor, critic: Critic, reference: Reference, reward: Reward, cost: Reward,
) -> dict[str, Any]:
    """One PPO-Lagrangian step on a batch of prompts; updates `lam`; returns the step's metrics."""
    t = StageTimer()
    # Stage 1: generate responses
    rollout = await t.one(Stage.GENERATE, actor.generate(
        prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=sampling_seed(cfg, step)))
    # Stage 2: prepare experience — four roles at once
    values, ref, scores, costs = await t.together(
        Stage.STAGE2, values=critic.compute_values(rollout), ref_log_prob=reference.compute_log_prob(rollout),
        reward=reward.score(rollout), cost=cost.score(rollout))
    # The multiplier: dual ascent on this step's episode costs
    mean_cost = statistics.fmean(non_tensor(costs, COST_SCORE))
    coef = lam.update(mean_cost)
    old = await t.one(Stage.OLD_LOG_PROB, actor.compute_log_prob(rollout, **cfg.log_prob_options()))
    adv = await t.one(Stage.ADVANTAGES, actor.compute_advantages(rollout, scores, costs, values, old, ref, **cfg.advantage_call(
        estimator="gae", gamma=cfg.gamma, lam=cfg.lam, cost_column=COST_TOKENS, cost_coef=coef,
        use_kl_in_reward=cfg.kl_coef > 0, kl_coef=cfg.kl_coef, kl_ctrl=cfg.kl_ctrl, target_kl=cfg.target_kl,
        horizon=cfg.kl_horizon)))
    # Stage 3: actor and critic training, at once
    critic_ranks, actor_ranks = await t.together(
        Stage.UPDATE, critic_update=critic.update(rollout, values, adv, **cfg.critic_update_options()),
        actor_update=actor.update(rollout, old, adv, **cfg.actor_update_options()))
    safe = {"safe/lambda": coef, "cost/mean": mean_cost, "cost/limit": cfg.cost_limit}
    return step_metrics(
        t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(critic_ranks), reduce_rank_metrics(actor_ranks), safe)
