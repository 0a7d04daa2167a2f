"""The heartbeat interval's accepted range, checked at every entry point (flags, cluster spec,
attach.json, Controller, ServeConfig), and a heartbeat thread that survives send failures."""

from __future__ import annotations

import json
import math
import socket
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import zmq

from hfrt.cli import main as cli_main
from hfrt.control.controller import Controller
from hfrt.daemon.heartbeat import SEND_HWM, HeartbeatThread
from hfrt.daemon.server import ServeConfig
from hfrt.deploy import SpecError, parse_spec
from hfrt.protocols import HEARTBEAT_MAX_S, HEARTBEAT_MIN_S, Heartbeat, Wire, check_heartbeat_s, new_key
from hfrt.session import Attach

pytestmark = pytest.mark.timeout(30)

BAD = [0, 0.0, -1.0, math.nan, math.inf, -math.inf, 1e-9, 1e9, HEARTBEAT_MIN_S / 2, HEARTBEAT_MAX_S * 2, True]


@pytest.mark.parametrize("value", BAD)
def test_out_of_range_intervals_are_refused_naming_where(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^somewhere: heartbeat interval must be a finite number of seconds"):
        check_heartbeat_s(value, "somewhere")


@pytest.mark.parametrize("value", [HEARTBEAT_MIN_S, 0.5, 2, HEARTBEAT_MAX_S])
def test_intervals_in_range_are_accepted_as_floats(value: float) -> None:
    assert check_heartbeat_s(value, "x") == value and type(check_heartbeat_s(value, "x")) is float


@pytest.mark.parametrize("command", [["controller", "--flow", "ping"], ["daemon", "--role", "echo", "--controller", "tcp://h:1"]])
@pytest.mark.parametrize("flag", ["0", "-1", "nan", "inf", "1e-9", "1e9"])
def test_command_line_refuses_a_bad_heartbeat_flag(command: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*command, "--heartbeat", flag])
    assert exit_info.value.code == 2
    assert "argument --heartbeat: heartbeat interval must be" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-2.0", "nan", "inf", "1e-9", "1e9"])
def test_cluster_spec_refuses_a_bad_heartbeat(value: str) -> None:
    text = f'[[nodes]]\nname = "localhost"\ndevices = 1\n[daemons]\nheartbeat_s = {value}\n[roles.echo]\n'
    with pytest.raises(SpecError, match=r"\[daemons\] heartbeat_s: heartbeat interval must be"):
        parse_spec(tomllib.loads(text), "test.toml")


@pytest.mark.parametrize("value", [0, -1, 1e-9, 1e9, "NaN", "Infinity"])
def test_attach_file_refuses_a_bad_heartbeat(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "attach.json"
    text = json.dumps({"address": "tcp://h:1", "key_file": "k", "roles": {"echo": 1}, "heartbeat_s": 0})
    path.write_text(text.replace('"heartbeat_s": 0', f'"heartbeat_s": {json.dumps(value) if isinstance(value, (int, float)) else value}'))
    with pytest.raises(ValueError, match=rf"attach file {path}: heartbeat_s: heartbeat interval must be"):
        Attach.read(path)


@pytest.mark.parametrize("value", [0.0, math.nan, 1e9])
def test_controller_and_daemon_config_refuse_a_bad_heartbeat(value: float) -> None:
    with pytest.raises(ValueError, match="controller heartbeat_s: heartbeat interval must be"):
        Controller("tcp://127.0.0.1:0", new_key(), heartbeat_s=value)
    with pytest.raises(ValueError, match="ServeConfig.heartbeat_s: heartbeat interval must be"):
        ServeConfig("tcp://127.0.0.1:1", heartbeat_s=value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_heartbeat_thread_survives_a_full_send_queue_and_beats_once_heard() -> None:
    """No controller listens: the queue fills (zmq.Again); the thread drops beats, lives on, and
    its beats reach a controller that starts listening later."""
    key, port = new_key(), _free_port()
    address = f"tcp://127.0.0.1:{port}"
    ctx: zmq.Context[Any] = zmq.Context()
    events: list[tuple[str, str]] = []
    thread = HeartbeatThread(ctx, "t:0", address, key, interval_s=HEARTBEAT_MIN_S, orphan_timeout_s=0,
                             notify=lambda e, d: events.append((e, d)))
    thread.start()
    router = None
    try:
        deadline = time.monotonic() + 10
        while thread.dropped < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thread.dropped >= 3 and thread.is_alive(), f"dropped {thread.dropped} beats (queue holds {SEND_HWM})"
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        assert router.poll(5000), "no beat arrived once a controller listened"
        ident, *frames = router.recv_multipart()
        assert ident == b"t:0/hb" and isinstance(Wire(key).unpack(frames), Heartbeat)
    finally:
        thread.stop()
        thread.join(5)
        if router is not None:
            router.close(0)
        ctx.term()
    assert not thread.is_alive()
