"""Running a flow: start (or attach to) daemons, run the flow's coroutine, stop what we started.

This is the composition root of `hfrt controller`: it wires a Controller, a launcher and a flow.
It knows nothing of what the flow computes. The attach file it writes/reads is JSON:
{"address": "tcp://host:port", "key_file": "...", "roles": {"role": world_size}, "heartbeat_s": s}.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfrt.deploy.base import DaemonSpec, expand
from hfrt.deploy.local import LocalLauncher
from hfrt.protocols import load_key, new_key, write_key_file

from .controller import Controller
from .flows import Flow
from .log import get_logger


@dataclass(frozen=True)
class Attach:
    """How to reach daemons that are already running."""

    address: str
    key_file: str
    roles: dict[str, int]
    heartbeat_s: float = 1.0

    @classmethod
    def read(cls, path: str | Path) -> Attach:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
            return cls(str(data["address"]), str(data["key_file"]), dict(data["roles"]), float(data.get("heartbeat_s", 1.0)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"attach file {p}: {exc}") from None

    def write(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.__dict__, indent=2) + "\n")
        return p


def free_tcp_address(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def specs_for(roles: dict[str, dict[str, Any]]) -> list[DaemonSpec]:
    specs: list[DaemonSpec] = []
    for role, settings in roles.items():
        specs += expand(
            role, int(settings.get("world_size", 1)), str(settings.get("impl", role)),
            dp_size=int(settings.get("dp_size", -1)), options=dict(settings.get("options", {})),
        )
    return specs


async def run_flow(
    flow: Flow,
    *,
    run_dir: Path,
    config: dict[str, Any],
    roles: dict[str, dict[str, Any]] | None = None,
    attach: Attach | None = None,
    keep_daemons: bool = False,
    heartbeat_s: float = 1.0,
    orphan_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Run `flow` once and return its summary (plus where things are)."""
    log = get_logger(part="run", flow=flow.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    if attach is not None:
        key, address, heartbeat_s = load_key(attach.key_file), attach.address, attach.heartbeat_s
    else:
        key = new_key()
        key_file = write_key_file(run_dir / "cluster.key", key)
        address = free_tcp_address() if keep_daemons else "tcp://127.0.0.1:0"
    async with Controller(address, key, heartbeat_s=heartbeat_s) as ctl:
        launcher = None
        if attach is None:
            launcher = LocalLauncher(
                heartbeat_s=heartbeat_s,
                orphan_timeout_s=max(orphan_timeout_s, 600.0) if keep_daemons else orphan_timeout_s,
                log_dir=run_dir / "logs",
            )
            await launcher.start(specs_for(roles or flow.roles), controller=ctl.address, key=key, on_exit=ctl.mark_gone)
        summary: dict[str, Any] = {}
        try:
            summary = dict(await flow.run(ctl, config) or {})
        finally:
            if launcher is not None and not keep_daemons:
                await ctl.shutdown_daemons()
                await launcher.stop()
        if keep_daemons and attach is None:
            counts = {name: int(s.get("world_size", 1)) for name, s in (roles or flow.roles).items()}
            path = Attach(ctl.address, str(key_file), counts, heartbeat_s).write(run_dir / "attach.json")
            summary["attach"] = str(path)
            log.info("daemons_kept", attach=str(path))
    return summary


async def stop_daemons(attach: Attach, wait_s: float = 10.0) -> list[str]:
    """Bind the attach address, wait for the daemons to check in, and shut them down."""
    async with Controller(attach.address, load_key(attach.key_file), heartbeat_s=attach.heartbeat_s) as ctl:
        stopped = []
        for role in attach.roles:
            group = await ctl.role(role, timeout_s=wait_s)
            stopped += [d.identity for d in group.daemons]
        await ctl.shutdown_daemons("hfrt stop", wait_s=wait_s)
        return stopped
