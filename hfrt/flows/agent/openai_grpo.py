"""The `agent_openai` flow: GRPO on the conversations of an external agent framework (smolagents by
default), of an agent program in its own virtualenv (`agent_command`, run once per
conversation), or of a verifiers environment (`verifiers_env`, run as such a program), that drives the policy through hfrt's OpenAI-compatible endpoint.

The run serves its rollout role (or, with agent_on = "actor", the actor's own generation engine)
on a loopback OpenAIServer with a fresh API key for its whole length. A step: push the actor's
weights to the rollout role → run the driver once per sample (`n` per prompt, `agent_threads` at
a time, each conversation its own session) → score each final answer with `agent_reward` → the
sessions' exact trajectories (gen_mask 1 only on tokens the policy sampled; prompts, tool results
and re-rendered history 0) assembled on the rollout daemons → (reference ∥ reward) → advantages
→ actor update, as agent_grpo does. It knows endpoints, sessions and the driver/reward contract;
nothing of smolagents (the driver imports it) or of engines.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfrt.flows.agent.command import (
    KILL_GRACE_S,
    SESSION_ENV,
    SESSION_HEADER,
    CommandDriver,
    failure_column,
    program_reward,
)
from hfrt.flows.agent.external import (
    DRIVERS,
    DriverCall,
    Episode,
    dump_trajectories,
    episode_metrics,
    load_callable,
    run_external,
)
from hfrt.flows.agent.grpo import ROLES, AgentGRPOConfig, PushCounter, agent_samples, prompt_columns, roles_for
from hfrt.flows.agent.loop import agent_metrics, assemble
from hfrt.flows.agent.verifiers_env import (
    check_environment,
    env_argument,
    find_python,
    number_examples,
    verifiers_command,
)
from hfrt.flows.async_steps import run_and_close
from hfrt.flows.config import CALL_TIMEOUT_S
from hfrt.flows.grpo_family import train_on
from hfrt.flows.pipeline import WeightSync
from hfrt.flows.reward_errors import RewardErrors
from hfrt.flows.timing import Stage, StageTimer
from hfrt.flows.trainer import Trainer, get_roles
from hfrt.protocols import BatchHandle
from hfrt.serve.server import OpenAIServer, ServerLimits
from hfrt.serve.tools import parser_for
from hfrt.wire.role_views import Actor, Reference, Reward, Turns

__all__ = ["ROLES", "AgentOpenAIConfig", "Config", "OpenAISteps", "driver_and_reward", "flow", "roles_for"]


@dataclass(frozen=True)
class AgentOpenAIConfig(AgentGRPOConfig):
    """agent_grpo's settings (n, prompts_per_step, temperature, agent_on, ...) with the external
    agent's, which calls the policy over HTTP. Synchronous steps only (max_staleness 0)."""

    #: new tokens per HTTP call at most
    max_new_tokens: int = 48
    #: the longest prompt + reply of one HTTP call
    max_total_tokens: int = 1024
    #: the agent framework's max steps
    max_turns: int = 3
    #: `smolagents`, or module:function taking a DriverCall and returning the final answer
    agent_driver: str = "smolagents"
    #: a program to run once per conversation instead of agent_driver (`/bin/sh -c`, e.g. "python3
    #: my_agent.py" or "/path/to/its/venv/bin/python agent.py"): OPENAI_BASE_URL, OPENAI_API_KEY and
    #: HFRT_SESSION_ID (sent as header X-Session-Id) in its environment, sample_timeout_s to run,
    #: agent_threads at a time; its last stdout line is the reward when it is a number, else
    #: agent_reward's; stdout / stderr kept in RUN_DIR/agent_logs (hfrt/flows/agent/command.py)
    agent_command: str = ""
    #: a verifiers environment to train on instead (hfrt/flows/agent/verifiers_env.py): a taskset id
    #: installed in the verifiers venv, or a path to a .py file; one episode per conversation, run as
    #: an agent_command by verifiers_host/runner.py, scored by the task's own rewards
    verifiers_env: str = ""
    #: the environment's taskset config keys (e.g. {size = 64, seed = 1})
    verifiers_args: dict[str, Any] = field(default_factory=dict)
    #: the verifiers venv's Python ("": .venv-verifiers/bin/python, as `.ci/install` makes it)
    verifiers_python: str = ""
    #: module:function (answer, sample) -> float
    agent_reward: str = "hfrt.flows.agent.smolagents_calc:calc_reward"
    #: conversations at once (0: all of a step's)
    agent_threads: int = 0
    #: a stop string the driver sends with each request (text of any length), e.g. "}}" to end a
    #: tool call's JSON ("": none)
    agent_stop: str = ""
    #: how tool calls are read from the model's text: hermes or llama3
    tool_parser: str = "hermes"
    #: write each step's trained trajectories to RUN_DIR/trajectories/step-N.jsonl
    save_trajectories: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_staleness:
            raise ValueError(f"config max_staleness={self.max_staleness}: agent_openai runs synchronous steps only; use 0")
        if self.agent_threads < 0:
            raise ValueError(f"config agent_threads={self.agent_threads}: use 0 (all of a step's conversations) or more")
        if self.max_new_tokens >= self.max_total_tokens:
            raise ValueError(f"config max_new_tokens={self.max_new_tokens} must be below max_total_tokens={self.max_total_tokens}")
        try:
            parser_for(self.tool_parser)
        except ValueError as exc:
            raise ValueError(f"config tool_parser={self.tool_parser!r}: {exc}") from exc
        if self.verifiers_env:
            if self.agent_command:
                raise ValueError("config verifiers_env and agent_command: give one (verifiers_env runs its own program)")
            env_argument(self.verifiers_env)
            find_python(self.verifiers_python)
        elif self.verifiers_args or self.verifiers_python:
            raise ValueError("config verifiers_args / verifiers_python are read only with verifiers_env")
        if not self.program:
            load_callable(self.agent_driver, "agent_driver", DRIVERS)
        elif not self.verifiers_env and not self.agent_command.strip():
            raise ValueError(f"config agent_command={self.agent_command!r}: give the program to run, e.g. \"python3 my_agent.py\"")
        load_callable(self.agent_reward, "agent_reward")

    @property
    def program(self) -> str:
        """The command run once per conversation: agent_command, or verifiers_env's runner ("": none)."""
        if self.verifiers_env:
            return verifiers_command(find_python(self.verifiers_python), self.verifiers_env, self.verifiers_args, self.max_turns)
        return self.agent_command

    def call(self) -> DriverCall:
        """The DriverCall every conversation starts from (server address and session filled in later);
        an agent_command is killed at sample_timeout_s, and waited for KILL_GRACE_S more."""
        wait_s = self.sample_timeout_s + (KILL_GRACE_S if self.program else 0.0)
        return DriverCall(base_url="", api_key="", model="policy", session="", sample={}, max_tokens=self.max_new_tokens,
                          temperature=self.temperature, max_steps=self.max_turns, timeout_s=wait_s,
                          stop=(self.agent_stop,) if self.agent_stop else ())


