"""Sessions of the OpenAI-compatible endpoint: the calls of one external conversation (prompt ids,
sampled ids, log-probs, weight version), and the Trajectory they make when every call's prompt
extends the previous call's prompt and output token for token.

Pure logic: it knows hfrt.serve.turns.Trajectory and nothing of HTTP, OpenAI fields or rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hfrt.serve.turns import Trajectory


class SessionDrift(ValueError):
    """A call's prompt does not extend the tokens the session holds so far (the client re-rendered
    or re-tokenised the conversation differently), so no exact trajectory exists."""


@dataclass(frozen=True)
class SessionCall:
    """One call of a session: the whole prompt's ids, the sampled ids and their log-probs."""

    prompt_ids: list[int]
    output_ids: list[int]
    log_probs: list[float]
    weight_version: int


@dataclass
class Session:
    """A session's calls in completion order, and `text`: the last call's prompt text plus its
    output text when that prompt was text (a next text prompt that starts with it continues the
    session's ids exactly, see OpenAIServer), or `chat` for a chat call."""

    calls: list[SessionCall] = field(default_factory=list)
    text: str | None = None
    #: the last chat call's messages + the reply as returned, and the tool schemas offered (a
    #: next chat request that extends them continues the session's ids exactly)
    chat: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None

    @property
    def ids(self) -> list[int]:
        """The last call's prompt and output ids (what the next call should extend)."""
        if not self.calls:
            return []
        last = self.calls[-1]
        return last.prompt_ids + last.output_ids


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where a and b differ (the shorter length when one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def build_trajectory(name: str, session: Session) -> Trajectory:
    """The session as one Trajectory: the first call's prompt is the prompt; every later call's
    prompt tokens past the previous call's prompt+output (tool results, user turns) are appended
    with gen_mask 0 and log-prob 0; every sampled token has gen_mask 1 and its log-prob.
    SessionDrift names the session, the call and the first differing position otherwise."""
    if not session.calls:
        raise KeyError(f"session {name!r} has no calls")
    first = session.calls[0]
    t = Trajectory({"session": name}, prompt_ids=list(first.prompt_ids))
    held = list(first.prompt_ids)
    for index, call in enumerate(session.calls):
        if index:
            at = first_difference(held, call.prompt_ids)
            if at < len(held):
                theirs = call.prompt_ids[at] if at < len(call.prompt_ids) else "end of prompt"
                raise SessionDrift(
                    f"session {name!r}: call {index}'s prompt does not extend the tokens of calls 0..{index - 1} "
                    f"(first difference at token {at} of {len(held)}: held {held[at]}, prompt has {theirs}); "
                    "send the previous prompt_token_ids + token_ids as the next prompt's prefix (token-id prompts), "
                    "or extend the previous prompt text + returned text exactly")
            extra = call.prompt_ids[len(held):]
            t.response_ids += extra
            t.gen_mask += [0] * len(extra)
            t.log_probs += [0.0] * len(extra)
        t.response_ids += call.output_ids
        t.gen_mask += [1] * len(call.output_ids)
        t.log_probs += call.log_probs
        t.weight_versions.append(call.weight_version)
        t.turns += 1
        held = call.prompt_ids + call.output_ids
    return t


def build_trajectories(name: str, session: Session) -> list[Trajectory]:
    """The session as exact trajectories for clients that re-render their history (so a call need
    not extend the one before): calls that extend each other token for token form one Trajectory,
    a call that does not starts the next (named NAME, NAME/1, NAME/2, ...)."""
    runs: list[list[SessionCall]] = []
    held: list[int] | None = None
    for call in session.calls:
        if held is None or first_difference(held, call.prompt_ids) < len(held):
            runs.append([])
        runs[-1].append(call)
        held = call.prompt_ids + call.output_ids
    return [build_trajectory(name if i == 0 else f"{name}/{i}", Session(run)) for i, run in enumerate(runs)]
