"""Training text as token ids, the way TRL's SFTTrainer and DPOTrainer tokenise it, and laid out as
the engines' batch (prompt left-padded, completion right-padded, `response_mask` = what the loss
counts).

Rows (non-tensor columns, one row each):
- prompt / completion (TRL's prompt-completion format; `response` is another name for
  `completion`): text, or a chat prompt (messages) with the assistant message(s) that follow it.
  Text: the tokenizer's EOS text ends the completion unless it does already; the prompt is
  tokenised alone and with the completion, and the completion is what follows their common prefix
  (TRL's rule, so a token merging across the boundary is not split). A chat: the prompt rendered
  with the model's chat template and a generation prompt, then prompt + completion rendered whole.
- messages (a conversation): the loss counts the assistant turns only. Each turn's tokens are what
  rendering one message more adds; an assistant turn's are counted from after the header its
  generation prompt renders (so `<assistant>` itself is context, its content and end-of-turn are
  trained), every other turn's are context. The template must render a conversation's prefixes as
  prefixes of it (an error names the row where it does not).
- pairs (prompt, chosen, rejected): each side as a prompt / completion row, the prompt cut where
  both sides' renderings still agree with it (TRL's DPO rule).

It knows tokenizers and chat templates; nothing of engines, losses or the wire.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hfrt.wire.loss_options import SFT_TRUNCATIONS

Tensors = dict[str, torch.Tensor]


class RowError(ValueError):
    """A training row that cannot be tokenised; the message names its data row."""


@dataclass(frozen=True)
class TokenRow:
    """One training sequence: the context, what follows it, and which of those tokens the loss counts."""

    prompt: list[int]
    completion: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.completion)


def is_chat(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and all(isinstance(m, Mapping) for m in value)


def _render(tokenizer: Any, messages: list[Any], where: str, *, generation_prompt: bool = False) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    except Exception as exc:  # a template error names the template's own line: say which row it was
        raise RowError(f"{where}: the chat template could not render it ({type(exc).__name__}: {exc})") from None
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _with_eos(tokenizer: Any, text: str) -> str:
    eos = tokenizer.eos_token
    return text if not eos or text.endswith(eos) else text + eos


def prompt_and_full(tokenizer: Any, prompt: Any, completion: Any, where: str) -> tuple[list[int], list[int]]:
    """(prompt ids, prompt + completion ids) of one prompt / completion row (see the module docstring)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        if not prompt:
            raise RowError(f"{where}: the prompt is empty (the first completion token needs a context)")
        return list(tokenizer(prompt)["input_ids"]), list(tokenizer(prompt + _with_eos(tokenizer, completion))["input_ids"])
    if is_chat(prompt) and is_chat(completion):
        return (_render(tokenizer, list(prompt), where, generation_prompt=True),
                _render(tokenizer, list(prompt) + list(completion), where))
    kinds = f"prompt is {'a chat' if is_chat(prompt) else type(prompt).__name__}, completion is {'a chat' if is_chat(completion) else type(completion).__name__}"
    raise RowError(f"{where}: prompt and completion must both be text or both be chats ({kinds})")


def completion_row(tokenizer: Any, prompt: Any, completion: Any, where: str) -> TokenRow:
    """A prompt / completion row; the loss counts every completion token."""
    prompt_ids, full = prompt_and_full(tokenizer, prompt, completion, where)
    cut = common_prefix(prompt_ids, full)
    if cut == 0 or cut == len(full):
        raise RowError(f"{where}: {'no prompt token' if cut == 0 else 'no completion token'} after tokenising")
    return TokenRow(full[:cut], full[cut:], [1] * (len(full) - cut))


def conversation_row(tokenizer: Any, messages: list[Any], where: str) -> TokenRow:
    """A conversation (messages): the tokens before its first assistant turn's content are the
    prompt; every assistant turn's tokens count, every other turn's (and each assistant header) not."""
    roles = [m.get("role") for m in messages]
    if "assistant" not in roles:
        raise RowError(f"{where}: the conversation has no assistant message to train on (roles {roles})")
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            header = _render(tokenizer, messages[:i], where, generation_prompt=True) if i else []
            _extend(ids, mask, header, 0, where, i)
        after = _render(tokenizer, messages[: i + 1], where)
        _extend(ids, mask, after, int(message.get("role") == "assistant"), where, i)
    start = mask.index(1)
    return TokenRow(ids[:start], ids[start:], mask[start:])


