"""The actor's hybrid engine: one set of trained weights serving both training and generation.

Before a rollout it wakes the generation engine and streams the training engine's full weights
into it one block at a time (never a second gathered copy of the whole model at once); after
the rollout it puts the generation engine to sleep so its memory is free for training. Each
transition is timed and its peak resident memory sampled; `compare_weights` checks a push. It
knows nothing of losses, of the wire, or of which backends it joins: only the TrainEngine and
GenerationEngine interfaces.

Typical use in the actor daemon's `generate` endpoint:

    out, metrics = hybrid.generate(prompt_ids, SamplingParams(...))
    # metrics: timing/reshard_to_generate_s, timing/generate_s, timing/reshard_to_train_s,
    #          memory/peak_rss_mb, memory/rss_before_mb, memory/rss_after_mb, ...
"""

from __future__ import annotations

import contextlib
import enum
import gc
import inspect
import os
import resource
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from hfrt.roles.generation.hf import GenerationEngine, HFGenerationEngine, SamplingParams
from hfrt.roles.training.engines.base import TrainEngine


class Phase(enum.StrEnum):
    """Which side of the hybrid engine holds the weights' memory. The actor's `hybrid_phase`
    endpoint reports it by its value ("train" / "generate")."""

    #: the generation engine asleep, its memory free for training (where a daemon starts)
    TRAIN = "train"
    #: the generation engine awake with the current weights pushed into it
    GENERATE = "generate"


