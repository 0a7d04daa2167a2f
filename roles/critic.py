"""The critic role daemon: a value model (causal-LM backbone + scalar head) that predicts values
for the response tokens and trains on returns with a clipped value loss.

Options: roles/common.py's, and `lora` (LoRA adapters on the backbone, the head trains in full;
roles/training/lora.py) (`model` may be a preset, an HF directory, or a value-model directory
written by models.save_value_model; a fresh head is seeded from `seed`). It knows nothing of how
returns or advantages are computed: the flow does that.
"""

from __future__ import annotations

from typing import Any

import torch

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.batch import Batch
from hfrt.roles.common import (
    CheckpointEndpoints,
    ModelOptions,
    build_engine,
    check_backend,
    check_lora,
    check_options,
    check_parallel,
    close_group,
    engine_dp_axes,
    needs_group,
    prepare_process,
    role_errors,
)
from hfrt.roles.losses import LossScale, masked_mean, value_loss
from hfrt.roles.rows import forward_inputs, merge
from hfrt.roles.training.engines import ForwardOutput, LossFn
from hfrt.roles.training.updates import MakeLoss, forward_equal, run_updates
from hfrt.wire.endpoints import Dispatch, endpoint
from hfrt.wire.loss_options import CriticLoss as CriticLoss  # declared torch-free, checked before launch
from hfrt.wire.loss_options import accepted_options, check_update_options


def critic_loss(cfg: CriticLoss) -> MakeLoss:
    def make(scale: LossScale, shares: dict[str, float]) -> LossFn:
        def loss_fn(out: ForwardOutput, mb: Any, _: LossScale) -> tuple[torch.Tensor, dict[str, Any]]:
            assert out.values is not None
            mask = mb["response_mask"]
            loss, metrics = value_loss(
                out.values, mb["returns"], mb["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode, scale,
                cfg.norm_horizon,
            )
            metrics["critic/vpred_mean"] = masked_mean(out.values.detach(), mask)
            return loss, metrics

        return loss_fn

    return make


class CriticDaemon(CheckpointEndpoints, Daemon):
    """Endpoints: compute_values, update (SPLIT); save, load (REPLICATE)."""

    #: whether setup joined the role's process group (teardown leaves it); False until it does
    _joined: bool = False

    @classmethod
    def check_config(cls, context: DaemonContext) -> None:
        check_options(context, ("lora",))
        opts = ModelOptions.read(context.options, trainable=True)
        check_backend(context, opts.engine)
        check_parallel(context, opts)
        check_lora(opts, value_head=True)

    async def setup(self) -> None:
        with role_errors(self.context):
            ctx = self.context
            self.check_config(ctx)
            self.opts = ModelOptions.read(ctx.options, trainable=True)
            self._joined = prepare_process(ctx, needs_group=needs_group(ctx, self.opts.engine))
            self.engine = build_engine(ctx, self.opts, value_head=True)

    async def teardown(self) -> None:
        close_group(self._joined)

    def dp_axes(self) -> dict[str, list[int]]:
        """At engine tp × pp > 1, ranks of one tp / pp group share rows (see engine_dp_axes)."""
        return engine_dp_axes(self.context, ModelOptions.read(self.context.options, trainable=True).engine)

    @endpoint(dispatch=Dispatch.SPLIT)
    def compute_values(self, batch: Batch, *extra: Batch) -> Batch:
        """`values` [rows, R]: the value before each response token, 0 where masked."""
        tensors = forward_inputs(merge(batch, extra), "critic.compute_values")
        out = forward_equal(self.engine, tensors, "critic.compute_values")
        assert out.values is not None
        return Batch({"values": out.values * tensors["response_mask"].to(out.values.dtype)})

    @endpoint(dispatch=Dispatch.SPLIT, keywords=accepted_options("critic"))
    def update(self, batch: Batch, *extra: Batch, **loss: Any) -> dict[str, float]:
        """Optimizer steps on `returns` with old `values`; options: CriticLoss and UpdateSchedule
        fields (hfrt.wire.loss_options). Returns metrics averaged over steps, the same on every rank."""
        schedule, cfg = check_update_options("critic", loss)
        tensors = forward_inputs(merge(batch, extra), "critic.update", "values", "returns")
        return run_updates(
            self.engine, tensors, critic_loss(cfg), schedule, prefix="critic", endpoint="critic.update"
        )

