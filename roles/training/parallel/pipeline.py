"""Pipeline parallelism for any Hugging Face causal LM or value model on torch.distributed.pipelining.

`cut_stage` keeps one stage's decoder layers (parameter-free stand-ins keep the Hugging Face names
of the rest), `StageModule` is what a `PipelineStage` runs (the first stage embeds `input_ids`,
later stages take hidden states as `inputs_embeds`; the last one returns per-token log-probs (+
entropy, + Σπ², as the pass's options ask: engines/model_pass) or values at the response
positions), and `run_schedule` runs one batch through a named schedule (gpipe, 1f1b, or
interleaved-1f1b with several stages per rank) for training or forward only. Stage boundaries
follow `stages.stage_layers` (contiguous, the first stages one layer longer; stage s on rank
s % pp). It knows nothing of losses beyond calling the one it is given, of tensor or data
parallelism, or of optimizers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfrt.roles.models import ValueModel
from hfrt.roles.training.engines.model_pass import PLAIN_PASS, PassOptions, from_logits
from hfrt.roles.training.parallel.stages import stage_layers

#: schedule names (default "1f1b"); "interleaved-1f1b" holds several stages per rank
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
#: the schedules that run several (virtual) stages per pipeline rank
MULTI_STAGE = ("interleaved-1f1b",)


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


def check_pp(config: Any, pp: int, where: str = "parallel", virtual: int = 1) -> None:
    """Refuse a pipeline size the model cannot take (more stages, pp × stages per rank, than
    decoder layers)."""
    from hfrt.roles.training.parallel.stages import check_pp as check_layers

    check_layers(int(getattr(config, "num_hidden_layers", 0) or 0), pp, where, virtual)


def check_schedule(name: str, where: str = "parallel") -> None:
    if name not in SCHEDULES:
        raise ValueError(f"{where}: unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}")


def stages_per_rank(schedule: str, setting: int, pp: int, where: str = "parallel") -> int:
    """The pipeline stages each rank holds: `setting` (pp_stages_per_rank; 0 picks 2 for an
    interleaved schedule, 1 otherwise). Refused: several stages with a one-stage schedule, one with
    an interleaved schedule. With pp = 1 there is no pipeline: 1."""
    check_schedule(schedule, where)
    if setting < 0:
        raise ValueError(f"{where}: pp_stages_per_rank={setting} must be >= 0 (0: 2 with interleaved-1f1b, else 1)")
    if pp == 1:
        return 1
    multi = schedule in MULTI_STAGE
    virtual = setting or (2 if multi else 1)
    if multi and virtual < 2:
        raise ValueError(f"{where}: pp_schedule {schedule!r} needs pp_stages_per_rank >= 2 (got {virtual}); use 1f1b for one stage per rank")
    if not multi and virtual > 1:
        raise ValueError(
            f"{where}: pp_stages_per_rank={virtual} needs an interleaved schedule (one of {', '.join(MULTI_STAGE)}); "
            f"pp_schedule {schedule!r} runs one stage per rank"
        )
    return virtual


def check_micro_batches(schedule: str, micro_batches: int, pp: int, where: str = "parallel") -> None:
    """Refuse a micro-batch count the schedule cannot take: at least pp, and a multiple of pp for an
    interleaved schedule (the engine rounds its own counts up to fit; this guards explicit ones)."""
    if micro_batches < pp:
        raise ValueError(f"{where}: {micro_batches} micro-batches are fewer than the {pp} pipeline stages")
    if schedule in MULTI_STAGE and micro_batches % pp:
        raise ValueError(f"{where}: {schedule} needs a multiple of pp={pp} micro-batches, got {micro_batches}")


def micro_batch_count(rows: int, size: int, pp: int, schedule: str) -> int:
    """How many micro-batches `rows` are cut into with pp > 1: ⌈rows / size⌉, at least pp (one per
    stage), rounded up to a multiple of pp for an interleaved schedule (its rounds of pp)."""
    if size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {size}")
    count = max(-(-rows // size), pp)
    if schedule in MULTI_STAGE:
        count = -(-count // pp) * pp
    return count


def cut_stage(model: nn.Module, stages: int | list[int], num_stages: int) -> None:
    """Keep pipeline stages `stages` (one index, or a rank's virtual stages) of `num_stages` of
    `model` in place: the other decoder layers become stand-ins; without the first stage the
    embedding goes, without the last the final norm and the head (a tied head keeps its weight:
    it is the embedding's parameter, which the last stage then holds too)."""
    mine = [stages] if isinstance(stages, int) else list(stages)
    base = base_of(model)
    layers = base.layers
    kept = {i for stage in mine for i in stage_layers(len(layers), num_stages, stage)}
    for index in range(len(layers)):
        if index not in kept:
            layers[index] = _Skip()
    if 0 not in mine:
        base.embed_tokens = _NoEmbedding()
    if num_stages - 1 not in mine:
        base.norm = _Skip()
        if isinstance(model, ValueModel):
            model.value_head = _Skip()
        else:
            model.lm_head = _Skip()


class StageModule(nn.Module):
    """Pipeline stage `stage` of `num_stages` of `model` (already cut to hold it): forward(x,
    attention_mask, position_ids, responses) → hidden states, or on the last stage log-probs
    [B, R] (a tuple with entropy and Σπ² when the options ask: PassOptions.pack) or values [B, R].
    `options` (the engine's PassOptions) is set per pass.

    Several stages of one rank share `model` (interleaved schedules): each registers only its own
    parts — its decoder layers (the others stand-ins, in a list swapped into the decoder for the
    duration of its forward), the embedding on the first stage, the final norm and head on the last
    — so each can be its own FSDP root and torch's schedule unshards exactly its chunk."""

    lm: Any  # the rank's (cut) model, not a child: stages of one rank share it
    #: the tp mesh when the model runs sequence-parallel (parallel/sequence): stages then send and
    #: receive this rank's sequence shard [rows, T / tp, hidden], a DTensor Shard(1) inside
    sequence_mesh: Any = None

    def __init__(self, model: nn.Module, stage: int, num_stages: int) -> None:
        super().__init__()
        object.__setattr__(self, "lm", model)
        self.stage, self.num_stages = stage, num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.is_value = isinstance(model, ValueModel)
        self.options: PassOptions = PLAIN_PASS
        base = base_of(model)
        mine = stage_layers(len(base.layers), num_stages, stage)
        self.layers = nn.ModuleList([layer if i in mine else _Skip() for i, layer in enumerate(base.layers)])
        parts: list[nn.Module] = []
        if self.first:  # the embedding and whatever else sits beside the layers
            parts += [m for name, m in base.named_children() if name not in ("layers", "norm")]
        if self.last:
            parts += [base.norm, self.lm.value_head if self.is_value else self.lm.lm_head]
        self.parts = nn.ModuleList(parts)

    def train(self, mode: bool = True) -> StageModule:
        super().train(mode)
        self.lm.train(mode)
        return self

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, responses: torch.Tensor
    ) -> Any:
        base = base_of(self.lm)
        if not self.first and self.sequence_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            x = DTensor.from_local(x, self.sequence_mesh, [Shard(1)], run_check=False)
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        # this stage's layers only, and the final norm only on the last stage (a rank may hold others)
        held = (base.layers, base.norm)
        base.layers, base.norm = self.layers, base.norm if self.last else _Skip()
        try:
            hidden = base(**inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        finally:
            base.layers, base.norm = held
        hidden = hidden.last_hidden_state
        if not self.last:
            return hidden.to_local() if self.sequence_mesh is not None else hidden
        width = int(responses.shape[1])
        at = hidden[:, -width - 1 : -1]
        if self.is_value:
            return self.lm.value_head(at).squeeze(-1).float()
        return self.options.pack(from_logits(self.lm.lm_head(at).float(), responses, self.options), False)


#: loss(output of the last stage for some rows, those rows' indices) → that share of the loss
RowsLoss = Callable[[Any, torch.Tensor], torch.Tensor]


def run_schedule(
    stage_modules: StageModule | list[StageModule],
    *,
    group: Any,
    device: torch.device,
    schedule: str,
    batch: Mapping[str, torch.Tensor],
    micro_batches: int,
    loss: RowsLoss | None,
    hidden: tuple[int, torch.dtype] | None = None,
    seq_shards: int = 1,
) -> Any:
    """One batch through the pipeline in `micro_batches` equal micro-batches (rows are padded by
    repeating the first row; padded rows have index -1 and must not reach the loss). This rank runs
    `stage_modules` (one stage, or its virtual stages for an interleaved schedule). Training when
    `loss` is given (gradients accumulate; nothing is scaled), forward only otherwise. Returns the
    last stage's output for the real rows, broadcast to every pipeline rank; collective over
    `group`. `hidden` (hidden size, activation dtype) gives the stages their shapes up front;
    without it each stage infers them by running the first micro-batch once more (torch's dynamic
    mode). `seq_shards`: the activations between stages hold 1/seq_shards of the columns (sequence
    parallelism; the columns must divide)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    modules = stage_modules if isinstance(stage_modules, list) else [stage_modules]
    pp = dist.get_world_size(group)
    check_schedule(schedule)
    check_micro_batches(schedule, micro_batches, pp)
    rows = int(batch["input_ids"].shape[0])
    per = -(-rows // micro_batches)
    padded = per * micro_batches
    index = torch.cat([torch.arange(rows), torch.full((padded - rows,), -1, dtype=torch.long)])
    take = index.clamp(min=0)
    cols = {k: batch[k][take].to(device) for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    pipe_stages: list[Any] = []
    for module in modules:
        shapes = _stage_shapes(module, per, cols, hidden, seq_shards) if hidden is not None else {}
        pipe_stages.append(PipelineStage(module, module.stage, module.num_stages, device, group=group, **shapes))
    if schedule in MULTI_STAGE:
        runner: Any = ScheduleInterleaved1F1B(pipe_stages, n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)
    else:
        if len(pipe_stages) != 1:
            raise ValueError(f"pipeline schedule {schedule!r} runs one stage per rank, got {len(pipe_stages)}")
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        runner = kind(pipe_stages[0], n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)
    first = any(m.first for m in modules)
    args = (cols["input_ids"],) if first else ()
    kwargs: dict[str, Any] = {k: cols[k] for k in ("attention_mask", "position_ids", "responses")}
    if loss is not None:
        runner.step(*args, target=index.to(device), **kwargs)
        return None
    with torch.no_grad():
        out = runner.eval(*args, **kwargs)
    return _broadcast_output(out, any(m.last for m in modules), group, device, rows)


def _stage_shapes(
    module: StageModule, rows: int, cols: Mapping[str, torch.Tensor], hidden: tuple[int, torch.dtype], seq_shards: int = 1
) -> dict[str, Any]:
    """Meta tensors of one micro-batch's stage input and output (torch's static mode)."""
    size, dtype = hidden
    length, width = int(cols["input_ids"].shape[1]), int(cols["responses"].shape[1])
    shard = length // seq_shards  # a stage's share of the columns (sequence parallelism)
    states = torch.empty(rows, shard, size, dtype=dtype, device="meta")
    received = torch.empty(rows, shard, size, dtype=dtype, device="meta", requires_grad=module.training)
    inputs = torch.empty(rows, length, dtype=torch.long, device="meta") if module.first else received
    grads_in = {"input_grads": None if module.first else states}
    if not module.last:
        return {"input_args": inputs, "output_args": states, "output_grads": states, **grads_in}
    per_token = torch.empty(rows, width, dtype=torch.float32, device="meta")
    count = len(module.options.fields(module.is_value))
    outputs: Any = (per_token,) * count if count > 1 else per_token
    return {"input_args": inputs, "output_args": outputs, **grads_in}


def _broadcast_output(out: Any, last_here: bool, group: Any, device: torch.device, rows: int) -> Any:
    """The last stage's output (a tensor or a tuple of [B, R] tensors), real rows only, on every
    pipeline rank (the last stage lives on the group's last rank)."""
    last = dist.get_global_rank(group, dist.get_world_size(group) - 1)
    if last_here:
        parts = out if isinstance(out, tuple) else (out,)
        meta: list[Any] = [[tuple(p.shape) for p in parts], isinstance(out, tuple)]
    else:
        meta = [None, None]
    dist.broadcast_object_list(meta, src=last, group=group)
    shapes, is_tuple = meta
    if not last_here:
        parts = tuple(torch.empty(s, dtype=torch.float32, device=device) for s in shapes)
    parts = tuple(p.detach().float().contiguous() for p in parts)
    for part in parts:
        dist.broadcast(part, src=last, group=group)
    parts = tuple(p[:rows] for p in parts)
    return parts if is_tuple else parts[0]
