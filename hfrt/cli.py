"""The `hfrt` command line: `controller`, `daemon`, `daemon-host`, `launch`, `stop`, `plot`, `plan`, `bench` and `serve-openai` subcommands (argparse).

It parses flags and hands off; it holds no runtime logic of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hfrt import daemon_host

BENCHES = {
    "latency": "hfrt.bench.latency", "transfer": "hfrt.bench.transfer", "transition": "hfrt.bench.transition",
    "step": "hfrt.bench.step", "memory": "hfrt.bench.memory",
    "vs-trl": "hfrt.bench.vs_trl", "vs-trl-sft": "hfrt.bench.vs_trl_sft", "reshard": "hfrt.bench.reshard", "openai-serve": "hfrt.bench.openai_serve",
    "openai-stream": "hfrt.bench.openai_stream", "grammar-masks": "hfrt.bench.grammar_masks", "scale": "hfrt.bench.scale",
    "recovery": "hfrt.bench.recovery_cost", "pipeline": "hfrt.bench.pipeline",
    "token-budget": "hfrt.bench.token_budget", "lora-sync": "hfrt.bench.lora_sync", "limit": "hfrt.bench.limit",
}


def _parse_roles(items: list[str]) -> dict[str, dict[str, Any]] | None:
    if not items:
        return None
    roles: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, rest = item.partition("=")
        impl, _, count = rest.partition(":")
        if not sep or not name or not impl:
            raise SystemExit(f"hfrt: --role expects NAME=IMPL[:RANKS], got {item!r}")
        roles[name] = {"impl": impl, "world_size": int(count or 1)}
    return roles


def _controller(args: argparse.Namespace) -> int:
    from hfrt import log
    from hfrt.flows import load_flow
    from hfrt.session import Attach, RunDirBusy, RunDirLock

    log.configure(args.log_level, args.log_format)
    try:
        flow = load_flow(args.flow)
        run_dir, config, roles = _run_config(args, flow)
        attach = Attach.read(args.attach) if args.attach else None
        if attach is not None:
            _check_attach_roles(flow, config, attach, args.attach)
    except ValueError as exc:  # ConfigError included: all before any daemon starts
        print(f"hfrt controller: {exc}", file=sys.stderr)
        return 2
    try:
        lock = RunDirLock(run_dir).acquire()  # held until this process exits
    except RunDirBusy as exc:
        busy = f"--resume {run_dir}: that run is still going (pid {exc.pid} holds {exc.lock})" if args.resume else exc
        print(f"hfrt controller: {busy}", file=sys.stderr)
        return 2
    with lock:
        roles = _parse_roles(args.role) or roles
        try:
            if not args.resume:
                _check_fresh_folder(run_dir, overwrite=args.overwrite)
            if args.resume:
                _check_resume(flow, run_dir, config, set(attach.roles) if attach is not None else set(roles))
            _write_config(run_dir, flow, config, roles)
        except ValueError as exc:
            print(f"hfrt controller: {exc}", file=sys.stderr)
            return 2
        if args.cluster:
            return _controller_on_cluster(args, flow, run_dir, config)
        return _controller_local(args, flow, run_dir, config, roles, attach)


def _controller_local(
    args: argparse.Namespace, flow: Any, run_dir: Path, config: dict[str, Any], roles: dict[str, dict[str, Any]],
    attach: Any,
) -> int:
    from hfrt.flows.reward_errors import RewardErrorLimit
    from hfrt.session import run_flow
    from hfrt.signals import Stopped, run_stoppable

    try:
        summary = run_stoppable(
            run_flow(
                flow, run_dir=run_dir, config=config, roles=roles,
                attach=attach, keep_daemons=args.keep_daemons, heartbeat_s=args.heartbeat,
                orphan_timeout_s=args.orphan_timeout,
            ), who="hfrt controller",
        )
    except Stopped as exc:
        return _stopped(run_dir, exc)
    except RewardErrorLimit as exc:  # the reward function failed on too many samples: its traceback, exit 1
        print(f"hfrt controller: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2, default=str))
    if "attach" in summary:
        print(f"daemons are still running; re-run with: hfrt controller --flow {args.flow} --attach {summary['attach']}\n"
              f"stop them with: hfrt stop {summary['attach']}", file=sys.stderr)
    return 0


def _run_config(args: argparse.Namespace, flow: Any) -> tuple[Path, dict[str, Any], dict[str, dict[str, Any]]]:
    """The run folder, the flow's settings and its roles: a resumed run's saved config.json, then
    --config, then --set; checked by the flow's Config (nothing is written yet)."""
    from hfrt import config as runconfig
    from hfrt.session import Attach

    base = None
    if args.resume:
        run_dir = Path(args.resume)
        saved = run_dir / "config.json"
        if not saved.is_file():
            raise runconfig.ConfigError(f"--resume {run_dir}: no config.json there (not an hfrt run folder?)")
        base = json.loads(saved.read_text())
    else:
        run_dir = Path(args.run_dir or Path("runs") / time.strftime(f"{Path(args.flow).stem}-%Y%m%d-%H%M%S"))
    rc = runconfig.build(flow.roles, file=args.config, sets=args.set, base=base)
    if args.attach:
        running = Attach.read(args.attach).settings
        runconfig.refuse_role_overrides(runconfig.role_overrides(file=args.config, sets=args.set), running, "--config/--set")
        runconfig.refuse_role_overrides(_parse_roles(args.role) or {}, running, "--role")
    elif rc.roles != flow.roles:  # the built-in tables are checked by the test suite
        runconfig.check_role_options(rc.roles)
    config = dict(rc.flow)
    if args.resume:
        config["resume"] = True
    if args.overwrite and args.resume:
        raise runconfig.ConfigError(f"--overwrite and --resume {run_dir}: continue the run or replace it, not both")
    if (args.attach or args.keep_daemons) and _reads_flow_config(flow):
        # daemons that outlive a run: their first weights are kept there, for reset_weights (Trainer)
        config["daemons_dir"] = str(Path(args.attach).parent if args.attach else run_dir)
    flow.check({**config, "run_dir": str(run_dir)})
    return run_dir, config, flow.roles_for(config, rc.roles)


