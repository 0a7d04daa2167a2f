"""`hfrt daemon-host`: serve N daemons of one role in one process (hfrt.daemon.host), for
benchmarks and tests of the controller at scale; not for training (its daemons share one CPU).

By default each daemon is the role's simulated daemon (hfrt.roles.diagnostic.scale), whose
endpoints compute nothing; `--compute-s` states a time each endpoint sleeps per call, or
`--workload PLAN.toml` takes them from `hfrt plan`'s cost model: the best mapping's predicted
seconds for each of the role's calls in each stage of the plan's flow (× `--time-scale`).
It parses, prices and starts; it knows nothing of how daemons serve or what the controller does.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

#: (role, op of a plan stage) → the endpoint a PPO-family flow calls for it (hfrt.flows.recipes.ppo's STAGES)
ENDPOINT_OF_OP = {
    ("actor", "generate"): "generate", ("actor", "forward"): "compute_log_prob", ("actor", "train"): "update",
    ("critic", "forward"): "compute_values", ("critic", "train"): "update",
    ("reference", "forward"): "compute_log_prob", ("reward", "forward"): "score",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hfrt.daemon.heartbeat import heartbeat_flag

    p.add_argument("--controller", required=True, help="controller address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--role", required=True, help="role of every daemon of this host (actor, critic, reference, reward, ...)")
    p.add_argument("--count", type=int, required=True, help="daemons this host serves (ranks first-rank .. first-rank+count-1)")
    p.add_argument("--first-rank", type=int, default=0, help="rank of the first daemon")
    p.add_argument("--world-size", type=int, default=0, help="ranks in the role group across all hosts (default: --count)")
    p.add_argument("--dp-size", type=int, default=-1, help="data-parallel size (default: world size)")
    p.add_argument("--impl", default="", help="daemon class (module:Class or a built-in name; default: the role's simulated daemon)")
    p.add_argument("--options", help="implementation options as a JSON object, the same for every daemon")
    p.add_argument("--compute-s", type=float, default=0.0, help="seconds every endpoint call sleeps (simulated daemons; default 0)")
    p.add_argument("--workload", metavar="PLAN", help="a PLAN.toml (see docs/plan.md): each endpoint sleeps the cost model's predicted seconds for its call")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the --workload times by this (e.g. 0.01 to run a 70B step in 1%% of its time)")
    p.add_argument("--key-file", help="file holding the hex cluster key (default: $HFRT_KEY, then $HFRT_KEY_FILE)")
    p.add_argument("--heartbeat", type=heartbeat_flag, default=2.0, help="heartbeat interval until the controller sets one")
    p.add_argument("--orphan-timeout", type=float, default=60.0, help="exit after this many seconds without a controller (0: never)")
    p.add_argument("--exit-with-controller", action="store_true", help="exit once the controller that welcomed the daemons is dead (a run's daemons)")
    p.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    p.add_argument("--log-format", default="console", choices=["console", "json"], help="log line format")


def plan_compute_s(plan_path: str, role: str, time_scale: float = 1.0) -> dict[str, float]:
    """Endpoint → seconds per call for `role`, from the best mapping `hfrt plan` finds for the PLAN:
    the role's predicted time in each stage of the flow, given to the endpoint that stage calls
    (a role the plan does not price, e.g. a rule reward, gets none). ValueError names a bad PLAN."""
    from hfrt.deploy.plan.file import load_plan
    from hfrt.deploy.plan.search import search
    from hfrt.deploy.reader import SpecError

    try:
        plan = load_plan(plan_path)
    except SpecError as exc:
        raise ValueError(str(exc)) from None
    result = search(plan.problem)
    if not result.ranked:
        raise ValueError(f"{plan_path}: no mapping fits the cluster, so the cost model prices no call")
    choice = result.ranked[0].choices.get(role)
    out: dict[str, float] = {}
    if choice is None:
        return out
    for stage, cost in zip(plan.problem.stages, choice.costs, strict=True):
        for op in stage.calls.get(role, ()):
            name = ENDPOINT_OF_OP.get((role, op.split("_")[0]))
            if name is not None:
                out[name] = out.get(name, 0.0) + cost.seconds(plan.problem.eff) * time_scale / len(stage.calls[role])
    return out


def daemons(args: argparse.Namespace) -> list[Any]:
    """The Hosted daemons the arguments describe (ValueError or ImportError naming what is wrong)."""
    from hfrt.daemon.base import DaemonContext
    from hfrt.daemon.host import Hosted
    from hfrt.roles import resolve_impl
    from hfrt.roles.diagnostic.scale import SIM_ROLES, SimDaemon, with_compute

    if args.count < 1 or args.first_rank < 0:
        raise ValueError(f"--count {args.count} / --first-rank {args.first_rank}: need count >= 1 and first-rank >= 0")
    world = args.world_size or args.first_rank + args.count
    if args.first_rank + args.count > world:
        raise ValueError(f"ranks {args.first_rank}..{args.first_rank + args.count - 1} do not fit --world-size {world}")
    cls = resolve_impl(args.impl) if args.impl else SIM_ROLES.get(args.role, SimDaemon)
    options: dict[str, Any] = json.loads(args.options) if args.options else {}
    if not isinstance(options, dict):
        raise ValueError(f"--options must be a JSON object, not {args.options!r}")
    if args.workload:
        options.setdefault("compute_s", plan_compute_s(args.workload, args.role, args.time_scale))
    elif args.compute_s:
        options.setdefault("compute_s", dict.fromkeys(_endpoints(cls), args.compute_s))
    if issubclass(cls, SimDaemon) and any(v > 0 for v in options.get("compute_s", {}).values()):
        cls = with_compute(cls)  # its endpoints sleep: async, so the host's other daemons run meanwhile
    impl = args.impl or f"sim-{args.role}"
    out = []
    for rank in range(args.first_rank, args.first_rank + args.count):
        context = DaemonContext(args.role, rank, world, dp_size=args.dp_size, impl=impl, options=options)
        cls.check_config(context)
        out.append(Hosted(cls, context))
    return out


def _endpoints(cls: type) -> list[str]:
    from hfrt.wire.endpoints import endpoint_table

    return sorted(endpoint_table(cls))


def main(args: argparse.Namespace) -> int:
    from hfrt import log
    from hfrt.daemon.host import DaemonHost
    from hfrt.daemon.server import ServeConfig
    from hfrt.protocols import KeyFileError, load_key
    from hfrt.wire.loop import run

    log.configure(args.log_level, args.log_format)
    where = f"hfrt daemon-host {args.role}[{args.first_rank}:{args.first_rank + args.count}]"
    try:
        key = load_key(args.key_file)
        hosted = daemons(args)
        config = ServeConfig(args.controller, heartbeat_s=args.heartbeat, orphan_timeout_s=args.orphan_timeout,
                             exit_with_controller=args.exit_with_controller)
    except (KeyFileError, ValueError, ImportError) as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        return 2
    return run(DaemonHost(hosted, config, key).run())
