"""Helpers for the engine tests: a deterministic batch, a PPO loss function, and rank workers
run in real spawned processes (gloo on CPU) whose results come back as files.

Not a test module: the spawned ranks import it by name.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from hfrt.roles.losses import LossScale, PolicyLossConfig, policy_loss

PROMPT_LEN, RESPONSE_LEN, ROWS = 6, 5, 8


def make_batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """8 rows of prompt (left-padded, varying length) + response (varying length) + PPO fields."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, PROMPT_LEN + 1, (ROWS,), generator=g)
    response_lens = torch.randint(1, RESPONSE_LEN + 1, (ROWS,), generator=g)
    cols = torch.arange(PROMPT_LEN)
    prompt_mask = (cols[None, :] >= PROMPT_LEN - prompt_lens[:, None]).long()
    response_mask = (torch.arange(RESPONSE_LEN)[None, :] < response_lens[:, None]).long()
    ids = torch.randint(3, vocab, (ROWS, PROMPT_LEN + RESPONSE_LEN), generator=g)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    ids = ids * attention_mask  # pad id 0
    return {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, PROMPT_LEN:],
        "response_mask": response_mask,
        "advantages": torch.randn(ROWS, RESPONSE_LEN, generator=g),
        "old_log_probs": -5.5 + 0.3 * torch.randn(ROWS, RESPONSE_LEN, generator=g),
    }


