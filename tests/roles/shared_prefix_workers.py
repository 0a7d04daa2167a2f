"""Helpers for the shared-prefix tests: a batch whose rows come in groups sharing a prompt, and a
rank body that runs it shared and unshared on the sharded backends.

Not a test module: spawned ranks import it by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

R = 12


def grouped_batch(
    vocab: int, prompts: Sequence[int] = (60, 45), n: int = 4, seed: int = 0, system: int = 0
) -> dict[str, torch.Tensor]:
    """n rows per prompt (prompts of the given lengths, left-padded; the first `system` tokens
    the same in every prompt), responses of 1..R tokens, right-padded; PPO columns."""
    g = torch.Generator().manual_seed(seed)
    width = max(prompts)
    head = torch.randint(3, vocab, (system,), generator=g)
    rows = []
    for length in prompts:
        prompt = torch.cat([head, torch.randint(3, vocab, (length - system,), generator=g)])
        for _ in range(n):
            size = int(torch.randint(1, R + 1, (1,), generator=g))
            rows.append((prompt, torch.randint(3, vocab, (size,), generator=g)))
    return rows_batch(rows, width, g)


def rows_batch(
    rows: Sequence[tuple[torch.Tensor, torch.Tensor]], width: int, g: torch.Generator
) -> dict[str, torch.Tensor]:
    """(prompt, response) token rows laid out as the engines' batch, with PPO columns."""
    count = len(rows)
    ids = torch.zeros(count, width + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(rows):
        ids[i, width - len(prompt) : width] = prompt
        ids[i, width : width + len(response)] = response
        mask[i, width - len(prompt) : width + len(response)] = 1
    return {
        "input_ids": ids, "attention_mask": mask, "responses": ids[:, width:], "response_mask": mask[:, width:],
        "advantages": torch.randn(count, R, generator=g), "old_log_probs": -5.5 + 0.3 * torch.randn(count, R, generator=g),
    }  # fmt: skip


def full_grads(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (FSDP2 / TP: gathered DTensors), by name."""
    if hasattr(engine, "full_gradients"):
        return {k: v.clone() for k, v in engine.full_gradients().items()}
    out = {}
    for name, p in engine.model.named_parameters():
        grad = p.grad
        if grad is None:  # frozen (LoRA's base weights)
            continue
        out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


def tokens(engine: Any) -> dict[str, float]:
    """The last pass's tokens, summed over the engine's dp ranks (as an update reports them)."""
    import torch.distributed as dist

    counts = torch.tensor(engine.sharing.tokens, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(counts, group=engine.dp_group)
    return {"tokens_computed": float(counts[0]), "tokens_in_batch": float(counts[1])}


def run_both(engine_of: Any, batch: dict[str, torch.Tensor], grads: bool = True) -> dict[str, Any]:
    """{shared: (log-probs, entropy, step metrics, gradients or None)} of one forward and one step."""
    from hfrt.roles.losses import PolicyLossConfig, policy_loss

    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, agg_mode="token-mean")

    def loss_fn(out: Any, mb: Any, scale: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return policy_loss(out.log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"], config, scale)

    out = {}
    for shared in (False, True):
        engine = engine_of(shared)
        forward = engine.forward(batch, with_entropy=True, temperature=0.7)
        metrics = engine.step(loss_fn, batch) | tokens(engine)
        out[shared] = (forward.log_probs, forward.entropy, metrics, full_grads(engine) if grads else None)
    return out


def sharded_rank(rank: int, world: int, *, out_dir: Path, deepspeed: bool = True) -> dict[str, Any]:
    """FSDP2 over 2 ranks (each its own 4-row group), DeepSpeed ZeRO-3 likewise, TP over both
    ranks (all 8 rows; and with loss_parallel, the head's vocabulary sharded): each shared and
    unshared, lr 0 (the weights stay as loaded)."""
    import importlib.util

    from hfrt.roles.models import ModelConfig, load_model
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

    from . import model_zoo

    vocab = load_model(ModelConfig("tiny")).config.vocab_size
    batch = grouped_batch(vocab)
    mine = {k: v[rank * 4 : rank * 4 + 4] for k, v in batch.items()}
    results: dict[str, Any] = {}

    def build(backend: str, **extra: Any) -> Any:
        return lambda shared: build_train_engine(
            load_model(ModelConfig("tiny")),
            EngineConfig(backend=backend, optim=OptimConfig(lr=0.0), micro_batch_size=8, shared_prefix=shared, **extra),
        )

    results["fsdp2"] = run_both(build("fsdp2"), mine)
    results["tp"] = run_both(build("tp", tp=2), batch)

    def untied(shared: bool) -> Any:  # an untied head: loss_parallel shards its vocabulary
        config = EngineConfig(backend="tp", tp=2, loss_parallel=True, optim=OptimConfig(lr=0.0), micro_batch_size=8,
                              shared_prefix=shared)  # fmt: skip
        return build_train_engine(model_zoo.model("llama", layers=2), config)

    results["tp_loss_parallel"] = run_both(untied, grouped_batch(128))
    if deepspeed and importlib.util.find_spec("deepspeed") is not None:
        results["deepspeed"] = run_both(build("deepspeed", zero_stage=3), mine, grads=False)
    return results
