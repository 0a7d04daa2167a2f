"""Rollouts by an external agent framework: a driver (a plain function that runs one conversation
of, say, a smolagents agent against an OpenAI-compatible base URL) runs once per sample in a
thread, every HTTP call it makes recorded under its own session on hfrt's endpoint; its final
answer is scored by a reward function, and the session becomes exact trajectories (gen_mask 1 on
sampled tokens only) carrying that reward.

Controller-side (no torch). It knows the OpenAIServer's sessions and the Trajectory layout;
nothing of any agent framework (drivers import theirs), of training or of tokenizers.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hfrt.flows.agent.loop import Trajectory

#: short names of the drivers hfrt ships (any "module:function" works as well)
DRIVERS = {"smolagents": "hfrt.flows.agent.smolagents_calc:drive"}


@dataclass(frozen=True)
class DriverCall:
    """What a driver gets for one conversation: where the policy is served (base_url, api_key,
    model), the session id to send as header X-Session-Id on every request, the sample (its
    `prompt` is the task; the driver may set `tool_calls`), and per-request sampling settings
    (`stop`: stop strings to send, each one token of the served model's vocabulary)."""

    base_url: str
    api_key: str
    model: str
    session: str
    sample: dict[str, Any]
    max_tokens: int
    temperature: float
    max_steps: int
    timeout_s: float
    stop: tuple[str, ...] = ()


Driver = Callable[[DriverCall], Any]
Reward = Callable[[Any, dict[str, Any]], float]


def load_callable(name: str, what: str, short: dict[str, str] | None = None) -> Callable[..., Any]:
    """`module:function` (or a short name of `short`) imported; ValueError naming `what` otherwise."""
    path = (short or {}).get(name, name)
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        known = f" or one of {', '.join(sorted(short))}" if short else ""
        raise ValueError(f"config {what}={name!r}: give module:function{known}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"config {what}={name!r}: cannot load it ({type(exc).__name__}: {exc})") from exc
    if not callable(fn):
        raise ValueError(f"config {what}={name!r} is not callable")
    return fn


@dataclass
class Episode:
    """One driver run: its sample, final answer, reward, error and the trajectories it made."""

    sample: dict[str, Any]
    answer: Any = None
    reward: float = 0.0
    error: str = ""
    calls: int = 0
    trajectories: list[Trajectory] | None = None


async def run_external(server: Any, driver: Driver, reward: Reward, samples: Sequence[dict[str, Any]], call: DriverCall, *,
                       tag: str, threads: int, error_reward: float = 0.0) -> list[Episode]:
    """`driver` once per sample, `threads` at a time, each under session `{tag}{i}` on `server`
    (an OpenAIServer); each episode's reward is reward(answer, sample), or `error_reward` when
    the driver or the reward function raised (the error recorded). Every call of a session that
    extends the previous one token for token joins its trajectory; a call that does not (a
    framework that re-renders its history) starts the next (OpenAIServer.trajectories). The
    sessions are ended (forgotten by the server) once read."""
    loop = asyncio.get_running_loop()
    # not `with`: its exit would wait, in the event loop, for a driver that ran past its time
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="agent-driver")
    try:
        async def one(index: int, sample: dict[str, Any]) -> Episode:
            session = f"{tag}{index}"
            episode = Episode(dict(sample))
            this = DriverCall(**{**asdict(call), "session": session, "sample": episode.sample})
            try:
                episode.answer = await asyncio.wait_for(loop.run_in_executor(pool, driver, this), call.timeout_s)
                episode.reward = float(reward(episode.answer, episode.sample))
            except TimeoutError:
                episode.reward, episode.error = error_reward, f"the agent ran past sample_timeout_s={call.timeout_s}"
            except Exception as exc:  # the sample's own failure: recorded, the run goes on
                episode.reward, episode.error = error_reward, f"{type(exc).__name__}: {exc}"[:500]
            held = server.sessions.get(session)
            episode.calls = len(held.calls) if held is not None else 0
            episode.trajectories = server.trajectories(session) if episode.calls else []
            server.sessions.pop(session, None)
            for t in episode.trajectories:
                t.sample = {**episode.sample, "session": t.sample.get("session", session)}
                t.reward, t.error = episode.reward, episode.error
            return episode

        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(samples))))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """agent/* over episodes (one driver run each): reward_mean, error_rate, calls_mean (HTTP calls),
    trajectories_mean (rows trained on per episode), tool_calls_mean (the drivers' count)."""
    count = max(len(episodes), 1)
    return {
        "agent/reward_mean": sum(e.reward for e in episodes) / count,
        "agent/error_rate": sum(1 for e in episodes if e.error) / count,
        "agent/calls_mean": sum(e.calls for e in episodes) / count,
        "agent/trajectories_mean": sum(len(e.trajectories or []) for e in episodes) / count,
        "agent/tool_calls_mean": sum(float(e.sample.get("tool_calls") or 0) for e in episodes) / count,
    }


def dump_trajectories(path: Path, episodes: Sequence[Episode]) -> None:
    """One JSON line per trajectory (session, uid, reward, error, answer, prompt_ids, response_ids,
    gen_mask, log_probs, weight_versions): what was trained on, for inspection."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for e in episodes:
            for t in e.trajectories or []:
                f.write(json.dumps({
                    "session": t.sample.get("session"), "uid": t.sample.get("uid"), "reward": t.reward, "error": t.error,
                    "answer": None if e.answer is None else str(e.answer), "prompt_ids": t.prompt_ids,
                    "response_ids": t.response_ids, "gen_mask": t.gen_mask, "log_probs": t.log_probs,
                    "weight_versions": t.weight_versions}) + "\n")
