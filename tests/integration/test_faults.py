"""Faults with real processes: kill -9, frozen heartbeats, SIGTERM, garbage and forged frames,
protocol version mismatch, orphaned daemons, and daemons that fail at start-up."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from hfrt import DaemonGone, ProtocolMismatch
from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.protocols import PROTOCOL_VERSION, Call, Heartbeat, Hello, Reply, Shutdown, Welcome, Wire, new_key
from tests.support import STARTED_PIDS, echo_specs, local_cluster, pid_alive, wait_for

pytestmark = pytest.mark.timeout(90)


async def test_kill_9_fails_pending_calls_fast_naming_the_daemon() -> None:
    async with local_cluster(echo_specs(2), heartbeat_s=0.5) as (ctl, launcher):
        echo = await ctl.role("echo")
        pending = echo.sleep.call_one(1, 30.0)
        await asyncio.sleep(0.2)
        pid = launcher.processes["echo:1"].pid
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(DaemonGone, match=rf"echo\[1\] \(.* pid {pid}\) is gone .*SIGKILL.*sleep did not finish"):
            await pending
        assert time.monotonic() - start < 1.0  # 2 × heartbeat
        with pytest.raises(DaemonGone, match="cannot call ping"):
            await echo.ping.call_one(1)
        assert await echo.ping.call_one(0) == "pong"


async def test_silent_daemon_is_declared_dead_within_two_heartbeats() -> None:
    """SIGSTOP keeps the process alive but silent: only missed heartbeats can reveal it."""
    async with local_cluster(echo_specs(1), heartbeat_s=0.5) as (ctl, launcher):
        echo = await ctl.role("echo")
        pending = echo.sleep.call_one(0, 30.0)
        await asyncio.sleep(0.2)
        pid = launcher.processes["echo:0"].pid
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            with pytest.raises(DaemonGone, match=r"no heartbeat for"):
                await pending
            assert time.monotonic() - start < 2 * 0.5 + 0.1
        finally:
            os.kill(pid, signal.SIGKILL)


async def test_sigterm_stops_a_daemon_gracefully() -> None:
    async with local_cluster(echo_specs(1)) as (ctl, launcher):
        echo = await ctl.role("echo")
        pending = echo.sleep.call_one(0, 30.0)
        await asyncio.sleep(0.2)
        proc = launcher.processes["echo:0"]
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(DaemonGone, match="exited: signal SIGTERM"):
            await asyncio.wait_for(pending, 10)
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_shutdown_command_stops_every_daemon() -> None:
    async with local_cluster(echo_specs(2)) as (ctl, launcher):
        await ctl.role("echo")
        await ctl.shutdown_daemons("test over")
        codes = [await asyncio.wait_for(p.wait(), 10) for p in launcher.processes.values()]
        assert codes == [0, 0]
        assert all(not d.alive and "shutdown: test over" in d.gone_reason for d in ctl.daemons())


async def test_garbage_sent_to_the_controller_is_dropped_and_it_keeps_serving() -> None:
    async with local_cluster(echo_specs(1)) as (ctl, _):
        echo = await ctl.role("echo")
        ctx = zmq.Context()
        stranger = ctx.socket(zmq.DEALER)
        stranger.connect(ctl.address)
        forged = Wire(new_key()).pack(Call(1, "ping", [], {}, True))
        for frames in ([b"garbage"], [b"", b"", b""], forged, [b"\x00" * 32 + b"\xc1"], [os.urandom(5000)]):
            stranger.send_multipart(frames)
        assert await wait_for(lambda: ctl.stats()["dropped_frames"] >= 5, 5)
        stranger.close(0)
        ctx.term()
        assert await echo.ping.call_one(0) == "pong"


class FakeController:
    """A bare ROUTER speaking the protocol by hand, to send a real daemon anything at all."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.wire = Wire(key)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pending: list[tuple[bytes, list[bytes]]] = []

    def start_daemon(self, *extra: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, HFRT_KEY=self.key.hex())
        proc = subprocess.Popen(
            [sys.executable, "-m", "hfrt", "daemon", "--role", "echo", "--impl", "echo", "--controller", self.address,
             "--log-level", "warning", *extra],
            env=env,
        )
        STARTED_PIDS.add(proc.pid)
        return proc

    def recv(self, timeout_s: float = 10.0) -> tuple[bytes, Any]:
        """Next message from any peer, answering heartbeats along the way."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.pending:
                if not self.sock.poll(100):
                    continue
                ident, *frames = self.sock.recv_multipart()
                batch = frames[1:] if frames[0] == b"" else [frames]  # [b"", m1, m2, ...] is a batch
                self.pending.extend((ident, [m] if isinstance(m, bytes) else m) for m in batch)
            ident, frames = self.pending.pop(0)
            msg = self.wire.unpack(frames)
            if isinstance(msg, Heartbeat):
                self.sock.send_multipart([ident, *self.wire.pack(Heartbeat("fake", msg.seq, 0.0))])
                continue
            return ident, msg
        raise TimeoutError("no message from the daemon")

    def send(self, ident: bytes, frames: list[bytes]) -> None:
        self.sock.send_multipart([ident, *frames])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def fake() -> Any:
    controller = FakeController(new_key())
    yield controller
    controller.close()


def test_garbage_and_forged_frames_to_a_daemon_leave_it_serving(fake: FakeController) -> None:
    proc = fake.start_daemon()
    try:
        ident, hello = fake.recv()
        assert isinstance(hello, Hello) and hello.role == "echo"
        fake.send(ident, fake.wire.pack(Welcome(PROTOCOL_VERSION, "fake", 1.0)))
        body = msgpack.packb([3, 1, "ping"])  # signed, but a Call with missing fields
        garbage = [
            [b"garbage"],
            [b""],
            [os.urandom(64), os.urandom(64)],
            Wire(new_key()).pack(Call(2, "ping", [], {}, True)),  # forged: wrong key
            [fake.wire.signer.sign([b"\xc1"]) + b"\xc1"],  # signed, not msgpack
            [fake.wire.signer.sign([body]) + body],
            [b"x" * (65 * 2**20)],  # larger than max_frame_bytes
        ]
        for frames in garbage:
            fake.send(ident, frames)
        fake.send(ident, fake.wire.pack(Call(99, "ping", [], {}, True)))
        replies = []
        while not any(isinstance(m, Reply) for m in replies):
            msg = fake.recv()[1]
            if not isinstance(msg, Hello):  # a repeated hello (heartbeat echo before Welcome) is fine
                replies.append(msg)
        assert Reply(99, "pong", replies[-1].elapsed_s) == replies[-1]
        problems = [m.type for m in replies[:-1]]
        assert problems == ["Undecodable", "UnknownKind"]  # signed junk is reported; forged junk is not
        assert proc.poll() is None
        fake.send(ident, fake.wire.pack(Shutdown("done", 1.0)))
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_daemon_exits_when_the_controller_speaks_another_protocol_version(fake: FakeController) -> None:
    proc = fake.start_daemon()
    try:
        ident, _ = fake.recv()
        fake.send(ident, fake.wire.pack(Welcome(PROTOCOL_VERSION + 1, "fake", 1.0)))
        assert proc.wait(10) == 2
        _, bye = fake.recv()
        while isinstance(bye, Hello):  # a repeated hello may come first
            _, bye = fake.recv()
        assert "controller speaks protocol" in bye.reason and bye.exit_code == 2
    finally:
        proc.kill()
        proc.wait()


async def test_controller_refuses_a_daemon_of_another_protocol_version() -> None:
    async with local_cluster([]) as (ctl, _):
        ctx = zmq.Context()  # signed with the cluster's own key (ctl._wire), but another version
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, b"old:0")
        sock.connect(ctl.address)
        hello = Hello(PROTOCOL_VERSION + 7, "old", 0, 1, 0, 1, 1, "h", "echo", {}, {})
        sock.send_multipart(ctl._wire.pack(hello))
        with pytest.raises(ProtocolMismatch, match=f"daemon speaks protocol {PROTOCOL_VERSION + 7}"):
            await ctl.role("old", timeout_s=5)
        assert await asyncio.get_running_loop().run_in_executor(None, sock.poll, 5000)
        reply = ctl._wire.unpack(sock.recv_multipart())
        assert reply.type == "ProtocolMismatch"
        sock.close(0)
        ctx.term()


async def test_daemon_that_fails_at_startup_is_reported_by_role() -> None:
    specs = [DaemonSpec("ghost", 0, 1, impl="no.such.module:Daemon")]
    async with local_cluster(specs) as (ctl, _):
        with pytest.raises(DaemonGone, match="ghost:0 exited before saying hello: process .* exited with code 2"):
            await ctl.role("ghost", timeout_s=30)


async def test_daemon_whose_setup_raises_says_why(tmp_path: Path) -> None:
    module = tmp_path / "broken_role.py"
    module.write_text(textwrap.dedent('''
        from hfrt import Daemon
        class Broken(Daemon):
            async def setup(self):
                raise RuntimeError("model directory /nope is missing")
    '''))
    specs = [DaemonSpec("broken", 0, 1, impl=f"{module}:Broken")]
    async with local_cluster(specs) as (ctl, _):
        with pytest.raises(DaemonGone, match="setup failed: RuntimeError: model directory /nope is missing"):
            await ctl.role("broken", timeout_s=30)


FLOW_THAT_HANGS = """
import asyncio, json, os, sys
ROLES = {"echo": {"impl": "echo", "world_size": 2}}
async def flow(ctl, config):
    echo = await ctl.role("echo")
    pids = [d["pid"] for d in await echo.describe.call()]
    with open(config["pid_file"], "w") as f:
        json.dump(pids, f)
    await asyncio.sleep(3600)
