"""Adapter-only weight sync (roles/generation/lora.py): with LoRA on the actor, the built-in
generation engine and a rollout daemon receive only the adapter tensors (bytes counted), checksummed
and versioned like a full sync, and then sample with log-probs equal to the training engine's; a
receiver set up unlike the actor is refused naming options.lora; vLLM on CPU (smollm2-135m,
adapters merged where they arrive) samples what the LoRA training engine recomputes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.flows.batches import prompts_handle
from hfrt.flows.config import CALL_TIMEOUT_S
from hfrt.roles.generation.build import generation_engine
from hfrt.roles.generation.hf import SamplingParams
from hfrt.roles.generation.lora import AdapterHybrid, check_record
from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
from hfrt.roles.training import lora
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
from hfrt.roles.training.lora import LoraSpec
from hfrt.wire.errors import RemoteError
from tests.support import local_cluster, skip_without_vllm

from .dist_workers import make_batch, ppo_loss, run_alone

SPEC = LoraSpec(rank=4, alpha=8.0)
HELPER = f"{Path(__file__).parent / 'daemon_helpers.py'}:AdvantageHelper"
OPTIONS = {"rank": 4, "alpha": 8.0}


def adapter_bytes(engine: Any) -> int:
    return sum(t.numel() * t.element_size() for t in engine.adapter_state_dict().values())


def full_bytes(engine: Any) -> int:
    return sum(t.numel() * t.element_size() for bucket in engine.state_dict_for_generation() for t in bucket.values())


@pytest.mark.slow
def test_the_hybrid_pushes_adapters_only_and_samples_as_training_computes() -> None:
    tok = load_tokenizer("tiny")
    model = load_model(ModelConfig("tiny"))
    train: Any = build_train_engine(model, EngineConfig(backend="local", micro_batch_size=4, optim=OptimConfig(lr=5e-2)), SPEC)
    gen = generation_engine("hf", model="tiny", dtype="float32", seed=0, tokenizer=tok, lora=SPEC)
    hybrid = AdapterHybrid(train, gen)
    params = SamplingParams(temperature=0.9, max_new_tokens=6, n=2, seed=0)
    batch = make_batch(model.config.vocab_size)
    for version in range(2):
        train.step(ppo_loss, batch)  # the adapters move (B starts at 0)
        out, metrics = hybrid.generate([[3, 4, 5], [6, 7]], params)
        assert metrics["reshard/pushed_mb"] * 2**20 == adapter_bytes(train), version
        recomputed = train.forward_logprobs(out, temperature=0.9)
        assert float(((recomputed - out["log_probs"]) * out["response_mask"]).abs().max()) < 1e-5, version
    assert adapter_bytes(train) < 0.2 * full_bytes(train)  # tiny (hidden 64) at rank 4; SmolLM2 at 16: ~3.6 %
    held = gen.local_parameters()  # the adapters by PEFT's saved names, equal to the trained ones
    assert set(held) == {lora.saved_name(n) for n in train.adapter_state_dict()}
    assert all(torch.equal(held[lora.saved_name(n)], t) for n, t in train.adapter_state_dict().items())
    _, again = hybrid.generate([[3, 4]], params)  # no optimizer step since: nothing pushed
    assert again["reshard/push_skipped"] == 1.0 and again["reshard/pushed_mb"] == 0.0


def test_a_receiver_unlike_the_actor_is_refused_naming_options_lora() -> None:
    record = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
    check_record(record, SPEC, "rollout:0")
    check_record(None, None, "rollout:0")
    with pytest.raises(ValueError, match="set this role's options.lora to the actor's"):
        check_record(record, None, "rollout:0")
    with pytest.raises(ValueError, match="holds full weights"):
        check_record(None, SPEC, "rollout:0")
    with pytest.raises(ValueError, match=r"\(rank differ\)"):
        check_record(record | {"rank": 8}, SPEC, "rollout:0")


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_rollout_daemon_loads_adapters_only_and_samples_as_the_actor_computes() -> None:
    train = {"micro_batch_size": 8, "optim": {"lr": 5e-2}}
    daemons = [
        DaemonSpec("helper", impl=HELPER),
        DaemonSpec("actor", impl="actor", options={"model": "tiny", "lora": OPTIONS, "engine": train}),
        DaemonSpec("rollout", impl="rollout", options={"model": "tiny", "lora": OPTIONS}),
        DaemonSpec("plain", impl="rollout", options={"model": "tiny"}),
    ]
    async with local_cluster(daemons) as (ctl, _):
        actor, rollout, plain, helper = [await ctl.role(n) for n in ("actor", "rollout", "plain", "helper")]
        prompts = prompts_handle({"prompt": ["a b c", "d e"]})
        sampled = await actor.generate(prompts, n=2, max_new_tokens=4, temperature=1.0, seed=0, timeout_s=CALL_TIMEOUT_S)
        advantages = await helper.advantages(sampled)  # held by name: a dropped handle may be freed before the actor reads it
        [metrics] = await actor.update(sampled, advantages, timeout_s=CALL_TIMEOUT_S)
        assert metrics["actor/optimizer_steps"] == 1  # the adapters moved off B = 0
        [published] = await actor.publish_weights(1, timeout_s=CALL_TIMEOUT_S)
        assert published["adapter"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
        [loaded] = await rollout.load_weights(published, timeout_s=CALL_TIMEOUT_S)
        assert loaded["version"] == 1 and loaded["held_verified"] == loaded["buckets"] >= 1
        assert loaded["bytes"] == sum(b["nbytes"] for b in published["buckets"])
        assert all(".lora_A." in row[0] or ".lora_B." in row[0] for b in published["buckets"] for row in b["layout"])
        assert ctl.stats()["controller_bulk_bytes"] == 0

        out = await rollout.generate(prompts, n=2, max_new_tokens=6, temperature=0.8, seed=1, timeout_s=CALL_TIMEOUT_S)
        batch = await ctl.fetch(out)
        trained = await ctl.fetch(await actor.compute_log_prob(out, temperature=0.8, timeout_s=CALL_TIMEOUT_S))
        mask = batch["response_mask"].bool()
        assert float((batch["rollout_log_probs"] - trained["old_log_probs"])[mask].abs().max()) < 1e-5
        with pytest.raises(RemoteError, match="set this role's options.lora to the actor's"):
            await plain.load_weights(published, timeout_s=CALL_TIMEOUT_S)


def vllm_adapter_rollouts(*, out_dir: Path) -> dict[str, Any]:
    """smollm2-135m with LoRA rank 16: one training step, adapters pushed into vLLM (merged on the
    receiving side on CPU), a vLLM rollout recomputed by the training engine."""
    from hfrt.roles.models import resolve_model_dir

    spec = LoraSpec(rank=16, alpha=32.0)
    tok = load_tokenizer("smollm2-135m")
    train: Any = build_train_engine(load_model(ModelConfig("smollm2-135m")),
                                    EngineConfig(backend="local", optim=OptimConfig(lr=1e-2)), spec)
    vllm = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 4}
    gen = generation_engine("vllm", model="smollm2-135m", dtype="float32", seed=0, tokenizer=tok, vllm=vllm, lora=spec)
    hybrid = AdapterHybrid(train, gen)
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)["input_ids"])
    params = SamplingParams(temperature=0.8, max_new_tokens=6, n=2, seed=0)
    first, _ = hybrid.generate([prompt], params)
    batch = dict(first) | {"old_log_probs": first["log_probs"]}
    batch["advantages"] = torch.where(torch.arange(2)[:, None] == 0, 1.0, -1.0).expand_as(first["log_probs"])
    train.step(ppo_loss, batch, micro_batch_size=2, temperature=0.8)
    moved = float(((train.forward_logprobs(first, temperature=0.8) - first["log_probs"]) * first["response_mask"]).abs().max())
    out, metrics = hybrid.generate([prompt], params)
    recomputed = train.forward_logprobs(out, temperature=0.8)
    full = sum(t.numel() * t.element_size() for b in train.state_dict_for_generation() for t in b.values())
    gen.close()
    return {"diff": float(((recomputed - out["log_probs"]) * out["response_mask"]).abs().max()),
            "moved": moved, "pushed": metrics["reshard/pushed_mb"] * 2**20, "adapter": adapter_bytes(train), "full": full,
            "model_dir": str(resolve_model_dir("smollm2-135m"))}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_vllm_samples_through_pushed_adapters(tmp_path: Path) -> None:
    skip_without_vllm("vLLM LoRA test")
    result = run_alone(vllm_adapter_rollouts, tmp_path)
    print({k: v for k, v in result.items() if k != "ok"})
    assert result["pushed"] == result["adapter"] < 0.05 * result["full"]  # rank 16, all-linear: ~3.6 %
    assert result["diff"] < 2e-3  # vLLM's fp32 CPU kernels (adapters merged on CPU) vs transformers + peft
    assert result["moved"] > 2e-2  # ... and the step did change the policy, so the push mattered
