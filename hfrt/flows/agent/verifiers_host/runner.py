"""One rollout of a verifiers environment against hfrt's OpenAI endpoint, as an agent program:
`PYTHON runner.py --env ID_OR_FILE [--args JSON] [--example I] [--max-turns N]`, run by the
agent_openai flow (`verifiers_env`) once per conversation with the verifiers venv's Python.

The environment is loaded by verifiers itself (`vf.resolve_env_config` + `vf.load_environment`:
a taskset package by id, or a .py file whose directory joins the import path and whose stem is
the id); task I of its taskset (I mod its size) runs one episode with the `hfrt_chat` harness on
the subprocess runtime, the model reached through verifiers' interception server and its eval
client at OPENAI_BASE_URL with OPENAI_API_KEY; the episode's trace is named after the hfrt
session (HFRT_SESSION_ID), so the X-Session-ID header verifiers sends on every model call is
hfrt's session and the conversation is recorded token-exact. The task's own rewards (`@vf.reward`,
judges) score it; the last stdout line is the trace's reward.

Runs in the verifiers venv: stdlib, verifiers and pydantic only, nothing of hfrt.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

#: the exit status of a run refused before any model call (bad environment, bad arguments)
REFUSED = 2


class Refused(Exception):
    """The environment cannot run here; the message says which and why."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one rollout of a verifiers environment against an OpenAI endpoint")
    parser.add_argument("--env", required=True, help="a verifiers taskset id (an installed package) or a path to a .py file")
    parser.add_argument("--args", default="{}", help="JSON object of taskset config keys (verifiers_args)")
    parser.add_argument("--example", type=int, default=None, help="task index (default: the sample's `example`)")
    parser.add_argument("--max-turns", type=int, default=None, help="model calls per rollout at most")
    parser.add_argument("--check", action="store_true", help="load the environment, print its task count and exit")
    return parser.parse_args(argv)


def taskset_id(env: str) -> str:
    """The verifiers id of `env`: a file's stem (its directory put first on the import path, for
    this process and the tool servers it starts), else `env` itself, which must import."""
    if env.endswith(".py"):
        path = Path(env).resolve()
        if not path.is_file():
            raise Refused(f"verifiers_env={env!r}: no such file")
        folder = str(path.parent)
        sys.path.insert(0, folder)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)
        return path.stem
    module = env.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    if importlib.util.find_spec(module) is None:
        raise Refused(f"verifiers_env={env!r}: no module {module!r} in {sys.executable}'s environment; install the "
                      "environment's package into the verifiers venv, or give a path to a .py file")
    return env


