"""The loss a pipeline schedule calls on the last stage for the TP engine: the caller's RL loss on
one micro-batch's real rows (padding rows dropped), with the step's loss and metrics summed. It
knows nothing of meshes, stages or schedules beyond the calls it receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hfrt.roles.losses import LossScale
from hfrt.roles.training.engines.base import ForwardOutput, LossFn


class Shares:
    """The pipeline's loss function: the caller's loss on the rows of one micro-batch (padding rows,
    index -1, dropped), with the loss and metrics summed for the step's report."""

    def __init__(
        self, loss_fn: LossFn, batch: Mapping[str, torch.Tensor], scale: LossScale, is_value: bool, n: int, probes: int = 0
    ) -> None:
        self.loss_fn, self.batch, self.scale, self.is_value, self.n = loss_fn, batch, scale, is_value, n
        self.probes = probes  # leading calls that only probe shapes (torch's dynamic-shape inference)
        self.total = 0.0
        self.extra: dict[str, float] = {}

    def __call__(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        if self.probes:
            self.probes -= 1
            return (output[0] if isinstance(output, tuple) else output).sum() * 0.0
        keep = index >= 0
        if not bool(keep.any()):  # a micro-batch of padding only (fewer rows than stages)
            return (output[0] if isinstance(output, tuple) else output).sum() * 0.0
        rows = index[keep]
        mb = {k: v[rows] for k, v in self.batch.items()}
        if self.is_value:
            out = ForwardOutput(values=output[keep])
        elif isinstance(output, tuple):
            out = ForwardOutput(log_probs=output[0][keep], entropy=output[1][keep])
        else:
            out = ForwardOutput(log_probs=output[keep])
        loss, metrics = self.loss_fn(out, mb, self.scale)
        self.total += float(loss.detach())
        for key, value in metrics.items():
            self.extra[key] = self.extra.get(key, 0.0) + float(value) / self.n
        return loss

    def metrics(self) -> dict[str, float]:
        return {"loss": self.total, **self.extra}
