"""Function-based rewards: a registry of rule functions plus user functions named by a string.

A reward function scores one decoded response: `fn(response, ground_truth, **info) -> float`,
where info holds what the function declares as parameters (the names it may declare, and their
check, are roles/reward_inputs.py's). `resolve` turns a spec — a registry name, "package.module:function" or
"path/to/file.py:function" — into a callable; `score_all` runs it over a batch and names the
function and sample when one raises. `token_level_rewards` places each score at the last
response token. This module knows nothing of models, engines or the wire.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hfrt.wire.reasoning_gym_tasks import score as gym_score

RewardFn = Callable[..., float]

REGISTRY: dict[str, RewardFn] = {}


class RewardFunctionError(RuntimeError):
    """A reward function could not be found, or raised / returned a non-number on a sample."""


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        REGISTRY[name] = fn
        return fn

    return wrap


# ------------------------------------------------------------------------------- rule functions

_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def normalize_text(text: str) -> str:
    return " ".join(text.strip().lower().split()).rstrip(".")


def extract_answer(response: str) -> str:
    """The final answer: the last \\boxed{...}, else what follows the last '####', else the text."""
    boxed = _BOXED.findall(response)
    if boxed:
        return boxed[-1]
    if "####" in response:
        return response.rsplit("####", 1)[1]
    return response


def parse_number(text: str) -> float | None:
    """The last number in `text` (commas as thousands separators), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


@register("exact_match")
def exact_match(response: str, ground_truth: Any) -> float:
    """1 when the extracted answer equals the ground truth after whitespace/case normalisation."""
    return float(normalize_text(extract_answer(response)) == normalize_text(str(ground_truth)))


#: numeric_match's tolerance, relative and absolute.
REL_TOL = 1e-6


@register("numeric_match")
def numeric_match(response: str, ground_truth: Any) -> float:
    """1 when the last number of the extracted answer equals the ground truth (within REL_TOL)."""
    got = parse_number(extract_answer(response))
    want = ground_truth if isinstance(ground_truth, (int, float)) else parse_number(str(ground_truth))
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, float(want), rel_tol=REL_TOL, abs_tol=REL_TOL))


_THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


@register("format")
def format_check(response: str, ground_truth: Any = None) -> float:
    """1 when the response is `<think>...</think> <answer>...</answer>` and nothing else."""
    return float(bool(_THINK_ANSWER.match(response)))


@register("boxed_format")
def boxed_format(response: str, ground_truth: Any = None) -> float:
    """1 when the response puts a final answer in \\boxed{...}."""
    return float(bool(_BOXED.search(response)))


#: math-verify's own defaults, in seconds (its `parse(parsing_timeout=5)` and `verify(timeout_seconds=5)`);
#: the reward role's settings `parsing_timeout` / `verify_timeout` change them
MATH_VERIFY_TIMEOUTS = {"parsing_timeout": 5, "verify_timeout": 5}


@register("math_verify")
def math_verify(response: str, ground_truth: Any, settings: Mapping[str, Any] | None = None) -> float:
    """1 when math-verify finds the response's final answer equal to the ground truth: both parsed
    to SymPy (LaTeX, `\\boxed{}` at any depth, fractions, decimals, units dropped, plain expressions)
    and compared symbolically and numerically — what TRL's, open-r1's and verl's math rewards use.
    A ground truth without `$` or `\\boxed` is read as LaTeX math (`$...$`); one math-verify cannot
    parse is an error naming it. Runs math-verify's signal-based timeouts (MATH_VERIFY_TIMEOUTS,
    from the role's `settings`), so it must run on the daemon's main thread, as `score` does."""
    from math_verify import parse, verify

    parsing_timeout, verify_timeout = _timeouts(settings or {})
    text = str(ground_truth)
    gold = parse(text if ("$" in text or "\\boxed" in text) else f"${text}$", fallback_mode="no_fallback",
                 parsing_timeout=parsing_timeout)
    if not gold:
        raise ValueError(f"math_verify cannot parse the ground truth {text!r} as math")
    answer = parse(response, parsing_timeout=parsing_timeout)
    return float(bool(answer) and verify(gold, answer, timeout_seconds=verify_timeout))


