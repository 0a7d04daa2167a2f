"""verifiers environments as agent programs: the agent_openai flow's `verifiers_env` setting
turned into the command it runs once per conversation — verifiers_host/runner.py under the
verifiers venv's Python (`verifiers_python`, `.venv-verifiers/bin/python` by default), which
loads the environment, runs one episode of one of its tasks against the flow's endpoint and
prints the task's reward — plus the check that the environment loads before training starts.

Controller-side (no torch, no verifiers: that lives in its own venv, whose `openai<3` and
`mcp==2.0.0` pins cannot sit beside hfrt's). It knows paths, the runner's command line and the
task numbering of a step's samples; nothing of verifiers' API.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path
from typing import Any

#: the program run once per conversation, with the verifiers venv's Python
RUNNER = Path(__file__).resolve().parent / "verifiers_host" / "runner.py"
#: where `.ci/install` puts the verifiers venv (relative to the working directory or hfrt's checkout)
DEFAULT_PYTHON = Path(".venv-verifiers") / "bin" / "python"
#: the verifiers release the runner is written against (its v1 API)
VERIFIERS_VERSION = "0.4.0"
#: seconds the load check may take (importing verifiers takes several on a busy CPU)
CHECK_TIMEOUT_S = 180.0


def find_python(given: str) -> Path:
    """The verifiers venv's interpreter: `given`, else DEFAULT_PYTHON under the working directory
    or hfrt's checkout; ValueError naming what was tried otherwise."""
    if given:
        path = Path(given).expanduser()
        if not path.exists():
            raise ValueError(f"config verifiers_python={given!r}: no such file")
        return path.absolute()
    tried = [Path.cwd() / DEFAULT_PYTHON, Path(__file__).resolve().parents[3] / DEFAULT_PYTHON]
    for path in tried:
        if path.exists():
            return path
    raise ValueError(f"config verifiers_env needs a virtualenv with verifiers=={VERIFIERS_VERSION} (none at "
                     f"{', '.join(map(str, tried))}): `bash .ci/install` makes .venv-verifiers, or set verifiers_python")


def env_argument(env: str) -> str:
    """`env` as the runner gets it: a .py file made absolute (the runner may start elsewhere)."""
    if not env.strip():
        raise ValueError(f"config verifiers_env={env!r}: give a verifiers taskset id or a path to a .py file")
    return str(Path(env).expanduser().absolute()) if env.endswith(".py") else env


def runner_argv(python: Path, env: str, args: dict[str, Any], max_turns: int) -> list[str]:
    """The runner's command line for one conversation (the sample's `example` picks the task)."""
    return [str(python), str(RUNNER), "--env", env_argument(env), "--args", json.dumps(args), "--max-turns", str(max_turns)]


def verifiers_command(python: Path, env: str, args: dict[str, Any], max_turns: int) -> str:
    """runner_argv as the shell command agent_command runs."""
    return shlex.join(runner_argv(python, env, args, max_turns))


def check_environment(python: Path, env: str, args: dict[str, Any]) -> dict[str, Any]:
    """Load the environment once (`runner.py --check`) and return what it says (env, taskset,
    tasks, seat); ValueError with the runner's reason when it does not load."""
    argv = [*runner_argv(python, env, args, 1), "--check"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        reason = [line for line in proc.stderr.splitlines() if line.startswith("refused: ")]
        detail = reason[-1].removeprefix("refused: ") if reason else proc.stderr.strip()[-1500:]
        raise ValueError(f"config verifiers_env={env!r} does not load with {python}: {detail}")
    return dict(json.loads(lines[-1]))


def number_examples(samples: list[dict[str, Any]], step: int, prompts_per_step: int, n: int) -> None:
    """Give each sample its task index, `example`: the step's prompt groups take tasks
    step * prompts_per_step, +1, ... in the taskset's order (the runner wraps around it), and
    the n conversations of a group share their group's task, as GRPO's advantages need."""
    for k, sample in enumerate(samples):
        sample["example"] = step * prompts_per_step + k // n
