"""Run folders and inputs checked by real `hfrt controller` processes before any daemon starts:
one run per folder at a time (an flock that kill -9 cannot leave stale), runs whose checkpoints
are all damaged, data files with bad rows, and `--attach` given settings it cannot honour."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import STARTED_PIDS, pid_alive

pytestmark = pytest.mark.timeout(120)

HOLD_FLOW = '''
import asyncio
import pathlib

ROLES = {}


async def flow(ctl, config):
    pathlib.Path(config["run_dir"], "running").write_text("yes")
    await asyncio.sleep(float(config.get("hold", 0)))
    return {"held": config.get("hold", 0)}
'''


def hfrt(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hfrt", *args], capture_output=True, text=True, timeout=timeout)


def test_one_run_per_folder_and_no_stale_lock_after_kill_9(tmp_path: Path) -> None:
    flow = tmp_path / "hold.py"
    flow.write_text(HOLD_FLOW)
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "hfrt", "controller", "--flow", str(flow), "--run-dir", str(run_dir), "--set", "hold=100"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "running").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None and (run_dir / "running").exists(), "the first run did not start"
        second = hfrt("controller", "--flow", str(flow), "--run-dir", str(run_dir), "--set", "hold=0")
        assert second.returncode == 2, second.stderr
        assert f"run folder {run_dir} is in use by another hfrt process (pid {first.pid}," in second.stderr
        resumed = hfrt("controller", "--flow", str(flow), "--resume", str(run_dir))
        assert resumed.returncode == 2, resumed.stderr
        assert f"--resume {run_dir}: that run is still going (pid {first.pid} holds {run_dir}/.lock)" in resumed.stderr
        assert json.loads((run_dir / "config.json").read_text())["flow"] == {"hold": 100}  # not overwritten
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        reused = hfrt("controller", "--flow", str(flow), "--run-dir", str(run_dir), "--set", "hold=0")
        assert reused.returncode == 2, reused.stderr  # the OS dropped the lock, but the folder holds a run
        assert (f"hfrt controller: run folder {run_dir} already holds a run (config.json); continue it with "
                f"--resume {run_dir}, replace it with --overwrite") in reused.stderr
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
        third = hfrt("controller", "--flow", str(flow), "--run-dir", str(run_dir), "--set", "hold=0", "--overwrite")
        assert third.returncode == 0, third.stderr  # the OS dropped the dead run's lock
        assert json.loads(third.stdout)["held"] == 0
        assert not (run_dir / "metrics.jsonl").exists()  # the old run's records went with --overwrite
        assert json.loads((run_dir / "config.json").read_text())["flow"] == {"hold": 0}
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def _checkpoint(run_dir: Path, step: int, state: object, roles: tuple[str, ...] = ("actor",)) -> Path:
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    for role in roles:
        (folder / role).mkdir(parents=True)
        (folder / role / "hfrt_engine.json").write_text("{}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state.json").write_text(state if isinstance(state, str) else json.dumps(state))
    (run_dir / "checkpoints" / "latest").write_text(folder.name + "\n")
    return folder


def _latest(run_dir: Path, name: str) -> None:
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "latest").write_text(name + "\n")


def _whole(step: int) -> dict[str, object]:
    return {"step": step, "roles": ["actor", "critic"], "data": {"rng": []}}


DAMAGE = {
    "latest outside the run": (lambda d: _latest(d, "../../outside"),
                               "checkpoints/latest names '../../outside', which is not a checkpoint folder of this run"),
    "latest at a missing folder": (lambda d: _latest(d, "step_00000004"), "names step_00000004, which does not exist"),
    "truncated state.json": (lambda d: _checkpoint(d, 2, '{"step": 2, "rol'), "state.json is not readable JSON"),
    "wrong type": (lambda d: _checkpoint(d, 2, _whole(2) | {"step": "2"}), "step '2' is not a positive integer"),
    "step beyond the run": (lambda d: _checkpoint(d, 9, _whole(9), ("actor", "critic")), "step 9 is beyond this run's 3 steps"),
    "role files missing": (lambda d: _checkpoint(d, 2, _whole(2)), "role 'critic' has no saved files"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_refuses_when_no_checkpoint_is_whole(tmp_path: Path, damage: str) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"flow": {"steps": 3}, "roles": {}}))
    make, message = DAMAGE[damage]
    make(run_dir)
    out = hfrt("controller", "--flow", "ppo", "--resume", str(run_dir))
    assert out.returncode == 2, out.stderr
    assert f"hfrt controller: {run_dir}: no whole checkpoint to resume from: " in out.stderr
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not (run_dir / "logs").exists(), "a daemon was started before the checkpoint was checked"


BAD_ROWS = [
    ('{"prompt": "1+1="}\n[1, 2]\n', "train.jsonl:2: expected an object, got list"),
    ('{"prompt": "1+1="}\n\n{"ground_truth": "2"}\n', "train.jsonl:3: missing key 'prompt' (a row has ['ground_truth'])"),
    ('{"prompt": 7}\n', "train.jsonl:1: 'prompt' must be a string or a list"),
    ('{"prompt": "1+1="}\n{"prompt": "1+2="\n', "train.jsonl:2: not JSON"),
    ("\n\n", "train.jsonl: no rows"),
]


@pytest.mark.parametrize(("content", "message"), BAD_ROWS)
@pytest.mark.parametrize("key", ["data", "val_data"])
def test_bad_data_file_is_refused_before_launch(tmp_path: Path, key: str, content: str, message: str) -> None:
    (tmp_path / "train.jsonl").write_text(content)
    run_dir = tmp_path / "run"
    out = hfrt("controller", "--flow", "grpo", "--run-dir", str(run_dir), "--set", f"{key}={tmp_path / 'train.jsonl'}")
    assert out.returncode == 2, out.stderr
    assert f"hfrt controller: config {key}: {tmp_path}/{message}" in out.stderr, out.stderr
    assert not (run_dir / "logs").exists(), "a daemon was started before the data file was checked"


@pytest.mark.slow
def test_attach_refuses_role_settings_and_missing_roles(tmp_path: Path) -> None:
    warm = hfrt("controller", "--flow", "ping", "--set", "rounds=1", "--keep-daemons", "--run-dir", str(tmp_path / "warm"))
    assert warm.returncode == 0, warm.stderr[-3000:]
    summary = json.loads(warm.stdout)
    pids = [int(d.rsplit(" ", 1)[1]) for d in summary["daemons"]]
    STARTED_PIDS.update(pids)
    attach = summary["attach"]
    try:
        assert json.loads(Path(attach).read_text())["settings"]["echo"] == {"impl": "echo", "world_size": 2}
        for override, named in [
            (["--role", "echo=echo:3"], "these from --role cannot apply: roles.echo.world_size=3 (they have 2)"),
            (["--set", "roles.echo.world_size=3", "--set", "roles.echo.options.x=1"],
             "these from --config/--set cannot apply: roles.echo.world_size=3 (they have 2), roles.echo.options.x=1;"),
        ]:
            out = hfrt("controller", "--flow", "ping", "--attach", attach, "--run-dir", str(tmp_path / "r"), *override)
            assert out.returncode == 2, out.stderr
            assert ("hfrt controller: --attach: the daemons already running were started with their own role "
                    f"settings, so {named}") in out.stderr
        same = hfrt("controller", "--flow", "ping", "--set", "rounds=1", "--set", "roles.echo.world_size=2",
                    "--attach", attach, "--run-dir", str(tmp_path / "same"))
        assert same.returncode == 0, same.stderr  # a setting the daemons already have is no override
        start = time.monotonic()
        out = hfrt("controller", "--flow", "ppo", "--attach", attach, "--run-dir", str(tmp_path / "p"))
        assert out.returncode == 2, out.stderr
        assert (f"--attach {attach}: flow 'ppo' needs role(s) ['actor', 'critic', 'reference', 'reward'], which these "
                "daemons do not have (attach.json has ['echo'])") in out.stderr
        assert time.monotonic() - start < 30
        again = hfrt("controller", "--flow", "ping", "--set", "rounds=1", "--attach", attach, "--run-dir", str(tmp_path / "warm"),
                     "--overwrite")
        assert again.returncode == 0, again.stderr  # the keep-daemons folder is free once its run ended
        assert hfrt("stop", attach).returncode == 0
    finally:
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_launch_refuses_a_folder_in_use(tmp_path: Path) -> None:
    """`hfrt launch` holds its folder's lock while it starts daemons (then a controller may use it)."""
    from hfrt.session import RunDirLock

    spec = tmp_path / "cluster.toml"
    spec.write_text('name = "t"\nlauncher = "local"\n[[nodes]]\nname = "a"\nhost = "127.0.0.1"\ndevices = 1\n'
                    '[roles.echo]\nimpl = "echo"\nworld_size = 1\n')
    run_dir = tmp_path / "warm"
    with RunDirLock(run_dir):
        out = hfrt("launch", str(spec), "--run-dir", str(run_dir))
    assert out.returncode == 2, out.stderr
    assert f"hfrt launch: run folder {run_dir} is in use by another hfrt process (pid {os.getpid()}," in out.stderr
    assert not (run_dir / "attach.json").exists() and not (run_dir / "cluster.key").exists()


