"""The training-engine contract and the parts every backend shares: configs, micro-batching,
the forward and step loops (arguments, loss scaling, metrics, the optimizer step, step counting,
defined once here), atomic checkpoint folders.

A backend (local, FSDP2, DeepSpeed, TP × PP) supplies only hooks: the module to call, backward,
optimizer step, per-bucket weight gathering, checkpoint I/O, and where it runs a pass its own way
(the pipeline schedule) the pass itself; forward and step are this class's alone, so every engine
takes the same arguments. One micro-batch's model call is engines/model_pass.py. This module knows
nothing of RL losses (the caller passes a loss function), of generation, or of messages and handles.

Batch layout (verl's): a mapping of tensors with a common first dimension —
  input_ids [B, T]        prompt (left-padded) followed by response (right-padded)
  attention_mask [B, T]   1 on real tokens
  position_ids [B, T]     optional; derived from attention_mask when absent
  responses [B, R]        the last R columns of input_ids
  response_mask [B, R]    1 on response tokens that count (used for loss normalisation)
  ...                     anything else the loss function reads (advantages, old_log_probs, ...)
Log-probs, entropies and values come back as [B, R], aligned with `responses`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hfrt.roles.training.engines.shared_prefix as prefixes
from hfrt.roles.losses import LossScale
from hfrt.roles.models import ValueModel, replace_folder
from hfrt.roles.training import batching
from hfrt.roles.training.engines.model_pass import ForwardOutput as ForwardOutput
from hfrt.roles.training.engines.model_pass import PassOptions as PassOptions
from hfrt.roles.training.engines.model_pass import expanded, in_row_order
from hfrt.roles.training.engines.model_pass import model_forward as model_forward
from hfrt.roles.training.engines.model_pass import position_ids_from_mask as position_ids_from_mask
from hfrt.roles.training.engines.model_pass import token_log_probs as token_log_probs
from hfrt.roles.training.engines.optim import OptimConfig as OptimConfig
from hfrt.roles.training.engines.optim import build_optimizer as build_optimizer
from hfrt.roles.training.engines.optim import lr_multiplier as lr_multiplier
from hfrt.roles.training.engines.optim import optimizer_and_scheduler as optimizer_and_scheduler

Batch = Mapping[str, torch.Tensor]
#: backends whose checkpoints are one DCP folder by parameter name: each loads the other's, at any layout
DCP_BACKENDS = frozenset({"fsdp2", "tp"})


#: loss_fn(output, micro_batch, scale) → (loss share, metrics). See hfrt.roles.losses for `scale`.
LossFn = Callable[[ForwardOutput, Batch, LossScale], tuple[torch.Tensor, Mapping[str, Any]]]


@dataclass(frozen=True)
class EngineConfig:
    """Which training backend, and how it runs: a role's `engine` option (a field's `#:` comment documents it)."""

    #: "local" (one process, no sharding), "fsdp2", "deepspeed" or "tp" (TP × PP × DP; fsdp2 with tp * pp > 1 too)
    backend: str = "local"
    #: DeepSpeed ZeRO stage (1, 2 or 3); ignored by other backends
    zero_stage: int = 3
    #: "fp32" or "bf16" (bf16 compute, fp32 master weights and grad reduction)
    mixed_precision: str = "fp32"
    #: rows per forward/backward pass (when max_tokens_per_micro_batch is unset)
    micro_batch_size: int = 4
    #: false builds no optimizer; by default what the role needs (false: the reference policy, a reward model)
    trainable: bool = True
    #: AdamW and its learning-rate schedule (the `engine.optim` table)
    optim: OptimConfig = field(default_factory=OptimConfig)
    #: tensor-parallel size (dp = world size / (tp * pp)); see engines.tp
    tp: int = 1
    #: pipeline-parallel size (dp = world size / (tp * pp)); see engines.tp
    pp: int = 1
    #: the schedule with pp > 1: "1f1b" (at most pp micro-batches' activations alive), "gpipe" (all forwards,
    #: then all backwards) or "interleaved-1f1b" (pp_stages_per_rank non-adjacent stages per rank, a smaller bubble)
    pp_schedule: str = "1f1b"
    #: pipeline stages each rank holds; 0: 2 with interleaved-1f1b, else 1
    pp_stages_per_rank: int = 0
    #: log-probs / entropy from the tp-sharded head's logits without gathering them (torch's
    #: loss_parallel; needs tp > 1 dividing the vocabulary and an untied head)
    loss_parallel: bool = False
    #: each tp rank holds 1/tp of the sequence between attention / MLP blocks (Megatron's; needs tp > 1)
    sequence_parallel: bool = False
    #: entries added to / replacing the model's transformers TP plan, e.g. {"model.layers.*.mlp.down_proj": "rowwise"}
    tp_plan: Mapping[str, str] | None = None
    #: tokens per forward/backward pass instead of rows (verl's use_dynamic_bsz); null: micro_batch_size rows
    max_tokens_per_micro_batch: int | None = None
    #: each micro-batch as one padding-free sequence (verl's use_remove_padding); false: trimmed to its longest row
    pack: bool = False
    #: rows of a micro-batch sharing a prefix (a prompt's n samples) run it once, its KV cache under
    #: their continuations (engines/shared_prefix.py); false: every row runs whole
    shared_prefix: bool = True
    #: the fewest tokens a group of rows must share for its micro-batch to run shared
    shared_prefix_min_tokens: int = prefixes.MIN_TOKENS

    def __post_init__(self) -> None:
        batching.check_settings(self.max_tokens_per_micro_batch, self.pack, self.pp)
        prefixes.check_settings(self.shared_prefix, self.shared_prefix_min_tokens)
        if self.sequence_parallel and self.tp < 2:
            from hfrt.roles.training.parallel.sequence import check

            check(None, self.tp, "engine")


# ------------------------------------------------------------------------------------ batches


def batch_rows(batch: Batch) -> int:
    return int(batch["input_ids"].shape[0])


def split_micro(batch: Batch, size: int) -> list[dict[str, torch.Tensor]]:
    """Contiguous micro-batches of at most `size` rows (every tensor sliced on dim 0)."""
    if size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {size}")
    rows = batch_rows(batch)
    return [{k: v[start : start + size] for k, v in batch.items()} for start in range(0, rows, size)]


class LossTally:
    """One training pass's report on this rank: the loss shares summed, loss_fn's metrics averaged
    over the pass's `micro_batches` (TrainEngine.step then averages both over ranks)."""

    def __init__(self, micro_batches: int) -> None:
        self.micro_batches = micro_batches
        self.total = 0.0
        self.extra: dict[str, float] = {}

    def add(self, loss: torch.Tensor, metrics: Mapping[str, Any]) -> None:
        self.total += float(loss.detach())
        for key, value in metrics.items():
            self.extra[key] = self.extra.get(key, 0.0) + float(value) / self.micro_batches

    def metrics(self) -> dict[str, float]:
        return {"loss": self.total, **self.extra}


