"""What a cluster spec decides about starting its daemons: the launcher it asks for, the address
the controller binds and the one nodes dial, a launch id, and the message when daemons never said
hello. hfrt.session.Session runs the launch with these.

It knows specs and launchers; it knows nothing of the controller or of flows.
"""

from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path

from hfrt.deploy.launchers.base import Launcher
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.deploy.placement import Placed
from hfrt.deploy.spec import LOCAL_HOSTS, ClusterSpec


def launcher_for(
    cluster: ClusterSpec, placed: list[Placed], *, run_dir: Path, launch_id: str, key_file: Path,
    orphan_timeout_s: float | None = None,
) -> Launcher:
    """The launcher the spec asks for, set up for this placement."""
    orphan = cluster.daemons.orphan_timeout_s if orphan_timeout_s is None else orphan_timeout_s
    if cluster.launcher == "ssh":
        from hfrt.deploy.launchers.ssh import SshLauncher

        return SshLauncher(cluster, placed, log_dir=run_dir / "logs", launch_id=launch_id, orphan_timeout_s=orphan)
    if cluster.launcher == "slurm":
        from hfrt.deploy.launchers.slurm import SlurmLauncher

        return SlurmLauncher(cluster, placed, run_dir=run_dir, launch_id=launch_id, key_file=key_file, orphan_timeout_s=orphan)
    d = cluster.daemons
    return LocalLauncher(
        heartbeat_s=d.heartbeat_s, orphan_timeout_s=orphan, log_level=d.log_level, log_dir=run_dir / "logs",
        torch_threads=min(cluster.roles[r].cpus for r in cluster.roles), python=cluster.python,
    )


def advertise_host(cluster: ClusterSpec) -> str:
    """The host daemons dial: the spec's, else this machine's source address toward the first node."""
    if cluster.controller.host:
        return cluster.controller.host
    far = [n for n in cluster.nodes if n.host not in LOCAL_HOSTS]
    if not far:
        return "127.0.0.1"
    try:
        addr = socket.getaddrinfo(far[0].host, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # no packet is sent; the kernel only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return socket.getfqdn()


def bind_host(cluster: ClusterSpec) -> str:
    """The interface to listen on: the spec's, else loopback when every node is this machine."""
    if cluster.controller.bind:
        return cluster.controller.bind
    return "127.0.0.1" if all(n.host in LOCAL_HOSTS for n in cluster.nodes) else "0.0.0.0"


def advertised(bound: str, host: str) -> str:
    """tcp://0.0.0.0:PORT (what the controller bound) as tcp://HOST:PORT (what daemons dial)."""
    scheme, _, rest = bound.partition("://")
    port = rest.rsplit(":", 1)[1]
    return f"{scheme}://{host}:{port}"


def new_launch_id(cluster: ClusterSpec) -> str:
    return f"hfrt-{cluster.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def missing_message(cluster: ClusterSpec, where: dict[str, str], up: set[str], timeout: float, address: str) -> str:
    """Why a launch failed when daemons did not say hello in time: which ones, where, and what to check."""
    missing = [w for identity, w in where.items() if identity not in up]
    return (
        f"launch failed: {len(missing)} daemon(s) did not say hello within {timeout:.0f}s: "
        + "; ".join(missing) + f". Can the nodes reach the controller at {address}? "
        f"Set [controller] host in {cluster.source} to an address they can reach."
    )
