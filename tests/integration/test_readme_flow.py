"""The custom flow printed in the README runs as printed: cut out of README.md, saved as a file,
run with `hfrt controller --flow my_flow.py` on real daemons (two actor ranks) for two steps."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_flow() -> str:
    text = README.read_text()
    block = re.search(r"<!-- custom-flow:start -->\s*```python\n(.*?)```\s*<!-- custom-flow:end -->", text, re.S)
    assert block, "README.md lost its custom-flow block"
    return block.group(1)


def test_readme_flow_is_about_30_lines() -> None:
    lines = [line for line in readme_flow().splitlines() if line.strip()]
    assert 20 <= len(lines) <= 40, len(lines)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_readme_flow_runs(tmp_path: Path) -> None:
    flow = tmp_path / "my_flow.py"
    flow.write_text(readme_flow())
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", str(flow), "--run-dir", str(run_dir),
         "--set", "steps=2", "--set", "n=2", "--set", "export_hf=false",
         # two actor ranks: the flow reduces the per-rank update metrics itself
         "--set", "roles.actor.world_size=2", "--set", "roles.actor.options.engine.backend=fsdp2"],
        capture_output=True, text=True, timeout=220,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["steps"] == 2 and summary["controller_bulk_bytes"] == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert "actor/kl_loss" in r and "advantages/mean" in r and r["timing/stage2_s"] > 0
        assert r["actor/optimizer_steps"] == 1.0  # the group's count, not one per rank summed
    # the flow's own Config rejects what it does not know, before launch
    bad = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", str(flow), "--run-dir", str(tmp_path / "bad"), "--set", "m=2"],
        capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode == 2 and "unknown config key(s) ['m']" in bad.stderr
