"""Agent programs in their own venv (`agent_command`, hfrt/flows/agent/command.py): a real child
process per conversation — its environment (OPENAI_BASE_URL, OPENAI_API_KEY, HFRT_SESSION_ID, the
sample), its logs kept per conversation, its stated reward or the flow's agent_reward, a failure
or a timeout (the process group killed) as a reward error — and the agent_openai flow training
two GRPO steps on the tiny preset on the conversations of tests/integration/agents/openai_agent.py
(the `openai` client). The docs section it backs: docs/agents-and-openai.md, "Agent programs"."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hfrt.flows.agent.command import (
    AgentProgramFailed,
    AgentProgramTimeout,
    CommandDriver,
    failure_column,
    program_reward,
    reward_of,
)
from hfrt.flows.agent.external import DriverCall
from hfrt.flows.reward_errors import RewardErrorLimit, RewardErrors, error_kind
from tests.support import pid_alive

AGENT = Path(__file__).resolve().parent / "agents" / "openai_agent.py"


def call(session: str = "step0-1", timeout_s: float = 10.0) -> DriverCall:
    return DriverCall("http://127.0.0.1:9/v1", "key-1", "policy", session, {"prompt": "1+2=", "ground_truth": "3"},
                      max_tokens=8, temperature=1.0, max_steps=1, timeout_s=timeout_s)


def conversation_reward(answer: Any, sample: dict[str, Any]) -> float:
    """The flow's agent_reward for a program whose last line is no number: 0.25 when the endpoint's
    recorded conversation reached it (the sample's `conversation`), else -1."""
    return 0.25 if sample.get("conversation") and str(answer) == "the answer is above" else -1.0


def test_a_program_sees_the_endpoint_and_its_session_and_its_logs_are_kept(tmp_path: Path) -> None:
    script = "import os, json; print(os.environ['OPENAI_BASE_URL'], os.environ['OPENAI_API_KEY'], os.environ['HFRT_SESSION_ID']); " \
             "print(json.loads(os.environ['HFRT_SAMPLE'])['ground_truth'], os.environ['HFRT_PROMPT']); print('0.5')"
    driver = CommandDriver(f"{sys.executable} -c \"{script}\"", timeout_s=10, log_dir=tmp_path)
    result = driver(call())
    assert str(result) == "0.5" and reward_of(str(result)) == 0.5
    assert (tmp_path / "step0-1.stdout").read_text().splitlines()[:2] == ["http://127.0.0.1:9/v1 key-1 step0-1", "3 1+2="]
    assert program_reward(lambda a, s: -1.0)(result, {}) == 0.5 and program_reward(lambda a, s: -1.0)("done", {}) == -1.0
    assert reward_of("nan") is None and reward_of("1e3") == 1000.0 and reward_of("12 apples") is None


def test_a_failing_program_is_an_error_naming_its_status_and_stderr(tmp_path: Path) -> None:
    driver = CommandDriver("echo partial; echo 'Traceback: boom' >&2; exit 3", timeout_s=10, log_dir=tmp_path)
    with pytest.raises(AgentProgramFailed, match=r"exited 3 in session step0-1; logs in .*stderr ends: 'Traceback: boom'"):
        driver(call())
    assert (tmp_path / "step0-1.stdout").read_text() == "partial\n"


def test_a_program_past_its_time_is_killed_with_everything_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    driver = CommandDriver(f"sleep 30 & echo $! > {pid_file}; wait", timeout_s=1.0, log_dir=None)
    start = time.monotonic()
    with pytest.raises(AgentProgramTimeout, match="ran past sample_timeout_s=1"):
        driver(call())
    assert time.monotonic() - start < 10
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child)  # the grandchild went with the process group


def test_failed_programs_count_against_reward_error_limit() -> None:
    column = failure_column(["", "AgentProgramFailed: agent_command exited 3", ""])
    assert column[0] == "" and error_kind(column[1]) == "AgentProgramFailed"
    RewardErrors(limit=0.5).observe(column, step=0)  # one of three: under the limit
    with pytest.raises(RewardErrorLimit, match="failed on 1 of 3 samples"):
        RewardErrors(limit=0.2).observe(column, step=0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_agent_openai_trains_on_an_agent_programs_conversations(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sets = ["steps=2", "progress=off", "export_hf=false", "prompts_per_step=2", "n=4", "max_new_tokens=6",
            "max_total_tokens=200", "agent_threads=4", "save_trajectories=true", "sample_timeout_s=60",
            f"agent_command={sys.executable} {AGENT}", "agent_reward=tests.integration.test_agent_command:conversation_reward"]
    cmd = [sys.executable, "-m", "hfrt", "controller", "--flow", "agent_openai", "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AgentProgramFailed" in proc.stderr  # logged (once: one kind)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    logs = run_dir / "agent_logs"
    for record in records:
        step = record["step"]
        assert record["agent/error_rate"] == 0.25 and record["controller_bulk_bytes"] == 0  # 2 of 8 conversations failed
        stated = [reward_of((logs / f"step{step}-{i}.stdout").read_text().splitlines()[-1]) for i in range(8) if i % 4 > 1]
        expected = (sum(stated) + 2 * 0.25) / 8  # failures score 0; the non-numeric ones agent_reward's 0.25
        assert record["agent/reward_mean"] == pytest.approx(expected)
        assert all("giving up" in (logs / f"step{step}-{i}.stderr").read_text() for i in (0, 4))
    rows = [json.loads(line) for line in (run_dir / "trajectories" / "step-0.jsonl").read_text().splitlines()]
    assert {r["session"] for r in rows} == {f"step0-{i}" for i in range(8)}  # a failed program's one call trains too
    assert all(r["gen_mask"] and set(r["gen_mask"]) <= {0, 1} for r in rows)
