"""The actor role daemon: one set of policy weights that trains (PPO-family loss) and generates,
through the hybrid engine — weights pushed into the generation engine before each rollout, its
memory released after.

Options (beyond roles/common.py's): `generator` ("hf" | "vllm"), `sampling` (SamplingParams
defaults), `vllm` (VLLMConfig fields but model_dir), `parallel` {tp, pp} (training layout; dp
follows from world_size; on a cluster, placement fills it from the spec's tp_size / pp_size) and
`generation.parallel` {tp, pp} (default: the training sizes): with either above 1 the actor trains
on the TP engine and generates at the generation layout (roles/actor_layout.py); `generate` splits
rows by generation dp. Endpoints take Batches whose extra positional Batches (same rows) are merged
in, so a flow can pass `(rollout, old_log_probs, advantages)` without a daemon-side join. It knows
the endpoint contract and nothing of the algorithm: the flow gives the loss options.

Phases: `generate` is one round trip (weights pushed, sample, generation memory released). The
agent loop's turns (`generate_turn`, roles/endpoint_groups/agent_turns.py) leave the daemon in the generation
phase, so a multi-turn round pushes the weights once, not once per turn; every endpoint that
reads or changes the training weights first returns to the training phase (`in_training_phase`).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.batch import Batch
from hfrt.roles.actor_layout import build_hybrid, check_vllm_layout, read_layouts, with_layout
from hfrt.roles.common import (
    SAMPLING_OPTIONS,
    ModelOptions,
    build_engine,
    check_backend,
    check_generation_options,
    check_lora,
    check_options,
    check_parallel,
    close_group,
    model_config,
    needs_group,
    prepare_process,
    role_errors,
    sampling_params,
)
from hfrt.roles.components import routing
from hfrt.roles.components.advantage import Advantages
from hfrt.roles.components.weight_sync import publish
from hfrt.roles.endpoint_groups.agent_turns import AgentTurns
from hfrt.roles.generation.batches import (
    chunk_bounds,
    decode_responses,
    encode_prompts,
    fixed_width,
    length_stats,
    rollout_batch,
    with_uids,
)
from hfrt.roles.generation.hf import SamplingParams
from hfrt.roles.generation.hybrid import Phase, compare_weights, generation_parameters
from hfrt.roles.models import export_model_dir, load_tokenizer, resolve_model_dir
from hfrt.roles.reference import masked_log_probs
from hfrt.roles.rows import all_reduce, check_rows, forward_inputs, merge, reduce_metrics
from hfrt.roles.training.actor_loss import actor_loss, prepare_corrections, update_columns
from hfrt.roles.training.lora import adapters_disabled, write_adapter_folder
from hfrt.roles.training.text_objectives import TextTraining, pair_log_probs
from hfrt.roles.training.updates import forward_equal, run_updates
from hfrt.wire.endpoints import Dispatch, endpoint
from hfrt.wire.loss_options import ADVANTAGE_OPTIONS, accepted_options, check_preference_options, check_update_options
from hfrt.wire.loss_options import ActorLoss as ActorLoss  # declared torch-free, checked before launch

#: attribute in_training_phase sets on the endpoints it wraps (what tests check every endpoint for)
PHASE_ATTR = "__hfrt_training_phase__"


def in_training_phase(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an actor endpoint so the daemon is back in the training phase before it runs
    (ActorDaemon._to_train: the generation engine asleep, its memory free; a no-op when already
    there). Every endpoint that reads or changes the training weights, or needs the generation
    engine's memory, takes it, under its `@endpoint` (functools.wraps keeps the signature the
    endpoint record reads). Only for endpoints every rank receives (REPLICATE, SPLIT): a phase
    change can be collective."""

    @functools.wraps(fn)
    def run(self: ActorDaemon, *args: Any, **kwargs: Any) -> Any:
        self._to_train()
        return fn(self, *args, **kwargs)

    setattr(run, PHASE_ATTR, True)
    return run


