"""The SSH launcher against a real sshd on 127.0.0.1: a flow end to end, launch/attach/stop from
the command line, Ctrl-C, and the ways a launch fails (closed port, wrong key, a daemon that
crashes at start-up, one bad node of two), each leaving nothing running."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hfrt.deploy import LaunchError, load_spec
from hfrt.flows import Flow, load_flow
from hfrt.session import run_on_cluster
from tests.deploy.conftest import Sshd, daemon_pids, free_port
from tests.support import sigint_default

pytestmark = pytest.mark.timeout(90)


def ssh_spec(
    tmp_path: Path, sshd: Sshd, marker: str, *, port: int | None = None, identity: Path | None = None,
    impl: str = "echo", second_node_port: int | None = None,
) -> Path:
    nodes = '[[nodes]]\nname = "node-a"\nhost = "127.0.0.1"\ndevices = 2\n'
    world = 2
    if second_node_port is not None:
        nodes = '[[nodes]]\nname = "node-a"\nhost = "127.0.0.1"\ndevices = 1\n'
        nodes += f'[[nodes]]\nname = "node-b"\nhost = "127.0.0.1"\nssh_port = {second_node_port}\ndevices = 1\n'
    pythonpath = os.environ.get("PYTHONPATH", "")  # the ssh'd daemon must import the same hfrt
    text = f"""
name = "{marker}"
launcher = "ssh"
env = {{ HFRT_TEST_SECRET = "{marker}-secret", PYTHONPATH = "{pythonpath}" }}
[ssh]
user = "{sshd.user}"
port = {port or sshd.port}
identity = "{identity or sshd.identity}"
strict_host_key_checking = "accept-new"
known_hosts = "{sshd.known_hosts}"
connect_timeout_s = 5
[controller]
bind = "0.0.0.0"
[daemons]
log_dir = "{tmp_path / 'node-logs'}"
hello_timeout_s = 30
{nodes}
[roles.echo]
impl = "{impl}"
world_size = {world}
options = {{ marker = "{marker}" }}
"""
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def ssh_clients(port: int) -> list[str]:
    """Command lines of live ssh clients talking to the test sshd's port."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0] == b"ssh" and str(port).encode() in cmd:
                found.append(b" ".join(cmd).decode(errors="replace"))
    return found


def command_lines_containing(text: str) -> list[str]:
    hits = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                hits.append(cmd)
    return hits


