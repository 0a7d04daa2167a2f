"""vLLM at a generation tp fed micro-DP pieces instead of full blocks.

Each rank gathers only its generation shard through the 3D-HybridEngine exchange
(roles/training/parallel/reshard.py: inside its micro-DP group, nothing when the layouts agree),
then hands vLLM's checkpoint-format loaders (`reload_weights(is_checkpoint_format=True)`) a
*full-shaped* tensor whose only written region is the rows that loader narrows for this rank
(`full_shaped`: uninitialised storage, the piece copied in at its offset; on CPU the untouched pages
are never resident, and a split along a later dim overlaps the rows so the storage is the piece
plus one row). Which rows a loader keeps is read from vLLM's own layers (`vllm_rows`: vocabulary
shard indices, the fused q/k/v and gate/up offsets, row-parallel input partitions, by the model's
packed_modules_mapping); a parameter whose vLLM rows differ from the even training split
(`tp_plan.chunk_bounds`) — a vocabulary padded per partition when it is not a multiple of 64·t_g,
KV heads replicated when t_g > num_kv_heads, a layer vLLM keeps whole, a name vLLM renames — is
pushed whole for every rank (`whole` names, the same on every rank) and counted. It knows vLLM's
layer classes, the reshard's Params and Resharder, and the training engine's local_pieces /
buckets / full_shapes / split_dims; nothing of losses, the wire or sampling.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from hfrt.roles.generation.hybrid import HybridEngine
from hfrt.roles.training.engines.base import TrainEngine
from hfrt.roles.training.parallel.tp_plan import chunk_bounds

#: (dim, start, stop): the rows of a full checkpoint tensor a vLLM loader keeps on this rank
Rows = tuple[int, int, int]


def vllm_rows(model: torch.nn.Module) -> dict[str, Any]:
    """Run inside vLLM (`llm.apply_model`): this rank's vLLM tp rank and size, and for every
    checkpoint (HF) name whose loader narrows it by tp rank, the rows it keeps. Names vLLM keeps
    whole, or whose layer class is not one of vLLM's standard parallel layers, are absent."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
    rows: dict[str, Rows] = {}
    for prefix, m in model.named_modules():
        head, _, leaf = prefix.rpartition(".")

        def put(part: str, span: tuple[int, int], dim: int = 0, bias: bool = True, head: str = head) -> None:
            name = f"{head}.{part}" if head else part
            rows[f"{name}.weight"] = (dim, span[0], span[0] + span[1])
            if bias:
                rows[f"{name}.bias"] = (dim, span[0], span[0] + span[1])

        if isinstance(m, VocabParallelEmbedding):
            si = m.shard_indices
            rows[f"{prefix}.weight"] = (0, int(si.org_vocab_start_index), int(si.org_vocab_end_index))
        elif isinstance(m, QKVParallelLinear):
            parts = packed.get(leaf, [])
            if len(parts) == 3:
                kv = m.tp_rank // m.num_kv_head_replicas
                q, k, v = m.num_heads * m.head_size, m.num_kv_heads * m.head_size, m.num_kv_heads * m.v_head_size
                for part, span in zip(parts, [(m.tp_rank * q, q), (kv * k, k), (kv * v, v)], strict=True):
                    put(part, span)
        elif isinstance(m, MergedColumnParallelLinear):
            parts = packed.get(leaf, [])
            if len(parts) == len(m.output_sizes):
                for part, size in zip(parts, m.output_sizes, strict=True):
                    n = int(size) // m.tp_size
                    put(part, (m.tp_rank * n, n))
        elif isinstance(m, ColumnParallelLinear):
            n = int(m.output_size_per_partition)
            put(leaf, (m.tp_rank * n, n))
        elif isinstance(m, RowParallelLinear):
            n = int(m.input_size_per_partition)
            put(leaf, (m.tp_rank * n, n), dim=1, bias=False)  # a row-parallel bias is added once, whole
    return {"tp_rank": int(get_tensor_model_parallel_rank()), "tp": int(get_tensor_model_parallel_world_size()), "rows": rows}


