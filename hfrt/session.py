"""Running a flow: start (or attach to) daemons, run the flow's coroutine, stop what we started.

This is the composition root of `hfrt controller`: it wires a Controller, a launcher and a flow.
It knows nothing of what the flow computes. The attach file it writes/reads is JSON:
{"address": "tcp://host:port", "key_file": "...", "roles": {"role": world_size}, "heartbeat_s": s,
 "bind": "tcp://0.0.0.0:port", "cleanup": [["scancel", "123"]], "settings": {"role": {...}}} — bind
(what a controller listens on, default: address), cleanup (commands `hfrt stop` runs after the
daemons exit) and settings (each role's impl / world_size / dp_size / options the daemons were
started with, so `--attach` can tell a setting they already have from one they lack) are optional.
Cluster runs (`--cluster SPEC`, `hfrt launch`) go through hfrt.deploy.cluster.ClusterSession.
One process at a time writes a run folder: `hfrt controller` and `hfrt launch` hold RunDirLock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfrt.control.controller import Controller
from hfrt.control.recovery import Recovery, RecoveryPolicy
from hfrt.control.trace import CallTrace
from hfrt.deploy.launchers.base import DaemonSpec, expand
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.flows import Flow
from hfrt.log import get_logger
from hfrt.protocols import check_heartbeat_s, load_key, new_key, write_key_file

if TYPE_CHECKING:
    from hfrt.deploy.cluster import ClusterSession
    from hfrt.deploy.spec import ClusterSpec


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


async def run_flow(
    flow: Flow,
    *,
    run_dir: Path,
    config: dict[str, Any],
    roles: dict[str, dict[str, Any]] | None = None,
    attach: Attach | None = None,
    keep_daemons: bool = False,
    heartbeat_s: float = 2.0,
    orphan_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Run `flow` once and return its summary (plus where things are)."""
    log = get_logger(part="run", flow=flow.name)
    policy = RecoveryPolicy.from_config(config)
    if policy.enabled and attach is not None:
        raise ValueError("config recovery=on: only daemons this controller starts can be relaunched, not --attach ones")
    run_dir.mkdir(parents=True, exist_ok=True)
    if attach is not None:
        key, address, heartbeat_s = load_key(attach.key_file), attach.bind_address, attach.heartbeat_s
    else:
        key = new_key()
        key_file = write_key_file(run_dir / "cluster.key", key)
        address = free_tcp_address() if keep_daemons else "tcp://127.0.0.1:0"
    async with Controller(address, key, heartbeat_s=heartbeat_s) as ctl:
        launcher = recovery = None
        if attach is None:
            launcher = LocalLauncher(
                heartbeat_s=heartbeat_s,
                orphan_timeout_s=max(orphan_timeout_s, 600.0) if keep_daemons else orphan_timeout_s,
                log_dir=run_dir / "logs",
            )
            recovery = Recovery(ctl, launcher, policy) if policy.enabled else None
            on_exit = recovery.on_exit if recovery is not None else ctl.mark_gone
            await launcher.start(specs_for(roles or flow.roles), controller=ctl.address, key=key, on_exit=on_exit)
        summary: dict[str, Any] = {}
        trace = start_trace(ctl, config, run_dir)
        try:
            summary = dict(await flow.run(ctl, with_run_dir(config, run_dir)) or {})
        finally:
            summary |= save_trace(trace, run_dir)
            if recovery is not None:
                await recovery.close()
                summary |= {"recovery_replace_s": [round(s, 2) for s in recovery.stats.replace_s]}
            if launcher is not None and not keep_daemons:
                await ctl.shutdown_daemons()
                await launcher.stop()
        if keep_daemons and attach is None:
            table = roles or flow.roles
            counts = {name: int(s.get("world_size", 1)) for name, s in table.items()}
            path = Attach(ctl.address, str(key_file), counts, heartbeat_s, settings=table).write(run_dir / "attach.json")
            summary["attach"] = str(path)
            log.info("daemons_kept", attach=str(path))
    return summary


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
    from hfrt.deploy.launchers.proc import run_command

    log = get_logger(part="stop")
    for argv in commands:
        code, _, err = await run_command(argv)
        if code != 0:
            log.warning("cleanup_failed", command=argv, error=err.strip())


# -- clusters (spec files) --------------------------------------------------------------------


async def run_on_cluster(
    flow: Flow, cluster: ClusterSpec, *, run_dir: Path, config: dict[str, Any], keep_daemons: bool = False
) -> dict[str, Any]:
    """Launch the spec's daemons, run `flow` once, then stop them (or keep them: see launch_cluster)."""
    from hfrt.deploy.cluster import ClusterSession

    if flow.roles:
        cluster.check_roles(flow.roles_for(config), f"flow {flow.name!r}")
    policy = RecoveryPolicy.from_config(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    key = new_key()
    key_file = write_key_file(run_dir / "cluster.key", key)
    orphan = max(cluster.daemons.orphan_timeout_s, 600.0) if keep_daemons else None
    session = ClusterSession(cluster, run_dir=run_dir, key=key, key_file=key_file, orphan_timeout_s=orphan)
    recovery = None
    if policy.enabled:  # every launcher relaunches (local process, ssh session, slurm step)
        recovery = Recovery(session.controller, session.launcher, policy)  # type: ignore[arg-type]
        session.on_exit = recovery.on_exit
    async with session:
        trace = start_trace(session.controller, config, run_dir)
        summary: dict[str, Any] = {}
        try:
            summary = dict(await flow.run(session.controller, with_run_dir(config, run_dir)) or {})
        finally:
            written: dict[str, Any] = dict(save_trace(trace, run_dir))
            if recovery is not None:
                await recovery.close()
                written |= {"recovery_replace_s": [round(s, 2) for s in recovery.stats.replace_s]}
        summary |= written
        if keep_daemons:
            summary["attach"] = str(await _detach(session))
    return summary


async def launch_cluster(cluster: ClusterSpec, *, run_dir: Path, orphan_timeout_s: float = 600.0) -> Path:
    """Start the spec's daemons, wait until all said hello, leave them running; returns attach.json."""
    from hfrt.deploy.cluster import ClusterSession

    run_dir.mkdir(parents=True, exist_ok=True)
    key = new_key()
    key_file = write_key_file(run_dir / "cluster.key", key)
    async with ClusterSession(cluster, run_dir=run_dir, key=key, key_file=key_file, orphan_timeout_s=orphan_timeout_s) as session:
        return await _detach(session)


async def _detach(session: ClusterSession) -> Path:
    cleanup = await session.detach()
    roles = {name: role.world_size for name, role in session.cluster.roles.items()}
    settings = {
        name: {"impl": r.impl, "world_size": r.world_size, "dp_size": r.dp_size, "options": r.options}
        for name, r in session.cluster.roles.items()
    }
    attach = Attach(
        session.address, str(session.key_file), roles, session.cluster.daemons.heartbeat_s, session.bind, cleanup, settings
    )
    path = attach.write(session.run_dir / "attach.json")
    get_logger(part="run").info("daemons_detached", attach=str(path), launch_id=session.launch_id)
    return path
