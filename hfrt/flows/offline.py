"""What the flows that train on a fixed set of rows share — `sft` (demonstrations) and `dpo`
(preference pairs): their common settings (OfflineConfig) and their step loop (OfflineLoop).

The loop takes each step's rows in the seeded, reshuffled-per-epoch order of hfrt.flows.pairs
(fixed by seed and step, so a resumed run takes what the interrupted one would), runs the flow's
step on them, validates on the held-out rows every `val_every` steps and after the last (and once
before the first), writes a record per step (metrics.jsonl, TensorBoard, W&B, the progress bar),
checkpoints the trained roles every `checkpoint_every` steps, resumes from the newest whole
checkpoint, and exports the actor as a Hugging Face folder (RUN_DIR/hf) at the end.

It knows role groups as the checkpoint / export helpers take them and the record's key names; it
knows nothing of what a step computes (the flow's step function does) or of tokenisers and engines.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from hfrt.flows.batches import prompts_handle
from hfrt.flows.checkpoint import load_checkpoint, resumable_checkpoint, save_checkpoint
from hfrt.flows.config import did_you_mean
from hfrt.flows.export import HFExport
from hfrt.flows.pairs import step_rows
from hfrt.flows.report import MetricsLog
from hfrt.flows.timing import StageTimer
from hfrt.flows.trainer import due
from hfrt.flows.validation import before_training
from hfrt.protocols import BatchHandle

Rows = list[dict[str, Any]]
#: step(step index, the step's rows as a batch, its timer) → the step's metrics
StepFn = Callable[[int, BatchHandle, StageTimer], Awaitable[dict[str, float]]]
#: validate() → the held-out metrics (`val/...`)
ValidateFn = Callable[[], Awaitable[dict[str, float]]]


@dataclass(frozen=True)
class OfflineConfig:
    """Settings every offline flow reads (the `#:` comment above a field is its description)."""

    #: held-out rows' file ("": val_fraction of data is held out, seeded)
    val_data: str = ""
    #: the share of data held out when val_data is ""
    val_fraction: float = 0.1
    #: passes over the training rows
    epochs: int = 1
    #: stop after this many optimizer steps (0: no cap)
    max_steps: int = 0
    #: seed of the split and the order
    seed: int = 0
    #: validation on the held-out rows every N steps and after the last (0: only after the last)
    val_every: int = 0
    #: also validate once before the first step (`val_before/*` in step 0's record)
    val_before_train: bool = True
    #: a checkpoint every N steps and after the last (0: none)
    checkpoint_every: int = 0
    #: tokens per sequence (prompt + completion) at most; a longer row is an error naming it
    max_length: int = 1024
    #: write the trained actor as a Hugging Face model folder, RUN_DIR/hf, at the end
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

    #: the flow's name, in errors
    FLOW: ClassVar[str] = "offline"
    #: the name of the flow's rows-per-optimizer-step setting (a field of its own)
    PER_STEP: ClassVar[str] = "rows_per_step"

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.per_step() < 1:
            raise ValueError(f"config epochs={self.epochs!r}, {self.PER_STEP}={self.per_step()!r}: must be at least 1")
        for name in ("max_steps", "val_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"config {name}={getattr(self, name)!r}: must not be negative")
        if self.max_length < 2:
            raise ValueError(f"config max_length={self.max_length!r}: must be at least 2 tokens")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"config val_fraction={self.val_fraction!r}: must be between 0 and 1")
        if self.progress not in ("auto", "on", "off"):
            raise ValueError(f"config progress={self.progress!r}: use auto, on or off")
        self.rows()  # every row checked before any daemon starts

    def per_step(self) -> int:
        """Rows per optimizer step (the flow's own setting, named by PER_STEP)."""
        return int(getattr(self, self.PER_STEP))

    def rows(self) -> tuple[Rows, Rows]:
        """(training rows, held-out rows), read and checked; ValueError naming the key and row."""
        raise NotImplementedError

    def steps_for(self, train_rows: int) -> int:
        steps = self.epochs * math.ceil(train_rows / self.per_step())
        return min(steps, self.max_steps) if self.max_steps else steps

    @classmethod
    def read(cls, config: Any) -> Any:
        """From the flow's config dict; unknown keys and wrong types are errors naming the key."""
        if isinstance(config, cls):
            return config
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}{did_you_mean(unknown, fields)}; the {cls.FLOW} flow reads {sorted(fields)}")
        values = {}
        for key, raw in config.items():
            kind = hints[key]
            if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
                raw = float(raw)
            if not isinstance(raw, kind) or (kind is not bool and isinstance(raw, bool)):
                raise ValueError(f"config {key}={raw!r}: expected {kind.__name__}")
            values[key] = raw
        return cls(**values)