def piece_dims(
    shapes: Mapping[str, tuple[int, ...]], train_dims: Mapping[str, int | None], rows: Mapping[str, Rows], tp: int, tp_rank: int
) -> dict[str, int | None]:
    """Each parameter's generation split dim for the reshard: the dim vLLM narrows where its rows
    are exactly this rank's even chunk (chunk_bounds) along the dim training splits (or training
    keeps it whole), else None (pushed whole). Local answer; see `agree`."""
    out: dict[str, int | None] = {}
    for name, shape in shapes.items():
        got = rows.get(name)
        dim = None
        if got is not None and tp > 1:
            d, start, stop = got
            if d < len(shape) and train_dims.get(name) in (None, d) and chunk_bounds(shape[d], tp, tp_rank) == (start, stop):
                dim = d
        out[name] = dim
    return out


def agree(dims: dict[str, int | None], group: Any = None) -> dict[str, int | None]:
    """`dims` with None wherever some rank of `group` (default: the world) answered None: every
    rank must plan the same exchange. Collective."""
    import torch.distributed as dist

    names = sorted(dims)
    flags = torch.tensor([0 if dims[n] is None else 1 for n in names], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return {n: dims[n] if int(f) else None for n, f in zip(names, flags.tolist(), strict=True)}


def full_shaped(piece: torch.Tensor, shape: tuple[int, ...], dim: int, start: int) -> torch.Tensor:
    """A tensor of the full checkpoint `shape` whose rows [start, start + piece rows) along `dim` are
    `piece` and whose other elements are never written. Its strides are the piece's own contiguous
    strides, so the written rows are one contiguous run of storage and, for dim > 0, the unwritten
    columns of neighbouring rows alias each other: storage = the piece plus one row (dim 0: the full
    size, of which only the piece's pages are touched). Only for loaders that narrow it and copy."""
    n = int(piece.shape[dim])
    if tuple(piece.shape) != tuple(shape[:dim]) + (n,) + tuple(shape[dim + 1 :]):
        raise ValueError(f"a piece of shape {tuple(piece.shape)} does not fit {tuple(shape)} along dim {dim}")
    strides, acc = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = acc
        acc *= int(piece.shape[i])
    size = 1 + sum((s - 1) * st for s, st in zip(shape, strides, strict=True))
    base = torch.empty(size, dtype=piece.dtype, device=piece.device)
    full = base.as_strided(tuple(shape), tuple(strides))
    full.narrow(dim, start, n).copy_(piece)
    return full


class VLLMPieceHybrid(HybridEngine):
    """The actor's push into vLLM at a generation tp through micro-DP pieces: HybridEngine's
    transition (skip while current, sleep / wake) with the full-weights stream replaced by this
    rank's generation pieces (Resharder.stream over the engine's local_pieces), each presented to
    vLLM full-shaped (`full_shaped`) or, for the `whole` names, as the full tensor. Metrics:
    reshard/bytes_received, reshard/bytes_sent (this rank, counted from the collectives' tensors),
    reshard/exchange_s, reshard/pushed_mb (bytes written into what vLLM's loaders read),
    reshard/whole_params (parameters pushed whole)."""

    def __init__(self, train: TrainEngine, gen: Any, resharder: Any, tp_rank: int, whole: list[str]) -> None:
        super().__init__(train, gen)
        self.resharder = resharder
        self.gen_dims = dict(resharder.params.gen_dims)
        self.tp, self.tp_rank = resharder.gen.tp, tp_rank
        #: parameters split by vLLM or by training but pushed whole (vLLM's split is not the even one)
        self.whole = whole

    def _push(self) -> dict[str, float]:
        engine: Any = self.train
        # FSDP's pieces are views of buffers reused by the next block, and vLLM may hold a tensor
        # until finalize (a layer with padding): _present copies each one once (full_shaped does
        # anyway), so the exchange need not clone first
        owned = not bool(getattr(engine, "sharded", True))
        pushed = [0]
        dtype = getattr(self.gen.llm.model_config, "dtype", None)
        pieces = self.resharder.stream(engine.local_pieces(), engine.buckets, copy=False)
        self.gen.load_weights(self._present(pieces, dtype, pushed, owned=owned), stable=True)
        stats = self.resharder.last
        return {
            "reshard/pushed_mb": pushed[0] / 2**20,
            "reshard/bytes_sent": float(stats.bytes_sent),
            "reshard/bytes_received": float(stats.bytes_received),
            "reshard/exchange_s": stats.time_s,
            "reshard/whole_params": float(len(self.whole)),
        }

    def _present(
        self, pieces: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None, pushed: list[int], *, owned: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each piece as vLLM's loader takes it, cast to vLLM's dtype; a piece that may be a view
        of a reused buffer (owned=False) is copied once on the way."""
        shapes = self.resharder.params.shapes
        for name, piece in pieces:
            dim = self.gen_dims.get(name)
            as_is = dim is None or tuple(piece.shape) == tuple(shapes[name])
            if dtype is not None and piece.is_floating_point() and piece.dtype != dtype:
                piece = piece.to(dtype)  # a new tensor
            elif as_is and not owned:
                piece = piece.clone()
            pushed[0] += piece.numel() * piece.element_size()
            if as_is or dim is None:
                yield name, piece
            else:
                start, _ = chunk_bounds(shapes[name][dim], self.tp, self.tp_rank)
                yield name, full_shaped(piece, shapes[name], dim, start)

    def to_train(self) -> dict[str, float]:
        metrics = super().to_train()
        self.resharder.to_train()
        return metrics


def piece_hybrid(rank: int, engine: Any, gen: Any, train: Any, layout: Any) -> VLLMPieceHybrid:
    """The VLLMPieceHybrid of `rank` over a TP training `engine` (full_shapes, split_dims, buckets,
    local_pieces, virtual) and a VLLMGenerationEngine `gen` at the generation `layout` (consecutive
    TP groups, actor_layout.check_vllm_layout). Collective: creates the pair's process groups and
    agrees on the pieces over the world."""
    from hfrt.roles.training.parallel import layout as L
    from hfrt.roles.training.parallel.reshard import Resharder
    from hfrt.roles.training.parallel.reshard_plan import Params
    from hfrt.roles.training.parallel.tp_plan import text_config

    train = L.Layout(train.tp, train.pp, train.dp, getattr(engine, "virtual", 1))
    info = gen.llm.apply_model(vllm_rows)[0]
    g, _ = L.gen_coords(train, layout, rank)
    if info["tp"] != layout.tp or info["tp_rank"] != g.tp:
        raise RuntimeError(f"rank {rank}: vLLM put it at tp rank {info['tp_rank']} of {info['tp']}; "
                           f"the generation layout {layout} over {train} at {g.tp} of {layout.tp}")  # fmt: skip
    shapes = {n: tuple(s) for n, s in engine.full_shapes.items()}
    train_dims = {n: engine.split_dims.get(n) for n in shapes}
    gen_dims = agree(piece_dims(shapes, train_dims, info["rows"], layout.tp, g.tp))
    params = Params(shapes, train_dims, gen_dims, int(text_config(engine.model.config).num_hidden_layers))
    groups = L.new_groups(train, layout, rank)
    # split by vLLM (its rows) or by training, yet pushed whole: vLLM's split is not the even one,
    # or a layer it is not known to split evenly (e.g. MoE experts)
    whole = sorted(n for n in shapes if gen_dims[n] is None and (n in info["rows"] or train_dims[n] is not None))
    return VLLMPieceHybrid(engine, gen, Resharder(train, layout, rank, params, groups), g.tp, whole)
