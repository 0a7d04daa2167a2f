"""Partial rollouts on the rollout role, daemon side — an endpoint group (`PartialRollouts`) mixed
into the rollout daemon class, reading the public attributes its docstring names: a rollout
generated in segments of at most K new tokens, the rows that have not finished kept here between
segments and continued token-in (their prompt ids + the tokens sampled so far) by the next segment
call, with whatever weights the daemon holds by then. Every response token records the version
that sampled it (`token_versions`) and the log-prob the sampling engine gave it.

Ordering makes the interruption: calls to one daemon run in arrival order, so a `load_weights` sent
while a segment runs is applied before the next segment. It knows the generation engine, the
tokenizer and the rollout layout; nothing of staleness bounds, flows or training.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from hfrt.daemon.batch import Batch
from hfrt.roles.common import SAMPLING_OPTIONS, sampling_params
from hfrt.roles.endpoint_groups.agent_turns import pad_rows
from hfrt.roles.generation.batches import (
    decode_responses,
    encode_prompts,
    fixed_width,
    length_stats,
    rollout_batch,
    with_uids,
)
from hfrt.roles.generation.hf import SamplingParams
from hfrt.roles.rows import all_reduce, check_rows, merge
from hfrt.wire.endpoints import Dispatch, endpoint

#: token_versions where response_mask is 0
NO_VERSION = -1
#: seed offset per segment after the first (a resumed segment must not replay the first one's draws)
SEGMENT_SEED_STRIDE = 1_000_003
#: unfinished rollouts kept at once per daemon (a flow has at most max_staleness + 1 in flight)
MAX_OPEN = 16


@dataclass
class PartialRows:
    """One rollout's rows on this rank between segments (n samples per prompt, adjacent)."""

    prompts: Batch  # the prompts this rank was given (with uids), carried to every sample
    params: SamplingParams  # the rollout's sampling (seed already offset by dp rank)
    prompt_ids: list[list[int]]  # per row
    width: int  # the group's widest prompt
    tokens: list[list[int]]
    log_probs: list[list[float]]
    versions: list[list[int]]
    done: list[bool]
    segments: int = 0
    generate_s: float = 0.0

    def open_rows(self) -> list[int]:
        return [i for i, d in enumerate(self.done) if not d]


