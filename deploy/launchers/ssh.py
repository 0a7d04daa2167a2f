"""The SSH launcher: one `ssh` session per daemon, through the system OpenSSH client.

It knows ssh options, a small POSIX-sh wrapper run on the node, and which node each daemon goes
to (from placement); it knows nothing of what the daemons do. Sessions use BatchMode (keys only,
never a password prompt). The cluster key and the spec's environment travel on ssh's stdin, never
on a command line, so they do not show up in process listings on either side.

The wrapper on the node reads the key and environment, starts the daemon with its output in a log
file on the node, prints "hfrt-started PID HOST", and then watches stdin: end of input (the
launcher stopped, was killed, or the connection died) terminates the daemon; the line "detach"
leaves it running on its own (`hfrt launch`); the line "kill" kills it at once (SIGKILL, which
also ends a frozen one: `relaunch` replaces a daemon so). When the daemon exits, the wrapper removes the
tensor files it kept in /dev/shm (hfrt-PID-*: left behind when it was killed), its exit code becomes
ssh's, and the last lines of its log go to ssh's stderr, which the launcher keeps in RUN_DIR/logs.
"""

from __future__ import annotations

import asyncio
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hfrt.deploy.launchers.base import DaemonSpec, LaunchError, OnExit, placed_for
from hfrt.deploy.launchers.proc import end_processes, exit_reason, tail
from hfrt.deploy.placement import Placed, moved
from hfrt.deploy.spec import ClusterSpec, Node
from hfrt.log import get_logger

STARTED, DETACH = "hfrt-started", "detach"
KILL = "kill"  # the wrapper's line for it is spelled out in WRAPPER (its format keys stay as they were)
SSH_ERROR = 255

#: Runs on the node under /bin/sh. {log}, {workdir_cd} and {command} are filled in, shell-quoted.
#: fd 3 keeps ssh's stdin for the watcher: a background list's own stdin would be /dev/null.
WRAPPER = """\
exec 3<&0
IFS= read -r HFRT_KEY || {{ echo "hfrt: no cluster key on stdin" >&2; exit 97; }}
export HFRT_KEY
while IFS= read -r kv && [ -n "$kv" ]; do export "$kv"; done
mkdir -p {log_dir} && : >>{log} || exit 98
{workdir_cd}
{command} </dev/null >>{log} 2>&1 3<&- &
pid=$!
unset HFRT_KEY
echo "{started} $pid $(hostname)"
(
  while IFS= read -r line; do
    if [ "$line" = {detach} ]; then echo hfrt-detached; kill -KILL $$; exit 0; fi
    if [ "$line" = kill ]; then kill -KILL $pid 2>/dev/null; fi
  done
  kill -TERM $pid 2>/dev/null
  n=0; while kill -0 $pid 2>/dev/null && [ $n -lt 100 ]; do sleep 0.1; n=$((n+1)); done
  kill -KILL $pid 2>/dev/null
) <&3 &
watcher=$!
wait $pid
code=$?
rm -f "${{HFRT_SHM_DIR:-/dev/shm}}/hfrt-$pid-"*
kill $watcher 2>/dev/null
[ $code -eq 0 ] || tail -n 20 {log} >&2
exit $code
"""


@dataclass
class _Session:
    placed: Placed
    target: str
    stderr_path: Path
    proc: asyncio.subprocess.Process | None = None
    remote_pid: int = 0
    stderr: IO[Any] | None = None
    watcher: asyncio.Task[None] | None = None