Config = AgentOpenAIConfig


class OpenAISteps:
    """The step function: the driver's conversations through `server`, trained on as agent_grpo's."""

    def __init__(self, cfg: AgentOpenAIConfig, roles: dict[str, Any], server: OpenAIServer, errors: RewardErrors | None = None) -> None:
        self.cfg, self.server = cfg, server
        self.driver, self.reward = driver_and_reward(cfg, server)
        self.errors = errors if errors is not None else RewardErrors(cfg.reward_error_limit)
        self.actor: Actor = roles["actor"]
        self.reference: Reference = roles["reference"]
        self.reward_role: Reward = roles["reward"]
        self.generator: Turns = roles["actor"] if cfg.agent_on == "actor" else roles["rollout"]
        self.sync = None if cfg.agent_on == "actor" else WeightSync(roles["actor"], roles["rollout"])
        self.pushes = PushCounter(roles["actor"]) if cfg.agent_on == "actor" else None
        self.last: list[Episode] = []

    async def __call__(self, step: int, prompts: BatchHandle) -> dict[str, Any]:
        cfg, t = self.cfg, StageTimer()
        info: dict[str, Any] = {}
        if self.sync is not None:
            await self.sync.publish(step)
            info = await t.one(Stage.SYNC, self.sync.drain())
        samples = agent_samples(cfg, step, prompts)
        if cfg.verifiers_env:
            number_examples(samples, step, cfg.prompts_per_step, cfg.n)
        call = DriverCall(**{**vars(cfg.call()), "base_url": self.server.url, "api_key": self.server.api_key or ""})
        threads = cfg.agent_threads or len(samples)
        episodes = await t.one(Stage.GENERATE, run_external(self.server, self.driver, self.reward, samples, call,
                                                        tag=f"step{step}-", threads=threads))
        self.last = episodes
        if cfg.program:  # a failed program counts as a failed reward: logged per kind, limited
            self.errors.observe(failure_column([e.error for e in episodes]), step=step)
        trajectories = [tr for e in episodes for tr in e.trajectories or []]
        if cfg.save_trajectories and cfg.run_dir:
            dump_trajectories(Path(cfg.run_dir) / "trajectories" / f"step-{step}.jsonl", episodes)
        if not trajectories:
            errors = sorted({e.error for e in episodes if e.error})[:3]
            hint = f" (an agent_command sends header {SESSION_HEADER}: ${SESSION_ENV} on every request)" if cfg.program else ""
            raise RuntimeError(f"step {step}: no conversation made a single call to the endpoint{hint} (errors: {errors})")
        batch = await t.one(Stage.ASSEMBLE, assemble(self.generator, trajectories, carry=(*prompt_columns(prompts), "uid")))
        if self.pushes is not None:
            info |= await self.pushes.since_last()
        record = await train_on(cfg, t, batch, actor=self.actor, reference=self.reference, reward=self.reward_role)
        rows = {f"agent/rows_{k.removeprefix('agent/')}": v for k, v in agent_metrics(trajectories).items()}
        return record | rows | episode_metrics(episodes) | info

    async def close(self, *, abort: bool = False) -> None:
        """Nothing runs between steps."""