class OfflineLoop:
    """Runs an offline flow's steps over `train` (each step's rows made into a batch by `columns`),
    validating with `validate`; `trained` are the role groups checkpointed (e.g. the actor),
    `actor` the one exported."""

    def __init__(self, cfg: OfflineConfig, *, trained: Mapping[str, Any], actor: Any, train: Rows, val: Rows,
                 columns: Callable[[Rows], dict[str, list[Any]]], ctl: Any = None) -> None:
        self.cfg, self.trained, self.actor, self.ctl = cfg, dict(trained), actor, ctl
        self.train, self.val, self.columns = train, val, columns
        self.steps = cfg.steps_for(len(train))

    def batch_for(self, step: int) -> BatchHandle:
        """Step `step`'s rows as one batch (fixed by the seed and the step)."""
        return prompts_handle(self.columns(step_rows(self.train, step, self.cfg.per_step(), self.cfg.seed)))

    def val_batch(self) -> BatchHandle:
        """The held-out rows as one batch (the same on every pass)."""
        return prompts_handle(self.columns(self.val))

    async def run(self, step_fn: StepFn, validate: ValidateFn) -> dict[str, Any]:
        """Every step from the start (or the resumed checkpoint) on; returns the run summary."""
        cfg, steps = self.cfg, self.steps
        with MetricsLog(cfg.run_dir, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project,
                        progress=cfg.progress, total_steps=steps) as log:
            start = await self._resume(log)
            before = before_training(await validate()) if cfg.val_before_train and start == 0 else {}
            first_val = dict(before)
            last_val: dict[str, float] = {}
            for step in range(start, steps):
                t = StageTimer()
                record = {"step": step, **before, **await step_fn(step, self.batch_for(step), t), **t.timings,
                          "timing/step_s": t.step_s()}
                before = {}
                if due(cfg.val_every or steps, step, steps):
                    last_val = await validate()
                    record |= last_val
                log.write(record | self._counters())
                if due(cfg.checkpoint_every, step, steps) and cfg.run_dir:
                    await save_checkpoint(cfg.run_dir, step + 1, self.trained, {"data": {"step": step + 1, "seed": cfg.seed}})
            if not last_val:  # resumed at the end, or no step ran
                last_val = await validate()
        return await self._summary(start, first_val, last_val)

    async def _resume(self, log: MetricsLog) -> int:
        """With resume: the newest whole checkpoint loaded into the trained roles, its step (else 0)."""
        if not (self.cfg.resume and self.cfg.run_dir):
            return 0
        found = resumable_checkpoint(self.cfg.run_dir, max_step=self.steps)
        if found.checkpoint is None:
            return 0
        await load_checkpoint(found.checkpoint, self.trained)
        log.truncate(found.checkpoint.step)
        return found.checkpoint.step

    def _counters(self) -> dict[str, Any]:
        """The controller's bulk-byte counter (0 for bulk data: rows travel as text, tensors by handle)."""
        stats = getattr(self.ctl, "stats", None)
        return {"controller_bulk_bytes": stats()["controller_bulk_bytes"]} if stats is not None else {}

    async def _summary(self, start: int, before: dict[str, float], last: dict[str, float]) -> dict[str, Any]:
        cfg = self.cfg
        summary: dict[str, Any] = {"steps": self.steps, "train_rows": len(self.train), "val_rows": len(self.val)}
        for key, value in (last | before).items():
            summary.setdefault(key.replace("/", "_"), value)
        if cfg.run_dir:
            summary["metrics"] = str(Path(cfg.run_dir) / "metrics.jsonl")
        if start:
            summary["resumed_from_step"] = start
        summary |= await HFExport(cfg.run_dir, self.actor, enabled=cfg.export_hf).export()
        return summary
