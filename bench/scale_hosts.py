"""Starting and stopping the `hfrt daemon-host` processes of the scale benchmark (bench/scale.py).

A role's ranks are spread over hosts of at most `per_host` daemons each; every host is a child
process with the cluster key in its environment, its stderr in the log folder. It knows the
`hfrt daemon-host` command line; nothing of what is measured.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from hfrt.protocols.signing import ENV_KEY


class Fleet:
    """The daemon hosts of one benchmark run, started role by role, stopped together.

    controller: its address. key: the cluster key. heartbeat_s: the daemons' interval until welcomed.
    per_host: most daemons per host process. log_dir: where each host's stderr goes.
    """

    def __init__(self, controller: str, key: bytes, *, heartbeat_s: float, per_host: int, log_dir: Path) -> None:
        if per_host < 1:
            raise ValueError(f"per_host={per_host}: a host runs at least one daemon")
        self.controller = controller
        self.key = key
        self.heartbeat_s = heartbeat_s
        self.per_host = per_host
        self.log_dir = log_dir
        self.hosts: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[Any]] = []

    def start(self, role: str, world: int, *extra: str) -> None:
        """Start hosts serving ranks 0..world-1 of `role` (extra: more `hfrt daemon-host` flags)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **{ENV_KEY: self.key.hex()})
        for first in range(0, world, self.per_host):
            count = min(self.per_host, world - first)
            log = open(self.log_dir / f"{role}-{first}.log", "ab")
            self._logs.append(log)
            self.hosts.append(subprocess.Popen(
                [sys.executable, "-m", "hfrt", "daemon-host", "--controller", self.controller, "--role", role,
                 "--count", str(count), "--first-rank", str(first), "--world-size", str(world),
                 "--heartbeat", str(self.heartbeat_s), "--exit-with-controller", "--orphan-timeout", "60", *extra],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            ))

    def failed(self) -> str | None:
        """Why a host already exited, if one did (with its log's last line), else None."""
        for host in self.hosts:
            if host.poll() is not None:
                return f"daemon host pid {host.pid} exited with code {host.returncode}"
        return None

    def wait(self, timeout_s: float) -> bool:
        """Wait until every host has exited; True if all did within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for host in self.hosts:
            try:
                host.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every host still running, then SIGKILL what is left after `timeout_s`; close the logs."""
        for host in self.hosts:
            if host.poll() is None:
                host.send_signal(signal.SIGTERM)
        if not self.wait(timeout_s):
            for host in self.hosts:
                if host.poll() is None:
                    host.kill()
                    host.wait()
        self.hosts.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
