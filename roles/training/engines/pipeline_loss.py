"""The loss a pipeline schedule calls on the last stage for the TP engine: the caller's RL loss on
one micro-batch's real rows (padding rows dropped), with the step's loss and metrics summed. It
knows nothing of meshes, stages or schedules beyond the calls it receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hfrt.roles.losses import LossScale
from hfrt.roles.training.engines.base import LossFn, LossTally, PassOptions


class Shares:
    """The pipeline's loss function: the caller's loss on the rows of one micro-batch (padding rows,
    index -1, dropped), the last stage's outputs read as `options` made them (PassOptions.pack),
    with the loss and metrics tallied for the step's report."""

    def __init__(
        self, loss_fn: LossFn, batch: Mapping[str, torch.Tensor], scale: LossScale, options: PassOptions, is_value: bool,
        n: int, probes: int = 0,
    ) -> None:  # fmt: skip
        self.loss_fn, self.batch, self.scale, self.options, self.is_value = loss_fn, batch, scale, options, is_value
        self.probes = probes  # leading calls that only probe shapes (torch's dynamic-shape inference)
        self.tally = LossTally(n)

    def __call__(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        if self.probes:
            self.probes -= 1
            return (output[0] if isinstance(output, tuple) else output).sum() * 0.0
        keep = index >= 0
        if not bool(keep.any()):  # a micro-batch of padding only (fewer rows than stages)
            return (output[0] if isinstance(output, tuple) else output).sum() * 0.0
        rows = index[keep]
        mb = {k: v[rows] for k, v in self.batch.items()}
        parts = output if isinstance(output, tuple) else (output,)
        out = self.options.unpack(tuple(p[keep] for p in parts), self.is_value)
        loss, metrics = self.loss_fn(out, mb, self.scale)
        self.tally.add(loss, metrics)
        return loss

    def metrics(self) -> dict[str, float]:
        return self.tally.metrics()