class ActorDaemon(AgentTurns, Daemon):
    """Endpoints: generate (SPLIT_GENERATION), compute_log_prob, update (SPLIT); sft_update,
    sft_evaluate, dpo_update, dpo_evaluate, compute_ref_pair_log_probs (SPLIT, text rows); save, load,
    export_hf, weight_sync_report, publish_weights, weight_version, hybrid_phase (REPLICATE);
    compute_advantages, advantage_state, load_advantage_state (RANK0, roles/components/advantage.py);
    generate_turn (SPLIT_GENERATION) and assemble_trajectories (SPLIT), the AgentTurns endpoints
    (roles/endpoint_groups/agent_turns.py) over the hooks below.

    Weight version: the number of optimizer steps the training engine has applied (engine.steps),
    so it changes exactly when the weights do and a checkpoint load restores it; with one optimizer
    step per update (GRPO on-policy) it is the number of updates applied, which is the version
    grpo_async publishes after each update."""

    OPTIONS = frozenset({"generator", "sampling", "vllm", "parallel", "generation", "lora", routing.OPTION})
    #: endpoints that stay in the generation phase (the agent loop's); `generate` makes its own
    #: round trip; the RANK0 endpoints (advantages) touch no engine and never change phase
    GENERATION_SIDE = frozenset({"generate_turn", "assemble_trajectories"})
    #: generate_turn_stream refuses on the actor before touching its engine (no token stream here:
    #: OpenAI streams of agent_on=actor go in generate_turn chunks); turn_streams reads counters,
    #: serving_info the model's context and vocabulary
    PHASE_FREE = frozenset({"generate", "describe", "weight_version", "hybrid_phase", "generate_turn_stream", "turn_streams", "serving_info"})
    #: whether setup joined the role's process group (teardown leaves it); False until it does
    _joined: bool = False
    #: (training, generation) layouts, set by setup; None: the data-parallel actor (or no setup yet)
    layouts: tuple[Any, Any] | None = None

    @classmethod
    def check_config(cls, context: DaemonContext) -> None:
        check_options(context, cls.OPTIONS)
        layouts = read_layouts(context)
        opts = ModelOptions.read(with_layout(context.options, layouts), trainable=True)
        check_backend(context, opts.engine)
        check_parallel(context, opts, f"roles.{context.role}.options.parallel")
        check_lora(opts)
        if layouts is not None and layouts[1].tp > 1:
            from hfrt.roles.training.parallel.tp_plan import check_tp

            check_tp(model_config(opts), layouts[1].tp, f"roles.{context.role}.options.generation.parallel")
        check_generation_options(context.options)
        if layouts is not None and context.options.get("generator", "hf") == "vllm":
            check_vllm_layout(*layouts, where=f"roles.{context.role}.options.generation.parallel")
        where = f"roles.{context.role}.options"
        routing.check_before_launch(routing.read_option(context.options, where), model_config(opts), opts.engine.pp, where)

    async def setup(self) -> None:
        with role_errors(self.context):
            ctx = self.context
            self.check_config(ctx)
            self.advantages = Advantages()
            self.layouts = read_layouts(ctx)
            self.opts = ModelOptions.read(with_layout(ctx.options, self.layouts), trainable=True)
            self._joined = prepare_process(ctx, needs_group=needs_group(ctx, self.opts.engine))
            self.tokenizer = load_tokenizer(self.opts.model, self.opts.seed)
            self.sampling = sampling_params(ctx.options.get("sampling"))
            hf_copy = str(ctx.options.get("generator", "hf")) == "hf"
            self.engine = build_engine(ctx, self.opts, extra_copies=1 if hf_copy else 0)
            self.hybrid = build_hybrid(ctx, self.engine, self.tokenizer, self.opts, self.layouts)
            self.generator = self.hybrid.gen
            self.generator.sleep()  # the daemon starts in the training phase
            self.routing = routing.Routing(routing.read_option(ctx.options, f"roles.{ctx.role}.options"),
                                           train_model=self.engine.model, generator=self.generator, where=ctx.role)
            self.transitions = {"to_generate": 0, "to_train": 0}  # phase changes that did work
            self.text = TextTraining(self.engine, self.tokenizer, ctx.role)  # sft_* and dpo_* endpoints

    def dp_axes(self) -> dict[str, list[int]]:
        """Training rows by training dp, generation rows by generation dp (Dispatch.SPLIT_GENERATION)."""
        if self.layouts is None:
            return {}
        from hfrt.roles.training.parallel.layout import dp_axes

        return dp_axes(self.layouts[0], self.layouts[1], self.context.rank)

    def _generation_dp_rank(self) -> int:
        return self.dp_axes().get("generation", [self.context.dp_rank])[0]

    async def teardown(self) -> None:
        close_group(self._joined)

    def _temperature(self, batch: Batch, explicit: float | None = None) -> float:
        if explicit is not None:
            return float(explicit)
        return float(batch.meta.get("temperature", self.sampling.temperature))

    # -- rollouts ---------------------------------------------------------------------------

    @endpoint(dispatch=Dispatch.SPLIT_GENERATION, keywords=SAMPLING_OPTIONS)
    def generate(self, batch: Batch, *extra: Batch, chunk: int | None = None, chunks: int = 1, **sampling: Any) -> Batch:
        """Sample responses for the `prompt` column (strings, chats or token ids); keyword
        arguments override the `sampling` option for this call. See roles/generation/batches.py
        for the output; meta holds the transition timings and peak memory (max over ranks).
        chunk=i, chunks=k: only the i-th of k contiguous parts of this rank's prompts, laid out as
        the whole batch would be (prompt width over all of them) and sampled row by row
        (SamplingParams.row_offset), so the k chunks' rollouts concatenated are the rollout one
        call makes with chunk=0, chunks=1 (streamed scoring, hfrt/flows/streaming.py)."""
        prompts = with_uids(merge(batch, extra))
        check_rows(len(prompts), "actor.generate")
        lo, hi = chunk_bounds(chunk, chunks, len(prompts))
        params = sampling_params(self.sampling, **sampling)
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + self._generation_dp_rank())
        if "prompt" not in prompts:
            raise KeyError(f"actor.generate needs a non-tensor column 'prompt'; the batch has {list(prompts.non_tensor)}")
        ids = encode_prompts(self.tokenizer, prompts["prompt"], params.max_prompt_tokens, "actor.generate")
        if self.layouts is not None and params.seed is None:
            # the ranks of one generation TP group must draw the same tokens: one seed for the
            # call (max over ranks), offset by the generation dp rank
            drawn = int(torch.randint(2**31, ()).item())
            width, top = all_reduce([max(len(i) for i in ids), drawn], "max")
            params = dataclasses.replace(params, seed=int(top) + self._generation_dp_rank())
        else:
            [width] = all_reduce([max(len(i) for i in ids)], "max")
        if chunk is not None:
            check_rows(hi - lo, "actor.generate (a chunk)")
            ids, prompts = ids[lo:hi], prompts[lo:hi]
        if params.row_offset is None:  # row-seeded, chunked or not (and as a rollout daemon samples)
            params = dataclasses.replace(params, row_offset=lo * params.n)
        out, metrics = self.hybrid.generate(ids, params)
        self._count(metrics)
        record = fixed_width(
            out, prompt_width=int(width), response_width=params.max_new_tokens,
            pad_id=self.tokenizer.pad_token_id, n=params.n,
        )
        routing.add_record(record, out, int(width), params.max_new_tokens)
        texts = decode_responses(self.tokenizer, record["responses"], record["response_mask"])
        meta = reduce_metrics(metrics, "max") | {"temperature": params.temperature, "n": params.n} | self.routing.meta()
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
        """This rank's phase (Phase's value: "train" | "generate"), how many transitions to each did work since
        the daemon started (to_generate pushes the weights), and the weight version."""
        return {"phase": self.hybrid.phase, **self.transitions, "weight_version": self.engine.steps}

    @endpoint(dispatch=Dispatch.REPLICATE)
    def weight_version(self) -> int:
        """The policy version this actor samples with: its optimizer steps so far (class docstring)."""
        return int(self.engine.steps)

    # -- agent turns: the AgentTurns hooks (roles/endpoint_groups/agent_turns.py) -----------------------

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
        if self.hybrid.phase is not Phase.GENERATE:
            raise RuntimeError(f"actor {self.context.identity}: a turn must be sampled in the generation phase (it is in {self.hybrid.phase!r})")
        start = time.perf_counter()
        out = self.generator.generate(contexts, params)
        return out, {"timing/generate_s": time.perf_counter() - start}

    def _turn_version(self) -> int:
        return int(self.engine.steps)

    # -- training-side endpoints: each first back in the training phase -------------------------

    @endpoint(dispatch=Dispatch.SPLIT)
    @in_training_phase
    def compute_log_prob(
        self, batch: Batch, *extra: Batch, temperature: float | None = None, sum_pi_squared: bool = False
    ) -> Batch:
        """Current-policy log-probs (`old_log_probs`) and `entropy` of the responses, 0 where masked;
        with sum_pi_squared also `sum_pi_squared`, Σ_v π_v² per token (the optimal token baselines')."""
        batch = merge(batch, extra)
        tensors = forward_inputs(batch, "actor.compute_log_prob", *self.routing.columns(batch.tensors))
        more = {"with_sum_pi_squared": True} if sum_pi_squared else {}
        out = forward_equal(
            self.engine, tensors, "actor.compute_log_prob", temperature=self._temperature(batch, temperature),
            with_entropy=True, **more,
        )
        assert out.log_probs is not None and out.entropy is not None
        mask = tensors["response_mask"].to(out.log_probs.dtype)
        columns = {"old_log_probs": out.log_probs * mask, "entropy": out.entropy * mask}
        if out.sum_pi_squared is not None:
            columns["sum_pi_squared"] = out.sum_pi_squared * mask
        return Batch(columns, meta=self.routing.metrics())

    # -- training ---------------------------------------------------------------------------

    @endpoint(dispatch=Dispatch.SPLIT, keywords=accepted_options("actor"))
    @in_training_phase
    def update(self, batch: Batch, *extra: Batch, **loss: Any) -> dict[str, float]:
        """PPO epochs × mini-batches of optimizer steps on `advantages`, `old_log_probs` (and
        `ref_log_prob` with use_kl_loss, `rollout_log_probs` with tis_cap, bypass_mode or rollout_is / rollout_rs). Options: ActorLoss and
        UpdateSchedule fields (hfrt.wire.loss_options). Returns metrics averaged over steps, the same on
        every rank. Without an `old_log_probs` column the update must be one optimizer step
        (on-policy: ppo_epochs 1, one mini-batch) and the old log-probs are the current ones,
        detached — what a compute_log_prob pass would have given, without its forward pass."""
        batch = merge(batch, extra)
        schedule, cfg = check_update_options("actor", loss)
        more = update_columns(cfg, set(batch.tensors), schedule, len(batch), "actor.update")
        more += [c for c in self.routing.columns(batch.tensors) if c not in more]
        tensors = forward_inputs(batch, "actor.update", *more)
        corrections = prepare_corrections(tensors, cfg)  # decoupled rollout correction (roles/training/actor_loss.py)
        return run_updates(
            self.engine, tensors, self.routing.with_gap(actor_loss(cfg, self.engine.steps)), schedule,
            prefix="actor", endpoint="actor.update", temperature=self._temperature(batch, cfg.temperature),
            with_entropy=cfg.entropy_coeff != 0,
        ) | corrections | self.routing.metrics()

    @endpoint(dispatch=Dispatch.SPLIT)
    @in_training_phase
    def compute_ref_log_prob(self, batch: Batch, *extra: Batch, temperature: float | None = None) -> Batch:
        """With LoRA (options.lora): the reference policy's log-probs (`ref_log_prob`), i.e. the
        base model's — this actor with its adapters off — as a reference daemon over the same
        model computes them, without a second copy of the weights; 0 where response_mask is 0."""
        if self.engine.lora is None:
            raise ValueError("actor.compute_ref_log_prob: this actor trains its full weights (no options.lora), so "
                             "they are not the reference's: configure a reference role")
        merged = merge(batch, extra)
        with adapters_disabled(self.engine.model):  # the base model, replaying the rollout's routing when configured
            ref = masked_log_probs(self.engine, merged, "actor.compute_ref_log_prob", temperature,
                                   *self.routing.columns(merged.tensors))
        self.routing.metrics()  # (collective) the update reports the policy's mismatch, not this pass's
        return Batch({"ref_log_prob": ref})

    # -- supervised and preference training on text rows (roles/training/text_objectives.py) ----

    @endpoint(dispatch=Dispatch.SPLIT)
    @in_training_phase
    def sft_update(self, batch: Batch, max_length: int | None = None, micro_batch_size: int | None = None,
                   truncation: str = "error") -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on the rows (`messages`, or `prompt` and
        `completion`, tokenised as TRL's SFTTrainer does): the token-mean NLL of the completion /
        assistant tokens of every rank's rows. Returns sft/loss, sft/token_accuracy, sft/tokens,
        sft/truncated_rows, sft/grad_norm, sft/lr, the same on every rank; a row over max_length
        tokens is cut to its first max_length with truncation "right", an error with "error"."""
        return self.text.sft_update(batch, max_length=max_length, micro_batch_size=micro_batch_size, truncation=truncation)

    @endpoint(dispatch=Dispatch.SPLIT)
    @in_training_phase
    def sft_evaluate(self, batch: Batch, max_length: int | None = None, truncation: str = "error") -> dict[str, float]:
        """The SFT rows scored without training: val/loss, val/token_accuracy, val/tokens, val/rows,
        val/truncated_rows (truncation as sft_update's)."""
        return self.text.sft_evaluate(batch, max_length=max_length, truncation=truncation)

    @endpoint(dispatch=Dispatch.SPLIT)
    @in_training_phase
    def dpo_update(
        self, batch: Batch, *extra: Batch, loss_type: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
        max_length: int | None = None, micro_batch_size: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step of a preference loss (PreferenceLoss: sigmoid / ipo / hinge / robust)
        on the pairs (`prompt`, `chosen`, `rejected`), with the reference's `ref_chosen_logps` /
        `ref_rejected_logps` in `extra`. Returns dpo/loss, TRL's rewards/* and logps/*, dpo/pairs,
        dpo/grad_norm, dpo/lr, the same on every rank."""
        cfg = check_preference_options({"loss_type": loss_type, "beta": beta, "label_smoothing": label_smoothing}, "actor.dpo_update")
        return self.text.dpo_update(merge(batch, extra), cfg, max_length=max_length, micro_batch_size=micro_batch_size)

    @endpoint(dispatch=Dispatch.SPLIT)
    @in_training_phase
    def dpo_evaluate(
        self, batch: Batch, *extra: Batch, loss_type: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
        max_length: int | None = None,
    ) -> dict[str, float]:
        """Held-out pairs scored without training: val/loss, val/rewards/*, val/logps/*, val/pairs."""
        cfg = check_preference_options({"loss_type": loss_type, "beta": beta, "label_smoothing": label_smoothing}, "actor.dpo_evaluate")
        return self.text.dpo_evaluate(merge(batch, extra), cfg, max_length=max_length)

    @endpoint(dispatch=Dispatch.SPLIT)
    @in_training_phase
    def compute_ref_pair_log_probs(self, batch: Batch, *extra: Batch, max_length: int | None = None) -> Batch:
        """With LoRA: what reference.compute_pair_log_probs gives (each pair's summed log-probs of
        its chosen and rejected completion), from this actor with its adapters off."""
        if self.engine.lora is None:
            raise ValueError("actor.compute_ref_pair_log_probs: this actor trains its full weights (no options.lora), so "
                             "they are not the reference's: configure a reference role")
        with adapters_disabled(self.engine.model):
            return pair_log_probs(self.engine, self.tokenizer, merge(batch, extra), "actor.compute_ref_pair_log_probs", max_length)

    @endpoint(dispatch=Dispatch.REPLICATE)
    @in_training_phase
    def export_hf(self, path: str) -> str:
        """Write the current policy as a Hugging Face model folder (the base model's config and
        tokenizer, the trained weights as model.safetensors) that transformers and vLLM load; with
        LoRA the weights merged (W + alpha/r·B·A) and the adapters alone as a PEFT adapter folder
        in `path`/adapter (peft.PeftModel.from_pretrained, vLLM's LoRARequest). Every rank takes
        part in gathering the weights; rank 0 writes."""
        keep = self.context.rank == 0
        weights: dict[str, torch.Tensor] = {}
        for bucket in self.engine.state_dict_for_generation():
            if keep:
                weights.update({name: t.detach().to("cpu", copy=True) for name, t in bucket.items()})
        base = resolve_model_dir(self.opts.model, self.opts.seed)
        adapters = self.engine.adapter_state_dict() if self.engine.lora is not None else None
        if keep:
            export_model_dir(base, weights, Path(path))
            if adapters is not None:
                write_adapter_folder(Path(path) / "adapter", adapters, self.engine.lora, str(base))
        return str(path)

    @endpoint(dispatch=Dispatch.REPLICATE)
    @in_training_phase
    def weight_sync_report(self) -> dict[str, Any]:
        """Push weights as before a rollout and compare the generation engine's copy with the
        gathered training weights (diagnostic; gathers the weights twice)."""
        self._to_generate()
        try:
            return compare_weights(self.hybrid.weights(), generation_parameters(self.generator))  # with LoRA: adapters
        finally:
            self._to_train()

    @endpoint(dispatch=Dispatch.REPLICATE)
    @in_training_phase
    def save(self, path: str) -> str:
        """Write a checkpoint folder (each rank its part; replaced atomically); returns its path."""
        return str(self.engine.save(path))

    @endpoint(dispatch=Dispatch.REPLICATE)
    @in_training_phase
    def load(self, path: str) -> dict[str, int]:
        self.engine.load(path)
        self.hybrid.forget_push()  # new weights, possibly at the step count last pushed
        return {"steps": self.engine.steps}

    @endpoint(dispatch=Dispatch.REPLICATE)
    @in_training_phase
    def publish_weights(self, version: int, bucket_mb: float = 64.0, corrupt_buckets: list[int] | None = None) -> dict[str, Any]:
        """Pack the current full weights into buckets of about `bucket_mb` MiB, kept in this
        daemon's tensor store (rank 0; every rank takes part in gathering), with a checksum each,
        for rollout daemons to load (roles/components/weight_sync.py). Returns {"version", "buckets":
        [{"index", "layout", "checksum", "nbytes", "data"}], "timing/publish_s"}; `data` leaves as a
        TensorHandle. `corrupt_buckets` flips one byte of those buckets after their checksum is
        taken (fault injection for tests: the receiver must name them)."""
        return publish(self.engine, self.context.rank, version, bucket_mb, corrupt_buckets)

    # -- advantages: rank 0 over the whole batch; no engine, so no phase change ----------------

    @endpoint(dispatch=Dispatch.RANK0, keywords=ADVANTAGE_OPTIONS)
    def compute_advantages(self, batch: Batch, *extra: Batch, estimator: str = "gae", **params: Any) -> Batch:
        """`advantages`, `returns` and `token_level_rewards` of the whole batch by `estimator`
        (Advantages.compute; options: AdvantageParams)."""
        return self.advantages.compute(batch, *extra, estimator=estimator, **params)

    @endpoint(dispatch=Dispatch.RANK0)
    def advantage_state(self) -> dict[str, Any]:
        """The in-reward KL controller's state (for run checkpoints): {} before its first use."""
        return self.advantages.state()

    @endpoint(dispatch=Dispatch.RANK0)
    def load_advantage_state(self, state: dict[str, Any]) -> None:
        """Restore what advantage_state returned."""
        self.advantages.load_state(state)