"""


@pytest.mark.slow
def test_daemons_exit_on_their_own_when_the_controller_is_killed(tmp_path: Path) -> None:
    import json

    flow = tmp_path / "hang.py"
    flow.write_text(FLOW_THAT_HANGS)
    pid_file = tmp_path / "pids.json"
    controller = subprocess.Popen(
        [sys.executable, "-m", "hfrt", "controller", "--flow", str(flow), "--run-dir", str(tmp_path / "run"),
         "--set", f"pid_file={pid_file}", "--orphan-timeout", "2", "--heartbeat", "0.5"],
    )
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert time.monotonic() < deadline and controller.poll() is None, "controller never started its daemons"
            time.sleep(0.1)
        time.sleep(0.2)
        pids = json.loads(pid_file.read_text())
        STARTED_PIDS.update(pids)
        controller.kill()
        controller.wait()
        start = time.monotonic()
        while any(pid_alive(p) for p in pids) and time.monotonic() - start < 20:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in pids), "daemons outlived their controller"
        assert time.monotonic() - start < 10
    finally:
        controller.kill()


def start_hanging_controller(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], list[int]]:
    """`hfrt controller` running FLOW_THAT_HANGS on two echo daemons, and the daemons' pids."""
    import json

    tmp_path.mkdir(parents=True, exist_ok=True)
    flow = tmp_path / "hang.py"
    flow.write_text(FLOW_THAT_HANGS)
    pid_file = tmp_path / "pids.json"
    controller = subprocess.Popen(
        [sys.executable, "-m", "hfrt", "controller", "--flow", str(flow), "--run-dir", str(tmp_path / "run"),
         "--set", f"pid_file={pid_file}", *extra],
    )
    deadline = time.monotonic() + 60
    while not pid_file.exists():
        assert time.monotonic() < deadline and controller.poll() is None, "controller never started its daemons"
        time.sleep(0.1)
    time.sleep(0.2)
    pids = json.loads(pid_file.read_text())
    STARTED_PIDS.update(pids)
    return controller, pids


