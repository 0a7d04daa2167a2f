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

#: policy_loss_mode (docs/roles-and-losses.md has each one's formula): clipped PPO (dual clip),
#: GSPO's sequence-level ratio, CISPO's clipped IS weight, decoupled PPO (clip against the proximal
#: policy, weighted by the truncated behaviour ratio), SAPO's soft gate, GPG's plain −A·logp,
#: GMPO's geometric-mean ratio, Clip-Cov / KL-Cov (covariance-selected tokens), plain REINFORCE
POLICY_LOSS_MODES = (
    "vanilla", "gspo", "cispo", "decoupled", "sapo", "gpg", "geo_mean", "clip_cov", "kl_cov", "reinforce",
)
#: rollout_is: importance weights π_old / π_rollout per token or per sequence (product over tokens)
ROLLOUT_IS_LEVELS = ("token", "sequence")
#: rollout_rs options (verl's rollout_rs, comma-separated; all must pass): a token or a sequence is
#: rejected when its divergence statistic between trainer and rollout is out of bounds
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)
#: compute_advantages' estimators (hfrt.roles.components.advantage; docs/roles-and-losses.md has each formula)
ESTIMATORS = (
    "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "grpo_passk",
    "gpg", "optimal_token_baseline", "tir_optimal_token_baseline", "on_policy_distill",
)
#: estimators that compare the samples of one prompt (grouped by uid), so need n >= 2 samples a prompt
GROUP_ESTIMATORS = (
    "grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg", "optimal_token_baseline",
    "tir_optimal_token_baseline",
)
#: estimators that read Σπ² per token (actor.compute_log_prob(sum_pi_squared=True))
TOKEN_BASELINE_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
#: estimators that read a column only some flows provide → that column
ESTIMATOR_COLUMNS = {"gae": "values (a critic)", "remax": "a greedy baseline score (the remax flow)"}
#: compute_advantages' keyword options besides `estimator` (hfrt.roles.components.advantage.AdvantageParams;
#: a test keeps the two equal)
ADVANTAGE_OPTIONS = (
    "gamma", "lam", "norm_adv_by_std", "epsilon", "use_kl_in_reward", "kl_penalty", "kl_ctrl", "kl_coef", "target_kl",
    "horizon", "score_column", "index_column", "baseline_column", "cost_column", "cost_coef", "overlong_buffer_len",
    "overlong_penalty_factor", "max_response_len", "f_norm", "sum_pi_squared_column", "handle_zero_tail", "rollout_is",
    "rollout_is_threshold", "teacher_column", "distill_reward_coef", "distill_baseline",
)
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
    keep_loss_agg_mode: gspo, sapo and geo_mean aggregate as verl does whatever loss_agg_mode says
        (seq-mean-token-mean; geo_mean a mean over sequences); True makes gspo and sapo use
        loss_agg_mode instead (hfrt's named alternative).
    tau_pos / tau_neg: SAPO's gate temperatures for positive / other advantages.
    clip_cov_ratio / clip_cov_lb / clip_cov_ub: Clip-Cov's share of tokens whose gradient is cut,
        picked at random among unclipped tokens with covariance in (lb, ub); kl_cov_ratio /
        ppo_kl_coef: KL-Cov's share of highest-covariance tokens and the |log ratio| penalty on
        them. loss_seed: seeds Clip-Cov's random pick (with the optimizer step), so runs repeat.
    rollout_is / rollout_is_threshold / rollout_is_batch_normalize: verl's rollout correction
        weights π_old / π_rollout per "token" or "sequence", truncated at the threshold, optionally
        divided by their batch mean. rollout_rs / rollout_rs_threshold: rejection (masking) of
        tokens or sequences whose trainer-vs-rollout divergence is out of bounds (ROLLOUT_RS_OPTIONS,
        comma-separated; k1 thresholds "lower_upper" or one upper bound, others one upper bound).
    bypass_mode: the rollout's log-probs are the old ones (no old_log_probs column is read): vanilla
        clips against the sampler, reinforce weights by π_θ / π_rollout (verl's bypass mode).
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
    keep_loss_agg_mode: bool = False
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    loss_seed: int = 0
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False

    def __post_init__(self) -> None:
        _one_of(self, "policy_loss_mode", POLICY_LOSS_MODES)
        self._check_new_modes()
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

    def _check_new_modes(self) -> None:
        """SAPO's, the covariance modes' and the rollout correction's options."""
        for name in ("tau_pos", "tau_neg", "clip_cov_ratio", "kl_cov_ratio", "rollout_is_threshold"):
            if not getattr(self, name) > 0:
                raise ValueError(f"option {name}={getattr(self, name)!r}: must be > 0")
        _at_least(self, "ppo_kl_coef", 0.0)
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"options clip_cov_lb={self.clip_cov_lb!r} and clip_cov_ub={self.clip_cov_ub!r}: lb must be < ub")
        if self.rollout_is is not None:
            _one_of(self, "rollout_is", ROLLOUT_IS_LEVELS)
        if self.rollout_rs is not None:
            rs_thresholds(self.rollout_rs, self.rollout_rs_threshold)
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ValueError("option rollout_is_batch_normalize=True needs rollout_is (token or sequence)")
        if self.bypass_mode and self.policy_loss_mode not in ("vanilla", "reinforce"):
            raise ValueError(f"option bypass_mode=True works with policy_loss_mode vanilla (PPO-clip against the "
                             f"rollout) or reinforce, as verl's bypass mode; got {self.policy_loss_mode!r}")
        if self.bypass_mode and self.tis_cap is not None:
            raise ValueError("options bypass_mode and tis_cap: with bypass_mode the rollout log-probs are the old ones, "
                             "so tis_cap's weight π_old / π_rollout is 1; use rollout_is for the weights")

    @property
    def reads_rollout_log_probs(self) -> bool:
        """Whether an update with these options needs the rollout's `rollout_log_probs` column."""
        return self.tis_cap is not None or self.bypass_mode or self.rollout_is is not None or self.rollout_rs is not None


def rs_thresholds(rollout_rs: str, spec: str | float | None) -> list[tuple[str, float | None, float]]:
    """[(option, lower, upper)] of a rollout_rs setting, as verl parses it: one threshold for
    every option or one per option (comma-separated); a k1 option takes "lower_upper" ratio
    bounds, or one upper bound U (lower 1/U); other options one positive upper bound (lower None)."""
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    bad = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if not options or bad:
        raise ValueError(f"option rollout_rs={rollout_rs!r}: use one or more (comma-separated) of {', '.join(ROLLOUT_RS_OPTIONS)}")
    if spec is None:
        raise ValueError(f"option rollout_rs={rollout_rs!r} needs rollout_rs_threshold (e.g. 2 or '0.5_2')")
    specs = [str(spec)] if isinstance(spec, int | float) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"option rollout_rs_threshold={spec!r}: give one threshold or one per rollout_rs option ({len(options)})")
    specs = specs * len(options) if len(specs) == 1 else specs
    out: list[tuple[str, float | None, float]] = []
    for option, text in zip(options, specs, strict=True):
        try:
            if option.endswith("k1"):
                lower_text, _, upper_text = text.rpartition("_") if "_" in text else ("", "", text)
                upper = float(upper_text)
                lower = float(lower_text) if lower_text else 1.0 / upper
            elif "_" in text:
                raise ValueError
            else:
                lower, upper = None, float(text)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"option rollout_rs_threshold={spec!r}: {text!r} is not a threshold for {option} "
                             "(k1: 'lower_upper' or one upper bound; k2/k3: one upper bound)") from None
        if upper <= 0 or (lower is not None and lower <= 0) or not math.isfinite(upper):
            raise ValueError(f"option rollout_rs_threshold={spec!r}: thresholds for {option} must be positive")
        out.append((option, lower, upper))
    return out


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


