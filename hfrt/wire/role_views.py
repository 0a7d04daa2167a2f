"""The built-in roles' endpoints as a flow calls them: one typed view per role (Actor, Critic,
Reference, Reward, RewardModel, Rollout, Echo) and the keyword options their endpoints take.

Use a view to type a role group (`actor = await ctl.role("actor", Actor)`, or a step's parameter
`actor: Actor`); a type checker then checks every endpoint name, keyword and type (see
hfrt.wire.handles for what "as a flow calls it" means: BatchHandles in, what the dispatch mode
collects out). The option tables are the daemons' own (a generate call's SamplingParams, the
update's loss options and schedule, the advantage options), which tests/roles/test_role_views.py
holds equal, with every signature here, to the daemon classes in hfrt.roles.

Types only: no torch, nothing of the daemons' code; nothing here runs.
"""

from __future__ import annotations

from typing import Any, Protocol, TypedDict, Unpack

from hfrt.protocols import BatchHandle
from hfrt.wire.handles import RoleHandle, remote


class Sampling(TypedDict, total=False):
    """A generate call's sampling options (the role's SamplingParams; absent: the role's `sampling`)."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    n: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    seed: int | None
    row_offset: int | None
    max_prompt_tokens: int | None
    stop_strings: tuple[str, ...]
    include_stop_str_in_output: bool
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float] | None
    json_schema: dict[str, Any] | None


class TurnSampling(Sampling, total=False):
    """A turn's options: Sampling's, plus each token's text (pieces), the top log-probs per token,
    the context's last ids decoded as the turn's text prefix, filling the context when no
    max_new_tokens is given, and the whole request's max_tokens when a call samples its first part."""

    pieces: bool
    top_logprobs: int
    text_prefix: int
    fit_context: bool
    request_max_tokens: int | None


class UpdateSchedule(TypedDict, total=False):
    """How an update walks its batch (hfrt.wire.loss_options.UpdateSchedule)."""

    ppo_epochs: int
    ppo_mini_batch_size: int
    micro_batch_size: int | None


class ActorUpdate(UpdateSchedule, total=False):
    """`actor.update`'s loss options (hfrt.wire.loss_options.ActorLoss) and schedule."""

    policy_loss_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    tis_cap: float | None
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    loss_agg_mode: str
    norm_horizon: int | None
    temperature: float | None
    keep_loss_agg_mode: bool
    tau_pos: float
    tau_neg: float
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    ppo_kl_coef: float
    loss_seed: int
    rollout_is: str | None
    rollout_is_threshold: float
    rollout_is_batch_normalize: bool
    rollout_rs: str | None
    rollout_rs_threshold: str | float | None
    bypass_mode: bool


class CriticUpdate(UpdateSchedule, total=False):
    """`critic.update`'s loss options (hfrt.wire.loss_options.CriticLoss) and schedule."""

    cliprange_value: float | None
    loss_agg_mode: str
    norm_horizon: int | None


class Advantages(TypedDict, total=False):
    """`compute_advantages`' options besides the estimator (hfrt.wire.loss_options.ADVANTAGE_OPTIONS)."""

    gamma: float
    lam: float
    norm_adv_by_std: bool
    epsilon: float
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl: str
    kl_coef: float
    target_kl: float
    horizon: float
    score_column: str
    index_column: str
    baseline_column: str
    cost_column: str
    cost_coef: float
    overlong_buffer_len: int
    overlong_penalty_factor: float
    max_response_len: int
    f_norm: float
    sum_pi_squared_column: str
    handle_zero_tail: bool | None
    rollout_is: str | None
    rollout_is_threshold: float
    teacher_column: str
    distill_reward_coef: float
    distill_baseline: bool


class Checkpointed(RoleHandle, Protocol):
    """A role whose state goes into run checkpoints (every rank writes or reads its part)."""

    @remote
    def save(self, path: str) -> list[str]: ...

    @remote
    def load(self, path: str) -> list[dict[str, int]]: ...


class Turns(RoleHandle, Protocol):
    """A role that samples agent turns (the actor and the rollout role)."""

    @remote
    def generate_turn(self, batch: BatchHandle, *extra: BatchHandle, stop: dict[str, list[str]] | None = None,
                      **sampling: Unpack[TurnSampling]) -> BatchHandle: ...

    @remote
    def generate_turn_stream(self, context: list[int], append: list[Any], stop: dict[str, list[str]] | None = None,
                             **sampling: Unpack[TurnSampling]) -> dict[str, Any]: ...

    @remote
    def turn_streams(self) -> list[dict[str, int]]: ...

    @remote
    def serving_info(self) -> list[dict[str, Any]]: ...

    @remote
    def assemble_trajectories(self, batch: BatchHandle, *extra: BatchHandle, prompt_width: int = 0,
                              response_width: int = 0) -> BatchHandle: ...

    @remote
    def weight_version(self) -> list[int]: ...


