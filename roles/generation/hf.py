"""Generation engines for the actor: the sampling contract and a built-in engine on transformers.

A generation engine turns prompt token ids into sampled responses with the sampler's per-token
log-probs, accepts weights pushed one bucket at a time, and can release its memory between
rollouts (sleep / wake). It knows nothing of training engines, sharding or RL losses; the
hybrid engine (hybrid.py) connects the two. The vLLM engine lives in vllm_engine.py.

Output layout (verl's), N = len(prompts) × n rows, samples of one prompt contiguous:
  prompts [N, P] (left-padded), responses [N, R] (right-padded with pad id),
  response_mask [N, R], log_probs [N, R] (0 where masked), input_ids / attention_mask /
  position_ids [N, P + R] ready for the training engine, prompt_index [N].
Log-probs are of log_softmax(logits / temperature) at the sampled token, before top-k/top-p
truncation, which is what TrainEngine.forward_logprobs(temperature=...) recomputes. Logits shaped
by logit_bias, penalties or a constraint (roles/generation/logits.py) are shaped first: the
log-probs are then those of the shaped distribution, the one actually sampled from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hfrt.roles.generation.grammar import Grammars
from hfrt.roles.generation.logits import Constraint, Shaper
from hfrt.roles.generation.stops import TextStops
from hfrt.roles.training.engines.base import default_device
from hfrt.wire.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingParams:
    """How to sample (a generating role's `sampling` option, and a generate call's keywords; the
    `#:` comment above a field is its description)."""

    #: sampling temperature; 0 means greedy
    temperature: float = 1.0
    #: nucleus sampling's probability mass; 1 disables
    top_p: float = 1.0
    #: sample among the k most likely tokens; 0 or less disables
    top_k: int = 0
    #: new tokens per response at most
    max_new_tokens: int = 32
    #: samples per prompt
    n: int = 1
    #: generation of a row ends after any of these (the engine adds the tokenizer's eos unless ignore_eos)
    stop_token_ids: tuple[int, ...] = ()
    #: keep sampling past the tokenizer's eos
    ignore_eos: bool = False
    #: the sampling seed; null draws a fresh seed
    seed: int | None = None
    #: null samples the call's rows from one generator (seed); an int gives each row its own
    #: generator, seeded from (seed, row_offset + its row), so a row's tokens do not depend on which
    #: other rows share the call (a rollout generated in chunks samples what one call would; vLLM
    #: seeds every request on its own anyway and ignores it)
    row_offset: int | None = None
    #: null, or the longest prompt (in tokens) a generate call accepts: a longer one is refused,
    #: naming its row, before anything is sampled (verl's data.max_prompt_length with truncation
    #: "error"); before launch, every role's token budget must hold it (hfrt.roles.check)
    max_prompt_tokens: int | None = None
    #: text that ends a response once its decoded text holds it (any length); the sampled ids keep
    #: every token up to the one that completed it
    stop_strings: tuple[str, ...] = ()
    #: keep the stop string at the end of the returned text (it is cut off by default)
    include_stop_str_in_output: bool = False
    #: subtracted from a token's logit once it was sampled in this response (OpenAI's presence_penalty)
    presence_penalty: float = 0.0
    #: subtracted from a token's logit for each time it was sampled in this response (OpenAI's frequency_penalty)
    frequency_penalty: float = 0.0
    #: null, or a table {token id: value} added to those tokens' logits before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    #: null, or a JSON schema every response follows by constrained decoding ({"type": "object"}: any JSON
    #: object): llguidance on the HF engine, vLLM's structured outputs on vLLM
    json_schema: dict[str, Any] | None = None


class GenerationEngine(Protocol):
    """What the hybrid engine drives."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> dict[str, torch.Tensor]: ...

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy parameters in (HF names, full shapes). The hybrid engine passes one stream per
        push that gathers a block at a time; a tensor may be invalid once the next is drawn."""

    def wake(self) -> None:
        """Allocate what generation needs (weights storage, caches) before load_weights."""

    def sleep(self) -> None:
        """Release generation memory; weights must be pushed again after wake."""


# --------------------------------------------------------------------------------- sampling


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf (the most likely token always survives)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def row_generators(seed: int, first_row: int, rows: int) -> list[torch.Generator]:
    """One generator per row, seeded from (seed, the row's index): the row's draws do not depend
    on the rows beside it."""
    return [torch.Generator().manual_seed((seed * 1_000_003 + first_row + i) % 2**63) for i in range(rows)]


def top_log_probs(logits: torch.Tensor, k: int, temperature: float) -> list[list[tuple[int, float]]]:
    """For each row of `logits` [positions, vocab], the k most likely tokens and their log-probs (of
    log_softmax(logits / temperature), as a sampled token's log-prob is); tokens a constraint made
    impossible (-inf) are left out, so a row may hold fewer than k."""
    logits = logits.float()
    lp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
    values, index = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return [[(t, v) for t, v in zip(i.tolist(), v.tolist(), strict=True) if v != float("-inf")] for i, v in zip(index, values, strict=True)]


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], log-prob [B]) from last-position logits [B, V]; a list of generators samples
    row i with generator i."""
    logits = logits.float()
    if params.temperature <= 0:
        tokens = logits.argmax(dim=-1)
        log_probs = torch.log_softmax(logits, dim=-1)
    else:
        log_probs = torch.log_softmax(logits / params.temperature, dim=-1)
        if params.top_k > 0 or params.top_p < 1.0:
            probs = torch.softmax(filter_logits(log_probs, params.top_k, params.top_p), dim=-1)
        else:  # no truncation: the distribution is the one whose log-probs we report
            probs = log_probs.exp()
        if isinstance(generator, list):
            cpu = probs.cpu()
            picked = [torch.multinomial(cpu[i], 1, generator=g) for i, g in enumerate(generator)]
            tokens = torch.cat(picked).to(logits.device)
        else:
            tokens = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"prompt {i} is empty")
        ids[i, width - len(row) :] = torch.as_tensor(list(row), dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


def assemble(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    n: int,
) -> dict[str, torch.Tensor]:
    """The output record of module docstring from its parts (all [N, ...] on CPU)."""
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "log_probs": log_probs * response_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "prompt_index": torch.arange(prompt_ids.shape[0]) // n,
    }


# ---------------------------------------------------------------------------- built-in engine


class HFGenerationEngine:
    """Sampling with a KV cache on a plain transformers causal LM.

    `model` is either the training module itself (share_weights=True: nothing to push, sleep
    frees nothing) or a private copy, moved to `device` (default: this rank's CUDA device, else
    the CPU), whose parameters are pushed per bucket and freed by sleep.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_token_id: int,
        eos_token_id: int | None,
        share_weights: bool = False,
        device: torch.device | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        if not share_weights:  # a private copy lives where training does (the CUDA device if any)
            model.to(device or default_device())
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.share_weights = share_weights
        self.decode = decode  # the tokenizer's decode (skipping special tokens): stop strings need it
        self.grammars = grammars  # JSON constraints for the tokenizer: json_schema needs them
        # a tensor-parallel model's parameters are DTensors: push, adopt and free their local
        # pieces (the very tensors the DTensors compute with)
        self._params = {name: _local_piece(p) for name, p in model.named_parameters()}
        self._shapes = {name: (p.shape, p.dtype) for name, p in self._params.items()}
        self.awake = True

    #: a routing_record.Recorder when rollouts record their MoE routing (option router_replay)
    recorder: Any = None

    # ---- weights
    def local_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters by name; a tensor-parallel model's as this rank's local pieces."""
        return dict(self._params)

    @property
    def keeps_weights_asleep(self) -> bool:
        """A shared module is the training module; a private copy is freed by sleep."""
        return self.share_weights

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.share_weights:
            return
        for name, tensor in named:
            target = self._params.get(name)
            if target is None:
                raise KeyError(f"generation model has no parameter {name!r}")
            with torch.no_grad():
                target.copy_(tensor)

    def adopt_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Make the tensors the parameters' storage, without copying (instead of wake +
        load_weights): a generation model at the training layout then *is* the training pieces.
        A tensor of another dtype or device is converted (that one is a copy). Every parameter
        must come; the engine is awake afterwards and sleep drops the references. Returns the
        bytes that had to be converted."""
        if self.share_weights:
            raise ValueError("adopt_weights: this engine shares the training module; there is nothing to adopt")
        converted, seen = 0, set()
        for name, tensor in named:
            target = self._params.get(name)
            if target is None:
                raise KeyError(f"generation model has no parameter {name!r}")
            shape, dtype = self._shapes[name]
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"adopt_weights: {name} is {tuple(tensor.shape)}, the generation model wants {tuple(shape)}")
            if tensor.dtype != dtype or tensor.device != target.device:
                tensor = tensor.to(dtype=dtype, device=target.device)
                converted += tensor.numel() * tensor.element_size()
            target.data = tensor.detach()
            seen.add(name)
        missing = [n for n in self._params if n not in seen]
        if missing:
            raise KeyError(f"adopt_weights: no tensor came for {missing[:5]} ({len(missing)} parameters)")
        self.awake = True
        return converted

    def sleep(self) -> None:
        """Free parameter storage of a private copy (shapes are remembered for wake)."""
        if self.share_weights or not self.awake:
            return
        for p in self._params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.awake = False

    def wake(self) -> None:
        if self.share_weights or self.awake:
            return
        for name, p in self._params.items():
            shape, dtype = self._shapes[name]
            p.data = torch.empty(shape, dtype=dtype, device=p.device)
        self.awake = True

    # ---- sampling
    def _stop_ids(self, params: SamplingParams) -> torch.Tensor:
        stops = set(params.stop_token_ids)
        if not params.ignore_eos and self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        return torch.tensor(sorted(stops), dtype=torch.long)

    def text_stops(self, params: SamplingParams) -> TextStops | None:
        """The early stop on params.stop_strings (ValueError when the engine was built without a decode)."""
        if not params.stop_strings:
            return None
        if self.decode is None:
            raise ValueError("stop_strings: this generation engine was built without its tokenizer's decode")
        return TextStops(self.decode, params.stop_strings)

    def constraints_for(self, params: SamplingParams, rows: int) -> list[Constraint | None] | None:
        """A fresh constraint per row when params.json_schema asks for one (InvalidArgument when the
        engine was built without its tokenizer's grammars, or the schema cannot be followed)."""
        if params.json_schema is None:
            return None
        if self.grammars is None:
            raise InvalidArgument("json_schema", "json_schema: this generation engine was built without its tokenizer's grammars")
        return [self.grammars.constraint(params.json_schema) for _ in range(rows)]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> dict[str, torch.Tensor]:
        """Sample params.n responses per prompt (each following params.json_schema when given)."""
        if not self.awake:
            raise RuntimeError("generation engine is asleep: wake() and push weights first")
        if params.n < 1 or params.max_new_tokens < 1:
            raise ValueError("n and max_new_tokens must be at least 1")
        was_training = self.model.training
        self.model.eval()
        try:
            rows = [list(p) for p in prompts for _ in range(params.n)]
            if self.recorder is None:
                return self._sample(rows, params, self.constraints_for(params, len(rows)))
            with self.recorder.recording():
                out = self._sample(rows, params, self.constraints_for(params, len(rows)))
            return out | {"routed_experts": self.recorder.routed(len(rows), out["attention_mask"])}
        finally:
            self.model.train(was_training)

    def _sample(self, rows: list[list[int]], params: SamplingParams,
                constraints: Sequence[Constraint | None] | None = None) -> dict[str, torch.Tensor]:
        device = next(iter(self._params.values())).device
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        generator: torch.Generator | list[torch.Generator] = (
            torch.Generator().manual_seed(seed) if params.row_offset is None else row_generators(seed, params.row_offset, len(rows))
        )
        ids, mask = left_pad(rows, self.pad_token_id)
        stops = self._stop_ids(params).to(device)
        texts = self.text_stops(params)
        shaper = shaper_for(params, len(rows), constraints)
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # the prompt's last position is the only one whose logits sampling reads
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        tokens, logps, alive = [], [], []
        finished = torch.zeros(len(rows), dtype=torch.bool, device=device)
        attn = mask
        for step in range(params.max_new_tokens):
            logits = out.logits[:, -1]
            token, logp = sample_next(shaper.shape(logits) if shaper is not None else logits, params, generator)
            token = token.masked_fill(finished, self.pad_token_id)
            tokens.append(token)
            logps.append(logp)
            alive.append(~finished)
            if shaper is not None:
                shaper.observe(token, ~finished, logits.shape[-1])
            finished = finished | torch.isin(token, stops) | self._ended(texts, shaper, tokens, finished)
            if bool(finished.all()) or step + 1 == params.max_new_tokens:
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attn,
                position_ids=positions[:, -1:] + step + 1,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        response_mask = torch.stack(alive, dim=1).long().cpu()
        return assemble(
            ids.cpu(),
            mask.cpu(),
            torch.stack(tokens, dim=1).cpu(),
            response_mask,
            torch.stack(logps, dim=1).float().cpu(),
            params.n,
        )


    @staticmethod
    def _ended(texts: TextStops | None, shaper: Shaper | None, tokens: list[torch.Tensor], finished: torch.Tensor) -> torch.Tensor:
        """[rows] rows that end after this step besides on a stop token: a stop string now ends their
        text, or their constraint is complete."""
        ended = torch.zeros_like(finished)
        if texts is not None:
            columns = torch.stack(tokens, dim=1).tolist()
            live = (~finished).tolist()
            ended = torch.tensor([live[i] and texts.hit(row) for i, row in enumerate(columns)], device=finished.device)
        done = shaper.finished() if shaper is not None else None
        return ended | done.to(finished.device) if done is not None else ended


def shaper_for(params: SamplingParams, rows: int, constraints: Sequence[Constraint | None] | None = None) -> Shaper | None:
    """The logits shaping `params` (and `constraints`) ask for, None when nothing applies."""
    if not Shaper.needed(params.presence_penalty, params.frequency_penalty, params.logit_bias, constraints):
        return None
    return Shaper(rows, presence=params.presence_penalty, frequency=params.frequency_penalty, bias=params.logit_bias,
                  constraints=constraints)


def _local_piece(param: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local tensor, else the parameter. The very object the DTensor computes
    with (`to_local()` returns a fresh alias, whose .data cannot re-point the DTensor), so
    load_weights / adopt_weights / sleep / wake act on the DTensor's storage."""
    from torch.distributed.tensor import DTensor

    return param._local_tensor if isinstance(param, DTensor) else param
