"""The actor role daemon: one set of policy weights that trains (PPO-family loss) and generates,
through the hybrid engine — weights pushed into the generation engine before each rollout, its
memory released after.

Options (beyond roles/common.py's): `generator` ("hf" | "vllm"), `sampling` (SamplingParams
defaults), `vllm` (VLLMConfig fields but model_dir), `parallel` {tp, pp} (training layout; dp
follows from world_size; default the placement's HFRT_TP_SIZE / HFRT_PP_SIZE) and
`generation.parallel` {tp, pp} (default: the training sizes): with either above 1 the actor trains
on the TP engine and generates with a TP model at the generation layout, filled by micro-DP
resharding (roles/parallel, hybrid.ReshardHybrid); `generate` splits rows by generation dp. Endpoints take Batches whose extra positional
Batches (same rows) are merged in, so a flow can pass `(rollout, old_log_probs, advantages)`
without a daemon-side join. It knows the endpoint contract and nothing of the algorithm: the flow
gives the loss options and computes advantages elsewhere.

Phases: `generate` is one round trip (weights pushed, sample, generation memory released). The
agent loop's turns (`generate_turn`, roles/agent_turns.py) leave the daemon in the generation
phase, so a multi-turn round pushes the weights once, not once per turn; every endpoint that
reads or changes the training weights first returns to the training phase (`in_training_phase`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.batch import Batch
from hfrt.roles.common import (
    CheckpointEndpoints,
    ModelOptions,
    build_dataclass,
    build_engine,
    check_backend,
    check_generation_options,
    check_options,
    close_group,
    needs_group,
    prepare_process,
    role_errors,
    sampling_params,
)
from hfrt.roles.generation.batches import decode_responses, encode_prompt, fixed_width, rollout_batch, with_uids
from hfrt.roles.generation.hf import GenerationEngine, HFGenerationEngine, SamplingParams
from hfrt.roles.generation.hybrid import HybridEngine, ReshardHybrid
from hfrt.roles.losses import LossScale, PolicyLossConfig, agg_loss, kl_penalty, policy_loss, zero_masked
from hfrt.roles.mixins.advantage import AdvantageEndpoints  # compute_advantages (RANK0), in its own module
from hfrt.roles.mixins.agent_turns import AgentTurns  # generate_turn, assemble_trajectories: the agent loop's turns
from hfrt.roles.mixins.weight_sync import WeightPublisher  # publish_weights (REPLICATE), for rollout daemons
from hfrt.roles.models import ModelConfig, export_model_dir, load_model, load_tokenizer, resolve_model_dir
from hfrt.roles.rows import all_reduce, check_rows, forward_inputs, merge, reduce_metrics
from hfrt.roles.training.engines import ForwardOutput, LossFn
from hfrt.roles.training.updates import MakeLoss, accumulate, forward_equal, require_one_step, run_updates
from hfrt.wire.endpoints import Dispatch, endpoint
from hfrt.wire.loss_options import ActorLoss as ActorLoss  # declared torch-free, checked before launch
from hfrt.wire.loss_options import check_update_options

#: attribute in_training_phase sets on the endpoints it wraps (what tests check every endpoint for)
PHASE_ATTR = "__hfrt_training_phase__"


def in_training_phase(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an actor endpoint so the daemon is back in the training phase before it runs
    (ActorDaemon._to_train: the generation engine asleep, its memory free; a no-op when already
    there). Every endpoint that reads or changes the training weights, or needs the generation
    engine's memory, takes it; the endpoint record `@endpoint` put on `fn` carries over, so it
    also wraps an inherited endpoint in a class body (`save = in_training_phase(Checkpoint.save)`).
    Only for endpoints every rank receives (REPLICATE, SPLIT): a phase change can be collective."""

    @functools.wraps(fn)
    def run(self: ActorDaemon, *args: Any, **kwargs: Any) -> Any:
        self._to_train()
        return fn(self, *args, **kwargs)

    setattr(run, PHASE_ATTR, True)
    return run