def _extend(ids: list[int], mask: list[int], rendered: list[int], counted: int, where: str, turn: int) -> None:
    """Append what `rendered` adds to `ids` (which it must start with), flagged `counted` in `mask`."""
    if rendered[: len(ids)] != ids:
        raise RowError(f"{where}: the chat template renders messages[:{turn + 1}] without the earlier turns' tokens as "
                       "its start, so the assistant turns cannot be told apart; use a template whose renderings of a "
                       "conversation's prefixes are prefixes of it")
    added = rendered[len(ids):]
    ids += added
    mask += [counted] * len(added)


def sft_row(tokenizer: Any, row: Mapping[str, Any], where: str) -> TokenRow:
    """One SFT row: `messages`, or `prompt` with `completion` (or `response`)."""
    if row.get("messages") is not None:
        if not is_chat(row["messages"]):
            raise RowError(f"{where}: `messages` must be a list of {{role, content}} messages")
        return conversation_row(tokenizer, list(row["messages"]), where)
    completion = row.get("completion", row.get("response"))
    if row.get("prompt") is None or completion is None:
        raise RowError(f"{where}: an SFT row has `messages`, or `prompt` and `completion`; it has {sorted(k for k, v in row.items() if v is not None)}")
    return completion_row(tokenizer, row["prompt"], completion, where)


def pair_rows(tokenizer: Any, prompt: Any, chosen: Any, rejected: Any, where: str) -> tuple[TokenRow, TokenRow]:
    """A preference pair as (chosen, rejected) sequences over one prompt (TRL's DPO rule)."""
    prompt_ids, with_chosen = prompt_and_full(tokenizer, prompt, chosen, f"{where} chosen")
    _, with_rejected = prompt_and_full(tokenizer, prompt, rejected, f"{where} rejected")
    cut = min(common_prefix(prompt_ids, with_chosen), common_prefix(prompt_ids, with_rejected))
    if cut == 0:
        raise RowError(f"{where}: no prompt token after tokenising")
    sides = []
    for name, full in (("chosen", with_chosen), ("rejected", with_rejected)):
        if cut == len(full):
            raise RowError(f"{where} {name}: no completion token after tokenising")
        sides.append(TokenRow(full[:cut], full[cut:], [1] * (len(full) - cut)))
    return sides[0], sides[1]


#: what happens to an SFT row over max_length tokens (hfrt.wire.loss_options.SFT_TRUNCATIONS)
TRUNCATIONS = SFT_TRUNCATIONS


def check_length(seq: TokenRow, max_length: int | None, where: str) -> TokenRow:
    if max_length is not None and len(seq) > max_length:
        raise RowError(f"{where}: {len(seq)} tokens, over max_length {max_length}")
    return seq


def truncate_right(seq: TokenRow, max_length: int) -> TokenRow:
    """`seq`'s first `max_length` tokens (the prompt's start is kept, the completion's end cut).
    A prompt that alone fills max_length keeps max_length − 1 of its tokens and one completion
    token that the loss does not count (TRL drops such a row: here it weighs nothing)."""
    if len(seq) <= max_length:
        return seq
    if len(seq.prompt) >= max_length:
        return TokenRow(seq.prompt[: max_length - 1], seq.completion[:1], [0])
    keep = max_length - len(seq.prompt)
    return TokenRow(seq.prompt, seq.completion[:keep], seq.loss_mask[:keep])


def layout(seqs: Sequence[TokenRow], pad_id: int) -> Tensors:
    """The engines' batch of `seqs`: input_ids / attention_mask [rows, P + R] (prompts left-padded
    to the longest, P; completions right-padded to the longest, R), responses and response_mask
    (the loss mask) [rows, R]."""
    if not seqs:
        raise ValueError("no sequences to lay out")
    width_p = max(len(s.prompt) for s in seqs)
    width_r = max(len(s.completion) for s in seqs)
    input_ids = torch.full((len(seqs), width_p + width_r), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    loss_mask = torch.zeros((len(seqs), width_r), dtype=torch.long)
    for row, s in enumerate(seqs):
        input_ids[row, width_p - len(s.prompt) : width_p] = torch.tensor(s.prompt, dtype=torch.long)
        input_ids[row, width_p : width_p + len(s.completion)] = torch.tensor(s.completion, dtype=torch.long)
        attention[row, width_p - len(s.prompt) : width_p + len(s.completion)] = 1
        loss_mask[row, : len(s.completion)] = torch.tensor(s.loss_mask, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "responses": input_ids[:, width_p:].clone(),
            "response_mask": loss_mask}
