"""Tools of agent flows: a Python function under a time limit, and code in the sandboxed
subprocess (real processes) with its wall-clock, memory and CPU limits; a trajectory's rollout
tensors (roles/agent_turns.py) with tool output masked out of training but attended to."""

from __future__ import annotations

import os
import time

import pytest

from hfrt.flows.agent.sandbox import SandboxLimits, ToolError, call_tool, run_python


async def test_code_runs_and_reports_its_output() -> None:
    out = await run_python("import sys; print(6*7); print('warn', file=sys.stderr); sys.exit(3)")
    assert (out.returncode, out.stdout, out.stderr, out.error) == (3, "42\n", "warn\n", "")


async def test_a_hanging_program_and_its_children_are_killed_at_the_timeout() -> None:
    code = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)"
    start = time.monotonic()
    out = await run_python(code, SandboxLimits(timeout_s=4.0, cpu_s=30))  # time to start python and its child
    assert out.error == "timed out after 4.0 s (killed)" and out.returncode == -9
    assert time.monotonic() - start < 30
    child = int(out.stdout.split()[0])
    for _ in range(100):  # the grandchild went with the process group (reaped by init shortly)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.05)
    else:
        pytest.fail(f"the sandbox's child {child} survived the kill")


async def test_memory_and_cpu_limits() -> None:
    out = await run_python("x = bytearray(1024 * 2**20)", SandboxLimits(memory_mb=256))
    assert out.error == "memory limit (256 MB) exceeded" and "MemoryError" in out.stderr
    out = await run_python("while True: pass", SandboxLimits(timeout_s=60, cpu_s=1))
    assert out.error == "CPU time limit (1 s) exceeded" and out.returncode < 0


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match=r"SandboxLimits.memory_mb=0: must be > 0"):
        SandboxLimits(memory_mb=0)


async def test_tool_functions_under_a_time_limit() -> None:
    assert await call_tool(sorted, [3, 1, 2]) == [1, 2, 3]
    with pytest.raises(ToolError, match="tool sleep timed out after 0.2 s"):
        await call_tool(time.sleep, 5, timeout_s=0.2)
    with pytest.raises(ToolError, match="tool int raised ValueError: invalid literal"):
        await call_tool(int, "x")


def test_trajectory_record_masks_tool_output_but_attends_to_it() -> None:
    from hfrt.roles.endpoint_groups.agent_turns import trajectory_record

    columns = {"prompt_ids": [[5, 6], [7]], "response_ids": [[8, 9, 10], [11]],
               "response_gen_mask": [[1, 0, 1], [1]], "response_log_probs": [[-1.0, -9.0, -2.0], [-3.0]]}
    r = trajectory_record(columns, prompt_width=3, response_width=4, pad_id=0)
    assert r["prompts"].tolist() == [[0, 5, 6], [0, 0, 7]]
    assert r["responses"].tolist() == [[8, 9, 10, 0], [11, 0, 0, 0]]
    assert r["response_mask"].tolist() == [[1, 0, 1, 0], [1, 0, 0, 0]]
    assert r["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0, 0]]
    assert r["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 1, 1, 1]]
    assert r["rollout_log_probs"].tolist() == [[-1.0, 0.0, -2.0, 0.0], [-3.0, 0.0, 0.0, 0.0]]
    assert r["input_ids"].tolist() == [[0, 5, 6, 8, 9, 10, 0], [0, 0, 7, 11, 0, 0, 0]]
    bad = dict(columns, response_gen_mask=[[1, 0], [1]])
    with pytest.raises(ValueError, match=r"trajectory 0: response_ids, response_gen_mask, response_log_probs differ in length \(3, 2, 3\)"):
        trajectory_record(bad, prompt_width=3, response_width=4, pad_id=0)
