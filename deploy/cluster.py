"""Bringing a spec's daemons up against a controller: pick the launcher, bind an address the nodes
can reach, start, wait until every daemon has said hello, and stop (or detach) afterwards.

It knows specs, launchers and the Controller's registry; it knows nothing of flows. A failure at
any point (launcher error, a daemon that dies before hello, hello timeout) stops everything that
was started and raises LaunchError naming the role, rank and node.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from pathlib import Path

from hfrt.control.controller import Controller
from hfrt.deploy.launchers.base import Launcher, LaunchError, OnExit
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.deploy.placement import Placed, place
from hfrt.deploy.spec import LOCAL_HOSTS, ClusterSpec
from hfrt.log import get_logger
from hfrt.wire.errors import DaemonGone, ProtocolMismatch


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


class ClusterSession:
    """A controller plus the spec's daemons, up and welcomed. Use as an async context manager:

        async with ClusterSession(cluster, run_dir=..., key=..., key_file=...) as session:
            await flow.run(session.controller, config)

    On exit the daemons are told to shut down and the launcher stops them, unless `detach` was
    called. `bind` and `address` are what the controller bound and what daemons dial. `on_exit`
    hears of a daemon's process ending (default: the controller's mark_gone; hfrt.control.recovery sets
    its own before entering).
    """

    def __init__(
        self, cluster: ClusterSpec, *, run_dir: Path, key: bytes, key_file: Path, orphan_timeout_s: float | None = None
    ) -> None:
        self.cluster = cluster
        self.run_dir = run_dir
        self.key = key
        self.key_file = key_file
        self.launch_id = new_launch_id(cluster)
        self.placed = place(cluster)
        self.controller = Controller(
            f"tcp://{bind_host(cluster)}:{cluster.controller.port}", key, heartbeat_s=cluster.daemons.heartbeat_s
        )
        self.launcher = launcher_for(
            cluster, self.placed, run_dir=run_dir, launch_id=self.launch_id, key_file=key_file,
            orphan_timeout_s=orphan_timeout_s,
        )
        self.bind = ""
        self.address = ""
        self.detached = False
        self.on_exit: OnExit = self.controller.mark_gone
        self._log = get_logger(part="cluster", spec=cluster.name)

    async def __aenter__(self) -> ClusterSession:
        await self.controller.start()
        self.bind = self.controller.address
        self.address = advertised(self.bind, advertise_host(self.cluster))
        try:
            specs = [p.spec for p in self.placed]
            await self.launcher.start(specs, controller=self.address, key=self.key, on_exit=self.on_exit)
            await self.rendezvous()
        except BaseException:
            await self._teardown()
            raise
        self._log.info("cluster_up", daemons=len(self.placed), address=self.address, launch_id=self.launch_id)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.detached:
            await self._teardown()
        else:
            await self.controller.close()

    async def _teardown(self) -> None:
        try:
            await self.controller.shutdown_daemons(wait_s=5.0)
            await self.launcher.stop(timeout_s=10.0)
        finally:
            await self.controller.close()

    async def detach(self) -> list[list[str]]:
        """Leave the daemons running for a later controller; returns the launcher's cleanup commands."""
        self.detached = True
        return await self.launcher.detach()

    async def rendezvous(self) -> None:
        """Wait until every placed daemon has said hello; LaunchError naming the node otherwise."""
        timeout = self.cluster.daemons.hello_timeout_s
        roles = list(dict.fromkeys(p.spec.role for p in self.placed))
        waits = [asyncio.ensure_future(self.controller.role(r, timeout_s=timeout)) for r in roles]
        try:
            await asyncio.gather(*waits)
        except (DaemonGone, ProtocolMismatch) as exc:
            raise LaunchError(f"launch failed: {exc}") from None
        except TimeoutError:
            raise LaunchError(self._missing(timeout)) from None
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    def _missing(self, timeout: float) -> str:
        up = {d.identity for d in self.controller.daemons() if d.alive}
        missing = [p.where() for p in self.placed if p.identity not in up]
        return (
            f"launch failed: {len(missing)} daemon(s) did not say hello within {timeout:.0f}s: "
            + "; ".join(missing) + f". Can the nodes reach the controller at {self.address}? "
            f"Set [controller] host in {self.cluster.source} to an address they can reach."
        )