class SshLauncher:
    """Starts each placed daemon over ssh; `stop` leaves nothing running, `detach` lets go.

    placed: the placement (identity → node). log_dir: where ssh's stderr is kept on this machine.
    launch_id: names the log folder on the nodes (DAEMONS.LOG_DIR/LAUNCH_ID/ROLE-RANK.log).
    """

    def __init__(
        self, cluster: ClusterSpec, placed: list[Placed], *, log_dir: Path, launch_id: str, orphan_timeout_s: float | None = None
    ) -> None:
        self.cluster = cluster
        self.placed = {p.identity: p for p in placed}
        self.log_dir = log_dir
        self.launch_id = launch_id
        self.orphan_timeout_s = cluster.daemons.orphan_timeout_s if orphan_timeout_s is None else orphan_timeout_s
        self.sessions: dict[str, _Session] = {}
        self._retired: list[_Session] = []  # sessions a relaunch replaced (stop still ends them)
        self._start: tuple[str, bytes, OnExit] | None = None  # controller, key, on_exit (for relaunch)
        self._stopping = False
        self._gates: dict[str, asyncio.Semaphore] = {}
        self._log = get_logger(part="launcher.ssh")

    # -- start --------------------------------------------------------------------------------

    async def start(self, specs: list[DaemonSpec], *, controller: str, key: bytes, on_exit: OnExit) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._start = (controller, key, on_exit)
        try:
            results = await asyncio.gather(
                *(self._start_one(self._placed(s), controller, key, on_exit) for s in specs), return_exceptions=True
            )
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                for exc in failures:
                    if not isinstance(exc, Exception):
                        raise exc
                raise LaunchError("\n".join(str(e) for e in failures))
        except BaseException:
            await self.stop(timeout_s=5.0)
            raise

    def _placed(self, spec: DaemonSpec) -> Placed:
        return placed_for(self.placed, spec)  # type: ignore[no-any-return]

    async def _start_one(self, placed: Placed, controller: str, key: bytes, on_exit: OnExit) -> None:
        node = placed.node
        session = _Session(placed, self._target(node), self.log_dir / f"ssh-{placed.spec.role}-{placed.spec.rank}.log")
        self.sessions[placed.identity] = session
        gate = self._gates.setdefault(node.host, asyncio.Semaphore(self.cluster.ssh.max_parallel_per_node))
        async with gate:  # sshd drops handshakes beyond MaxStartups; do not open too many at once
            await self._open(session, controller, key)
            await self._await_started(session)
        session.watcher = asyncio.get_running_loop().create_task(self._watch(session, on_exit))
        self._log.info("daemon_started", daemon=placed.identity, node=node.name, remote_pid=session.remote_pid)

    async def _open(self, session: _Session, controller: str, key: bytes) -> None:
        placed = session.placed
        session.stderr = open(session.stderr_path, "ab")
        argv = self.ssh_argv(placed.node) + [self.remote_command(placed, controller)]
        session.proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=session.stderr,
            start_new_session=True,  # Ctrl-C in a terminal reaches the controller, which stops us in order
        )
        assert session.proc.stdin is not None
        lines = [key.hex()] + [f"{k}={v}" for k, v in placed.spec.env.items()] + [""]
        session.proc.stdin.write(("\n".join(lines) + "\n").encode())
        try:
            await session.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # ssh already gave up; _await_started reports why

    async def _await_started(self, session: _Session) -> None:
        assert session.proc is not None and session.proc.stdout is not None
        limit = self.cluster.ssh.connect_timeout_s + 30.0
        try:
            line = await asyncio.wait_for(session.proc.stdout.readline(), limit)
        except TimeoutError:
            raise LaunchError(f"{session.placed.where()}: ssh {session.target} did not start the daemon within {limit:.0f}s") from None
        words = line.decode(errors="replace").split()
        if len(words) >= 2 and words[0] == STARTED:
            session.remote_pid = int(words[1])
            return
        code = await session.proc.wait()
        raise LaunchError(self._failure(session, code, before_start=True))

    def _failure(self, session: _Session, code: int | None, *, before_start: bool) -> str:
        what = f"ssh {session.target} could not start the daemon ({exit_reason(code)})" if before_start else (
            f"daemon {exit_reason(code)}"
        )
        if code == SSH_ERROR:
            what = f"ssh {session.target} failed ({exit_reason(code)})"
        text = f"{session.placed.where()}: {what}"
        log = tail(session.stderr_path)
        return f"{text}: {log}" if log else text

    async def _watch(self, session: _Session, on_exit: OnExit) -> None:
        assert session.proc is not None
        code = await session.proc.wait()
        if not self._stopping and self.sessions.get(session.placed.identity) is session:  # not one relaunch replaced
            on_exit(session.placed.identity, self._failure(session, code, before_start=False))

    # -- relaunch (hfrt.control.recovery) ---------------------------------------------------------------

    async def relaunch(self, identity: str) -> int:
        """Replace daemon `identity` on its node: tell its wrapper to kill it (SIGKILL, even when
        frozen), wait for the session to end (the wrapper removes the daemon's /dev/shm files on
        the node), open a new session with the same placement, and return the new daemon's pid
        on its node (the one its hello carries). The old session's exit is not reported."""
        old = self.sessions.get(identity)
        if old is None or self._start is None:
            raise KeyError(f"{identity}: not a daemon this launcher started")
        controller, key, on_exit = self._start
        del self.sessions[identity]  # from here on, its watcher stays silent
        self._retired.append(old)
        await self._end_session(old)
        try:
            await self._start_one(old.placed, controller, key, on_exit)
        except LaunchError as own:
            self._retired.append(self.sessions.pop(identity))  # its stderr file is closed with the rest
            await self._start_on_spare(old.placed, own, controller, key, on_exit)
        return self.sessions[identity].remote_pid

    async def _start_on_spare(self, placed: Placed, own: LaunchError, controller: str, key: bytes, on_exit: OnExit) -> None:
        """Its own slot failed to start the daemon: try the role's spare slots in order (one not
        taken by another daemon); the first that starts it becomes its placement. Raises `own`
        (with what each spare said) when none does."""
        failures = [str(own)]
        taken = {(s.placed.node.name, s.placed.device) for s in self.sessions.values()}
        for node_name, device in self.cluster.roles[placed.spec.role].spares:
            if (node_name, device) in taken or (node_name, device) == (placed.node.name, placed.device):
                continue
            try:
                spare = moved(placed, self.cluster.node(node_name), device)
            except ValueError as exc:
                failures.append(str(exc))
                break
            try:
                await self._start_one(spare, controller, key, on_exit)
            except LaunchError as exc:
                self._retired.append(self.sessions.pop(placed.identity))
                failures.append(str(exc))
                continue
            self.placed[placed.identity] = spare
            self._log.warning("daemon_moved_to_spare", daemon=placed.identity, node=node_name, device=device)
            return
        raise LaunchError("\n".join(failures))

    async def _end_session(self, session: _Session, timeout_s: float = 10.0) -> None:
        """Kill the session's daemon through its wrapper and wait for ssh to exit; if the node
        does not answer in time, end the ssh client (its wrapper then sees end of input)."""
        proc = session.proc
        if proc is None or proc.returncode is not None:
            return
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.write(f"{KILL}\n".encode())
            try:
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            _close_stdin(session)
        await end_processes([proc], timeout_s)

    # -- commands -----------------------------------------------------------------------------

    def _target(self, node: Node) -> str:
        user = node.ssh_user or self.cluster.ssh.user
        port = node.ssh_port or self.cluster.ssh.port
        return f"{user + '@' if user else ''}{node.host}:{port}"

    def ssh_argv(self, node: Node) -> list[str]:
        """The ssh client command line for `node` (everything but the remote command)."""
        s = self.cluster.ssh
        argv = [
            "ssh", "-T", "-o", "BatchMode=yes", "-o", f"StrictHostKeyChecking={s.strict_host_key_checking}",
            "-o", f"ConnectTimeout={max(1, int(s.connect_timeout_s))}", "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR", "-p", str(node.ssh_port or s.port),
        ]
        if s.known_hosts:
            argv += ["-o", f"UserKnownHostsFile={Path(s.known_hosts).expanduser()}"]
        identity = node.ssh_identity or s.identity
        if identity:
            argv += ["-i", str(Path(identity).expanduser()), "-o", "IdentitiesOnly=yes"]
        user = node.ssh_user or s.user
        if user:
            argv += ["-l", user]
        return argv + list(s.options) + [node.host]

    def remote_log(self, placed: Placed) -> str:
        return f"{self.cluster.daemons.log_dir}/{self.launch_id}/{placed.spec.role}-{placed.spec.rank}.log"

    def remote_command(self, placed: Placed, controller: str) -> str:
        """What ssh runs on the node: the wrapper under /bin/sh (no secrets in it)."""
        d = self.cluster.daemons
        args = placed.spec.daemon_args(
            controller, heartbeat_s=d.heartbeat_s, orphan_timeout_s=self.orphan_timeout_s, log_level=d.log_level
        )
        log = self.remote_log(placed)
        script = WRAPPER.format(
            log_dir=shlex.quote(log.rsplit("/", 1)[0]), log=shlex.quote(log),
            workdir_cd=f"cd {shlex.quote(self.cluster.workdir)} || exit 98" if self.cluster.workdir else ":",
            command=shlex.join([self.cluster.python, "-m", "hfrt", "daemon", *args]),
            started=STARTED, detach=DETACH,
        )
        return "exec /bin/sh -c " + shlex.quote(script)

    # -- stop / detach ------------------------------------------------------------------------

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Close every session's stdin (the node's wrapper then terminates its daemon), wait, kill."""
        self._stopping = True
        sessions = [*self.sessions.values(), *self._retired]
        for session in sessions:
            _close_stdin(session)
        await end_processes([s.proc for s in sessions if s.proc is not None], timeout_s)
        await self._release()

    async def detach(self) -> list[list[str]]:
        """Tell every wrapper to let its daemon run on alone, then drop the sessions."""
        self._stopping = True
        await asyncio.gather(*(_send_detach(s) for s in self.sessions.values()))
        await end_processes([s.proc for s in self.sessions.values() if s.proc is not None], 10.0)
        await self._release()
        return []

    async def _release(self) -> None:
        sessions = [*self.sessions.values(), *self._retired]
        watchers = [s.watcher for s in sessions if s.watcher is not None]
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        for session in sessions:
            if session.stderr is not None:
                session.stderr.close()
                session.stderr = None


async def _send_detach(session: _Session) -> None:
    if session.proc is None or session.proc.stdin is None or session.proc.returncode is not None:
        return
    session.proc.stdin.write(f"{DETACH}\n".encode())
    try:
        await session.proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass


def _close_stdin(session: _Session) -> None:
    if session.proc is not None and session.proc.stdin is not None and not session.proc.stdin.is_closing():
        session.proc.stdin.close()
