"""The context check of a turn request and the byte cap before tokenising (roles/endpoint_groups/turn_limits.py):
pure functions on a stand-in tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from hfrt.roles.endpoint_groups.turn_limits import check_request_length, check_text_size, item_bytes, max_token_bytes


class Vocab:
    """A tokenizer's vocabulary as convert_ids_to_tokens sees it."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[Any]:
        return [self.tokens[i] for i in ids]


def test_the_longest_token_bounds_the_bytes_a_token_covers() -> None:
    assert max_token_bytes(Vocab(["a", "bc", "<|im_start|>", "é"])) == len("<|im_start|>")
    assert max_token_bytes(Vocab(["é"])) == 2  # UTF-8 bytes, not characters


def test_text_the_context_cannot_hold_is_refused_naming_the_numbers() -> None:
    check_text_size(["x" * 100], 20, 5)  # 100 bytes <= 20 tokens x 5 bytes
    with pytest.raises(ValueError, match=r"the text is 101 bytes, more than the model's context of 20 tokens can hold .* at most 100 bytes"):
        check_text_size(["x" * 50, {"messages": [{"role": "user", "content": "y" * 51}]}], 20, 5)
    check_text_size(["x" * 10**6], None, 5)  # an unknown context: no cap
    assert item_bytes({"messages": [{"role": "user", "content": "é"}, {"role": "assistant", "content": None}]}) == 2


def test_the_request_length_check_names_the_requests_own_numbers() -> None:
    check_request_length(112, 400, 512)
    with pytest.raises(ValueError, match=r"context is 512 tokens, and this request asks for 618 \(218 in the prompt, 400 for max_tokens\)"):
        check_request_length(218, 400, 512)
    check_request_length(10**6, 10**6, None)