def ppo_loss(out: Any, mb: Mapping[str, torch.Tensor], scale: LossScale) -> tuple[torch.Tensor, dict[str, Any]]:
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, agg_mode="token-mean")
    return policy_loss(out.log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"], config, scale)


def rows_for(batch: Mapping[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    per = ROWS // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world: int, port: int, out_dir: str, target: Callable[..., dict[str, Any]], kwargs: dict[str, Any]
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any]
    try:
        from hfrt.roles.training.engines import init_distributed

        init_distributed(rank, world, "127.0.0.1", port)
        result = {"ok": True, **target(rank, world, out_dir=Path(out_dir), **kwargs)}
    except BaseException:  # reported to the test, which fails with the traceback
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    _leave_group_and_exit(together=result["ok"])


def _leave_group_and_exit(together: bool) -> None:
    """Leave the gloo group together, then exit without running C++ static destructors.

    A rank that tears its group down while its peer is still using it, or gloo's pair threads
    being destroyed at interpreter exit, can abort the process ("terminate called without an
    active exception") after its result is already written; `os._exit` after a barrier avoids both.
    A rank that failed skips the barrier: its peer may be stuck in a collective it will never join.
    """
    import torch.distributed as dist

    code = 0
    try:
        if together and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(target: Callable[..., dict[str, Any]], world: int, out_dir: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Run target(rank, world, out_dir=..., **kwargs) in `world` spawned processes; their results."""
    ctx = mp.start_processes(
        _entry, args=(world, free_port(), str(out_dir), target, kwargs), nprocs=world, join=False, start_method="spawn"
    )
    while not ctx.join(timeout=90):
        pass
    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for rank, res in enumerate(results):
        assert res["ok"], f"rank {rank} failed:\n{res['error']}"
    return results


# ------------------------------------------------------------------------------- rank bodies


def train_and_push(
    rank: int, world: int, *, out_dir: Path, backend: str, zero_stage: int = 3, check_checkpoint: bool = False
) -> dict[str, Any]:
    """One PPO step on this rank's rows, push weights to a generation copy, compare, sample, recompute."""
    from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
    from hfrt.roles.generation.hybrid import HybridEngine
    from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

    model = load_model(ModelConfig("tiny"))
    vocab = model.config.vocab_size
    engine = build_train_engine(
        model,
        EngineConfig(backend=backend, zero_stage=zero_stage, micro_batch_size=2, optim=OptimConfig(lr=1e-2)),
    )
    batch = rows_for(make_batch(vocab), rank, world)
    metrics = engine.step(ppo_loss, batch, micro_batch_size=2)

    tok = load_tokenizer("tiny")
    gen_model = load_model(ModelConfig("tiny", seed=123))  # different init: the push must overwrite it
    gen = HFGenerationEngine(gen_model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    gen.sleep()  # a daemon starts in the training phase
    hybrid = HybridEngine(engine, gen)
    transition = hybrid.to_generate()
    full = engine.full_parameters()  # type: ignore[attr-defined]
    pushed = {k: v.detach().clone() for k, v in gen_model.named_parameters()}
    exact = sorted(full) == sorted(pushed) and all(torch.equal(full[k], pushed[k]) for k in full)

    prompts = [tok(text)["input_ids"] for text in (["2+2=", "the cat"] if rank == 0 else ["hi", "3*3="])]
    params = SamplingParams(temperature=0.7, top_k=20, max_new_tokens=6, n=2, seed=rank)
    sample = gen.generate(prompts, params)
    transition |= hybrid.to_train()
    recomputed = engine.forward_logprobs(sample, temperature=0.7)
    mask = sample["response_mask"]
    logprob_diff = float(((recomputed - sample["log_probs"]) * mask).abs().max())

    result: dict[str, Any] = {
        "metrics": metrics,
        "exact": exact,
        "pushed": pushed if rank == 0 else None,
        "checksum": float(sum(v.double().sum() for v in pushed.values())),
        "logprob_diff": logprob_diff,
        "transition": transition,
    }
    if check_checkpoint:
        result |= _checkpoint_roundtrip(engine, batch, out_dir)
    return result


def _checkpoint_roundtrip(engine: Any, batch: Mapping[str, torch.Tensor], out_dir: Path) -> dict[str, Any]:
    """save → step → load → step again: the two second steps must agree."""
    path = engine.save(out_dir / "ckpt")
    again = engine.step(ppo_loss, batch, micro_batch_size=2)
    engine.load(path)
    replay = engine.step(ppo_loss, batch, micro_batch_size=2)
    return {"after_save": again, "after_load": replay, "ckpt_files": sorted(p.name for p in path.iterdir())}


def run_alone(target: Callable[..., dict[str, Any]], out_dir: Path, **kwargs: Any) -> dict[str, Any]:
    """Run target(out_dir=..., **kwargs) in one spawned process without a process group (vLLM
    builds its own), so its thread pinning and globals stay out of the test process."""
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_alone_entry, args=(str(out_dir), target, kwargs))
    proc.start()
    proc.join()
    result = torch.load(out_dir / "alone.pt", weights_only=False)
    assert result["ok"], f"child failed:\n{result['error']}"
    return result


def _alone_entry(out_dir: str, target: Callable[..., dict[str, Any]], kwargs: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    try:
        result = {"ok": True, **target(out_dir=Path(out_dir), **kwargs)}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, Path(out_dir) / "alone.pt")


def vllm_rollouts(*, out_dir: Path) -> dict[str, Any]:
    """smollm2-135m: vLLM rollout, one training step, push through the hybrid engine, rollout again."""
    from hfrt.roles.generation.hf import SamplingParams
    from hfrt.roles.generation.hybrid import HybridEngine
    from hfrt.roles.generation.vllm_engine import VLLMConfig, VLLMGenerationEngine
    from hfrt.roles.models import ModelConfig, load_model, load_tokenizer, resolve_model_dir
    from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

    tok = load_tokenizer("smollm2-135m")
    train = build_train_engine(
        load_model(ModelConfig("smollm2-135m")), EngineConfig(backend="local", optim=OptimConfig(lr=1e-3))
    )
    gen = VLLMGenerationEngine(
        VLLMConfig(
            str(resolve_model_dir("smollm2-135m")), dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20
        ),
        pad_token_id=tok.pad_token_id,
    )
    hybrid = HybridEngine(train, gen)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
    params = SamplingParams(temperature=0.8, max_new_tokens=10, n=2, seed=0)

    def rollout() -> tuple[dict[str, torch.Tensor], float, dict[str, float]]:
        out, metrics = hybrid.generate([prompt], params)
        recomputed = train.forward_logprobs(out, temperature=0.8)
        return out, float(((recomputed - out["log_probs"]) * out["response_mask"]).abs().max()), metrics

    first, diff_before, _ = rollout()
    batch = dict(first)
    batch["advantages"] = torch.where(torch.arange(len(first["responses"]))[:, None] == 0, 1.0, -1.0).expand_as(
        first["log_probs"]
    )
    batch["old_log_probs"] = first["log_probs"]
    step = train.step(ppo_loss, batch, micro_batch_size=2, temperature=0.8)
    moved = float(
        ((train.forward_logprobs(first, temperature=0.8) - first["log_probs"]) * first["response_mask"]).abs().max()
    )
    _, diff_after, metrics = rollout()
    return {
        "text": tok.decode(first["responses"][0][first["response_mask"][0].bool()]),
        "diff_before": diff_before,
        "diff_after": diff_after,
        "step": step,
        "metrics": metrics,
        "moved": moved,
    }
