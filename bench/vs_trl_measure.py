"""What `hfrt bench vs-trl` measures beside step times: the peak resident memory of hfrt's role
daemons (sampled from outside, every process below the bench but TRL's), their CPU seconds, and the padding
fraction of each step's rollout — rows padded to the batch's longest (before token budgets) and
micro-batches as the training engine plans them now (roles/training/batching.py).

It knows process trees, the rollout's inline text columns and the engine's batching rule;
nothing of RL or of TRL.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


class DaemonRSS:
    """Samples the RSS of every process below this one except `exclude` (TRL's), every
    `interval_s`, while running; `.peak_mb` per pid, `.peak_total_mb` (the largest sum seen)."""

    def __init__(self, exclude: Sequence[int] = (), interval_s: float = 0.2) -> None:
        import psutil

        self._psutil = psutil
        self.exclude = set(exclude)
        self.interval_s = interval_s
        self.peak_mb: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self.peak_total_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hfrt-bench-rss", daemon=True)

    def _sample(self) -> None:
        total = 0.0
        for proc in self._psutil.Process().children(recursive=True):
            if proc.pid in self.exclude:
                continue
            try:
                mb = proc.memory_info().rss / 2**20
                self.names.setdefault(proc.pid, " ".join(proc.cmdline()[-2:])[-60:])
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                continue
            total += mb
            self.peak_mb[proc.pid] = max(self.peak_mb.get(proc.pid, 0.0), mb)
        self.peak_total_mb = max(self.peak_total_mb, total)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the figures: hfrt_peak_daemon_rss_mb (the largest daemon), ..._total_mb."""
        self._stop.set()
        self._thread.join()
        return {
            "hfrt_peak_daemon_rss_mb": round(max(self.peak_mb.values(), default=0.0), 1),
            "hfrt_peak_daemons_rss_total_mb": round(self.peak_total_mb, 1),
        }


def row_lengths(tokenizer: Any, prompts: Sequence[str], responses: Sequence[str], n: int) -> tuple[list[int], list[int]]:
    """(prompt tokens, response tokens) per rollout row (samples of a prompt adjacent), counted by
    re-tokenising the texts (the rollout's token ids stay on the daemons)."""
    prompt_tokens = [len(tokenizer(p)["input_ids"]) for p in prompts]
    response_tokens = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) + 1 for r in responses]  # + EOS
    return [prompt_tokens[i // n] for i in range(len(responses))], response_tokens


def padding_fractions(prompt: list[int], response: list[int], engine: dict[str, Any]) -> dict[str, float]:
    """padding_before: the share of token slots that are padding with every row padded to the
    batch's longest prompt and longest response (the engine before token budgets); padding_after:
    the same under `engine` (micro_batch_size, max_tokens_per_micro_batch, pack) as the training
    engine plans its micro-batches now."""
    try:
        from hfrt.roles.training.batching import Lengths, padding_fraction
    except ImportError:  # an engine without token budgets
        return {}
    lengths = Lengths(prompt, response)
    rows = len(prompt)
    slots = rows * (max(prompt) + max(response))
    before = 1.0 - sum(p + r for p, r in zip(prompt, response, strict=True)) / slots if slots else 0.0
    after = padding_fraction(lengths, engine.get("max_tokens_per_micro_batch"),
                             rows_per_micro=int(engine.get("micro_batch_size", rows)), pack=bool(engine.get("pack", False)))
    return {"padding_before": round(before, 4), "padding_after": round(after, 4)}


class ProcessCPU:
    """CPU seconds (user + system, every thread) of this process and every process below it but
    `exclude` (the floor's): hfrt's controller and daemons."""

    def __init__(self, exclude: int | None) -> None:
        import psutil

        self._psutil, self.exclude = psutil, exclude
        self.me = psutil.Process()

    def seconds(self) -> float:
        total = 0.0
        for proc in [self.me, *self.me.children(recursive=True)]:
            if proc.pid == self.exclude:
                continue
            try:
                times = proc.cpu_times()
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                continue
            total += times.user + times.system
        return total
