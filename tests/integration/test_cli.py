"""The `hfrt` command as a user runs it: controller with built-in and user flows, its help's list of
flows, warm daemons (keep, attach, stop), bad input (a misspelled flow gets the nearest name), and
the latency benchmark's output contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfrt.flows import BUILTIN
from tests.support import STARTED_PIDS, pid_alive

pytestmark = pytest.mark.timeout(120)


def hfrt(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hfrt", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def summary_of(out: subprocess.CompletedProcess[str]) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_ping_flow_runs_on_real_daemons(tmp_path: Path) -> None:
    summary = summary_of(hfrt("controller", "--flow", "ping", "--run-dir", str(tmp_path / "run")))
    assert len(summary["daemons"]) == 2
    assert summary["remote_error"] == "echo[0].fail: ValueError"
    # the one error in stats is the deliberate echo.fail call, and the summary says so
    assert summary["stats"]["errors"] == 1 and summary["errors_unintended"] == 0
    assert summary["errors_intended"].startswith("1: echo.fail raises on purpose")
    assert summary["split_rows"] == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 4], [1, 5], [1, 6], [1, 7]]
    assert summary["overlap_two_0.2s_sleeps_s"] < 0.38
    assert summary["stats"]["controller_bulk_bytes"] == 0
    assert (tmp_path / "run" / "logs" / "echo-0.log").exists()
    key_mode = os.stat(tmp_path / "run" / "cluster.key").st_mode & 0o777
    assert key_mode == 0o600


USER_FLOW = '''
import asyncio
ROLES = {"left": {"impl": "echo", "world_size": 1}, "right": {"impl": "echo", "world_size": 2}}

async def flow(ctl, config):
    left, right = await asyncio.gather(ctl.role("left"), ctl.role("right"))
    a, b = await asyncio.gather(left.echo.call_one(0, config["word"]), right.ping())
    return {"left": a, "right": b}
'''


def test_user_flow_file_with_its_own_roles_and_config(tmp_path: Path) -> None:
    flow = tmp_path / "my_flow.py"
    flow.write_text(USER_FLOW)
    summary = summary_of(hfrt("controller", "--flow", str(flow), "--set", "word=hello", "--run-dir", str(tmp_path / "r")))
    assert Path(summary.pop("trace")).is_file()  # every run writes its call trace
    assert summary == {"left": "hello", "right": ["pong", "pong"]}


def test_role_override_from_the_command_line(tmp_path: Path) -> None:
    summary = summary_of(hfrt("controller", "--flow", "ping", "--role", "echo=echo:3", "--run-dir", str(tmp_path / "r")))
    assert len(summary["daemons"]) == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["controller", "--flow", "nope"], f"unknown flow 'nope': use one of {', '.join(sorted(BUILTIN))}, or a path"),
        (["controller", "--flow", "missing.py"], "flow file missing.py does not exist"),
        (["controller", "--flow", "ping", "--set", "novalue"], "--set expects key=value"),
        (["controller", "--flow", "ping", "--attach", "absent.json"], "attach file absent.json"),
    ],
)
def test_bad_controller_input_is_a_clear_error(args: list[str], message: str, tmp_path: Path) -> None:
    out = hfrt(*args, "--run-dir", str(tmp_path / "r"))
    assert out.returncode != 0
    assert message in out.stderr


def test_a_misspelled_flow_gets_the_nearest_name() -> None:
    """As docs/flows.md (built-in RL flows) shows it."""
    from hfrt.flows import BUILTIN

    out = hfrt("controller", "--flow", "ppoo")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == f"hfrt controller: unknown flow 'ppoo': did you mean 'ppo'? Use one of {', '.join(sorted(BUILTIN))}, or a path to a .py file\n"


def test_controller_help_lists_every_builtin_flow() -> None:
    from hfrt.flows import BUILTIN
    from hfrt.flows.catalog import describe

    out = hfrt("controller", "--help", env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr
    listed = out.stdout.split("built-in flows (--flow NAME):\n", 1)[1].splitlines()
    firsts = {line.split()[0]: line for line in listed if line.startswith("  ") and not line.startswith("   ")}
    assert list(firsts) == list(BUILTIN)  # rm and agent_openai included: the list is the registry
    for name, text in describe(BUILTIN).items():  # each with its docstring's opening (wrapped: its first line)
        assert text.startswith(firsts[name].split(None, 1)[1]), name


def test_daemon_without_a_key_refuses_to_start() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HFRT_KEY")}
    out = hfrt("daemon", "--role", "echo", "--controller", "tcp://127.0.0.1:1", env=env, timeout=30)
    assert out.returncode == 2
    assert "no cluster key" in out.stderr


@pytest.mark.slow
def test_keep_daemons_then_attach_then_stop(tmp_path: Path) -> None:
    run_dir = tmp_path / "warm"
    first = summary_of(hfrt("controller", "--flow", "ping", "--keep-daemons", "--run-dir", str(run_dir)))
    attach = Path(first["attach"])
    pids = [int(d.rsplit(" ", 1)[1]) for d in first["daemons"]]
    STARTED_PIDS.update(pids)
    try:
        assert json.loads(attach.read_text())["roles"] == {"echo": 2}
        assert all(pid_alive(p) for p in pids), "kept daemons are not running"
        second = summary_of(hfrt("controller", "--flow", "ping", "--attach", str(attach), "--run-dir", str(tmp_path / "again")))
        assert [int(d.rsplit(" ", 1)[1]) for d in second["daemons"]] == pids  # the same warm processes
        stopped = hfrt("stop", str(attach))
        assert stopped.returncode == 0, stopped.stderr
        assert "echo:0" in stopped.stdout and "echo:1" in stopped.stdout
        for pid in pids:
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not pid_alive(pid)
    finally:
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, 9)


@pytest.mark.slow
def test_latency_benchmark_prints_a_table_and_json(tmp_path: Path) -> None:
    out = hfrt("bench", "latency", "--json", "--calls", "300", "--duration", "0.3", "--no-ray", "--out", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("hfrt_p50_us", "hfrt_p99_us", "hfrt_calls_per_s", "fanout4_p50_us", "raw_zmq_p50_us",
                "ray_p50_us", "hfrt_vs_raw_p50", "hfrt_vs_ray_p50"):
        assert key in result
    assert result["hfrt_p50_us"] > 0 and result["raw_zmq_p50_us"] > 0
    assert result["ray_p50_us"] is None and result["controller_bulk_bytes"] == 0
    assert "hfrt no-op round trip p50" in out.stdout
    assert "skipped (--no-ray)" in out.stdout and "n/a" not in out.stdout  # a status, not a figure in µs
    assert "hfrt pipelined calls/s: target ≥ 20000 calls/s: " in out.stdout  # a target printed as a target
    assert result["targets_met"]["hfrt_vs_ray_p50"] is None
    assert json.loads((tmp_path / "r.json").read_text()) == result
