"""What every launcher takes (DaemonSpec) and offers (Launcher): start daemons, report exits, stop;
and what a launcher that can replace one daemon offers besides (Relauncher, for hfrt.control.recovery).

It knows the `hfrt daemon` command line, not how any particular launcher runs it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Called with (daemon identity, reason) when a launched daemon's process ends on its own.
OnExit = Callable[[str, str], None]
#: What Relauncher.relaunch returns when it cannot know the new process's pid (a Slurm step):
#: the controller's recovery then accepts the first hello from a pid other than the dead daemon's.
PID_UNKNOWN = 0


@dataclass(frozen=True, slots=True)
class DaemonSpec:
    """One daemon to start: its role, rank, implementation and options.

    impl: implementation name (default: the role name). dp_size: data-parallel size (-1: world).
    options: implementation settings, passed as JSON. env: extra environment for the process.
    exit_with_controller: the daemon belongs to one run and exits once its controller is dead
        (`hfrt daemon --exit-with-controller`); False for daemons kept for `--attach`.
    """

    role: str
    rank: int = 0
    world_size: int = 1
    impl: str = ""
    dp_size: int = -1
    options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    exit_with_controller: bool = False

    @property
    def identity(self) -> str:
        return f"{self.role}:{self.rank}"

    def daemon_args(self, controller: str, *, heartbeat_s: float, orphan_timeout_s: float, log_level: str) -> list[str]:
        """Arguments after `hfrt daemon`. The cluster key travels in the environment, never here."""
        args = [
            "--role", self.role, "--rank", str(self.rank), "--world-size", str(self.world_size),
            "--impl", self.impl or self.role, "--controller", controller,
            "--heartbeat", str(heartbeat_s), "--orphan-timeout", str(orphan_timeout_s),
            "--log-level", log_level,
        ]
        if self.dp_size != -1:
            args += ["--dp-size", str(self.dp_size)]
        if self.options:
            args += ["--options", json.dumps(self.options)]
        if self.exit_with_controller:
            args.append("--exit-with-controller")
        return args


def expand(role: str, world_size: int, impl: str = "", **kwargs: Any) -> list[DaemonSpec]:
    """One DaemonSpec per rank of a role group."""
    return [DaemonSpec(role, rank, world_size, impl, **kwargs) for rank in range(world_size)]


class LaunchError(RuntimeError):
    """Starting daemons failed; the message names the node and role, and nothing was left running."""


class Launcher(Protocol):
    async def start(self, specs: list[DaemonSpec], *, controller: str, key: bytes, on_exit: OnExit) -> None:
        """Start every daemon; on failure, stop what was started and raise naming the daemon."""

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Make sure every daemon this launcher started has exited (terminate, then kill)."""

    async def detach(self) -> list[list[str]]:
        """Leave the daemons running on their own (for `hfrt launch`) and let go of them.

        Returns commands `hfrt stop` should run once the daemons have exited (e.g. scancel of an
        allocation this launcher made); usually none.
        """


class Relauncher(Launcher, Protocol):
    """A launcher that can replace one of its daemons in place (`--set recovery=on` needs one).

    All three are: LocalLauncher (a new child process), SshLauncher (the old session's wrapper
    kills the daemon on its node, a new session opens on the same placement) and SlurmLauncher
    (the old step is cancelled, a new `srun --jobid=JOB --overlap` step starts on the same node,
    in srun and sbatch mode alike).
    """

    async def relaunch(self, identity: str) -> int:
        """Kill daemon `identity` if it still runs, frozen or not (its exit is not reported to
        on_exit), make sure its /dev/shm files go, start a fresh process from the same spec, and
        return that pid (the one its hello will carry), or 0 when the launcher cannot know it
        (PID_UNKNOWN: a Slurm step's pid is known only from its hello)."""


def placed_for(placed: dict[str, Any], spec: DaemonSpec) -> Any:
    """The placement a launcher holds for `spec`, or a LaunchError naming the daemon."""
    try:
        return placed[spec.identity]
    except KeyError:
        raise LaunchError(f"{spec.identity}: not in this launcher's placement") from None
