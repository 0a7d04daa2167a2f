"""Where a flow's prompts come from: the built-in addition task, or a local JSONL / Parquet file of
rows `{"prompt": ..., "ground_truth": ..., "data_source": ...}` read in a seeded, reshuffled-per-
epoch order whose position is saved in checkpoints.

A row's `prompt` is a string or a chat (a list of {"role", "content"} messages). The ground truth
may also sit where verl's preprocessed data puts it, `reward_model.ground_truth`; `data_source`
defaults to the file's stem, and a dict `extra_info` column is passed through. A `Task` bundles a
flow's prompts, its validation rows and what counts as a right validation answer (the built-in
addition task and a data file's task are its implementations here; a reasoning-gym task's is
hfrt.flows.gym_data's). Nothing here imports torch or knows of roles: a source hands out plain
columns.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hfrt.flows.gym_data import gym_task
from hfrt.flows.tasks import AdditionTask
from hfrt.wire.reasoning_gym_tasks import is_gym

COLUMNS = ("prompt", "ground_truth", "data_source", "extra_info")


class PromptSource(Protocol):
    """An endless stream of prompt rows whose position can be saved and restored."""

    def batch(self, count: int) -> dict[str, list[Any]]:
        """The next `count` rows as non-tensor columns (at least prompt, ground_truth, data_source)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DatasetError(ValueError):
    """A data file that cannot be used, naming the file and the row."""


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a .jsonl / .json (a list) / .parquet file, normalised to COLUMNS."""
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"data file {file} does not exist")
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        raw = []
        for number, line in enumerate(file.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    raw.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{file}:{number}: not JSON ({exc.msg})") from None
    elif suffix == ".json":
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DatasetError(f"{file}: not JSON ({getattr(exc, 'msg', exc)})") from None
        if not isinstance(raw, list):
            raise DatasetError(f"{file}: a .json data file must hold a list of rows")
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{file}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        raw = pq.read_table(file).to_pylist()
    else:
        raise DatasetError(f"{file}: unknown data file type {suffix!r}; use .jsonl, .json or .parquet")
    rows = [_normalise(row, file, number) for number, row in enumerate(raw, start=1)]
    if not rows:
        raise DatasetError(f"{file}: no rows")
    return rows


def _normalise(row: Any, file: Path, number: int, where: str = "") -> dict[str, Any]:
    where = where or f"{file}: row {number}"
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
    if "prompt" not in row:
        raise DatasetError(f"{where}: missing key 'prompt' (a row has {sorted(row)[:8]})")
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        prompt = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    else:
        raise DatasetError(f"{where}: 'prompt' must be a string or a list of {{role, content}} messages, got {prompt!r:.80}")
    truth = row.get("ground_truth")
    if truth is None and isinstance(row.get("reward_model"), dict):
        truth = row["reward_model"].get("ground_truth")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DatasetError(f"{where}: 'extra_info' must be an object")
    return {
        "prompt": prompt,
        "ground_truth": "" if truth is None else str(truth),
        "data_source": str(row.get("data_source") or file.stem),
        "extra_info": {str(k): v for k, v in extra.items() if isinstance(v, str | int | float | bool) or v is None},
    }


#: a JSONL file up to this size has every line checked before launch; a larger one its first rows
CHECK_ALL_BYTES = 32 * 2**20
#: rows checked before launch in a file larger than CHECK_ALL_BYTES (and in .json / Parquet files)
CHECK_ROWS = 1000
#: bad lines of a JSONL file named in one error before the rest are only counted
REPORT_BAD = 10


def check_data_file(path: str | Path, what: str = "") -> int:
    """Check a data file before any daemon starts and return its row count: the file's rows
    are read and normalised (every row of a JSONL file up to CHECK_ALL_BYTES, else the first
    CHECK_ROWS) and the rest counted. Raises DatasetError naming the file, line or row and
    the problem (after `what`, e.g. the config key, when given); a file with no rows is an error."""
    try:
        return _check_file(Path(path))
    except DatasetError as exc:
        raise DatasetError(f"{what}: {exc}" if what else str(exc)) from None


def _check_file(file: Path) -> int:
    if not file.is_file():
        raise DatasetError(f"data file {file} does not exist")
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        count = _check_jsonl(file, check_all=file.stat().st_size <= CHECK_ALL_BYTES)
    elif suffix == ".parquet":
        count = _check_parquet(file)
    else:
        rows = read_rows(file)  # .json holds one list: there is no reading part of it
        count = len(rows)
    if count == 0:
        raise DatasetError(f"{file}: no rows")
    return count


def _check_jsonl(file: Path, *, check_all: bool) -> int:
    """Row count of a JSONL file; every bad line checked is a problem, and the first REPORT_BAD
    of them are named in one DatasetError (the rest counted), so one run shows what to fix."""
    count, bad = 0, []
    with file.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            count += 1
            if not check_all and count > CHECK_ROWS:
                continue
            try:
                _normalise(json.loads(raw), file, count, f"{file}:{number}")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                bad.append(f"{file}:{number}: not JSON ({getattr(exc, 'msg', exc)})")
            except DatasetError as exc:
                bad.append(str(exc))
    if bad:
        more = f"; and {len(bad) - REPORT_BAD} more bad line(s)" if len(bad) > REPORT_BAD else ""
        raise DatasetError("; ".join(bad[:REPORT_BAD]) + more)
    return count


def _check_parquet(file: Path) -> int:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{file}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(file)
        batch = next(parquet.iter_batches(batch_size=CHECK_ROWS), None)
    except Exception as exc:  # pyarrow's errors for a damaged or non-Parquet file
        raise DatasetError(f"{file}: not a readable Parquet file ({exc})") from None
    for number, row in enumerate(batch.to_pylist() if batch is not None else [], start=1):
        _normalise(row, file, number)
    return int(parquet.metadata.num_rows)


class FileDataset:
    """A data file's rows, visited epoch after epoch, each epoch in a new order drawn from
    (seed, epoch) — so a resumed run sees exactly the rows the interrupted one would have."""

    def __init__(self, path: str | Path, seed: int = 0, shuffle: bool = True) -> None:
        self.path = str(path)
        self.rows = read_rows(path)
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def batch(self, count: int) -> dict[str, list[Any]]:
        picked = []
        for _ in range(count):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
            picked.append(self.rows[self._order[self.position]])
            self.position += 1
        return {name: [row[name] for row in picked] for name in COLUMNS}

    def state_dict(self) -> dict[str, Any]:
        return {"path": self.path, "rows": len(self.rows), "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["rows"]) != len(self.rows):
            raise DatasetError(f"{self.path}: the checkpoint was taken over {state['rows']} rows, the file has {len(self.rows)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._order_of(self.epoch)


def make_source(data: str, *, seed: int, max_operand: int) -> PromptSource:
    """The training prompts: a data file, or the built-in addition task when `data` is ""."""
    return FileDataset(data, seed) if data else AdditionTask(seed, max_operand)


def validation_rows(data: str, *, seed: int, max_operand: int, count: int) -> dict[str, list[Any]]:
    """A fixed validation set: the first `count` rows of a data file (all when count is 0), or
    `count` addition prompts from a seed the training stream does not use."""
    if data:
        rows = read_rows(data)[: count or None]
        return {name: [row[name] for row in rows] for name in COLUMNS}
    return AdditionTask(seed + 7919, max_operand).batch(count or 32)


#: a validation sample whose score is at least this is a right answer (both built-in tasks: their
#: rewards give 1 for a right answer, less for anything else)
CORRECT_SCORE = 1.0


class Task(Protocol):
    """What a flow trains and validates on: its name, a training prompt stream, a fixed set of
    validation rows, and when a validation sample's score counts as a right answer (the share of
    those is `val/accuracy`)."""

    @property
    def name(self) -> str: ...

    def prompts(self) -> PromptSource:
        """A new training prompt stream at its start (checkpoints save and restore its position)."""
        ...

    def validation_rows(self, count: int) -> dict[str, list[Any]]:
        """The fixed validation rows as non-tensor columns: `count` of them (0: the task's default)."""
        ...

    def correct(self, score: float) -> bool:
        """Whether a validation sample's score counts as a right answer."""
        ...


@dataclass(frozen=True)
class BuiltinAddition:
    """The built-in addition task as a Task: prompts from AdditionTask(seed, max_operand); validation
    on `count` held-out prompts (32 for 0) from a seed the training stream does not use, or on the
    first rows of `val_data` when given; a score of at least `threshold` is right."""

    seed: int = 0
    max_operand: int = 2
    val_data: str = ""
    threshold: float = CORRECT_SCORE
    name: str = "addition"

    def prompts(self) -> PromptSource:
        return make_source("", seed=self.seed, max_operand=self.max_operand)

    def validation_rows(self, count: int) -> dict[str, list[Any]]:
        return validation_rows(self.val_data, seed=self.seed, max_operand=self.max_operand, count=count)

    def correct(self, score: float) -> bool:
        return score >= self.threshold


@dataclass(frozen=True)
class DataFileTask:
    """A data file's task: its rows in a seeded order reshuffled per epoch (FileDataset); validation on
    the first `count` rows (all for 0) of `val_data`, or of the training file when that is ""; a
    score of at least `threshold` is right. Its name is the file's stem."""

    path: str
    seed: int = 0
    val_data: str = ""
    threshold: float = CORRECT_SCORE

    def __post_init__(self) -> None:
        if not self.path:
            raise DatasetError("DataFileTask: path is empty (the built-in addition task is BuiltinAddition)")

    @property
    def name(self) -> str:
        return Path(self.path).stem

    def prompts(self) -> PromptSource:
        return FileDataset(self.path, self.seed)

    def validation_rows(self, count: int) -> dict[str, list[Any]]:
        return validation_rows(self.val_data or self.path, seed=self.seed, max_operand=0, count=count)

    def correct(self, score: float) -> bool:
        return score >= self.threshold


def config_task(*, data: str, val_data: str, seed: int, max_operand: int, data_options: Mapping[str, Any] | None = None) -> Task:
    """The task a flow's settings name (FlowConfig's data, val_data, seed, max_operand, data_options):
    a reasoning-gym task for `data = "reasoning_gym:TASK"` (hfrt.flows.gym_data), the data file's
    when `data` is another string, else the built-in addition task."""
    if is_gym(data):
        held = None if not val_data else (lambda count: validation_rows(val_data, seed=seed, max_operand=0, count=count))
        return gym_task(data, data_options or {}, seed=seed, val_rows=held)
    if data:
        return DataFileTask(data, seed, val_data)
    return BuiltinAddition(seed, max_operand, val_data)
