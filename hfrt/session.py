"""The one composition root: a Session wires a Controller (with its recovery layer), the daemons a
launcher starts for it — locally or from a cluster spec — or daemons already running (attach), a
flow, the run folder's trace, and how it all ends (stop the daemons, or leave them for a later
controller). `hfrt controller`, `hfrt launch`, `hfrt serve-openai` and the benchmarks all run
through it. It knows nothing of what the flow computes, and reaches deploy only through its face
(`hfrt.deploy`: specs, placement, the launcher interface). The attach file it writes/reads is JSON:
{"address": "tcp://host:port", "key_file": "...", "roles": {"role": world_size}, "heartbeat_s": s,
 "bind": "tcp://0.0.0.0:port", "cleanup": [["scancel", "123"]], "settings": {"role": {...}}} — bind
(what a controller listens on, default: address), cleanup (commands `hfrt stop` runs after the
daemons exit) and settings (each role's impl / world_size / dp_size / options the daemons were
started with, so `--attach` can tell a setting they already have from one they lack) are optional.
One process at a time writes a run folder: `hfrt controller` and `hfrt launch` hold RunDirLock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfrt.control.controller import Controller
from hfrt.control.recovery import Recovery, RecoveryPolicy
from hfrt.control.trace import CallTrace
from hfrt.deploy import (
    ClusterSpec,
    DaemonSpec,
    Launcher,
    LaunchError,
    LocalLauncher,
    cluster,
    expand,
    place,
    run_command,
)
from hfrt.flows import Flow
from hfrt.flows.config import CALL_TIMEOUT_S, FlowConfig
from hfrt.log import get_logger
from hfrt.protocols import check_heartbeat_s, load_key, new_key, write_key_file
from hfrt.wire.errors import DaemonGone, ProtocolMismatch


@dataclass(frozen=True)
class Attach:
    """How to reach daemons that are already running."""

    address: str
    key_file: str
    roles: dict[str, int]
    heartbeat_s: float = 2.0
    bind: str = ""
    cleanup: list[list[str]] = field(default_factory=list)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path) -> Attach:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
            return cls(
                str(data["address"]), str(data["key_file"]), dict(data["roles"]), check_heartbeat_s(data.get("heartbeat_s", 2.0), "heartbeat_s"),
                str(data.get("bind", "")), [[str(a) for a in c] for c in data.get("cleanup", [])],
                {str(k): dict(v) for k, v in data.get("settings", {}).items()},
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"attach file {p}: {exc}") from None

    @property
    def bind_address(self) -> str:
        """What a controller attaching to these daemons listens on."""
        return self.bind or self.address

    def write(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.__dict__, indent=2) + "\n")
        return p


class RunDirBusy(ValueError):
    """Another live process holds the run folder's lock (`pid`: the holder's, as it wrote it)."""

    def __init__(self, lock: Path, pid: str) -> None:
        super().__init__(f"run folder {lock.parent} is in use by another hfrt process (pid {pid}, holding {lock}); "
                         "wait for it to end or use another folder")
        self.lock, self.pid = lock, pid


class RunDirLock:
    """An exclusive lock on a run folder (flock on RUN_DIR/.lock, which holds the holder's pid),
    held for the life of a run so two processes never write one folder at once. The OS drops
    it when the holder exits, however it exits (kill -9 included): no stale lock survives."""

    FILE = ".lock"

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / self.FILE
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock (creating the folder) or raise RunDirBusy naming the holder's pid."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(self.path, holder) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def free_tcp_address(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def specs_for(roles: dict[str, dict[str, Any]]) -> list[DaemonSpec]:
    """Local daemon specs; a role with world_size > 1 gets options.dist_master (a free loopback
    port where its ranks form their own torch.distributed group) unless its settings give one."""
    specs: list[DaemonSpec] = []
    for role, settings in roles.items():
        world_size = int(settings.get("world_size", 1))
        options = dict(settings.get("options", {}))
        if world_size > 1 and not options.get("dist_master"):
            options["dist_master"] = free_tcp_address().removeprefix("tcp://")
        specs += expand(
            role, world_size, str(settings.get("impl", role)),
            dp_size=int(settings.get("dp_size", -1)), options=options,
        )
    return specs


def with_run_dir(config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The flow's config with `run_dir` (where the run writes: metrics, logs) set to the run's folder."""
    return {**config, "run_dir": str(run_dir)}


def start_trace(ctl: Controller, config: dict[str, Any], run_dir: Path) -> CallTrace | None:
    """Stream every call of the run to RUN_DIR/trace.json as it finishes (so the controller's
    memory stays flat, and a killed run still leaves a loadable trace), unless the flow's config
    says `trace = false`. A file that cannot be opened is logged and the run goes on untraced."""
    if not config.get("trace", True):
        return None
    try:
        return ctl.record_calls(path=run_dir / "trace.json")
    except OSError as exc:
        get_logger(part="run").warning("trace_not_written", path=str(run_dir / "trace.json"), error=str(exc))
        return None


def save_trace(trace: CallTrace | None, run_dir: Path) -> dict[str, str]:
    """Finish RUN_DIR/trace.json (also after a failed flow: that is when it helps most); a write
    that fails is logged (by the trace), never raised over the flow's own outcome."""
    path = trace.close() if trace is not None else None
    return {"trace": str(path)} if path is not None else {}


#: The default: daemons that die stay dead (`--set recovery=on` relaunches them).
RECOVERY_OFF = RecoveryPolicy()


class Session:
    """A controller and its daemons for one run; use as an async context manager:

        async with Session.local(roles, run_dir=run_dir, policy=policy) as session:
            summary = await session.run(flow, config)

    Entering binds the controller, starts the daemons (a launcher's), and — for a cluster —
    waits until every one has said hello (LaunchError naming the node otherwise). Leaving shuts
    the daemons down and stops the launcher, or, with `keep_daemons`, leaves them running and
    writes RUN_DIR/attach.json for a later `--attach`. Build one with `local`, `on_cluster` or
    `attached`.
    """

    def __init__(
        self, *, run_dir: Path, key: bytes, bind: str, heartbeat_s: float, specs: list[DaemonSpec],
        launcher: Launcher | None = None, key_file: Path | None = None, policy: RecoveryPolicy = RECOVERY_OFF,
        advertise: Callable[[str], str] = lambda bound: bound, hello_timeout_s: float | None = None,
        keep_daemons: bool = False, settings: dict[str, dict[str, Any]] | None = None,
        missing: Callable[[set[str], float, str], str] | None = None,
    ) -> None:
        if not keep_daemons:  # a run's daemons end with its controller, even a killed one (hfrt.daemon.heartbeat)
            specs = [dataclasses.replace(s, exit_with_controller=True) for s in specs]
        self.run_dir, self.key, self.key_file, self.specs, self.launcher = run_dir, key, key_file, specs, launcher
        self.heartbeat_s, self.hello_timeout_s, self.keep_daemons = heartbeat_s, hello_timeout_s, keep_daemons
        self.settings = settings or {}
        self._advertise, self._missing = advertise, missing
        # a launcher that started the daemons relaunches them (`attached` refuses recovery)
        self.recovery = Recovery(launcher, policy) if policy.enabled and launcher is not None else None  # type: ignore[arg-type]
        # the flows' calls give no timeout: the controller's default is theirs
        self.controller = Controller(bind, key, heartbeat_s=heartbeat_s, recovery=self.recovery, default_timeout_s=CALL_TIMEOUT_S)
        self.address = ""  # what daemons dial (the bound address, as they can reach it)
        self.attach_file: Path | None = None
        self._log = get_logger(part="run")

    # -- the three ways to get daemons ---------------------------------------------------------

    @classmethod
    def local(
        cls, roles: dict[str, dict[str, Any]], *, run_dir: Path, policy: RecoveryPolicy = RECOVERY_OFF,
        keep_daemons: bool = False, heartbeat_s: float = 2.0, orphan_timeout_s: float = 30.0,
    ) -> Session:
        """Daemons for `roles` as subprocesses of this machine (a fixed port when they are kept)."""
        key = new_key()
        key_file = write_key_file(_made(run_dir) / "cluster.key", key)
        launcher = LocalLauncher(
            heartbeat_s=heartbeat_s, log_dir=run_dir / "logs",
            orphan_timeout_s=max(orphan_timeout_s, 600.0) if keep_daemons else orphan_timeout_s,
        )
        return cls(
            run_dir=run_dir, key=key, key_file=key_file, bind=free_tcp_address() if keep_daemons else "tcp://127.0.0.1:0",
            heartbeat_s=heartbeat_s, specs=specs_for(roles), launcher=launcher, policy=policy,
            keep_daemons=keep_daemons, settings=roles,
        )

    @classmethod
    def on_cluster(
        cls, spec: ClusterSpec, *, run_dir: Path, policy: RecoveryPolicy = RECOVERY_OFF,
        keep_daemons: bool = False, orphan_timeout_s: float | None = None,
    ) -> Session:
        """The spec's daemons, placed on its nodes by its launcher (local, ssh or slurm)."""
        key = new_key()
        key_file = write_key_file(_made(run_dir) / "cluster.key", key)
        placed = place(spec)
        if not keep_daemons:  # the launchers start what they placed: mark it there (see __init__)
            placed = [dataclasses.replace(p, spec=dataclasses.replace(p.spec, exit_with_controller=True)) for p in placed]
        launch_id = cluster.new_launch_id(spec)
        launcher = cluster.launcher_for(spec, placed, run_dir=run_dir, launch_id=launch_id, key_file=key_file,
                                        orphan_timeout_s=orphan_timeout_s)
        host = cluster.advertise_host(spec)
        settings = {name: {"impl": r.impl, "world_size": r.world_size, "dp_size": r.dp_size, "options": r.options}
                    for name, r in spec.roles.items()}
        where = {p.identity: p.where() for p in placed}
        return cls(
            run_dir=run_dir, key=key, key_file=key_file, bind=f"tcp://{cluster.bind_host(spec)}:{spec.controller.port}",
            heartbeat_s=spec.daemons.heartbeat_s, specs=[p.spec for p in placed], launcher=launcher, policy=policy,
            advertise=lambda bound: cluster.advertised(bound, host), hello_timeout_s=spec.daemons.hello_timeout_s,
            keep_daemons=keep_daemons, settings=settings,
            missing=lambda up, timeout, address: cluster.missing_message(spec, where, up, timeout, address),
        )

    @classmethod
    def attached(cls, attach: Attach, *, run_dir: Path, policy: RecoveryPolicy = RECOVERY_OFF) -> Session:
        """Daemons already running (an attach file): nothing is started, and they are left running."""
        if policy.enabled:
            raise ValueError("config recovery=on: only daemons this controller starts can be relaunched, not --attach ones")
        session = cls(run_dir=run_dir, key=load_key(attach.key_file), bind=attach.bind_address,
                      heartbeat_s=attach.heartbeat_s, specs=[], policy=policy, keep_daemons=True)
        session.controller.launched_roles = frozenset(attach.roles)  # what the attach file says is running
        _made(run_dir)
        return session

    # -- life cycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Session:
        await self.controller.start()
        self.address = self._advertise(self.controller.address)
        if self.launcher is None:
            return self
        self.controller.launched_roles = frozenset(s.role for s in self.specs)
        try:
            on_exit = self.recovery.on_exit if self.recovery is not None else self.controller.mark_gone
            await self.launcher.start(self.specs, controller=self.address, key=self.key, on_exit=on_exit)
            if self.hello_timeout_s is not None:
                await self.rendezvous(self.hello_timeout_s)
        except BaseException:
            await self._teardown()
            raise
        self._log.info("daemons_started", daemons=len(self.specs), address=self.address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.launcher is None:
            await self.controller.close()
        elif self.keep_daemons:
            try:
                self.attach_file = await self._detach()
            finally:
                await self.controller.close()
        else:
            await self._teardown()

    async def run(self, flow: Flow, config: dict[str, Any]) -> dict[str, Any]:
        """Run `flow` once on this session's daemons and return its summary, plus where the trace
        went and (recovery on) each replacement's time; an attach file is added on leaving."""
        trace = start_trace(self.controller, config, self.run_dir)
        written: dict[str, Any] = {}
        try:
            summary = dict(await flow.run(self.controller, with_run_dir(config, self.run_dir)) or {})
        finally:
            written |= save_trace(trace, self.run_dir)
            if self.recovery is not None:
                await self.recovery.close()
                written |= {"recovery_replace_s": [round(s, 2) for s in self.recovery.stats.replace_s]}
        return summary | written

    async def rendezvous(self, timeout: float) -> None:
        """Wait until every started daemon has said hello; LaunchError naming the missing ones."""
        roles = list(dict.fromkeys(s.role for s in self.specs))
        waits = [asyncio.ensure_future(self.controller.role(r, timeout_s=timeout)) for r in roles]
        try:
            await asyncio.gather(*waits)
        except (DaemonGone, ProtocolMismatch) as exc:
            raise LaunchError(f"launch failed: {exc}") from None
        except TimeoutError:
            up = {d.identity for d in self.controller.daemons() if d.alive}
            if self._missing is None:
                raise
            raise LaunchError(self._missing(up, timeout, self.address)) from None
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _teardown(self) -> None:
        try:
            await self.controller.shutdown_daemons(wait_s=5.0)
            if self.launcher is not None:
                await self.launcher.stop(timeout_s=10.0)
        finally:
            await self.controller.close()

    async def _detach(self) -> Path:
        assert self.launcher is not None and self.key_file is not None
        cleanup = await self.launcher.detach()
        counts = {name: int(s.get("world_size", 1)) for name, s in self.settings.items()}
        bind = self.controller.address if self.address != self.controller.address else ""
        attach = Attach(self.address, str(self.key_file), counts, self.heartbeat_s, bind, cleanup, self.settings)
        path = attach.write(self.run_dir / "attach.json")
        self._log.info("daemons_kept", attach=str(path))
        return path


def _made(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


# -- what the CLI and benchmarks call ---------------------------------------------------------


async def run_flow(
    flow: Flow, *, run_dir: Path, config: dict[str, Any], roles: dict[str, dict[str, Any]] | None = None,
    attach: Attach | None = None, keep_daemons: bool = False, heartbeat_s: float = 2.0, orphan_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Run `flow` once on local daemons (or attached ones) and return its summary."""
    policy = recovery_policy(flow, with_run_dir(config, run_dir))
    if attach is not None:
        session = Session.attached(attach, run_dir=run_dir, policy=policy)
    else:
        session = Session.local(roles or flow.roles, run_dir=run_dir, policy=policy, keep_daemons=keep_daemons,
                                heartbeat_s=heartbeat_s, orphan_timeout_s=orphan_timeout_s)
    return await _run(session, flow, config)


async def run_on_cluster(
    flow: Flow, spec: ClusterSpec, *, run_dir: Path, config: dict[str, Any], keep_daemons: bool = False
) -> dict[str, Any]:
    """Launch the spec's daemons, run `flow` once, then stop them (or keep them: see launch_cluster)."""
    if flow.roles:
        spec.check_roles(flow.roles_for(config), f"flow {flow.name!r}")
    policy = recovery_policy(flow, with_run_dir(config, run_dir))
    orphan = max(spec.daemons.orphan_timeout_s, 600.0) if keep_daemons else None
    return await _run(Session.on_cluster(spec, run_dir=run_dir, policy=policy, keep_daemons=keep_daemons,
                                         orphan_timeout_s=orphan), flow, config)


def recovery_policy(flow: Flow, config: dict[str, Any]) -> RecoveryPolicy:
    """The run's recovery settings: from the flow's config as the flow reads it (`config` is the
    dict the flow runs with, run_dir included, so `hfrt controller`'s check before launch, this
    and Flow.run read it once: see hfrt.flows.Flow), or from the plain dict for a flow without a
    FlowConfig."""
    typed = flow.read(config) if flow.config_cls is not None else None
    return typed.recovery_policy() if isinstance(typed, FlowConfig) else RecoveryPolicy.from_config(config)


async def _run(session: Session, flow: Flow, config: dict[str, Any]) -> dict[str, Any]:
    async with session:
        summary = await session.run(flow, config)
    if session.attach_file is not None:
        summary["attach"] = str(session.attach_file)
    return summary


async def launch_cluster(spec: ClusterSpec, *, run_dir: Path, orphan_timeout_s: float = 600.0) -> Path:
    """Start the spec's daemons, wait until all said hello, leave them running; returns attach.json."""
    session = Session.on_cluster(spec, run_dir=run_dir, keep_daemons=True, orphan_timeout_s=orphan_timeout_s)
    async with session:
        pass
    assert session.attach_file is not None
    return session.attach_file


async def stop_daemons(attach: Attach, wait_s: float = 10.0) -> list[str]:
    """Bind the attach address, wait for the daemons to check in, and shut them down."""
    try:
        async with Controller(attach.bind_address, load_key(attach.key_file), heartbeat_s=attach.heartbeat_s) as ctl:
            stopped = []
            for role in attach.roles:
                group = await ctl.role(role, timeout_s=wait_s)
                stopped += [d.identity for d in group.daemons]
            await ctl.shutdown_daemons("hfrt stop", wait_s=wait_s)
    finally:
        await run_cleanup(attach.cleanup)
    return stopped


async def run_cleanup(commands: list[list[str]]) -> None:
    """Run an attach file's cleanup commands (e.g. scancel of an allocation the launcher made)."""
    log = get_logger(part="stop")
    for argv in commands:
        code, _, err = await run_command(argv)
        if code != 0:
            log.warning("cleanup_failed", command=argv, error=err.strip())