#: what a run writes into its folder (docs/flows.md); the first three mean the folder holds a run
RUN_OUTPUTS = ("config.json", "metrics.jsonl", "checkpoints", "hf", "tensorboard", "trace.json", "wandb", "metrics.png")
#: settings `hfrt controller` sets for one run (its folder, --resume, the daemons' folder): not saved
RUN_ONLY = ("run_dir", "resume", "daemons_dir")


def _check_fresh_folder(run_dir: Path, *, overwrite: bool) -> None:
    """A run folder that already holds a run (config.json, metrics.jsonl or checkpoints/) is
    refused without --resume (its records would mix with this run's), unless --overwrite: then
    that run's outputs (RUN_OUTPUTS) are deleted first. A folder of daemons only (hfrt launch,
    attach.json, cluster.key, logs/) is no run."""
    import shutil

    held = [name for name in RUN_OUTPUTS[:3] if (run_dir / name).exists()]
    if not held:
        return
    if not overwrite:
        raise ValueError(
            f"run folder {run_dir} already holds a run ({', '.join(held)}); continue it with --resume {run_dir}, "
            "replace it with --overwrite, or pick another --run-dir")
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _write_config(run_dir: Path, flow: Any, config: dict[str, Any], roles: dict[str, dict[str, Any]]) -> None:
    """RUN_DIR/config.json: every setting this run uses, defaults included (the flow's Config as
    read), and its roles — what `--resume` starts from, and what `--config RUN_DIR/config.json`
    runs again."""
    import dataclasses

    from hfrt import config as runconfig

    settings = config
    if flow.config_cls is not None:
        typed = flow.read({**config, "run_dir": str(run_dir)})  # as checked before: read once
        if dataclasses.is_dataclass(typed):
            settings = {f.name: getattr(typed, f.name) for f in dataclasses.fields(typed)}
    saved = runconfig.RunConfig({k: v for k, v in settings.items() if k not in RUN_ONLY}, roles)
    (run_dir / "config.json").write_text(saved.to_json())


def _reads_flow_config(flow: Any) -> bool:
    from hfrt.flows.config import FlowConfig

    return isinstance(flow.config_cls, type) and issubclass(flow.config_cls, FlowConfig)


