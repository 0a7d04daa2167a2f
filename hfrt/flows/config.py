"""FlowConfig, the settings every built-in RL flow reads, and how a flow's config dict becomes it
(read once, checked before any daemon starts).

No torch, no roles: it knows setting names, their types and limits, and which update options
they turn into; it does not know what a flow does with them.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from hfrt.control.recovery import RecoveryPolicy
from hfrt.flows.gym_data import gym_task
from hfrt.wire.loss_options import TOKEN_BASELINE_ESTIMATORS, check_advantage_options, check_update_options
from hfrt.wire.reasoning_gym_tasks import GymTaskError, is_gym

C = TypeVar("C", bound="FlowConfig")
#: actor_loss options that are another spelling of a setting: (table, option) → the setting it sets.
#: Resolved in one place, FlowConfig.__post_init__ (giving both with different values is an error).
ALIASES: dict[tuple[str, str], str] = {("actor_loss", "policy_loss_mode"): "policy_loss_mode"}
#: how long one call of a flow may take before the flow gives up (a step on CPU takes seconds): the
#: default timeout of the controller a run's session builds (hfrt.session), so a flow's calls give
#: none; a call that needs another deadline says so (`endpoint.with_timeout(s)`)
CALL_TIMEOUT_S = 300.0
#: the defaults a data file brings in place of the addition task's (a real model's answers are
#: sentences, not one digit; a pretrained policy needs no entropy bonus to keep exploring); a
#: setting given explicitly wins
DATA_DEFAULTS: dict[str, Any] = {"max_new_tokens": 64, "entropy_coeff": 0.0, "kl_coef": 0.001, "prompts_per_step": 16}


@dataclass(frozen=True)
class FlowConfig:
    """Settings every built-in RL flow reads (`--config FILE`, `--set key=value`). The `#:` comment
    above a field is its description: docs/configuration.md's key tables are generated from them.

    With a data file the defaults of DATA_DEFAULTS apply (64 new tokens, no entropy bonus, PPO's
    in-reward KL at 0.001, 16 prompts a step), and the default reward scores its rows with the
    generic numeric reward (hfrt.flows.tasks).
    """

    #: RL steps
    steps: int = 150
    #: prompts per step (each sampled `n` times where the flow samples groups)
    prompts_per_step: int = 16
    #: seed of the data order and of sampling (a step's sampling seed is fixed by seed and step)
    seed: int = 0
    #: the built-in addition task's largest addend (used when `data` is "")
    max_operand: int = 2
    #: new tokens sampled per response at most
    max_new_tokens: int = 2
    #: sampling temperature of the rollouts (validation's is val_temperature, default greedy)
    temperature: float = 1.0
    #: passes over each rollout in the actor's and the critic's updates
    ppo_epochs: int = 1
    #: rows per optimizer step over the whole group (0: one optimizer step per epoch)
    ppo_mini_batch_size: int = 0
    #: the actor's entropy bonus (keeps a small policy exploring)
    entropy_coeff: float = 0.01
    #: the actor's policy loss (vanilla, gspo, cispo, decoupled, ...); the one place to set it
    #: (`actor_loss.policy_loss_mode`, the older spelling, is read into it: see ALIASES)
    policy_loss_mode: str = "vanilla"
    #: truncated importance sampling against the sampler's log-probs, weights capped at tis_cap (0: off)
    tis_cap: float = 0.0
    #: more actor `update` options (hfrt.wire.loss_options), merged last into every actor update
    #: call, e.g. `--set actor_loss.clip_ratio_c=10`; checked before launch
    actor_loss: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: more critic `update` options (hfrt.wire.loss_options), merged last into every critic update
    #: call, e.g. `--set critic_loss.cliprange_value=0.2`; checked before launch
    critic_loss: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: compute_advantages options merged last into the flow's own (advantage_call), e.g.
    #: `--set advantage.estimator=opo`; checked before launch (a group estimator needs n >= 2,
    #: gae a critic, remax the remax flow's baseline)
    advantage: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: whether the flow runs a critic (gae's values); PPO-family configs set it
    CRITIC: ClassVar[bool] = False
    #: the dict `read` built this config from (set on the instance there; None: built directly)
    _source: ClassVar[Mapping[str, Any] | None] = None
    #: a JSONL / JSON / Parquet file of prompts (hfrt/flows/data.py), or `reasoning_gym:TASK` (a
    #: reasoning-gym task, `composite`, or a composite's YAML file; hfrt/flows/gym_data.py), checked
    #: before launch; "" uses the built-in addition task
    data: str = ""
    #: the options of `data = "reasoning_gym:TASK"`: the task's own config keys (size, seed — default
    #: the run's seed —, and the task's; a composite's `datasets`), plus `system_prompt` (a
    #: reasoning-gym prompt name, default "default", "" for none, or the text)
    data_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the validation prompts' file ("": data's first rows, or held-out addition prompts)
    val_data: str = ""
    #: a validation pass every N steps and after the last (0: none; greedy unless val_temperature);
    #: the summary shows the first and last validation accuracy
    val_every: int = 0
    #: prompts in each validation pass
    val_prompts: int = 32
    #: with val_every, also one validation pass before the first step (`val_before/*` in step 0's record)
    val_before_train: bool = True
    #: the validation pass's sampling temperature (verl's `val_kwargs.temperature`); 0: greedy
    val_temperature: float = 0.0
    #: responses per validation prompt (verl's `val_kwargs.n`; needs val_temperature > 0):
    #: `val/accuracy` and `val/reward_mean` are means over every response
    val_n: int = 1
    #: one validation pass of the starting weights and no training (verl's `trainer.val_only`): the
    #: summary and metrics.jsonl hold its `val/*`; no step runs and nothing is exported
    val_only: bool = False
    #: a checkpoint every N steps and after the last (0: none)
    checkpoint_every: int = 0
    #: at the end, write the actor as a Hugging Face model folder, RUN_DIR/hf
    export_hf: bool = True
    #: also write RUN_DIR/tensorboard
    tensorboard: bool = True
    #: also log to this W&B project (needs wandb; "": no W&B)
    wandb_project: str = ""
    #: "auto" (a bar on a terminal, nothing otherwise), "on" or "off"
    progress: str = "auto"
    #: write RUN_DIR/trace.json (a Chrome trace of every call)
    trace: bool = True
    #: the run folder, set by `hfrt controller` (--run-dir); "" writes no file
    run_dir: str = ""
    #: continue the run in run_dir from its last checkpoint, set by `hfrt controller` (--resume)
    resume: bool = False
    #: "on" relaunches a dead or hung reward / reference / cost daemon and retries the calls that
    #: failed with it, and relaunches a dead actor / critic and rewinds to the last checkpoint
    #: (hfrt.control.recovery; local, SSH and Slurm launchers, not --attach); "off": a lost daemon ends the run
    recovery: str = "off"
    #: restarts of one daemon allowed within recovery_window_s; one more ends the run
    recovery_max_restarts: int = 3
    #: the window, in seconds, over which recovery_max_restarts is counted
    recovery_window_s: float = 600.0
    #: a sample on which the reward function raises scores the reward role's error_score (each kind
    #: of error is logged once on stderr with its traceback); when more than this share of a step's
    #: samples failed, the run stops with the traceback and exit 1 (1: never)
    reward_error_limit: float = 0.5
    #: a run on daemons an earlier run trained (--attach) continues from their trained weights by
    #: default, and says so (a warning and `started_from_trained_weights` in the summary); true
    #: loads the weights they started with instead (kept in daemons_dir/initial_weights)
    reset_weights: bool = False
    #: where attached daemons keep their initial weights: `hfrt controller` sets it to the attach
    #: file's folder, or RUN_DIR with --keep-daemons
    daemons_dir: str = ""
    #: with LoRA on the actor (roles.actor.options.lora) the reference log-probs are the actor's
    #: with its adapters off, and no reference daemon is launched (hfrt.flows.reference); false
    #: keeps the reference role. No effect without LoRA
    reference_from_actor: bool = True

    def __post_init__(self) -> None:
        self._resolve_aliases()
        for name in ("steps", "prompts_per_step", "max_new_tokens", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"config {name}={getattr(self, name)!r}: must be at least 1")
        for name in ("ppo_mini_batch_size", "val_every", "val_prompts", "checkpoint_every", "max_operand"):
            if getattr(self, name) < 0:
                raise ValueError(f"config {name}={getattr(self, name)!r}: must not be negative")
        if self.temperature < 0:
            raise ValueError(f"config temperature={self.temperature!r}: must not be negative")
        self._check_validation_sampling()
        if not 0.0 <= self.reward_error_limit <= 1.0:
            raise ValueError(f"config reward_error_limit={self.reward_error_limit!r}: a share of a step's samples, 0 to 1 (1: never stop)")
        if self.tis_cap < 0:
            raise ValueError(f"config tis_cap={self.tis_cap!r}: must not be negative (0: off)")
        self.check_update_options()
        self.check_advantage_options()
        self.recovery_policy()
        if self.progress not in ("auto", "on", "off"):
            raise ValueError(f"config progress={self.progress!r}: use auto, on or off")
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ValueError(f"config wandb_project={self.wandb_project!r}: W&B logging needs wandb (pip install wandb)")
        self._check_gym_data()
        for name in ("data", "val_data"):
            path = getattr(self, name)
            if name == "data" and is_gym(path):
                continue
            if path and not Path(path).is_file():
                raise ValueError(f"config {name}={path!r}: no such file")
            if path:  # rows of the wrong shape, or none, refused before any daemon starts
                from hfrt.flows.data import check_data_file
                check_data_file(path, f"config {name}")

    def _check_validation_sampling(self) -> None:
        """val_temperature and val_n: n samples of one greedy answer would all be the same."""
        if self.val_temperature < 0:
            raise ValueError(f"config val_temperature={self.val_temperature!r}: must not be negative (0: greedy)")
        if isinstance(self.val_n, bool) or self.val_n < 1:
            raise ValueError(f"config val_n={self.val_n!r}: must be at least 1")
        if self.val_n > 1 and self.val_temperature == 0:
            raise ValueError(f"config val_n={self.val_n}: greedy validation (val_temperature=0) gives one answer per "
                             "prompt; set val_temperature > 0 (e.g. 1.0) to sample val_n of them")

    def _check_gym_data(self) -> None:
        """A reasoning-gym `data` and its `data_options`, checked by building the task once (the
        rows' scorer is the task's own); data_options without one is an error naming both keys."""
        if not is_gym(self.data):
            if self.data_options:
                raise ValueError(f"config data_options={self.data_options!r}: read only with data = \"reasoning_gym:TASK\" "
                                 f"(data is {self.data!r})")
            return
        try:
            gym_task(self.data, self.data_options, seed=self.seed)
        except GymTaskError as exc:
            raise ValueError(f"config {exc}") from None

    def _resolve_aliases(self) -> None:
        """Move each ALIASES option out of its table into the setting it spells (the only place
        either spelling is read); both given with different values is an error naming them."""
        for (table, option), name in ALIASES.items():
            options = dict(getattr(self, table))
            if option not in options:
                continue
            value = options.pop(option)
            default = next(f.default for f in dataclasses.fields(self) if f.name == name)
            if getattr(self, name) not in (default, value):
                raise ValueError(
                    f"config {table}.{option}={value!r} and {name}={getattr(self, name)!r}: the same setting "
                    f"given twice; set {name} only")
            object.__setattr__(self, name, value)
            object.__setattr__(self, table, options)

    def recovery_policy(self) -> RecoveryPolicy:
        """The recovery settings (recovery, recovery_max_restarts, recovery_window_s) as the
        controller's policy; ValueError naming the key when one is bad."""
        keys = ("recovery", "recovery_max_restarts", "recovery_window_s")
        return RecoveryPolicy.from_config({k: getattr(self, k) for k in keys})

    def actor_update_options(self) -> dict[str, Any]:
        """Every actor.update option of this flow: the schedule, the entropy bonus, the policy
        loss mode and TIS, then the flow's own (flow_actor_options), then the actor_loss table."""
        base: dict[str, Any] = {
            "ppo_epochs": self.ppo_epochs, "ppo_mini_batch_size": self.ppo_mini_batch_size,
            "entropy_coeff": self.entropy_coeff, "policy_loss_mode": self.policy_loss_mode,
        }
        if self.tis_cap > 0:
            base["tis_cap"] = self.tis_cap
        return base | self.flow_actor_options() | dict(self.actor_loss)

    def on_policy(self, rows: int) -> bool:
        """Whether the actor's update over a rollout of `rows` rows is one optimizer step
        (ppo_epochs 1, one mini-batch, after the actor_loss table), or the update runs in bypass_mode:
        then its old log-probs are its current ones (bypass: the rollout's) and the flow skips the
        pass that computes them — unless an optimal token baseline needs that pass's Σπ²."""
        options = self.actor_update_options()
        mini = int(options.get("ppo_mini_batch_size", 0))
        one_step = int(options.get("ppo_epochs", 1)) == 1 and (mini == 0 or mini >= rows)
        bypass = bool(options.get("bypass_mode"))  # the rollout's log-probs are the old ones
        return (one_step or bypass) and not self.log_prob_options()  # an optimal token baseline reads that pass's Σπ²

    def critic_update_options(self) -> dict[str, Any]:
        """Every critic.update option: the schedule, the flow's own, then the critic_loss table."""
        base = {"ppo_epochs": self.ppo_epochs, "ppo_mini_batch_size": self.ppo_mini_batch_size}
        return base | self.flow_critic_options() | dict(self.critic_loss)

    def flow_actor_options(self) -> dict[str, Any]:
        """A flow's own actor.update options (its config subclass overrides this)."""
        return {}

    def flow_critic_options(self) -> dict[str, Any]:
        """A flow's own critic.update options (its config subclass overrides this)."""
        return {}

    def check_update_options(self) -> None:
        """Refuse, before launch, update options the actor or critic would refuse: an unknown
        key or a bad value, with every accepted option listed."""
        for role, options in (("actor", self.actor_update_options()), ("critic", self.critic_update_options())):
            try:
                check_update_options(role, options)
            except ValueError as err:
                raise ValueError(f"config: {err} (from the flow's settings or its {role}_loss table)") from None

    def advantage_call(self, **flow: Any) -> dict[str, Any]:
        """compute_advantages' keyword options: the flow's own (`flow`), then the advantage table."""
        return flow | dict(self.advantage)

    def log_prob_options(self) -> dict[str, Any]:
        """actor.compute_log_prob's options: Σπ² when the advantage table names an optimal token baseline."""
        return {"sum_pi_squared": True} if self.advantage.get("estimator") in TOKEN_BASELINE_ESTIMATORS else {}

    def advantage_options(self) -> dict[str, Any]:
        """The estimator and options the flow itself passes to compute_advantages, when its config
        names them (the RLOO family's do); {} where the flow's step names its own."""
        return {}

    def check_advantage_options(self) -> None:
        """Refuse, before launch, an advantage table the flow cannot run (see check_advantage_options)."""
        baseline = self.advantage_options().get("estimator") == "remax"
        n = int(getattr(self, "n", 1))  # the `n` field of a config whose flow samples groups
        try:
            check_advantage_options(self.advantage, n, critic=self.CRITIC, baseline=baseline)
        except ValueError as err:
            raise ValueError(f"config: {err} (from the advantage table)") from None

    @classmethod
    def read(cls: type[C], config: Mapping[str, Any] | FlowConfig) -> C:
        """The config from a flow's `config` dict: unknown keys and values of the wrong type are
        errors naming the key, raised before any daemon is called. A config already read (what
        hfrt.flows.Flow hands a flow that defines Config) is returned as it is when it is a `cls`,
        and read again from its dict when it is another flow's."""
        if isinstance(config, cls):
            return config
        if isinstance(config, FlowConfig):
            config = config.source
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - set(fields))
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}{did_you_mean(unknown, fields)}; this flow reads {sorted(fields)}")
        values: dict[str, Any] = {}
        for key, raw in config.items():
            kind = _field_type(fields[key])
            if kind is dict:
                raw = _table(key, raw)
            if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
                raw = float(raw)
            if not isinstance(raw, kind) or (kind is not bool and isinstance(raw, bool)):
                raise ValueError(f"config {key}={raw!r}: expected {kind.__name__}")
            values[key] = raw
        if values.get("data"):
            values = {k: v for k, v in DATA_DEFAULTS.items() if k in fields} | values
        out = cls(**values)
        object.__setattr__(out, "_source", dict(config))
        return out

    @property
    def source(self) -> dict[str, Any]:
        """The dict this config was read from (its fields' values when it was built directly)."""
        return dict(self._source) if self._source is not None else {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def did_you_mean(unknown: list[str], known: Iterable[str]) -> str:
    """` (did you mean `steps`?)` naming the closest known key to each unknown one (difflib), or ""."""
    names = list(known)
    guesses = [f"`{match[0]}`" for key in unknown if (match := difflib.get_close_matches(key, names, n=1, cutoff=0.6))]
    return f" (did you mean {', '.join(dict.fromkeys(guesses))}?)" if guesses else ""


def _field_type(f: dataclasses.Field[Any]) -> type:
    """The type a config field's values must have: its default's, or its default factory's."""
    if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
        return type(f.default_factory())
    return type(f.default)


def _table(key: str, raw: Any) -> dict[str, Any]:
    """A config table (a dict with string keys), copied."""
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
        raise ValueError(f"config {key}={raw!r}: expected a table of option = value (e.g. --set {key}.NAME=VALUE)")
    return dict(raw)
