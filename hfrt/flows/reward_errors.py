"""The controller's half of the reward-error rule: a sample on which the reward function raises
(or returns no finite number) scores the reward role's `error_score` and comes back with a message
in the scores' `score_error` column (roles/reward_fns.py::score_all; the first sample of each kind
in a call also carries the traceback). Here each kind of error is logged once per run on the
controller's stderr with its first traceback, and a step in which more than `reward_error_limit`
of the samples failed stops the run (RewardErrorLimit, naming the step, the share and the
traceback; `hfrt controller` exits 1).

It knows the message format of score_all and nothing of roles or what a flow does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from hfrt.log import get_logger

#: where a step's record carries its `score_error` column for the Trainer (which takes it out)
ERRORS_KEY = "reward/error_column"
#: score_all's message for a raise: "reward function NAME raised on sample N: TYPE: ..."
_RAISED = re.compile(r" raised on sample \d+: ([\w.]+)")


class RewardErrorLimit(RuntimeError):
    """More of a step's samples failed in the reward function than `reward_error_limit` allows."""


def error_kind(message: str) -> str:
    """The kind of a `score_error` message: the exception's type, or "non-number" for a return
    that is not a finite number."""
    found = _RAISED.search(message.split("\n", 1)[0])
    return found.group(1) if found else "non-number"


@dataclass
class RewardErrors:
    """One run's reward-error bookkeeping: `limit` is the share of a step's samples (0-1) that may
    fail before the run stops (1: never); `seen` the kinds already logged."""

    limit: float = 0.5
    seen: set[str] = field(default_factory=set)

    def observe(self, errors: Sequence[str], *, step: int | None) -> None:
        """`errors`: a `score_error` column ("" for a sample that scored). Log each new kind with
        its traceback; for a training step (`step` not None) raise RewardErrorLimit when the
        failed share is over the limit. Validation (step None) only logs."""
        failed = [message for message in errors if message]
        if not failed:
            return
        first: dict[str, str] = {}
        for message in failed:  # per kind, the first message, or the first with a traceback
            kind = error_kind(message)
            if kind not in first or ("\n" in message and "\n" not in first[kind]):
                first[kind] = message
        log = get_logger(part="reward")
        for kind, message in first.items():
            if kind not in self.seen:
                self.seen.add(kind)
                head, _, trace = message.partition("\n")
                log.warning("reward_function_error", kind=kind, where="validation" if step is None else f"step {step}",
                            failed=f"{len(failed)} of {len(errors)} samples", error=head,
                            rule="each failed sample scores the reward role's error_score (option error_score); "
                                 "this kind is logged once", exception=trace or head)
        share = len(failed) / len(errors)
        if step is not None and share > self.limit:
            detail = "\n".join(first.values())
            raise RewardErrorLimit(
                f"step {step}: the reward function failed on {len(failed)} of {len(errors)} samples ({share:.0%}), "
                f"more than reward_error_limit={self.limit:g} allows; the run stops (--set reward_error_limit=1 "
                f"never stops, roles.reward.options.error_score sets a failed sample's score). First error of each "
                f"kind:\n{detail}")
