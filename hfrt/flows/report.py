"""What a run reports per step: RUN_DIR/metrics.jsonl (one JSON object per step, flushed as it is
written), and the run summary. On resume the log is cut back to the checkpoint's step so no step
appears twice.

It knows metric records as flat dicts of numbers; nothing of roles or algorithms.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, TextIO


class MetricsLog:
    """RUN_DIR/metrics.jsonl writer ("" as run_dir: keep the rewards in memory only)."""

    def __init__(self, run_dir: str) -> None:
        self.path = Path(run_dir) / "metrics.jsonl" if run_dir else None
        self._file: TextIO | None = None
        self.rewards: list[float] = []

    def __enter__(self) -> MetricsLog:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()

    def truncate(self, steps: int) -> None:
        """Keep the records of steps < `steps` (a resumed run rewrites what came after its checkpoint)."""
        if self.path is None or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if int(record.get("step", -1)) < steps:
                kept.append(line)
                self.rewards.append(float(record.get("reward/mean", math.nan)))
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)
        if self._file is not None:
            self._file.close()
            self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.rewards.append(float(record.get("reward/mean", math.nan)))
        if self._file is not None:
            self._file.write(json.dumps(record, default=float) + "\n")
            self._file.flush()

    def summary(self) -> dict[str, Any]:
        """First / last mean reward, and the means of the first and last quarter of the steps."""
        r = [x for x in self.rewards if not math.isnan(x)]
        if not r:
            return {"steps": len(self.rewards)}
        q = max(1, len(r) // 4)
        return {
            "steps": len(self.rewards), "reward_first": r[0], "reward_last": r[-1],
            "reward_first_quarter": statistics.fmean(r[:q]), "reward_last_quarter": statistics.fmean(r[-q:]),
            "metrics": str(self.path) if self.path else None,
        }