def stop_set(params: SamplingParams, eos_token_id: int | None) -> set[int]:
    """Token ids that end a row, as the engines read `params`."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos and eos_token_id is not None:
        stops.add(int(eos_token_id))
    return stops


def partial_record(rows: PartialRows, pad_id: int) -> dict[str, torch.Tensor]:
    """The rollout tensor columns (roles/generation/batches.py layout) of finished rows, plus token_versions."""
    params = rows.params
    out = {
        "prompts": pad_rows(rows.prompt_ids, max(len(p) for p in rows.prompt_ids), pad_id, left=True, dtype=torch.long),
        "responses": pad_rows(rows.tokens, params.max_new_tokens, pad_id, left=False, dtype=torch.long),
        "response_mask": pad_rows([[1] * len(t) for t in rows.tokens], params.max_new_tokens, 0, left=False, dtype=torch.long),
        "log_probs": pad_rows(rows.log_probs, params.max_new_tokens, 0.0, left=False, dtype=torch.float32),
    }
    prompt_mask = pad_rows([[1] * len(p) for p in rows.prompt_ids], out["prompts"].shape[1], 0, left=True, dtype=torch.long)
    out["attention_mask"] = torch.cat([prompt_mask, out["response_mask"]], dim=1)
    record = fixed_width(out, prompt_width=rows.width, response_width=params.max_new_tokens, pad_id=pad_id, n=params.n)
    record["token_versions"] = pad_rows(rows.versions, params.max_new_tokens, NO_VERSION, left=False, dtype=torch.long)
    return record


class PartialRollouts:
    """Endpoint generate_partial (SPLIT), for a daemon with `engine`, `tokenizer`, `sampling`,
    `version`, `broken` and `context` (the rollout role), and `partials` (empty at setup): the
    rollouts in progress by key."""

    engine: Any
    tokenizer: Any
    sampling: Any
    version: int
    broken: str | None
    context: Any
    partials: dict[str, PartialRows]

    @endpoint(dispatch=Dispatch.SPLIT, keywords=SAMPLING_OPTIONS)
    def generate_partial(
        self, batch: Batch, *extra: Batch, key: str, segment_tokens: int, segment: int = 0, **sampling: Any
    ) -> Batch:
        """One segment of rollout `key`: at most `segment_tokens` new tokens for every row not yet
        finished (the first call for `key` starts it from the `prompt` column, as `generate` does;
        later calls must pass the same prompts and continue it). While any row of the group is
        unfinished it returns per-row `finished` only (meta `unfinished`, `segments`); the call
        that finishes the last row returns the rollout Batch as `generate` does, plus tensor
        `token_versions` [N, R] (the version that sampled each token, -1 on padding) and per-row
        `weight_version` (the row's oldest token's version) and `weight_version_max`, and forgets `key`.

        `segment` is the caller's count of calls already made for `key`. A later segment for a key
        this daemon does not hold means the rows were lost with a daemon that has been replaced
        since (elastic recovery re-sends the call): the whole rollout is generated again, to the
        end, in this call, with the weights held now (meta `regenerated`)."""
        if self.broken is not None:
            raise RuntimeError(f"rollout daemon {self.context.identity} holds no valid weights: {self.broken}")
        if not isinstance(segment_tokens, int) or isinstance(segment_tokens, bool) or segment_tokens < 1:
            raise ValueError(f"generate_partial: segment_tokens must be an int >= 1, got {segment_tokens!r}")
        prompts = merge(batch, extra)
        rows = self.partials.get(key)
        if rows is None:
            while len(self.partials) >= MAX_OPEN:  # rollouts a flow abandoned (cancelled, dropped): oldest first
                del self.partials[next(iter(self.partials))]
            rows = self.partials[key] = self._start(prompts, sampling)
        elif len(prompts) * rows.params.n != len(rows.done):
            raise ValueError(f"generate_partial {key!r}: continued with {len(prompts)} prompts, started with "
                             f"{len(rows.done) // rows.params.n} (pass the same prompts to every segment)")
        lost = rows.segments == 0 and segment > 0
        self._segment(rows, segment_tokens)
        [unfinished] = all_reduce([float(len(rows.open_rows()))])
        while lost and unfinished:
            self._segment(rows, segment_tokens)
            [unfinished] = all_reduce([float(len(rows.open_rows()))])
        if unfinished:
            meta = {"unfinished": unfinished, "segments": rows.segments, "weight_version": self.version}
            return Batch({}, {"finished": list(rows.done)}, meta)
        del self.partials[key]
        out = self._finish(rows)
        if lost:
            out.meta["regenerated"] = True
        return out

    def _start(self, prompts: Batch, sampling: dict[str, Any]) -> PartialRows:
        prompts = with_uids(prompts)
        check_rows(len(prompts), "rollout.generate_partial")
        if "prompt" not in prompts:
            raise KeyError(f"rollout.generate_partial needs a non-tensor column 'prompt'; the batch has {list(prompts.non_tensor)}")
        params = sampling_params(self.sampling, **sampling)
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + self.context.dp_rank)
        if params.row_offset is None:  # row-seeded as the rollout's generate, so one segment is generate
            params = dataclasses.replace(params, row_offset=0)
        ids = encode_prompts(self.tokenizer, prompts["prompt"], params.max_prompt_tokens, "rollout.generate_partial")
        [width] = all_reduce([max(len(i) for i in ids)], "max")
        per_row = [list(i) for i in ids for _ in range(params.n)]
        empty: list[list[Any]] = [[] for _ in per_row]
        return PartialRows(prompts, params, per_row, int(width), [list(e) for e in empty], [list(e) for e in empty],
                           [list(e) for e in empty], [False] * len(per_row))

    def _segment(self, rows: PartialRows, segment_tokens: int) -> None:
        """Sample up to `segment_tokens` more tokens for every open row with the current weights."""
        open_rows = rows.open_rows()
        if not open_rows:
            return
        params, first = rows.params, rows.segments == 0
        budget = min(segment_tokens, params.max_new_tokens - len(rows.tokens[open_rows[0]]))
        if first:  # the same call `generate` makes: one segment of K ≥ max_new_tokens is `generate` itself
            contexts = [rows.prompt_ids[i] for i in range(0, len(rows.done), params.n)]
            seg = dataclasses.replace(params, max_new_tokens=budget)
        else:  # open rows all hold the same number of tokens: none of them has stopped yet
            contexts = [rows.prompt_ids[i] + rows.tokens[i] for i in open_rows]
            seed = None if params.seed is None else params.seed + SEGMENT_SEED_STRIDE * rows.segments
            seg = dataclasses.replace(params, max_new_tokens=budget, n=1, seed=seed)
        start = time.perf_counter()
        out = self.engine.generate(contexts, seg)
        rows.generate_s += time.perf_counter() - start
        stops = stop_set(params, getattr(self.tokenizer, "eos_token_id", None))
        mask = out["response_mask"].bool()
        for i, r, m, lp in zip(open_rows, out["responses"], mask, out["log_probs"], strict=True):
            new = r[m].tolist()
            rows.tokens[i] += new
            rows.log_probs[i] += lp[m].tolist()
            rows.versions[i] += [self.version] * len(new)
            ended = len(new) < budget or (bool(new) and new[-1] in stops)
            rows.done[i] = ended or len(rows.tokens[i]) >= params.max_new_tokens
        rows.segments += 1

    def _finish(self, rows: PartialRows) -> Batch:
        pad_id = int(self.tokenizer.pad_token_id)
        record = partial_record(rows, pad_id)
        texts = decode_responses(self.tokenizer, record["responses"], record["response_mask"])
        [elapsed] = all_reduce([rows.generate_s], "max")
        params = rows.params
        oldest = [min(v) if v else self.version for v in rows.versions]
        newest = [max(v) if v else self.version for v in rows.versions]
        [low] = all_reduce([float(min(oldest, default=self.version))], "min")
        meta = {"temperature": params.temperature, "n": params.n, "timing/generate_s": elapsed,
                "weight_version": int(low), "segments": rows.segments} | length_stats(record["response_mask"], params.max_new_tokens)
        out = rollout_batch(record, texts, rows.prompts, params.n, meta)
        out["weight_version"] = oldest
        out["weight_version_max"] = newest
        return out