def test_every_bad_jsonl_line_is_named_up_to_a_limit(tmp_path: Path) -> None:
    """Not only the first: one run shows every line to fix (REPORT_BAD of them, the rest counted)."""
    from hfrt.flows.data import REPORT_BAD, DatasetError, check_data_file

    lines = ['{"prompt": "1+1="}', "[1]", '{"ground_truth": "2"}', '{"prompt": 7}', "{oops"] + ["[2]"] * REPORT_BAD
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as raised:
        check_data_file(tmp_path / "train.jsonl", "config data")
    message = str(raised.value)
    for where in ("train.jsonl:2: expected an object", "train.jsonl:3: missing key 'prompt'",
                  "train.jsonl:4: 'prompt' must be a string", "train.jsonl:5: not JSON"):
        assert where in message, message
    assert message.startswith("config data: ") and message.endswith("; and 4 more bad line(s)")


def test_a_flow_file_with_a_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    flow = tmp_path / "typo.py"
    flow.write_text("ROLES = {}\n\nasync def flow(ctl, config)\n    return {}\n")
    out = hfrt("controller", "--flow", str(flow), "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr
    assert f"hfrt controller: flow file {flow}, line 3, column 28: expected ':'" in out.stderr
    assert "async def flow(ctl, config)" in out.stderr and "Traceback" not in out.stderr
