"""verifiers environments in the agent_openai flow (`verifiers_env`, hfrt/flows/agent/verifiers_env.py):
the environment loaded in its own venv (.venv-verifiers, made by .ci/install) by
hfrt/flows/agent/verifiers_host/runner.py, one episode per conversation against the flow's endpoint,
its task's rewards as the reward, the conversation recorded token-exact — two GRPO steps on the tiny
preset of a single-turn environment (verifiers_envs/vf_sum.py) and of a multi-turn one whose
environment plays the user (verifiers_envs/vf_retry.py), one of a tool-using one (vf_tools.py, an
MCP tool server per rollout); a bad environment is a config error before training, and a rollout
whose model calls fail is a failed program. The docs section it backs: docs/agents-and-openai.md, "verifiers environments"."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows.agent.openai_grpo import AgentOpenAIConfig, flow
from hfrt.flows.agent.verifiers_env import DEFAULT_PYTHON, check_environment, find_python, number_examples, runner_argv

ROOT = Path(__file__).resolve().parents[2]
ENVS = Path(__file__).resolve().parent / "verifiers_envs"
PYTHON = ROOT / DEFAULT_PYTHON

needs_venv = pytest.mark.skipif(not PYTHON.exists(), reason=f"no verifiers venv at {PYTHON}: `bash .ci/install` makes it")


def runs(mask: list[int]) -> list[int]:
    """The lengths of the runs of 1s in a gen_mask (one per sampled turn)."""
    lengths, current = [], 0
    for bit in [*mask, 0]:
        if bit:
            current += 1
        elif current:
            lengths.append(current)
            current = 0
    return lengths


def train(run_dir: Path, env: Path, *sets: str, steps: int = 2) -> list[dict[str, Any]]:
    """`steps` agent_openai steps on `env` (n = 2 conversations per task); the metrics records."""
    base = [f"steps={steps}", "progress=off", "export_hf=false", "n=2", "max_total_tokens=300", "save_trajectories=true",
            "sample_timeout_s=150", f"verifiers_env={env}", *sets]
    cmd = [sys.executable, "-m", "hfrt", "controller", "--flow", "agent_openai", "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd + [a for s in base for a in ("--set", s)], capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    return records


def conversations(run_dir: Path, step: int) -> tuple[dict[str, dict[str, Any]], dict[str, float], dict[str, dict[str, Any]]]:
    """A step's trajectory rows, stated rewards (the runner's last line) and reports (its JSON line), by session."""
    rows = [json.loads(line) for line in (run_dir / "trajectories" / f"step-{step}.jsonl").read_text().splitlines()]
    by_session = {r["session"]: r for r in rows}
    assert len(by_session) == len(rows)  # one trajectory per conversation: its calls continued each other exactly
    stated, reports = {}, {}
    for session in by_session:
        lines = (run_dir / "agent_logs" / f"{session}.stdout").read_text().splitlines()
        stated[session], reports[session] = float(lines[-1]), json.loads(lines[-2])
    return by_session, stated, reports


def test_samples_share_their_group_task_and_the_settings_are_checked(tmp_path: Path) -> None:
    samples: list[dict[str, Any]] = [{} for _ in range(6)]
    number_examples(samples, step=3, prompts_per_step=3, n=2)
    assert [s["example"] for s in samples] == [9, 9, 10, 10, 11, 11]
    with pytest.raises(ValueError, match="verifiers_env and agent_command: give one"):
        AgentOpenAIConfig.read({"verifiers_env": "x", "agent_command": "true", "verifiers_python": sys.executable})
    with pytest.raises(ValueError, match=r"verifiers_python='/nope': no such file"):
        AgentOpenAIConfig.read({"verifiers_env": "x", "verifiers_python": "/nope"})
    with pytest.raises(ValueError, match="read only with verifiers_env"):
        AgentOpenAIConfig.read({"verifiers_args": {"size": 3}})
    cfg = AgentOpenAIConfig.read({"verifiers_env": "vf_sum.py", "verifiers_args": {"size": 3}, "verifiers_python": sys.executable})
    assert cfg.program.startswith(f"{sys.executable} ") and f"--env {Path('vf_sum.py').absolute()}" in cfg.program


@needs_venv
@pytest.mark.timeout(120)
def test_a_bad_environment_is_a_clear_error() -> None:
    python = find_python("")  # (a good one is checked at the start of the training runs below)
    with pytest.raises(ValueError, match="no module 'no_such_env' in .*install the environment's package into the verifiers venv"):
        check_environment(python, "no-such-env", {})
    with pytest.raises(ValueError, match=r"nope\.py': no such file"):
        check_environment(python, str(ENVS / "nope.py"), {})
    with pytest.raises(ValueError, match="does not load as a verifiers .*exports no Taskset subclass"):
        check_environment(python, "json", {})
    # the flow checks before it asks for any role (ctl None: nothing else would run)
    with pytest.raises(ValueError, match="config verifiers_env='no-such-env' does not load"):
        asyncio.run(flow(None, {"verifiers_env": "no-such-env", "verifiers_python": str(python)}))


@needs_venv
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_agent_openai_trains_a_single_turn_verifiers_environment(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    records = train(run_dir, ENVS / "vf_sum.py", "prompts_per_step=1", "max_new_tokens=6", "verifiers_args.size=8")
    for record in records:
        rows, stated, reports = conversations(run_dir, record["step"])
        assert len(rows) == 2 and record["agent/error_rate"] == 0.0 and record["controller_bulk_bytes"] == 0
        assert record["agent/reward_mean"] == pytest.approx(sum(stated.values()) / 2)  # the task's reward, as the runner stated it
        for session, row in rows.items():
            report = reports[session]
            assert set(report["rewards"]) == {"exact_answer"} and stated[session] == report["rewards"]["exact_answer"] in (0.0, 1.0)
            assert runs(row["gen_mask"]) == [report["output_tokens"]]  # the sampled tokens, exactly, and only them
        groups: dict[str, list[list[int]]] = {}
        for row in rows.values():
            groups.setdefault(row["uid"], []).append(row["prompt_ids"])
        assert all(a == b for a, b in groups.values())  # a group's conversations share their task


@needs_venv
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_agent_openai_trains_a_multi_turn_verifiers_environment(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    records = train(run_dir, ENVS / "vf_retry.py", "prompts_per_step=1", "max_new_tokens=4")
    for record in records:
        rows, stated, reports = conversations(run_dir, record["step"])
        assert len(rows) == 2 and record["agent/error_rate"] == 0.0
        assert record["agent/reward_mean"] == pytest.approx(sum(stated.values()) / 2)
        for session, row in rows.items():
            report = reports[session]
            # the task's @vf.reward (weight 0.5) and the environment's own record_reward
            assert report["rewards"]["turns_taken"] == 0.25 and report["rewards"]["second_answer"] in (0.0, 0.5)
            assert stated[session] == pytest.approx(sum(report["rewards"].values()))
            assert report["turns"] == 2 and sum(runs(row["gen_mask"])) == report["output_tokens"]
            assert len(runs(row["gen_mask"])) == 2  # two sampled turns, the environment's reply between them masked


@needs_venv
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_agent_openai_trains_a_tool_using_verifiers_environment(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # the environment's seat forces a tool call each turn: turn 1 calls `hint`, its MCP server answers
    records = train(run_dir, ENVS / "vf_tools.py", "prompts_per_step=1", "max_new_tokens=40", "max_turns=2",
                    "max_total_tokens=500", steps=1)  # the tool schema takes ~300 of the tiny preset's 512
    tool_text = "add the two numbers and reply with the sum alone"
    for record in records:
        rows, stated, reports = conversations(run_dir, record["step"])
        assert len(rows) == 2 and record["agent/error_rate"] == 0.0
        for session, row in rows.items():
            report = reports[session]
            assert report["metrics"]["tool_calls"] >= 1 and report["turns"] == 2 and report["stop"] == "max_turns"
            assert set(report["rewards"]) == {"exact_answer"} and stated[session] == report["rewards"]["exact_answer"]
            turns = runs(row["gen_mask"])
            assert len(turns) == 2 and sum(turns) == report["output_tokens"]
            first_end = row["gen_mask"].index(1) + turns[0]
            between = row["gen_mask"][first_end:].index(1)  # the tool's result (and the chat template around it), masked
            assert between > len(tool_text) // 4


@needs_venv
@pytest.mark.timeout(120)
def test_a_rollout_whose_model_calls_fail_is_a_failed_program_not_a_reward(tmp_path: Path) -> None:
    """No endpoint at the address: the episode's model call fails, its reward never runs, and the
    runner exits 1 naming why (the flow then scores it as a failed program, under reward_error_limit)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "k",
           "HFRT_SESSION_ID": "step0-0", "HFRT_MODEL": "policy", "HFRT_MAX_TOKENS": "4", "HFRT_SAMPLE": json.dumps({"example": 1})}
    argv = runner_argv(find_python(""), str(ENVS / "vf_sum.py"), {"size": 4}, 1)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the rollout was not scored (no rewards): ProviderError: All connection attempts failed" in proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["rewards"] == {} and report["output_tokens"] == 0 and report["errors"][0].startswith("ProviderError")
