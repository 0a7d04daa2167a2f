"""Checking a call's arguments against the parameters its daemon declared in hello, before the
controller sends it, with a "did you mean" for a misspelled name.

Everything a check needs is worked out once per endpoint (CallCheck.of), so checking a call that
fits is a length comparison, plus two set operations when it has keywords. It knows protocols' endpoint entries; it knows
nothing of sockets, dispatch or what the endpoints do.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hfrt.protocols.endpoints import EndpointEntry, Param, ParamKind
from hfrt.wire.errors import BadArguments

_POSITIONAL = (ParamKind.POSITIONAL_ONLY, ParamKind.POSITIONAL_OR_KEYWORD)
_BY_KEYWORD = (ParamKind.POSITIONAL_OR_KEYWORD, ParamKind.KEYWORD_ONLY)
_NO_LIMIT = 1 << 30


def did_you_mean(word: str, names: Iterable[str]) -> str:
    """"did you mean 'x'?" (or "'x' or 'y'") when `names` holds close spellings of `word`; else ""."""
    close = difflib.get_close_matches(word, list(names), n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


@dataclass(frozen=True, slots=True)
class CallCheck:
    """One endpoint's parameters, arranged for checking calls.

    where: "role.endpoint", for messages. shape: "(a, b=…, *rest, **options)".
    positional: the names a call may give by position, in order; max_positional: how many it may
    give (None: any, the endpoint takes *args). keywords: the names a call may give by keyword
    (None: any, the endpoint takes **kwargs and declared no names). by_position_only: names that
    must come by position. required: (name, position or -1, may come by keyword) of every
    parameter without a default. fast: (min, max) positional counts that are valid without keywords.
    """

    where: str
    shape: str
    positional: tuple[str, ...]
    max_positional: int | None
    keywords: frozenset[str] | None
    by_position_only: frozenset[str]
    required: tuple[tuple[str, int, bool], ...]
    fast: tuple[int, int]

    @classmethod
    def of(cls, where: str, entry: EndpointEntry) -> CallCheck | None:
        """The check of an endpoint-table entry; None when its daemon did not declare parameters."""
        if entry.params is None:
            return None
        params = entry.params
        positional = tuple(p.name for p in params if p.kind in _POSITIONAL)
        var_args = any(p.kind is ParamKind.VAR_POSITIONAL for p in params)
        var_kwargs = any(p.kind is ParamKind.VAR_KEYWORD for p in params)
        required = tuple(
            (p.name, positional.index(p.name) if p.kind in _POSITIONAL else -1, p.kind in _BY_KEYWORD)
            for p in params
            if not p.has_default and p.kind not in (ParamKind.VAR_POSITIONAL, ParamKind.VAR_KEYWORD)
        )
        named = frozenset(p.name for p in params if p.kind in _BY_KEYWORD)
        keywords = named if not var_kwargs else None if entry.keywords is None else named | frozenset(entry.keywords)
        most = None if var_args else len(positional)
        # without keywords, a call is valid when it gives every required positional: unless one
        # is keyword-only, then none is
        need = _NO_LIMIT if any(pos < 0 for _, pos, _ in required) else len(required)
        by_position_only = frozenset(p.name for p in params if p.kind is ParamKind.POSITIONAL_ONLY)
        fast = (need, _NO_LIMIT if most is None else most)
        return cls(where, _shape(params), positional, most, keywords, by_position_only, required, fast)

    def check(self, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]) -> None:
        """Raise BadArguments unless a call with `args` and `kwargs` fits the parameters. A call
        that fits costs two comparisons, plus (with keywords) two set operations run in C."""
        given = len(args)
        lo, hi = self.fast
        if lo <= given <= hi:
            if not kwargs:
                return
            keywords = self.keywords
            if (keywords is None or keywords.issuperset(kwargs)) and kwargs.keys().isdisjoint(self.positional[:given]):
                return
        self._check_slowly(given, kwargs)

    def _check_slowly(self, given: int, kwargs: dict[str, Any]) -> None:
        most = self.max_positional
        if most is not None and given > most:
            raise BadArguments(f"{self.where}{self.shape} takes {_count(most, 'positional argument')} but {given} were given")
        taken = self.positional[:given]
        for key in kwargs:
            if self.keywords is not None and key not in self.keywords:
                raise BadArguments(self._unknown(key))
            if key in taken and key not in self.by_position_only:
                raise BadArguments(f"{self.where}{self.shape} got multiple values for argument {key!r}")
        missing = [
            name for name, pos, by_keyword in self.required
            if not 0 <= pos < given and not (by_keyword and name in kwargs)
        ]
        if missing:
            names = ", ".join(map(repr, missing))
            raise BadArguments(f"{self.where}{self.shape} is missing required argument(s) {names}")

    def _unknown(self, key: str) -> str:
        accepted = sorted(self.keywords or ())
        if key in self.by_position_only:
            return f"{self.where}{self.shape}: {key!r} is positional-only; give it by position"
        suggestion = did_you_mean(key, accepted)
        head = f"{self.where} got an unexpected keyword argument {key!r}"
        tail = f"accepted: {', '.join(accepted)}" if accepted else "it takes no keyword arguments"
        return f"{head} — {suggestion} {tail[0].upper()}{tail[1:]}" if suggestion else f"{head}; {tail}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _shape(params: tuple[Param, ...]) -> str:
    """`(a, b=…, /, c, *rest, d, **options)` from the parameters, as Python would print them (no defaults' values)."""
    parts: list[str] = []
    kinds = [p.kind for p in params] + [None]
    for i, p in enumerate(params):
        if p.kind is ParamKind.KEYWORD_ONLY and kinds[i - 1] not in (ParamKind.VAR_POSITIONAL, ParamKind.KEYWORD_ONLY):
            parts.append("*")  # the bare star before the first keyword-only one (no *args)
        prefix = {ParamKind.VAR_POSITIONAL: "*", ParamKind.VAR_KEYWORD: "**"}.get(p.kind, "")
        parts.append(prefix + p.name + ("=…" if p.has_default else ""))
        if p.kind is ParamKind.POSITIONAL_ONLY and kinds[i + 1] is not ParamKind.POSITIONAL_ONLY:
            parts.append("/")
    return f"({', '.join(parts)})"
