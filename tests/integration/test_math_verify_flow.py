"""The `math_verify` reward on real daemons: two GRPO steps on the tiny preset over a data file of
LaTeX ground truths (`\\frac{a}{b}`), scored on the reward daemon with math-verify's signal timers
(they work only on a main thread: the reward role's `score` runs there) and no sample allowed to
fail (`error_score = null`, `reward_error_limit = 0`). The docs section it backs:
docs/roles-and-losses.md, "Built-in rule rewards"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("math_verify", reason="math-verify is not installed (pip install -e '.[envs]')")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grpo_scores_with_math_verify(tmp_path: Path) -> None:
    data = tmp_path / "halves.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}/2=", "ground_truth": f"\\frac{{{a}}}{{2}}"}) + "\n" for a in range(1, 9)))
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo", "--run-dir", str(tmp_path / "run")]
    for item in (f"data={data}", "steps=2", "prompts_per_step=4", "n=2", "max_new_tokens=6", "export_hf=false",
                 "reward_error_limit=0", "roles.reward.options.function=math_verify", "roles.reward.options.error_score=null",
                 "roles.reward.options.settings.parsing_timeout=3"):
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r.get("reward/errors", 0) == 0 for r in records)
