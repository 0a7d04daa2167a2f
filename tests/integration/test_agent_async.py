"""Asynchronous agentic rollout on real daemons (tiny preset): `agent_calc` with max_staleness runs
the agents of the next step on the rollout role while the actor trains (RolloutPipeline), each
sample carrying its oldest turn's weight_version; lockstep reproduces the synchronous step, and the
colocated agent_on=actor refuses to run ahead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows.agent.grpo import AgentCalcConfig, spanning_share
from hfrt.flows.agent.loop import Trajectory, trajectory_columns

SMALL = ("prompts_per_step=2", "n=4")
#: keys that differ between two runs of the same samples by how they were scheduled, not by what was computed
SCHEDULING = ("timing/", "perf/", "memory/", "rollout/", "sync/", "async/")

TOOL_FLOW = '''
from hfrt.flows.agent.grpo import agent_grpo
from hfrt.flows.recipes.agent_calc import ROLES, Config, calc_agent, roles_for  # read by hfrt

async def flow(ctl, config):
    return await agent_grpo(ctl, config, calc_agent)
'''


def command(run_dir: Path, *sets: str, flow: str = "agent_calc") -> list[str]:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", flow, "--run-dir", str(run_dir),
            "--set", "progress=off", "--set", "export_hf=false"]
    for item in sets:
        args += ["--set", item]
    return args


def controller(run_dir: Path, *sets: str, flow: str = "agent_calc", timeout: float = 170) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(run_dir, *sets, flow=flow), capture_output=True, text=True, timeout=timeout)


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def spans(run_dir: Path, calls: set[tuple[str, str]]) -> list[tuple[float, float]]:
    """[start, end) of every traced call (role, endpoint) in `calls`."""
    events = json.loads((run_dir / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [(e["ts"], e["ts"] + e["dur"]) for e in events
            if e.get("ph") == "X" and (names.get(e["pid"]), e["name"]) in calls]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lockstep_pipeline_reproduces_the_synchronous_step(tmp_path: Path) -> None:
    """max_staleness=0 (the synchronous step) and the pipeline held to lockstep (rollout_ahead=0:
    each step's agents start after the version they train was sent) give the same samples, rewards
    and losses for the same seed."""
    sync = controller(tmp_path / "sync", "steps=3", *SMALL)
    assert sync.returncode == 0, sync.stderr[-3000:]
    piped = controller(tmp_path / "piped", "steps=3", *SMALL, "max_staleness=1", "rollout_ahead=0")
    assert piped.returncode == 0, piped.stderr[-3000:]
    a_rows, b_rows = records(tmp_path / "sync"), records(tmp_path / "piped")
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows] == [0, 1, 2]
    assert not any(k.startswith("async/") for k in a_rows[0])  # the synchronous step has no pipeline
    for a, b in zip(a_rows, b_rows, strict=True):
        assert b["async/staleness_max"] == 0 and b["async/staleness_hist/0"] == 1.0
        compared = [k for k in a if not k.startswith(SCHEDULING)]
        assert {"reward/mean", "actor/pg_loss", "agent/reward_mean", "response_tokens"} <= set(compared), compared
        for key in compared:
            if key.startswith(("reward/", "agent/", "response_length/")) or key == "response_tokens":
                assert b[key] == a[key], key
            else:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_max_staleness_1_runs_the_agents_ahead_of_the_update(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = controller(run_dir, "steps=4", *SMALL, "max_staleness=1", "tis_cap=2", "policy_loss_mode=decoupled", "sync_bucket_mb=0.1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["controller_bulk_bytes"] == 0
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["async/staleness_max"] <= 1 and r["controller_bulk_bytes"] == 0
        assert r["agent/error_rate"] == 0.0 and r["agent/turns_mean"] >= 1.0
        assert "actor/tis_weight_mean" in r and "actor/behav_kl" in r  # corrected with the turns' own log-probs
        assert 0.0 <= r["async/rows_spanning_versions"] <= 1.0 and r["async/dropped_groups"] == 0.0
    assert rows[0]["async/staleness_max"] == 0  # nothing older than version 0 exists
    assert any(r["async/staleness_hist/1"] > 0 for r in rows[1:]), [r["async/staleness_hist/1"] for r in rows]
    assert rows[1]["async/weight_version_min"] == 0.0  # step 1's agents ran while step 0 trained
    assert rows[0]["sync/version"] == 0 and rows[0]["sync/buckets"] >= 2
    # the trace: some turn of an agent rollout sampled while the training side worked on an
    # earlier step (the actor's update, or that step's reference / reward stage: which one a
    # turn meets depends on the machine's load), anywhere over the run
    turns = spans(run_dir, {("rollout", "generate_turn")})
    training = spans(run_dir, {("actor", "update"), ("reference", "compute_log_prob"), ("reward", "score")})
    assert turns and training
    assert any(a0 < b1 and b0 < a1 for a0, a1 in turns for b0, b1 in training), (turns, training)


def test_agent_on_actor_cannot_run_ahead(tmp_path: Path) -> None:
    """Refused by the config check, before any daemon starts: for agent_calc and for a user tool
    flow built on agent_grpo."""
    with pytest.raises(ValueError, match="max_staleness=1 with agent_on=actor: the colocated actor cannot"):
        AgentCalcConfig.read({"agent_on": "actor", "max_staleness": 1})
    assert AgentCalcConfig.read({"agent_on": "actor"}).max_staleness == 0
    assert AgentCalcConfig.read({"max_staleness": 2}).staleness().depth == 2
    with pytest.raises(ValueError, match="stale_policy='later'"):
        AgentCalcConfig.read({"max_staleness": 1, "stale_policy": "later"})
    tool_flow = tmp_path / "my_tool_flow.py"
    tool_flow.write_text(TOOL_FLOW)
    for flow in ("agent_calc", str(tool_flow)):
        out = controller(tmp_path / "run", "agent_on=actor", "max_staleness=1", flow=flow, timeout=60)
        assert out.returncode != 0
        assert "max_staleness=1 with agent_on=actor" in out.stderr, out.stderr[-3000:]
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_sample_is_as_old_as_its_oldest_turn() -> None:
    """Turns sampled across a weight load: the sample's weight_version (what the staleness check
    and the off-policy corrections read) is its oldest turn's; the share spanning versions is reported."""
    one = Trajectory({"uid": "1-0"}, prompt_ids=[5], response_ids=[6, 7, 8], gen_mask=[1, 0, 1], log_probs=[-1.0, 0.0, -2.0],
                     turns=2, weight_versions=[3, 4])
    two = Trajectory({"uid": "1-0"}, prompt_ids=[5], response_ids=[6], gen_mask=[1], log_probs=[-1.0], turns=1, weight_versions=[4])
    assert trajectory_columns([one, two])["weight_version"] == [3, 4]
    assert spanning_share([one, two]) == 0.5 and spanning_share([]) == 0.0
