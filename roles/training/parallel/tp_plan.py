"""Tensor parallelism for any Hugging Face causal LM: the model's own transformers TP plan applied
with DTensor on a tp DeviceMesh, the checks that refuse a tp size before launch, and what the
resharding needs to know afterwards (each parameter's split dim and its pieces' bounds).

The plan is transformers' (`model.tp_plan`, from `config.base_model_tp_plan` and the head's
`_tp_plan`), so every family transformers parallelises works here without a table of module names;
a user may override entries (`options.parallel.tp_plan`). hfrt changes the plan in one way: when
tp does not divide the vocabulary, the embedding and head stay replicated (transformers refuses a
gathered uneven head). With `loss_parallel` the head's logits stay split over the vocabulary (the
style LOSS_PARALLEL_HEAD, registered with transformers under that name; see parallel/vocab).
Pieces follow DTensor's Shard rule (torch.chunk: ceil-sized chunks, the last ones shorter). It
knows nothing of engines, pipelines, data parallelism or generation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

#: styles whose only effect is summing a replicated parameter's gradient over tp after each
#: backward (transformers all-reduces the accumulated .grad, wrong with gradient accumulation):
#: hfrt drops them from the plan and the engine sums those gradients once per step instead
PARTIAL_GRAD_STYLES = ("replicated_with_grad_allreduce",)

#: plan entries for the vocabulary (kept replicated when tp does not divide the vocabulary)
_VOCAB_KEYS = ("embed_tokens", "lm_head", "embed_in", "embed_out", "wte")
#: output-head module names (the ones whose logits loss_parallel keeps vocabulary-sharded)
_HEAD_KEYS = ("lm_head", "embed_out")
#: the head's style under loss_parallel: column-parallel, the logits left a DTensor split over the
#: vocabulary (transformers' "colwise" hands back the local shard, "colwise_gather_output" gathers)
LOSS_PARALLEL_HEAD = "hfrt_colwise_vocab_sharded"


def _register_head_style() -> None:
    from torch.distributed.tensor import Replicate, Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, ColwiseParallel, ParallelInterface

    if LOSS_PARALLEL_HEAD not in ALL_PARALLEL_STYLES:
        style = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
        ParallelInterface.register(LOSS_PARALLEL_HEAD, style)  # type: ignore[arg-type]


class PlanError(ValueError):
    """A model cannot be tensor-parallelised at the requested size; the message says what to change."""


def text_config(config: Any) -> Any:
    """The language model's config (multimodal configs nest it)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def check_tp(config: Any, tp: int, where: str = "parallel") -> None:
    """Refuse (PlanError) a tp size the model's shapes cannot take, naming the numbers that do not
    divide, and a model that has no TP plan. Config only: runs before launch, no torch.distributed."""
    if tp < 1:
        raise PlanError(f"{where}: tp must be >= 1, got {tp}")
    if tp == 1:
        return
    cfg = text_config(config)
    family = getattr(cfg, "model_type", type(cfg).__name__)
    if not getattr(cfg, "base_model_tp_plan", None):
        raise PlanError(
            f"{where}: model type {family!r} has no tensor-parallel plan (config.base_model_tp_plan is empty); "
            f"give one in options.parallel.tp_plan, e.g. {{\"model.layers.*.self_attn.q_proj\" = \"colwise\", ...}}, "
            f"or use tp=1"
        )
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    sizes = {"attention heads": heads, "key/value heads": kv}
    inter = getattr(cfg, "intermediate_size", None)
    if inter:
        sizes["intermediate size"] = int(inter)
    moe_inter = getattr(cfg, "moe_intermediate_size", None)
    if moe_inter:
        sizes["expert intermediate size"] = int(moe_inter)
    for what, size in sizes.items():
        if size % tp:
            raise PlanError(f"{where}: tp={tp} does not divide the model's {size} {what} ({family})")