# ------------------------------------------------------------------------------------ engine

#: what TrainEngine alone defines: every engine takes the same arguments (an engine overrides hooks)
CONTRACT = frozenset({"forward", "step"})


class TrainEngine(ABC):
    """One training backend over one model. Every rank of a data-parallel group runs the same
    calls in the same order (they contain collectives); each rank passes its own rows.

    Public face: forward / forward_logprobs / forward_values, step, state_dict_for_generation,
    save / load, and the attributes model (unwrapped module), dp_rank, dp_size, steps.
    """

    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        self.config = config
        self.model = model
        self.is_value = isinstance(model, ValueModel)
        self.steps = 0
        self.dp_rank = dist.get_rank() if dist.is_initialized() else 0
        self.dp_size = dist.get_world_size() if dist.is_initialized() else 1
        self.device = default_device()

    # ---- backend hooks
    @property
    @abstractmethod
    def forward_module(self) -> nn.Module:
        """The module to call for forward passes (a wrapper for some backends)."""

    #: the group rows are split over (None: every rank of the role; a tp / pp engine's dp group)
    dp_group: Any = None

    def from_last_stage(self, value: Any) -> Any:
        """`value` as the last pipeline stage computed it (engines without stages: unchanged)."""
        return value

    #: the torch optimizer (None when frozen); engines that own theirs (DeepSpeed) override the hooks
    optimizer: torch.optim.Optimizer | None = None

    def _zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @abstractmethod
    def _optimizer_step(self) -> float:
        """Clip, step optimizer and schedule; return the pre-clip global grad norm."""

    def current_lr(self) -> float:
        """The learning rate of the next step (0 for an engine with no optimizer)."""
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    @abstractmethod
    def _gathered_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Full parameters, one block at a time (collective: every rank iterates)."""

    @abstractmethod
    def _save_into(self, folder: Path) -> None: ...

    @abstractmethod
    def _load_from(self, folder: Path) -> None: ...

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    # ---- the contract: forward and step are this class's, for every engine
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if owned := sorted(CONTRACT & set(vars(cls))):
            raise TypeError(
                f"{cls.__qualname__} defines {' and '.join(owned)}: TrainEngine owns forward and step (their arguments, "
                "the loss scale, the metrics, the optimizer step); an engine overrides the hooks "
                "(_pass_context, _forward_pass, _train_pass, _backward, _optimizer_step, ...) instead"
            )

    @torch.no_grad()
    def forward(
        self,
        batch: Batch,
        *,
        micro_batch_size: int | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
        with_sum_pi_squared: bool = False,
        with_top1: bool = False,
    ) -> ForwardOutput:
        """Evaluation-mode forward over the whole batch in micro-batches; results on CPU, [rows, R]:
        a causal LM's log-probs of `responses` at `temperature`, with the entropy, Σ_v π_v² and
        whether the token is the top-1 choice of each position when asked; a value model's values."""
        options = PassOptions(temperature, with_entropy, with_sum_pi_squared, with_top1)
        self.sharing.tokens = [0, 0]
        with self._pass_context():
            return self._forward_pass(batch, micro_batch_size, options)

    # ---- pass hooks: how one pass runs (an engine with pipeline stages runs its schedule instead)
    def _pass_context(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around each forward pass and each training pass (its forwards and backwards)."""
        return contextlib.nullcontext()

    def _forward_pass(self, batch: Batch, micro_batch_size: int | None, options: PassOptions) -> ForwardOutput:
        """`batch`'s outputs on the CPU at full width, in row order: each micro-batch through
        forward_module in evaluation mode."""
        module = self.forward_module
        module.eval()
        micros = self.micro_batches(batch, micro_batch_size)
        outs = []
        for micro in micros:
            with self._autocast():
                out = prefixes.forward(module, micro.inputs, device=self.device, is_value=self.is_value, options=options)
            outs.append(expanded(micro, out, cpu=True))
        return in_row_order(micros, outs)

    def _train_pass(
        self, loss_fn: LossFn, batch: Batch, micro_batch_size: int | None, scale: LossScale, options: PassOptions
    ) -> dict[str, float]:
        """Forward and backward of each micro-batch of `batch` in training mode, gradients
        accumulated; this rank's {"loss": summed shares, **loss_fn's metrics averaged} (LossTally)."""
        micros = self.micro_batches(batch, micro_batch_size)
        module = self.forward_module
        module.train()
        tally = LossTally(len(micros))
        for part in micros:
            mb = {k: v[part.rows].to(self.device) for k, v in batch.items()}  # the loss reads full-width columns
            with self._autocast():
                out = prefixes.forward(module, part.inputs, device=self.device, is_value=self.is_value, options=options)
                loss, metrics = loss_fn(expanded(part, out), mb, scale)
            self._backward(loss)
            tally.add(loss, metrics)
        return tally.metrics()

    #: rows that must share a micro-batch, in order (a reward model's chosen / rejected pairs)
    rows_together: int = 1
    #: output columns read past each row's last response token: a reward model scores the output
    #: at its last response token (column L of a [rows, R + 1] readout), so it sets 1 and trimming
    #: or packing keeps that column instead of zero-filling it
    columns_past_response: int = 0
    #: kept sequence widths are rounded up to a multiple of this (an engine sharding the sequence sets it)
    seq_multiple: int = 1

    @property
    def sharing(self) -> prefixes.Sharing:
        """Whether and how this engine's micro-batches share prefixes, and the tokens its passes computed."""
        if "_sharing" not in vars(self):
            self._sharing = prefixes.Sharing(self.config)
        return self._sharing

    def micro_batches(self, batch: Batch, micro_batch_size: int | None = None) -> list[batching.Micro]:
        """This rank's micro-batches of `batch`: micro_batch_size rows, or the config's token
        budget; trimmed, or packed when config.pack and the rows allow it (see batching).
        Collective over the dp group with a token budget (every rank runs as many as the most)."""
        lengths = batching.row_lengths(batch)
        budget = self.config.max_tokens_per_micro_batch
        pack = self.config.pack and batching.packable(batch, lengths)
        if self.columns_past_response:
            lengths = lengths.reaching(self.columns_past_response, int(batch["responses"].shape[1]))
        unit = self.rows_together
        rows = micro_batch_size or self.config.micro_batch_size
        groups = batching.plan(lengths, budget=budget, rows_per_micro=rows, packed=pack, unit=unit)
        if budget is not None and self.dp_size > 1 and dist.is_initialized():
            count = torch.tensor([float(len(groups))], dtype=torch.float64, device=_comm_device())
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dp_group)
            groups = batching.split_to(groups, int(count.item()), lengths, pack, unit)
        micros = batching.micro_batches(batch, groups, lengths, pack=pack, multiple=self.seq_multiple)
        if not pack and self.sharing.min_tokens(self):
            micros = self.sharing.share(batch, groups, lengths, micros)
        self.sharing.count(lengths, micros)
        return micros

    def forward_logprobs(self, batch: Batch, *, temperature: float = 1.0, **kwargs: Any) -> torch.Tensor:
        out = self.forward(batch, temperature=temperature, **kwargs)
        if out.log_probs is None:
            raise TypeError("forward_logprobs needs a causal LM, this engine holds a value model")
        return out.log_probs

    def forward_values(self, batch: Batch, **kwargs: Any) -> torch.Tensor:
        out = self.forward(batch, **kwargs)
        if out.values is None:
            raise TypeError("forward_values needs a value model, this engine holds a causal LM")
        return out.values

    # ---- training
    def loss_scale(self, batch: Batch) -> LossScale:
        """Global token / sequence counts of this step's batch over all dp ranks."""
        counts = torch.tensor([float(batch["response_mask"].sum()), float(batch_rows(batch))], dtype=torch.float64)
        self._all_reduce(counts)
        return LossScale(global_tokens=counts[0].item(), global_seqs=counts[1].item(), dp_size=self.dp_size)

    def step(
        self,
        loss_fn: LossFn,
        batch: Batch,
        micro_batch_size: int | None = None,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        with_top1: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over this rank's `batch`, accumulated over micro-batches, the loss
        reading log-probs at `temperature` (and the entropy with with_entropy, the top-1 flags
        with with_top1).

        loss_fn returns each micro-batch's share of the global loss (hfrt.roles.losses.agg_loss with
        the given LossScale does this); the engine sums shares and backends average gradients
        over ranks. Returns metrics averaged over ranks: loss, grad_norm, lr, plus loss_fn's own.
        """
        if not self.config.trainable:
            raise RuntimeError("this engine was built with trainable=False (no optimizer)")
        options = PassOptions(temperature, with_entropy, with_top1=with_top1)
        scale = self.loss_scale(batch)
        self._zero_grad()
        self.sharing.tokens = [0, 0]
        with self._pass_context():
            metrics = self._train_pass(loss_fn, batch, micro_batch_size, scale, options)
        grad_norm = self._optimizer_step()
        self.steps += 1
        return self._reduce_metrics(metrics) | {"grad_norm": grad_norm, "lr": self.current_lr()}

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if self.dp_size > 1:
            device = tensor.device
            work = tensor.to(_comm_device())
            dist.all_reduce(work)
            tensor.copy_(work.to(device))

    def _reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Rank-average of each metric (keys are the same on every rank)."""
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        self._all_reduce(values)
        return {k: v / self.dp_size for k, v in zip(keys, values.tolist(), strict=True)}

    # ---- weights for generation
    def state_dict_for_generation(self) -> Iterator[dict[str, torch.Tensor]]:
        """Full (unsharded) parameters, one decoder block (or the rest) per item, HF names,
        in the compute dtype (bf16 under bf16 mixed precision on FSDP2 / DeepSpeed).

        Collective on sharded backends: every rank must exhaust the iterator. Tensors may be
        views of temporary gather buffers, valid only until the next item is requested: copy
        what you keep. At most one block is gathered at a time. With LoRA: the merged weights
        under the plain model's names (W + alpha/r·B·A; see adapter_state_dict for adapters only).
        """
        if self.lora is not None:
            from hfrt.roles.training import lora

            return lora.merged_buckets(self._gathered_buckets(), self.lora)
        return self._gathered_buckets()

    #: the LoRA adapters' hfrt.roles.training.lora.LoraSpec when the model has them (else None)
    lora: Any = None

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter tensors, whole, under peft's in-model names (`<module>.lora_A.default.weight`),
        fp32 copies on this rank's device. Collective on sharded backends: every rank calls it."""
        from hfrt.roles.training import lora

        if self.lora is None:
            raise RuntimeError("adapter_state_dict: this engine's model has no LoRA adapters (options.lora)")
        return lora.full_tensors(lora.adapter_parameters(self.model))

    # ---- checkpoints
    def save(self, path: str | Path) -> Path:
        """Write a checkpoint folder atomically: every rank writes into a staging folder, then
        rank 0 renames it over `path` (an old checkpoint is replaced only once the new one is whole)."""
        final = Path(path)
        staging = final.with_name(f".{final.name}.partial")
        if self.is_checkpoint_leader():
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self._barrier()
        self._save_into(staging)
        self._barrier()
        if self.is_checkpoint_leader():
            meta = {"backend": self.config.backend, "steps": self.steps, "dp_size": self.dp_size}
            (staging / "hfrt_engine.json").write_text(json.dumps(meta | {"config": asdict(self.config)}))
            replace_folder(staging, final)
        self._barrier()
        return final

    def is_checkpoint_leader(self) -> bool:
        """The one rank that creates the staging folder and renames it into place."""
        return self.dp_rank == 0

    def load(self, path: str | Path) -> None:
        folder = Path(path)
        meta_file = folder / "hfrt_engine.json"
        if not meta_file.exists():
            raise FileNotFoundError(f"{folder} is not an hfrt engine checkpoint (no hfrt_engine.json)")
        meta = json.loads(meta_file.read_text())
        same_format = {meta["backend"], self.config.backend} <= DCP_BACKENDS  # one DCP folder, any layout
        if meta["backend"] != self.config.backend and not same_format:
            raise ValueError(f"checkpoint {folder} was written by {meta['backend']}, not {self.config.backend}")
        self._load_from(folder)
        self.steps = int(meta["steps"])
        self._barrier()

    def _barrier(self) -> None:
        if self.dp_size > 1:
            dist.barrier()


def default_device() -> torch.device:
    """This rank's CUDA device when there is one (set by the launcher), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _comm_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def named_buckets(model: nn.Module, blocks: list[nn.Module]) -> list[tuple[nn.Module | None, list[str]]]:
    """Parameter names grouped by decoder block, then the rest (embeddings, norms, heads).

    Each entry is (block module or None for the rest, [full parameter names]).
    """
    owner: dict[int, int] = {}
    for index, block in enumerate(blocks):
        for p in block.parameters():
            owner[id(p)] = index
    groups: list[list[str]] = [[] for _ in blocks]
    rest: list[str] = []
    for name, p in model.named_parameters():
        (groups[owner[id(p)]] if id(p) in owner else rest).append(name)
    out: list[tuple[nn.Module | None, list[str]]] = [(b, g) for b, g in zip(blocks, groups, strict=True)]
    return out + [(None, rest)]
