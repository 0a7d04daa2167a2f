"""One rank count of the scale benchmark (bench/scale.py), measured in this process, which is the
controller: a real Controller (recovery on), its daemons in `hfrt daemon-host` processes
(bench/scale_hosts.py), and one real `hfrt daemon` process to kill -9.

Two phases over the same controller. Ranks: one role of N simulated daemons — start-up (ready_s,
peer_directory_bytes), broadcasts (`ping` on every rank, all replies gathered), dispatches (`take`
of a batch with one shard handle per rank, split by data-parallel rank), and a death: the separate
daemon (role `cost`, stateless, so recovery relaunches it) is killed and the controller must find
out from its heartbeats alone, then recovery replaces it. Step: the PPO roles (actor, critic,
reference, reward, N/4 ranks each, at least one) run hfrt.flows.recipes.ppo's own step with no
compute, so the step's time is the runtime's, with its calls traced to a file as a run traces
them. CPU is this process's (all threads: the event loop and ZeroMQ's I/O thread), also net of
the idle background (heartbeats and liveness, measured alone first) over each call's wall time;
RSS is its resident memory; a soak runs more steps and samples memory at their first tenth and their end. It knows the controller's public API and the
PPO step; nothing of how the daemons serve.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfrt.bench.scale_hosts import Fleet
from hfrt.control.controller import Controller
from hfrt.control.daemons import DaemonInfo
from hfrt.control.group import RoleGroup
from hfrt.control.recovery import Recovery, RecoveryPolicy
from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.flows.recipes.ppo import PPOFlowConfig, ppo_step
from hfrt.protocols import BatchHandle, Shard, TensorHandle, new_key

#: the daemon that is killed: its own process, a stateless role recovery relaunches
VICTIM_ROLE, VICTIM_IMPL = "cost", "hfrt.roles.diagnostic.scale:SimReward"
RANKS_ROLE = "rank"
PPO_ROLES = ("actor", "critic", "reference", "reward")
#: seconds of only keeping the daemons alive, to measure that background's CPU
IDLE_S = 5.0


@dataclass(frozen=True)
class Settings:
    """What one measurement runs: ranks, daemons per host process, the heartbeat interval, how many
    broadcasts, dispatches and PPO steps, and where logs go."""

    ranks: int
    per_host: int = 256
    heartbeat_s: float = 2.0
    broadcasts: int = 100
    dispatches: int = 100
    steps: int = 20
    log_dir: Path = Path("runs/bench-scale")
    ready_timeout_s: float = 600.0
    #: after the measured steps, this many more, with memory sampled at the first and the last
    soak_steps: int = 0


class Deaths:
    """When the controller declared each daemon gone (a gone-listener)."""

    def __init__(self, ctl: Controller) -> None:
        self.at: dict[str, float] = {}
        self.unexpected: list[str] = []
        ctl.gone_listeners.append(self._heard)

    def _heard(self, info: DaemonInfo, reason: str, expected: bool) -> None:
        self.at.setdefault(info.identity, time.monotonic())
        if not expected:
            self.unexpected.append(f"{info.identity}: {reason}")


def rss_mb() -> tuple[float, float]:
    """(resident, peak resident) memory of this process in MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(n: int, call: Any) -> tuple[list[float], float]:
    """(wall seconds of each of n awaited calls, this process's CPU seconds over all of them),
    after two calls not counted."""
    for _ in range(2):
        await call()
    samples = []
    cpu = time.process_time()
    for _ in range(n):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return samples, time.process_time() - cpu


async def idle_cpu(seconds: float) -> float:
    """This process's CPU seconds per second while it only keeps its daemons alive (heartbeats,
    liveness): the background every other figure's CPU includes for as long as it takes."""
    cpu, start = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    return (time.process_time() - cpu) / (time.perf_counter() - start)


def net_ms(cpu_s: float, samples: list[float], idle: float) -> float:
    """CPU per call in ms without the idle background over the calls' wall time."""
    return max(0.0, cpu_s - idle * sum(samples)) / len(samples) * 1e3


def shard_batch(group: RoleGroup, rows_per_rank: int = 4) -> BatchHandle:
    """A batch with one shard per rank of `group`, each owned by its rank (made-up handles)."""
    shards = tuple(
        Shard(d.identity, rows_per_rank, {"x": TensorHandle(d.identity, f"x-{d.rank}", (rows_per_rank, 8), "float32", "cpu",
                                                             rows_per_rank * 32)})
        for d in group.daemons)
    return BatchHandle(shards)


async def wait_ready(ctl: Controller, fleet: Fleet, role: str, timeout_s: float) -> RoleGroup:
    """The role group once every rank said hello; a daemon host that exits first fails it, named."""
    task = asyncio.ensure_future(ctl.role(role, timeout_s=timeout_s))
    while not task.done():
        await asyncio.wait([task], timeout=1.0)
        why = fleet.failed()
        if why is not None and not task.done():
            task.cancel()
            raise RuntimeError(f"{role}: {why} (logs in {fleet.log_dir})")
    return task.result()