def check_loss_parallel(config: Any, tp: int, where: str = "parallel") -> None:
    """Refuse loss_parallel where it cannot apply: tp = 1 (nothing is split), a vocabulary tp does
    not divide (the head then stays whole), a head tied to the input embedding. Config only."""
    cfg = text_config(config)
    vocab = int(cfg.vocab_size)
    if tp < 2:
        raise PlanError(f"{where}: loss_parallel needs tp > 1 (the head's vocabulary is split over tp ranks); got tp={tp}")
    if vocab % tp:
        raise PlanError(f"{where}: loss_parallel needs tp to divide the vocabulary: tp={tp} does not divide {vocab}")
    if getattr(config, "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False):
        raise PlanError(f"{where}: loss_parallel needs an untied head; this model ties lm_head to the input embedding")


def resolve_plan(
    model: nn.Module, tp: int, override: Mapping[str, str] | None = None, prefix: str = "", *, loss_parallel: bool = False
) -> dict[str, str]:
    """The TP plan for `model` (a transformers PreTrainedModel): its own plan, then `override`
    entries; the vocabulary entries dropped when tp does not divide the vocabulary; with
    `loss_parallel` the head's entry LOSS_PARALLEL_HEAD. `prefix` names the causal LM inside a
    wrapper (a value model's "backbone.")."""
    plan = _full_plan(model, override)
    vocab = int(text_config(model.config).vocab_size)
    if vocab % tp:
        plan = {k: v for k, v in plan.items() if not any(k.split(".")[-1] == key for key in _VOCAB_KEYS)}
    elif loss_parallel:
        _register_head_style()
        plan = {k: LOSS_PARALLEL_HEAD if k.split(".")[-1] in _HEAD_KEYS else v for k, v in plan.items()}
    return {f"{prefix}{k}": v for k, v in plan.items() if v not in PARTIAL_GRAD_STYLES}


def _full_plan(model: nn.Module, override: Mapping[str, str] | None) -> dict[str, str]:
    plan = dict(getattr(model, "tp_plan", None) or {})
    plan.update(override or {})
    if not plan:
        raise PlanError(f"{type(model).__name__} has no tensor-parallel plan; give options.parallel.tp_plan")
    return plan


def partial_grad_names(model: nn.Module, override: Mapping[str, str] | None = None, prefix: str = "") -> list[str]:
    """Parameters of `model` (names under `prefix`) that stay replicated over tp but see only this
    rank's heads, so their gradients are partial sums to add over the tp group (Qwen3's per-head
    q_norm / k_norm)."""
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard

    patterns = {k for k, v in _full_plan(model, override).items() if v in PARTIAL_GRAD_STYLES}
    out = []
    for name, _ in model.named_parameters():
        module = replace_layer_number_by_wildcard(name.rsplit(".", 1)[0])
        if module in patterns:
            out.append(f"{prefix}{name}")
    return out


def apply_tp(model: nn.Module, tp_mesh: Any, plan: Mapping[str, str], lm: Any = None) -> None:
    """Shard `model` in place over `tp_mesh` with transformers' DTensor TP styles. Every rank must
    hold the same full weights (each keeps its own chunk; nothing is sent). A tied head is tied
    again afterwards (the styles replace the embedding's and the head's parameter separately).
    `lm`: the causal LM inside `model` whose embeddings may be tied (default: model itself)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    lm = model if lm is None else lm
    head: Any = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    embedding = lm.get_input_embeddings()
    tied = isinstance(embedding, nn.Embedding) and getattr(head, "weight", None) is embedding.weight
    apply_tensor_parallelism(model, tp_mesh, dict(plan))
    if tied:  # (a pipeline stage holding only one of the two has nothing to re-tie)
        head.weight = embedding.weight


def split_dims(model: nn.Module, mesh_dim: str = "tp") -> dict[str, int | None]:
    """Each parameter's dim split over the `mesh_dim` mesh dimension (None: every tp rank holds all
    of it), by name, tied aliases included. Read from the DTensor placements apply_tp left."""
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, int | None] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        dim = None
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            if mesh_dim in names:
                placement = param.placements[names.index(mesh_dim)]
                if isinstance(placement, Shard):
                    dim = placement.dim % param.dim()
        out[name] = dim
    return out


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk `index` when `size` rows are cut into `parts` the way DTensor's
    Shard does (torch.chunk: ceil(size / parts) each, the last ones shorter or empty)."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size)
