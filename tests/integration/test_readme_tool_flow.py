"""The multi-turn tool flow printed in docs/agents-and-openai.md runs as printed: cut out of the page,
saved as a file, run with `hfrt controller --flow py_tool_flow.py` on real daemons, on the rollout role and on
the actor's own engine (agent_on=actor, no rollout daemon launched)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "agents-and-openai.md"


def readme_tool_flow() -> str:
    block = re.search(r"<!-- tool-flow:start -->\s*```python\n(.*?)```\s*<!-- tool-flow:end -->", PAGE.read_text(), re.S)
    assert block, "docs/agents-and-openai.md lost its tool-flow block"
    return block.group(1)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("agent_on", ["rollout", "actor"])
def test_readme_tool_flow_runs(tmp_path: Path, agent_on: str) -> None:
    flow = tmp_path / "py_tool_flow.py"
    flow.write_text(readme_tool_flow())
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", str(flow), "--run-dir", str(run_dir),
         "--set", "steps=2", "--set", "n=2", "--set", "prompts_per_step=2", "--set", "export_hf=false",
         "--set", f"agent_on={agent_on}"],
        capture_output=True, text=True, timeout=280,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    launched = set(json.loads((run_dir / "config.json").read_text())["roles"])
    assert ("rollout" in launched) == (agent_on == "rollout"), launched
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert 0.0 <= r["agent/reward_mean"] <= 1.0 and r["agent/turns_mean"] >= 1 and "agent/tool_calls_mean" in r
