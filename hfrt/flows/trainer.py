"""The step loop every built-in RL flow shares, wiring the components it owns: the task's prompts
(hfrt.flows.data.Task), the flow's own step function, a validation pass every `val_every` steps
(hfrt.flows.validation), a record per step (hfrt.flows.metrics_processor), checkpoints every
`checkpoint_every` steps, resume from the run's latest checkpoint and an in-run rewind to it when
recovery replaced an actor or critic daemon (hfrt.flows.checkpoint_manager, hfrt.control.recovery),
and the actor's export as a Hugging Face folder at the end (hfrt.flows.export).

A flow gets its role groups with `get_roles` and supplies `step(step_index, prompts) -> metrics`;
the loop supplies everything around it. The task is the one the settings name (a reasoning-gym
task, a data file, else the addition task) unless the flow passes its own.
It knows role groups by name ("actor" for validation, the advantage state and the export, "reward"
for validation scores), the FlowConfig fields and when each component is due; it knows nothing of
what a step computes, and each component's insides stay behind its methods.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from hfrt.control.controller import Controller
from hfrt.control.group import RoleGroup
from hfrt.control.recovery import RecoveryFailed
from hfrt.flows.batches import prompts_handle
from hfrt.flows.checkpoint import Checkpoint
from hfrt.flows.checkpoint_manager import CheckpointManager, FlowState
from hfrt.flows.config import CALL_TIMEOUT_S, FlowConfig
from hfrt.flows.data import Task, config_task
from hfrt.flows.export import HFExport
from hfrt.flows.metrics_processor import MetricsProcessor
from hfrt.flows.reference import reference_role
from hfrt.flows.reward_errors import RewardErrors
from hfrt.flows.validation import Validator, before_training
from hfrt.log import get_logger
from hfrt.protocols import BatchHandle
from hfrt.wire.errors import HfrtError

__all__ = ["FlowState", "StepFn", "Trainer", "due", "get_roles", "sampling_seed"]

StepFn = Callable[[int, BatchHandle], Awaitable[dict[str, Any]]]


async def get_roles(ctl: Any, *names: str) -> dict[str, Any]:
    """The role groups a flow needs, waited for together. "reference" beside "actor" when the run
    launched no reference daemon (a LoRA actor stands in for it, hfrt.flows.reference): the actor's
    stand-in, checked once the actor is up. A run that launched a reference waits for its hello;
    with attached daemons (launched roles unknown) a reference that said hello is used."""
    daemons = getattr(ctl, "daemons", None)
    launched = getattr(ctl, "launched_roles", None)
    absent = "reference" not in launched if launched is not None else daemons is not None and not daemons("reference")
    stand_in = "reference" in names and "actor" in names and absent
    wait = [name for name in names if not (stand_in and name == "reference")]
    groups = dict(zip(wait, await asyncio.gather(*(ctl.role(name, timeout_s=CALL_TIMEOUT_S) for name in wait)), strict=True))
    if stand_in:
        groups["reference"] = reference_role(ctl, groups["actor"]) or await ctl.role("reference", timeout_s=CALL_TIMEOUT_S)
    return {name: groups[name] for name in names}


class Trainer:
    """Runs `cfg.steps` steps of a flow over `roles`; `trained` names the roles whose weights and
    optimizer state go into checkpoints (e.g. actor and critic), `state` the flow's own state saved
    with them, `task` what the run trains and validates on (default: the one `cfg` names)."""

    def __init__(
        self,
        ctl: Controller,
        cfg: FlowConfig,
        roles: Mapping[str, Any],
        *,
        trained: Sequence[str] = ("actor",),
        state: FlowState | None = None,
        task: Task | None = None,
    ) -> None:
        self.ctl, self.cfg, self.roles = ctl, cfg, dict(roles)
        self.trained = {name: self.roles[name] for name in trained}
        self.state = state
        self.task = task if task is not None else config_task(
            data=cfg.data, val_data=cfg.val_data, seed=cfg.seed, max_operand=cfg.max_operand, data_options=cfg.data_options)
        self.source = self.task.prompts()
        self.start_step = 0
        self.resumed_from = 0  # the checkpoint step a resumed run started from
        self.rewinds: list[list[int]] = []  # [failed step, checkpoint step] per in-run rewind (hfrt.control.recovery)
        self.reward_errors = RewardErrors(cfg.reward_error_limit)
        self.started: dict[str, int] = {}  # what the weights were at the start, for the summary
        actor = self.roles.get("actor")
        self.checkpoints = CheckpointManager(cfg.run_dir, max_step=cfg.steps, trained=self.trained, source=self.source,
                                             actor=actor, flow_state=state)
        self.validator = Validator(self.task, actor, self.roles.get("reward"), count=cfg.val_prompts,
                                   max_new_tokens=cfg.max_new_tokens, errors=self.reward_errors,
                                   temperature=cfg.val_temperature, n=cfg.val_n, seed=validation_seed(cfg))
        self.metrics = MetricsProcessor.for_config(ctl, cfg, self.reward_errors)
        self.exporter = HFExport(cfg.run_dir, actor, enabled=cfg.export_hf)

    async def run(self, step_fn: StepFn) -> dict[str, Any]:
        """Every step from the start (or the resumed checkpoint) to `cfg.steps`; returns the summary."""
        cfg = self.cfg
        self.step_fn = step_fn
        with self.metrics:
            await self._start()
            if cfg.val_only:
                return await self._validate_only()
            before: dict[str, float] = {}
            if cfg.val_every and cfg.val_before_train and self.start_step == 0:
                before = before_training(await self.validate())
            step = self.start_step
            while step < cfg.steps:
                try:
                    before = await self._step(step, before)
                except HfrtError as exc:
                    if not await self._rewind(step, exc):
                        raise
                    step = self.start_step
                    continue
                step += 1
        return await self._summary()

    async def _start(self) -> None:
        """Resume from the latest checkpoint when asked; a run that did not resume starts from the
        daemons' initial weights (CheckpointManager.initial_weights)."""
        if self.cfg.resume:
            ckpt = await self.checkpoints.resume()
            if ckpt is not None:
                self._restarted_at(ckpt.step)
                self.resumed_from = ckpt.step
        if not self.resumed_from:
            self.started = await self.checkpoints.initial_weights(self.cfg.daemons_dir, reset=self.cfg.reset_weights)

    async def _validate_only(self) -> dict[str, Any]:
        """val_only: one validation pass of the starting weights, written as the record of step 0
        (no step runs, nothing is exported); the summary holds its `val/*`."""
        metrics = await self.validate()
        self.metrics.write({"step": 0, **metrics})
        return {"val_only": True, "steps": 0, **metrics, "val_prompts": len(self.validator.rows()["prompt"]),
                "val_temperature": self.cfg.val_temperature, "val_n": self.cfg.val_n} | self.started

    async def _step(self, step: int, before: dict[str, float]) -> dict[str, float]:
        """One step: run it, validate if due, write its record, checkpoint if due."""
        cfg = self.cfg
        prompts = prompts_handle(self.source.batch(cfg.prompts_per_step))
        record = self.metrics.step_record(step, before, await self.step_fn(step, prompts))
        if due(cfg.val_every, step, cfg.steps):
            record |= await self.validate()
        self.metrics.write(record)
        if due(cfg.checkpoint_every, step, cfg.steps):
            await self.save(step + 1)
        return {}

    async def _rewind(self, step: int, exc: HfrtError) -> bool:
        """After a stateful role's daemon was replaced (hfrt.control.recovery), reload the last checkpoint
        into every trained role, rewind the data and the metrics to it, and return True; without
        recovery or such a death, False (the error stands); without a checkpoint, RecoveryFailed."""
        recovery = self.ctl.recovery
        if isinstance(exc, RecoveryFailed):
            return False
        lost = await recovery.wait_lost_state() if recovery is not None else {}
        if recovery is None or not lost:
            return False
        ckpt = self.checkpoints.latest()
        if ckpt is None:
            raise RecoveryFailed(
                f"{', '.join(lost)} died at step {step} ({next(iter(lost.values()))}) and there is no checkpoint "
                "to reload (set checkpoint_every)") from exc
        failed_at = time.monotonic()
        get_logger(part="trainer").warning("rewinding", step=step, to_step=ckpt.step, lost=lost, error=str(exc).splitlines()[0])
        await recovery.settle([g for g in self.roles.values() if isinstance(g, RoleGroup)])
        await self._load(ckpt)
        recovery.rewound(time.monotonic() - failed_at)
        self.rewinds.append([step, ckpt.step])
        return True

    async def _load(self, ckpt: Checkpoint) -> None:
        """Everything `ckpt` holds back into the run; the steps from its step on run again."""
        self._restarted_at(await self.checkpoints.load(ckpt))

    def _restarted_at(self, step: int) -> None:
        self.start_step = step
        self.metrics.truncate(step)

    async def _summary(self) -> dict[str, Any]:
        """The run summary: the records' figures, the export's folder, and how the run started."""
        summary = self.metrics.summary() | await self.exporter.export()
        if self.resumed_from:
            summary["resumed_from_step"] = self.resumed_from
        summary |= self.started
        if self.rewinds:
            summary["rewound"] = self.rewinds
        return summary

    def more_prompts(self, count: int) -> BatchHandle:
        """The data source's next `count` prompts, for a step that needs more than it was given
        (DAPO's dynamic sampling); they count in the source position that checkpoints save."""
        return prompts_handle(self.source.batch(count))

    async def validate(self) -> dict[str, float]:
        """One validation pass (hfrt.flows.validation; greedy unless val_temperature): `val/reward_mean` and `val/accuracy`,
        the share of scores the task counts as right."""
        return await self.validator.run()

    async def save(self, steps_done: int) -> None:
        """A checkpoint after `steps_done` steps (hfrt.flows.checkpoint_manager)."""
        await self.checkpoints.save(steps_done)


def due(every: int, step: int, steps: int) -> bool:
    """Whether something done every `every` steps (0: never) happens after step `step` (0-based):
    after every `every`-th step and after the last."""
    return bool(every) and ((step + 1) % every == 0 or step + 1 == steps)


def validation_seed(cfg: FlowConfig) -> int:
    """The sampling seed of every sampled validation pass: fixed by `seed`, apart from every step's."""
    return cfg.seed * 1_000_003 + 1_000_002


def sampling_seed(cfg: FlowConfig, step: int) -> int:
    """The generation seed of a step: fixed by (seed, step), so a resumed run samples as the
    interrupted one would have."""
    return cfg.seed * 1_000_003 + step
