"""The controller's reward-error rule (hfrt/flows/reward_errors.py): each kind of error logged once
with its traceback, a step over reward_error_limit stops the run, validation only logs; and the
summary's validation accuracies describe the whole run across a resume (hfrt/flows/report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from hfrt import log
from hfrt.flows.config import FlowConfig
from hfrt.flows.report import MetricsLog
from hfrt.flows.reward_errors import RewardErrorLimit, RewardErrors, error_kind

TRACE = "Traceback (most recent call last):\n  File \"r.py\", line 2, in score\nTypeError: boom"
FIRST = f"reward function r.py:score raised on sample 0: TypeError: boom\n{TRACE}"
LATER = "reward function r.py:score raised on sample 3: TypeError: boom"
BAD_RETURN = "reward function r.py:score returned None for sample 1, not a finite number\nRewardFunctionError: ..."


def test_error_kinds() -> None:
    assert error_kind(FIRST) == "TypeError" and error_kind(LATER) == "TypeError"
    assert error_kind(BAD_RETURN) == "non-number"


def test_each_kind_is_logged_once_with_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    log.configure("warning")  # binds the captured stderr
    try:
        errors = RewardErrors(limit=0.5)
        errors.observe([FIRST, "", "", LATER], step=0)  # half failed: not over the limit
        errors.observe([LATER, "", "", ""], step=1)
        errors.observe([BAD_RETURN, "", "", ""], step=None)  # validation: logged, never stops
        err = capsys.readouterr().err
    finally:
        structlog.reset_defaults()  # not the captured stream, closed after this test
    assert err.count("reward_function_error") == 2, err
    assert err.count(TRACE) == 1 and "kind=TypeError" in err and "failed='2 of 4 samples'" in err
    assert "kind=non-number" in err and "where=validation" in err


def test_a_step_over_the_limit_stops_with_the_traceback() -> None:
    with pytest.raises(RewardErrorLimit, match=r"step 4: the reward function failed on 3 of 4 samples \(75%\), more than "
                       r"reward_error_limit=0.5") as raised:
        RewardErrors(limit=0.5).observe([FIRST, LATER, LATER, ""], step=4)
    assert TRACE in str(raised.value)
    RewardErrors(limit=1.0).observe([FIRST, LATER], step=0)  # 1: never stops
    RewardErrors(limit=0.0).observe(["", ""], step=0)  # nothing failed
    with pytest.raises(ValueError, match="reward_error_limit=1.5"):
        FlowConfig.read({"reward_error_limit": 1.5})


def test_summary_validation_accuracy_spans_a_resume(tmp_path: Path) -> None:
    """The bug: after --resume, val_accuracy_first came from the resumed part (0.094) although
    step 0's val_before/accuracy was 0.0."""
    records = [{"step": 0, "val_before/accuracy": 0.0, "reward/mean": 0.1, "val/accuracy": 0.25},
               {"step": 1, "reward/mean": 0.2}, {"step": 2, "reward/mean": 0.3, "val/accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with MetricsLog(str(tmp_path)) as resumed:
        resumed.truncate(2)  # resumed from the checkpoint after step 1: step 2 runs again
        resumed.write({"step": 2, "reward/mean": 0.4, "val/accuracy": 0.75})
        summary = resumed.summary()
    assert summary["val_accuracy_first"] == 0.0 and summary["val_accuracy_last"] == 0.75
    assert summary["steps"] == 3 and summary["reward_first"] == 0.1 and summary["reward_last"] == 0.4
    with MetricsLog("") as fresh:  # no validation: no such fields
        fresh.write({"step": 0, "reward/mean": 1.0})
        assert "val_accuracy_first" not in fresh.summary()
