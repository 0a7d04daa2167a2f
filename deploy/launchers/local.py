"""The local launcher: one `python -m hfrt daemon` subprocess per daemon on this machine.

The cluster key goes to each child in $HFRT_KEY, never on its command line. A watcher per child
reports an unexpected exit to the controller at once (faster than missed heartbeats), and removes
the tensor files a killed child left in /dev/shm (hfrt.wire.shm). `relaunch` replaces one child by a
fresh process with the same spec (hfrt.control.recovery's Relauncher). With a log_dir, the pids it
started are listed in log_dir/daemons.pids; daemons of an earlier launcher on the same folder that
still run (a killed controller's, in the two heartbeats before they notice: hfrt.daemon.heartbeat)
are killed before new ones start, so a resumed run never runs beside them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import IO, Any

from hfrt.deploy.launchers.base import DaemonSpec, OnExit
from hfrt.deploy.launchers.proc import with_tail
from hfrt.log import get_logger
from hfrt.protocols.signing import ENV_KEY
from hfrt.wire import shm

#: where a launcher with a log_dir lists the pids it started, one a line
PIDS_FILE = "daemons.pids"


class LocalLauncher:
    """Starts daemons as child processes; `stop` leaves none behind.

    log_dir: when set, each daemon's stderr goes to log_dir/ROLE-RANK.log; else it is inherited.
    torch_threads: OMP/MKL thread count per daemon, so several daemons share few cores.
    """

    def __init__(
        self,
        *,
        heartbeat_s: float = 2.0,
        orphan_timeout_s: float = 30.0,
        log_level: str = "warning",
        log_dir: str | Path | None = None,
        torch_threads: int = 1,
        python: str = sys.executable,
    ) -> None:
        self.heartbeat_s = heartbeat_s
        self.orphan_timeout_s = orphan_timeout_s
        self.log_level = log_level
        self.log_dir = Path(log_dir) if log_dir else None
        self.torch_threads = torch_threads
        self.python = python
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self._watchers: list[asyncio.Task[None]] = []
        self._specs: dict[str, DaemonSpec] = {}
        self._retired: list[asyncio.subprocess.Process] = []  # processes a relaunch replaced
        self._start: tuple[str, bytes, OnExit] | None = None  # controller, key, on_exit (for relaunch)
        self._logs: list[IO[Any]] = []
        self._stopping = False
        self._log = get_logger(part="launcher.local")

    async def start(self, specs: list[DaemonSpec], *, controller: str, key: bytes, on_exit: OnExit) -> None:
        self._start = (controller, key, on_exit)
        if self.log_dir is not None:
            await self._end_earlier_daemons()
        try:
            for spec in specs:
                await self._spawn(spec, controller, key, on_exit)
        except BaseException:
            await self.stop(timeout_s=2.0)
            raise

    async def _spawn(self, spec: DaemonSpec, controller: str, key: bytes, on_exit: OnExit) -> None:
        env = dict(os.environ)
        env.update(spec.env)
        env[ENV_KEY] = key.hex()
        threads = str(self.torch_threads)
        env.setdefault("OMP_NUM_THREADS", threads)
        env.setdefault("MKL_NUM_THREADS", threads)
        stderr: Any = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.log_dir / f"{spec.role}-{spec.rank}.log", "ab")
            self._logs.append(stderr)
        args = spec.daemon_args(
            controller, heartbeat_s=self.heartbeat_s, orphan_timeout_s=self.orphan_timeout_s, log_level=self.log_level
        )
        proc = await asyncio.create_subprocess_exec(
            self.python, "-m", "hfrt", "daemon", *args,
            env=env, stdin=asyncio.subprocess.DEVNULL, stdout=stderr, stderr=stderr,
            start_new_session=True,  # a terminal's Ctrl-C reaches the controller only: it stops them in order
        )
        self.processes[spec.identity] = proc
        self._specs[spec.identity] = spec
        if self.log_dir is not None:
            with open(self.log_dir / PIDS_FILE, "a") as f:
                f.write(f"{proc.pid}\n")
        self._log.info("daemon_started", daemon=spec.identity, pid=proc.pid)
        self._watchers.append(asyncio.get_running_loop().create_task(self._watch(spec.identity, proc, on_exit)))

    async def _end_earlier_daemons(self) -> None:
        """Kill the daemons listed in log_dir/daemons.pids that still run and still write to a log
        in log_dir (not a reused pid), then start the list afresh."""
        assert self.log_dir is not None
        listed = self.log_dir / PIDS_FILE
        try:
            pids = [int(p) for p in listed.read_text().split()]
        except (OSError, ValueError):
            pids = []
        ended = [pid for pid in pids if _our_daemon(pid, self.log_dir) and _kill(pid)]
        for pid in ended:
            for _ in range(200):  # 10 s
                if not _our_daemon(pid, self.log_dir):
                    break
                await asyncio.sleep(0.05)
            shm.remove_files_of(pid)
        if ended:
            self._log.warning("earlier_daemons_replaced", pids=ended, folder=str(self.log_dir),
                              why="still running from an earlier controller of this run folder")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        listed.write_text("")

    async def _watch(self, identity: str, proc: asyncio.subprocess.Process, on_exit: OnExit) -> None:
        code = await proc.wait()
        shm.remove_files_of(proc.pid)
        if not self._stopping and self.processes.get(identity) is proc:  # not one relaunch replaced
            reason = f"process {proc.pid} exited with code {code}"
            if code < 0:
                reason = f"process {proc.pid} killed by {signal.Signals(-code).name}"
            if self.log_dir is not None:
                role, _, rank = identity.partition(":")
                reason = with_tail(reason, self.log_dir / f"{role}-{rank}.log", lines=4)
            on_exit(identity, reason)

    async def relaunch(self, identity: str) -> int:
        """Kill daemon `identity` if it still runs, remove its /dev/shm files, start a new process
        with the same spec, and return its pid; the old process's exit is not reported."""
        spec, proc = self._specs.get(identity), self.processes.get(identity)
        if spec is None or proc is None or self._start is None:
            raise KeyError(f"{identity}: not a daemon this launcher started")
        del self.processes[identity]  # from here on, its watcher stays silent
        self._retired.append(proc)  # and stop() still makes sure it is gone
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            await proc.wait()
        shm.remove_files_of(proc.pid)
        await self._spawn(spec, *self._start)
        return self.processes[identity].pid

    async def detach(self) -> list[list[str]]:
        """Stop watching the children and leave them running; they exit on Shutdown or orphaning."""
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._watchers.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()
        self.processes.clear()
        return []

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        live = [p for p in self.processes.values() if p.returncode is None]
        live += [p for p in self._retired if p.returncode is None]
        if live:
            await self._wait(live, timeout_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            live = [p for p in [*self.processes.values(), *self._retired] if p.returncode is None]
            if not live:
                break
            for proc in live:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass
            await self._wait(live, 5.0)
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for proc in [*self.processes.values(), *self._retired]:
            shm.remove_files_of(proc.pid)
        for f in self._logs:
            f.close()
        self._logs.clear()

    @staticmethod
    async def _wait(procs: list[asyncio.subprocess.Process], timeout_s: float) -> None:
        await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout_s)


def _our_daemon(pid: int, log_dir: Path) -> bool:
    """Whether `pid` is a live (not zombie) `hfrt daemon` whose stderr goes to a file in log_dir."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        stderr = os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return False
    return b"hfrt" in argv and b"daemon" in argv and Path(stderr).parent == log_dir.resolve()


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True
