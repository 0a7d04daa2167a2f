"""What the critic-free recipes (grpo, rloo, reinforce_pp, remax, dapo, grpo_async, agent_calc)
share: their embedded default roles, GRPOConfig and the configs built on it (GRPOFlowConfig,
RLOOConfig), and the step pieces several of them run — sampling, experience (reference ∥
reward), the RLOO-style step and GRPO's stages after generation (`train_on`).

No torch: futures, handles and settings. It knows role endpoints and their options; it knows no
engine, and no recipe's own additions (those stay in the recipe).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from hfrt.flows.config import FlowConfig
from hfrt.flows.metrics import reduce_rank_metrics, step_metrics
from hfrt.flows.ppo_family import PPO_ROLES
from hfrt.flows.streaming import check_stream_chunks
from hfrt.flows.timing import Stage, StageTimer
from hfrt.flows.trainer import Trainer, get_roles, sampling_seed
from hfrt.protocols import BatchHandle
from hfrt.wire.loss_options import GROUP_ESTIMATORS as GROUP_ESTIMATORS  # estimators that need n >= 2
from hfrt.wire.role_views import Actor, Reference, Reward

#: The embedded default: PPO's roles without the critic (actor, reference, reward).
GRPO_ROLES: dict[str, dict[str, Any]] = {name: s for name, s in PPO_ROLES.items() if name != "critic"}
#: A generation-only rollout daemon with the actor's model and sampling (asynchronous and agent flows).
ROLLOUT_ROLE: dict[str, Any] = {"impl": "rollout", "options": {"model": "tiny", "sampling": {"top_k": 0}}}
StepFn = Callable[..., Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class GRPOConfig(FlowConfig):
    """FlowConfig plus groups of samples per prompt, group-relative advantages and the KL loss."""

    prompts_per_step: int = 8
    #: samples per prompt (a group)
    n: int = 8
    #: divide each group's advantages by the group's standard deviation (false: Dr.GRPO's plain differences)
    norm_adv_by_std: bool = True
    #: coefficient of the KL loss towards the reference policy (0 turns it off)
    kl_loss_coef: float = 0.001
    #: the KL loss's estimator (kl, abs, mse, low_var_kl, ...: hfrt.wire.loss_options.KL_TYPES)
    kl_loss_type: str = "low_var_kl"
    #: how token losses become the batch's loss (token-mean, seq-mean-token-sum, seq-mean-token-mean, ...)
    loss_agg_mode: str = "token-mean"
    #: generate calls per step; the reference and reward start on each as it arrives, same samples
    #: (hfrt/flows/streaming.py; docs/bench-and-performance.md for what it costs). 1: one call.
    #: Only flows whose config declares STREAMED (grpo)
    stream_chunks: int = 1
    STREAMED: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_stream_chunks(self)

    def flow_actor_options(self) -> dict[str, Any]:
        """KL as a loss term (no critic) and the loss aggregation."""
        return {
            "use_kl_loss": self.kl_loss_coef > 0, "kl_loss_coef": self.kl_loss_coef,
            "kl_loss_type": self.kl_loss_type, "loss_agg_mode": self.loss_agg_mode,
        }


@dataclass(frozen=True)
class GRPOFlowConfig(GRPOConfig):
    """The `grpo` flow's own defaults; GRPOConfig's stay as they are for the flows built on it
    (rloo, reinforce_pp, remax, dapo). On the addition task with the tiny model (150 steps, 2 CPU
    cores, four seeds each), std-normalised advantages on 8 prompts × 8 samples collapsed the policy on
    two seeds of four (last-quarter mean reward 0.10 and 0.20): they give a group whose samples
    differ only by the 0.1 form credit the same push as one with a right answer. Dr.GRPO's plain
    differences (norm_adv_by_std=false) on 16 prompts × 8 samples never collapsed (0.35-0.78, mean
    0.57; 0.40 is "always answer 2", the most common sum), at about the same time per step."""

    prompts_per_step: int = 16
    norm_adv_by_std: bool = False
    STREAMED: ClassVar[bool] = True


@dataclass(frozen=True)
class RLOOConfig(GRPOConfig):
    """GRPOConfig (n, the KL loss — off by default here) plus the in-reward KL. norm_adv_by_std is
    GRPO's and must stay true. Also the base of REINFORCE++'s and ReMax's configs, which change
    only the estimator and its options."""

    #: GRPO's std normalisation, which this flow does not read: must stay true
    norm_adv_by_std: bool = True
    kl_loss_coef: float = 0.0
    #: β of the KL penalty subtracted from the reward (0 turns it off)
    kl_coef: float = 0.001
    #: the in-reward KL's controller: "fixed" (β stays kl_coef) or "adaptive" (starts at kl_coef,
    #: aims at target_kl over kl_horizon samples)
    kl_ctrl: str = "fixed"
    #: the KL the adaptive controller aims at
    target_kl: float = 0.1
    #: samples over which the adaptive controller moves β towards target_kl
    kl_horizon: float = 10000.0
    #: the per-token KL's kind in the reward (kl, abs, mse, low_var_kl)
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


def actor_loss_options(cfg: GRPOConfig) -> dict[str, Any]:
    """The actor update's options for GRPO-style flows (KL as a loss term, no critic), with the
    config's policy loss mode, TIS and actor_loss table (checked before launch)."""
    return cfg.actor_update_options()