def env_config(ident: str, args: dict[str, Any], model: str, max_tokens: int, temperature: float,
               max_turns: int | None) -> tuple[Any, str]:
    """The verifiers EnvConfig and its one seat's name: the taskset with its args, the seat on
    hfrt_chat (this Python, subprocess runtime, no retries: a retry would mint a second trace in
    the session). An environment with several seats (a judge, a simulated user) is refused."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    taskset = {**args, "id": ident}
    seats = list(agent_config_fields(vf.resolve_env_config({"taskset": taskset})))
    if len(seats) != 1:
        raise Refused(f"verifiers_env={ident!r} declares {len(seats)} agent seats {seats}; hfrt trains "
                      "single-agent environments (one policy conversation per rollout)")
    agent = {"harness": {"id": "hfrt_chat"}, "runtime": {"type": "subprocess"}, "model": model,
             "client": {"type": "eval", "base_url": os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:9/v1"), "api_key_var": "OPENAI_API_KEY"},
             "sampling": {"max_tokens": max_tokens, "temperature": temperature}, "max_turns": max_turns,
             "retries": {"max_retries": 0}}
    return vf.resolve_env_config({"taskset": taskset, seats[0]: agent}), seats[0]


def pick_task(env: Any, index: int) -> Any:
    """Task `index` of the taskset (modulo its size; an infinite one is read up to it). A task
    that needs a container (an image, NEEDS_CONTAINER) is refused: rollouts run as subprocesses."""
    if not env.taskset.bounded:
        task = next(itertools.islice(iter(env.taskset), index, None))
    else:
        tasks = list(env.taskset)
        if not tasks:
            raise Refused(f"the environment's taskset {type(env.taskset).__name__} has no tasks")
        task = tasks[index % len(tasks)]
    if type(task).NEEDS_CONTAINER or task.data.image:
        raise Refused(f"task {task.data.idx} of {type(env.taskset).__name__} needs a container (image "
                      f"{task.data.image!r}); hfrt runs verifiers rollouts in subprocesses, without Docker or Prime sandboxes")
    return task


async def rollout(env: Any, seat: str, task: Any, session: str) -> Any:
    """One episode of `task`; its one trace takes the id `session`."""
    import verifiers.v1 as vf

    traces: list[Any] = []

    def name_trace(trace: Any) -> None:
        traces.append(trace)
        if len(traces) > 1:
            raise Refused(f"{type(env).__name__} runs more than one agent in an episode; hfrt trains single-agent "
                          "environments (one trace per conversation)")
        trace.id = session

    agent = getattr(env.config, seat)
    ctx = vf.ModelContext(model=agent.model, client=agent.client, sampling=agent.sampling)
    async with env.serving():
        episode = await env.run_episode(task, ctx, on_trace=name_trace)
    return episode


def report(episode: Any) -> float:
    """Print the episode (its trace's rewards, metrics, turns, output tokens and errors as a JSON
    line; the transcript on stderr) and return its reward. An episode with no trace, or whose
    rewards did not all run (a failed model call, a raising reward), is an error, not a reward."""
    if not episode.traces:
        raise RuntimeError(f"the episode produced no trace; errors: {[f'{e.type}: {e.message}' for e in episode.errors]}")
    trace = episode.traces[0]
    errors = [*episode.errors, *trace.errors]
    print(json.dumps({"rewards": {k: (v.value if v else None) for k, v in trace.rewards.items()},
                      "metrics": trace.metrics, "stop": trace.stop_condition, "turns": trace.num_turns,
                      "output_tokens": trace.num_output_tokens, "errors": [f"{e.type}: {e.message}" for e in errors]},
                     default=str))
    print(trace.transcript, file=sys.stderr)
    unscored = [name for name, value in trace.rewards.items() if value is None]
    if unscored or not trace.rewards:
        why = f"{errors[0].type}: {errors[0].message}" if errors else "the task declares no @vf.reward and the environment recorded none"
        raise RuntimeError(f"the rollout was not scored ({', '.join(unscored) or 'no rewards'}): {why}")
    return float(trace.reward)


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    sample = json.loads(os.environ.get("HFRT_SAMPLE", "{}"))
    index = opts.example if opts.example is not None else int(sample.get("example", 0))
    try:
        args = json.loads(opts.args)
        if not isinstance(args, dict):
            raise Refused(f"verifiers_args={opts.args}: expected a table of taskset config keys")
        ident = taskset_id(opts.env)
        import verifiers.v1 as vf

        try:
            config, seat = env_config(ident, args, os.environ.get("HFRT_MODEL", "policy"), int(os.environ.get("HFRT_MAX_TOKENS", "64")),
                                float(os.environ.get("HFRT_TEMPERATURE", "1.0")), opts.max_turns)
            env = vf.load_environment(config)
        except (ImportError, TypeError, ValueError, AttributeError) as exc:
            raise Refused(f"verifiers_env={opts.env!r} does not load as a verifiers {vf.__name__} environment: "
                          f"{type(exc).__name__}: {exc}") from exc
        task = pick_task(env, index)
        if opts.check:
            size = sum(1 for _ in env.taskset) if env.taskset.bounded else "unbounded"
            print(json.dumps({"env": type(env).__name__, "taskset": type(env.taskset).__name__, "tasks": size, "seat": seat}))
            return 0
    except Refused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return REFUSED
    episode = asyncio.run(rollout(env, seat, task, os.environ["HFRT_SESSION_ID"]))
    print(report(episode))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