def _check_attach_roles(flow: Any, config: dict[str, Any], attach: Any, path: str) -> None:
    """Refuse at once a flow that needs a role the attached daemons do not have (waiting for
    it to say hello would only time out); the roles are those the flow needs with `config`."""
    missing = sorted(set(flow.roles_for(config)) - set(attach.roles))
    if missing:
        raise ValueError(
            f"--attach {path}: flow {flow.name!r} needs role(s) {missing}, which these daemons do not have "
            f"(attach.json has {sorted(attach.roles)}); start daemons for this flow with --keep-daemons or hfrt launch"
        )


def _check_resume(flow: Any, run_dir: Path, config: dict[str, Any], roles: set[str]) -> None:
    """Find the checkpoint a resume will load before any daemon starts (the Trainer picks the same
    one): refuse when the run's checkpoints are all damaged or hold a role this run lacks, warn when
    a damaged newer one is passed over."""
    from hfrt.flows.checkpoint import resumable_checkpoint

    steps = config.get("steps", getattr(flow.config_cls, "steps", None))
    found = resumable_checkpoint(run_dir, max_step=steps if isinstance(steps, int) else None)
    ckpt = found.checkpoint
    if ckpt is None:
        return
    extra = sorted(set(ckpt.state["roles"]) - roles)
    if extra:
        raise ValueError(f"--resume {run_dir}: checkpoint {ckpt.path} holds role(s) {extra} that this run does not have")
    for problem in found.damaged:
        print(f"hfrt controller: warning: {problem}; passed over", file=sys.stderr)
    if found.damaged:
        print(f"hfrt controller: warning: resuming from {ckpt.path} (step {ckpt.step}), the newest whole checkpoint", file=sys.stderr)