def _timeouts(settings: Mapping[str, Any]) -> tuple[int, int]:
    """math_verify's (parsing, verification) timeouts: whole seconds, at least 1 (signal.alarm's unit)."""
    out = []
    for key, default in MATH_VERIFY_TIMEOUTS.items():
        value = settings.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"math_verify: settings.{key}={value!r} must be a whole number of seconds, at least 1")
        out.append(value)
    return out[0], out[1]


@register("reasoning_gym")
def reasoning_gym(response: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """A reasoning-gym task's own `score_answer` of the response's last `<answer>...</answer>`,
    against the entry the row's extra_info names (rows of `data = "reasoning_gym:TASK"` carry it)."""
    return gym_score(response, ground_truth, extra_info or {})


# ------------------------------------------------------------------------------------- lookup


def _load_module(spec: str, module_part: str) -> Any:
    if module_part.endswith(".py"):
        path = Path(module_part).expanduser()
        if not path.is_file():
            raise RewardFunctionError(f"reward function {spec!r}: file {path} does not exist")
        loader_spec = importlib.util.spec_from_file_location(f"hfrt_user_reward_{path.stem}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise RewardFunctionError(f"reward function {spec!r}: cannot load {path}")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(module_part)
    except ImportError as exc:
        raise RewardFunctionError(f"reward function {spec!r}: cannot import {module_part}: {exc}") from exc


def resolve(spec: str) -> RewardFn:
    """A registry name, "module:function" or "file.py:function" → the function (or a clear error)."""
    if spec in REGISTRY:
        return REGISTRY[spec]
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        known = ", ".join(sorted(REGISTRY))
        raise RewardFunctionError(
            f"unknown reward function {spec!r}: use one of {known}, module:function or file.py:function"
        )
    fn = getattr(_load_module(spec, module_part), name, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r}: {module_part} has no function {name!r}")
    return fn


def _accepted(fn: RewardFn, info: Mapping[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(info)
    return {k: v for k, v in info.items() if k in params}


def score_all(
    fn: RewardFn,
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    infos: Sequence[Mapping[str, Any]] | None = None,
    name: str | None = None,
    *,
    error_score: float | None = None,
    errors: list[str] | None = None,
) -> list[float]:
    """fn over every sample. A sample on which fn raises or returns a non-finite / non-number
    value is an error naming fn and the sample: raised (error_score None), or scored
    `error_score` with the message appended to `errors` ("" for the samples that scored). The
    first sample of each kind of error (the exception's type; a non-number return) in the call
    also carries the traceback, on the lines after its one-line message — what the controller
    shows once per kind (hfrt/flows/reward_errors.py)."""
    label: str = name or str(getattr(fn, "__qualname__", repr(fn)))
    infos = infos if infos is not None else [{}] * len(responses)
    scores = []
    kinds: set[str] = set()
    for index, (response, truth, info) in enumerate(zip(responses, ground_truths, infos, strict=True)):
        try:
            scores.append(_one_score(fn, label, index, response, truth, info))
            problem = ""
        except RewardFunctionError as exc:
            if error_score is None:
                raise
            scores.append(float(error_score))
            problem = str(exc)
            kind = type(exc.__cause__).__name__ if exc.__cause__ is not None else "non-number"
            if kind not in kinds:
                kinds.add(kind)
                problem += "\n" + _traceback(exc)
        if errors is not None:
            errors.append(problem)
    return scores


def _traceback(exc: RewardFunctionError) -> str:
    """The user function's traceback (from the call into it on), or the message of a bad return."""
    cause = exc.__cause__
    if cause is None:
        return f"RewardFunctionError: {exc}"
    return "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)).rstrip()


def _one_score(fn: RewardFn, label: str, index: int, response: str, truth: Any, info: Mapping[str, Any]) -> float:
    try:
        value = fn(response, truth, **_accepted(fn, info))
    except Exception as exc:
        raise RewardFunctionError(f"reward function {label} raised on sample {index}: {type(exc).__name__}: {exc}") from exc
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardFunctionError(f"reward function {label} returned {value!r} for sample {index}, not a finite number")
    return float(value)


def token_level_rewards(scores: Sequence[float] | torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N, R] zeros with each row's score at its last response token (rows with no token get none)."""
    scores_t = torch.as_tensor(scores, dtype=torch.float32)
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    lengths = response_mask.long().sum(dim=-1)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    rewards[rows, lengths[rows] - 1] = scores_t[rows]
    return rewards