@pytest.mark.slow
def test_a_killed_controllers_daemons_exit_within_two_heartbeats_not_the_orphan_timeout(tmp_path: Path) -> None:
    heartbeat_s = 1.0
    controller, pids = start_hanging_controller(tmp_path, "--heartbeat", str(heartbeat_s))  # orphan timeout: 30 s
    try:
        controller.kill()
        controller.wait()
        start = time.monotonic()
        while any(pid_alive(p) for p in pids) and time.monotonic() - start < 20:
            time.sleep(0.02)
        took = time.monotonic() - start
    finally:
        controller.kill()
    print(f"daemons exited {took:.2f}s after kill -9 of their controller (heartbeat {heartbeat_s}s)")
    assert not any(pid_alive(p) for p in pids), "daemons outlived their controller"
    assert took < 2 * heartbeat_s + 1.0, f"{took:.2f}s: not within two heartbeats"


@pytest.mark.slow
def test_a_stopped_controller_keeps_its_daemons_and_kept_daemons_outlive_a_killed_one(tmp_path: Path) -> None:
    # a frozen (busy) controller still holds its connections: its daemons wait for it
    controller, pids = start_hanging_controller(tmp_path / "a", "--heartbeat", "0.5")
    try:
        controller.send_signal(signal.SIGSTOP)
        time.sleep(2.5)  # 5 heartbeats
        assert all(pid_alive(p) for p in pids), "daemons left a controller that was only stopped"
        controller.send_signal(signal.SIGCONT)
    finally:
        controller.kill()
    # daemons kept for --attach do not end with the controller (their orphan timeout applies)
    kept, kept_pids = start_hanging_controller(tmp_path / "b", "--heartbeat", "0.5", "--keep-daemons")
    try:
        kept.kill()
        kept.wait()
        time.sleep(2.5)
        assert all(pid_alive(p) for p in kept_pids), "kept daemons ended with their controller"
    finally:
        kept.kill()
        for p in kept_pids:
            os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_a_resumed_run_replaces_daemons_still_running_from_its_killed_controller(tmp_path: Path) -> None:
    import json

    # heartbeats every 20 s: the killed controller's daemons would take 40 s to notice
    first, old = start_hanging_controller(tmp_path, "--heartbeat", "20")
    first.kill()
    first.wait()
    (tmp_path / "pids.json").unlink()
    resumed = subprocess.Popen(
        [sys.executable, "-m", "hfrt", "controller", "--resume", str(tmp_path / "run"), "--flow", str(tmp_path / "hang.py"),
         "--heartbeat", "20"],
    )
    new: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pids.json").exists():
            assert time.monotonic() < deadline and resumed.poll() is None, "the resumed run never started its daemons"
            time.sleep(0.1)
        time.sleep(0.2)
        new = json.loads((tmp_path / "pids.json").read_text())
        STARTED_PIDS.update(new)
        assert not [p for p in old if pid_alive(p)], "the old run's daemons still run beside the resumed one"
        assert all(pid_alive(p) for p in new)
    finally:
        resumed.terminate()  # stops its daemons (hfrt.signals)
        resumed.wait(30)
        for p in old + new:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
