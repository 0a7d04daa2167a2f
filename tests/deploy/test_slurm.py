"""The Slurm launcher against a real one-node Slurm cluster (munged, slurmctld, slurmd on
127.0.0.1): srun steps in an allocation it makes or one that exists, an sbatch job script,
launch/stop, and refusals and crashes, each leaving no daemon, step or job behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hfrt.deploy import LaunchError, load_spec
from hfrt.flows import load_flow
from hfrt.session import run_on_cluster
from tests.deploy.conftest import Slurm, daemon_pids, squeue_names

pytestmark = pytest.mark.timeout(90)


def slurm_spec(
    tmp_path: Path, slurm: Slurm, marker: str, *, mode: str, extra_slurm: str = "", role: str = "", impl: str = "echo"
) -> Path:
    text = f"""
name = "{marker}"
launcher = "slurm"
[slurm]
mode = "{mode}"
start_timeout_s = 30
{extra_slurm}
[daemons]
hello_timeout_s = 30
[[nodes]]
name = "{slurm.node}"
devices = 2
[roles.echo]
impl = "{impl}"
world_size = 2
options = {{ marker = "{marker}" }}
{role}
"""
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def assert_nothing_left(marker: str) -> None:
    deadline = time.monotonic() + 10
    while (daemon_pids(marker) or squeue_names(f"hfrt-{marker}")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert daemon_pids(marker) == [], "daemons left running"
    assert squeue_names(f"hfrt-{marker}") == [], "jobs or steps left in the queue"


async def run_ping(spec: Path, run_dir: Path) -> dict[str, Any]:
    return await run_on_cluster(load_flow("ping"), load_spec(spec), run_dir=run_dir, config={"rounds": 20})


async def launch_error(spec: Path, run_dir: Path) -> str:
    with pytest.raises(LaunchError) as info:
        await run_ping(spec, run_dir)
    return str(info.value)


@pytest.fixture
def allocation(slurm: Slurm, marker: str) -> Iterator[str]:
    """A two-CPU allocation made the way a user's salloc would; cancelled at teardown."""
    out = subprocess.run(["salloc", "--no-shell", "-n2", f"--job-name=user-{marker}"], capture_output=True, text=True, timeout=30)
    job = out.stderr.split("allocation")[-1].strip()
    assert out.returncode == 0 and job.isdigit(), out.stderr
    yield job
    subprocess.run(["scancel", job], capture_output=True)


async def test_srun_steps_in_an_allocation_the_launcher_makes(tmp_path: Path, slurm: Slurm, marker: str) -> None:
    summary = await run_ping(slurm_spec(tmp_path, slurm, marker, mode="srun"), tmp_path / "run")
    assert len(summary["daemons"]) == 2 and summary["remote_error"] == "echo[0].fail: ValueError"
    assert (tmp_path / "run" / "logs" / "srun-echo-0.log").exists()
    assert_nothing_left(marker)


async def test_srun_steps_inside_an_existing_allocation(tmp_path: Path, slurm: Slurm, marker: str, allocation: str) -> None:
    spec = slurm_spec(tmp_path, slurm, marker, mode="auto", extra_slurm=f'job_id = "{allocation}"')
    summary = await run_ping(spec, tmp_path / "run")
    assert len(summary["daemons"]) == 2
    assert_nothing_left(marker)
    state = subprocess.run(["squeue", "-h", "-j", allocation, "-o", "%T"], capture_output=True, text=True).stdout.strip()
    assert state == "RUNNING", "the user's own allocation is left alone"


async def test_sbatch_job_script_starts_the_daemons(tmp_path: Path, slurm: Slurm, marker: str) -> None:
    summary = await run_ping(slurm_spec(tmp_path, slurm, marker, mode="sbatch"), tmp_path / "run")
    assert len(summary["daemons"]) == 2
    script = next((tmp_path / "run").glob("*.sbatch"))
    key = (tmp_path / "run" / "cluster.key").read_text().strip()
    assert os.stat(script).st_mode & 0o777 == 0o700
    assert key not in script.read_text() and "--key-file" in script.read_text()
    exits = next((tmp_path / "run").glob("*.exits")).read_text().split()
    assert sorted(exits[0::2]) == ["echo:0", "echo:1"], "each step's exit is recorded for the launcher"
    assert_nothing_left(marker)


def hfrt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hfrt", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_launch_then_stop_cancels_the_allocation_it_made(tmp_path: Path, slurm: Slurm, marker: str) -> None:
    launched = hfrt("launch", str(slurm_spec(tmp_path, slurm, marker, mode="srun")), "--run-dir", str(tmp_path / "warm"))
    assert launched.returncode == 0, launched.stderr
    attach = Path(launched.stdout.strip())
    cleanup = json.loads(attach.read_text())["cleanup"]
    assert len(cleanup) == 1 and cleanup[0][0] == "scancel"
    assert len(daemon_pids(marker)) == 2 and squeue_names(f"hfrt-{marker}")
    ran = hfrt("controller", "--flow", "ping", "--set", "rounds=5", "--attach", str(attach), "--run-dir", str(tmp_path / "r"))
    assert ran.returncode == 0, ran.stderr
    stopped = hfrt("stop", str(attach))
    assert stopped.returncode == 0, stopped.stderr
    assert_nothing_left(marker)


@pytest.mark.parametrize("mode, refused_by", [("srun", "salloc"), ("sbatch", "sbatch")])
async def test_nonexistent_partition_is_refused(tmp_path: Path, slurm: Slurm, marker: str, mode: str, refused_by: str) -> None:
    spec = slurm_spec(tmp_path, slurm, marker, mode=mode, extra_slurm='partition = "nope"')
    text = await launch_error(spec, tmp_path / "run")
    assert f"{refused_by} refused the" in text and f"echo on {slurm.node}" in text
    assert "Invalid partition name specified" in text
    assert_nothing_left(marker)


