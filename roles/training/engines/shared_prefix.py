"""Shared-prefix micro-batches: rows whose real tokens begin alike (a group's n samples of one
prompt, a conversation's later turns, prompts under one long system prompt) run that prefix once
and each row's rest on top of its KV cache.

How: the prefixes of a micro-batch's groups go through the model as one left-padded batch
[groups, Lp] with a transformers DynamicCache; the cache is then selected out to the rows
(`batch_select_indices`, a differentiable gather) and the continuations [rows, S] run against it
with positions continuing after each row's prefix. Autograd through the gather sums the gradient
of every continuation into its prefix, so log-probs, entropies, losses and gradients are the
unshared pass's at fp32 rounding. A row's prefix ends before its last prompt token (whose logits
predict the first response token), so no prefix logits are ever needed.

Grouping, per micro-batch (sharing never crosses micro-batches): rows are keyed either by their
whole prompt (GRPO's n samples: the prefix is the prompt less its last token) or by their first
`min_tokens` tokens (a shared system prompt: the prefix is the members' longest common prefix);
the grouping that computes fewer tokens wins, and the micro-batch shares only when some group of
two or more rows shares `min_tokens` tokens and the shared pass computes at most SAVING of the
trimmed pass's tokens. Rows must be laid out as engines/base.py's batch with contiguous real
tokens and positions 0, 1, ... (batching.packable's rule) and prompts of two tokens or more.

It knows that batch layout, transformers' cache and engines/model_pass.py (which runs every other
micro-batch); nothing of engines, ranks, losses or the wire.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hfrt.roles.training import batching
from hfrt.roles.training.engines.model_pass import PLAIN_PASS, ForwardOutput, PassOptions, from_logits, model_forward

#: in a shared-prefix micro-batch: the groups' prefixes [G, Lp] (left-padded), their mask and positions
PREFIX_IDS = "prefix_input_ids"
PREFIX_MASK = "prefix_attention_mask"
PREFIX_POSITIONS = "prefix_position_ids"
#: [rows]: the prefix (group) of each row
OWNER = "prefix_owner"
#: [rows, r]: the continuation position whose logits predict each response column (clamped past a row's end)
READ_AT = "prefix_read_at"
#: a micro-batch shares only when it computes at most this share of the trimmed pass's tokens
SAVING = 0.9
#: the default of engine.shared_prefix_min_tokens: the fewest tokens a group must share
MIN_TOKENS = 32


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot run shared-prefix passes (None: it can): it must be a transformers
    causal LM whose cache keeps every past position (DynamicLayer only, no sliding window)."""
    from hfrt.roles.models import ValueModel

    if isinstance(model, ValueModel):
        return "a value model (its head reads hidden states of every position; no cached-prefix path)"
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return f"{type(model).__name__} has no transformers config"
    try:
        from transformers import DynamicCache

        kinds = sorted({type(layer).__name__ for layer in DynamicCache(config=config).layers})
    except Exception as exc:  # a config transformers builds no DynamicCache for
        return f"transformers builds no DynamicCache for {type(config).__name__} ({type(exc).__name__}: {exc})"
    if kinds != ["DynamicLayer"]:
        return f"its cache layers are {', '.join(kinds)} (sliding-window or linear attention keep no whole prefix)"
    return None


def _grouping(seqs: Sequence[torch.Tensor], caps: Sequence[int], key_len: int | None) -> list[tuple[list[int], int]]:
    """(members, shared prefix length) of each group: rows keyed by their first `key_len` tokens
    (None: their whole cap), the prefix their longest common one within every member's cap."""
    keyed: dict[Any, list[int]] = {}
    for i, seq in enumerate(seqs):
        n = caps[i] if key_len is None else key_len
        key = tuple(seq[:n].tolist()) if caps[i] >= n else ("alone", i)
        keyed.setdefault((n, key), []).append(i)
    out = []
    for members in keyed.values():
        cap = min(caps[i] for i in members)
        if len(members) > 1:
            stack = torch.stack([seqs[i][:cap] for i in members])
            same = (stack == stack[0]).all(0)
            cap = cap if bool(same.all()) else int(same.int().argmin())
        out.append((members, cap))
    return out


def _cost(groups: list[tuple[list[int], int]], totals: Sequence[int]) -> int:
    """Tokens the two passes compute: groups × longest prefix + rows × longest continuation."""
    longest = max(length for _, length in groups)
    rest = max(totals[i] - length for members, length in groups for i in members)
    return len(groups) * longest + len(totals) * rest


def micro(
    batch: Mapping[str, torch.Tensor], rows: Sequence[int], lengths: batching.Lengths, min_tokens: int
) -> batching.Micro | None:
    """The rows' shared-prefix Micro, or None where sharing does not pay (see the module docstring;
    the caller checked batching.packable)."""
    width = int(batch["responses"].shape[1])
    start = int(batch["input_ids"].shape[1]) - width
    prompts = [lengths.prompt[r] for r in rows]
    responses = [max(lengths.response[r], 1) for r in rows]
    if len(rows) < 2 or min(prompts) < 2 or batching.ROUTED_EXPERTS in batch:  # a recorded MoE routing: not cut here
        return None
    seqs = [batch["input_ids"][r, start - p : start + n] for r, p, n in zip(rows, prompts, responses, strict=True)]
    caps = [p - 1 for p in prompts]
    totals = [p + n for p, n in zip(prompts, responses, strict=True)]
    candidates = [_grouping(seqs, caps, None), _grouping(seqs, caps, min_tokens)]
    groups = min(candidates, key=lambda g: _cost(g, totals))
    if not any(len(m) > 1 and length >= min_tokens for m, length in groups):
        return None
    if _cost(groups, totals) > SAVING * len(rows) * (max(prompts) + max(responses)):
        return None
    return _build(batch, rows, seqs, groups, prompts, responses)


def _build(
    batch: Mapping[str, torch.Tensor],
    rows: Sequence[int],
    seqs: Sequence[torch.Tensor],
    groups: list[tuple[list[int], int]],
    prompts: Sequence[int],
    responses: Sequence[int],
) -> batching.Micro:
    """The Micro of a grouping: prefixes left-padded, continuations right-padded, read positions per row."""
    dtype = seqs[0].dtype
    longest = max(length for _, length in groups)
    owner = [0] * len(rows)
    for g, (members, _) in enumerate(groups):
        for i in members:
            owner[i] = g
    prefix_len = [groups[owner[i]][1] for i in range(len(rows))]
    rest = max(len(seqs[i]) - prefix_len[i] for i in range(len(rows)))
    prefix_ids = torch.zeros(len(groups), longest, dtype=dtype)
    prefix_mask = torch.zeros(len(groups), longest, dtype=torch.long)
    for g, (members, length) in enumerate(groups):
        if length:
            prefix_ids[g, longest - length :] = seqs[members[0]][:length]
            prefix_mask[g, longest - length :] = 1
    ids = torch.zeros(len(rows), rest, dtype=dtype)
    own = torch.zeros(len(rows), rest, dtype=torch.long)
    for i, seq in enumerate(seqs):
        tail = seq[prefix_len[i] :]
        ids[i, : len(tail)] = tail
        own[i, : len(tail)] = 1
    r = max(responses)
    cols = torch.arange(r)
    read_at = torch.stack([(prompts[i] - 1 - prefix_len[i] + cols).clamp(max=rest - 1) for i in range(len(rows))])
    index = torch.tensor(list(rows), dtype=torch.long)
    owners = torch.tensor(owner, dtype=torch.long)
    inputs = {
        PREFIX_IDS: prefix_ids,
        PREFIX_MASK: prefix_mask,
        PREFIX_POSITIONS: (prefix_mask.cumsum(-1) - 1).clamp(min=0),
        OWNER: owners,
        "input_ids": ids,
        "attention_mask": torch.cat([prefix_mask[owners], own], dim=1),
        "position_ids": torch.tensor(prefix_len)[:, None] + torch.arange(rest)[None],
        "responses": batch["responses"][index][:, :r],
        READ_AT: read_at,
    }
    return batching.Micro(index, inputs, int(batch["responses"].shape[1]))


def computed_tokens(micro: batching.Micro) -> int:
    """Token positions the model runs for `micro` (padding included; a shared one's prefixes once)."""
    shared = micro.inputs.get(PREFIX_IDS)
    return int(micro.inputs["input_ids"].numel()) + (0 if shared is None else int(shared.numel()))


def logits(module: nn.Module, mb: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The logits [rows, r, V] that predict each row's response tokens, from a shared-prefix
    micro-batch's two passes (the prefixes once, with a cache; the continuations on it)."""
    prefix = module(
        input_ids=mb[PREFIX_IDS].to(device), attention_mask=mb[PREFIX_MASK].to(device),
        position_ids=mb[PREFIX_POSITIONS].to(device), use_cache=True, logits_to_keep=1,
    )  # fmt: skip
    cache = prefix.past_key_values
    cache.batch_select_indices(mb[OWNER].to(device))  # each row its group's prefix (gradients summed back)
    read_at = mb[READ_AT].to(device)
    first = int(read_at.min())
    rest = int(mb["input_ids"].shape[1])
    out = module(
        input_ids=mb["input_ids"].to(device), attention_mask=mb["attention_mask"].to(device),
        position_ids=mb["position_ids"].to(device), past_key_values=cache, use_cache=True,
        logits_to_keep=rest - first,
    ).logits  # fmt: skip
    at = read_at - first
    if bool((at == at[:1]).all()) and bool((at[0, 1:] - at[0, :-1] == 1).all()):
        lo = int(at[0, 0])
        picked = out[:, lo : lo + int(at.shape[1])]
    else:
        picked = out.gather(1, at[..., None].expand(-1, -1, int(out.shape[-1])))
    if torch.is_grad_enabled():
        # The prefix pass's own output, added times zero: the backward then enters each of its
        # layers through that layer's output, as the hooks of a sharded module (FSDP2's pre-backward
        # unshard, ZeRO-3's fetch) expect; without it the last layer's cached keys and values reach
        # its weights while they are still sharded. Adds exactly zero to every value and gradient.
        picked = picked + 0.0 * prefix.logits.sum()
    return picked


def forward(
    module: nn.Module,
    mb: Mapping[str, torch.Tensor],
    *,
    device: torch.device,
    is_value: bool,
    options: PassOptions = PLAIN_PASS,
) -> ForwardOutput:
    """model_pass.model_forward of any micro-batch, a shared-prefix one's through `logits`."""
    if PREFIX_IDS not in mb:
        return model_forward(module, mb, device=device, is_value=is_value, options=options)
    return from_logits(logits(module, mb, device), mb["responses"].to(device), options)


def check_settings(enabled: object, min_tokens: object) -> None:
    """engine.shared_prefix and engine.shared_prefix_min_tokens (ValueError naming the key and value)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"engine.shared_prefix: expected true or false, got {enabled!r}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
        raise ValueError(f"engine.shared_prefix_min_tokens: expected a whole number of tokens >= 1, got {min_tokens!r}")


class Sharing:
    """One engine's prefix sharing: whether it applies (decided once, the reason it does not
    logged once), the micro-batches it shares, and the tokens [computed, in the batch] its
    current pass ran (the engine resets `tokens` at the start of each pass)."""

    def __init__(self, config: Any) -> None:
        self.enabled: bool = config.shared_prefix
        self.min: int = config.shared_prefix_min_tokens
        #: why sharing is off on this engine (None: on, or not decided yet)
        self.reason: str | None = None if self.enabled else "engine.shared_prefix = false"
        self._decided = not self.enabled
        self.tokens: list[int] = [0, 0]

    def off(self, reason: str) -> None:
        """Turn sharing off on this engine for `reason` (logged once, when it was on)."""
        if self.reason is None:
            self.reason, self._decided = reason, True
            from hfrt.log import get_logger

            get_logger(part="engine").info("shared_prefix_off", reason=reason)

    def min_tokens(self, engine: Any) -> int | None:
        """The fewest shared tokens worth a shared micro-batch on `engine`; None when sharing is off."""
        if not self._decided:
            self._decided = True
            if engine.seq_multiple > 1:
                self.off("sequence parallel cuts every micro-batch's sequence over the tp ranks")
            elif (reason := unsupported(engine.model)) is not None:
                self.off(reason)
        return self.min if self.reason is None else None

    def share(
        self,
        batch: Mapping[str, torch.Tensor],
        groups: Sequence[Sequence[int]],
        lengths: batching.Lengths,
        micros: list[batching.Micro],
    ) -> list[batching.Micro]:
        """`micros` with each one whose rows share a prefix worth it made a shared-prefix one (rows laid
        out as batching.packable asks, checked per micro-batch: equal-rows padding elsewhere does not matter)."""
        out = []
        for rows, plain in zip(groups, micros, strict=True):
            index = torch.tensor(list(rows), dtype=torch.long)
            part = {
                k: batch[k][index] for k in ("input_ids", "attention_mask", "position_ids", "responses") if k in batch
            }
            mine = batching.Lengths([lengths.prompt[r] for r in rows], [lengths.response[r] for r in rows])
            ok = batching.packable(part, mine)
            out.append((micro(batch, rows, lengths, self.min) if ok else None) or plain)
        return out

    def count(self, lengths: batching.Lengths, micros: Sequence[batching.Micro]) -> None:
        """Add a pass's micro-batches to `tokens`: positions computed, and the rows' real tokens."""
        self.tokens[0] += sum(computed_tokens(m) for m in micros)
        self.tokens[1] += sum(lengths.total(int(r)) for m in micros for r in m.rows)