async def flow(ctl: Any, config: AgentOpenAIConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = AgentOpenAIConfig.read(config)
    if cfg.verifiers_env:  # a clear error before the first step: the environment loads in its venv (off the loop)
        await asyncio.to_thread(check_environment, find_python(cfg.verifiers_python), cfg.verifiers_env, cfg.verifiers_args)
    needed = ("actor", "reference", "reward") if cfg.agent_on == "actor" else ("actor", "rollout", "reference", "reward")
    roles = await get_roles(ctl, *needed)
    trainer = Trainer(ctl, cfg, roles)
    generator = roles["actor"] if cfg.agent_on == "actor" else roles["rollout"]
    limits = ServerLimits(max_tokens=cfg.max_new_tokens, max_prompt_tokens=cfg.max_total_tokens - cfg.max_new_tokens,
                          request_timeout_s=cfg.sample_timeout_s, long_request_tokens=10**9)
    batch = cfg.agent_threads or cfg.n * cfg.prompts_per_step
    async with OpenAIServer(generator, model="policy", batch_size=batch, flush_after_s=0.1, limits=limits,
                            api_key=secrets.token_urlsafe(16), tool_parser=cfg.tool_parser,
                            timeout_s=max(CALL_TIMEOUT_S, cfg.sample_timeout_s)) as server:  # a round may be slow on a busy CPU
        return await run_and_close(trainer, OpenAISteps(cfg, roles, server, trainer.reward_errors))


def driver_and_reward(cfg: AgentOpenAIConfig, server: OpenAIServer) -> tuple[Any, Any]:
    """The conversations' driver and reward: agent_command's program (hfrt.flows.agent.command) with
    its stated reward, else the agent_driver function with agent_reward."""
    reward = load_callable(cfg.agent_reward, "agent_reward")
    if not cfg.program:
        return load_callable(cfg.agent_driver, "agent_driver", DRIVERS), reward
    logs = Path(cfg.run_dir) / "agent_logs" if cfg.run_dir else None
    return CommandDriver(cfg.program, timeout_s=cfg.sample_timeout_s, log_dir=logs, server=server), program_reward(reward)