class Actor(Checkpointed, Turns, Protocol):
    """The actor (hfrt.roles.actor, and actor_ref, the actor that also serves the reference)."""

    @remote
    def generate(self, batch: BatchHandle, *extra: BatchHandle, chunk: int | None = None, chunks: int = 1,
                 **sampling: Unpack[Sampling]) -> BatchHandle: ...

    @remote
    def hybrid_phase(self) -> list[dict[str, Any]]: ...

    @remote
    def compute_log_prob(self, batch: BatchHandle, *extra: BatchHandle, temperature: float | None = None,
                         sum_pi_squared: bool = False) -> BatchHandle: ...

    @remote
    def update(self, batch: BatchHandle, *extra: BatchHandle, **loss: Unpack[ActorUpdate]) -> list[dict[str, float]]: ...

    @remote
    def compute_ref_log_prob(self, batch: BatchHandle, *extra: BatchHandle, temperature: float | None = None) -> BatchHandle: ...

    @remote
    def sft_update(self, batch: BatchHandle, max_length: int | None = None,
                   micro_batch_size: int | None = None, truncation: str = "error") -> list[dict[str, float]]: ...

    @remote
    def sft_evaluate(self, batch: BatchHandle, max_length: int | None = None,
                     truncation: str = "error") -> list[dict[str, float]]: ...

    @remote
    def dpo_update(self, batch: BatchHandle, *extra: BatchHandle, loss_type: str = "sigmoid", beta: float = 0.1,
                   label_smoothing: float = 0.0, max_length: int | None = None,
                   micro_batch_size: int | None = None) -> list[dict[str, float]]: ...

    @remote
    def dpo_evaluate(self, batch: BatchHandle, *extra: BatchHandle, loss_type: str = "sigmoid", beta: float = 0.1,
                     label_smoothing: float = 0.0, max_length: int | None = None) -> list[dict[str, float]]: ...

    @remote
    def compute_ref_pair_log_probs(self, batch: BatchHandle, *extra: BatchHandle, max_length: int | None = None) -> BatchHandle: ...

    @remote
    def export_hf(self, path: str) -> list[str]: ...

    @remote
    def weight_sync_report(self) -> list[dict[str, Any]]: ...

    @remote
    def publish_weights(self, version: int, bucket_mb: float = 64.0,
                        corrupt_buckets: list[int] | None = None) -> list[dict[str, Any]]: ...

    @remote
    def compute_advantages(self, batch: BatchHandle, *extra: BatchHandle, estimator: str = "gae",
                           **params: Unpack[Advantages]) -> BatchHandle: ...

    @remote
    def advantage_state(self) -> dict[str, Any]: ...

    @remote
    def load_advantage_state(self, state: dict[str, Any]) -> None: ...


class Critic(Checkpointed, Protocol):
    """The critic (hfrt.roles.critic)."""

    @remote
    def compute_values(self, batch: BatchHandle, *extra: BatchHandle) -> BatchHandle: ...

    @remote
    def update(self, batch: BatchHandle, *extra: BatchHandle, **loss: Unpack[CriticUpdate]) -> list[dict[str, float]]: ...


class Reference(RoleHandle, Protocol):
    """The reference policy (hfrt.roles.reference; or the LoRA actor standing in for it)."""

    @remote
    def compute_log_prob(self, batch: BatchHandle, *extra: BatchHandle, temperature: float | None = None) -> BatchHandle: ...

    @remote
    def compute_pair_log_probs(self, batch: BatchHandle, *extra: BatchHandle, max_length: int | None = None) -> BatchHandle: ...


class Reward(RoleHandle, Protocol):
    """A reward (or cost) role (hfrt.roles.reward): a rule or a model scores each response."""

    @remote
    def score(self, batch: BatchHandle, *extra: BatchHandle) -> BatchHandle: ...


class RewardModel(Checkpointed, Protocol):
    """A reward model being trained on preference pairs (hfrt.roles.reward_model)."""

    @remote
    def update(self, batch: BatchHandle) -> list[dict[str, float]]: ...

    @remote
    def evaluate(self, batch: BatchHandle) -> list[dict[str, float]]: ...

    @remote
    def export_hf(self, path: str) -> list[str]: ...


class Rollout(Turns, Protocol):
    """A generation-only role (hfrt.roles.rollout) that takes published weights."""

    @remote
    def generate(self, batch: BatchHandle, *extra: BatchHandle, **sampling: Unpack[Sampling]) -> BatchHandle: ...

    @remote
    def generate_partial(self, batch: BatchHandle, *extra: BatchHandle, key: str, segment_tokens: int, segment: int = 0,
                         **sampling: Unpack[Sampling]) -> BatchHandle: ...

    @remote
    def load_weights(self, sync: dict[str, Any]) -> list[dict[str, Any]]: ...


class Echo(RoleHandle, Protocol):
    """The diagnostic echo role (hfrt.roles.diagnostic.echo): round trips, sleeps, errors, streams."""

    @remote
    def ping(self) -> list[str]: ...

    @remote
    def echo(self, value: Any) -> list[Any]: ...

    @remote
    def sleep(self, seconds: float, tag: Any = None) -> list[float]: ...

    @remote
    def block(self, seconds: float, tag: Any = None) -> list[float]: ...

    @remote
    def sleep_concurrent(self, seconds: float, tag: Any = None) -> list[float]: ...

    @remote
    def gate(self, name: str) -> list[str]: ...

    @remote
    def release(self, name: str) -> list[None]: ...

    @remote
    def record(self, tag: Any) -> list[int]: ...

    @remote
    def history(self) -> list[list[Any]]: ...

    @remote
    def fail(self, message: str = "requested failure") -> list[None]: ...

    @remote
    def blob(self, nbytes: int) -> list[bytes]: ...

    @remote
    def unsendable(self) -> list[Any]: ...

    @remote
    def count(self, n: int, step_s: float = 0.0, fail_at: int = -1) -> int: ...

    @remote
    def tag_rows(self, rows: list[Any]) -> list[Any]: ...

    @remote
    def leader(self) -> int: ...
