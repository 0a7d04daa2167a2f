"""The step loop every built-in RL flow shares: prompts from the data source, the flow's own step
function, a validation pass every `val_every` steps, metrics per step, checkpoints every
`checkpoint_every` steps, resume from the run's latest checkpoint, an in-run rewind to the latest
checkpoint when recovery replaced an actor or critic daemon (hfrt.control.recovery), and the actor's
export as a Hugging Face folder at the end.

A flow gets its role groups with `get_roles` and supplies `step(step_index, prompts) -> metrics`;
the loop supplies everything around it.
It knows role groups by name ("actor" for validation and the advantage state, "reward" for
validation scores) and the FlowConfig fields; it knows nothing of what a step computes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from hfrt.control.controller import Controller
from hfrt.control.group import RoleGroup
from hfrt.control.recovery import RecoveryFailed
from hfrt.flows.batches import non_tensor, prompts_handle
from hfrt.flows.checkpoint import (
    Checkpoint,
    load_checkpoint,
    load_weights,
    resumable_checkpoint,
    save_checkpoint,
    save_weights,
)
from hfrt.flows.config import CALL_TIMEOUT_S, FlowConfig
from hfrt.flows.data import make_source, validation_rows
from hfrt.flows.reference import reference_role
from hfrt.flows.report import MetricsLog
from hfrt.flows.reward_errors import ERRORS_KEY, RewardErrors
from hfrt.log import get_logger
from hfrt.protocols import BatchHandle
from hfrt.wire.errors import HfrtError

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


class FlowState(Protocol):
    """A flow's own state that must survive a resume (e.g. Safe-RLHF's Lagrange multiplier)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Trainer:
    """Runs `cfg.steps` steps of a flow over `roles`; `trained` names the roles whose weights and
    optimizer state go into checkpoints (e.g. actor and critic)."""

    def __init__(
        self,
        ctl: Controller,
        cfg: FlowConfig,
        roles: Mapping[str, Any],
        *,
        trained: Sequence[str] = ("actor",),
        state: FlowState | None = None,
    ) -> None:
        self.ctl, self.cfg, self.roles = ctl, cfg, dict(roles)
        self.trained = {name: self.roles[name] for name in trained}
        self.state = state
        self.source = make_source(cfg.data, seed=cfg.seed, max_operand=cfg.max_operand)
        self.start_step = 0
        self.resumed_from = 0  # the checkpoint step a resumed run started from
        self.rewinds: list[list[int]] = []  # [failed step, checkpoint step] per in-run rewind (hfrt.control.recovery)
        self._val_rows: dict[str, list[Any]] | None = None  # read once, on the first validation
        self.reward_errors = RewardErrors(cfg.reward_error_limit)
        self.started: dict[str, int] = {}  # what the weights were at the start, for the summary (_start_weights)

    async def run(self, step_fn: StepFn) -> dict[str, Any]:
        cfg = self.cfg
        self.step_fn = step_fn
        with MetricsLog(cfg.run_dir, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project, progress=cfg.progress, total_steps=cfg.steps) as log:
            if cfg.resume:
                await self._resume(log)
            if not self.resumed_from:
                await self._start_weights()
            before: dict[str, float] = {}
            if cfg.val_every and cfg.val_before_train and self.start_step == 0:
                before = {k.replace("val/", "val_before/", 1): v for k, v in (await self.validate()).items()}
            step = self.start_step
            while step < cfg.steps:
                try:
                    before = await self._step(step, before, log)
                except HfrtError as exc:
                    if not await self._rewind(step, exc, log):
                        raise
                    step = self.start_step
                    continue
                step += 1
        summary = log.summary() | {"controller_bulk_bytes": self.ctl.stats()["controller_bulk_bytes"]}
        if cfg.export_hf and cfg.run_dir and "actor" in self.roles:
            await self.roles["actor"].export_hf(str(Path(cfg.run_dir) / "hf"), timeout_s=CALL_TIMEOUT_S)
            summary["hf_export"] = str(Path(cfg.run_dir) / "hf")
        if self.resumed_from:
            summary["resumed_from_step"] = self.resumed_from
        summary |= self.started
        if self.rewinds:
            summary["rewound"] = self.rewinds
        return summary

    async def _step(self, step: int, before: dict[str, float], log: MetricsLog) -> dict[str, float]:
        """One step: run it, validate if due, write its record, checkpoint if due."""
        cfg = self.cfg
        prompts = prompts_handle(self.source.batch(cfg.prompts_per_step))
        record = {"step": step, **before, **await self.step_fn(step, prompts)}
        self.reward_errors.observe(record.pop(ERRORS_KEY, []), step=step)
        if due(cfg.val_every, step, cfg.steps):
            record |= await self.validate()
        stats = self.ctl.stats()
        record["controller_bulk_bytes"] = stats["controller_bulk_bytes"]
        record["controller/unmatched_replies"] = stats.get("unmatched_replies", 0)  # signed replies to no pending call
        if self.ctl.recovery is not None:
            record |= self.ctl.recovery.metrics()
        log.write(record)
        if due(cfg.checkpoint_every, step, cfg.steps):
            await self.save(step + 1)
        return {}

    async def _rewind(self, step: int, exc: HfrtError, log: MetricsLog) -> bool:
        """After a stateful role's daemon was replaced (hfrt.control.recovery), reload the last checkpoint
        into every trained role, rewind the data and the metrics to it, and return True; without
        recovery or such a death, False (the error stands); without a checkpoint, RecoveryFailed."""
        recovery = self.ctl.recovery
        if isinstance(exc, RecoveryFailed):
            return False
        lost = await recovery.wait_lost_state() if recovery is not None else {}
        if recovery is None or not lost:
            return False
        found = resumable_checkpoint(self.cfg.run_dir, max_step=self.cfg.steps) if self.cfg.run_dir else None
        if found is None or found.checkpoint is None:
            raise RecoveryFailed(
                f"{', '.join(lost)} died at step {step} ({next(iter(lost.values()))}) and there is no checkpoint "
                "to reload (set checkpoint_every)") from exc
        failed_at = time.monotonic()
        get_logger(part="trainer").warning("rewinding", step=step, to_step=found.checkpoint.step, lost=lost, error=str(exc).splitlines()[0])
        await recovery.settle([g for g in self.roles.values() if isinstance(g, RoleGroup)])
        await self._load(found.checkpoint, log)
        recovery.rewound(time.monotonic() - failed_at)
        self.rewinds.append([step, found.checkpoint.step])
        return True

    def more_prompts(self, count: int) -> BatchHandle:
        """The data source's next `count` prompts, for a step that needs more than it was given
        (DAPO's dynamic sampling); they count in the source position that checkpoints save."""
        return prompts_handle(self.source.batch(count))

    # -- validation ------------------------------------------------------------------------

    async def validate(self) -> dict[str, float]:
        """Greedy responses to the fixed validation prompts, scored by the reward role:
        `val/reward_mean` and `val/accuracy` (share of scores >= 1)."""
        cfg = self.cfg
        if self._val_rows is None:
            self._val_rows = validation_rows(
                cfg.val_data or cfg.data, seed=cfg.seed, max_operand=cfg.max_operand, count=cfg.val_prompts
            )
        rows = self._val_rows
        actor, reward = self.roles["actor"], self.roles["reward"]
        rollout = await actor.generate(
            prompts_handle(rows), temperature=0.0, max_new_tokens=cfg.max_new_tokens, timeout_s=CALL_TIMEOUT_S
        )
        scored = await reward.score(rollout, timeout_s=CALL_TIMEOUT_S)
        self.reward_errors.observe(non_tensor(scored, "score_error"), step=None)
        scores = [float(s) for s in non_tensor(scored, "score")]
        accuracy = sum(s >= 1.0 for s in scores) / len(scores)
        return {"val/reward_mean": sum(scores) / len(scores), "val/accuracy": accuracy}

    # -- checkpoints -----------------------------------------------------------------------

    async def _start_weights(self) -> None:
        """Daemons that outlive a run (cfg.daemons_dir: --attach, --keep-daemons) may hold weights an
        earlier run trained (the actor's weight_version, its optimizer steps, above 0). Untrained,
        their weights are kept in DAEMONS_DIR/initial_weights; trained, the run says so and goes on
        from them (summary `started_from_trained_weights`: the actor's steps), or, with
        reset_weights, loads the kept ones back (summary `weights_reset`)."""
        cfg, actor = self.cfg, self.roles.get("actor")
        if not cfg.daemons_dir or actor is None or "weight_version" not in actor.endpoints:
            return
        version = max(int(v) for v in await actor.weight_version(timeout_s=CALL_TIMEOUT_S))
        folder = Path(cfg.daemons_dir) / "initial_weights"
        log = get_logger(part="trainer")
        if version == 0:
            await save_weights(folder, self.trained, timeout_s=CALL_TIMEOUT_S)
        elif cfg.reset_weights:
            await load_weights(folder, self.trained, timeout_s=CALL_TIMEOUT_S)
            log.warning("weights_reset", discarded_actor_steps=version, loaded=str(folder))
            self.started["weights_reset"] = version
        else:
            log.warning("continuing_from_trained_weights", actor_steps=version,
                        why="these daemons were trained by an earlier run",
                        hint="--set reset_weights=true starts from the weights they started with")
            self.started["started_from_trained_weights"] = version

    async def save(self, steps_done: int) -> None:
        state: dict[str, Any] = {"data": self.source.state_dict()}
        if "actor" in self.roles and "advantage_state" in self.roles["actor"].endpoints:
            state["advantage"] = await self.roles["actor"].advantage_state(timeout_s=CALL_TIMEOUT_S)
        if self.state is not None:
            state["flow"] = self.state.state_dict()
        await save_checkpoint(self.cfg.run_dir, steps_done, self.trained, state, timeout_s=CALL_TIMEOUT_S)

    async def _resume(self, log: MetricsLog) -> None:
        found = resumable_checkpoint(self.cfg.run_dir, max_step=self.cfg.steps)  # as checked before launch
        ckpt = found.checkpoint
        if ckpt is None:
            return  # nothing saved yet: start from step 0
        if found.damaged:
            get_logger(part="trainer").info("checkpoint_passed_over", using=str(ckpt.path), damaged=found.damaged)
        await self._load(ckpt, log)
        self.resumed_from = ckpt.step

    async def _load(self, ckpt: Checkpoint, log: MetricsLog) -> None:
        """Weights, optimizer, data position, advantage and flow state from `ckpt`; steps from its on."""
        await load_checkpoint(ckpt, self.trained, timeout_s=CALL_TIMEOUT_S)
        self.source.load_state_dict(ckpt.state["data"])
        if "advantage" in ckpt.state:
            await self.roles["actor"].load_advantage_state(ckpt.state["advantage"], timeout_s=CALL_TIMEOUT_S)
        if self.state is not None and "flow" in ckpt.state:
            self.state.load_state_dict(ckpt.state["flow"])
        self.start_step = ckpt.step
        log.truncate(ckpt.step)


def due(every: int, step: int, steps: int) -> bool:
    """Whether something done every `every` steps (0: never) happens after step `step` (0-based):
    after every `every`-th step and after the last."""
    return bool(every) and ((step + 1) % every == 0 or step + 1 == steps)


def sampling_seed(cfg: FlowConfig, step: int) -> int:
    """The generation seed of a step: fixed by (seed, step), so a resumed run samples as the
    interrupted one would have."""
    return cfg.seed * 1_000_003 + step
