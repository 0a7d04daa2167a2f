"""The rollout role daemon: generation only (built-in HF engine or vLLM), on its own devices beside
the training actor, holding a numbered version of the policy's weights pushed by weight sync.

Options: `model`, `dtype`, `seed`, `threads`, `dist_master` (as every role), `generator` ("hf" |
"vllm"), `sampling` (SamplingParams defaults), `vllm` (VLLMConfig fields but model_dir), `lora` (the
actor's LoRA table: the engine keeps the base weights and syncs receive adapters only). Until the
first sync it holds the `model` option's weights as version -1. Every sample it returns carries
the version it was generated with (non-tensor column `weight_version`, meta `weight_version`).
It knows generation and weight sync; nothing of training, losses or the algorithm.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.batch import Batch
from hfrt.roles.common import (
    SAMPLING_OPTIONS,
    ModelOptions,
    check_generation_options,
    check_options,
    close_group,
    model_config,
    prepare_process,
    role_errors,
    sampling_params,
)
from hfrt.roles.components import routing
from hfrt.roles.components.weight_sync import WeightSyncError, apply_sync
from hfrt.roles.endpoint_groups.agent_turns import AgentTurns
from hfrt.roles.endpoint_groups.partial_rollout import NO_VERSION, PartialRollouts, PartialRows
from hfrt.roles.generation.batches import (
    decode_responses,
    encode_prompts,
    fixed_width,
    length_stats,
    rollout_batch,
    with_uids,
)
from hfrt.roles.generation.build import generation_engine
from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
from hfrt.roles.generation.hf_stream import stream_tokens
from hfrt.roles.generation.lora import AdapterHFGeneration, adapter_spec, check_record
from hfrt.roles.models import check_model_source, load_tokenizer
from hfrt.roles.rows import all_reduce, check_rows, merge
from hfrt.wire.endpoints import Dispatch, endpoint

#: version a rollout daemon reports before its first sync (the `model` option's own weights)
INITIAL_VERSION = -1


class RolloutDaemon(PartialRollouts, AgentTurns, Daemon):
    """Endpoints: generate (SPLIT); load_weights, weight_version (REPLICATE); generate_partial
    (SPLIT, roles/endpoint_groups/partial_rollout.py: a rollout in segments that a weight sync can interrupt);
    generate_turn and assemble_trajectories (SPLIT, roles/endpoint_groups/agent_turns.py: multi-turn agent rollouts)."""

    OPTIONS = frozenset({"generator", "sampling", "vllm", "lora", routing.OPTION})
    #: whether setup joined the role's process group (teardown leaves it); False until it does
    _joined: bool = False

    @classmethod
    def check_config(cls, context: DaemonContext) -> None:
        check_options(context, cls.OPTIONS)
        check_generation_options(context.options)
        if context.options.get("engine"):
            raise ValueError("the rollout role does not train: option engine is not read (remove it)")
        check_model_source(str(context.options.get("model", "tiny")), int(context.options.get("seed", 0)))
        adapter_spec(context)
        where = f"roles.{context.role}.options"
        if (value := routing.read_option(context.options, where)) is not None:
            opts = ModelOptions.read({k: context.options[k] for k in ("model", "seed") if k in context.options}, trainable=False)
            routing.check_before_launch(value, model_config(opts), 1, where)

    async def setup(self) -> None:
        with role_errors(self.context):
            ctx = self.context
            self.check_config(ctx)
            self.model = str(ctx.options.get("model", "tiny"))
            self.dtype = str(ctx.options.get("dtype", "float32"))
            self.seed = int(ctx.options.get("seed", 0))
            self._joined = prepare_process(ctx, needs_group=ctx.world_size > 1)
            self.tokenizer = load_tokenizer(self.model, self.seed)
            self.sampling = sampling_params(ctx.options.get("sampling"))
            self.engine = generation_engine(
                str(ctx.options.get("generator", "hf")), model=self.model, dtype=self.dtype, seed=self.seed,
                tokenizer=self.tokenizer, vllm=ctx.options.get("vllm"), lora=adapter_spec(ctx),
            )
            self.routing = routing.Routing(routing.read_option(ctx.options, f"roles.{ctx.role}.options"),
                                           train_model=None, generator=self.engine, where=ctx.role)
            self.version = INITIAL_VERSION
            self.broken: str | None = None  # why the weights are not usable (a failed sync)
            self.partials: dict[str, PartialRows] = {}  # generate_partial's rollouts in progress (PartialRollouts)

    async def teardown(self) -> None:
        close_group(self._joined)

    # -- weights --------------------------------------------------------------------------

    @endpoint(dispatch=Dispatch.REPLICATE, raw_handles=True)
    def load_weights(self, sync: dict[str, Any]) -> dict[str, Any]:
        """Load a version published by `publish_weights` (roles/components/weight_sync.py): buckets pulled
        daemon-to-daemon one at a time, each checksum checked on arrival and on what the engine
        then holds. A failed sync leaves this daemon refusing to generate until the next good one."""
        where = f"rollout daemon {self.context.identity}"
        check_record(sync.get("adapter"), getattr(self.engine, "spec", None), where)
        peers = self.tensor_plane().peers
        self.broken = f"the sync to version {sync.get('version')!r} did not finish"
        try:
            result = apply_sync(sync, lambda h: peers.pull([h])[0], self.engine.load_weights, self._held, where)
        except WeightSyncError as exc:
            self.broken = str(exc)
            raise
        self.version, self.broken = int(result["version"]), None
        return result

    def _held(self, layout: list[list[Any]]) -> torch.Tensor | None:
        """What the HF engine now holds for `layout`, packed as the publisher packed it."""
        if isinstance(self.engine, AdapterHFGeneration):
            return self.engine.held(layout)
        if not isinstance(self.engine, HFGenerationEngine):
            return None  # vLLM fuses and renames parameters: only the received bytes are checked
        params = self.engine._params
        return torch.cat([params[row[0]].detach().reshape(-1).view(torch.uint8).cpu() for row in layout])

    @endpoint(dispatch=Dispatch.REPLICATE)
    def weight_version(self) -> int:
        """The policy version this daemon generates with (-1 before the first sync)."""
        return self.version

    # -- agent turns: the AgentTurns hooks (roles/endpoint_groups/agent_turns.py) ----------------------

    def _turn_prepare(self, params: SamplingParams) -> tuple[SamplingParams, dict[str, float]]:
        if self.broken is not None:
            raise RuntimeError(f"rollout daemon {self.context.identity} holds no valid weights: {self.broken}")
        return params, {}

    def _turn_generate(self, contexts: list[list[int]], params: SamplingParams) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        start = time.perf_counter()
        out = self.engine.generate(contexts, params)
        return out, {"timing/generate_s": time.perf_counter() - start}

    def _turn_version(self) -> int:
        return self.version

    def _turn_stream(self, context: list[int], params: SamplingParams, top_k: int) -> Iterator[tuple[int, float, list[tuple[int, float]]]]:
        """Token by token on the HF engine's KV cache (roles/generation/hf_stream.py); vLLM's
        offline engine has no per-token stream here, so it refuses (callers sample in chunks)."""
        if not isinstance(self.engine, HFGenerationEngine):
            raise NotImplementedError(f"rollout daemon {self.context.identity}: token streaming needs the HF engine "
                                      f"(this one runs {type(self.engine).__name__}); sample in chunks of generate_turn calls")
        return stream_tokens(self.engine, context, params, top_k)

    # -- generation -----------------------------------------------------------------------

    @endpoint(dispatch=Dispatch.SPLIT, keywords=SAMPLING_OPTIONS)
    def generate(self, batch: Batch, *extra: Batch, **sampling: Any) -> Batch:
        """Sample responses for the `prompt` column, as the actor's `generate` does
        (roles/generation/batches.py layout), plus `weight_version` (and `weight_version_max`, the
        same here) per row and in meta, tensor `token_versions` [N, R] (this version on every
        response token, -1 on padding), and meta timing/generate_s."""
        if self.broken is not None:
            raise WeightSyncError(f"rollout daemon {self.context.identity} holds no valid weights: {self.broken}")
        prompts = with_uids(merge(batch, extra))
        check_rows(len(prompts), "rollout.generate")
        if "prompt" not in prompts:
            raise KeyError(f"rollout.generate needs a non-tensor column 'prompt'; the batch has {list(prompts.non_tensor)}")
        params = sampling_params(self.sampling, **sampling)
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + self.context.dp_rank)
        if params.row_offset is None:  # row-seeded as the actor's generate (chunked or not): same seed, same tokens
            params = dataclasses.replace(params, row_offset=0)
        ids = encode_prompts(self.tokenizer, prompts["prompt"], params.max_prompt_tokens, "rollout.generate")
        [width] = all_reduce([max(len(i) for i in ids)], "max")
        start = time.perf_counter()
        out = self.engine.generate(ids, params)
        elapsed = time.perf_counter() - start
        record = fixed_width(out, prompt_width=int(width), response_width=params.max_new_tokens,
                             pad_id=self.tokenizer.pad_token_id, n=params.n)
        routing.add_record(record, out, int(width), params.max_new_tokens)
        texts = decode_responses(self.tokenizer, record["responses"], record["response_mask"])
        [elapsed] = all_reduce([elapsed], "max")
        meta = {"temperature": params.temperature, "n": params.n, "timing/generate_s": elapsed,
                "weight_version": self.version} | length_stats(record["response_mask"], params.max_new_tokens) | self.routing.meta()
        record["token_versions"] = torch.where(record["response_mask"].bool(), self.version, NO_VERSION)
        out_batch = rollout_batch(record, texts, prompts, params.n, meta)
        out_batch["weight_version"] = [self.version] * len(out_batch)
        out_batch["weight_version_max"] = [self.version] * len(out_batch)
        return out_batch
