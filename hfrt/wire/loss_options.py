"""The options `actor.update` and `critic.update` accept, declared once: the loss dataclasses, the
update schedule, the allowed values of the string options, and `check_update_options`, which both
the controller side (flow configs, before launch) and the daemons (on every update) call, so the
two cannot disagree.

No torch: the controller imports this. It knows option names, types and ranges; what the losses
compute is hfrt.roles.losses's business, how an update walks its batch roles/updates.py's.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: policy_loss_mode: clipped PPO (dual clip), GSPO's sequence-level ratio, CISPO's clipped IS weight,
#: decoupled PPO (clip against the proximal policy, weighted by the truncated behaviour ratio)
POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo", "decoupled")
#: loss_agg_mode (see hfrt.roles.losses.agg_loss)
AGG_MODES = (
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
    "seq-mean-token-sum-norm-mean",
)
#: kl_loss_type (see hfrt.roles.losses.kl_penalty)
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
ROLES = ("actor", "critic")


@dataclass(frozen=True)
class UpdateSchedule:
    """How one `update` call walks its batch.

    ppo_epochs: passes over the batch.
    ppo_mini_batch_size: rows per optimizer step, counted over the whole role group (each rank
        steps on its share); 0 means one step per epoch over the whole batch.
    micro_batch_size: rows per forward/backward (gradient accumulation); None: the engine's.
    """

    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 0
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        _at_least(self, "ppo_epochs", 1)
        _at_least(self, "ppo_mini_batch_size", 0)
        _at_least(self, "micro_batch_size", 1)


@dataclass(frozen=True)
class ActorLoss:
    """The loss options of `actor.update` (besides UpdateSchedule's).

    policy_loss_mode: vanilla (clipped PPO with dual clip), gspo (sequence-level importance ratio,
        GSPO; seq-mean-token-mean is the aggregation its authors use) or cispo (clipped importance
        weight with stop-gradient times the log-prob, MiniMax-M1) or decoupled (decoupled PPO for
        stale samples: the clip against the proximal policy, i.e. the old log-probs, the term
        weighted by min(π_prox / π_behav, tis_cap) with the rollout engine's log-probs; needs tis_cap).
    clip_ratio_low / high: ratio clip [1 - low, 1 + high]; clip_ratio_c: vanilla's dual clip
        (> 1; None: off).
    tis_cap: truncated importance sampling against the sampler's log-probs (the rollout's
        `rollout_log_probs` column): each token's policy loss × min(exp(old − rollout), tis_cap),
        detached; None: off. Works with every mode.
    entropy_coeff: entropy bonus weight. use_kl_loss: add kl_loss_coef × KL(policy ‖ reference)
        of type kl_loss_type (needs the `ref_log_prob` column).
    loss_agg_mode: see hfrt.roles.losses.agg_loss; norm_horizon: the constant L of the *-sum-norm modes
        (None: the padded response length).
    temperature: of the log-probs (default: the rollout's, from batch meta).
    """

    policy_loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    tis_cap: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    norm_horizon: int | None = None
    temperature: float | None = None

    def __post_init__(self) -> None:
        _one_of(self, "policy_loss_mode", POLICY_LOSS_MODES)
        _one_of(self, "loss_agg_mode", AGG_MODES)
        _one_of(self, "kl_loss_type", KL_TYPES)
        _at_least(self, "clip_ratio_low", 0.0)
        _at_least(self, "clip_ratio_high", 0.0)
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"option clip_ratio_c={self.clip_ratio_c!r}: the dual-clip bound must be > 1 (or None: off)")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"option tis_cap={self.tis_cap!r}: the truncation cap must be > 0 (or None: off)")
        if self.policy_loss_mode == "decoupled" and self.tis_cap is None:
            raise ValueError("option policy_loss_mode='decoupled' needs tis_cap, the cap of its behaviour weight "
                             "π_prox / π_behav (e.g. tis_cap=2)")
        _at_least(self, "norm_horizon", 1)
        _at_least(self, "temperature", 0.0)


@dataclass(frozen=True)
class CriticLoss:
    """The loss options of `critic.update` (besides UpdateSchedule's): cliprange_value clips new
    values around the old ones (None: off); loss_agg_mode / norm_horizon as for the actor."""

    cliprange_value: float | None = 0.5
    loss_agg_mode: str = "token-mean"
    norm_horizon: int | None = None

    def __post_init__(self) -> None:
        _one_of(self, "loss_agg_mode", AGG_MODES)
        _at_least(self, "cliprange_value", 0.0)
        _at_least(self, "norm_horizon", 1)


LOSS_CLASSES: dict[str, type[ActorLoss] | type[CriticLoss]] = {"actor": ActorLoss, "critic": CriticLoss}


def accepted_options(role: str) -> list[str]:
    """Every option `<role>.update` accepts, sorted."""
    return sorted(f.name for cls in (LOSS_CLASSES[_role(role)], UpdateSchedule) for f in dataclasses.fields(cls))


def check_update_options(role: str, options: Mapping[str, Any]) -> tuple[UpdateSchedule, Any]:
    """(schedule, loss config) from `<role>.update`'s keyword options. A ValueError names the bad
    key or value and lists every accepted option; wrong types are refused (an int is a float)."""
    loss_cls = LOSS_CLASSES[_role(role)]
    where = f"{role}.update"
    unknown = sorted(set(options) - set(accepted_options(role)))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; accepted: {', '.join(accepted_options(role))}")
    parts: list[Any] = []
    for cls in (UpdateSchedule, loss_cls):
        hints = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in options:
                values[f.name] = _typed(where, f.name, options[f.name], hints[f.name])
        try:
            parts.append(cls(**values))
        except ValueError as err:
            raise ValueError(f"{where}: {err}; accepted: {', '.join(accepted_options(role))}") from None
    return parts[0], parts[1]


def _role(role: str) -> str:
    if role not in LOSS_CLASSES:
        raise ValueError(f"no update options for role {role!r}: use one of {', '.join(ROLES)}")
    return role


def _typed(where: str, name: str, value: Any, hint: Any) -> Any:
    """`value` checked against a field's type (float, int, bool, str, or one of them | None)."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ValueError(f"{where}: option {name}={value!r} must be finite")
            return float(value)
        if kind in (int, str) and isinstance(value, kind) and not isinstance(value, bool):
            return value
        if kind is bool and isinstance(value, bool):
            return value
    names = " or ".join("None" if k is type(None) else k.__name__ for k in allowed)
    raise ValueError(f"{where}: option {name}={value!r} must be {names}")


def _one_of(obj: Any, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in allowed:
        raise ValueError(f"option {name}={value!r}: use one of {', '.join(allowed)}")


def _at_least(obj: Any, name: str, low: float) -> None:
    value = getattr(obj, name)
    if value is not None and not value >= low:
        raise ValueError(f"option {name}={value!r}: must be at least {low:g}")
