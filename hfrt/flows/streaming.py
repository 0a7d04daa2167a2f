"""Streamed scoring for the synchronous flows: the step's rollout generated as `stream_chunks`
calls to the actor (each a future, run by the actor in arrival order), and the scoring calls
(reference log-probs, reward, critic values) started on each chunk as soon as it arrives, so they
run while the actor samples the next chunks. Sync semantics stay: the actor's weights are those
of the previous update for every chunk, and the step trains on the whole rollout.

Exactness: every chunk call names its part (chunk i of k) of the full prompt batch; the actor lays
each out as the whole batch would be (same prompt width) and samples row by row (row-seeded),
so the chunks concatenated are the rollout that stream_chunks=1 makes — the same tokens,
rewards and advantages; forward passes over smaller batches may differ in the last float bits.

No torch: futures and handles. It knows the actor's `generate(chunk=, chunks=)`; not which scorers a
flow runs (the flow passes them) nor what they compute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar, Protocol

from hfrt.flows.batches import concat_rollouts
from hfrt.flows.timing import Stage, StageTimer
from hfrt.protocols import BatchHandle

#: the scoring calls of one chunk of rollout, by timing name: {"ref_log_prob": reference.compute_log_prob(chunk), ...}
Scorers = Callable[[BatchHandle], Mapping[str, Awaitable[BatchHandle]]]


class StreamedConfig(Protocol):
    """What check_stream_chunks reads."""

    stream_chunks: int
    prompts_per_step: int
    STREAMED: ClassVar[bool]


def check_stream_chunks(cfg: Any) -> None:
    """stream_chunks at least 1, at most prompts_per_step (a chunk holds whole prompts), and other
    than 1 only in a flow whose config class declares STREAMED = True itself (a flow built on it
    that generates another way does not inherit it)."""
    chunks = cfg.stream_chunks
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"config stream_chunks={chunks!r}: must be an int of at least 1 (1: one generate call)")
    if chunks > cfg.prompts_per_step:
        raise ValueError(f"config stream_chunks={chunks}: more chunks than prompts_per_step={cfg.prompts_per_step}")
    if chunks != 1 and not type(cfg).__dict__.get("STREAMED", False):
        raise ValueError(f"config stream_chunks={chunks}: {type(cfg).__name__}'s flow generates in one call; "
                         "streamed scoring is in the grpo and ppo flows")


async def streamed_experience(
    t: StageTimer, generate: Callable[[int, int], Awaitable[BatchHandle]], chunks: int, scorers: Scorers
) -> tuple[BatchHandle, dict[str, BatchHandle]]:
    """(rollout, {name: scores}): `generate(i, chunks)` sent for every chunk at once, each
    chunk's scorers started when it arrives; results concatenated in chunk order.

    Timings as the unstreamed step records them: timing/generate_s until the last chunk arrived,
    timing/stage2_s from then until the last scoring call returned (what streaming did not
    hide), timing/<name>_s per scorer over the same interval, plus stream/chunks and
    timing/stage2_streamed_s (scoring time that ran while chunks were still being generated:
    from the first scoring call to the last chunk's arrival; 0 with one chunk)."""
    start = time.perf_counter()
    pending = [asyncio.ensure_future(generate(i, chunks)) for i in range(chunks)]
    parts: list[BatchHandle] = []
    started: dict[str, list[asyncio.Future[BatchHandle]]] = {}
    first_score = None
    try:
        for future in pending:
            part = await future
            parts.append(part)
            first_score = first_score or time.perf_counter()
            for name, call in scorers(part).items():
                started.setdefault(name, []).append(asyncio.ensure_future(call))
        generated = time.perf_counter()
        t.record(Stage.GENERATE, generated - start)

        async def finish(name: str, calls: list[asyncio.Future[BatchHandle]]) -> BatchHandle:
            done = await asyncio.gather(*calls)
            t.timings[f"timing/{name}_s"] = time.perf_counter() - generated
            return done[0] if len(done) == 1 else BatchHandle.concat(list(done))

        names = list(started)
        results = await asyncio.gather(*(finish(name, started[name]) for name in names))
    except BaseException:
        everything: list[asyncio.Future[Any]] = [*pending, *(f for calls in started.values() for f in calls)]
        for call in everything:
            call.cancel()
        raise
    t.record(Stage.STAGE2, time.perf_counter() - generated)
    t.timings["timing/stage2_streamed_s"] = generated - first_score if chunks > 1 and first_score else 0.0
    t.timings["stream/chunks"] = float(chunks)
    rollout = parts[0] if len(parts) == 1 else concat_rollouts(parts)
    return rollout, dict(zip(names, results, strict=True))
