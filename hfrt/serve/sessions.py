"""Sessions of the OpenAI-compatible endpoint: the calls of one external conversation (prompt ids,
sampled ids, log-probs, weight version), and the Trajectory they make when every call's prompt
extends the previous call's prompt and output token for token.

It knows hfrt.serve.turns.Trajectory and nothing of HTTP, OpenAI fields or rewards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hfrt.log import get_logger
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
    #: the last call's reply text as returned (its content, for a chat)
    answer: str | None = None

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


class SessionStore:
    """The sessions of one server by name, in the order they were opened: at most `max_sessions`
    (the oldest is dropped to make room, counted in `dropped` and logged), each kept until ended.

    It knows the TurnRequest fields a session continues from (text prompt, chat messages and
    tools) and what a call leaves (its prompt ids, sampled ids, log-probs and the text or reply
    as returned); nothing of HTTP or the rollout role."""

    def __init__(self, max_sessions: int = 10_000, on_drop: Callable[[str, Session], None] | None = None) -> None:
        self.sessions: dict[str, Session] = {}
        self.max_sessions, self.dropped = max_sessions, 0
        self.on_drop = on_drop  # told of a session dropped to make room (a recorder writes it)

    def held(self, name: str | None) -> Session | None:
        return self.sessions.get(name) if name else None

    def trajectory(self, name: str) -> Trajectory:
        """The session's calls as one Trajectory (gen_mask 1 exactly on sampled tokens); KeyError
        for an unknown session, SessionDrift when a call's prompt does not extend the previous ids."""
        return build_trajectory(name, self._known(name))

    def trajectories(self, name: str) -> list[Trajectory]:
        """The session as exact trajectories even when its client re-renders its history (an agent
        framework that rewrites earlier turns): see build_trajectories."""
        return build_trajectories(name, self._known(name))

    def end(self, name: str) -> Trajectory:
        """trajectory(name), then forget the session."""
        t = self.trajectory(name)
        del self.sessions[name]
        return t

    def _known(self, name: str) -> Session:
        if name not in self.sessions:
            raise KeyError(f"no session {name!r} (known: {sorted(self.sessions)[:10]})")
        return self.sessions[name]

    def pop(self, name: str) -> Session:
        """Forget session `name` and return it (KeyError naming it when unknown)."""
        session = self._known(name)
        del self.sessions[name]
        return session

    def record(self, name: str, call: SessionCall, *, text: str | None = None,
               chat: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None, answer: str | None = None) -> None:
        """Append `call` to session `name` (made on first use), with what a next request continues
        from: `text` (the prompt text and output as the ids spell them) or `chat` (the messages and
        the reply as returned, and the tool schemas offered)."""
        if name not in self.sessions and len(self.sessions) >= self.max_sessions:
            oldest = next(iter(self.sessions))
            dropped = self.sessions.pop(oldest)
            self.dropped += 1
            get_logger(part="openai_server").warning("session_dropped", session=oldest, max_sessions=self.max_sessions)
            if self.on_drop is not None:
                self.on_drop(oldest, dropped)
        session = self.sessions.setdefault(name, Session())
        session.calls.append(call)
        session.text, session.chat, session.answer = text, chat, answer

    @staticmethod
    def continuation(session: Session | None, context: list[int], append: list[Any], *, text_prompt: str | None = None,
                     messages: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
                     prefill: str = "", template: str | None = None) -> tuple[list[int], list[Any]]:
        """The (context ids, append items) to send: a session's exact ids when the request extends
        what it holds — a text prompt that starts with the last prompt text + output text (only
        the new text is tokenised), or chat messages that start with the last messages + the reply
        as returned, with the same tools (only what the chat template renders past them is
        tokenised) — else the request's own `context` and `append`."""
        if session is None or not session.calls:
            return context, append
        if text_prompt is not None and session.text is not None and text_prompt.startswith(session.text):
            rest = text_prompt[len(session.text):]
            return session.ids, [rest] if rest else []
        if messages is not None and session.chat is not None:
            held, offered = session.chat
            if len(messages) > len(held) and messages[:len(held)] == held and (tools or []) == offered:
                item = {"messages": messages, "tools": offered or None, "after": len(held), **({"template": template} if template else {})}
                return session.ids, [item, prefill] if prefill else [item]
        return context, append
