"""The built-in synthetic verifiable task: single-digit addition prompts ("3+4=") with a numeric
ground truth, made locally from a seed, and its rule reward.

No torch and no I/O: the controller makes the prompts, and the reward daemon imports the reward
by name (REWARD). It knows nothing of roles, handles or algorithms.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hfrt.wire.reasoning_gym_tasks import carries_entry
from hfrt.wire.reasoning_gym_tasks import score as gym_score

#: What a reward role's `function` option names by default: this task's rule reward on its own
#: rows, a reasoning-gym task's own scorer on its rows, the generic numeric reward on a data file's
#: rows (see task_reward).
REWARD = "hfrt.flows.tasks:task_reward"
#: What a cost role's `function` option names to score this task (Safe-RLHF's cost).
COST = "hfrt.flows.tasks:addition_cost"
#: Partial credit for an answer in the right form (a leading number) but wrong: it gives a
#: random-init policy a signal to find the answer's form before it finds the answer.
FORM_CREDIT = 0.1
ASCII_DIGITS = frozenset("0123456789")


@dataclass
class AdditionTask:
    """Prompts "a+b=" with 0 <= a, b <= max_operand, drawn from a seeded generator (a fixed order
    for a given seed); the ground truth is the sum as text.

    The sum is drawn uniformly (0 to 2 x max_operand), then a split of it: with a and b drawn
    independently the sums pile up in the middle (sums 0-4: "2" is right a third of the time), and
    a small policy settles on always answering the most common sum instead of learning to add."""

    seed: int = 0
    max_operand: int = 2
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def batch(self, count: int) -> dict[str, list[Any]]:
        """`count` prompts as non-tensor columns: prompt, ground_truth, data_source."""
        pairs = [self._pair() for _ in range(count)]
        return {
            "prompt": [f"{a}+{b}=" for a, b in pairs],
            "ground_truth": [str(a + b) for a, b in pairs],
            "data_source": ["addition"] * count,
        }

    def _pair(self) -> tuple[int, int]:
        top = self.max_operand
        total = self._rng.randint(0, 2 * top)
        a = self._rng.randint(max(0, total - top), min(top, total))
        return a, total - a

    def state_dict(self) -> dict[str, Any]:
        """Where the prompt stream is (the generator's state), as JSON-able data for checkpoints."""
        version, internal, gauss = self._rng.getstate()
        return {"seed": self.seed, "max_operand": self.max_operand, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))


def leading_number(text: str) -> int | None:
    """The integer the text starts with (after spaces), or None. Only ASCII digits count:
    str.isdigit is also true for '¹' or '٣', which int() refuses or reads differently."""
    digits = ""
    for ch in text.lstrip():
        if ch not in ASCII_DIGITS:
            break
        digits += ch
    return int(digits) if digits else None


def addition_reward(response: str, ground_truth: Any) -> float:
    """1 when the response starts with the right sum (the number ends where the digits do: "7",
    "7 " and "7=" are right, "77" is not), FORM_CREDIT when it starts with another number, else 0."""
    got = leading_number(response)
    if got is None:
        return 0.0
    return 1.0 if got == int(str(ground_truth)) else FORM_CREDIT


def addition_cost(response: str, ground_truth: Any) -> float:
    """Safe-RLHF's cost on this task: 0 when the response is just a number no longer than the
    right sum ("7", "3"), else 1 ("7 ", "7=", "77", "x", and the empty response, so that saying
    nothing is not a way out). The reward accepts anything after a right number; only the cost
    teaches the policy to stop right after it."""
    plain_number = bool(response) and all(ch in ASCII_DIGITS for ch in response)
    return 0.0 if plain_number and len(response) <= len(str(ground_truth)) else 1.0


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> float | None:
    """The last number in `text` (commas as thousands separators), or None."""
    found = _NUMBER.findall(text)
    try:
        return float(found[-1].replace(",", "")) if found else None
    except ValueError:
        return None


def numeric_reward(response: str, ground_truth: Any) -> float:
    """The generic reward of a data file's rows: 1 when the final answer — the last \\boxed{...},
    else what follows the last '####', else the whole response — ends in the ground truth's
    number (a ground truth that is no number: the answer's text equals it); else 0."""
    boxed = _BOXED.findall(response)
    answer = boxed[-1] if boxed else response.rsplit("####", 1)[-1]
    want = last_number(str(ground_truth))
    if want is None:
        return float(answer.strip().lower() == str(ground_truth).strip().lower())
    got = last_number(answer)
    return float(got is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want)))


def task_reward(response: str, ground_truth: Any, data_source: str = "addition", extra_info: Mapping[str, Any] | None = None) -> float:
    """The default reward: addition_reward on the built-in task's rows (data_source "addition"),
    the task's own scorer on a reasoning-gym task's rows (hfrt.wire.reasoning_gym_tasks.score),
    numeric_reward on any other row (a data file's)."""
    if data_source == "addition":
        return addition_reward(response, ground_truth)
    if carries_entry(extra_info):
        return gym_score(response, ground_truth, extra_info or {})
    return numeric_reward(response, ground_truth)