async def phase_ranks(ctl: Controller, fleet: Fleet, launcher: LocalLauncher, key: bytes, s: Settings,
                      deaths: Deaths) -> dict[str, Any]:
    start = time.monotonic()
    fleet.start(RANKS_ROLE, s.ranks)
    await launcher.start([DaemonSpec(VICTIM_ROLE, 0, 1, VICTIM_IMPL, exit_with_controller=True)],
                         controller=ctl.address, key=key, on_exit=lambda identity, reason: None)
    group = await wait_ready(ctl, fleet, RANKS_ROLE, s.ready_timeout_s)
    ready_s = time.monotonic() - start
    directory = ctl.stats()["peer_directory_bytes"]
    await ctl.role(VICTIM_ROLE, timeout_s=s.ready_timeout_s)
    beats = ctl.stats()["heartbeats"]
    idle = await idle_cpu(IDLE_S)
    idle_beats = (ctl.stats()["heartbeats"] - beats) / IDLE_S
    beats = ctl.stats()["heartbeats"]
    bcast, bcast_cpu = await timed(s.broadcasts, group.ping.call)
    busy_beats = (ctl.stats()["heartbeats"] - beats) / sum(bcast)
    batch = shard_batch(group)
    disp, disp_cpu = await timed(s.dispatches, lambda: group.take(batch))
    out: dict[str, Any] = {
        "ready_s": ready_s, "peer_directory_bytes": directory, "controller_idle_cpu_ms_per_s": idle * 1e3,
        "heartbeats_per_s_idle": idle_beats, "heartbeats_per_s_broadcasting": busy_beats,
        "controller_cpu_ms_per_broadcast_net": net_ms(bcast_cpu, bcast, idle),
        "controller_cpu_ms_per_dispatch_net": net_ms(disp_cpu, disp, idle),
        "broadcast_p50_ms": statistics.median(bcast) * 1e3, "broadcast_p99_ms": pct(bcast, 0.99) * 1e3,
        "dispatch_p50_ms": statistics.median(disp) * 1e3, "dispatch_p99_ms": pct(disp, 0.99) * 1e3,
        "controller_cpu_ms_per_broadcast": bcast_cpu / s.broadcasts * 1e3,
        "controller_cpu_ms_per_dispatch": disp_cpu / s.dispatches * 1e3,
    }
    out |= await kill_and_replace(ctl, deaths, s)
    out["controller_rss_mb_ranks"] = rss_mb()[0]
    out["idle"] = idle  # for the step's net figure (dropped from the result)
    return out


async def kill_and_replace(ctl: Controller, deaths: Deaths, s: Settings) -> dict[str, float]:
    """kill -9 the victim; seconds until the controller declared it gone (heartbeats only: its
    launcher does not report the exit), and from then until its replacement said hello."""
    identity = f"{VICTIM_ROLE}:0"
    victim = ctl.daemon(identity)
    assert victim is not None and victim.alive
    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    while identity not in deaths.at:
        await ctl.wait_change(1.0)
        if time.monotonic() - killed > 20 * s.heartbeat_s:
            raise RuntimeError(f"{identity} was killed {time.monotonic() - killed:.0f}s ago and is still thought alive")
    gone = deaths.at[identity]
    while True:
        info = ctl.daemon(identity)
        if info is not None and info.alive and info.pid != victim.pid:
            break
        if time.monotonic() - gone > s.ready_timeout_s:
            raise RuntimeError(f"{identity} was not replaced within {s.ready_timeout_s:.0f}s")
        await ctl.wait_change(1.0)
    return {"detect_dead_s": gone - killed, "replace_s": time.monotonic() - gone}


