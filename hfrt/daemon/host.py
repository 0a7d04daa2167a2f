"""A daemon host: many role daemons served in one OS process, on one asyncio loop, for benchmarks
and tests of the controller at hundreds or thousands of ranks on one machine (`hfrt daemon-host`).

Every daemon is a real DaemonServer (hfrt.daemon.server), so to the controller it is what a lone
daemon process is: its own DEALER socket and ZeroMQ identity, its own hello with its endpoint
table, its own heartbeat socket and Vigil, its own tensor-plane directory entry, the real protocol
and signing. What the daemons of one host share is lent to each through `Hosting`: the process
(one pid, one interpreter, the CPU), one ZeroMQ context and its I/O thread, one heartbeat thread
(hfrt.daemon.beat_hub: every daemon's beats and silence judged on it) and one data-plane server
(its address in every daemon's directory entry; hosted daemons keep no tensors, so it serves
none). Ray's release tests measure many-actor scale the same way, many actors per process.

It knows DaemonServer, its Hosting, and the heartbeat hub; nothing of any role or of the controller.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from typing import Any

import zmq

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.beat_hub import BeatHub
from hfrt.daemon.server import EXIT_OK, DaemonServer, Hosting, ServeConfig
from hfrt.daemon.tensors.plane import DataPlaneServer, advertised_host
from hfrt.log import get_logger

#: ZeroMQ sockets one hosted daemon opens in the host's context (the context's default cap is 1,023)
SOCKETS_PER_DAEMON = 4


@dataclass(frozen=True, slots=True)
class Hosted:
    """One daemon a host runs: its class and its place (role, rank, options)."""

    daemon_cls: type[Daemon]
    context: DaemonContext


class DaemonHost:
    """Serves `daemons` (each with `config` and the cluster `key`) until every one has stopped.

    SIGTERM or SIGINT stops them all; each stops on its own as a lone daemon would (a Shutdown,
    orphaning). `run` returns 0 when all exited cleanly, else the first other exit code.
    """

    def __init__(self, daemons: list[Hosted], config: ServeConfig, key: bytes) -> None:
        if not daemons:
            raise ValueError("a daemon host needs at least one daemon")
        identities = [d.context.identity for d in daemons]
        if len(set(identities)) != len(identities):
            twice = sorted({i for i in identities if identities.count(i) > 1})
            raise ValueError(f"a daemon host runs each identity once; given twice: {', '.join(twice)}")
        self.daemons = daemons
        self.config = config
        self._key = key
        self.servers: list[DaemonServer] = []
        self._log = get_logger(part="daemon-host", pid=os.getpid())

    async def run(self) -> int:
        zctx: zmq.Context[Any] = zmq.Context()
        # each daemon: command, heartbeat and monitor sockets, and libzmq's end of the monitor
        zctx.set(zmq.MAX_SOCKETS, SOCKETS_PER_DAEMON * len(self.daemons) + 64)
        hub = BeatHub(zctx, self.config.controller, self._key, limits=self.config.limits)
        data = DataPlaneServer(f"daemon-host:{os.getpid()}", self._key, host=advertised_host(self.config.controller))
        hosting = Hosting(zctx, hub.beats, data)
        self.servers = [DaemonServer(d.daemon_cls, d.context, self.config, self._key) for d in self.daemons]
        loop = asyncio.get_running_loop()
        hub.start()
        data.start()
        try:
            runs = [loop.create_task(s.run(hosting), name=f"serve {s.context.identity}") for s in self.servers]
            await asyncio.sleep(0)  # each server's run() has begun: stop() may be called on it
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop, f"signal {signal.Signals(sig).name}")
            self._log.info("daemon_host_serving", daemons=len(self.servers), controller=self.config.controller)
            codes = await asyncio.gather(*runs)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            hub.stop()
            data.stop()
            hub.join(timeout=2.0)
            data.join(timeout=2.0)
            zctx.term()
        failed = [c for c in codes if c != EXIT_OK]
        self._log.info("daemon_host_exit", daemons=len(codes), failed=len(failed))
        return failed[0] if failed else EXIT_OK

    def stop(self, reason: str) -> None:
        """Ask every daemon to wind down (as SIGTERM asks a lone daemon)."""
        for server in self.servers:
            server.stop(reason)
