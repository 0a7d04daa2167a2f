"""What the critic-based recipes (ppo, safe_rlhf) share: their embedded default roles and
PPOConfig (GAE, the in-reward KL, the value clip).

No torch: settings and role tables. It knows option names the actor and critic read; it knows no
step and no engine (a recipe's step lives in its recipe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hfrt.flows.config import FlowConfig
from hfrt.flows.streaming import check_stream_chunks
from hfrt.flows.tasks import REWARD

ENGINE = {"micro_batch_size": 32, "optim": {"lr": 2e-3}}
#: The embedded default: one local daemon per role, the `tiny` preset, the task's rule reward.
PPO_ROLES: dict[str, dict[str, Any]] = {
    "actor": {"impl": "actor", "options": {"model": "tiny", "engine": ENGINE, "sampling": {"top_k": 0}}},
    "critic": {"impl": "critic", "options": {"model": "tiny", "engine": ENGINE}},
    "reference": {"impl": "reference", "options": {"model": "tiny", "engine": {"micro_batch_size": 32}}},
    "reward": {"impl": "reward", "options": {"kind": "function", "function": REWARD}},
}


@dataclass(frozen=True)
class PPOConfig(FlowConfig):
    """FlowConfig plus GAE over the critic's values, the in-reward KL and the critic's value clip."""

    #: GAE's discount
    gamma: float = 1.0
    #: GAE's λ
    lam: float = 0.95
    #: β of the KL penalty subtracted from the reward (0 turns it off)
    kl_coef: float = 0.001
    #: the in-reward KL's controller: "fixed" (β stays kl_coef) or "adaptive" (starts at kl_coef,
    #: aims at target_kl over kl_horizon samples)
    kl_ctrl: str = "fixed"
    #: the KL the adaptive controller aims at
    target_kl: float = 0.1
    #: samples over which the adaptive controller moves β towards target_kl
    kl_horizon: float = 10000.0
    #: the critic's value clip (its update's cliprange_value)
    cliprange_value: float = 0.5
    #: generate calls per step; critic, reference and reward start on each as it arrives
    #: (hfrt/flows/streaming.py). 1: one call. Only flows whose config declares STREAMED (ppo)
    stream_chunks: int = 1
    CRITIC: ClassVar[bool] = True  # gae's values: these flows run a critic
    STREAMED: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_stream_chunks(self)
        if self.kl_ctrl not in ("fixed", "adaptive"):
            raise ValueError(f"config kl_ctrl={self.kl_ctrl!r}: use fixed or adaptive")

    def flow_critic_options(self) -> dict[str, Any]:
        """The value clip."""
        return {"cliprange_value": self.cliprange_value}