def actor_loss(cfg: ActorLoss) -> MakeLoss:
    """Policy loss of cfg.policy_loss_mode (TIS-weighted with tis_cap) − entropy bonus + KL loss,
    each term's share recorded."""
    policy = PolicyLossConfig(
        cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.loss_agg_mode,
        mode=cfg.policy_loss_mode, tis_cap=cfg.tis_cap, norm_horizon=cfg.norm_horizon,
    )

    def aggregate(mat: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
        return agg_loss(mat, mask, cfg.loss_agg_mode, scale, cfg.norm_horizon)

    def make(scale: LossScale, shares: dict[str, float]) -> LossFn:
        def loss_fn(out: ForwardOutput, mb: Any, _: LossScale) -> tuple[torch.Tensor, dict[str, Any]]:
            assert out.log_probs is not None
            mask = mb["response_mask"]
            # No old_log_probs column: the update is on-policy (one optimizer step per rollout), so
            # the old log-probs are the current ones, detached (the ratio is exactly 1).
            old = mb["old_log_probs"] if "old_log_probs" in mb else out.log_probs.detach()
            loss, metrics = policy_loss(
                out.log_probs, old, mb["advantages"], mask, policy, scale, mb.get("rollout_log_probs")
            )
            accumulate(shares, "actor/pg_loss", loss.detach())
            if cfg.entropy_coeff:
                assert out.entropy is not None
                entropy = aggregate(out.entropy, mask, scale)
                loss = loss - cfg.entropy_coeff * entropy
                accumulate(shares, "actor/entropy", entropy.detach())
            if cfg.use_kl_loss:
                kl = aggregate(kl_penalty(out.log_probs, zero_masked(mb["ref_log_prob"], mask), cfg.kl_loss_type), mask, scale)
                loss = loss + cfg.kl_loss_coef * kl
                accumulate(shares, "actor/kl_loss", kl.detach())
            return loss, metrics

        return loss_fn

    return make


class ActorDaemon(WeightPublisher, AdvantageEndpoints, CheckpointEndpoints, AgentTurns, Daemon):
    """Endpoints: generate, compute_log_prob, update (SPLIT); save, load, export_hf, weight_sync_report,
    publish_weights, weight_version, hybrid_phase (REPLICATE); generate_turn (SPLIT_GENERATION) and
    assemble_trajectories (SPLIT), from roles/agent_turns.py; compute_advantages, advantage_state,
    load_advantage_state (RANK0, from roles/advantage.py).

    Weight version: the number of optimizer steps the training engine has applied (engine.steps),
    so it changes exactly when the weights do and a checkpoint load restores it; with one optimizer
    step per update (GRPO on-policy) it is the number of updates applied, which is the version
    grpo_async publishes after each update."""

    OPTIONS = frozenset({"generator", "sampling", "vllm", "parallel", "generation"})
    #: endpoints that stay in the generation phase (the agent loop's); `generate` makes its own
    #: round trip; the RANK0 endpoints (advantages) touch no engine and never change phase
    GENERATION_SIDE = frozenset({"generate_turn", "assemble_trajectories"})
    PHASE_FREE = frozenset({"generate", "describe", "weight_version", "hybrid_phase"})

    # inherited endpoints that read the training weights: back in the training phase first
    save = in_training_phase(CheckpointEndpoints.save)
    load = in_training_phase(CheckpointEndpoints.load)
    publish_weights = in_training_phase(WeightPublisher.publish_weights)

    @classmethod
    def check_config(cls, context: DaemonContext) -> None:
        check_options(context, cls.OPTIONS)
        layouts = read_layouts(context)
        check_backend(context, ModelOptions.read(with_layout(context.options, layouts), trainable=True).engine)
        check_generation_options(context.options)
        if layouts is not None and context.options.get("generator", "hf") == "vllm":
            check_vllm_layout(*layouts, where=f"roles.{context.role}.options.generation.parallel")

    async def setup(self) -> None:
        with role_errors(self.context):
            ctx = self.context
            self.check_config(ctx)
            self.layouts = read_layouts(ctx)
            self.opts = ModelOptions.read(with_layout(ctx.options, self.layouts), trainable=True)
            self._joined = prepare_process(ctx, needs_group=needs_group(ctx, self.opts.engine))
            self.tokenizer = load_tokenizer(self.opts.model, self.opts.seed)
            self.sampling = sampling_params(ctx.options.get("sampling"))
            kind = str(ctx.options.get("generator", "hf"))
            self.engine = build_engine(ctx, self.opts, extra_copies=1 if kind == "hf" else 0)
            self.hybrid: HybridEngine
            if self.layouts is not None and kind == "vllm":
                # each rank one vLLM rank at the generation tp (external_launcher), fed full blocks
                self.generator = self._generation_engine(kind, self.layouts[1])
                self.hybrid = HybridEngine(self.engine, self.generator)
            elif self.layouts is not None:
                self.hybrid = self._resharding_hybrid(*self.layouts)
                self.generator = self.hybrid.gen
            else:
                self.generator = self._generation_engine(kind)
                self.hybrid = HybridEngine(self.engine, self.generator)
            self.generator.sleep()  # the daemon starts in the training phase
            self.transitions = {"to_generate": 0, "to_train": 0}  # phase changes that did work

    def _resharding_hybrid(self, train: Any, gen: Any) -> ReshardHybrid:
        """Generation at its own layout: a TP model in this rank's generation TP group, filled by
        micro-DP resharding from the training engine's pieces (roles/parallel)."""
        from hfrt.roles.training.parallel import layout as L
        from hfrt.roles.training.parallel import tp_model
        from hfrt.roles.training.parallel.reshard import Resharder
        from hfrt.roles.training.parallel.shard import ModelShape

        config = self.engine.model.config
        groups = L.new_groups(train, gen, self.context.rank)
        shapes = {n: tuple(shape) for n, (shape, _) in self.engine.layout.full_shapes.items()}  # type: ignore[attr-defined]
        resharder = Resharder(train, gen, self.context.rank, shapes, ModelShape.of(config), groups)
        dtype = getattr(torch, self.opts.dtype)
        pp_group, pp_ranks = gen_pp_group(train, gen, self.context.rank)
        # the group's ranks in generation-tp order: a strided group need not be ascending
        model = tp_model.empty_parallel(
            config, tp_group=groups.gen_tp, tp_ranks=groups.gen_tp_ranks, pp_group=pp_group, pp_ranks=pp_ranks, dtype=dtype
        )
        tok = self.tokenizer
        generator = HFGenerationEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        return ReshardHybrid(self.engine, generator, resharder)

    def dp_axes(self) -> dict[str, list[int]]:
        """Training rows by training dp, generation rows by generation dp (Dispatch.SPLIT_GENERATION)."""
        layouts = getattr(self, "layouts", None)
        if layouts is None:
            return {}
        from hfrt.roles.training.parallel.layout import dp_axes

        return dp_axes(layouts[0], layouts[1], self.context.rank)

    def _generation_dp_rank(self) -> int:
        return self.dp_axes().get("generation", [self.context.dp_rank])[0]

    def _generation_engine(self, kind: str, gen_layout: Any = None) -> GenerationEngine:
        tok = self.tokenizer
        if kind == "hf":
            copy = load_model(ModelConfig(self.opts.model, self.opts.dtype, seed=self.opts.seed))
            return HFGenerationEngine(copy, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        if kind == "vllm":
            from hfrt.roles.generation.vllm_engine import VLLMConfig, VLLMGenerationEngine

            fields = dict(self.context.options.get("vllm") or {})
            fields.setdefault("seed", self.opts.seed)
            fields["model_dir"] = str(resolve_model_dir(self.opts.model, self.opts.seed))
            if gen_layout is not None and gen_layout.tp > 1:
                fields["tensor_parallel_size"], fields["data_parallel_size"] = gen_layout.tp, gen_layout.dp
            return VLLMGenerationEngine(build_dataclass(VLLMConfig, fields, "vllm"), pad_token_id=tok.pad_token_id)
        raise ValueError(f"unknown generator {kind!r}: use hf or vllm")

    async def teardown(self) -> None:
        close_group(getattr(self, "_joined", False))

    def _temperature(self, batch: Batch, explicit: float | None = None) -> float:
        if explicit is not None:
            return float(explicit)
        return float(batch.meta.get("temperature", self.sampling.temperature))

    # -- rollouts ---------------------------------------------------------------------------

    @endpoint(dispatch=Dispatch.SPLIT_GENERATION)
    def generate(self, batch: Batch, *extra: Batch, **sampling: Any) -> Batch:
        """Sample responses for the `prompt` column (strings, chats or token ids); keyword
        arguments override the `sampling` option for this call. See roles/rollout.py for the
        output; meta holds the transition timings and peak memory (max over ranks)."""
        prompts = with_uids(merge(batch, extra))
        check_rows(len(prompts), "actor.generate")
        params = sampling_params(self.sampling, **sampling)
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + self._generation_dp_rank())
        if "prompt" not in prompts:
            raise KeyError(f"actor.generate needs a non-tensor column 'prompt'; the batch has {list(prompts.non_tensor)}")
        ids = [encode_prompt(self.tokenizer, p) for p in prompts["prompt"]]
        if self.layouts is not None and params.seed is None:
            # the ranks of one generation TP group must draw the same tokens: one seed for the
            # call (max over ranks), offset by the generation dp rank
            drawn = int(torch.randint(2**31, ()).item())
            width, top = all_reduce([max(len(i) for i in ids), drawn], "max")
            params = dataclasses.replace(params, seed=int(top) + self._generation_dp_rank())
        else:
            [width] = all_reduce([max(len(i) for i in ids)], "max")
        out, metrics = self.hybrid.generate(ids, params)
        self._count(metrics)
        record = fixed_width(
            out, prompt_width=int(width), response_width=params.max_new_tokens,
            pad_id=self.tokenizer.pad_token_id, n=params.n,
        )
        texts = decode_responses(self.tokenizer, record["responses"], record["response_mask"])
        meta = reduce_metrics(metrics, "max") | {"temperature": params.temperature, "n": params.n}
        meta |= length_stats(record["response_mask"], params.max_new_tokens)
        return rollout_batch(record, texts, prompts, params.n, meta)

    # -- phases ---------------------------------------------------------------------------------

    def _count(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Count the transitions a hybrid call's metrics show (a no-op transition reports none)."""
        self.transitions["to_generate"] += "timing/reshard_to_generate_s" in metrics
        self.transitions["to_train"] += "timing/reshard_to_train_s" in metrics
        return dict(metrics)

    def _to_train(self) -> dict[str, Any]:
        return self._count(self.hybrid.to_train())

    def _to_generate(self) -> dict[str, Any]:
        return self._count(self.hybrid.to_generate())

    @endpoint(dispatch=Dispatch.REPLICATE)
    def hybrid_phase(self) -> dict[str, Any]:
        """This rank's phase ("train" | "generate"), how many transitions to each did work since
        the daemon started (to_generate pushes the weights), and the weight version."""
        return {"phase": self.hybrid.phase, **self.transitions, "weight_version": self.engine.steps}

    @endpoint(dispatch=Dispatch.REPLICATE)
    def weight_version(self) -> int:
        """The policy version this actor samples with: its optimizer steps so far (class docstring)."""
        return int(self.engine.steps)

    # -- agent turns: the AgentTurns hooks (roles/agent_turns.py) ------------------------------

    def _turn_prepare(self, params: SamplingParams) -> tuple[SamplingParams, dict[str, float]]:
        """To the generation phase (weights pushed on the first turn after a training-side call;
        later turns find it there) and the seed: the call's seed plus the generation dp rank, or,
        with a generation layout and no seed, one drawn seed all ranks agree on (max over ranks),
        so the ranks of a generation TP/PP group draw the same tokens."""
        meta = self._to_generate()
        meta["reshard/pushes"] = 1.0 if "timing/reshard_to_generate_s" in meta else 0.0
        if params.seed is None and self.layouts is not None:
            [top] = all_reduce([int(torch.randint(2**31, ()).item())], "max")
            params = dataclasses.replace(params, seed=int(top))
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + self._generation_dp_rank())
        return params, meta

    def _turn_generate(self, contexts: list[list[int]], params: SamplingParams) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        if self.hybrid.phase != "generate":
            raise RuntimeError(f"actor {self.context.identity}: a turn must be sampled in the generation phase (it is in {self.hybrid.phase!r})")
        start = time.perf_counter()
        out = self.generator.generate(contexts, params)
        return out, {"timing/generate_s": time.perf_counter() - start}

    def _turn_version(self) -> int:
        return int(self.engine.steps)

    # -- training-side endpoints: each first back in the training phase -------------------------

    @endpoint(dispatch=Dispatch.SPLIT)
    @in_training_phase
    def compute_log_prob(self, batch: Batch, *extra: Batch, temperature: float | None = None) -> Batch:
        """Current-policy log-probs (`old_log_probs`) and `entropy` of the responses, 0 where masked."""
        batch = merge(batch, extra)
        tensors = forward_inputs(batch, "actor.compute_log_prob")
        out = forward_equal(
            self.engine, tensors, "actor.compute_log_prob", temperature=self._temperature(batch, temperature),
            with_entropy=True,
        )
        assert out.log_probs is not None and out.entropy is not None
        mask = tensors["response_mask"].to(out.log_probs.dtype)
        return Batch({"old_log_probs": out.log_probs * mask, "entropy": out.entropy * mask})

    # -- training ---------------------------------------------------------------------------

    @endpoint(dispatch=Dispatch.SPLIT)
    @in_training_phase
    def update(self, batch: Batch, *extra: Batch, **loss: Any) -> dict[str, float]:
        """PPO epochs × mini-batches of optimizer steps on `advantages`, `old_log_probs` (and
        `ref_log_prob` with use_kl_loss, `rollout_log_probs` with tis_cap). Options: ActorLoss and
        UpdateSchedule fields (hfrt.wire.loss_options). Returns metrics averaged over steps, the same on
        every rank. Without an `old_log_probs` column the update must be one optimizer step
        (on-policy: ppo_epochs 1, one mini-batch) and the old log-probs are the current ones,
        detached — what a compute_log_prob pass would have given, without its forward pass."""
        batch = merge(batch, extra)
        schedule, cfg = check_update_options("actor", loss)
        with_old = "old_log_probs" in batch.tensors
        if not with_old:
            require_one_step(schedule, len(batch), "actor.update")
        more = ["advantages"] + (["old_log_probs"] if with_old else []) + (["ref_log_prob"] if cfg.use_kl_loss else [])
        more += ["rollout_log_probs"] if cfg.tis_cap is not None else []
        return run_updates(
            self.engine, forward_inputs(batch, "actor.update", *more), actor_loss(cfg), schedule,
            prefix="actor", endpoint="actor.update", temperature=self._temperature(batch, cfg.temperature),
            with_entropy=cfg.entropy_coeff != 0,
        )

    @endpoint(dispatch=Dispatch.REPLICATE)
    @in_training_phase
    def export_hf(self, path: str) -> str:
        """Write the current policy as a Hugging Face model folder (the base model's config and
        tokenizer, the trained weights as model.safetensors) that transformers and vLLM load.
        Every rank takes part in gathering the weights; rank 0 writes."""
        keep = self.context.rank == 0
        weights: dict[str, torch.Tensor] = {}
        for bucket in self.engine.state_dict_for_generation():
            if keep:
                weights.update({name: t.detach().to("cpu", copy=True) for name, t in bucket.items()})
        if keep:
            export_model_dir(resolve_model_dir(self.opts.model, self.opts.seed), weights, Path(path))
        return str(path)

    @endpoint(dispatch=Dispatch.REPLICATE)
    @in_training_phase
    def weight_sync_report(self) -> dict[str, Any]:
        """Push weights as before a rollout and compare the generation engine's copy with the
        gathered training weights (diagnostic; gathers the weights twice)."""
        self._to_generate()
        try:
            return compare_weights(self.engine.state_dict_for_generation(), self._generation_parameters())
        finally:
            self._to_train()

    def _generation_parameters(self) -> dict[str, torch.Tensor] | None:
        if isinstance(self.generator, HFGenerationEngine):
            return dict(self.generator.model.named_parameters())
        return None  # vLLM fuses and renames parameters: only checksums compare


def read_layouts(context: DaemonContext) -> tuple[Any, Any] | None:
    """(training, generation) Layouts from options.parallel {tp, pp} (default: the placement's
    HFRT_TP_SIZE / HFRT_PP_SIZE, else 1) and options.generation.parallel {tp, pp} (default: the
    training sizes); None when both are 1 × 1 (the data-parallel actor). ValueError names the
    option that does not fit the world size or the other layout."""
    from hfrt.roles.training.parallel.layout import Layout, check_pair

    where = f"roles.{context.role}.options"
    par = _table(context.options.get("parallel"), f"{where}.parallel")
    tp = int(par.get("tp", os.environ.get("HFRT_TP_SIZE", 1)))
    pp = int(par.get("pp", os.environ.get("HFRT_PP_SIZE", 1)))
    gen_opts = _table(_table(context.options.get("generation"), f"{where}.generation").get("parallel"), f"{where}.generation.parallel")
    tp_g, pp_g = int(gen_opts.get("tp", tp)), int(gen_opts.get("pp", pp))
    if tp * pp == 1 and tp_g * pp_g == 1:
        return None
    train = Layout.for_world(context.world_size, tp, pp, f"{where}.parallel")
    gen = Layout.for_world(context.world_size, tp_g, pp_g, f"{where}.generation.parallel")
    check_pair(train, gen)
    return train, gen


def gen_pp_group(train: Any, gen: Any, rank: int) -> tuple[Any, list[int] | None]:
    """This rank's generation pipeline group and its ranks in stage order, (None, None) when the
    generation layout has one stage. Collective when pp_g > 1: every rank creates every group."""
    if gen.pp == 1:
        return None, None
    import torch.distributed as dist

    from hfrt.roles.training.parallel.layout import gen_pp_groups

    mine: tuple[Any, list[int] | None] = (None, None)
    for ranks in gen_pp_groups(train, gen):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = (group, ranks)
    return mine


def check_vllm_layout(train: Any, gen: Any, where: str) -> None:
    """generator 'vllm' at a generation layout (tensor parallel only: hfrt does not run vLLM's
    pipeline stages, refused here). vLLM's external_launcher orders its ranks TP
    innermost over the whole world (TP rank = rank % tp, DP rank = rank // tp), so the generation
    TP groups must be sets of consecutive ranks; strided groups (e.g. t4p1d1 → t2p1d2, whose
    groups are [0, 2] and [1, 3]) are refused. vLLM gets full checkpoint tensors one block at a
    time and keeps its TP slice itself: its loaders narrow full tensors
    (model_executor/layers/linear.py weight_loader) into fused per-rank qkv_proj / gate_up_proj and
    a vocabulary padded to a multiple of 64 (VocabParallelEmbedding), which hfrt's micro-DP pieces
    do not match, so the transition moves each block whole (not micro-DP resharding)."""
    from hfrt.roles.training.parallel.layout import gen_coords

    if gen.pp > 1:
        raise ValueError(f"{where}: pp={gen.pp} with generator 'vllm' is not built (vLLM runs at a generation tp only); use generator 'hf'")
    for rank in range(train.world):
        g, _ = gen_coords(train, gen, rank)
        if g.dp != rank // gen.tp:  # the tp order within a group is vLLM's own (full tensors come in)
            raise ValueError(
                f"{where}: {train} → {gen} puts rank {rank} in generation dp group {g.dp}; vLLM's "
                f"external_launcher puts it in {rank // gen.tp} (TP groups of consecutive ranks). "
                f"Use generator 'hf' for this layout pair"
            )


def with_layout(options: Mapping[str, Any], layouts: tuple[Any, Any] | None) -> dict[str, Any]:
    """options with engine.tp / engine.pp from the training layout (backend 'tp' unless fsdp2)."""
    out = dict(options)
    if layouts is None:
        return out
    train = layouts[0]
    engine = dict(out.get("engine") or {})
    if engine.get("backend", "local") not in ("tp", "fsdp2"):
        engine["backend"] = "tp"
    engine.update(tp=train.tp, pp=train.pp)
    out["engine"] = engine
    return out


def _table(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a table, e.g. {{tp = 2, pp = 1}}; got {value!r}")
    return dict(value)


def length_stats(response_mask: torch.Tensor, max_new_tokens: int) -> dict[str, float]:
    """Response length mean / max / min over every rank's rows, the tokens generated, and the
    share of responses cut at max_new_tokens."""
    lengths = response_mask.long().sum(-1).double()
    rows, tokens, clipped = all_reduce([len(lengths), float(lengths.sum()), float((lengths >= max_new_tokens).sum())], "sum")
    [longest] = all_reduce([float(lengths.max()) if len(lengths) else 0.0], "max")
    [shortest] = all_reduce([float(lengths.min()) if len(lengths) else float(max_new_tokens)], "min")
    return {
        "response_length/mean": tokens / max(rows, 1), "response_length/max": longest,
        "response_length/min": shortest, "response_length/clip_ratio": clipped / max(rows, 1),
        "response_tokens": tokens,
    }


def compare_weights(train: Any, generation: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Max |difference| per parameter name (when names match) and fp64 checksums of both sides."""
    max_diff, compared, train_sum = 0.0, 0, 0.0
    for bucket in train:
        for name, tensor in bucket.items():
            train_sum += float(tensor.double().sum())
            if generation is not None:
                other = generation[name].detach().to(tensor.device).double()
                max_diff = max(max_diff, float((other - tensor.double()).abs().max()))
                compared += 1
    gen_sum = None if generation is None else sum(float(p.detach().double().sum()) for p in generation.values())
    return {"max_abs_diff": max_diff, "compared": compared, "train_checksum": train_sum, "generation_checksum": gen_sum}