async def test_more_cpus_than_the_node_has_is_refused(tmp_path: Path, slurm: Slurm, marker: str) -> None:
    text = await launch_error(slurm_spec(tmp_path, slurm, marker, mode="srun", role="cpus = 3"), tmp_path / "run")
    assert f"salloc refused the allocation for echo on {slurm.node}" in text
    assert "More processors requested than permitted" in text
    assert_nothing_left(marker)


async def test_srun_refusing_a_step_in_an_existing_allocation(tmp_path: Path, slurm: Slurm, marker: str, allocation: str) -> None:
    spec = slurm_spec(tmp_path, slurm, marker, mode="srun", extra_slurm=f'job_id = "{allocation}"', role="cpus = 3")
    text = await launch_error(spec, tmp_path / "run")
    assert f"on node {slurm.node} device" in text and "echo" in text
    assert "More processors requested than permitted" in text
    assert_nothing_left(marker)


@pytest.mark.parametrize("mode", ["srun", "sbatch"])
async def test_daemon_crashing_at_start_up_is_a_clear_error(tmp_path: Path, slurm: Slurm, marker: str, mode: str) -> None:
    spec = slurm_spec(tmp_path, slurm, marker, mode=mode, impl="nonexistent.module:Nope")
    text = await launch_error(spec, tmp_path / "run")
    assert "exited before saying hello" in text and f"on node {slurm.node} device" in text
    assert "slurm job" in text and "No module named 'nonexistent'" in text
    assert_nothing_left(marker)


# -- elastic recovery in Slurm steps (`--set recovery=on`) --------------------------------------


def recovery_spec(tmp_path: Path, slurm: Slurm, marker: str, roles: dict[str, dict[str, Any]], *, mode: str,
                  job_id: str = "", heartbeat_s: float = 1.0) -> Path:
    """One node (one device), every role colocated; `marker` in every daemon's environment."""
    from tests.deploy.test_ssh import toml_inline

    tables = "".join(
        f'[roles.{name}]\nimpl = "{r.get("impl", name)}"\nworld_size = {r.get("world_size", 1)}\n'
        f'options = {toml_inline(r.get("options", {}))}\n' for name, r in roles.items()
    )
    text = f"""
name = "{marker}"
launcher = "slurm"
env = {{ HFRT_TEST_MARK = "{marker}" }}
[slurm]
mode = "{mode}"
start_timeout_s = 30
{f'job_id = "{job_id}"' if job_id else ""}
[daemons]
hello_timeout_s = 60
heartbeat_s = {heartbeat_s}
[[nodes]]
name = "{slurm.node}"
devices = 1
{tables}"""
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("mode", ["srun", "sbatch"])
async def test_a_frozen_daemon_step_is_cancelled_and_replaced_by_a_new_step(tmp_path: Path, slurm: Slurm, marker: str, mode: str) -> None:
    from hfrt.flows import Flow
    from tests.deploy.test_ssh import freeze_then_call, kill_marked, marked_daemons

    roles = {"reward": {"impl": "echo"}}
    cluster = load_spec(recovery_spec(tmp_path, slurm, marker, roles, mode=mode, heartbeat_s=0.5))
    try:
        summary = await run_on_cluster(Flow("freeze", freeze_then_call, roles), cluster, run_dir=tmp_path / "run",
                                       config={"recovery": "on"})
    finally:
        kill_marked(marker)
    assert summary["after"] == ["after"] and summary["restarts"] == 1 and summary["new"] != summary["frozen"]
    stat = Path(f"/proc/{summary['frozen']}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the frozen daemon was left running"
    assert marked_daemons(marker, "reward") == []
    assert_nothing_left(marker)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ppo_in_slurm_steps_survives_a_killed_reward_daemon(tmp_path: Path, slurm: Slurm, marker: str, allocation: str) -> None:
    from tests.deploy.test_ssh import kill_marked, marked_daemons
    from tests.integration.test_recovery import steps_done

    steps, run_dir = 6, tmp_path / "run"
    # inside the user's two-CPU allocation: its four one-CPU steps overlap (salloc for 4 CPUs would be refused)
    spec = recovery_spec(tmp_path, slurm, marker, load_flow("ppo").roles, mode="srun", job_id=allocation)
    run = subprocess.Popen(
        [sys.executable, "-m", "hfrt", "controller", "--cluster", str(spec), "--flow", "ppo", "--run-dir", str(run_dir),
         "--set", "recovery=on", "--set", f"steps={steps}", "--set", "export_hf=false", "--set", "trace=false",
         "--set", "tensorboard=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while len(steps_done(run_dir)) < 2 and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.poll() is None and len(steps_done(run_dir)) >= 2, "the run did not reach step 2"
        [killed] = marked_daemons(marker, "reward")
        os.kill(killed, 9)
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        kill_marked(marker)
    assert run.returncode == 0, err[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    assert records[-1]["recovery/restarts"] == 1
    print(f"recovery figures: replace_s={json.loads(out)['recovery_replace_s']} lost_s={records[-1]['recovery/lost_s']}")
    assert not list(Path("/dev/shm").glob(f"hfrt-{killed}-*")), "the killed daemon's /dev/shm files were left"
    for role in ("actor", "critic", "reference", "reward"):
        assert marked_daemons(marker, role) == [], f"{role} daemons left running"
    assert_nothing_left(marker)
