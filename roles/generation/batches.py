"""Between a prompts Batch and a generation engine: prompt tokenisation, and the actor's rollout
Batch built from an engine's output — fixed widths, decoded responses, the input's other columns
carried to every sample, and the response-length figures over the role's ranks.

Fixed widths: every rank of an actor group pads prompts to the group's widest prompt and
responses to `max_new_tokens`, so the shards of one rollout stack into one batch wherever they
are pulled. It knows nothing of engine internals, training or the wire.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hfrt.daemon.batch import Batch
from hfrt.roles.generation.hf import assemble
from hfrt.roles.rows import all_reduce

#: Tensor columns of a rollout (the sampler's log-probs are `rollout_log_probs`).
ROLLOUT_COLUMNS = (
    "prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids", "rollout_log_probs",
)
#: Non-tensor columns a rollout adds to those carried from the prompts batch.
ROLLOUT_TEXT = ("response",)


def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of one prompt: a string (tokenised as is), a chat (a list of {"role", "content"}
    messages, rendered with the tokenizer's chat template and a generation prompt), or ids."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise TypeError(f"a prompt must be a string, a chat (list of messages) or token ids, not {prompt!r:.80}")


def encode_prompts(tokenizer: Any, prompts: Sequence[Any], limit: int | None, where: str) -> list[list[int]]:
    """Token ids of every prompt (encode_prompt); ValueError naming the first row longer than
    `limit` tokens (sampling.max_prompt_tokens; None: no limit)."""
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    if limit is not None:
        for row, one in enumerate(ids):
            if len(one) > limit:
                raise ValueError(f"{where}: prompt row {row} is {len(one)} tokens, more than sampling.max_prompt_tokens={limit}")
    return ids


def _left(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)


def _right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def fixed_width(
    out: Mapping[str, torch.Tensor], *, prompt_width: int, response_width: int, pad_id: int, n: int
) -> dict[str, torch.Tensor]:
    """A generation engine's output (roles/generation/hf.py layout) padded to the given widths, with
    the sampler's log-probs renamed `rollout_log_probs` and the rank-local prompt_index dropped."""
    width = out["prompts"].shape[1]
    prompt_mask = out["attention_mask"][:, :width]
    record = assemble(
        _left(out["prompts"], prompt_width, pad_id),
        _left(prompt_mask, prompt_width, 0),
        _right(out["responses"], response_width, pad_id),
        _right(out["response_mask"], response_width, 0),
        _right(out["log_probs"], response_width, 0.0),
        n,
    )
    record.pop("prompt_index")
    record["rollout_log_probs"] = record.pop("log_probs")
    return record


def decode_responses(tokenizer: Any, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
    rows = [r[m.bool()].tolist() for r, m in zip(responses, mask, strict=True)]
    return list(tokenizer.batch_decode(rows, skip_special_tokens=True))


def with_uids(batch: Batch) -> Batch:
    """The prompts batch with a fresh `uid` per prompt unless it has one (groups samples for GRPO)."""
    if "uid" in batch:
        return batch
    out = batch[:]
    out["uid"] = [uuid.uuid4().hex for _ in range(len(batch))]
    return out


def rollout_batch(
    record: Mapping[str, torch.Tensor], texts: list[str], prompts: Batch, n: int, meta: Mapping[str, Any]
) -> Batch:
    """The rollout Batch: generation columns, `response` text, and every column of `prompts`
    repeated n times (samples of a prompt are adjacent), except names the rollout itself uses."""
    carried = prompts.repeat(n, interleave=True)
    own = set(record) | set(ROLLOUT_TEXT)
    tensors = {**{k: v for k, v in carried.tensors.items() if k not in own}, **record}
    non_tensor = {**{k: v for k, v in carried.non_tensor.items() if k not in own}, "response": texts}
    return Batch(tensors, non_tensor, {**prompts.meta, **meta})


def length_stats(response_mask: torch.Tensor, max_new_tokens: int) -> dict[str, float]:
    """Response length mean / max / min over every rank's rows, the tokens generated, and the
    share of responses cut at max_new_tokens (collective over the role's group)."""
    lengths = response_mask.long().sum(-1).double()
    rows, tokens, clipped = all_reduce([len(lengths), float(lengths.sum()), float((lengths >= max_new_tokens).sum())], "sum")
    [longest] = all_reduce([float(lengths.max()) if len(lengths) else 0.0], "max")
    [shortest] = all_reduce([float(lengths.min()) if len(lengths) else float(max_new_tokens)], "min")
    return {
        "response_length/mean": tokens / max(rows, 1), "response_length/max": longest,
        "response_length/min": shortest, "response_length/clip_ratio": clipped / max(rows, 1),
        "response_tokens": tokens,
    }


def chunk_bounds(chunk: int | None, chunks: int, rows: int) -> tuple[int, int]:
    """[start, stop) of chunk `chunk` — the chunk-th of `chunks` contiguous, nearly equal parts of
    `rows` prompts (the first parts one shorter when they do not divide); (0, rows) for None."""
    if chunk is None:
        return 0, rows
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (chunk, chunks)) or not 0 <= chunk < chunks:
        raise ValueError(f"generate: need 0 <= chunk < chunks, got chunk={chunk!r}, chunks={chunks!r}")
    return chunk * rows // chunks, (chunk + 1) * rows // chunks
