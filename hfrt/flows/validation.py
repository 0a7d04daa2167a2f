"""The validation pass, owned by the Trainer: the task's fixed validation rows answered by the actor
(greedily by default; `val_temperature` and `val_n` sample several answers per row, as verl's
`val_kwargs` do), scored by the reward role, reduced to `val/reward_mean` and `val/accuracy` (the
share of samples the task counts as right, over every sample).

It knows the actor's `generate` and the reward role's `score` endpoints and a Task's validation rows
and `correct`; it does not know when validation is due, what a training step does, or where the
metrics go.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hfrt.flows.batches import non_tensor, prompts_handle
from hfrt.flows.data import Task
from hfrt.flows.reward_errors import RewardErrors

#: what a validation record's keys start with; before the first step they start with BEFORE instead
PREFIX, BEFORE = "val/", "val_before/"


def validation_metrics(scores: Sequence[float], task: Task) -> dict[str, float]:
    """`val/reward_mean` and `val/accuracy` (the share of scores `task.correct` accepts)."""
    if not scores:
        raise ValueError(f"validation of task {task.name!r}: the reward role returned no scores")
    accuracy = sum(1 for s in scores if task.correct(s)) / len(scores)
    return {f"{PREFIX}reward_mean": sum(scores) / len(scores), f"{PREFIX}accuracy": accuracy}


def before_training(metrics: dict[str, float]) -> dict[str, float]:
    """A pass before the first step, its keys moved from `val/` to `val_before/`."""
    return {k.replace(PREFIX, BEFORE, 1): v for k, v in metrics.items()}


class Validator:
    """Responses of `actor` to `count` validation rows of `task` (read once, on the first pass), up to
    `max_new_tokens` each: one greedy response per row at temperature 0 (the default), else `n`
    sampled at `temperature` with the fixed `seed` (every pass draws the same way, so passes differ
    by the weights alone); scored by `reward`, failed reward samples going to `errors` (logged,
    never stopping the run)."""

    def __init__(
        self, task: Task, actor: Any, reward: Any, *, count: int, max_new_tokens: int, errors: RewardErrors,
        timeout_s: float | None = None, temperature: float = 0.0, n: int = 1, seed: int = 0,
    ) -> None:
        if n > 1 and temperature == 0:
            raise ValueError(f"validation: n={n} greedy responses per row would all be the same; sample (temperature > 0) or use n=1")
        self.task, self.actor, self.reward = task, actor, reward
        self.count, self.max_new_tokens = count, max_new_tokens
        self.errors, self.timeout_s = errors, timeout_s
        self.temperature, self.n, self.seed = temperature, n, seed
        self._rows: dict[str, list[Any]] | None = None

    def rows(self) -> dict[str, list[Any]]:
        """The task's validation rows, the same on every pass."""
        if self._rows is None:
            self._rows = self.task.validation_rows(self.count)
        return self._rows

    def sampling(self) -> dict[str, Any]:
        """The actor's generate options of a pass: greedy, or n samples at the temperature and seed."""
        options: dict[str, Any] = {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens}
        if self.temperature > 0:
            options |= {"n": self.n, "seed": self.seed}
        return options

    async def run(self) -> dict[str, float]:
        """One pass: `val/reward_mean` and `val/accuracy`, means over every response."""
        if self.actor is None or self.reward is None:
            missing = " and ".join(name for name, group in (("actor", self.actor), ("reward", self.reward)) if group is None)
            raise ValueError(f"validation (val_every) needs the actor and reward roles; this flow gave the Trainer no {missing}")
        rollout = await self.actor.generate(prompts_handle(self.rows()), **self.sampling(), timeout_s=self.timeout_s)
        scored = await self.reward.score(rollout, timeout_s=self.timeout_s)
        self.errors.observe(non_tensor(scored, "score_error"), step=None)
        return validation_metrics([float(s) for s in non_tensor(scored, "score")], self.task)
