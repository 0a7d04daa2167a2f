"""A run's per-step records, owned by the Trainer: each step's metrics with the reward-error column
taken out (hfrt.flows.reward_errors), the controller's counters (bulk bytes through the
controller, unmatched replies) and recovery's metrics added, written through hfrt.flows.report's
MetricsLog (metrics.jsonl, TensorBoard, W&B, the progress bar), and the run summary's figures.

It knows the controller's `stats()` and `recovery` and the record's key names; it does not know
what a step computes, when validation or checkpoints happen, or how a sink stores a record.
"""

from __future__ import annotations

from typing import Any

from hfrt.control.controller import Controller
from hfrt.flows.config import FlowConfig
from hfrt.flows.report import MetricsLog
from hfrt.flows.reward_errors import ERRORS_KEY, RewardErrors


class MetricsProcessor:
    """The records of a run over `ctl`; `errors` judges each step's failed reward samples. Use it as a
    context manager: the log and its sinks are open inside it."""

    def __init__(self, ctl: Controller, log: MetricsLog, errors: RewardErrors) -> None:
        self.ctl, self.log, self.errors = ctl, log, errors

    @classmethod
    def for_config(cls, ctl: Controller, cfg: FlowConfig, errors: RewardErrors) -> MetricsProcessor:
        """The records a flow's settings ask for: run_dir, tensorboard, wandb_project, progress over steps."""
        log = MetricsLog(cfg.run_dir, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project,
                         progress=cfg.progress, total_steps=cfg.steps)
        return cls(ctl, log, errors)

    def __enter__(self) -> MetricsProcessor:
        self.log.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.__exit__(*exc)

    def step_record(self, step: int, before: dict[str, float], metrics: dict[str, Any]) -> dict[str, Any]:
        """Step `step`'s record: `before` (a validation before training) and what the step returned,
        less its reward-error column, which `errors` judges (RewardErrorLimit stops the run)."""
        record = {"step": step, **before, **metrics}
        self.errors.observe(record.pop(ERRORS_KEY, []), step=step)
        return record

    def write(self, record: dict[str, Any]) -> None:
        """Add the controller's counters and recovery's metrics to `record` and write it."""
        stats = self.ctl.stats()
        record["controller_bulk_bytes"] = stats["controller_bulk_bytes"]
        record["controller/unmatched_replies"] = stats.get("unmatched_replies", 0)  # signed replies to no pending call
        if self.ctl.recovery is not None:
            record |= self.ctl.recovery.metrics()
        self.log.write(record)

    def truncate(self, steps: int) -> None:
        """Keep the records of steps before `steps` (a resume or a rewind redoes the rest)."""
        self.log.truncate(steps)

    def summary(self) -> dict[str, Any]:
        """The log's summary (rewards, validation accuracies) and the controller's bulk bytes."""
        return self.log.summary() | {"controller_bulk_bytes": self.ctl.stats()["controller_bulk_bytes"]}
