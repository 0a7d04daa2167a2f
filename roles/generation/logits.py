"""Shaping next-token logits before a row samples, as OpenAI and vLLM define the options:
`logit_bias` adds a value to the named tokens' logits; `frequency_penalty` subtracts, per token,
the times it was already sampled in this response times the penalty, and `presence_penalty` the
penalty once it was sampled at all; a constraint (structured output, roles/generation/grammar.py)
sets every token its grammar forbids to -inf. The distribution sampled from, and the log-probs
recorded, are the shaped one's.

It knows logits and token ids; nothing of tokenizers, models or calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from hfrt.wire.errors import InvalidArgument


class Constraint(Protocol):
    """One row's constraint on what it may sample next (e.g. a grammar matcher)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] (float32, the shaper's own copy: changed in place) with the forbidden tokens at -inf."""
        ...

    def accept(self, token: int) -> None:
        """The row sampled `token` (it must be one the mask allowed)."""
        ...

    def done(self) -> bool:
        """Whether the constraint is complete and allows nothing more (the row ends)."""
        ...


def bias_vector(bias: Mapping[int, float] | None, vocab: int, device: torch.device) -> torch.Tensor | None:
    """A dense [vocab] vector of `bias`; ValueError naming a token id outside the vocabulary."""
    if not bias:
        return None
    out = torch.zeros(vocab, dtype=torch.float32, device=device)
    for token, value in bias.items():
        if not 0 <= int(token) < vocab:
            raise InvalidArgument("logit_bias", f"logit_bias: token id {token} is outside the vocabulary [0, {vocab})")
        out[int(token)] = float(value)
    return out


class Shaper:
    """The shaping of one call's rows: `shape(logits)` before each sampling step, `observe(tokens,
    live)` after it. Built only when some option is set (see `needed`)."""

    def __init__(self, rows: int, *, presence: float = 0.0, frequency: float = 0.0, bias: Mapping[int, float] | None = None,
                 constraints: Sequence[Constraint | None] | None = None) -> None:
        self.rows, self.presence, self.frequency, self.bias = rows, float(presence), float(frequency), dict(bias or {})
        self.constraints = list(constraints) if constraints is not None else None
        self._counts: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None

    @staticmethod
    def needed(presence: float, frequency: float, bias: Mapping[int, float] | None, constraints: object) -> bool:
        return bool(presence or frequency or bias or constraints)

    def shape(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, V] logits, shaped (a float32 copy when anything applies)."""
        logits = original = logits.float()
        vocab, device = logits.shape[-1], logits.device
        if self.bias and self._bias is None:
            self._bias = bias_vector(self.bias, vocab, device)
        if self._bias is not None:
            logits = logits + self._bias
        if self._counts is not None:
            logits = logits - self.frequency * self._counts - self.presence * (self._counts > 0).float()
        if self.constraints is not None:
            logits = logits.clone() if logits is original else logits  # masked in place: never the model's own output
            for c, row in zip(self.constraints, logits, strict=True):
                if c is not None:
                    c.mask(row)
        return logits

    def observe(self, tokens: torch.Tensor, live: torch.Tensor, vocab: int) -> None:
        """The rows sampled `tokens` [rows]; only `live` rows [rows] (not yet finished) count."""
        if self.presence or self.frequency:
            if self._counts is None:
                self._counts = torch.zeros(self.rows, vocab, dtype=torch.float32, device=tokens.device)
            self._counts.scatter_add_(1, tokens.view(-1, 1), live.float().view(-1, 1))
        if self.constraints is not None:
            for i, (c, t) in enumerate(zip(self.constraints, tokens.tolist(), strict=True)):
                if c is not None and bool(live[i]) and not c.done():
                    c.accept(int(t))

    def finished(self) -> torch.Tensor | None:
        """[rows] whether each row's constraint is complete (None without constraints)."""
        if self.constraints is None:
            return None
        return torch.tensor([c is not None and c.done() for c in self.constraints])
