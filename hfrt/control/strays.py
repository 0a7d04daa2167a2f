"""Signed replies and errors whose call id is not pending at the controller: counted, never silent.

A late one answers a call this controller gave up on (cancelled, timed out, or its daemon declared
gone): normal after a cancel, counted as `late_replies`. Any other (an id never sent, or no longer
remembered) is counted as `unmatched_replies` and the first from each peer is logged as a warning
(a confused or hostile peer holding the key sends thousands; one line each is enough). It knows
call ids and peers; nothing of sockets or calls' contents.
"""

from __future__ import annotations

from typing import Any

#: call ids given up on that are remembered (oldest forgotten first)
REMEMBER = 4096


class StrayReplies:
    def __init__(self, stats: dict[str, int], log: Any) -> None:
        self._stats, self._log = stats, log
        stats.setdefault("late_replies", 0)
        stats.setdefault("unmatched_replies", 0)
        self._given_up: dict[int, None] = {}  # insertion-ordered set
        self._logged: set[bytes] = set()

    def given_up(self, call_id: int) -> None:
        """The controller stopped waiting for `call_id` (cancelled, timed out, daemon gone)."""
        self._given_up[call_id] = None
        if len(self._given_up) > REMEMBER:
            del self._given_up[next(iter(self._given_up))]

    def arrived(self, ident: bytes, call_id: int, kind: str) -> None:
        """A signed `kind` ("reply" / "error") for `call_id`, which is not pending, came from `ident`."""
        if call_id in self._given_up:  # answered once: a replay of it counts as unmatched
            del self._given_up[call_id]
            self._stats["late_replies"] += 1
            return
        self._stats["unmatched_replies"] += 1
        if ident not in self._logged:  # later ones from this peer are only counted
            self._logged.add(ident)
            self._log.warning("unmatched_reply", peer=ident.decode("utf-8", "replace"), kind=kind, call_id=call_id,
                              why="no call with this id is pending or was given up on (never sent, or not ours)")