async def train(ctl: Any, cfg: RLOOConfig, step_fn: StepFn) -> dict[str, Any]:
    """The Trainer's loop over the actor, reference and reward roles, calling
    `step_fn(cfg, step, prompts, actor=, reference=, reward=)` each step."""
    roles = await get_roles(ctl, "actor", "reference", "reward")
    return await Trainer(ctl, cfg, roles).run(lambda step, prompts: step_fn(cfg, step, prompts, **roles))


async def rloo_step(
    cfg: RLOOConfig, step: int, prompts: BatchHandle, *, actor: Actor, reference: Reference, reward: Reward
) -> dict[str, Any]:
    """One RLOO step on a batch of prompts; returns its metrics. REINFORCE++ runs the same stages:
    its config names another estimator (`cfg.advantage_options()`)."""
    t = StageTimer()
    # Stage 1: n responses per prompt (samples of a prompt share its uid); stage 2: prepare
    # experience — the reference and the reward at once
    rollout, ref, scores = await experience(t, sample(actor, cfg, step, prompts), reference=reference, reward=reward)
    old = await t.one(Stage.OLD_LOG_PROB, actor.compute_log_prob(rollout, **cfg.log_prob_options()))
    # rewards = scores − β·KL, then each sample against the mean of its prompt's other samples
    adv = await t.one(Stage.ADVANTAGES, actor.compute_advantages(
        rollout, scores, old, ref, **cfg.advantage_call(**cfg.advantage_options())))
    # Stage 3: actor training (no critic)
    actor_ranks = await t.one(Stage.UPDATE, actor.update(rollout, old, ref, adv, **actor_loss_options(cfg)))
    return step_metrics(t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(actor_ranks))


def sample(actor: Actor, cfg: RLOOConfig, step: int, prompts: BatchHandle) -> Awaitable[BatchHandle]:
    """Send the step's sampling call (n responses per prompt, the step's seed); returns its future."""
    return actor.generate(
        prompts, n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=sampling_seed(cfg, step))


async def experience(
    t: StageTimer, samples: Awaitable[BatchHandle], *, reference: Reference, reward: Reward
) -> tuple[BatchHandle, BatchHandle, BatchHandle]:
    """(rollout, reference log-probs, scores): the sampled rollout once it arrives
    (`timing/generate_s`), then its reference and reward calls at once (`timing/stage2_s`)."""
    rollout = await t.one(Stage.GENERATE, samples)
    ref, scores = await t.together(
        Stage.STAGE2, ref_log_prob=reference.compute_log_prob(rollout), reward=reward.score(rollout))
    return rollout, ref, scores


async def train_on(
    cfg: GRPOConfig, t: StageTimer, rollout: BatchHandle, *, actor: Actor, reference: Reference, reward: Reward,
    early: tuple[Awaitable[BatchHandle], Awaitable[BatchHandle]] | None = None,
) -> dict[str, Any]:
    """grpo's stages after generation, on a rollout made elsewhere (grpo_async's rollout role,
    agent_calc's agents); the step's metrics. `early`: the rollout's (reference log-probs, reward
    scores) calls, already started."""
    ref_call, score_call = early or (reference.compute_log_prob(rollout), reward.score(rollout))
    ref, scores = await t.together(Stage.STAGE2, ref_log_prob=ref_call, reward=score_call)
    # as in grpo: one optimizer step takes the actor's current log-probs as the old ones (the
    # proximal policy); the rollout engine's own log-probs enter through tis_cap
    old = [] if cfg.on_policy(len(rollout)) else [
        await t.one(Stage.OLD_LOG_PROB, actor.compute_log_prob(rollout, **cfg.log_prob_options()))]
    adv = await t.one(Stage.ADVANTAGES, actor.compute_advantages(
        rollout, scores, *old, ref, **cfg.advantage_call(estimator="grpo", norm_adv_by_std=cfg.norm_adv_by_std)))
    actor_ranks = await t.one(Stage.UPDATE, actor.update(rollout, *old, ref, adv, **actor_loss_options(cfg)))
    return step_metrics(t, scores, rollout, adv.meta["metrics"], reduce_rank_metrics(actor_ranks))
