"""Agent programs as the agent_openai flow's driver (`agent_command`): any program, in whatever
virtualenv it was built in, runs once per conversation as a child process (`/bin/sh -c COMMAND`, in
its own process group) with the endpoint's URL, an API key and the conversation's session id in
its environment; its stdout and stderr are kept per conversation; its reward is its last line of
stdout when that is a number, else the flow's `agent_reward` over its answer and the conversation
the endpoint recorded.

Controller-side (no torch). It knows environment variable names, the DriverCall contract and
processes; nothing of any agent framework, of training or of tokenizers.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hfrt.flows.agent.external import DriverCall

#: the session id a program sends as the X-Session-Id header on every request (SESSION_HEADER)
SESSION_ENV = "HFRT_SESSION_ID"
#: the header hfrt's OpenAI endpoint reads a request's session from
SESSION_HEADER = "X-Session-Id"
#: what else a program finds in its environment: the model name to ask for, the sample (JSON: its
#: prompt, ground_truth, data_source, uid, ...), the prompt alone (text, or a chat as JSON), and
#: the flow's per-request bounds
MODEL_ENV, SAMPLE_ENV, PROMPT_ENV = "HFRT_MODEL", "HFRT_SAMPLE", "HFRT_PROMPT"
MAX_TOKENS_ENV, TEMPERATURE_ENV, TIMEOUT_ENV = "HFRT_MAX_TOKENS", "HFRT_TEMPERATURE", "HFRT_TIMEOUT_S"
#: seconds past sample_timeout_s the flow waits for a program it killed to be reaped and its logs read
KILL_GRACE_S = 5.0
#: characters of a failed program's stderr quoted in its error
STDERR_TAIL = 400


class AgentProgramFailed(RuntimeError):
    """An agent program exited with a non-zero status (its stderr's tail in the message)."""


class AgentProgramTimeout(AgentProgramFailed):
    """An agent program ran past sample_timeout_s and was killed with its process group."""


@dataclass(frozen=True)
class ProgramResult:
    """What a conversation's program left: its last non-empty line of stdout ("" for none)."""

    last_line: str

    def __str__(self) -> str:
        return self.last_line


def reward_of(line: str) -> float | None:
    """The reward a program's last stdout line states: the line as a finite number, else None."""
    try:
        value = float(line.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def program_env(call: DriverCall, timeout_s: float) -> dict[str, str]:
    """The program's environment: the controller's, plus OPENAI_BASE_URL, OPENAI_API_KEY (what the
    `openai` client and most agent frameworks read), the session id and the sample."""
    prompt = call.sample.get("prompt", "")
    return {
        **os.environ,
        "OPENAI_BASE_URL": call.base_url, "OPENAI_API_KEY": call.api_key or "none",
        SESSION_ENV: call.session, MODEL_ENV: call.model,
        SAMPLE_ENV: json.dumps(call.sample, default=str), PROMPT_ENV: prompt if isinstance(prompt, str) else json.dumps(prompt),
        MAX_TOKENS_ENV: str(call.max_tokens), TEMPERATURE_ENV: str(call.temperature), TIMEOUT_ENV: str(timeout_s),
    }


class CommandDriver:
    """A driver (DriverCall -> ProgramResult) running `command` once per conversation, killed with
    its process group after `timeout_s`; stdout and stderr go to LOG_DIR/SESSION.stdout / .stderr
    when `log_dir` is given. `server` (an OpenAIServer) is read for the recorded conversation,
    put in the sample as `conversation` (the last chat request's messages and the reply)."""

    def __init__(self, command: str, *, timeout_s: float, log_dir: Path | None, server: Any = None) -> None:
        self.command, self.timeout_s, self.log_dir, self.server = command, timeout_s, log_dir, server

    def __call__(self, call: DriverCall) -> ProgramResult:
        out, err = self._streams(call.session)
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", self.command], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env=program_env(call, self.timeout_s), start_new_session=True, text=True)
            stdout, stderr = self._wait(proc, call.session)
        finally:
            for stream in (out, err):
                if not isinstance(stream, int):
                    stream.close()
        if self.log_dir is not None:
            stdout, stderr = self._read(call.session, "stdout"), self._read(call.session, "stderr")
        self._record_conversation(call)
        if proc.returncode != 0:
            where = f"; logs in {self.log_dir}/{call.session}.stdout / .stderr" if self.log_dir is not None else ""
            raise AgentProgramFailed(f"agent_command exited {proc.returncode} in session {call.session}{where}; "
                                     f"stderr ends: {stderr[-STDERR_TAIL:].strip()!r}")
        lines = [line for line in stdout.splitlines() if line.strip()]
        return ProgramResult(lines[-1].strip() if lines else "")

    def _streams(self, session: str) -> tuple[IO[str] | int, IO[str] | int]:
        if self.log_dir is None:
            return subprocess.PIPE, subprocess.PIPE
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return (self.log_dir / f"{session}.stdout").open("w"), (self.log_dir / f"{session}.stderr").open("w")

    def _read(self, session: str, kind: str) -> str:
        return (self.log_dir / f"{session}.{kind}").read_text(errors="replace") if self.log_dir is not None else ""

    def _wait(self, proc: subprocess.Popen[str], session: str) -> tuple[str, str]:
        """(stdout, stderr) when piped; the program and everything it started killed past timeout_s."""
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            raise AgentProgramTimeout(f"agent_command ran past sample_timeout_s={self.timeout_s:g} in session {session}; "
                                      "killed with its process group") from None
        return stdout or "", stderr or ""

    def _record_conversation(self, call: DriverCall) -> None:
        sessions = getattr(self.server, "sessions", None)
        held = sessions.get(call.session) if isinstance(sessions, dict) else None
        chat = getattr(held, "chat", None)
        if chat is not None:
            call.sample["conversation"] = list(chat[0])


def program_reward(fallback: Callable[[Any, dict[str, Any]], float]) -> Callable[[Any, dict[str, Any]], float]:
    """The reward of a program's conversation: its last stdout line when that is a number, else
    `fallback(last line, sample)` (the flow's agent_reward; the sample holds `conversation`)."""

    def reward(answer: Any, sample: dict[str, Any]) -> float:
        line = str(answer)
        stated = reward_of(line)
        return stated if stated is not None else float(fallback(line, sample))

    return reward


def failure_column(errors: list[str]) -> list[str]:
    """Episodes' errors as a reward-error column (hfrt.flows.reward_errors): "" for a conversation
    whose program ran to the end, else "agent_command raised on sample I: TYPE: ..." (its kind TYPE)."""
    return [f"agent_command raised on sample {i}: {error}" if error else "" for i, error in enumerate(errors)]