def rss_mb() -> float:
    """Current resident set size of this process, MiB."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss / 2**20


def lifetime_peak_rss_mb() -> float:
    """ru_maxrss: the highest RSS this process ever had (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeakRSS:
    """Samples RSS on a background thread while the block runs; `.peak_mb` afterwards.

    ru_maxrss only ever grows, so it cannot show the peak of one phase once an earlier phase
    went higher; sampling can (at `interval_s` resolution; the start and end are always sampled).
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hfrt-peak-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mb = max(self.peak_mb, rss_mb())

    def __enter__(self) -> PeakRSS:
        self.peak_mb = rss_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, rss_mb())


class HybridEngine:
    """Train ↔ generate transitions over one training engine and one generation engine.

    Every rank of the training group must make the same calls (weight gathering is collective).
    With a generation engine built on the training module itself (share_weights), the push is a
    no-op and only sleep / wake remain.
    """

    def __init__(self, train: TrainEngine, gen: GenerationEngine) -> None:
        self.train = train
        self.gen = gen
        self.phase = Phase.TRAIN
        #: the training engine's optimizer steps when its weights were last pushed (None: never,
        #: or forgotten); the push is skipped while it still matches and the engine kept them
        self.pushed_version: int | None = None

    def forget_push(self) -> None:
        """The training weights changed without an optimizer step (a checkpoint load): push again."""
        self.pushed_version = None

    def current(self) -> bool:
        """True when the generation engine still holds the training weights as they are now:
        pushed at the engine's current step count, and not dropped by sleep since (vLLM on CPU
        ignores sleep; a shared HF module is the training module)."""
        return self.train.steps == self.pushed_version and bool(getattr(self.gen, "keeps_weights_asleep", False))

    def weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """What to_generate pushes, one bucket at a time: the full weights (AdapterHybrid in
        roles/generation/lora.py: the LoRA adapters only)."""
        return self.train.state_dict_for_generation()

    def to_generate(self) -> dict[str, float]:
        """Wake the generation engine and push current weights, streamed per block — unless the
        engine still holds them (`current`: same optimizer step count since the last push;
        reshard/push_skipped = 1 then). Tensors the training engine owns for good (the local
        backend's own parameters) go in without a defensive copy."""
        if self.phase is Phase.GENERATE:
            return {}
        start, before = time.perf_counter(), rss_mb()
        if self.current():
            self.gen.wake()
            self.phase = Phase.GENERATE
            return {"timing/reshard_to_generate_s": time.perf_counter() - start, "memory/rss_before_mb": before,
                    "reshard/pushed_mb": 0.0, "reshard/push_skipped": 1.0}
        with PeakRSS() as peak:
            self.gen.wake()
            pushed = self._push()
            _synchronize()
        self.phase = Phase.GENERATE
        self.pushed_version = self.train.steps
        return {
            "timing/reshard_to_generate_s": time.perf_counter() - start,
            "memory/reshard_to_generate_peak_rss_mb": peak.peak_mb,
            "memory/rss_before_mb": before,
            "reshard/push_skipped": 0.0,
            **pushed,
        }

    def _push(self) -> dict[str, float]:
        """Load the current weights into the awake generation engine; its metrics (at least
        reshard/pushed_mb). Here: the full weights, streamed per block (VLLMPieceHybrid in
        roles/generation/vllm_pieces.py: this rank's micro-DP pieces)."""
        pushed = [0]
        _load(self.gen, _stream(self.weights(), pushed), stable=_owns_tensors(self.train))
        return {"reshard/pushed_mb": pushed[0] / 2**20}

    def to_train(self) -> dict[str, float]:
        """Release generation memory (sleep) so training has it back."""
        if self.phase is Phase.TRAIN:
            return {}
        start = time.perf_counter()
        with PeakRSS() as peak:
            self.gen.sleep()
            # The young generations hold what a rollout left in reference cycles; a full
            # collection walks every object transformers ever made (~0.15 s a step on CPU).
            gc.collect(1)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.phase = Phase.TRAIN
        return {
            "timing/reshard_to_train_s": time.perf_counter() - start,
            "memory/reshard_to_train_peak_rss_mb": peak.peak_mb,
            "memory/rss_after_mb": rss_mb(),
        }

    @contextlib.contextmanager
    def generating(self, metrics: dict[str, float]) -> Iterator[GenerationEngine]:
        """`with hybrid.generating(metrics) as gen:` — weights pushed on entry, memory freed on exit."""
        metrics.update(self.to_generate())
        try:
            yield self.gen
        finally:
            metrics.update(self.to_train())

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """One rollout: to_generate → generate → to_train, with timings and peak memory."""
        metrics: dict[str, float] = {}
        with PeakRSS() as peak, self.generating(metrics) as gen:
            start = time.perf_counter()
            out = gen.generate(prompts, params)
            metrics["timing/generate_s"] = time.perf_counter() - start
        metrics["memory/peak_rss_mb"] = peak.peak_mb
        metrics["memory/lifetime_peak_rss_mb"] = lifetime_peak_rss_mb()
        metrics |= _cuda_memory()
        return out, metrics



class ReshardHybrid(HybridEngine):
    """The 3D-HybridEngine transition (roles/training/parallel/reshard.py): the training engine's tp/pp
    pieces (engine.local_pieces(), gathered over dp by FSDP as every forward does, one block at a
    time, in engine.buckets order) are regrouped inside micro-DP groups into this rank's generation
    pieces, which the tensor-parallel generation model *adopts* as its DTensors' local tensors (no
    copy, no wake-time allocation). Where the
    layouts coincide (or generation is more sharded) a generation parameter is the training piece
    or a view of it: zero bytes beyond the dp gather, none at all without FSDP (dp = 1). to_train
    drops the generation model's references, so what was assembled or dp-gathered is freed. No
    rank gathers the full model unless the generation layout is t1p1. Adds reshard/bytes_sent,
    reshard/bytes_received (this rank; the rollout meta takes the max), reshard/shared,
    reshard/built (generation tensors kept from the training pieces / assembled from rows)."""

    def __init__(self, train: TrainEngine, gen: GenerationEngine, resharder: Any) -> None:
        super().__init__(train, gen)
        self.resharder = resharder

    def to_generate(self) -> dict[str, float]:
        if self.phase is Phase.GENERATE:
            return {}
        start, before = time.perf_counter(), rss_mb()
        engine: Any = self.train
        # FSDP's pieces are views of buffers freed when the next block is gathered: keep a copy of
        # the generation rows only; without FSDP they are the parameters themselves: share them
        copy = bool(getattr(engine, "sharded", True))
        with PeakRSS() as peak:
            pieces = self.resharder.stream(engine.local_pieces(), engine.buckets, copy=copy)
            converted = self.gen.adopt_weights(pieces)  # type: ignore[attr-defined]
            _synchronize()
        self.phase = Phase.GENERATE
        stats = self.resharder.last
        return {
            "timing/reshard_to_generate_s": time.perf_counter() - start,
            "memory/reshard_to_generate_peak_rss_mb": peak.peak_mb,
            "memory/rss_before_mb": before,
            "reshard/bytes_sent": float(stats.bytes_sent),
            "reshard/bytes_received": float(stats.bytes_received),
            "reshard/exchange_s": stats.time_s,
            "reshard/shared": float(stats.shared),
            "reshard/built": float(stats.built),
            "reshard/converted_mb": converted / 2**20,
        }

    def to_train(self) -> dict[str, float]:
        """Drop the generation model's references to the adopted pieces (sleep) and the
        resharder's, so assembled and dp-gathered rows are freed; shared training tensors stay."""
        metrics = super().to_train()
        self.resharder.to_train()
        return metrics


def _owns_tensors(train: TrainEngine) -> bool:
    """True when state_dict_for_generation yields tensors that stay valid after the next block is
    drawn (the local backend yields its parameters themselves; sharded backends yield views of
    gather buffers that are reused)."""
    config = getattr(train, "config", None)
    return getattr(config, "backend", None) == "local"


def _load(gen: GenerationEngine, stream: Iterator[tuple[str, torch.Tensor]], *, stable: bool) -> None:
    """gen.load_weights(stream), telling an engine that can use it that the tensors stay valid
    (vLLM then skips its per-tensor copy)."""
    if stable and "stable" in inspect.signature(gen.load_weights).parameters:
        gen.load_weights(stream, stable=True)  # type: ignore[call-arg]
    else:
        gen.load_weights(stream)


def _stream(buckets: Iterator[dict[str, torch.Tensor]], pushed: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten per-block buckets into (name, tensor) pairs, counting bytes; the next block is
    gathered only when the consumer asks for its first tensor."""
    for bucket in buckets:
        for name, tensor in bucket.items():
            pushed[0] += tensor.numel() * tensor.element_size()
            yield name, tensor


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _cuda_memory() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {}
    return {"memory/cuda_max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20}


def generation_parameters(gen: GenerationEngine) -> dict[str, torch.Tensor] | None:
    """The generation engine's parameters by name; None for vLLM (it fuses and renames them, so
    only checksums compare)."""
    if isinstance(gen, HFGenerationEngine):
        return gen.local_parameters()
    return None


def compare_weights(train: Iterable[dict[str, torch.Tensor]], generation: dict[str, torch.Tensor] | None) -> dict[str, Any]:
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
