"""Sequence parallelism over the tp ranks (Megatron's, composed with DTensor the way torchtitan
does): outside the attention and MLP blocks — the norms, the residual adds, dropouts — each tp
rank holds 1/tp of the sequence, as a DTensor `Shard(1)`. A block gathers the sequence on entry
(all-gather; its backward a reduce-scatter) and its row-parallel output projection reduce-scatters
over the sequence instead of all-reducing; the final norm's output is gathered for the head.

Derived from the tp plan the engine applied, not from a table of module names: in each decoder
layer a child holding tp-sharded (DTensor) parameters is a block, a child with only plain ones
is a norm (its weight becomes a replicated DTensor: torch's `SequenceParallel`); the plan's
row-parallel entries directly under a block get a `Shard(1)` output (`sequence_plan`). Because
the residual stream is a DTensor, transformers' model code sees the global sequence length (the
causal mask, rotary positions) while each rank stores its shard.

With pipeline stages, each stage sends and receives its sequence shard (parallel/pipeline's
`StageModule.sequence_mesh`). Refused before launch (`check`): tp < 2 and model types whose
decoder layers the tests have not run this way (VERIFIED). It knows nothing of engines, pipelines,
data parallelism, losses or generation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

#: model types whose layer structure (norm → block → residual add, the block's row-parallel
#: projection last) tests/roles/test_sequence_parallel.py checks against one process
VERIFIED = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "qwen3_moe")
#: the suffix of the registered row-parallel style that reduce-scatters over the sequence
_SUFFIX = "_hfrt_seq"


class SequenceParallelError(ValueError):
    """sequence_parallel cannot apply to this layout or model; the message says why."""


def check(config: Any, tp: int, where: str = "engine") -> None:
    """Refuse sequence_parallel where it cannot apply. Config only: runs before launch."""
    cfg = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    family = getattr(cfg, "model_type", type(cfg).__name__)
    if tp < 2:
        raise SequenceParallelError(f"{where}: sequence_parallel needs tp > 1 (it splits the sequence over the tp ranks); got tp={tp}")
    if family not in VERIFIED:
        raise SequenceParallelError(
            f"{where}: sequence_parallel is verified for model types {', '.join(VERIFIED)}, not {family!r} "
            f"(its decoder layer may act on the residual stream in ways the sharded sequence does not follow); "
            f"use sequence_parallel=false"
        )


def sequence_plan(plan: Mapping[str, str]) -> dict[str, str]:
    """`plan` with every row-parallel entry that sits directly under a decoder layer's block
    (`*.layers.*.<block>.<leaf>`) and all-reduces to a replicated output replaced by the same
    style reduce-scattering to Shard(1) (registered with transformers as `<style>_hfrt_seq`)."""
    out = dict(plan)
    for key, style in plan.items():
        head, star, tail = key.rpartition("*.")
        if star and len(tail.split(".")) == 2 and _register(style):
            out[key] = style + _SUFFIX
    return out


def _register(style: str) -> bool:
    """Register the sequence-sharded variant of a row-parallel style; False for other styles."""
    from torch.distributed.tensor import Replicate, Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, ParallelInterface, RowwiseParallel

    base = ALL_PARALLEL_STYLES[style] if style in ALL_PARALLEL_STYLES else None
    if type(base) is not RowwiseParallel or not isinstance(base.output_layouts, Replicate):
        return False
    if style + _SUFFIX not in ALL_PARALLEL_STYLES:
        variant = RowwiseParallel(input_layouts=base.input_layouts, output_layouts=Shard(1), use_local_output=False)
        ParallelInterface.register(style + _SUFFIX, variant)  # type: ignore[arg-type]
    return True


def apply(lm: Any, layers: list[nn.Module], tp_mesh: Any, partial: set[int] | frozenset[int] = frozenset()) -> None:
    """Install sequence parallelism on `lm` (a transformers model after apply_tp with
    `sequence_plan`): the embedding's output sharded, each decoder layer's norms sequence-parallel
    and blocks gathering their input, the final norm's output gathered. `layers`: the decoder
    layers; `partial`: ids of replicated parameters whose gradients the engine sums over tp."""
    from torch.distributed.tensor import DTensor

    base = lm.base_model
    embedding = lm.get_input_embeddings()
    embedding.register_forward_hook(lambda _m, _a, out: _to_sequence(out, tp_mesh))
    for layer in layers:
        for child in layer.children():
            params = [p for p in child.parameters() if id(p) not in partial]
            if any(isinstance(p, DTensor) for p in params):
                _gather_input(child, tp_mesh, dtensor=all(isinstance(p, DTensor) for p in params))
            elif params:
                _sequence_norm(child, tp_mesh)
    ids = {id(m) for m in layers} | {id(embedding)}
    for child in base.children():
        if id(child) in ids or any(id(m) in ids for m in child.modules()) or not any(True for _ in child.parameters()):
            continue
        _sequence_norm(child, tp_mesh)  # the final norm: its output whole again for the head
        child.register_forward_hook(lambda _m, _a, out: _whole(out))


def _to_sequence(x: Any, mesh: Any) -> Any:
    """A replicated tensor (plain or DTensor) or a partial / sharded DTensor as DTensor Shard(1)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x if x.placements == (Shard(1),) else x.redistribute(placements=[Shard(1)])


def _whole(x: Any) -> Any:
    """A sequence-sharded DTensor as this rank's plain, whole tensor (all-gather)."""
    from torch.distributed.tensor import DTensor, Replicate

    return x.redistribute(placements=[Replicate()]).to_local() if isinstance(x, DTensor) else x


def _sequence_norm(module: nn.Module, mesh: Any) -> None:
    """torch's SequenceParallel on a norm: its parameters replicated DTensors, its input Shard(1)."""
    from torch.distributed.tensor import DTensor, Replicate

    for name, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False), p.requires_grad))

    def pre(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_to_sequence(args[0], mesh), *args[1:])

    module.register_forward_pre_hook(pre)


def _gather_input(block: nn.Module, mesh: Any, *, dtensor: bool) -> None:
    """A block's `hidden_states` (first argument or keyword) gathered over the sequence on entry;
    its output (or first output) Shard(1) on exit. `dtensor`: hand the block a replicated DTensor
    (every parameter inside is tp-sharded, so its colwise projections leave their input gradients
    partial and the gather's backward is one reduce-scatter); else a plain tensor (a block with
    plain parameters, e.g. an MoE router, would not mix with a DTensor)."""
    from torch.distributed.tensor import DTensor, Replicate

    def gather(x: Any) -> Any:
        if not isinstance(x, DTensor):
            return x
        x = x.redistribute(placements=[Replicate()])
        return x if dtensor else x.to_local()

    def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

    def post(_m: nn.Module, _a: Any, _k: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (_to_sequence(out[0], mesh), *out[1:])
        return _to_sequence(out, mesh)

    block.register_forward_pre_hook(pre, with_kwargs=True)
    block.register_forward_hook(post, with_kwargs=True)
