"""A reasoning-gym task as a flow's Task (`data = "reasoning_gym:TASK"`): its `size` entries visited
epoch after epoch in a seeded order reshuffled per epoch, validation rows from seeds the training
rows never use, and the task's own scorer as what counts as right (a score of 1).

The rows themselves come from hfrt.wire.reasoning_gym_tasks. No torch; it knows nothing of roles,
handles or what a step does.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hfrt.wire.reasoning_gym_tasks import GymSpec, GymTaskError, parse, rows

#: a validation sample whose score is at least this is right (reasoning-gym scores a right answer 1)
CORRECT_SCORE = 1.0
#: validation rows when val_prompts is 0
DEFAULT_VAL_ROWS = 32


class GymSource:
    """The training prompt stream: entry indices 0..size-1, each epoch in a new order drawn from
    (seed, epoch), so a resumed run sees exactly the rows the interrupted one would have."""

    def __init__(self, spec: GymSpec, seed: int) -> None:
        self.spec, self.seed = spec, seed
        self.epoch, self.position = 0, 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(self.spec.size))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def batch(self, count: int) -> dict[str, list[Any]]:
        picked = []
        for _ in range(count):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
            picked.append(self._order[self.position])
            self.position += 1
        return rows(self.spec, picked)

    def state_dict(self) -> dict[str, Any]:
        return {"task": self.spec.task, "size": self.spec.size, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("task") != self.spec.task or int(state["size"]) != self.spec.size:
            raise GymTaskError(f"reasoning_gym:{self.spec.task}: the checkpoint was taken over {state.get('task')!r} with "
                               f"{state.get('size')} rows; this run has {self.spec.size}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._order_of(self.epoch)


@dataclass(frozen=True)
class ReasoningGymTask:
    """A reasoning-gym task as a Task: training rows from `spec`, validation rows from the same task
    at seed + VAL_SEED_OFFSET (or from `val_rows`, a validation file's reader, when given); a score
    of at least `threshold` is right."""

    spec: GymSpec
    seed: int = 0
    val_rows: Callable[[int], dict[str, list[Any]]] | None = field(default=None, compare=False)
    threshold: float = CORRECT_SCORE

    @property
    def name(self) -> str:
        return f"reasoning_gym:{self.spec.task}"

    def prompts(self) -> GymSource:
        return GymSource(self.spec, self.seed)

    def validation_rows(self, count: int) -> dict[str, list[Any]]:
        if self.val_rows is not None:
            return self.val_rows(count)
        count = count or DEFAULT_VAL_ROWS
        return rows(self.spec.for_validation(count), range(count))

    def correct(self, score: float) -> bool:
        return score >= self.threshold


def gym_task(data: str, options: Mapping[str, Any], *, seed: int,
             val_rows: Callable[[int], dict[str, list[Any]]] | None = None) -> ReasoningGymTask:
    """The Task `data = "reasoning_gym:TASK"` and `data_options` name (GymTaskError when they cannot be used)."""
    return ReasoningGymTask(parse(data, options, seed=seed), seed, val_rows)
