"""A run's checkpoint decisions, owned by the Trainer: what a checkpoint holds beside the trained roles'
weights (the data position, the actor's advantage state, the flow's own state), saving one, resuming
from the newest whole one, reloading it after a lost daemon (rewind), and a daemon's initial weights.

It knows role groups by name ("actor" for the advantage state and weight versions) and the file
layout through hfrt.flows.checkpoint; it does not know when a step is due for a checkpoint, what a
step computes, or how a run records its metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from hfrt.flows.checkpoint import (
    Checkpoint,
    load_checkpoint,
    load_weights,
    resumable_checkpoint,
    save_checkpoint,
    save_weights,
)
from hfrt.flows.data import PromptSource
from hfrt.log import get_logger


class FlowState(Protocol):
    """A flow's own state that must survive a resume (e.g. Safe-RLHF's Lagrange multiplier)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointManager:
    """Checkpoints of one run in `run_dir` ("": none): `trained` are the role groups whose weights and
    optimizer state are saved and reloaded, `source` the prompt stream whose position is saved,
    `actor` the group whose advantage state is saved when it has that endpoint, `flow_state` the
    flow's own state. `max_step` is the run's step count (a checkpoint beyond it is not resumed)."""

    def __init__(
        self,
        run_dir: str,
        *,
        max_step: int,
        trained: Mapping[str, Any],
        source: PromptSource,
        actor: Any = None,
        flow_state: FlowState | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.run_dir, self.max_step = run_dir, max_step
        self.trained = dict(trained)
        self.source, self.actor, self.flow_state = source, actor, flow_state
        self.timeout_s = timeout_s

    async def save(self, steps_done: int) -> Path:
        """A checkpoint after `steps_done` steps: the trained roles and state.json's data, advantage
        and flow states (hfrt.flows.checkpoint.save_checkpoint)."""
        state: dict[str, Any] = {"data": self.source.state_dict()}
        if self._has(self.actor, "advantage_state"):
            state["advantage"] = await self.actor.advantage_state(timeout_s=self.timeout_s)
        if self.flow_state is not None:
            state["flow"] = self.flow_state.state_dict()
        return await save_checkpoint(self.run_dir, steps_done, self.trained, state, timeout_s=self.timeout_s)

    def latest(self) -> Checkpoint | None:
        """The checkpoint a resume or a rewind loads (the one the check before launch found), or None
        when the run has none; CheckpointError when it has some but none is whole."""
        if not self.run_dir:
            return None
        found = resumable_checkpoint(self.run_dir, max_step=self.max_step)
        if found.checkpoint is not None and found.damaged:
            get_logger(part="trainer").info("checkpoint_passed_over", using=str(found.checkpoint.path), damaged=found.damaged)
        return found.checkpoint

    async def resume(self) -> Checkpoint | None:
        """Load the latest whole checkpoint, or None (start from step 0) when nothing was saved yet."""
        ckpt = self.latest()
        if ckpt is not None:
            await self.load(ckpt)
        return ckpt

    async def load(self, ckpt: Checkpoint) -> int:
        """Weights, optimizer, data position, advantage and flow state from `ckpt`; returns its step
        (the first step to run next)."""
        await load_checkpoint(ckpt, self.trained, timeout_s=self.timeout_s)
        self.source.load_state_dict(ckpt.state["data"])
        if "advantage" in ckpt.state:
            if self.actor is None:
                raise ValueError(f"checkpoint {ckpt.path} holds an advantage state, and this run has no actor to load it into")
            await self.actor.load_advantage_state(ckpt.state["advantage"], timeout_s=self.timeout_s)
        if self.flow_state is not None and "flow" in ckpt.state:
            self.flow_state.load_state_dict(ckpt.state["flow"])
        return ckpt.step

    async def initial_weights(self, daemons_dir: str, *, reset: bool) -> dict[str, int]:
        """Daemons that outlive a run (daemons_dir: --attach, --keep-daemons) may hold weights an
        earlier run trained (the actor's weight_version, its optimizer steps, above 0). Untrained,
        their weights are kept in DAEMONS_DIR/initial_weights; trained, the run goes on from them
        (returns `started_from_trained_weights`: the actor's steps), or, with `reset`, loads the kept
        ones back (returns `weights_reset`). What it returns goes into the run summary."""
        if not daemons_dir or not self._has(self.actor, "weight_version"):
            return {}
        version = max(int(v) for v in await self.actor.weight_version(timeout_s=self.timeout_s))
        folder = Path(daemons_dir) / "initial_weights"
        log = get_logger(part="trainer")
        if version == 0:
            await save_weights(folder, self.trained, timeout_s=self.timeout_s)
            return {}
        if reset:
            await load_weights(folder, self.trained, timeout_s=self.timeout_s)
            log.warning("weights_reset", discarded_actor_steps=version, loaded=str(folder))
            return {"weights_reset": version}
        log.warning("continuing_from_trained_weights", actor_steps=version,
                    why="these daemons were trained by an earlier run",
                    hint="--set reset_weights=true starts from the weights they started with")
        return {"started_from_trained_weights": version}

    @staticmethod
    def _has(group: Any, name: str) -> bool:
        return group is not None and name in group.endpoints
