"""Stop strings of any length, at the text level (as OpenAI and vLLM define them): a response ends
once its decoded text holds one of the strings; the returned text ends before it (or after it,
with include_stop_str_in_output), while the sampled ids keep every token up to the one that
completed it (what the policy sampled, for training).

Two parts: `TextStops` lets an engine stop a row early (it decodes only the tail of what the row
sampled), and `cut_at_stop` is the exact answer for a whole response, also one sampled in chunks
(the ids of its earlier chunks given as `prefix`): the tokens past the completing one are dropped,
which leaves the rest exactly as sampled (each token depends only on those before it). It knows a
decode function and strings; nothing of models, engines or calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Decode = Callable[[Sequence[int]], str]


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(position, string) of the stop string that ends first in `text`, among occurrences that end
    past `start`; None when none does."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, start - len(stop) + 1))
        if at >= 0 and (best is None or at + len(stop) < best[0] + len(best[2])):
            best = (at, at + len(stop), stop)
    return None if best is None else (best[0], best[2])


class TextStops:
    """An engine's early stop on stop strings: `hit(ids)` for a row's sampled ids so far decodes
    only their last tokens (a window long enough for the longest string) and says whether a stop
    string ends in the newest token's text."""

    def __init__(self, decode: Decode, stops: Sequence[str]) -> None:
        self.decode, self.stops = decode, [s for s in stops if s]
        self.window = max((len(s) for s in self.stops), default=0) + 8  # tokens; a token spells at least part of a character

    def hit(self, ids: Sequence[int]) -> bool:
        if not self.stops or not ids:
            return False
        tail = list(ids[-self.window:])
        text, before = self.decode(tail), self.decode(tail[:-1])
        common = len(before) if text.startswith(before) else 0
        return first_stop(text, self.stops, common) is not None


@dataclass(frozen=True)
class Cut:
    """A response cut at its first stop string: how many sampled tokens to keep, the text to
    return, and the text those tokens spell past it (the stop string and what its last token held
    after it; "" when no stop string ended the response)."""

    tokens: int
    text: str
    stopped_by: str = ""
    spelled_past: str = ""


def cut_at_stop(decode: Decode, ids: Sequence[int], stops: Sequence[str], *, prefix: Sequence[int] = (),
                include: bool = False) -> Cut:
    """Where the response `ids` (after `prefix`, its own earlier tokens; their text is not returned)
    first holds a stop string: the fewest tokens whose text completes it, found by bisection on the
    decoded length (a dozen decodes for a long response)."""
    base = decode(prefix) if prefix else ""
    whole = decode(list(prefix) + list(ids))
    own = whole[len(base):] if whole.startswith(base) else whole
    found = first_stop(whole, [s for s in stops if s], len(base)) if stops else None
    if found is None:
        return Cut(len(ids), own)
    at, stop = found
    end = at + len(stop)
    lo, hi = 1, len(ids)
    while lo < hi:  # the fewest tokens whose decoded text reaches past the stop's end
        mid = (lo + hi) // 2
        if len(decode(list(prefix) + list(ids[:mid]))) >= end:
            hi = mid
        else:
            lo = mid + 1
    spelled = decode(list(prefix) + list(ids[:lo]))
    keep_to = end if include else at
    text = spelled[len(base):keep_to] if keep_to >= len(base) else ""
    return Cut(lo, text, stop, spelled[max(keep_to, len(base)):])