async def phase_step(ctl: Controller, fleet: Fleet, s: Settings, idle: float) -> dict[str, Any]:
    per_role = max(1, s.ranks // len(PPO_ROLES))
    start = time.monotonic()
    for role in PPO_ROLES:
        fleet.start(role, per_role)
    groups = {role: await wait_ready(ctl, fleet, role, s.ready_timeout_s) for role in PPO_ROLES}
    ready_s = time.monotonic() - start
    prompts_n = max(8, 2 * per_role)
    cfg = PPOFlowConfig.read({"prompts_per_step": prompts_n})
    prompts = BatchHandle.inline({"prompt": ["1+1="] * prompts_n, "ground_truth": ["2"] * prompts_n})
    roles: dict[str, Any] = dict(groups)
    step = 0

    async def one() -> None:
        nonlocal step
        await ppo_step(cfg, step, prompts, **roles)
        step += 1

    trace = ctl.record_calls(path=s.log_dir / "trace.json")  # as a run does (RUN_DIR/trace.json)
    samples, cpu = await timed(s.steps, one)
    trace.flush()
    out = {
        "step_ranks": per_role * len(PPO_ROLES), "step_ready_s": ready_s, "prompts_per_step": prompts_n,
        "step_overhead_ms": statistics.median(samples) * 1e3, "step_p99_ms": pct(samples, 0.99) * 1e3,
        "controller_cpu_s_per_step": cpu / s.steps, "controller_cpu_s_per_step_net": net_ms(cpu, samples, idle) / 1e3,
        "trace_spans_per_step": trace.recorded / (s.steps + 2), "trace_bytes_per_step": trace_bytes(trace) / (s.steps + 2),
    }
    if s.soak_steps:
        out |= await soak(one, s.soak_steps)
    trace.close()
    return out


def trace_bytes(trace: Any) -> int:
    return trace.path.stat().st_size if trace.path is not None and trace.path.exists() else 0


async def soak(one: Any, steps: int, every: int = 100) -> dict[str, Any]:
    """`steps` more steps: resident memory after the first tenth, every `every` steps and at the
    end, and how long it ran."""
    start = time.monotonic()
    warm = max(1, steps // 10)
    series = []
    for step in range(1, steps + 1):
        await one()
        if step == warm:
            rss_warm = rss_mb()[0]
        if step % every == 0:
            series.append(round(rss_mb()[0], 1))
    last = rss_mb()[0]
    return {"soak_steps": steps, "soak_s": time.monotonic() - start, "soak_rss_mb_first": rss_warm,
            "soak_rss_mb_last": last, f"soak_rss_mb_every_{every}": series,
            "soak_rss_mb_after_malloc_trim": trimmed_rss_mb()}


def trimmed_rss_mb() -> float | None:
    """Resident memory after glibc's malloc_trim(0) hands free heap pages back to the system: what
    of the growth was freed memory the allocator kept (None where libc has no malloc_trim)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return rss_mb()[0]


async def measure(s: Settings) -> dict[str, Any]:
    """Every figure of one rank count (see the module docstring)."""
    key = new_key()
    launcher = LocalLauncher(heartbeat_s=s.heartbeat_s, orphan_timeout_s=30.0, log_dir=s.log_dir / "victim")
    recovery = Recovery(launcher, RecoveryPolicy(enabled=True, roles=frozenset({VICTIM_ROLE})))
    out: dict[str, Any] = {"ranks": s.ranks, "heartbeat_s": s.heartbeat_s, "daemons_per_host": s.per_host}
    started = time.monotonic()
    async with Controller("tcp://127.0.0.1:0", key, heartbeat_s=s.heartbeat_s, recovery=recovery) as ctl:
        deaths = Deaths(ctl)
        fleet = Fleet(ctl.address, key, heartbeat_s=s.heartbeat_s, per_host=s.per_host, log_dir=s.log_dir)
        try:
            out |= await phase_ranks(ctl, fleet, launcher, key, s, deaths)
            await stop_all(ctl, fleet, recovery)
            false_deaths = [d for d in deaths.unexpected if not d.startswith(VICTIM_ROLE)]
            deaths.unexpected = []
            out |= await phase_step(ctl, fleet, s, out.pop("idle"))
            out["false_deaths"] = len(false_deaths) + len(deaths.unexpected)
            rss, peak = rss_mb()
            stats = ctl.stats()
            out |= {"controller_rss_mb": rss, "controller_peak_rss_mb": peak, "calls_sent": stats["calls_sent"],
                    "peer_directory_bytes_run": stats["peer_directory_bytes"], "run_s": time.monotonic() - started}
        finally:
            await stop_all(ctl, fleet, recovery)
            await launcher.stop()
    return out


async def stop_all(ctl: Controller, fleet: Fleet, recovery: Recovery) -> None:
    """Shut every daemon down in order and wait for their hosts to exit (killing stragglers)."""
    recovery.closing = True
    await ctl.shutdown_daemons("benchmark phase over", wait_s=60.0)
    fleet.wait(30.0)
    fleet.stop()
    recovery.closing = False


def main(argv: list[str] | None = None) -> int:
    """`python -m hfrt.bench.scale_measure RANKS ...`: one rank count, its figures as one JSON line."""
    from hfrt.log import configure
    from hfrt.wire.loop import run

    p = argparse.ArgumentParser(prog="python -m hfrt.bench.scale_measure", description=__doc__)
    p.add_argument("ranks", type=int, help="simulated ranks")
    p.add_argument("--per-host", type=int, default=Settings.per_host, help="most daemons per daemon-host process")
    p.add_argument("--heartbeat", type=float, default=Settings.heartbeat_s, help="heartbeat interval in seconds")
    p.add_argument("--broadcasts", type=int, default=Settings.broadcasts, help="broadcasts measured")
    p.add_argument("--dispatches", type=int, default=Settings.dispatches, help="dispatches measured")
    p.add_argument("--steps", type=int, default=Settings.steps, help="PPO steps measured")
    p.add_argument("--log-dir", default=str(Settings.log_dir), help="where the daemon hosts' logs and the call trace go")
    p.add_argument("--soak-steps", type=int, default=0, help="PPO steps more, memory sampled at the first tenth and the end")
    args = p.parse_args(argv)
    configure("warning")
    settings = Settings(args.ranks, args.per_host, args.heartbeat, args.broadcasts, args.dispatches, args.steps,
                        Path(args.log_dir), soak_steps=args.soak_steps)
    result = run(measure(settings))
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
