"""How a value model's per-token outputs become one reward per sequence, shared by the reward-model
trainer (roles/reward_model.py) and the model reward (roles/reward.py), so a model is served the
way it was trained: the score position (`score_at`), and the optional running normalisation and
clipping of served rewards.

It knows tensors and masks only: nothing of tokenizers, engines or the wire.
"""

from __future__ import annotations

import math

import torch

from hfrt.roles.rows import all_reduce

#: "last": the output at the last non-padding token (the last response token; the last prompt
#: token when the response is empty) — what transformers' *ForSequenceClassification, TRL and
#: OpenRLHF read. "mean": the mean of the outputs over the response tokens.
SCORE_AT = ("last", "mean")
#: served-reward normalisation: "none", "running" (running mean / std over every score served so
#: far, over all ranks, as OpenRLHF's RunningMoments), "config" (the `mean` / `std` the model's
#: config.json holds, which `hfrt controller --flow rm` writes, as OpenRLHF's normalize_reward)
NORMALIZE = ("none", "running", "config")


def check_score_at(value: object, where: str) -> str:
    if value not in SCORE_AT:
        raise ValueError(f"{where} score_at={value!r}: use one of {', '.join(SCORE_AT)}")
    return str(value)


def pool_scores(shifted: torch.Tensor, response_mask: torch.Tensor, score_at: str) -> torch.Tensor:
    """[rows] one score per row from `shifted` [rows, R + 1], the outputs at positions P-1 .. P+R-1
    (P: the prompt width, so column j is the output after j response tokens): "last" reads
    column L (L = the row's response length), "mean" averages columns 1..L (column 0 when L = 0)."""
    lengths = response_mask.long().sum(-1)
    if score_at == "last":
        return shifted.gather(1, lengths[:, None].to(shifted.device)).squeeze(1)
    mask = response_mask.to(shifted.dtype).to(shifted.device)
    total = (shifted[:, 1:] * mask).sum(-1)
    empty = lengths.to(shifted.device) == 0
    return torch.where(empty, shifted[:, 0], total / mask.sum(-1).clamp(min=1))


class RunningMoments:
    """Mean and variance of every value seen, merged batch by batch (Chan et al.'s parallel
    update); `update` is collective over the role's process group, so all ranks agree."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    def update(self, values: torch.Tensor) -> None:
        v = values.double()
        n, total, squares = all_reduce([float(v.numel()), float(v.sum()), float((v * v).sum())])
        if n == 0:
            return
        batch_mean = total / n
        batch_m2 = max(squares - n * batch_mean * batch_mean, 0.0)
        delta = batch_mean - self.mean
        count = self.count + n
        self.mean += delta * n / count
        self.m2 += batch_m2 + delta * delta * self.count * n / count
        self.count = count

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0


def normalized(scores: torch.Tensor, mean: float, std: float, clip: float | None) -> torch.Tensor:
    """(scores - mean) / std, then clipped to [-clip, clip] when clip is set."""
    out = (scores - mean) / max(std, 1e-8)
    return out.clamp(-clip, clip) if clip is not None else out