def _controller_on_cluster(args: argparse.Namespace, flow: Any, run_dir: Path, config: dict[str, Any]) -> int:
    from hfrt.deploy import LaunchError, SpecError, load_spec
    from hfrt.flows.reward_errors import RewardErrorLimit
    from hfrt.session import run_on_cluster
    from hfrt.signals import Stopped, run_stoppable

    if args.attach or args.role:
        print("hfrt controller: --cluster places the roles itself; drop --attach and --role", file=sys.stderr)
        return 2
    try:
        cluster = load_spec(args.cluster)
        summary = run_stoppable(run_on_cluster(flow, cluster, run_dir=run_dir, config=config, keep_daemons=args.keep_daemons),
                                who="hfrt controller")
    except SpecError as exc:
        print(f"hfrt controller: {exc}", file=sys.stderr)
        return 2
    except (LaunchError, RewardErrorLimit) as exc:
        print(f"hfrt controller: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        return _stopped(run_dir, exc)
    print(json.dumps(summary, indent=2, default=str))
    if "attach" in summary:
        _print_attach(args.flow, summary["attach"])
    return 0


def _launch(args: argparse.Namespace) -> int:
    from hfrt import log
    from hfrt.deploy import LaunchError, SpecError, load_spec
    from hfrt.session import RunDirBusy, RunDirLock, launch_cluster
    from hfrt.signals import Stopped, run_stoppable

    log.configure(args.log_level, "console")
    try:
        cluster = load_spec(args.spec)
        run_dir = Path(args.run_dir or Path("runs") / time.strftime(f"launch-{cluster.name}-%Y%m%d-%H%M%S"))
        with RunDirLock(run_dir):  # while launching: a controller may use the folder once we are done
            attach = run_stoppable(launch_cluster(cluster, run_dir=run_dir, orphan_timeout_s=args.orphan_timeout), who="hfrt launch")
    except (SpecError, RunDirBusy) as exc:
        print(f"hfrt launch: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"hfrt launch: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:  # the daemons it had started were stopped (the signal's line said so)
        return exc.exit_code
    print(attach)
    _print_attach("FLOW", str(attach))
    return 0


def _serve_openai(args: argparse.Namespace) -> int:
    from hfrt import log
    from hfrt.flows import Flow
    from hfrt.serve.command import api_key_from, serve_flow
    from hfrt.session import run_flow
    from hfrt.signals import Stopped, run_stoppable
    from hfrt.wire.errors import HfrtError

    log.configure(args.log_level, "console")
    options = {"model": args.model, "seed": args.seed, "generator": args.generator}
    roles = {"rollout": {"impl": "rollout", "world_size": args.ranks, "options": options}}
    from hfrt.serve.server import ServerLimits

    limits = ServerLimits(max_body_bytes=int(args.max_body_mb * (1 << 20)), max_tokens=args.max_tokens,
                          max_concurrent_requests=args.max_concurrent_requests, request_timeout_s=args.request_timeout_s,
                          header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                          max_prompt_tokens=args.max_prompt_tokens or None, token_stream=not args.stream_chunks)
    try:
        api_key = api_key_from(args.api_key, args.api_key_file)
    except (OSError, ValueError) as exc:
        print(f"hfrt serve-openai: {exc}", file=sys.stderr)
        return 2
    serve = serve_flow(host=args.host, port=args.port, model=args.served_model_name or args.model,
                       batch_size=args.batch_size, flush_after_s=args.flush_ms / 1000, idle_flush=args.idle_flush, record=args.record or None,
                       limits=limits, api_key=api_key, tool_parser=args.tool_parser, tool_template=args.tool_template or None)
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("serve-openai-%Y%m%d-%H%M%S"))
    try:
        run_stoppable(run_flow(Flow("serve-openai", serve, roles), run_dir=run_dir, config={"trace": False, "recovery": "on"}, roles=roles),
                      who="hfrt serve-openai")
    except Stopped as exc:  # the rollout daemons were shut down (the signal's line said so)
        return exc.exit_code
    except (OSError, HfrtError) as exc:  # the port is taken, the daemon could not start
        print(f"hfrt serve-openai: {exc}", file=sys.stderr)
        return 1
    return 0


def _stopped(run_dir: Path, exc: Any) -> int:
    """A run stopped by SIGTERM / SIGINT (hfrt.signals): its summary on stdout, exit 128 + signal."""
    from hfrt.signals import stopped_summary

    print(json.dumps(stopped_summary(run_dir, exc), indent=2, default=str))
    return int(exc.exit_code)


def _print_attach(flow: str, attach: str) -> None:
    print(f"daemons are running; run a flow with: hfrt controller --flow {flow} --attach {attach}\n"
          f"stop them with: hfrt stop {attach}", file=sys.stderr)


def _daemon(args: argparse.Namespace) -> int:
    from hfrt import log
    from hfrt.daemon.base import DaemonContext
    from hfrt.daemon.server import DaemonServer, ServeConfig
    from hfrt.protocols import KeyFileError, Limits, load_key
    from hfrt.roles import resolve_impl
    from hfrt.wire.loop import run

    log.configure(args.log_level, args.log_format)
    try:
        key = load_key(args.key_file)
        cls = resolve_impl(args.impl or args.role)
        options = json.loads(args.options) if args.options else {}
        context = DaemonContext(
            args.role, args.rank, args.world_size, dp_size=args.dp_size, impl=args.impl or args.role, options=options
        )
    except (KeyFileError, ValueError, ImportError) as exc:
        print(f"hfrt daemon {args.role}:{args.rank}: {exc}", file=sys.stderr)
        return 2
    config = ServeConfig(
        args.controller, heartbeat_s=args.heartbeat, orphan_timeout_s=args.orphan_timeout,
        limits=Limits(max_frame_bytes=args.max_frame_mb * 2**20, max_message_bytes=max(args.max_frame_mb, 256) * 2**20),
        exit_with_controller=args.exit_with_controller,
    )
    return run(DaemonServer(cls, context, config, key).run())


def _stop(args: argparse.Namespace) -> int:
    from hfrt import log
    from hfrt.session import Attach, stop_daemons
    from hfrt.wire.loop import run

    log.configure(args.log_level, "console")
    stopped = run(stop_daemons(Attach.read(args.attach_file), wait_s=args.wait))
    print("stopped: " + ", ".join(stopped))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from hfrt.plot import plot_run

    try:
        out = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
    except (OSError, ValueError, ImportError) as exc:
        print(f"hfrt plot: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from hfrt.deploy.plan import main as plan_main

    return plan_main(args)


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    import importlib

    module = importlib.import_module(BENCHES[args.which])
    return int(module.main(rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    from hfrt.daemon.heartbeat import heartbeat_flag  # the range both ends of the wire accept
    from hfrt.flows import BUILTIN
    from hfrt.flows.catalog import EPILOG, flow_list_help

    p = argparse.ArgumentParser(prog="hfrt", description="HybridFlow-style RL runtime on asyncio + ZeroMQ")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("controller", help="run an algorithm script (flow) against role daemons",
                       formatter_class=flow_list_help(BUILTIN), epilog=EPILOG)
    c.add_argument("--flow", required=True, help=f"built-in flow ({', '.join(BUILTIN)}; listed below) or a .py file defining `async def flow(ctl, config)`")
    c.add_argument("--role", action="append", default=[], metavar="NAME=IMPL[:RANKS]", help="override the flow's roles, e.g. echo=echo:4 (repeatable)")
    c.add_argument("--config", metavar="FILE", help="flow settings and role overrides (TOML or YAML, or a run's RUN_DIR/config.json to run it again); see docs/configuration.md")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one setting (dots nest: roles.actor.options.engine.optim.lr=1e-3); VALUE parsed as JSON when it can be (repeatable)")
    c.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint (its config.json, then --config/--set)")
    c.add_argument("--attach", metavar="FILE", help="run against daemons already up, described by an attach.json")
    c.add_argument("--cluster", metavar="SPEC", help="launch the daemons a cluster spec (TOML) places, run the flow, stop them")
    c.add_argument("--keep-daemons", action="store_true", help="leave the launched daemons running and write RUN_DIR/attach.json")
    c.add_argument("--run-dir", help="where the run writes (default: runs/FLOW-TIMESTAMP); a folder that already holds a run is refused without --resume or --overwrite")
    c.add_argument("--overwrite", action="store_true", help="replace the run the --run-dir folder holds (its config, metrics, checkpoints, export) instead of refusing it")
    c.add_argument("--heartbeat", type=heartbeat_flag, default=2.0, help="daemon heartbeat interval in seconds")
    c.add_argument("--orphan-timeout", type=float, default=30.0, help="launched daemons exit after this many seconds without a controller")
    c.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    c.add_argument("--log-format", default="console", choices=["console", "json"], help="log line format")

    d = sub.add_parser("daemon", help="serve one role rank (the cluster key comes from $HFRT_KEY or --key-file)")
    d.add_argument("--role", required=True, help="role name, e.g. actor, critic, cost")
    d.add_argument("--rank", type=int, default=0, help="rank within the role group")
    d.add_argument("--world-size", type=int, default=1, help="number of ranks in the role group")
    d.add_argument("--dp-size", type=int, default=-1, help="data-parallel size (default: world size)")
    d.add_argument("--impl", default="", help="implementation: built-in name or module:Class (default: the role name)")
    d.add_argument("--controller", required=True, help="controller address, e.g. tcp://10.0.0.1:5555")
    d.add_argument("--key-file", help="file holding the hex cluster key (default: $HFRT_KEY, then $HFRT_KEY_FILE)")
    d.add_argument("--heartbeat", type=heartbeat_flag, default=2.0, help="heartbeat interval until the controller sets one")
    d.add_argument("--orphan-timeout", type=float, default=60.0, help="exit after this many seconds without a controller (0: never)")
    d.add_argument("--exit-with-controller", action="store_true", help="exit once the controller that welcomed it is dead (its echoes stop and its connection closes): a run's daemons; not for daemons kept for --attach")
    d.add_argument("--max-frame-mb", type=int, default=64, help="largest frame accepted, in MiB")
    d.add_argument("--options", help="implementation options as a JSON object")
    d.add_argument("--log-level", default="info", help="debug, info, warning or error")
    d.add_argument("--log-format", default="console", choices=["console", "json"], help="log line format")

    daemon_host.add_arguments(sub.add_parser("daemon-host", help="serve N daemons of one role in one process, for benchmarks and tests of the controller at scale"))
    la = sub.add_parser("launch", help="start the daemons a cluster spec places, wait for them, write attach.json")
    la.add_argument("spec", help="cluster + placement spec (TOML); see docs/deploy.md")
    la.add_argument("--run-dir", help="where the key, logs and attach.json go (default: runs/launch-NAME-TIMESTAMP)")
    la.add_argument("--orphan-timeout", type=float, default=600.0, help="daemons exit after this many seconds without a controller")
    la.add_argument("--log-level", default="warning", help="debug, info, warning or error")

    s = sub.add_parser("stop", help="shut down daemons described by an attach.json")
    s.add_argument("attach_file", help="the attach.json written by --keep-daemons or hfrt launch")
    s.add_argument("--wait", type=float, default=10.0, help="seconds to wait for daemons to check in and exit")
    s.add_argument("--log-level", default="warning", help="debug, info, warning or error")

    pn = sub.add_parser("plan", help="map roles to devices (the paper's Algorithm 1) and write a cluster spec")
    from hfrt.deploy.plan import add_arguments as plan_arguments

    plan_arguments(pn)

    pl = sub.add_parser("plot", help="draw a run's reward curve and stage timings as a PNG")
    pl.add_argument("run_dir", help="a run folder (holding metrics.jsonl)")
    pl.add_argument("--out", help="PNG path (default: RUN_DIR/metrics.png)")

    so = sub.add_parser("serve-openai", help="serve a local rollout role as an OpenAI-compatible HTTP endpoint (completions, chat completions) until Ctrl-C")
    so.add_argument("--model", default="tiny", help="model preset, Hugging Face model folder or Hub id (org/name[@revision]) the rollout daemon samples from")
    so.add_argument("--served-model-name", default="", help="the model name clients send and /v1/models lists (default: --model)")
    so.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 exposes it to the network: set an API key)")
    so.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one, printed at start)")
    so.add_argument("--generator", default="hf", choices=["hf", "vllm"], help="generation engine of the rollout daemon")
    so.add_argument("--ranks", type=int, default=1, help="rollout daemons (requests are split across them)")
    so.add_argument("--seed", type=int, default=0, help="seed of the rollout daemon (and of a preset's random weights)")
    so.add_argument("--batch-size", type=int, default=64, help="most requests batched into one generate_turn call")
    so.add_argument("--flush-ms", type=float, default=20.0, help="a batch goes out this long after its first request (or when full)")
    so.add_argument("--idle-flush", action="store_true", help="send a request at once when no generate_turn call is in flight (best for few clients)")
    so.add_argument("--run-dir", help="where daemon logs go (default: runs/serve-openai-TIMESTAMP)")
    so.add_argument("--record", default="", help="write every conversation served to this folder as trajectories to train on (docs/agents-and-openai.md)")
    so.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    so.add_argument("--api-key", default="", help="require 'Authorization: Bearer KEY' (default: $HFRT_API_KEY; none: no authentication)")
    so.add_argument("--api-key-file", default="", help="read the API key from this file (first line)")
    so.add_argument("--tool-parser", default="hermes", choices=["hermes", "llama3"], help="how tool calls are parsed out of sampled text")
    so.add_argument("--tool-template", default="", choices=["", "hermes"], help="render chats with a built-in tool template (hermes: ChatML, <tools>, <tool_call>) instead of the model's own, e.g. one that ignores tools (warned at start)")
    so.add_argument("--max-tokens", type=int, default=4096, help="largest max_tokens a request may ask for")
    so.add_argument("--max-prompt-tokens", type=int, default=0, help="longest prompt in tokens (0: the model's context less max_tokens)")
    so.add_argument("--max-concurrent-requests", type=int, default=512, help="requests in progress at once (more get 429)")
    so.add_argument("--request-timeout-s", type=float, default=600.0, help="one request's time limit (408 past it)")
    so.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body (413 past it)")
    so.add_argument("--header-timeout-s", type=float, default=10.0, help="seconds a request's headers may take from their first byte (408, closed)")
    so.add_argument("--body-timeout-s", type=float, default=30.0, help="seconds a request's body may take after its headers (408, closed)")
    so.add_argument("--stream-chunks", action="store_true",
                    help="stream turns 4 tokens per generate_turn call instead of token by token (vLLM daemons always do)")

    # no -h of its own: `hfrt bench step --help` reaches the benchmark's parser
    b = sub.add_parser("bench", add_help=False, help="run a benchmark (extra flags go to the benchmark; see --help there)")
    b.add_argument("which", choices=sorted(BENCHES), help="which benchmark")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handlers = {"controller": _controller, "daemon": _daemon, "launch": _launch, "stop": _stop, "plot": _plot, "plan": _plan,
                "serve-openai": _serve_openai, "daemon-host": daemon_host.main}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:  # Ctrl-C before or after the event loop (hfrt.signals handles it during)
        print(f"hfrt {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
