"""A test-only role daemon that stands in for the flow's advantage computation (random
advantages and returns of a rollout's shape), and a function that builds a prompts batch handle.

Not a test module: daemons load it by file path (`.../daemon_helpers.py:AdvantageHelper`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hfrt.daemon.base import Daemon
from hfrt.daemon.batch import Batch
from hfrt.protocols import BatchHandle
from hfrt.protocols.handles import Shard
from hfrt.wire.endpoints import Dispatch, endpoint


def prompt_handle(prompts: Sequence[Any], **columns: Sequence[Any]) -> BatchHandle:
    """A batch of non-tensor columns only, made in the controller: no daemon owns any tensor of
    it, so the receiving ranks read their rows straight out of the handle."""
    non_tensor = {"prompt": list(prompts), **{k: list(v) for k, v in columns.items()}}
    return BatchHandle((Shard("controller:0", len(prompts), {}, non_tensor),))


class AdvantageHelper(Daemon):
    async def setup(self) -> None:
        import torch

        torch.set_num_threads(1)

    @endpoint(dispatch=Dispatch.SPLIT)
    def advantages(self, batch: Batch, seed: int = 0) -> Batch:
        """`advantages` and `returns` [rows, R]: seeded noise, 0 where response_mask is 0."""
        import torch

        mask = batch["response_mask"]
        assert isinstance(mask, torch.Tensor)
        g = torch.Generator().manual_seed(seed + self.context.dp_rank)
        noise = torch.randn(mask.shape, generator=g) * mask
        returns = torch.rand(mask.shape, generator=g) * mask
        return Batch({"advantages": noise, "returns": returns})
