"""Log-probs and entropy from a vocabulary-sharded head (tp `loss_parallel`): the head's logits
stay a DTensor split over the vocabulary on the tp ranks, and torch's `loss_parallel` computes
log-softmax / cross-entropy from the shards with all-reduces of [tokens]-sized statistics, never
gathering [tokens, vocab] logits. Chosen tokens' log-probs are -cross_entropy(reduction="none");
the entropy is -Σ p·log p and Σπ² is Σ exp(2·log p) over the sharded log-softmax (partial sums,
reduced over tp); a token is top-1 where its log-prob is the largest over the shards.

`loss_parallel()` must be active around the forward *and* the backward that use these (the engine
enters it for a whole forward or step); outside it DTensor gathers the logits itself, which is
slower but gives the same numbers. It knows nothing of models, plans or engines.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F


def is_sharded(tensor: Any) -> bool:
    """Whether `tensor` is a DTensor (the logits of a vocabulary-sharded head)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def context(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """torch's loss_parallel() when `enabled`, else nothing."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _plain(tensor: Any) -> torch.Tensor:
    """A replicated or partial DTensor as this rank's whole tensor (partial sums reduced)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def token_log_probs(logits: Any, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[tokens] in fp32 from vocabulary-sharded logits [..., V] (a DTensor);
    tokens [...] plain. Returns a plain tensor of tokens' shape (autograd flows to the shards)."""
    flat = logits.float().flatten(0, -2)
    picked = -F.cross_entropy(flat, tokens.reshape(-1).to(flat.device), reduction="none")
    return _plain(picked).view(tokens.shape)


def entropy(logits: Any) -> torch.Tensor:
    """Entropy over the (sharded) vocabulary of DTensor logits [..., V], as a plain tensor."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return _plain(-(log_p.exp() * log_p).sum(dim=-1))


def sum_pi_squared(logits: Any) -> torch.Tensor:
    """Σ_v π_v² over the (sharded) vocabulary of DTensor logits [..., V], as a plain tensor."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return _plain((2 * log_p).exp().sum(dim=-1))


def top1(logits: Any, tokens: torch.Tensor) -> torch.Tensor:
    """1.0 where `tokens` [...] holds the arg-max of the (sharded) DTensor logits [..., V], as a
    plain tensor: the token's log-prob against the largest over the vocabulary (max over tp)."""
    with torch.no_grad():
        picked = token_log_probs(logits, tokens)
        best = _plain(torch.log_softmax(logits.float(), dim=-1).amax(dim=-1))
        return (picked >= best - 1e-5).float()  # the two are computed apart: rounding, not a rival token
