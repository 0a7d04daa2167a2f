"""The `rm` flow: train a reward model on preference pairs (Bradley-Terry), validate it by pair
accuracy on held-out pairs, checkpoint and resume like every flow, and export it as a Hugging Face
*ForSequenceClassification folder (RUN_DIR/hf) that the reward role serves with
`roles.reward.options = {kind = "model", model = "RUN_DIR/hf"}` (docs/reward-models.md).

The controller reads and checks the pair file and picks each step's pairs; the pairs travel as
text and the `reward_model` daemons (roles/reward_model.py) tokenise, train and score them.
It knows the reward_model role's endpoints; it knows nothing of tokenizers, engines or devices.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfrt.flows.batches import prompts_handle
from hfrt.flows.checkpoint import load_checkpoint, resumable_checkpoint, save_checkpoint
from hfrt.flows.config import did_you_mean
from hfrt.flows.metrics import reduce_rank_metrics
from hfrt.flows.pairs import PairDataError, addition_pairs, columns, read_pairs, split_pairs, step_rows
from hfrt.flows.report import MetricsLog
from hfrt.flows.timing import Stage, StageTimer
from hfrt.flows.trainer import due, get_roles
from hfrt.wire.role_views import RewardModel

ROLE = "reward_model"
#: The embedded default: one local trainer on the `tiny` preset (AdamW at 1e-3: a tiny random
#: backbone learns the addition pairs of docs/reward-models.md in a few hundred steps).
ROLES: dict[str, dict[str, Any]] = {
    ROLE: {"impl": "reward_model", "world_size": 1,
           "options": {"model": "tiny", "engine": {"micro_batch_size": 16, "optim": {"lr": 1e-3}}}},
}


@dataclass(frozen=True)
class RMConfig:
    """The `rm` flow's settings (the `#:` comment above a field is its description)."""

    #: the pair file (JSONL / JSON / Parquet rows of prompt, chosen, rejected, optional margin;
    #: hfrt/flows/pairs.py); "" makes pairs for the built-in addition task from its rule reward
    #: (hfrt.flows.pairs.addition_pairs)
    data: str = ""
    #: pairs made for the addition task when data is ""
    pairs_count: int = 8000
    #: the addition task's largest addend when data is ""
    max_operand: int = 2
    #: held-out pairs ("": val_fraction of data is held out, seeded)
    val_data: str = ""
    #: the share of data held out when val_data is ""
    val_fraction: float = 0.1
    #: passes over the training pairs
    epochs: int = 1
    #: stop after this many optimizer steps (0: no cap)
    max_steps: int = 0
    #: pairs per optimizer step, over all data-parallel ranks
    pairs_per_step: int = 32
    #: seed of the split and the order
    seed: int = 0
    #: pair accuracy on the held-out pairs every N steps and after the last (0: only after the last)
    val_every: int = 0
    #: also measure the held-out pair accuracy once before the first step
    val_before_train: bool = True
    #: a checkpoint every N steps and after the last (0: none)
    checkpoint_every: int = 0
    #: write the trained reward model as a Hugging Face model folder, RUN_DIR/hf, at the end
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

    def __post_init__(self) -> None:
        for name in ("epochs", "pairs_per_step", "pairs_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"config {name}={getattr(self, name)!r}: must be at least 1")
        for name in ("max_steps", "val_every", "checkpoint_every", "max_operand"):
            if getattr(self, name) < 0:
                raise ValueError(f"config {name}={getattr(self, name)!r}: must not be negative")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"config val_fraction={self.val_fraction!r}: must be between 0 and 1")
        if self.progress not in ("auto", "on", "off"):
            raise ValueError(f"config progress={self.progress!r}: use auto, on or off")
        try:
            self.pairs()  # every row checked before any daemon starts
        except PairDataError as exc:
            raise ValueError(f"config data: {exc}") from None

    @classmethod
    def read(cls, config: Any) -> RMConfig:
        """From the flow's config dict; unknown keys and wrong types are errors naming the key."""
        if isinstance(config, cls):
            return config
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}{did_you_mean(unknown, fields)}; the rm flow reads {sorted(fields)}")
        values = {}
        for key, raw in config.items():
            kind = hints[key]
            if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
                raw = float(raw)
            if not isinstance(raw, kind) or (kind is not bool and isinstance(raw, bool)):
                raise ValueError(f"config {key}={raw!r}: expected {kind.__name__}")
            values[key] = raw
        return cls(**values)

    def pairs(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(training pairs, held-out pairs), read and checked."""
        rows = read_pairs(self.data) if self.data else addition_pairs(self.pairs_count, self.seed, self.max_operand)
        for number, row in enumerate(rows, start=1):
            row.setdefault("margin", 0.0)
            row.setdefault("row", number)
        if self.val_data:
            return rows, read_pairs(self.val_data)
        return split_pairs(rows, self.val_fraction, self.seed)

    def steps_for(self, train_pairs: int) -> int:
        steps = self.epochs * math.ceil(train_pairs / self.pairs_per_step)
        return min(steps, self.max_steps) if self.max_steps else steps


Config = RMConfig


async def flow(ctl: Any, config: RMConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = RMConfig.read(config)
    train, val = cfg.pairs()
    rm: RewardModel = (await get_roles(ctl, ROLE))[ROLE]
    steps, start = cfg.steps_for(len(train)), 0
    val_handle = prompts_handle(columns(val))

    async def validate() -> dict[str, float]:
        return reduce_rank_metrics(await rm.evaluate(val_handle))

    with MetricsLog(cfg.run_dir, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project,
                    progress=cfg.progress, total_steps=steps) as log:
        found = resumable_checkpoint(cfg.run_dir, max_step=steps) if cfg.resume and cfg.run_dir else None
        if found is not None and found.checkpoint is not None:
            await load_checkpoint(found.checkpoint, {ROLE: rm})
            start = found.checkpoint.step
            log.truncate(start)
        before: dict[str, float] = {}
        if cfg.val_before_train and start == 0:
            before = {k.replace("val/", "val_before/", 1): v for k, v in (await validate()).items()}
        last_val: dict[str, float] = {}
        for step in range(start, steps):
            t = StageTimer()
            batch = prompts_handle(columns(step_rows(train, step, cfg.pairs_per_step, cfg.seed)))
            metrics = reduce_rank_metrics(await t.one(Stage.UPDATE, rm.update(batch)))
            record = {"step": step, **before, **metrics, **t.timings, "timing/step_s": t.step_s()}
            before = {}
            if due(cfg.val_every or steps, step, steps):
                last_val = await validate()
                record |= last_val
            log.write(record)
            if due(cfg.checkpoint_every, step, steps) and cfg.run_dir:
                await save_checkpoint(cfg.run_dir, step + 1, {ROLE: rm}, {"data": {"step": step + 1, "seed": cfg.seed}})
        if not last_val:  # resumed at the end, or no steps: the export's mean / std need one pass
            last_val = await validate()
    summary: dict[str, Any] = {
        "steps": steps, "train_pairs": len(train), "val_pairs": len(val),
        "val_accuracy": last_val["val/accuracy"], "val_margin_mean": last_val["val/margin_mean"],
        "val_loss": last_val["val/loss"],
    }
    if cfg.run_dir:
        summary["metrics"] = str(Path(cfg.run_dir) / "metrics.jsonl")
    if "val_before/accuracy" in (first := _first_record(cfg.run_dir)):
        summary["val_accuracy_before"] = first["val_before/accuracy"]
    if start:
        summary["resumed_from_step"] = start
    if cfg.export_hf and cfg.run_dir:
        summary["hf_export"] = (await rm.export_hf(str(Path(cfg.run_dir) / "hf")))[0]  # every rank names the folder
    return summary


def _first_record(run_dir: str) -> dict[str, Any]:
    import json

    path = Path(run_dir) / "metrics.jsonl" if run_dir else None
    if path is None or not path.exists():
        return {}
    with path.open() as f:
        line = f.readline()
    return dict(json.loads(line)) if line.strip() else {}
