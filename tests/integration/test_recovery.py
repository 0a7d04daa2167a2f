"""Elastic recovery (`--set recovery=on`), with real processes on the tiny preset: a reward or
reference daemon killed with kill -9 mid-run is relaunched and the run finishes every step once;
a role whose replacements crash on start ends the run with an error naming it and its log lines,
leaving nothing running."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from hfrt.bench import recovery_cost
from hfrt.control.controller import Controller
from hfrt.control.recovery import Recovery, RecoveryFailed, RecoveryPolicy
from hfrt.deploy.launchers.base import DaemonSpec, OnExit
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.protocols import new_key
from hfrt.wire import shm
from hfrt.wire.errors import DaemonGone, RemoteError
from tests.support import STARTED_PIDS, pid_alive

# -- the mechanism, on probe daemons (each starts real daemons: ~10 s on a loaded 2-core box) -------

pytestmark = pytest.mark.timeout(120)


class Cluster:
    """A controller, a local launcher and (unless recovery=False) Recovery, over two probe
    daemons: `maker` (recoverable, as a reward daemon would be) and `user` (not)."""

    def __init__(self, tmp: Path, *, recovery: bool = True, heartbeat_s: float = 2.0, max_restarts: int = 3,
                 hang_floor_s: float = 60.0, stateful: frozenset[str] = frozenset({"actor", "critic"})) -> None:
        self.key = new_key()
        self.launcher = LocalLauncher(heartbeat_s=heartbeat_s, orphan_timeout_s=10.0, log_dir=tmp / "logs")
        self.policy = RecoveryPolicy(recovery, max_restarts, 600.0, 60.0, frozenset({"maker"}), stateful=stateful,
                                     hang_floor_s=hang_floor_s)
        self.recovery = Recovery(self.launcher, self.policy) if self.policy.enabled else None
        self.ctl = Controller("tcp://127.0.0.1:0", self.key, heartbeat_s=heartbeat_s, recovery=self.recovery)

    async def __aenter__(self) -> Cluster:
        await self.ctl.start()
        on_exit: OnExit = self.recovery.on_exit if self.recovery is not None else self.ctl.mark_gone
        specs = [DaemonSpec("maker", impl="probe"), DaemonSpec("user", impl="probe")]
        await self.launcher.start(specs, controller=self.ctl.address, key=self.key, on_exit=on_exit)
        STARTED_PIDS.update(p.pid for p in self.launcher.processes.values())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.recovery is not None:
            await self.recovery.close()
        await self.ctl.shutdown_daemons(wait_s=5.0)
        await self.launcher.stop(timeout_s=5.0)
        await self.ctl.close()

    def pid(self, identity: str) -> int:
        return self.launcher.processes[identity].pid


async def wait_gone(pid: int) -> None:
    for _ in range(200):
        if not pid_alive(pid):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"process {pid} still running")


@pytest.mark.slow
async def test_a_call_to_a_killed_daemon_is_retried_on_its_replacement(tmp_path: Path) -> None:
    async with Cluster(tmp_path) as c:
        maker = await c.ctl.role("maker")
        old = c.pid("maker:0")
        await maker.make([0, 1])  # warm
        proc = c.launcher.processes["maker:0"]
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        made = await maker.make([0, 1, 2])
        assert len(made) == 3
        assert c.pid("maker:0") != old and maker.daemons[0].pid == c.pid("maker:0")
        assert c.recovery is not None and c.recovery.stats.restarts == 1 and c.recovery.stats.retried_calls == 1
        assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{old}-*"))


@pytest.mark.slow
async def test_a_handle_made_by_a_dead_daemon_is_made_again_for_the_call_that_reads_it(tmp_path: Path) -> None:
    async with Cluster(tmp_path) as c:
        maker, user = await c.ctl.role("maker"), await c.ctl.role("user")
        made = await maker.make([5, 6, 7])
        proc = c.launcher.processes["maker:0"]
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        owned = await user.reshard(made)  # pulls rows from the dead maker: remade, then retried
        assert await user.inspect(owned) is not None
        assert c.recovery is not None and c.recovery.stats.retried_calls == 1 and c.recovery.stats.restarts == 1


@pytest.mark.slow
async def test_without_recovery_the_same_read_fails(tmp_path: Path) -> None:
    async with Cluster(tmp_path, recovery=False) as c:
        maker, user = await c.ctl.role("maker"), await c.ctl.role("user")
        made = await maker.make([5, 6, 7])
        proc = c.launcher.processes["maker:0"]
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        with pytest.raises(RemoteError):
            await user.reshard(made)


@pytest.mark.slow
async def test_a_hung_daemon_sigstop_is_declared_gone_killed_and_replaced(tmp_path: Path) -> None:
    async with Cluster(tmp_path, heartbeat_s=0.5) as c:
        maker = await c.ctl.role("maker")
        old = c.launcher.processes["maker:0"]
        old.send_signal(signal.SIGSTOP)
        made = await maker.make([1, 2])  # sent to a frozen daemon: fails when it is declared gone
        assert len(made) == 2 and maker.daemons[0].pid != old.pid
        await wait_gone(old.pid)  # the frozen process was killed, not left behind
        assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{old.pid}-*"))


@pytest.mark.slow
async def test_a_call_past_its_endpoints_deadline_counts_as_a_hang_and_is_retried_on_a_replacement(tmp_path: Path) -> None:
    # heartbeats every 10 s: only the deadline (2 s, past 3 quick calls) can catch the freeze in time
    async with Cluster(tmp_path, heartbeat_s=10.0, hang_floor_s=2.0) as c:
        maker = await c.ctl.role("maker")
        for _ in range(3):
            await maker.make([0])
        old = c.launcher.processes["maker:0"]
        old.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        made = await maker.make([1, 2])
        assert len(made) == 2 and maker.daemons[0].pid != old.pid
        assert time.monotonic() - started < 15.0, "not caught by the deadline (heartbeats would take 17.5 s)"
        await wait_gone(old.pid)
        assert c.recovery is not None and c.recovery.stats.restarts == 1


@pytest.mark.slow
async def test_a_stateful_role_past_its_deadline_is_replaced_and_its_call_fails_into_the_rewind(tmp_path: Path) -> None:
    # `user` stands for the actor: heartbeats every 10 s, so only its endpoint's deadline catches the freeze
    async with Cluster(tmp_path, heartbeat_s=10.0, hang_floor_s=2.0, stateful=frozenset({"user"})) as c:
        user = await c.ctl.role("user")
        for _ in range(3):
            await user.last_seen()
        old = c.launcher.processes["user:0"]
        old.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(DaemonGone, match="hung: last_seen ran past its"):
            await user.last_seen()  # not retried: a stateful role's step fails, the trainer rewinds
        assert time.monotonic() - started < 15.0, "not caught by the deadline (heartbeats would take 17.5 s)"
        assert c.recovery is not None and "user:0" in await c.recovery.wait_lost_state()
        await c.recovery.settle([user])
        assert user.daemons[0].pid != old.pid and c.recovery.stats.restarts == 1
        await wait_gone(old.pid)
        assert await user.last_seen() is not None  # the replacement serves


@pytest.mark.slow
async def test_an_on_restart_hook_runs_after_the_replacements_hello_and_before_the_retry(tmp_path: Path) -> None:
    async with Cluster(tmp_path) as c:
        maker = await c.ctl.role("maker")
        assert c.recovery is not None
        order: list[str] = []

        async def resync(replaced: list[str]) -> None:
            order.append(f"hook {replaced} pid {maker.daemons[0].pid}")
            await maker.make([9])  # a hook's own calls reach the replacement (the group points at it)

        c.recovery.on_restart("maker", resync)
        proc = c.launcher.processes["maker:0"]
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        made = await maker.make([1, 2])
        order.append("retried")
        assert len(made) == 2
        assert order == [f"hook ['maker:0'] pid {c.pid('maker:0')}", "retried"]
        assert c.recovery.stats.restarts == 1


async def replaced(c: Cluster, identity: str, old_pid: int, timeout_s: float = 60.0) -> None:
    """Wait until a process other than `old_pid` said hello as `identity`."""
    deadline = time.monotonic() + timeout_s
    while not ((d := c.ctl.daemon(identity)) is not None and d.alive and d.pid != old_pid):
        assert time.monotonic() < deadline, f"{identity} was not replaced within {timeout_s:.0f}s"
        await c.ctl.wait_change(1.0)


@pytest.mark.slow
async def test_two_daemons_killed_together_count_their_replacement_time_once_in_lost_s(tmp_path: Path) -> None:
    # `user` stands for the actor (stateful), `maker` for the reward: both killed at once, no call in flight
    async with Cluster(tmp_path, stateful=frozenset({"user"})) as c:
        await c.ctl.role("maker"), await c.ctl.role("user")
        old = {i: c.launcher.processes[i] for i in ("maker:0", "user:0")}
        for proc in old.values():
            proc.send_signal(signal.SIGKILL)
        for identity, proc in old.items():
            await replaced(c, identity, proc.pid)
        assert c.recovery is not None
        await c.recovery.settle([])
        took = c.recovery.stats.replace_s
        lost = c.recovery.metrics()["recovery/lost_s"]
        print(f"replacements took {[round(t, 2) for t in took]} s; recovery/lost_s {lost} s")
        assert len(took) == 2 and c.recovery.stats.restarts == 2
        # the windows overlap: at least the longer replacement, at most both end to end
        assert max(took) - 0.05 <= lost <= sum(took) + 0.05, (lost, took)


@pytest.mark.slow
async def test_a_replacement_killed_during_start_up_counts_as_a_second_restart(tmp_path: Path) -> None:
    async with Cluster(tmp_path) as c:
        await c.ctl.role("maker")
        first = c.launcher.processes["maker:0"]
        first.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (second := c.launcher.processes.get("maker:0")) is None or second is first:
            assert time.monotonic() < deadline, "no replacement was launched"
            await asyncio.sleep(0.005)
        STARTED_PIDS.add(second.pid)
        second.send_signal(signal.SIGKILL)  # long before its hello (a daemon takes ~1 s to start)
        await replaced(c, "maker:0", second.pid)
        third = c.ctl.daemon("maker:0")
        assert third is not None and third.pid not in (first.pid, second.pid)
        assert c.recovery is not None and c.recovery.metrics()["recovery/restarts"] == 2
        assert c.recovery.metrics()["recovery/lost_s"] >= c.recovery.stats.replace_s[0] - 0.05


def test_on_restart_makes_a_role_recoverable(tmp_path: Path) -> None:
    async def noop(replaced: list[str]) -> None:
        return None

    recovery = Recovery(LocalLauncher(), RecoveryPolicy(True))
    ctl = Controller("tcp://127.0.0.1:0", new_key(), recovery=recovery)
    assert ctl.recovery is recovery and recovery.ctl is ctl
    assert "rollout" not in recovery.roles
    recovery.on_restart("rollout", noop)
    assert "rollout" in recovery.roles
    recovery.on_restart("actor", noop)
    assert "actor" not in recovery.roles, "a stateful role stays stateful (rewound, not retried)"


@pytest.mark.slow
async def test_a_role_whose_replacements_crash_ends_with_an_error_naming_it(tmp_path: Path) -> None:
    crash = tmp_path / "crash.sh"
    crash.write_text("#!/bin/sh\necho 'maker: broken on purpose' >&2\nexit 3\n")
    crash.chmod(0o755)
    async with Cluster(tmp_path, max_restarts=2) as c:
        maker = await c.ctl.role("maker")
        c.launcher.python = str(crash)  # every relaunch from now on crashes at start
        proc = c.launcher.processes["maker:0"]
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        with pytest.raises(RecoveryFailed, match=r"role 'maker' keeps dying: maker:0 restarted 2 times(.|\n)*broken on purpose"):
            await maker.make([1])
        assert c.recovery is not None and c.recovery.stats.restarts == 2  # two launches, both crashed
    assert not [p for p in c.launcher._retired + list(c.launcher.processes.values()) if pid_alive(p.pid)]


# -- whole runs (slow) ---------------------------------------------------------------------------


def steps_done(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def start_run(run_dir: Path, *sets: str, heartbeat_s: float = 1.0, flow: str = "ppo") -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", flow, "--run-dir", str(run_dir),
            "--set", "recovery=on", "--set", "export_hf=false", "--set", "trace=false", "--set", "tensorboard=false",
            "--heartbeat", str(heartbeat_s), "--orphan-timeout", "5"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextmanager
def killed_on_exit(run: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """The run, killed on the way out if it is still going (a failed assertion, a timeout)."""
    try:
        yield run
    finally:
        if run.poll() is None:
            run.kill()


def daemon_of(run: subprocess.Popen[str], role: str) -> psutil.Process:
    """The live daemon process of `role` (rank 0) under the controller `run` (every daemon under it
    is recorded for the suite's clean-up)."""
    STARTED_PIDS.update(child.pid for child in psutil.Process(run.pid).children(recursive=True))
    return recovery_cost.daemon_of(run, role)


def wait_for_step(run: subprocess.Popen[str], run_dir: Path, step: int, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(steps_done(run_dir)) < step and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.poll() is None, f"the run ended before step {step}: {run.communicate()[1][-3000:]}"
    assert len(steps_done(run_dir)) >= step, f"step {step} not reached within {timeout_s:.0f}s"


def kill_9(run: subprocess.Popen[str], role: str) -> int:
    proc = daemon_of(run, role)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    return proc.pid


def descendants(run: subprocess.Popen[str]) -> list[psutil.Process]:
    try:
        return psutil.Process(run.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_reward_and_reference_killed_mid_run_are_replaced_and_the_run_finishes(tmp_path: Path) -> None:
    run_dir, steps = tmp_path / "run", 20
    run = start_run(run_dir, f"steps={steps}")
    killed: list[int] = []
    with killed_on_exit(run):
        wait_for_step(run, run_dir, 5)
        killed.append(kill_9(run, "reward"))
        wait_for_step(run, run_dir, 12)
        killed.append(kill_9(run, "reference"))
        out, err = run.communicate(timeout=400)
    assert run.returncode == 0, err[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps)), "a step was lost or repeated"
    assert records[-1]["recovery/restarts"] == 2
    assert records[0]["recovery/restarts"] == 0
    summary = json.loads(out)
    assert len(summary["recovery_replace_s"]) == 2
    for pid in killed:
        assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{pid}-*")), f"killed daemon {pid} left /dev/shm files"
    assert not [p for p in descendants(run) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_one_rank_of_a_two_rank_fsdp2_reference_killed_restarts_both_and_the_run_finishes(tmp_path: Path) -> None:
    run_dir, steps = tmp_path / "run", 12
    run = start_run(run_dir, f"steps={steps}", "roles.reference.world_size=2", "roles.reference.options.engine.backend=fsdp2")
    with killed_on_exit(run):
        wait_for_step(run, run_dir, 4)
        kill_9(run, "reference")
        out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    assert records[-1]["recovery/restarts"] == 2, "both ranks (one process group) are relaunched"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_frozen_reward_daemon_sigstop_is_replaced_and_the_run_finishes(tmp_path: Path) -> None:
    run_dir, steps = tmp_path / "run", 12
    run = start_run(run_dir, f"steps={steps}")
    with killed_on_exit(run):
        wait_for_step(run, run_dir, 4)
        frozen = daemon_of(run, "reward")
        frozen.send_signal(signal.SIGSTOP)
        out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    assert records[-1]["recovery/restarts"] == 1
    assert not frozen.is_running() or frozen.status() == psutil.STATUS_ZOMBIE, "the frozen daemon was left behind"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_role_that_crashes_on_every_restart_ends_the_run_naming_it(tmp_path: Path) -> None:
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def score(response, ground_truth, **kw):\n    return 0.0\n")
    run_dir = tmp_path / "run"
    run = start_run(run_dir, "steps=200", "recovery_max_restarts=2", "roles.reward.options.function=" + f"{reward_file}:score")
    with killed_on_exit(run):
        wait_for_step(run, run_dir, 2)
        reward_file.write_text("raise SystemExit('my_reward: broken on purpose')\n")
        first = kill_9(run, "reward")
        _, err = run.communicate(timeout=240)
    assert run.returncode != 0
    assert "role 'reward' keeps dying: reward:0 restarted 2 times" in err, err[-3000:]
    assert "broken on purpose" in err, "the error does not show the daemon's last log lines"
    assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{first}-*"))
    assert not [p for p in descendants(run) if p.is_running()], "daemons left running"


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("ranks", [1, 2], ids=["one_rank", "two_ranks_fsdp2"])
def test_a_killed_actor_is_replaced_and_the_run_rewinds_to_its_last_checkpoint(tmp_path: Path, ranks: int) -> None:
    run_dir, steps = tmp_path / "run", 16
    multi = [f"roles.actor.world_size={ranks}", "roles.actor.options.engine.backend=fsdp2"] if ranks > 1 else []
    run = start_run(run_dir, f"steps={steps}", "checkpoint_every=3", *multi)
    with killed_on_exit(run):
        wait_for_step(run, run_dir, 7)
        kill_9(run, "actor")
        out, err = run.communicate(timeout=400)
    assert run.returncode == 0, err[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps)), "a step was lost or repeated in metrics.jsonl"
    assert records[-1]["recovery/rewinds"] == 1 and records[-1]["recovery/restarts"] == ranks  # every rank relaunched
    [(failed, to)] = json.loads(out)["rewound"]
    assert to % 3 == 0 and to <= failed, (failed, to)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_frozen_actor_sigstop_is_replaced_and_the_run_rewinds_to_its_last_checkpoint(tmp_path: Path) -> None:
    run_dir, steps = tmp_path / "run", 12
    run = start_run(run_dir, f"steps={steps}", "checkpoint_every=3", heartbeat_s=2.0)
    with killed_on_exit(run):
        wait_for_step(run, run_dir, 5)
        frozen = daemon_of(run, "actor")
        frozen.send_signal(signal.SIGSTOP)
        out, err = run.communicate(timeout=400)
    assert run.returncode == 0, err[-4000:]
    records = records_of(run_dir)
    assert [r["step"] for r in records] == list(range(steps)), "a step was lost or repeated in metrics.jsonl"
    assert records[-1]["recovery/rewinds"] == 1 and records[-1]["recovery/restarts"] == 1
    assert not frozen.is_running() or frozen.status() == psutil.STATUS_ZOMBIE, "the frozen actor was left behind"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_actor_without_a_checkpoint_ends_the_run_saying_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run = start_run(run_dir, "steps=200")
    with killed_on_exit(run):
        wait_for_step(run, run_dir, 2)
        kill_9(run, "actor")
        _, err = run.communicate(timeout=240)
    assert run.returncode != 0
    assert "actor:0 died at step" in err and "no checkpoint to reload (set checkpoint_every)" in err, err[-3000:]
    assert not [p for p in descendants(run) if p.is_running()], "daemons left running"


def records_of(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sixty_steps_with_reward_killed_at_20_and_reference_at_40_learn_as_an_undisturbed_run(tmp_path: Path) -> None:
    """Recovery end to end. Same seed, rule-based reward, per-step sampling seeds: the retried calls
    recompute exactly what the dead daemons would have (the reference reloads the same weights),
    so the disturbed run's curves equal the undisturbed run's, step for step, bit for bit (no
    tolerance needed: a difference means a retried call computed something else)."""
    steps = 60
    quiet_dir, hit_dir = tmp_path / "quiet", tmp_path / "hit"
    # both at once (half the wall time); heartbeats every 3 s so a loaded box does not fake deaths
    quiet, hit = start_run(quiet_dir, f"steps={steps}", heartbeat_s=3.0), start_run(hit_dir, f"steps={steps}", heartbeat_s=3.0)
    with killed_on_exit(quiet), killed_on_exit(hit):
        wait_for_step(hit, hit_dir, 20, timeout_s=600)
        killed = [kill_9(hit, "reward")]
        wait_for_step(hit, hit_dir, 40, timeout_s=600)
        killed.append(kill_9(hit, "reference"))
        _, err = hit.communicate(timeout=600)
        _, quiet_err = quiet.communicate(timeout=300)
    assert hit.returncode == 0, err[-4000:]
    assert quiet.returncode == 0, quiet_err[-4000:]
    disturbed, undisturbed = records_of(hit_dir), records_of(quiet_dir)
    assert [r["step"] for r in disturbed] == list(range(steps)), "a step was lost or repeated"
    assert disturbed[-1]["recovery/restarts"] == 2 and undisturbed[-1]["recovery/restarts"] == 0
    assert disturbed[-1]["recovery/retried_calls"] >= 2
    # the strongest statement that holds: every learning figure is bit-identical (timings and memory differ)
    learned = [k for k in undisturbed[0] if not any(w in k for w in ("timing", "time", "memory", "perf", "recovery"))]
    assert {"reward/mean", "kl/mean"} <= set(learned)
    for key in learned:
        ours, theirs = [r.get(key) for r in disturbed], [r.get(key) for r in undisturbed]
        assert ours == theirs, f"{key} differs from the undisturbed run"
    for pid in killed:
        assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{pid}-*")), f"killed daemon {pid} left /dev/shm files"


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_killed_rollout_daemon_is_replaced_resynced_and_grpo_async_finishes(tmp_path: Path) -> None:
    """grpo_async registers Recovery.on_restart("rollout", ...): the replacement gets the actor's
    current weights before the failed generate is retried, so no step trains on stale samples."""
    run_dir, steps = tmp_path / "run", 10
    run = start_run(run_dir, f"steps={steps}", flow="grpo_async", heartbeat_s=2.0)
    with killed_on_exit(run):
        wait_for_step(run, run_dir, 4)
        killed = kill_9(run, "rollout")
        out, err = run.communicate(timeout=400)
    assert run.returncode == 0, err[-4000:]
    records = records_of(run_dir)
    assert [r["step"] for r in records] == list(range(steps)), "a step was lost or repeated"
    assert records[-1]["recovery/restarts"] == 1
    assert max(r["async/staleness_max"] for r in records) <= 1, "a step trained on samples staler than the bound"
    assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{killed}-*"))