#: preference losses (DPO family, TRL's names and formulas; docs/pipeline.md): sigmoid (DPO,
#: with label_smoothing the conservative cDPO), ipo (IPO on token-averaged log-ratios), hinge (SLiC),
#: robust (robust DPO against flipped labels, label_smoothing = the flip rate)
PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
#: what sft_update / sft_evaluate do with a row over max_length tokens (verl's `data.truncation`
#: names): "right" cuts its end, keeping the first max_length tokens (TRL's truncation_mode=
#: "keep_start", its default); "error" refuses it, naming the row
SFT_TRUNCATIONS = ("right", "error")


@dataclass(frozen=True)
class PreferenceLoss:
    """The options of the actor's preference update (`dpo_update`, `dpo_evaluate`).

    loss_type: one of PREFERENCE_LOSSES. beta: the strength of the implicit KL to the reference
        (IPO's τ). label_smoothing: the assumed share of flipped preference labels — sigmoid's
        cDPO mix -(1-ε)·log σ(βΔ) - ε·log σ(-βΔ), robust's unbiased estimator (ε < 0.5); ipo and
        hinge take none.
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        _one_of(self, "loss_type", PREFERENCE_LOSSES)
        if not self.beta > 0 or not math.isfinite(self.beta):
            raise ValueError(f"option beta={self.beta!r}: must be > 0")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"option label_smoothing={self.label_smoothing!r}: a share of flipped labels in [0, 0.5)")
        if self.label_smoothing and self.loss_type in ("ipo", "hinge"):
            raise ValueError(f"option label_smoothing={self.label_smoothing!r}: loss_type={self.loss_type!r} takes none "
                             "(sigmoid and robust do)")


def check_preference_options(options: Mapping[str, Any], where: str = "dpo") -> PreferenceLoss:
    """A PreferenceLoss from keyword options; ValueError naming the bad key or value (an int is a float)."""
    hints = typing.get_type_hints(PreferenceLoss)
    names = [f.name for f in dataclasses.fields(PreferenceLoss)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; accepted: {', '.join(names)}")
    values = {k: _typed(where, k, v, hints[k]) for k, v in options.items()}
    try:
        return PreferenceLoss(**values)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


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


def check_advantage_options(options: Mapping[str, Any], n: int, *, critic: bool, baseline: bool) -> None:
    """Refuse, before launch, compute_advantages options a flow cannot run: an unknown estimator or
    option, a group estimator with fewer than 2 samples a prompt (n), gae without a critic, remax
    without a flow that scores a greedy baseline. ValueError naming the option."""
    unknown = sorted(set(options) - {"estimator", *ADVANTAGE_OPTIONS})
    if unknown:
        raise ValueError(f"compute_advantages: unknown option(s) {unknown}; accepted: estimator, {', '.join(ADVANTAGE_OPTIONS)}")
    estimator = options.get("estimator")
    if estimator is None:
        return
    if estimator not in ESTIMATORS:
        raise ValueError(f"compute_advantages: estimator={estimator!r}: use one of {', '.join(ESTIMATORS)}")
    if estimator in GROUP_ESTIMATORS and n < 2:
        raise ValueError(f"compute_advantages: estimator={estimator!r} compares a prompt's samples, so it needs n >= 2 (n={n})")
    if (estimator == "gae" and not critic) or (estimator == "remax" and not baseline):
        raise ValueError(f"compute_advantages: estimator={estimator!r} needs {ESTIMATOR_COLUMNS[estimator]}, which this flow does not provide")


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
