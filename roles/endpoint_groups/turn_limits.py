"""What a turn may ask of a generating role's context: the one context check of a request (its
prompt tokens plus its max_tokens against the model's context, both named in the refusal), and the
byte-level cap that refuses text the context cannot hold before any of it is tokenised.

The cap is exact, not a guess: no token of the vocabulary decodes to more than `max_token_bytes`
bytes, so a text of more than context × max_token_bytes bytes is more tokens than the context
holds. It knows a tokenizer's vocabulary and the shapes of appended items; nothing of engines or calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hfrt.wire.errors import ContextTooLong


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes any token of the vocabulary spells (special tokens included): an upper
    bound of the bytes one token covers (byte-fallback tokens such as `<0x0A>` overcount, which only
    loosens the cap)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(str(t).encode("utf-8")) for t in tokens if t is not None), default=1) or 1


def item_bytes(item: Any) -> int:
    """The UTF-8 bytes of an appended item's own text (a string, or a chat item's message contents):
    the template only adds to it, so its tokens are at least item_bytes / max_token_bytes."""
    if isinstance(item, str):
        return len(item.encode("utf-8", "surrogatepass"))
    if isinstance(item, Mapping):
        total = 0
        for message in item.get("messages") or []:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                total += len(content.encode("utf-8", "surrogatepass"))
        return total
    return 0


def check_text_size(append: list[Any], context_tokens: int | None, token_bytes: int) -> None:
    """ContextTooLong, before tokenising, when the appended text alone is more bytes than the model's
    context can hold as tokens (context_tokens × token_bytes); nothing when the context is unknown."""
    if context_tokens is None:
        return
    cap = context_tokens * token_bytes
    size = sum(item_bytes(a) for a in append)
    if size > cap:
        raise ContextTooLong("prompt", f"prompt: the text is {size} bytes, more than the model's context of {context_tokens} tokens can hold "
                         f"(no token spans more than {token_bytes} bytes, so at most {cap} bytes fit)")


def check_request_length(prompt_tokens: int, max_tokens: int, context_tokens: int | None) -> None:
    """ContextTooLong naming the request's own numbers when its prompt plus max_tokens passes the context."""
    if context_tokens is not None and prompt_tokens + max_tokens > context_tokens:
        raise ContextTooLong("prompt", f"prompt: the model's context is {context_tokens} tokens, and this request asks for "
                         f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} for max_tokens): "
                         "shorten the prompt or lower max_tokens")
