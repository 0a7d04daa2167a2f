"""The Slurm launcher: daemons as job steps, started with `srun` (inside an allocation) or by a
job script given to `sbatch` (outside one). It knows Slurm's command-line tools and which node
each daemon goes to; it knows nothing of what the daemons do.

srun mode: one `srun --overlap -N1 -n1 -w NODE` step per daemon in the allocation named by the
spec's job_id or $SLURM_JOB_ID; with neither, it first makes one with `salloc --no-shell` and
cancels it on stop. The cluster key reaches each step in $HFRT_KEY through srun's environment.
sbatch mode: writes RUN_DIR/LAUNCH_ID.sbatch (mode 0700) whose lines start the same steps, each
reading the key from the 0600 key file with --key-file (so RUN_DIR must be on a filesystem the
nodes share), then waits for the job to run; each step's exit is appended to RUN_DIR/LAUNCH_ID.exits.
Either way, secrets never appear on a command line.

`relaunch` (hfrt.control.recovery) replaces one daemon in either mode: it cancels that daemon's step
(`scancel --signal=KILL JOB.STEP`, found by its step name LAUNCH_ID-ROLE:RANK; a frozen daemon
dies too) and starts a new `srun --jobid=JOB --overlap` step for it on the same node, from this
process (in sbatch mode from outside the job script, which stays up while any of its steps runs).
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
from pathlib import Path
from typing import IO, Any

from hfrt.deploy.launchers.base import PID_UNKNOWN, DaemonSpec, LaunchError, OnExit, placed_for
from hfrt.deploy.launchers.proc import end_processes, exit_reason, run_command, with_tail
from hfrt.deploy.placement import Placed
from hfrt.deploy.spec import ClusterSpec
from hfrt.log import get_logger

POLL_S = 0.5
GONE_STATES = {"", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL"}


class SlurmLauncher:
    """Starts placed daemons as Slurm job steps; `stop` leaves nothing running, `detach` lets go.

    key_file: the 0600 cluster key file (sbatch mode reads it on the nodes). environ: the
    environment to decide "inside an allocation" from and to start Slurm commands with.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        placed: list[Placed],
        *,
        run_dir: Path,
        launch_id: str,
        key_file: Path,
        orphan_timeout_s: float | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.cluster = cluster
        self.placed = {p.identity: p for p in placed}
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.launch_id = launch_id
        self.key_file = key_file
        self.orphan_timeout_s = cluster.daemons.orphan_timeout_s if orphan_timeout_s is None else orphan_timeout_s
        self.environ = dict(os.environ if environ is None else environ)
        self.job_id = cluster.slurm.job_id or self.environ.get("SLURM_JOB_ID", "")
        mode = cluster.slurm.mode
        self.mode = mode if mode != "auto" else ("srun" if self.job_id else "sbatch")
        self.own_job = False
        self.hosts: dict[str, str] = {}  # spec node name → Slurm host name
        self.steps: dict[str, asyncio.subprocess.Process] = {}
        self._retired: list[asyncio.subprocess.Process] = []  # srun clients of steps a relaunch replaced
        self._start: tuple[str, bytes, OnExit] | None = None  # controller, key, on_exit (for relaunch)
        self._files: list[IO[Any]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._reported: set[str] = set()
        self._stopping = False
        self._log = get_logger(part="launcher.slurm", mode=self.mode)

    # -- start --------------------------------------------------------------------------------

    async def start(self, specs: list[DaemonSpec], *, controller: str, key: bytes, on_exit: OnExit) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._start = (controller, key, on_exit)
        placed = [self._placed(s) for s in specs]
        try:
            if self.mode == "srun":
                await self._start_steps(placed, controller, key, on_exit)
            else:
                await self._start_batch(placed, controller, on_exit)
        except BaseException:
            await self.stop(timeout_s=0.0)
            raise

    def _placed(self, spec: DaemonSpec) -> Placed:
        return placed_for(self.placed, spec)  # type: ignore[no-any-return]

    def _describe(self, placed: list[Placed]) -> str:
        return ", ".join(sorted({f"{p.spec.role} on {p.node.name}" for p in placed}))

    # -- srun mode ----------------------------------------------------------------------------

    async def _start_steps(self, placed: list[Placed], controller: str, key: bytes, on_exit: OnExit) -> None:
        if not self.job_id:
            await self._allocate(placed)
        await self._map_hosts()
        for p in placed:
            await self._start_step(p, controller, key, on_exit)

    async def _start_step(self, p: Placed, controller: str, key: bytes, on_exit: OnExit) -> None:
        log = self.log_dir / f"srun-{p.spec.role}-{p.spec.rank}.log"
        out = open(log, "ab")
        self._files.append(out)
        env = {**self._slurm_env(), **p.spec.env, "HFRT_KEY": key.hex(), **self._master_env(p)}
        proc = await asyncio.create_subprocess_exec(
            *self.srun_argv(p, controller), stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
            env=env, start_new_session=True,
        )
        self.steps[p.identity] = proc
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch_step(p, proc, log, on_exit)))
        self._log.info("step_started", daemon=p.identity, node=self._host(p), job=self.job_id)

    async def _allocate(self, placed: list[Placed]) -> None:
        s = self.cluster.slurm
        argv = ["salloc", "--no-shell", f"--job-name={self.launch_id}", *self._resource_args(placed)]
        if s.start_timeout_s > 0:
            argv.append(f"--immediate={max(1, int(s.start_timeout_s))}")
        code, out, err = await run_command(argv, timeout_s=s.start_timeout_s + 30, env=self._slurm_env())
        found = re.search(r"allocation (\d+)", out + err)
        if code != 0 or not found:
            if found:
                await run_command(["scancel", found.group(1)], env=self._slurm_env())
            raise LaunchError(f"salloc refused the allocation for {self._describe(placed)}: {(err or out).strip()}")
        self.job_id, self.own_job = found.group(1), True
        self._log.info("allocated", job=self.job_id)

    def srun_argv(self, p: Placed, controller: str) -> list[str]:
        """The srun command for one daemon step (the key is in srun's environment, not here)."""
        argv = [
            "srun", f"--jobid={self.job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={self._host(p)}",
            f"--cpus-per-task={self.cluster.roles[p.spec.role].cpus}", f"--job-name={self.launch_id}-{p.identity}",
            *self._step_args(),
        ]
        return argv + self._device_prefix(p) + self._daemon_argv(p, controller)

    async def _watch_step(self, p: Placed, proc: asyncio.subprocess.Process, log: Path, on_exit: OnExit) -> None:
        code = await proc.wait()
        if not self._stopping and self.steps.get(p.identity) is proc:  # not one a relaunch replaced
            where = f"{p.where()} (slurm job {self.job_id}, srun)"
            on_exit(p.identity, with_tail(f"{where}: {exit_reason(code)}", log))

    # -- relaunch (hfrt.control.recovery) ---------------------------------------------------------------

    async def relaunch(self, identity: str) -> int:
        """Replace daemon `identity`: cancel its step with SIGKILL (frozen or not), wait until it
        has left the queue, and start a new overlapping step for it on the same node of the same
        job. Returns PID_UNKNOWN: the daemon's pid is known only from its hello. The old step's
        exit is not reported. Its /dev/shm files: the controller removes them when the node is
        this machine; on another node the replacement's start-up sweep (hfrt.wire.shm.remove_stale)
        removes them when its tensor plane starts."""
        p = self.placed.get(identity)
        if p is None or self._start is None or not self.job_id:
            raise KeyError(f"{identity}: not a daemon this launcher started")
        self._reported.add(identity)  # sbatch: the job script's step for it ends now; no news
        old = self.steps.pop(identity, None)
        if old is not None:
            self._retired.append(old)
        self.relaunch_marker.touch()
        try:
            await self._cancel_step(p)
            if old is not None:
                await end_processes([old], 10.0)
            if not self.hosts:
                await self._map_hosts()  # sbatch: the job's hosts, for a step started from outside it
            await self._start_step(p, *self._start)
            await self._await_step(p)
        finally:
            self.relaunch_marker.unlink(missing_ok=True)
        return PID_UNKNOWN

    async def _await_step(self, p: Placed) -> None:
        """Wait until the new step for `p` is in the queue (or its srun exited: its watcher reports
        that), so a job script waiting on its steps sees it."""
        deadline = asyncio.get_running_loop().time() + self.cluster.slurm.start_timeout_s
        proc = self.steps[p.identity]
        while proc.returncode is None and asyncio.get_running_loop().time() < deadline:
            _, out, _ = await run_command(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%j"], env=self._slurm_env())
            if self.step_name(p) in out.split():
                return
            await asyncio.sleep(POLL_S / 5)

    def step_name(self, p: Placed) -> str:
        return f"{self.launch_id}-{p.identity}"

    async def _cancel_step(self, p: Placed, timeout_s: float = 15.0) -> None:
        """scancel --signal=KILL every step of the job named for `p`, and wait until none is left."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        signalled: set[str] = set()
        while True:
            code, out, err = await run_command(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"], env=self._slurm_env())
            ids = [w[0] for w in (line.split() for line in out.splitlines()) if len(w) == 2 and w[1] == self.step_name(p)]
            if code != 0 or not ids:
                return
            fresh = [i for i in ids if i not in signalled]
            if fresh:
                await run_command(["scancel", "--signal=KILL", *fresh], env=self._slurm_env())
                signalled.update(fresh)
            if asyncio.get_running_loop().time() > deadline:
                raise LaunchError(f"{p.where()}: slurm step(s) {', '.join(ids)} of job {self.job_id} still there "
                                  f"{timeout_s:.0f}s after scancel --signal=KILL")
            await asyncio.sleep(POLL_S)

    # -- sbatch mode --------------------------------------------------------------------------

    async def _start_batch(self, placed: list[Placed], controller: str, on_exit: OnExit) -> None:
        script = self.run_dir / f"{self.launch_id}.sbatch"
        fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)
        with os.fdopen(fd, "w") as f:
            f.write(self.job_script(placed, controller))
        code, out, err = await run_command(["sbatch", "--parsable", str(script)], env=self._slurm_env())
        if code != 0:
            raise LaunchError(f"sbatch refused the job for {self._describe(placed)}: {(err or out).strip()}")
        self.job_id, self.own_job = out.strip().split(";")[0], True
        self._log.info("submitted", job=self.job_id, script=str(script))
        await self._await_running(placed)
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch_batch(placed, on_exit)))

    def job_script(self, placed: list[Placed], controller: str) -> str:
        """The bash job script: #SBATCH resources, then one backgrounded step per daemon, then wait."""
        s = self.cluster.slurm
        pinned = s.pin_nodes
        lines = ["#!/bin/bash", f"#SBATCH --job-name={self.launch_id}", f"#SBATCH --output={self.log_dir}/slurm-%j.out"]
        lines += [f"#SBATCH {arg}" for arg in self._resource_args(placed)]
        lines += [
            f"# Written by hfrt for spec {self.cluster.source}: starts the role daemons, then waits for them.",
            "set -u",
            f"exits={shlex.quote(str(self.exits_file))}",
            'mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
            "daemon() {  # identity host log command...: run one daemon step, then record its exit code",
            '  local id=$1 host=$2 log=$3; shift 3',
            '  srun --overlap --nodes=1 --ntasks=1 --nodelist="$host" --job-name="$SLURM_JOB_NAME-$id" \\',
            '    --output="$log" --error="$log" ' + shlex.join(self._step_args()) + ' "$@"',
            '  echo "$id $?" >> "$exits"',
            "}",
        ]
        order = [n.name for n in self.cluster.nodes]
        for p in placed:
            host = shlex.quote(p.node.host) if pinned else f'"${{hosts[{order.index(p.node.name)}]}}"'
            master = "" if pinned else f' MASTER_ADDR="${{hosts[{order.index(p.master.name)}]}}"'
            env = " ".join(shlex.quote(f"{k}={v}") for k, v in p.spec.env.items())
            cpus = self.cluster.roles[p.spec.role].cpus
            log = shlex.quote(str(self.log_dir / f"{p.spec.role}-{p.spec.rank}.log"))
            command = shlex.join(self._daemon_argv(p, controller) + ["--key-file", str(self.key_file)])
            lines.append(f"daemon {p.identity} {host} {log} --cpus-per-task={cpus} env {env}{master} {command} &")
        lines += [
            "wait",
            "# The job stays up while a step hfrt started from outside (a relaunch) runs, or a relaunch",
            "# is under way (its marker file, younger than two minutes, exists).",
            f"relaunching={shlex.quote(str(self.relaunch_marker))}",
            'held() { [ -n "$(find "$relaunching" -mmin -2 2>/dev/null)" ] || '
            'squeue -h -s -j "$SLURM_JOB_ID" -o %j 2>/dev/null | grep -q "^$SLURM_JOB_NAME-"; }',
            "while held; do sleep 1; done",
            "",
        ]
        return "\n".join(lines)

    @property
    def exits_file(self) -> Path:
        return self.run_dir / f"{self.launch_id}.exits"

    @property
    def relaunch_marker(self) -> Path:
        """Exists while a relaunch replaces a step (sbatch: the job script then does not end)."""
        return self.run_dir / f"{self.launch_id}.relaunching"

    async def _await_running(self, placed: list[Placed]) -> None:
        deadline = asyncio.get_running_loop().time() + self.cluster.slurm.start_timeout_s
        while True:
            state = await self._job_state()
            if state == "RUNNING":
                return
            if state in GONE_STATES and _read_lines(self.exits_file):
                return  # it ran and its daemons already exited: the watcher reports each with its log
            if state in GONE_STATES:
                out = self.log_dir / f"slurm-{self.job_id}.out"
                raise LaunchError(with_tail(
                    f"slurm job {self.job_id} for {self._describe(placed)} ended before running ({state or 'gone'})", out
                ))
            if asyncio.get_running_loop().time() > deadline:
                raise LaunchError(
                    f"slurm job {self.job_id} for {self._describe(placed)} is still {state} after "
                    f"{self.cluster.slurm.start_timeout_s:.0f}s; cancelled it"
                )
            await asyncio.sleep(POLL_S)

    async def _watch_batch(self, placed: list[Placed], on_exit: OnExit) -> None:
        by_id = {p.identity: p for p in placed}
        seen_lines = 0
        polls = 0
        while True:
            await asyncio.sleep(POLL_S)
            lines = _read_lines(self.exits_file)
            for line in lines[seen_lines:]:
                identity, _, code = line.partition(" ")
                self._report(by_id.get(identity), f"exited with code {code}", on_exit)
            seen_lines = len(lines)
            polls += 1
            if polls % 4 == 0 and await self._job_state() in GONE_STATES:
                for p in by_id.values():
                    self._report(p, f"slurm job {self.job_id} ended", on_exit)
                return

    def _report(self, p: Placed | None, what: str, on_exit: OnExit) -> None:
        if p is None or p.identity in self._reported or self._stopping:
            return
        self._reported.add(p.identity)
        log = self.log_dir / f"{p.spec.role}-{p.spec.rank}.log"
        on_exit(p.identity, with_tail(f"{p.where()} (slurm job {self.job_id}, sbatch): {what}", log))

    # -- shared pieces ------------------------------------------------------------------------

    def _resource_args(self, placed: list[Placed]) -> list[str]:
        """Job-level request: N nodes, one task each with the CPUs of every daemon placed there
        (steps then share them with --overlap, as colocated daemons share devices)."""
        s = self.cluster.slurm
        nodes = list(dict.fromkeys(p.node.name for p in placed))
        cpus = max(sum(self.cluster.roles[p.spec.role].cpus for p in placed if p.node.name == n) for n in nodes)
        args = [f"--nodes={len(nodes)}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}"]
        if s.pin_nodes:
            args.append("--nodelist=" + ",".join(self.cluster.node(n).host for n in nodes))
        args += [f"--{k}={v}" for k, v in (("partition", s.partition), ("account", s.account), ("time", s.time)) if v]
        return args + list(s.sbatch_args)

    async def _map_hosts(self) -> None:
        """Pinned: a node's host is its Slurm name. Unpinned: spec nodes take allocated hosts in order."""
        if self.cluster.slurm.pin_nodes:
            self.hosts = {n.name: n.host for n in self.cluster.nodes}
            return
        code, out, err = await run_command(["squeue", "-h", "-j", self.job_id, "-o", "%N"], env=self._slurm_env())
        code2, names, err2 = await run_command(["scontrol", "show", "hostnames", out.strip()], env=self._slurm_env())
        hosts = names.split()
        if code or code2 or len(hosts) < len(self.cluster.nodes):
            raise LaunchError(
                f"slurm job {self.job_id} has hosts {hosts}, the spec needs {len(self.cluster.nodes)}: {err}{err2}".strip()
            )
        self.hosts = {n.name: h for n, h in zip(self.cluster.nodes, hosts, strict=False)}

    def _host(self, p: Placed) -> str:
        return self.hosts.get(p.node.name, p.node.host)

    def _master_env(self, p: Placed) -> dict[str, str]:
        return {} if self.cluster.slurm.pin_nodes else {"MASTER_ADDR": self.hosts.get(p.master.name, p.master.address)}

    def _device_prefix(self, p: Placed) -> list[str]:
        # Slurm may set CUDA_VISIBLE_DEVICES for a step; the placement's device must win.
        if "CUDA_VISIBLE_DEVICES" in p.spec.env:
            return ["env", f"CUDA_VISIBLE_DEVICES={p.spec.env['CUDA_VISIBLE_DEVICES']}"]
        return []

    def _daemon_argv(self, p: Placed, controller: str) -> list[str]:
        d = self.cluster.daemons
        args = p.spec.daemon_args(controller, heartbeat_s=d.heartbeat_s, orphan_timeout_s=self.orphan_timeout_s, log_level=d.log_level)
        return [self.cluster.python, "-m", "hfrt", "daemon", *args]

    def _step_args(self) -> list[str]:
        workdir = [f"--chdir={self.cluster.workdir}"] if self.cluster.workdir else []
        return ["--kill-on-bad-exit=1", *workdir, *self.cluster.slurm.srun_args]

    def _slurm_env(self) -> dict[str, str]:
        """Our environment minus a surrounding job's SLURM_* settings (they would leak into the
        requests we make; the job id is passed explicitly); SLURM_CONF is kept."""
        return {
            k: v for k, v in self.environ.items()
            if k == "SLURM_CONF" or not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))
        }

    async def _job_state(self) -> str:
        code, out, _ = await run_command(["squeue", "-h", "-j", self.job_id, "-o", "%T"], env=self._slurm_env())
        return out.strip().split("\n")[0] if code == 0 else ""

    # -- stop / detach ------------------------------------------------------------------------

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the steps to end (daemons told to shut down end them), then cancel what is left."""
        self._stopping = True
        await end_processes([*self.steps.values(), *self._retired], timeout_s)
        if self.job_id and self.own_job:
            if self.mode == "sbatch":
                await self._await_gone(timeout_s)
            await run_command(["scancel", self.job_id], env=self._slurm_env())
            await self._await_gone(10.0)
        elif self.job_id:
            await self._cancel_own_steps()
        await self._release()

    async def _await_gone(self, timeout_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while await self._job_state() not in GONE_STATES and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(POLL_S)

    async def _cancel_own_steps(self) -> None:
        code, out, _ = await run_command(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"], env=self._slurm_env())
        ours = [w[0] for w in (line.split() for line in out.splitlines()) if len(w) == 2 and w[1].startswith(self.launch_id)]
        if code == 0 and ours:
            await run_command(["scancel", *ours], env=self._slurm_env())

    async def detach(self) -> list[list[str]]:
        """Leave the steps (or the job) running; `hfrt stop` cancels an allocation made here."""
        self._stopping = True
        await self._release()
        self.steps.clear()
        return [["scancel", self.job_id]] if self.own_job and self.mode == "srun" else []

    async def _release(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for f in self._files:
            f.close()
        self._files.clear()


def _read_lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []
