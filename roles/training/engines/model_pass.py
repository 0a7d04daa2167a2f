"""One micro-batch through the model: what a pass computes (PassOptions), what it yields
(ForwardOutput), and the per-token outputs from a causal LM's logits or a value model's values.

Every engine and every pipeline stage computes its outputs here, so a setting of a pass (the
temperature, entropy, Σπ², whether each token was the top-1 choice) means the same on every backend. It knows nothing of ranks, optimizers,
micro-batch planning (training/batching.py) or losses beyond the entropy it reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hfrt.roles.losses import entropy_from_logits
from hfrt.roles.training import batching, router_replay

Batch = Mapping[str, torch.Tensor]


@dataclass
class ForwardOutput:
    """What one forward pass yields, each [B, R] or None when not requested / not applicable."""

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    #: Σ_v π_v² per position (the optimal token baseline's input), when asked for
    sum_pi_squared: torch.Tensor | None = None
    #: 1.0 where the response token is the most likely one at its position (token accuracy), when asked for
    top1: torch.Tensor | None = None


@dataclass(frozen=True)
class PassOptions:
    """What a forward or training pass computes beside a causal LM's log-probs (a value model
    yields values only): TrainEngine.forward / step build it once from their keywords, and every
    hook and pipeline stage reads it, so no backend can drop one."""

    #: the logits are divided by it before the softmax (0 or 1: unchanged)
    temperature: float = 1.0
    #: the entropy of each position's distribution
    with_entropy: bool = False
    #: Σ_v π_v² of each position's distribution
    with_sum_pi_squared: bool = False
    #: whether each response token is its position's most likely one (1.0 / 0.0; SFT's token accuracy)
    with_top1: bool = False

    def fields(self, is_value: bool) -> tuple[str, ...]:
        """The ForwardOutput fields a pass fills, in the order a pipeline stage returns them."""
        if is_value:
            return ("values",)
        return ("log_probs", *(("entropy",) if self.with_entropy else ()),
                *(("sum_pi_squared",) if self.with_sum_pi_squared else ()),
                *(("top1",) if self.with_top1 else ()))  # fmt: skip

    def pack(self, out: ForwardOutput, is_value: bool) -> Any:
        """`out`'s filled fields as one tensor (when one) or a tuple: what a pipeline stage sends."""
        parts = tuple(getattr(out, name) for name in self.fields(is_value))
        return parts[0] if len(parts) == 1 else parts

    def unpack(self, packed: Any, is_value: bool) -> ForwardOutput:
        """The ForwardOutput of what `pack` made (a tensor or a tuple, in fields' order)."""
        parts = packed if isinstance(packed, tuple) else (packed,)
        names = self.fields(is_value)
        if len(parts) != len(names):
            raise ValueError(f"a pass yielded {len(parts)} outputs, expected {len(names)} ({', '.join(names)})")
        return ForwardOutput(**dict(zip(names, parts, strict=True)))


#: log-probs (values) only, at temperature 1
PLAIN_PASS = PassOptions()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0-based positions counting only real tokens (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _model_inputs(mb: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    mask = mb["attention_mask"].to(device)
    pos = mb.get("position_ids")
    return {
        "input_ids": mb["input_ids"].to(device),
        "attention_mask": mask,
        "position_ids": (pos if pos is not None else position_ids_from_mask(mask)).to(device),
    }


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[tokens] in fp32, without keeping a second [.., vocab] tensor alive."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):  # a vocabulary-sharded head (tp loss_parallel)
        from hfrt.roles.training.parallel import vocab

        return vocab.token_log_probs(logits, tokens)
    logits = logits.float()
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    """Σ_v softmax(logits)_v² over the last dimension, in fp32."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):  # a vocabulary-sharded head (tp loss_parallel)
        from hfrt.roles.training.parallel import vocab

        return vocab.sum_pi_squared(logits)
    return torch.softmax(logits.float(), dim=-1).square().sum(dim=-1)


def top1(logits: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """1.0 where `responses` holds the arg-max of `logits` [.., V] (a tie counts), else 0.0."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):  # a vocabulary-sharded head (tp loss_parallel)
        from hfrt.roles.training.parallel import vocab

        return vocab.top1(logits, responses)
    with torch.no_grad():
        logits = logits.float()
        picked = logits.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        return (picked >= logits.amax(dim=-1)).float()


def from_logits(logits: torch.Tensor, responses: torch.Tensor, options: PassOptions) -> ForwardOutput:
    """Log-probs of `responses` (+ entropy, + Σπ², + top-1, as `options` asks) from the logits
    that predict them, [.., R, V], at options.temperature."""
    if options.temperature > 0 and options.temperature != 1.0:
        logits = logits / options.temperature
    out = ForwardOutput(log_probs=token_log_probs(logits, responses))
    if options.with_entropy:
        out.entropy = entropy_from_logits(logits)
    if options.with_sum_pi_squared:
        out.sum_pi_squared = sum_pi_squared(logits)
    if options.with_top1:
        out.top1 = top1(logits, responses)
    return out


def model_forward(
    module: nn.Module, mb: Batch, *, device: torch.device, is_value: bool, options: PassOptions = PLAIN_PASS
) -> ForwardOutput:
    """Log-probs (+ what `options` asks) of `responses`, or values at response positions, for one
    micro-batch: [rows, R], or [1, N] for a packed one (batching.packed: no attention mask, the
    logits read at its PACKED_POSITIONS)."""
    packed_at = mb.get(batching.PACKED_POSITIONS)
    if packed_at is not None:
        inputs = {"input_ids": mb["input_ids"].to(device), "position_ids": mb["position_ids"].to(device)}
        packed_at = packed_at.to(device)
    else:
        inputs = _model_inputs(mb, device)
    width = int(mb["responses"].shape[1])
    with router_replay.feeding(mb.get(router_replay.ROUTED_EXPERTS)):  # the rollout's routing, when recorded
        return _forward(module, inputs, mb, packed_at, width, is_value, options, device)


def _forward(module: nn.Module, inputs: dict[str, torch.Tensor], mb: Batch, packed_at: torch.Tensor | None,
             width: int, is_value: bool, options: PassOptions, device: torch.device) -> ForwardOutput:
    if is_value:
        values = module(**inputs)
        return ForwardOutput(values=(values[:, packed_at] if packed_at is not None else values[:, -width - 1 : -1]).float())
    # The LM head only where a response token is predicted (the last width + 1 positions, the
    # very last dropped): prompt positions' [vocab] logits are never made.
    if packed_at is not None:
        logits = module(**inputs, use_cache=False, logits_to_keep=packed_at).logits
    else:
        logits = module(**inputs, use_cache=False, logits_to_keep=width + 1).logits[:, :-1]
    return from_logits(logits, mb["responses"].to(device), options)


def expanded(micro: batching.Micro, out: ForwardOutput, cpu: bool = False) -> ForwardOutput:
    """`out` of a trimmed or packed micro-batch at the batch's full width [rows, R] (zeros where
    the rows had no real column), on the CPU when asked."""
    parts = [micro.expand(t) for t in (out.log_probs, out.entropy, out.values, out.sum_pi_squared, out.top1)]
    return ForwardOutput(*(t.cpu() if cpu and t is not None else t for t in parts))


def in_row_order(micros: list[batching.Micro], outs: list[ForwardOutput]) -> ForwardOutput:
    """The micro-batches' full-width outputs as one ForwardOutput over the batch's rows, in order."""
    return ForwardOutput(
        log_probs=batching.in_row_order(micros, [o.log_probs for o in outs]),
        entropy=batching.in_row_order(micros, [o.entropy for o in outs]),
        values=batching.in_row_order(micros, [o.values for o in outs]),
        sum_pi_squared=batching.in_row_order(micros, [o.sum_pi_squared for o in outs]),
        top1=batching.in_row_order(micros, [o.top1 for o in outs]),
    )
