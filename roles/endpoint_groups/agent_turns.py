"""Daemon-side endpoints of multi-turn agent rollouts — an endpoint group (`AgentTurns`) mixed into
the daemon class of any role that generates (the rollout role, and the actor on its hybrid
engine): one sampled turn for many conversations at once (token ids in, sampled token ids and their
log-probs out), and the assembly of finished trajectories into the rollout Batch layout
(roles/generation/batches.py) the actor trains on.

Token-in/token-out: a conversation travels as the token ids it holds so far; text is tokenised
here only for what is appended (a prompt, a tool's output), never for what the policy sampled.
It knows the tokenizer and three hooks the daemon implements (TurnHooks); nothing of which engine
samples, of weight versions' meaning, of tools, rewards or the agent loop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hfrt.daemon.batch import Batch
from hfrt.roles.common import SAMPLING_OPTIONS, sampling_params
from hfrt.roles.endpoint_groups.turn_limits import check_request_length, check_text_size, max_token_bytes
from hfrt.roles.generation.batches import encode_prompt
from hfrt.roles.generation.build import text_decoder
from hfrt.roles.generation.hf import SamplingParams, shaper_for, top_log_probs
from hfrt.roles.generation.logits import Constraint
from hfrt.roles.generation.stops import Cut, cut_at_stop
from hfrt.roles.generation.templates import TOOL_TEMPLATES, template_sees_tools
from hfrt.roles.rows import all_reduce, check_rows, merge
from hfrt.wire.endpoints import Dispatch, endpoint
from hfrt.wire.errors import ContextTooLong, InvalidArgument

#: non-tensor columns generate_turn reads (one row per conversation)
TURN_INPUT = ("context", "append")
#: non-tensor columns assemble_trajectories reads (one row per trajectory)
TRAJECTORY_INPUT = ("prompt_ids", "response_ids", "response_gen_mask", "response_log_probs")
#: the keyword options a turn call takes (read by _turn_options): the sampling options plus these
TURN_OPTIONS = (*SAMPLING_OPTIONS, "pieces", "top_logprobs", "text_prefix", "fit_context", "request_max_tokens")


@dataclass(frozen=True)
class TurnOptions:
    """A turn call's keywords read once (AgentTurns._turn_options): the sampling parameters, and
    `pieces` (each token's text wanted), `max_prompt` (max_prompt_tokens), `top_k` (top_logprobs),
    `text_prefix` (turn_text also decodes the context's last k ids: a turn sampled in chunks), `fit`
    (no max_tokens given: sample until the context is full) and `request_max` (the whole request's
    max_tokens when this call samples its first chunk only: the context check uses it)."""

    params: SamplingParams
    pieces: bool = False
    max_prompt: int | None = None
    top_k: int = 0
    text_prefix: int = 0
    fit: bool = False
    request_max: int | None = None


def special_stop_ids(tokenizer: Any, stops: Sequence[str]) -> tuple[int, ...]:
    """Ids of stop strings that are one special token each (`<|im_end|>`): decoded text skips
    special tokens, so those end a turn by id; every stop string also ends it by text (stops.py)."""
    special, out = set(getattr(tokenizer, "all_special_ids", None) or ()), []
    for text in stops:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) == 1 and int(ids[0]) in special:
            out.append(int(ids[0]))
    return tuple(out)


def render_chat(tokenizer: Any, item: Mapping[str, Any]) -> list[int]:
    """Ids of a chat item {"messages", "tools"?, "after"?, "template"?} through the tokenizer's chat
    template, or the built-in one `template` names (roles/generation/templates.py; tools passed as
    `tools=`). With `after` = k the conversation's first k messages are already held as ids (the
    session's exact tokens): only the text the template renders past them (tool results, a user
    turn, the generation prompt) is tokenised."""
    messages, tools, after = list(item["messages"]), item.get("tools") or None, item.get("after")
    if not messages:
        raise InvalidArgument("prompt", "a chat item has no messages")
    kw: dict[str, Any] = {"tools": tools}
    if item.get("template") is not None:
        if item["template"] not in TOOL_TEMPLATES:
            raise InvalidArgument("template", f"unknown tool template {item['template']!r}: choose one of {sorted(TOOL_TEMPLATES)}")
        kw["chat_template"] = TOOL_TEMPLATES[item["template"]]
    if after is None:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kw)
        return [int(t) for t in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    held = tokenizer.apply_chat_template(messages[:after], add_generation_prompt=False, tokenize=False, **kw)
    if not full.startswith(held):
        at = next((i for i, (a, b) in enumerate(zip(full, held, strict=False)) if a != b), min(len(full), len(held)))
        raise InvalidArgument("prompt", f"the chat template renders the first {after} messages differently once more follow (from character {at}: "
                         f"{held[at:at + 40]!r} vs {full[at:at + 40]!r}), so the session cannot continue its exact tokens")
    return [int(t) for t in tokenizer(full[len(held):], add_special_tokens=False)["input_ids"]]


def extend_context(tokenizer: Any, context: Sequence[int], append: Sequence[Any]) -> tuple[list[int], list[list[int]]]:
    """A conversation's ids with `append` tokenised after them (the first item of an empty
    conversation is its prompt: a string, a chat or ids, as `generate` reads prompts; a chat item
    {"messages", "tools", "after"} may come anywhere, see render_chat). Token ids past the
    tokenizer's vocabulary are refused."""
    ids, pieces = [int(t) for t in context], []
    for index, item in enumerate(append):
        if isinstance(item, Mapping):
            piece = render_chat(tokenizer, item)
        elif not ids and index == 0:
            piece = encode_prompt(tokenizer, item)
        elif isinstance(item, str):
            piece = list(tokenizer(item, add_special_tokens=False)["input_ids"])
        else:
            raise InvalidArgument("prompt", f"appended item {index} must be text, not {item!r:.80}")
        pieces.append([int(t) for t in piece])
        ids += piece
    if not ids:
        raise InvalidArgument("prompt", "a conversation has no tokens to continue from (empty context and nothing appended)")
    vocab = len(tokenizer)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidArgument("prompt", f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
    return ids, pieces


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's share of the decoded text (a token that ends inside a multi-byte character
    gets "" and the character goes with the token that completes it): what streaming sends."""
    pieces, shown = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(list(ids[: i + 1]), skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(shown):
            pieces.append("")
            continue
        pieces.append(text[len(shown):])
        shown = text
    return pieces


def top_alternatives(role: Any, contexts: list[list[int]], turn_ids: list[list[int]], k: int,
                     params: SamplingParams) -> list[list[list[tuple[int, float]]]]:
    """For each sampled token, the k most likely tokens at its position and their log-probs (of
    log_softmax(logits / temperature) after the logits shaping the turn sampled with — bias,
    penalties, a fresh copy of its constraint replayed — as the sampled log-probs are), by one
    forward pass of the role's HF generation model per row. ValueError when the engine exposes no
    such model."""
    model = getattr(getattr(role, "engine", None), "model", None)
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgument("top_logprobs", "top_logprobs: top log-probs need the HF generation engine (this one returns only the sampled token's)")
    device = next(model.parameters()).device
    fresh = getattr(role.engine, "constraints_for", None)  # the HF engine's (an engine without one masks nothing)
    constraints: list[Constraint | None] | None = fresh(params, len(contexts)) if fresh is not None else None
    out: list[list[list[tuple[int, float]]]] = []
    with torch.no_grad():
        for row, (context, ids) in enumerate(zip(contexts, turn_ids, strict=True)):
            if not ids:
                out.append([])
                continue
            seq = torch.tensor([list(context) + list(ids[:-1])], device=device)
            logits = model(input_ids=seq).logits[0, len(context) - 1:].float()
            shaper = shaper_for(params, 1, [constraints[row]] if constraints is not None else None)
            if shaper is not None:  # replayed position by position, as the sampler saw them
                shaped = []
                for i, token in enumerate(ids):
                    shaped.append(shaper.shape(logits[i:i + 1])[0])
                    shaper.observe(torch.tensor([token], device=device), torch.ones(1, dtype=torch.bool, device=device), logits.shape[-1])
                logits = torch.stack(shaped)
            out.append(top_log_probs(logits, k, params.temperature))
    return out


def context_limit(role: Any) -> int | None:
    """The most prompt + response tokens the role's generation engine takes (vLLM's max_model_len,
    an HF model's max_position_embeddings), None when unknown."""
    engine = getattr(role, "engine", None)
    limit = getattr(getattr(engine, "config", None), "max_model_len", None)
    if limit is None:
        limit = getattr(getattr(getattr(engine, "model", None), "config", None), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def pad_rows(rows: Sequence[Sequence[float]], width: int, value: float, *, left: bool, dtype: torch.dtype) -> torch.Tensor:
    """[len(rows), width] of `value` with each row's values at the left or right end."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"row {i} has {len(row)} tokens, more than the width {width}")
        if row:
            start = width - len(row) if left else 0
            out[i, start:start + len(row)] = torch.as_tensor(list(row), dtype=dtype)
    return out


def trajectory_record(columns: dict[str, list[Any]], prompt_width: int, response_width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The rollout tensor columns of trajectories: response_mask is 1 only on sampled tokens, while
    attention covers every real token (tool outputs included)."""
    prompts, responses = columns["prompt_ids"], columns["response_ids"]
    gen, logps = columns["response_gen_mask"], columns["response_log_probs"]
    for i, (r, g, lp) in enumerate(zip(responses, gen, logps, strict=True)):
        if not (len(r) == len(g) == len(lp)):
            raise ValueError(f"trajectory {i}: response_ids, response_gen_mask, response_log_probs differ in length ({len(r)}, {len(g)}, {len(lp)})")
    prompt_ids = pad_rows(prompts, prompt_width, pad_id, left=True, dtype=torch.long)
    prompt_mask = pad_rows([[1] * len(p) for p in prompts], prompt_width, 0, left=True, dtype=torch.long)
    response_ids = pad_rows(responses, response_width, pad_id, left=False, dtype=torch.long)
    real = pad_rows([[1] * len(r) for r in responses], response_width, 0, left=False, dtype=torch.long)
    response_mask = pad_rows(gen, response_width, 0, left=False, dtype=torch.long)
    log_probs = pad_rows(logps, response_width, 0.0, left=False, dtype=torch.float32) * response_mask
    attention = torch.cat([prompt_mask, real], dim=1)
    return {
        "prompts": prompt_ids, "responses": response_ids, "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1), "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "rollout_log_probs": log_probs,
    }


class AgentTurns:
    """Endpoints generate_turn (SPLIT_GENERATION: rows by generation data-parallel group where the
    daemon declares one, else by dp rank) and assemble_trajectories (SPLIT), for a daemon with
    `tokenizer` and `sampling` (SamplingParams defaults) that implements the hooks:

    - `_turn_prepare(params) -> (params, meta)`: make the engine ready to sample and settle the
      call's sampling parameters (e.g. a seed the ranks of one generation group agree on); raise
      if it cannot sample. Called on every rank for every call, with rows or none, before any row
      is read, so it may be collective.
    - `_turn_generate(contexts, params) -> (out, meta)`: sample one response per context (token
      id lists); `out` as GenerationEngine.generate returns it (`responses`, `response_mask`,
      `log_probs`), `meta` timings. Called only with rows.
    - `_turn_version() -> int`: the weight version the turn was sampled with.
    """

    tokenizer: Any
    sampling: Any

    def _turn_prepare(self, params: SamplingParams) -> tuple[SamplingParams, dict[str, float]]:
        raise NotImplementedError(f"{type(self).__name__} mixes in AgentTurns but does not implement _turn_prepare")

    def _turn_generate(self, contexts: list[list[int]], params: SamplingParams) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        raise NotImplementedError(f"{type(self).__name__} mixes in AgentTurns but does not implement _turn_generate")

    def _turn_version(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} mixes in AgentTurns but does not implement _turn_version")

    def _turn_stream(self, context: list[int], params: SamplingParams, top_k: int) -> Iterator[tuple[int, float, list[tuple[int, float]]]]:
        """Optional hook: sample one turn token by token, yielding (id, log-prob, top-k alternatives)
        as each is sampled (roles/generation/hf_stream.py). Without it generate_turn_stream refuses
        with NotImplementedError, and callers sample in chunks of generate_turn calls instead."""
        raise NotImplementedError(f"{type(self).__name__}: token streaming is not available on this role's engine "
                                  "(sample in chunks of generate_turn calls)")

    @endpoint(dispatch=Dispatch.SPLIT_GENERATION, keywords=TURN_OPTIONS)
    def generate_turn(self, batch: Batch, *extra: Batch, stop: dict[str, list[str]] | None = None, **sampling: Any) -> Batch:
        """One sampled turn per row. Reads `context` (token ids so far; [] for a new conversation)
        and `append` (texts tokenised and appended first: the prompt, tool outputs). Returns
        non-tensor `appended` (ids of each appended text), `turn_ids`, `turn_log_probs`, `turn_text`,
        `weight_version`, `turn_finished` and `turn_stop_text` (the text the ids spell past the
        returned text when a stop string ended the turn). `stop`: {"strings": [...]}, text of any
        length that ends a turn (roles/generation/stops.py: the ids keep every token up to the one
        that completed it; the text ends before it unless include_stop_str_in_output; a table, as
        SPLIT dispatch would split a list argument)."""
        opts = self._turn_options("generate_turn", stop, sampling)
        # every rank, rows or none (a generation group gets none when fewer conversations are
        # live than there are groups), before any row is read: it may be collective
        params, meta = self._turn_prepare(opts.params)
        rows = merge(batch, extra)
        if len(rows) == 0:  # an empty slice of the call's rows carries no columns
            return Batch({}, {c: [] for c in ("appended", "turn_ids", "turn_log_probs", "turn_text", "weight_version", "turn_finished",
                                                  "turn_stop_text")}, meta)
        missing = [c for c in TURN_INPUT if c not in rows.non_tensor]
        if missing:
            raise KeyError(f"generate_turn needs non-tensor columns {missing}; the batch has {list(rows.non_tensor)}")
        contexts, appended = [], []
        for i, (context, append) in enumerate(zip(rows["context"], rows["append"], strict=True)):
            ids, pieces = self._extend(i, context, append)
            contexts.append(ids)
            appended.append(pieces)
        params = self._fit(params, contexts, opts)
        out, timings = self._turn_generate(contexts, params)
        version = self._turn_version()
        mask = out["response_mask"].bool()
        turn_ids = [r[m].tolist() for r, m in zip(out["responses"], mask, strict=True)]
        turn_lp = [lp[m].tolist() for lp, m in zip(out["log_probs"], mask, strict=True)]
        cuts = [self._cut(c, t, params, opts.text_prefix) for c, t in zip(contexts, turn_ids, strict=True)]
        turn_ids = [t[:cut.tokens] for t, cut in zip(turn_ids, cuts, strict=True)]
        turn_lp = [lp[:cut.tokens] for lp, cut in zip(turn_lp, cuts, strict=True)]
        columns = {"appended": appended, "turn_ids": turn_ids, "turn_log_probs": turn_lp, "turn_text": [cut.text for cut in cuts],
                   "weight_version": [version] * len(rows),
                   "turn_finished": [bool(cut.stopped_by) or self._finished(t, params) for t, cut in zip(turn_ids, cuts, strict=True)],
                   "turn_stop_text": [cut.spelled_past for cut in cuts]}
        if opts.pieces:
            columns["turn_pieces"] = [token_pieces(self.tokenizer, ids) for ids in turn_ids]
        if opts.top_k:
            columns["turn_top"] = top_alternatives(self, contexts, turn_ids, opts.top_k, params)
        return Batch({}, columns, {**meta, **timings, "weight_version": version})

    @endpoint(stream=True, keywords=TURN_OPTIONS)
    def generate_turn_stream(self, context: list[int], append: list[Any], stop: dict[str, list[str]] | None = None,
                             **sampling: Any) -> Generator[dict[str, Any], None, dict[str, Any]]:
        """One conversation's turn, token by token (a streaming endpoint: hfrt.daemon.streaming).
        Takes one row's `context` and `append` and generate_turn's options; yields
        {"appended": ids of each appended item, "weight_version"} once the prompt is built and checked, then
        {"id", "logprob", "text" (the token's share of the decoded text), "top" (with top_logprobs)}
        as each token is sampled, on a KV cache kept for the whole turn (one prefill); returns the
        row generate_turn gives for this conversation (the same tokens and log-probs for the same
        seed). Cancelling the call stops sampling before the next token."""
        if type(self)._turn_stream is AgentTurns._turn_stream:  # refused before _turn_prepare, which may be collective
            self._turn_stream([], self.sampling, 0)
        opts = self._turn_options("generate_turn_stream", stop, sampling)
        params, _ = self._turn_prepare(opts.params)
        ids, appended = self._extend(0, context, append)  # worded as generate_turn's row 0
        params = self._fit(params, [ids], opts)
        top_k = opts.top_k
        version = self._turn_version()  # the turn's version: a load during the turn applies from its next step on
        tokens = self._turn_stream(ids, params, top_k)
        yield {"appended": appended, "weight_version": version}
        stats = self.__dict__.setdefault("turn_stream_stats", {"streams": 0, "open": 0, "tokens": 0, "closed_early": 0})
        stats["streams"] += 1
        stats["open"] += 1
        turn_ids, log_probs, pieces, tops, shown, done = [], [], [], [], "", False
        try:
            for token, logp, top in tokens:
                turn_ids.append(token)
                log_probs.append(logp)
                stats["tokens"] += 1
                text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
                piece = "" if text.endswith("\ufffd") or not text.startswith(shown) else text[len(shown):]
                shown = shown + piece
                pieces.append(piece)
                tops.append(top)
                yield {"id": token, "logprob": logp, "text": piece, **({"top": top} if top_k else {})}
            done = True
        finally:
            stats["open"] -= 1
            stats["closed_early"] += 0 if done else 1
            if isinstance(tokens, Generator):
                tokens.close()  # drops the KV cache now
        cut = self._cut(ids, turn_ids, params, 0)
        return {"appended": appended, "turn_ids": turn_ids[:cut.tokens], "turn_log_probs": log_probs[:cut.tokens], "turn_text": cut.text,
                "turn_pieces": pieces[:cut.tokens], "turn_finished": bool(cut.stopped_by) or self._finished(turn_ids, params),
                "turn_stop_text": cut.spelled_past, "weight_version": version, **({"turn_top": tops[:cut.tokens]} if top_k else {})}

    @endpoint(dispatch=Dispatch.REPLICATE)
    def turn_streams(self) -> dict[str, int]:
        """Counters of generate_turn_stream: streams started, open now, tokens sampled, and streams
        closed before their turn ended (their caller went away)."""
        return dict(self.__dict__.get("turn_stream_stats") or {"streams": 0, "open": 0, "tokens": 0, "closed_early": 0})

    def _turn_options(self, where: str, stop: Any, sampling: dict[str, Any]) -> TurnOptions:
        """A turn call's keywords read out (see TurnOptions)."""
        if stop is not None and not isinstance(stop, dict):
            raise InvalidArgument("stop", f"{where}: stop must be a table {{'strings': [...]}}, not {stop!r:.80}")
        pieces, max_prompt = bool(sampling.pop("pieces", False)), sampling.pop("max_prompt_tokens", None)
        top_k, text_prefix = int(sampling.pop("top_logprobs", 0) or 0), int(sampling.pop("text_prefix", 0) or 0)
        fit, request_max = bool(sampling.pop("fit_context", False)), sampling.pop("request_max_tokens", None)
        strings = tuple((stop or {}).get("strings", [])) + tuple(sampling.pop("stop_strings", None) or ())
        stops = tuple(sampling.pop("stop_token_ids", None) or ()) + special_stop_ids(self.tokenizer, strings)
        params = dataclasses.replace(sampling_params(self.sampling, **sampling), n=1, stop_token_ids=stops, stop_strings=strings)
        return TurnOptions(params, pieces, max_prompt, top_k, text_prefix, fit, None if request_max is None else int(request_max))

    def _extend(self, row: int, context: list[int], append: list[Any]) -> tuple[list[int], list[list[int]]]:
        """extend_context for one row, after refusing appended text longer than the context can
        hold before any of it is tokenised (turn_limits.check_text_size); errors name the row."""
        try:
            check_text_size(list(append), context_limit(self), self._token_bytes)
            return extend_context(self.tokenizer, context, append)
        except InvalidArgument as exc:
            raise exc.at(f"generate_turn row {row}") from exc
        except (TypeError, ValueError) as exc:
            raise ValueError(f"generate_turn row {row}: {exc}") from exc

    @functools.cached_property
    def _token_bytes(self) -> int:
        """The most bytes one token of this role's vocabulary spells (turn_limits.max_token_bytes)."""
        return max_token_bytes(self.tokenizer)

    @endpoint(dispatch=Dispatch.REPLICATE)
    def serving_info(self) -> dict[str, Any]:
        """What a server in front of this role checks before sending a turn: `context_tokens` (the
        model's context, None when unknown), `max_token_bytes` (so text longer than
        context_tokens × max_token_bytes bytes is refused without a call), `template_sees_tools`
        (whether the tokenizer's chat template shows the model the tools it is given; None: no
        template) and `tool_templates` (the built-in ones a chat item may name instead)."""
        return {"context_tokens": context_limit(self), "max_token_bytes": self._token_bytes,
                "template_sees_tools": self._template_sees_tools, "tool_templates": sorted(TOOL_TEMPLATES)}

    @functools.cached_property
    def _template_sees_tools(self) -> bool | None:
        return template_sees_tools(self.tokenizer)

    def _fit(self, params: SamplingParams, contexts: list[list[int]], opts: TurnOptions) -> SamplingParams:
        """params with max_new_tokens cut to what the longest row's context leaves (with `fit`:
        max_tokens was not given), after checking the rows' lengths once, against the request's
        own max_tokens (`request_max`, else max_new_tokens): ValueError naming the row otherwise."""
        limit = context_limit(self)
        if opts.fit and limit is not None:
            left = limit - max(len(c) for c in contexts)
            if left < 1:
                raise ContextTooLong("prompt", f"prompt: the prompt is {limit - left} tokens, which leaves no room in the model's context of {limit} tokens")
            params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, left))
        asked = params.max_new_tokens if opts.fit or opts.request_max is None else opts.request_max
        for i, ids in enumerate(contexts):
            try:
                if opts.max_prompt is not None and len(ids) > opts.max_prompt:
                    raise InvalidArgument("prompt", f"prompt: {len(ids)} tokens, more than the max_prompt_tokens limit of {opts.max_prompt}")
                check_request_length(len(ids), asked, limit)
            except InvalidArgument as exc:
                raise exc.at(f"generate_turn row {i}") from exc
        return params

    def _cut(self, context: list[int], turn_ids: list[int], params: SamplingParams, text_prefix: int) -> Cut:
        """The turn cut at its first stop string (stops.cut_at_stop; the engine may have sampled a
        few tokens past it, or missed one that began in an earlier chunk, the context's last
        `text_prefix` ids); its text is the whole turn's, those earlier chunks' included."""
        prefix = context[len(context) - text_prefix:] if text_prefix else []
        cut = cut_at_stop(text_decoder(self.tokenizer), turn_ids, params.stop_strings, prefix=prefix,
                          include=params.include_stop_str_in_output)
        if not prefix:
            return cut
        whole = text_decoder(self.tokenizer)(prefix + turn_ids[:cut.tokens]) if not cut.stopped_by else None
        base = text_decoder(self.tokenizer)(prefix)
        return dataclasses.replace(cut, text=whole if whole is not None else base + cut.text)

    def _finished(self, turn_ids: list[int], params: SamplingParams) -> bool:
        """Whether a turn ended on eos or a stop token, or before max_new_tokens (False: cut by it)."""
        eos = self.tokenizer.eos_token_id
        ends = set(params.stop_token_ids) | ({int(eos)} if eos is not None and not params.ignore_eos else set())
        return len(turn_ids) < params.max_new_tokens or (bool(turn_ids) and turn_ids[-1] in ends)

    @endpoint(dispatch=Dispatch.SPLIT)
    def assemble_trajectories(self, batch: Batch, *extra: Batch, prompt_width: int = 0, response_width: int = 0) -> Batch:
        """Trajectories (non-tensor `prompt_ids`, `response_ids`, `response_gen_mask` 1 on sampled
        tokens, `response_log_probs`) as a rollout Batch: the roles/generation/batches.py tensor columns, padded
        to the group's widest (at least the given widths), `response` text of the whole response,
        and every other column carried. Every data-parallel rank must get at least one trajectory
        (the training endpoints need rows on every rank too); all ranks refuse together otherwise."""
        rows = merge(batch, extra)
        check_rows(len(rows), "assemble_trajectories")  # all ranks raise together: none waits in all_reduce below
        missing = [c for c in TRAJECTORY_INPUT if c not in rows.non_tensor]
        if missing:
            raise KeyError(f"assemble_trajectories needs non-tensor columns {missing}; the batch has {list(rows.non_tensor)}")
        columns = {c: list(rows[c]) for c in TRAJECTORY_INPUT}
        empty = [i for i, p in enumerate(columns["prompt_ids"]) if not p]
        if empty:
            raise ValueError(f"assemble_trajectories: trajectories {empty[:5]} have no prompt tokens")
        local = [max((len(p) for p in columns["prompt_ids"]), default=1), max((len(r) for r in columns["response_ids"]), default=1)]
        widths = all_reduce([max(local[0], prompt_width), max(local[1], response_width, 1)], "max")
        record = trajectory_record(columns, int(widths[0]), int(widths[1]), int(self.tokenizer.pad_token_id))
        texts = list(self.tokenizer.batch_decode(columns["response_ids"], skip_special_tokens=True))
        carried = {k: v for k, v in rows.non_tensor.items() if k not in TRAJECTORY_INPUT and k != "response"}
        tokens = float(record["response_mask"].sum())
        return Batch(record, {**carried, "response": texts}, {**rows.meta, "response_tokens": tokens})
