"""What a user sees of a run: TensorBoard scalars (read back with TensorBoard's own reader), W&B
records, the progress bar / lines, the Chrome trace of every call of a real PPO run, and the
`hfrt plot` PNG."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows.report import MetricsLog

RECORDS = [
    {"step": s, "reward/mean": 0.1 * (s + 1), "kl/mean": 0.01 * s, "perf/tokens_per_s": 100.0 + s,
     "timing/generate_s": 0.5, "timing/stage2_s": 0.25, "timing/old_log_prob_s": 0.1,
     "timing/advantages_s": 0.05, "timing/update_s": 0.75, "note": "text", "flag": True}
    for s in range(4)
]


def scalars_of(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


# -- metrics sinks --------------------------------------------------------------------------------


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    with MetricsLog(str(tmp_path), tensorboard=True, total_steps=4) as log:
        for record in RECORDS:
            log.write(record)
        # flushed per step: readable while the run goes on
        assert scalars_of(tmp_path / "tensorboard", "reward/mean")[-1] == (3, pytest.approx(0.4))
    assert scalars_of(tmp_path / "tensorboard", "kl/mean") == [(s, pytest.approx(0.01 * s)) for s in range(4)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "timing/update_s" in tags and "note" not in tags and "flag" not in tags and "step" not in tags
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_tensorboard_resume_drops_the_steps_rewritten(tmp_path: Path) -> None:
    with MetricsLog(str(tmp_path), tensorboard=True) as log:
        for record in RECORDS:
            log.write(record)
    with MetricsLog(str(tmp_path), tensorboard=True) as log:
        log.truncate(2)
        log.write(RECORDS[2] | {"reward/mean": 9.0})
    assert scalars_of(tmp_path / "tensorboard", "reward/mean") == [
        (0, pytest.approx(0.1)), (1, pytest.approx(0.2)), (2, pytest.approx(9.0))]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_tensorboard_missing_warns_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with MetricsLog(str(tmp_path), tensorboard=True) as log:
        log.write(RECORDS[0])
    assert not (tmp_path / "tensorboard").exists() or not any((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_wandb_missing_names_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="wandb_project='demo'.*pip install wandb"):
        with MetricsLog(str(tmp_path), wandb_project="demo"):
            pass


def test_wandb_logs_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    class Run:
        def log(self, data: dict[str, float], step: int) -> None:
            calls.append(("log", (step, data)))

        def finish(self) -> None:
            calls.append(("finish", None))

    def init(**kwargs: Any) -> Run:
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLog(str(tmp_path), wandb_project="demo") as log:
        for record in RECORDS[:2]:
            log.write(record)
    assert calls[0] == ("init", {"project": "demo", "dir": str(tmp_path), "name": tmp_path.name})
    logged = [c[1] for c in calls if c[0] == "log"]
    assert [step for step, _ in logged] == [0, 1]
    assert logged[1][1]["reward/mean"] == pytest.approx(0.2) and "note" not in logged[1][1]
    assert calls[-1] == ("finish", None)


# -- progress ---------------------------------------------------------------------------------------


def test_progress_auto_off_a_terminal_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for mode in ("auto", "off"):
        with MetricsLog(str(tmp_path / mode), progress=mode, total_steps=4) as log:
            for record in RECORDS:
                log.write(record)
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""


def test_progress_on_off_a_terminal_prints_a_line_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    with MetricsLog("", progress="on", total_steps=6, start_step=2) as log:
        for record in RECORDS[2:]:
            log.write(record)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 3/6  reward 0.300  kl 0.0200  tok/s 102  eta ")
    assert lines[1].startswith("step 4/6") and "eta 0:00:0" in lines[1]


def test_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    with MetricsLog("", progress="auto", total_steps=4) as log:
        for record in RECORDS:
            log.write(record)
    shown = tty.getvalue()
    assert "4/4" in shown and "reward 0.400" in shown and "kl 0.0300" in shown and "tok/s 103" in shown
    assert "eta 0:00:00" in shown
