"""Stop strings at the text level and logits shaping (roles/generation/stops.py, logits.py): pure
functions on a stand-in decode (ids are character codes; 0 is a token that spells nothing)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from hfrt.roles.generation.logits import Shaper, bias_vector
from hfrt.roles.generation.stops import TextStops, cut_at_stop, first_stop


def decode(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids if i)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_first_stop_to_end_wins_and_earlier_text_is_not_searched_again() -> None:
    assert first_stop("I add.\nObservation: 5", ["Observation:", "add"]) == (2, "add")
    assert first_stop("xObservation:", ["Observation:"], start=12) == (1, "Observation:")  # ends past start
    assert first_stop("Observation: x", ["Observation:"], start=12) is None  # ended at start, not past it


def test_a_response_is_cut_at_the_token_that_completes_the_stop() -> None:
    cut = cut_at_stop(decode, ids("Thought: add\nObservation: 5\nmore"), ["Observation:"])
    assert cut.tokens == len("Thought: add\nObservation:") and cut.text == "Thought: add\n"
    assert cut.stopped_by == "Observation:" and cut.spelled_past == "Observation:"
    kept = cut_at_stop(decode, ids("ab\nObservation: 5"), ["Observation:"], include=True)
    assert kept.text == "ab\nObservation:" and kept.spelled_past == ""
    assert cut_at_stop(decode, ids("no stop here"), ["Observation:"]) == cut_at_stop(decode, ids("no stop here"), [])
    # a response sampled in chunks: the stop began in the earlier chunk (the prefix)
    chunked = cut_at_stop(decode, ids("vation: 5"), ["Observation:"], prefix=ids("so Obser"))
    assert chunked.tokens == len("vation:") and chunked.text == "" and chunked.spelled_past == "vation:"
    # a token that spells the stop and more: the text past the stop is cut, the token kept
    whole = cut_at_stop(lambda t: "".join({1: "ab", 2: "c:\nx"}[i] for i in t), [1, 2, 1], ["c:"])
    assert (whole.tokens, whole.text, whole.spelled_past) == (2, "ab", "c:\nx")


def test_the_engines_early_stop_looks_at_the_newest_tokens_only() -> None:
    stops = TextStops(decode, ["Observation:"])
    assert not stops.hit(ids("I add. Observation"))
    assert stops.hit(ids("I add. Observation:"))
    assert not stops.hit(ids("Observation: 5 and more"))  # it ended before the newest token: not new
    assert not TextStops(decode, []).hit(ids("x"))


def test_bias_and_penalties_shape_the_logits_as_openai_defines_them() -> None:
    shaper = Shaper(1, presence=0.5, frequency=1.0, bias={2: 3.0})
    logits = torch.zeros(1, 4)
    assert shaper.shape(logits).tolist() == [[0.0, 0.0, 3.0, 0.0]]
    for token in (1, 1, 3):
        shaper.observe(torch.tensor([token]), torch.tensor([True]), 4)
    assert shaper.shape(logits).tolist() == [[0.0, -2.5, 3.0, -1.5]]  # 2 x frequency + presence; 1 x frequency + presence
    shaper.observe(torch.tensor([2]), torch.tensor([False]), 4)  # a finished row's pad does not count
    assert shaper.shape(logits)[0, 2].item() == 3.0
    with pytest.raises(ValueError, match=r"logit_bias: token id 9 is outside the vocabulary \[0, 4\)"):
        bias_vector({9: 1.0}, 4, torch.device("cpu"))
    assert not Shaper.needed(0.0, 0.0, None, None) and Shaper.needed(0.0, 0.0, {1: 1.0}, None)
