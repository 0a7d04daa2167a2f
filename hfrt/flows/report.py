"""What a run reports per step: RUN_DIR/metrics.jsonl (one JSON object per step, flushed as it is
written), TensorBoard scalars in RUN_DIR/tensorboard (written without torch), W&B when asked, a
progress bar on a terminal, and the run summary. On resume the log is cut back to the
checkpoint's step so no step appears twice.

It knows metric records as flat dicts of numbers (a few by name, for the progress line); nothing
of roles or algorithms.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

from hfrt.log import get_logger


class Sink(Protocol):
    """Somewhere besides metrics.jsonl that every record goes to."""

    def write(self, record: dict[str, Any]) -> None: ...

    def restart(self, step: int) -> None:
        """A resumed run starts again at `step`: what was logged from `step` on is obsolete."""

    def close(self) -> None: ...


class MetricsLog:
    """RUN_DIR/metrics.jsonl writer ("" as run_dir: keep the rewards in memory only), plus the
    optional sinks: `tensorboard` (RUN_DIR/tensorboard; skipped with a warning when the package is
    missing), `wandb_project` (W&B; ImportError naming the setting when wandb is missing),
    `progress` ("auto": a bar only when stderr is a terminal; "on": a bar, or one line per step
    when stderr is not a terminal; "off") over `total_steps`, counting from `start_step` (a
    resume moves it: see truncate)."""

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard: bool = False,
        wandb_project: str = "",
        progress: str = "off",
        total_steps: int = 0,
        start_step: int = 0,
    ) -> None:
        if progress not in ("auto", "on", "off"):
            raise ValueError(f"progress={progress!r}: use auto, on or off")
        self.run_dir = Path(run_dir) if run_dir else None
        self.path = self.run_dir / "metrics.jsonl" if self.run_dir else None
        self.tensorboard, self.wandb_project, self.progress = tensorboard, wandb_project, progress
        self.total_steps, self.start_step = total_steps, start_step
        self._file: TextIO | None = None
        self._sinks: list[Sink] = []
        self.rewards: list[float] = []
        #: every validation accuracy of the run in order (val_before/ then val/ of each record),
        #: the records kept from before a resume included, so the summary describes the whole run
        self.val_accuracy: list[float] = []

    def __enter__(self) -> MetricsLog:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        try:
            self._sinks = open_sinks(
                self.run_dir, self.total_steps, self.start_step,
                tensorboard=self.tensorboard, wandb_project=self.wandb_project, progress=self.progress,
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if self._file is not None:
            self._file.close()
            self._file = None

    def truncate(self, steps: int) -> None:
        """Keep the records of steps < `steps` (a resumed run rewrites what came after its checkpoint)."""
        self.start_step = steps
        for sink in self._sinks:
            sink.restart(steps)
        if self.path is None or not self.path.exists():
            return
        kept = []
        self.rewards.clear()  # refilled from the kept records (a mid-run rewind had written some)
        self.val_accuracy.clear()
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if int(record.get("step", -1)) < steps:
                kept.append(line)
                self._note(record)
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)
        if self._file is not None:
            self._file.close()
            self._file = self.path.open("a")

    def _note(self, record: dict[str, Any]) -> None:
        """What the summary needs of a record: its mean reward and validation accuracies."""
        self.rewards.append(float(record.get("reward/mean", math.nan)))
        for key in ("val_before/accuracy", "val/accuracy"):
            if isinstance(record.get(key), int | float):
                self.val_accuracy.append(float(record[key]))

    def write(self, record: dict[str, Any]) -> None:
        self._note(record)
        if self._file is not None:
            self._file.write(json.dumps(record, default=float) + "\n")
            self._file.flush()
        for sink in self._sinks:
            sink.write(record)

    def summary(self) -> dict[str, Any]:
        """First / last mean reward, the means of the first and last quarter of the steps, and the
        first / last validation accuracy (val_before/ counts as the first) — over the whole run's
        records, those kept from before a resume included, as metrics.jsonl holds them."""
        val = {"val_accuracy_first": self.val_accuracy[0], "val_accuracy_last": self.val_accuracy[-1]} if self.val_accuracy else {}
        r = [x for x in self.rewards if not math.isnan(x)]
        if not r:
            return {"steps": len(self.rewards)} | val
        q = max(1, len(r) // 4)
        return {
            "steps": len(self.rewards), "reward_first": r[0], "reward_last": r[-1],
            "reward_first_quarter": statistics.fmean(r[:q]), "reward_last_quarter": statistics.fmean(r[-q:]),
            "metrics": str(self.path) if self.path else None,
        } | val


def open_sinks(
    run_dir: Path | None, total_steps: int, start_step: int, *, tensorboard: bool, wandb_project: str, progress: str
) -> list[Sink]:
    """The sinks the options ask for (TensorBoard and W&B need a run folder)."""
    sinks: list[Sink] = []
    if tensorboard and run_dir is not None:
        tb = TensorBoardSink.open(run_dir / "tensorboard")
        if tb is not None:
            sinks.append(tb)
    if wandb_project and run_dir is not None:
        sinks.append(WandbSink(wandb_project, run_dir))
    bar = progress_sink(progress, total_steps, start_step, sys.stderr)
    if bar is not None:
        sinks.append(bar)
    return sinks


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric metrics (bools, strings, lists and "step" left out)."""
    return {
        k: float(v) for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


# -- TensorBoard ---------------------------------------------------------------------------------


class TensorBoardSink:
    """Scalar events in `logdir` through the tensorboard package's own event-file writer (no torch,
    no TensorFlow): one event per step holding one scalar per numeric metric, flushed per step."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(logdir))

    @classmethod
    def open(cls, logdir: Path) -> TensorBoardSink | None:
        try:
            return cls(logdir)
        except ImportError as exc:
            get_logger(part="report").warning(
                "tensorboard_missing", error=str(exc), hint="pip install tensorboard, or --set tensorboard=false")
            return None

    def write(self, record: dict[str, Any]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars(record).items()]
        self._writer.add_event(
            self._event(wall_time=time.time(), step=int(record.get("step", 0)), summary=self._summary(value=values)))
        self._writer.flush()

    def restart(self, step: int) -> None:
        """A SessionLog START at `step`: TensorBoard then drops the older events from `step` on."""
        from tensorboard.compat.proto.event_pb2 import SessionLog

        self._writer.add_event(self._event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# -- Weights & Biases ----------------------------------------------------------------------------


class WandbSink:
    """One W&B run (files under RUN_DIR/wandb), each record logged at its step."""

    def __init__(self, project: str, run_dir: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError(
                f"config wandb_project={project!r} needs the wandb package: pip install wandb "
                "(or leave wandb_project empty)"
            ) from None
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, dir=str(run_dir), name=run_dir.name)

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=int(record.get("step", 0)))

    def restart(self, step: int) -> None:
        pass  # W&B keeps steps monotonic on its own: re-logged steps go to this new W&B run

    def close(self) -> None:
        self._run.finish()


# -- progress ------------------------------------------------------------------------------------


def progress_sink(mode: str, total: int, start: int, stream: TextIO) -> Sink | None:
    """A rich bar when `stream` is a terminal ("auto" or "on"); one line per step on a stream that
    is not one ("on" only); nothing for "off", or for "auto" off a terminal."""
    tty = _isatty(stream)
    if mode == "off" or (mode == "auto" and not tty):
        return None
    if tty:
        try:
            return RichProgress(total, start, stream)
        except ImportError:
            pass  # no rich: plain lines still say where the run is
    return LineProgress(total, start, stream)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or odd stream
        return False


class _Eta:
    """Steps done / total and the time left, from the pace of the steps this process ran."""

    def __init__(self, total: int, start: int) -> None:
        self.total, self.done, self.first = total, start, start
        self.t0 = time.monotonic()

    def restart(self, step: int) -> None:
        self.done = self.first = step
        self.t0 = time.monotonic()

    def step(self, record: dict[str, Any]) -> None:
        self.done = int(record.get("step", self.done)) + 1

    def left_s(self) -> float | None:
        ran = self.done - self.first
        if ran <= 0 or self.total <= 0:
            return None
        return (time.monotonic() - self.t0) / ran * max(0, self.total - self.done)


def status_line(record: dict[str, Any], eta_s: float | None) -> str:
    """reward, KL, tokens/s and ETA of one step, as the progress bar shows them."""
    parts = []
    for label, key, fmt in (("reward", "reward/mean", ".3f"), ("kl", "kl/mean", ".4f"), ("tok/s", "perf/tokens_per_s", ".0f")):
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            parts.append(f"{label} {value:{fmt}}")
    parts.append(f"eta {_clock(eta_s)}")
    return "  ".join(parts)


def _clock(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class LineProgress:
    """`step 3/150  reward 0.512  kl 0.0012  tok/s 840  eta 0:02:10`, one line per step."""

    def __init__(self, total: int, start: int, stream: TextIO) -> None:
        self._eta, self._stream = _Eta(total, start), stream

    def write(self, record: dict[str, Any]) -> None:
        self._eta.step(record)
        line = f"step {self._eta.done}/{self._eta.total}  {status_line(record, self._eta.left_s())}"
        print(line, file=self._stream, flush=True)

    def restart(self, step: int) -> None:
        self._eta.restart(step)

    def close(self) -> None:
        pass


class RichProgress:
    """A rich progress bar on `stream` (the controller's stderr; stdout stays the run summary)."""

    def __init__(self, total: int, start: int, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._eta = _Eta(total, start)
        self._progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(), console=Console(file=stream), redirect_stdout=False, refresh_per_second=2,
        )
        self._task = self._progress.add_task("steps", total=total or None, completed=start, status="")
        self._progress.start()

    def write(self, record: dict[str, Any]) -> None:
        self._eta.step(record)
        status = status_line(record, self._eta.left_s())
        self._progress.update(self._task, completed=self._eta.done, status=status, refresh=True)

    def restart(self, step: int) -> None:
        self._eta.restart(step)
        self._progress.reset(self._task, total=self._eta.total or None, completed=step, status="")

    def close(self) -> None:
        self._progress.stop()
