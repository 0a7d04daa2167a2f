"""Daemon-side endpoints of multi-turn agent rollouts, mixed into any role that generates (the rollout
role, and the actor on its hybrid engine): one sampled turn for many conversations at once (token
ids in, sampled token ids and their log-probs out), and the assembly of finished trajectories into
the rollout Batch layout (roles/generation/batches.py) the actor trains on.

Token-in/token-out: a conversation travels as the token ids it holds so far; text is tokenised
here only for what is appended (a prompt, a tool's output), never for what the policy sampled.
It knows the tokenizer and three hooks the daemon implements (TurnHooks); nothing of which engine
samples, of weight versions' meaning, of tools, rewards or the agent loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from hfrt.daemon.batch import Batch
from hfrt.roles.common import sampling_params
from hfrt.roles.generation.batches import encode_prompt
from hfrt.roles.generation.hf import SamplingParams
from hfrt.roles.rows import all_reduce, check_rows, merge
from hfrt.wire.endpoints import Dispatch, endpoint

#: non-tensor columns generate_turn reads (one row per conversation)
TURN_INPUT = ("context", "append")
#: non-tensor columns assemble_trajectories reads (one row per trajectory)
TRAJECTORY_INPUT = ("prompt_ids", "response_ids", "response_gen_mask", "response_log_probs")


def stop_ids(tokenizer: Any, stops: Sequence[str]) -> tuple[int, ...]:
    """Token ids of stop strings; each must be one token (the engine stops on token ids)."""
    out = []
    for text in stops:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) != 1:
            raise ValueError(f"stop string {text!r} is {len(ids)} tokens {ids}: a stop must be exactly one token")
        out.append(int(ids[0]))
    return tuple(out)


def extend_context(tokenizer: Any, context: Sequence[int], append: Sequence[Any]) -> tuple[list[int], list[list[int]]]:
    """A conversation's ids with `append` tokenised after them (the first item of an empty
    conversation is its prompt: a string, a chat or ids, as `generate` reads prompts)."""
    ids, pieces = [int(t) for t in context], []
    for index, item in enumerate(append):
        if not ids and index == 0:
            piece = encode_prompt(tokenizer, item)
        elif isinstance(item, str):
            piece = list(tokenizer(item, add_special_tokens=False)["input_ids"])
        else:
            raise TypeError(f"appended item {index} must be text, not {item!r:.80}")
        pieces.append([int(t) for t in piece])
        ids += piece
    if not ids:
        raise ValueError("a conversation has no tokens to continue from (empty context and nothing appended)")
    return ids, pieces


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

    @endpoint(dispatch=Dispatch.SPLIT_GENERATION)
    def generate_turn(self, batch: Batch, *extra: Batch, stop: dict[str, list[str]] | None = None, **sampling: Any) -> Batch:
        """One sampled turn per row. Reads `context` (token ids so far; [] for a new conversation)
        and `append` (texts tokenised and appended first: the prompt, tool outputs). Returns
        non-tensor `appended` (ids of each appended text), `turn_ids`, `turn_log_probs`, `turn_text`,
        `weight_version`. `stop`: {"strings": [...]}, one-token strings that end a turn (as stop
        token ids; a table, as SPLIT dispatch would split a list argument)."""
        if stop is not None and not isinstance(stop, dict):
            raise TypeError(f"generate_turn: stop must be a table {{'strings': [...]}}, not {stop!r:.80}")
        stops = tuple(sampling.pop("stop_token_ids", None) or ()) + stop_ids(self.tokenizer, (stop or {}).get("strings", []))
        params = dataclasses.replace(sampling_params(self.sampling, **sampling), n=1, stop_token_ids=stops)
        # every rank, rows or none (a generation group gets none when fewer conversations are
        # live than there are groups), before any row is read: it may be collective
        params, meta = self._turn_prepare(params)
        rows = merge(batch, extra)
        if len(rows) == 0:  # an empty slice of the call's rows carries no columns
            return Batch({}, {c: [] for c in ("appended", "turn_ids", "turn_log_probs", "turn_text", "weight_version")}, meta)
        missing = [c for c in TURN_INPUT if c not in rows.non_tensor]
        if missing:
            raise KeyError(f"generate_turn needs non-tensor columns {missing}; the batch has {list(rows.non_tensor)}")
        contexts, appended = [], []
        for i, (context, append) in enumerate(zip(rows["context"], rows["append"], strict=True)):
            try:
                ids, pieces = extend_context(self.tokenizer, context, append)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"generate_turn row {i}: {exc}") from exc
            contexts.append(ids)
            appended.append(pieces)
        out, timings = self._turn_generate(contexts, params)
        version = self._turn_version()
        mask = out["response_mask"].bool()
        turn_ids = [r[m].tolist() for r, m in zip(out["responses"], mask, strict=True)]
        turn_lp = [lp[m].tolist() for lp, m in zip(out["log_probs"], mask, strict=True)]
        texts = list(self.tokenizer.batch_decode(turn_ids, skip_special_tokens=True))
        columns = {"appended": appended, "turn_ids": turn_ids, "turn_log_probs": turn_lp, "turn_text": texts,
                   "weight_version": [version] * len(rows)}
        return Batch({}, columns, {**meta, **timings, "weight_version": version})

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
