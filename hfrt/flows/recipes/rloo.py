"""The `rloo` flow: RLOO (REINFORCE Leave-One-Out, Ahmadian et al. 2024) on the built-in addition
task — n samples per prompt, each sample's baseline the mean score of its prompt's other n−1
samples, no critic. Stages as in the paper's pseudo-code: generate → (reference log-probs ∥
reward scores) → old log-probs → advantages (on the actor's rank 0) → actor update.

KL goes into the reward by default (rewards = scores − β·KL(old ‖ ref), kl_coef=0.001, kl
penalty "kl"), as verl's RLOO example sets it (use_kl_in_reward=True, use_kl_loss=False) and as
OpenRLHF does; kl_loss_coef > 0 adds GRPO's KL loss term instead (set kl_coef=0) or as well.
RLOOConfig and `rloo_step` also serve REINFORCE++ and ReMax (reinforce_pp.py, remax.py), whose
configs change only the estimator and its options.

The controller only moves handles. It knows role endpoints and their options, nothing of engines.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hfrt.flows.common import CALL_TIMEOUT_S, StageTimer, get_roles, reduce_rank_metrics, step_metrics
from hfrt.flows.recipes.grpo import ROLES as GRPO_ROLES
from hfrt.flows.recipes.grpo import GRPOConfig, actor_loss_options
from hfrt.flows.trainer import Trainer, sampling_seed
from hfrt.protocols import BatchHandle

#: The embedded default: GRPO's roles (actor, reference, reward; no critic).
ROLES: dict[str, dict[str, Any]] = GRPO_ROLES
#: The step's stages for `hfrt plan` (torch-free): each stage's name (its timing/<name>_s metric)
#: and the calls made in it, role → ops (generate, forward, train; *_greedy: one per prompt).
STAGES: tuple[tuple[str, dict[str, tuple[str, ...]]], ...] = (
    ("generate", {"actor": ("generate",)}),
    ("stage2", {"reference": ("forward",), "reward": ("forward",)}),
    ("old_log_prob", {"actor": ("forward",)}),
    ("update", {"actor": ("train",)}),
)
#: Estimators that compare the samples of one prompt, so need n >= 2.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


@dataclass(frozen=True)
class RLOOConfig(GRPOConfig):
    """GRPOConfig (n, the KL loss — off by default here) plus the in-reward KL: kl_coef (β; 0
    turns it off), kl_ctrl fixed|adaptive (target_kl, kl_horizon), kl_penalty (the per-token KL's
    kind: kl, abs, mse, low_var_kl). norm_adv_by_std is GRPO's and must stay true."""

    kl_loss_coef: float = 0.0
    kl_coef: float = 0.001
    kl_ctrl: str = "fixed"
    target_kl: float = 0.1
    kl_horizon: float = 10000.0
    kl_penalty: str = "kl"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kl_ctrl not in ("fixed", "adaptive"):
            raise ValueError(f"config kl_ctrl={self.kl_ctrl!r}: use fixed or adaptive")
        if not self.norm_adv_by_std:
            raise ValueError("config norm_adv_by_std is GRPO's; this flow does not read it")
        estimator = self.advantage_options()["estimator"]
        if estimator in GROUP_ESTIMATORS and self.n < 2:
            raise ValueError(f"config n={self.n}: {estimator} compares a prompt's samples, so use n >= 2")

    def advantage_options(self) -> dict[str, Any]:
        """compute_advantages' estimator and options (the in-reward KL)."""
        return {
            "estimator": "rloo", "use_kl_in_reward": self.kl_coef > 0, "kl_coef": self.kl_coef,
            "kl_ctrl": self.kl_ctrl, "target_kl": self.target_kl, "horizon": self.kl_horizon,
            "kl_penalty": self.kl_penalty,
        }


Config = RLOOConfig
KW = {"timeout_s": CALL_TIMEOUT_S}
StepFn = Callable[..., Awaitable[dict[str, Any]]]


async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
    return await train(ctl, RLOOConfig.read(config), rloo_step)


async def train(ctl: Any, cfg: RLOOConfig, step_fn: StepFn) -> dict[str, Any]:
    """The Trainer's loop over the actor, reference and reward roles, calling
    `step_fn(cfg, step, prompts, actor=, reference=, reward=)` each step."""
    roles = await get_roles(ctl, "actor", "reference", "reward")
    return await Trainer(ctl, cfg, roles).run(lambda step, prompts: step_fn(cfg, step, prompts, **roles))


async def rloo_step(cfg: RLOOConfig, step: int, prompts: BatchHandle, *, actor: Any, reference: Any, reward: Any) -> dict[str, Any]:
    """One RLOO step on a batch of prompts; returns its metrics. REINFORCE++ runs the same stages:
    its config names another estimator (`cfg.advantage_options()`)."""
    t = StageTimer()
    # Stage 1: n responses per prompt (samples of a prompt share its uid); stage 2: prepare
    # experience — the reference and the reward at once
    rollout, ref, scores = await experience(t, sample(actor, cfg, step, prompts), reference=reference, reward=reward)
    old = await t.one("old_log_prob", actor.compute_log_prob(rollout, **KW))
    # rewards = scores − β·KL, then each sample against the mean of its prompt's other samples
    adv = await t.one("advantages", actor.compute_advantages(rollout, scores, old, ref, **cfg.advantage_options(), **KW))
    # Stage 3: actor training (no critic)
    actor_ranks = await t.one("update", actor.update(rollout, old, ref, adv, **actor_loss_options(cfg), **KW))
    return step_metrics(t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(actor_ranks))


def sample(actor: Any, cfg: RLOOConfig, step: int, prompts: BatchHandle) -> Awaitable[BatchHandle]:
    """Send the step's sampling call (n responses per prompt, the step's seed); returns its future."""
    return actor.generate(
        prompts, n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        seed=sampling_seed(cfg, step), **KW)


async def experience(
    t: StageTimer, samples: Awaitable[BatchHandle], *, reference: Any, reward: Any
) -> tuple[BatchHandle, BatchHandle, BatchHandle]:
    """(rollout, reference log-probs, scores): the sampled rollout once it arrives
    (`timing/generate_s`), then its reference and reward calls at once (`timing/stage2_s`)."""
    rollout = await t.one("generate", samples)
    ref, scores = await t.together(
        "stage2", ref_log_prob=reference.compute_log_prob(rollout, **KW), reward=reward.score(rollout, **KW))
    return rollout, ref, scores
