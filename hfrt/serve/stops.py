"""Stop strings in a streamed response: text is sent as it is sampled, except what could still
turn out to be (the start of) a stop string — a client never sees stop text it did not ask for
(`include_stop_str_in_output`), even when the string spans several tokens or chunks. The rollout
daemon cuts the whole turn's text (roles/generation/stops.py); what was held back and is not stop
text goes out at the end, as the difference between that text and what was sent.

Pure logic: it knows strings; nothing of tokens, HTTP or the rollout role.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopHoldback:
    """`feed(piece)` → the text that may be sent now; after a stop string is seen, nothing more."""

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops, self.include = [s for s in stops if s], include
        self.text, self.sent, self.stopped = "", 0, False

    def feed(self, piece: str) -> str:
        if self.stopped or not self.stops:
            if self.stopped:
                return ""
            self.text += piece
            self.sent = len(self.text)
            return piece
        self.text += piece
        end = self._stop_end()
        if end is not None:
            self.stopped = True
            safe = end
        else:
            safe = len(self.text) - self._held()
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def _stop_end(self) -> int | None:
        """Where sending must end because of a stop string now in the text (None: none is)."""
        best: int | None = None
        for stop in self.stops:
            at = self.text.find(stop)
            if at >= 0:
                end = at + len(stop) if self.include else at
                best = end if best is None else min(best, end)
        return best

    def _held(self) -> int:
        """The longest end of the text that is the start of a stop string (it may yet become one)."""
        held = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:n]):
                    held = n
                    break
        return held
