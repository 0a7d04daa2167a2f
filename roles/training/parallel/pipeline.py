"""Pipeline parallelism for any Hugging Face causal LM or value model on torch.distributed.pipelining.

`cut_stage` keeps one stage's decoder layers (parameter-free stand-ins keep the Hugging Face names
of the rest), `StageModule` is what a `PipelineStage` runs (the first stage embeds `input_ids`,
later stages take hidden states as `inputs_embeds`; the last one returns per-token log-probs
(+ entropy) or values at the response positions), and `run_schedule` runs one batch through a
named schedule (gpipe or 1f1b) for training or forward only. Stage boundaries
follow `stages.stage_layers` (contiguous, the first stages one layer longer). It knows nothing of
losses beyond calling the one it is given, of tensor or data parallelism, or of optimizers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfrt.roles.losses import entropy_from_logits
from hfrt.roles.models import ValueModel
from hfrt.roles.training.parallel.stages import stage_layers

#: schedule names → torch.distributed.pipelining classes (default "1f1b")
SCHEDULES = ("gpipe", "1f1b")


class _Skip(nn.Module):
    """Stands in for a module another stage holds: no parameters, passes the hidden states on."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden


class _NoEmbedding(nn.Module):
    """The embedding's place on later stages (they are fed hidden states, never token ids)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a later pipeline stage was given token ids instead of hidden states")


def base_of(model: nn.Module) -> Any:
    """The decoder stack (embed_tokens, layers, norm) of a causal LM or of a value model."""
    if isinstance(model, ValueModel):
        return model.backbone
    return getattr(model, str(model.base_model_prefix))


def check_pp(config: Any, pp: int, where: str = "parallel") -> None:
    """Refuse a pipeline size the model cannot take (more stages than decoder layers)."""
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    if pp < 1 or pp > layers:
        raise ValueError(f"{where}: pp={pp} must be between 1 and the model's {layers} decoder layers")


def check_schedule(name: str, where: str = "parallel") -> None:
    if name not in SCHEDULES:
        raise ValueError(f"{where}: unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}")


def cut_stage(model: nn.Module, stage: int, num_stages: int) -> None:
    """Keep stage `stage` of `num_stages` of `model` in place: the other decoder layers become
    stand-ins, later stages lose the embedding, earlier ones the final norm and the head (a tied
    head keeps its weight: it is the embedding's parameter, which the last stage then holds too)."""
    base = base_of(model)
    layers = base.layers
    mine = stage_layers(len(layers), num_stages, stage)
    for index in range(len(layers)):
        if index not in mine:
            layers[index] = _Skip()
    if stage > 0:
        base.embed_tokens = _NoEmbedding()
    if stage < num_stages - 1:
        base.norm = _Skip()
        if isinstance(model, ValueModel):
            model.value_head = _Skip()
        else:
            model.lm_head = _Skip()


class StageModule(nn.Module):
    """One pipeline stage of `model` (already cut): forward(x, attention_mask, position_ids,
    responses) → hidden states, or on the last stage log-probs [B, R] (a tuple with entropy when
    `with_entropy`) or values [B, R]. `temperature` / `with_entropy` are set per call."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int) -> None:
        super().__init__()
        self.lm: Any = model
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.is_value = isinstance(model, ValueModel)
        self.temperature = 1.0
        self.with_entropy = False

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, responses: torch.Tensor
    ) -> Any:
        from hfrt.roles.training.engines.base import token_log_probs

        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = base_of(self.lm)(**inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = hidden.last_hidden_state
        if not self.last:
            return hidden
        width = int(responses.shape[1])
        at = hidden[:, -width - 1 : -1]
        if self.is_value:
            return self.lm.value_head(at).squeeze(-1).float()
        logits = self.lm.lm_head(at).float()
        if self.temperature > 0 and self.temperature != 1.0:
            logits = logits / self.temperature
        log_probs = token_log_probs(logits, responses)
        if self.with_entropy:
            return log_probs, entropy_from_logits(logits)
        return log_probs


#: loss(output of the last stage for some rows, those rows' indices) → that share of the loss
RowsLoss = Callable[[Any, torch.Tensor], torch.Tensor]


def run_schedule(
    stage_module: StageModule,
    *,
    stage: int,
    num_stages: int,
    group: Any,
    device: torch.device,
    schedule: str,
    batch: Mapping[str, torch.Tensor],
    micro_batches: int,
    loss: RowsLoss | None,
    hidden: tuple[int, torch.dtype] | None = None,
) -> Any:
    """One batch through the pipeline in `micro_batches` equal micro-batches (rows are padded by
    repeating the first row; padded rows have index -1 and must not reach the loss). Training when
    `loss` is given (gradients accumulate; nothing is scaled), forward only otherwise. Returns the
    last stage's output for the real rows, broadcast to every stage; collective over `group`.
    `hidden` (hidden size, activation dtype) gives the stage its shapes up front; without it the
    stage infers them by running the first micro-batch once more (torch's dynamic mode)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rows = int(batch["input_ids"].shape[0])
    per = -(-rows // micro_batches)
    padded = per * micro_batches
    index = torch.cat([torch.arange(rows), torch.full((padded - rows,), -1, dtype=torch.long)])
    take = index.clamp(min=0)
    cols = {k: batch[k][take].to(device) for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    shapes = _stage_shapes(stage_module, per, cols, hidden) if hidden is not None else {}
    pipe_stage = PipelineStage(stage_module, stage, num_stages, device, group=group, **shapes)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(schedule)
    if kind is None:
        raise ValueError(f"pipeline schedule {schedule!r} needs several stages per rank; use gpipe or 1f1b")
    runner = kind(pipe_stage, n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)
    args = (cols["input_ids"],) if stage == 0 else ()
    kwargs: dict[str, Any] = {k: cols[k] for k in ("attention_mask", "position_ids", "responses")}
    if loss is not None:
        out = runner.step(*args, target=index.to(device), **kwargs)
    else:
        with torch.no_grad():
            out = runner.eval(*args, **kwargs)
    if loss is not None:
        return None
    return _broadcast_output(out, stage, num_stages, group, device, rows)


def _stage_shapes(
    module: StageModule, rows: int, cols: Mapping[str, torch.Tensor], hidden: tuple[int, torch.dtype]
) -> dict[str, Any]:
    """Meta tensors of one micro-batch's stage input and output (torch's static mode)."""
    size, dtype = hidden
    length, width = int(cols["input_ids"].shape[1]), int(cols["responses"].shape[1])
    states = torch.empty(rows, length, size, dtype=dtype, device="meta")
    received = torch.empty(rows, length, size, dtype=dtype, device="meta", requires_grad=module.training)
    inputs = torch.empty(rows, length, dtype=torch.long, device="meta") if module.first else received
    grads_in = {"input_grads": None if module.first else states}
    if not module.last:
        return {"input_args": inputs, "output_args": states, "output_grads": states, **grads_in}
    per_token = torch.empty(rows, width, dtype=torch.float32, device="meta")
    outputs: Any = (per_token, per_token) if module.with_entropy and not module.is_value else per_token
    return {"input_args": inputs, "output_args": outputs, **grads_in}


def _broadcast_output(out: Any, stage: int, num_stages: int, group: Any, device: torch.device, rows: int) -> Any:
    """The last stage's output (a tensor or a tuple of [B, R] tensors), real rows only, on every stage."""
    last = dist.get_global_rank(group, num_stages - 1)
    if stage == num_stages - 1:
        parts = out if isinstance(out, tuple) else (out,)
        meta: list[Any] = [[tuple(p.shape) for p in parts], isinstance(out, tuple)]
    else:
        meta = [None, None]
    dist.broadcast_object_list(meta, src=last, group=group)
    shapes, is_tuple = meta
    if stage != num_stages - 1:
        parts = tuple(torch.empty(s, dtype=torch.float32, device=device) for s in shapes)
    parts = tuple(p.detach().float().contiguous() for p in parts)
    for part in parts:
        dist.broadcast(part, src=last, group=group)
    parts = tuple(p[:rows] for p in parts)
    return parts if is_tuple else parts[0]