def assert_nothing_left(marker: str, sshd: Sshd) -> None:
    deadline = time.monotonic() + 5
    while (daemon_pids(marker) or ssh_clients(sshd.port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon_pids(marker) == [], "daemons left running"
    assert ssh_clients(sshd.port) == [], "ssh clients left running"


async def test_ping_flow_over_ssh_keeps_secrets_off_command_lines(tmp_path: Path, sshd: Sshd, marker: str) -> None:
    cluster = load_spec(ssh_spec(tmp_path, sshd, marker))
    ping = load_flow("ping")
    seen: dict[str, Any] = {}

    async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
        key = (tmp_path / "run" / "cluster.key").read_text().strip()
        seen["daemons"] = daemon_pids(marker)
        seen["key_on_command_line"] = command_lines_containing(key)
        seen["secret_on_command_line"] = command_lines_containing(f"{marker}-secret")
        echo = await ctl.role("echo")
        seen["hosts"] = [d["host"] for d in await echo.describe.call()]
        return dict(await ping.run(ctl, config) or {})

    summary = await run_on_cluster(
        Flow("ssh-ping", flow, ping.roles), cluster, run_dir=tmp_path / "run", config={"rounds": 20}
    )
    assert len(summary["daemons"]) == 2 and summary["remote_error"] == "echo[0].fail: ValueError"
    assert summary["split_rows"][-1] == [1, 7]
    assert len(seen["daemons"]) == 2, "the daemons run as separate processes started through sshd"
    assert seen["key_on_command_line"] == [] and seen["secret_on_command_line"] == []
    assert (tmp_path / "node-logs").is_dir(), "daemon logs are written on the node"
    assert_nothing_left(marker, sshd)


def hfrt(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hfrt", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_launch_then_attach_then_stop_from_the_command_line(tmp_path: Path, sshd: Sshd, marker: str) -> None:
    spec = ssh_spec(tmp_path, sshd, marker)
    launched = hfrt("launch", str(spec), "--run-dir", str(tmp_path / "warm"))
    assert launched.returncode == 0, launched.stderr
    attach = Path(launched.stdout.strip())
    assert f"hfrt stop {attach}" in launched.stderr
    data = json.loads(attach.read_text())
    assert data["roles"] == {"echo": 2} and data["bind"].startswith("tcp://0.0.0.0:")
    assert data["address"].startswith("tcp://127.0.0.1:")
    pids = daemon_pids(marker)
    assert len(pids) == 2 and ssh_clients(sshd.port) == [], "launch leaves the daemons, not the ssh sessions"
    ran = hfrt("controller", "--flow", "ping", "--set", "rounds=10", "--attach", str(attach), "--run-dir", str(tmp_path / "r"))
    assert ran.returncode == 0, ran.stderr
    assert sorted(int(d.rsplit(" ", 1)[1]) for d in json.loads(ran.stdout)["daemons"]) == sorted(pids)
    stopped = hfrt("stop", str(attach))
    assert stopped.returncode == 0, stopped.stderr
    assert "echo:0" in stopped.stdout
    assert_nothing_left(marker, sshd)


async def test_unreachable_host_is_a_clear_error(tmp_path: Path, sshd: Sshd, marker: str) -> None:
    closed = free_port()
    cluster = load_spec(ssh_spec(tmp_path, sshd, marker, port=closed))
    with pytest.raises(LaunchError) as info:
        await run_on_cluster(load_flow("ping"), cluster, run_dir=tmp_path / "run", config={})
    text = str(info.value)
    assert f"echo[0] on node node-a (127.0.0.1) device 0: ssh {sshd.user}@127.0.0.1:{closed} failed" in text
    assert "Connection refused" in text
    assert_nothing_left(marker, sshd)


async def test_wrong_key_is_a_clear_error(tmp_path: Path, sshd: Sshd, marker: str) -> None:
    cluster = load_spec(ssh_spec(tmp_path, sshd, marker, identity=sshd.wrong_identity))
    with pytest.raises(LaunchError) as info:
        await run_on_cluster(load_flow("ping"), cluster, run_dir=tmp_path / "run", config={})
    text = str(info.value)
    assert "echo[1] on node node-a (127.0.0.1) device 1" in text and "Permission denied (publickey)" in text
    assert_nothing_left(marker, sshd)


async def test_daemon_crashing_at_start_up_is_a_clear_error(tmp_path: Path, sshd: Sshd, marker: str) -> None:
    cluster = load_spec(ssh_spec(tmp_path, sshd, marker, impl="nonexistent.module:Nope"))
    with pytest.raises(LaunchError) as info:
        await run_on_cluster(load_flow("ping"), cluster, run_dir=tmp_path / "run", config={})
    text = str(info.value)
    assert "exited before saying hello" in text and "on node node-a (127.0.0.1)" in text
    assert "No module named 'nonexistent'" in text
    assert_nothing_left(marker, sshd)


async def test_one_bad_node_tears_down_the_daemon_started_on_the_good_one(tmp_path: Path, sshd: Sshd, marker: str) -> None:
    cluster = load_spec(ssh_spec(tmp_path, sshd, marker, second_node_port=free_port()))
    with pytest.raises(LaunchError) as info:
        await run_on_cluster(load_flow("ping"), cluster, run_dir=tmp_path / "run", config={})
    text = str(info.value)
    assert "echo[1] on node node-b (127.0.0.1) device 0" in text and "Connection refused" in text
    assert "node-a" not in text
    assert list((tmp_path / "node-logs").glob("*/echo-0.log")), "the good node's daemon had started"
    assert_nothing_left(marker, sshd)


HANG_FLOW = '''
import asyncio, pathlib
ROLES = {"echo": {"impl": "echo", "world_size": 2}}

async def flow(ctl, config):
    await ctl.role("echo")
    pathlib.Path(config["ready"]).write_text("up")
    await asyncio.sleep(60)
'''


def start_hanging_controller(tmp_path: Path, sshd: Sshd, marker: str) -> subprocess.Popen[str]:
    """`hfrt controller --cluster` running a flow that holds its daemons until killed."""
    flow = tmp_path / "hang.py"
    flow.write_text(HANG_FLOW)
    return subprocess.Popen(
        [sys.executable, "-m", "hfrt", "controller", "--cluster", str(ssh_spec(tmp_path, sshd, marker)),
         "--flow", str(flow), "--set", f"ready={tmp_path / 'ready'}", "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default,
    )


async def wait_until_ready(proc: subprocess.Popen[str], ready: Path, marker: str) -> None:
    deadline = time.monotonic() + 30
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if not ready.exists():
        _, err = proc.communicate(timeout=10) if proc.poll() is not None else ("", "flow never got its daemons")
        pytest.fail(err)
    assert len(daemon_pids(marker)) == 2


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_ctrl_c_on_the_controller_stops_every_daemon_it_launched(
    tmp_path: Path, sshd: Sshd, marker: str, sig: signal.Signals
) -> None:
    proc = start_hanging_controller(tmp_path, sshd, marker)
    try:
        await wait_until_ready(proc, tmp_path / "ready", marker)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + sig, err  # 130 after Ctrl-C, 143 after SIGTERM (hfrt.signals)
        assert f"{sig.name}: stopping (the daemons it started are shut down)" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_nothing_left(marker, sshd)


async def test_a_killed_controller_leaves_no_daemons_behind(tmp_path: Path, sshd: Sshd, marker: str) -> None:
    proc = start_hanging_controller(tmp_path, sshd, marker)
    try:
        await wait_until_ready(proc, tmp_path / "ready", marker)
        proc.kill()  # no clean-up code runs: ssh's stdin closes and the node-side wrappers stop the daemons
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_nothing_left(marker, sshd)


# -- elastic recovery over ssh (`--set recovery=on`) -------------------------------------------


def toml_inline(value: Any) -> str:
    """A JSON-like value as a TOML inline value (the flows' role options, for a spec file)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_inline(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def recovery_spec(tmp_path: Path, sshd: Sshd, marker: str, roles: dict[str, dict[str, Any]], *, heartbeat_s: float = 1.0) -> Path:
    """One node, every role colocated on its one device, over the test sshd; `marker` in every
    daemon's environment (role options are checked strictly, so it cannot ride there)."""
    tables = "".join(
        f'[roles.{name}]\nimpl = "{r.get("impl", name)}"\nworld_size = {r.get("world_size", 1)}\n'
        f'options = {toml_inline(r.get("options", {}))}\n' for name, r in roles.items()
    )
    text = f"""
name = "{marker}"
launcher = "ssh"
env = {{ HFRT_TEST_MARK = "{marker}", PYTHONPATH = "{os.environ.get('PYTHONPATH', '')}" }}
[ssh]
user = "{sshd.user}"
port = {sshd.port}
identity = "{sshd.identity}"
strict_host_key_checking = "accept-new"
known_hosts = "{sshd.known_hosts}"
connect_timeout_s = 5
[daemons]
log_dir = "{tmp_path / 'node-logs'}"
hello_timeout_s = 60
heartbeat_s = {heartbeat_s}
[[nodes]]
name = "node-a"
host = "127.0.0.1"
devices = 1
{tables}"""
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def marked_daemons(marker: str, role: str) -> list[int]:
    """Live `hfrt daemon --role ROLE` processes with `marker` in their environment."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        is_daemon = Path(argv[0]).name.startswith("python") and "daemon" in argv and "--role" in argv
        if is_daemon and argv[argv.index("--role") + 1] == role and marker.encode() in environ and state != "Z":
            found.append(int(entry))
    return found


def kill_marked(marker: str) -> None:
    for role in ("actor", "critic", "reference", "reward"):
        for pid in marked_daemons(marker, role):
            os.kill(pid, signal.SIGKILL)


async def freeze_then_call(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
    """A flow: freeze the `reward` daemon (SIGSTOP: it stops heartbeating), call it again; the
    call is retried on a replacement started through a new ssh session."""
    reward = await ctl.role("reward")
    assert await reward.echo("before") == ["before"]
    frozen = reward.daemons[0].pid
    os.kill(frozen, signal.SIGSTOP)
    after = await reward.echo("after")
    return {"frozen": frozen, "new": reward.daemons[0].pid, "after": after, "restarts": ctl.recovery.stats.restarts}


async def test_a_frozen_daemon_is_killed_on_its_node_and_replaced_over_ssh(tmp_path: Path, sshd: Sshd, marker: str) -> None:
    roles = {"reward": {"impl": "echo"}}
    cluster = load_spec(recovery_spec(tmp_path, sshd, marker, roles, heartbeat_s=0.5))
    try:
        summary = await run_on_cluster(Flow("freeze", freeze_then_call, roles), cluster, run_dir=tmp_path / "run",
                                       config={"recovery": "on"})
    finally:
        kill_marked(marker)
    assert summary["after"] == ["after"] and summary["restarts"] == 1 and len(summary["recovery_replace_s"]) == 1
    assert summary["new"] != summary["frozen"]
    frozen_state = Path(f"/proc/{summary['frozen']}/stat")
    assert not frozen_state.exists() or frozen_state.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the frozen daemon was left on its node"
    logs = sorted((tmp_path / "run" / "logs").glob("ssh-reward-0.log"))
    assert logs, "the ssh sessions' stderr is kept"
    assert marked_daemons(marker, "reward") == []
    assert ssh_clients(sshd.port) == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ppo_over_ssh_survives_a_killed_reward_daemon(tmp_path: Path, sshd: Sshd, marker: str) -> None:
    from tests.integration.test_recovery import steps_done

    steps, run_dir = 6, tmp_path / "run"
    spec = recovery_spec(tmp_path, sshd, marker, load_flow("ppo").roles)
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
        os.kill(killed, signal.SIGKILL)
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
    assert len(json.loads(out)["recovery_replace_s"]) == 1
    assert not list(Path("/dev/shm").glob(f"hfrt-{killed}-*")), "the killed daemon's /dev/shm files were left"
    for role in ("actor", "critic", "reference", "reward"):
        assert marked_daemons(marker, role) == [], f"{role} daemons left running"
    assert ssh_clients(sshd.port) == []


class Forwarder:
    """A TCP port on 127.0.0.1 forwarding to another until `close()`: a node whose sshd goes away
    (connections already made keep working, new ones are refused)."""

    def __init__(self, target: int) -> None:
        self.target, self.port = target, 0
        self.server: asyncio.Server | None = None

    async def start(self) -> Forwarder:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        far_reader, far_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, far_writer), pipe(far_reader, writer), return_exceptions=True)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def spare_spec(tmp_path: Path, sshd: Sshd, marker: str, own_port: int) -> Path:
    text = f"""
name = "{marker}"
launcher = "ssh"
env = {{ HFRT_TEST_MARK = "{marker}", PYTHONPATH = "{os.environ.get('PYTHONPATH', '')}" }}
[ssh]
user = "{sshd.user}"
identity = "{sshd.identity}"
strict_host_key_checking = "no"
known_hosts = "{sshd.known_hosts}"
connect_timeout_s = 5
[daemons]
log_dir = "{tmp_path / 'node-logs'}"
hello_timeout_s = 60
heartbeat_s = 0.5
[[nodes]]
name = "node-a"
host = "127.0.0.1"
ssh_port = {own_port}
devices = 1
[[nodes]]
name = "node-b"
host = "127.0.0.1"
ssh_port = {sshd.port}
devices = 1
[pools.main]
nodes = ["node-a"]
[roles.reward]
impl = "echo"
pool = "main"
spares = ["node-b"]
"""
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def node_of(pid: int) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"HFRT_NODE="))


async def test_a_daemon_whose_node_cannot_start_it_again_moves_to_a_spare(tmp_path: Path, sshd: Sshd, marker: str) -> None:
    node_a = await Forwarder(sshd.port).start()

    async def flow(ctl: Any, config: dict[str, Any]) -> dict[str, Any]:
        reward = await ctl.role("reward")
        first = reward.daemons[0].pid
        where = [node_of(first)]
        node_a.close()  # node-a's sshd goes away: its running session goes on, a new one is refused
        os.kill(first, signal.SIGKILL)
        after = await reward.echo("after")
        where.append(node_of(reward.daemons[0].pid))
        return {"after": after, "where": where, "restarts": ctl.recovery.stats.restarts}

    try:
        summary = await run_on_cluster(Flow("spare", flow, {"reward": {"impl": "echo"}}), load_spec(spare_spec(tmp_path, sshd, marker, node_a.port)),
                                       run_dir=tmp_path / "run", config={"recovery": "on"})
    finally:
        node_a.close()
        kill_marked(marker)
    assert summary["after"] == ["after"] and summary["restarts"] == 1
    assert summary["where"] == ["node-a", "node-b"], "relaunched on the spare node"
    assert marked_daemons(marker, "reward") == []
    assert ssh_clients(sshd.port) == [] and ssh_clients(node_a.port) == []
