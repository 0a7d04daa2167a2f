"""LoRA end to end on real daemons (tiny preset, CPU): the LoRA actor's reference log-probs equal
a separate reference daemon's, its export loads in transformers (merged) and peft (adapter folder)
with the actor's log-probs; GRPO and PPO (LoRA critic + trained value head) run with no reference
daemon; grpo_async and agent_calc sync only the adapters to their rollout daemon; bad LoRA settings
are refused before any daemon starts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hfrt.deploy.launchers.base import DaemonSpec
from tests.roles.daemon_helpers import prompt_handle
from tests.support import local_cluster

HELPER = f"{Path(__file__).parents[1] / 'roles' / 'daemon_helpers.py'}:AdvantageHelper"
LORA = {"rank": 4, "alpha": 8}
TRAIN = {"micro_batch_size": 4, "optim": {"lr": 5e-2}}


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


def log_probs(model: Any, rollout: dict[str, torch.Tensor]) -> torch.Tensor:
    from hfrt.roles.training.engines import EngineConfig, build_train_engine

    engine = build_train_engine(model, EngineConfig(backend="local", trainable=False))
    return engine.forward_logprobs(rollout, temperature=0.8)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_reference_from_actor_equals_a_reference_daemon_and_export_loads(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    specs = [
        DaemonSpec("actor", impl="actor", options={"engine": TRAIN, "lora": LORA,
                                                   "sampling": {"max_new_tokens": 6, "temperature": 0.8}}),
        DaemonSpec("reference", impl="reference"),
        DaemonSpec("helper", impl=HELPER),
    ]
    async with local_cluster(specs) as (ctl, _):
        actor, reference, helper = await asyncio.gather(*(ctl.role(n, timeout_s=180) for n in ("actor", "reference", "helper")))
        rollout = await actor.generate(prompt_handle(["1+1=", "the cat sat", "3*3="]), n=2, seed=1)
        advantages = await helper.advantages(rollout)  # (the handle kept alive until the update has read it)
        await actor.update(rollout, advantages)  # the adapters move off zero
        ours, theirs, policy = await asyncio.gather(
            actor.compute_ref_log_prob(rollout), reference.compute_log_prob(rollout), actor.compute_log_prob(rollout))
        await actor.export_hf(str(tmp_path / "hf"))
        ours, theirs, policy, batch = await asyncio.gather(
            ctl.fetch(ours), ctl.fetch(theirs), ctl.fetch(policy), ctl.fetch(rollout))
    mask = batch["response_mask"]
    assert masked_max(ours["ref_log_prob"], theirs["ref_log_prob"], mask) <= 1e-6
    assert masked_max(policy["old_log_probs"], theirs["ref_log_prob"], mask) > 1e-4  # the policy did change
    # the merged folder (transformers) and the adapter folder on the base (peft): the actor's policy
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert masked_max(log_probs(merged, batch), policy["old_log_probs"], mask) < 1e-5
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "hf" / "adapter"))
    assert masked_max(log_probs(adapted, batch), policy["old_log_probs"], mask) < 1e-5


def controller(run_dir: Path, flow: str, *sets: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", flow, "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("flow", ["grpo", "ppo"])
def test_flows_train_lora_without_a_reference_daemon(flow: str, tmp_path: Path) -> None:
    sets = ["steps=2", "checkpoint_every=2", "roles.actor.options.lora.rank=4"]
    if flow == "ppo":
        sets.append("roles.critic.options.lora.rank=4")
    out = controller(tmp_path / "run", flow, *sets)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "kl/mean" in records[-1] and "timing/ref_log_prob_s" in records[-1]
    if flow == "ppo":
        assert "critic/loss" in records[-1]
    logs = tmp_path / "run" / "logs"
    assert not any("reference" in p.name for p in logs.iterdir()), sorted(p.name for p in logs.iterdir())
    # checkpoints hold adapters (+ a value head) and optimizer state only: small next to the model
    ckpts = sorted((tmp_path / "run").glob("checkpoints/*/actor/local.pt"))
    assert ckpts, sorted(str(p) for p in (tmp_path / "run").rglob("*.pt"))
    saved = torch.load(ckpts[-1], weights_only=True)
    assert saved["model"] and all(".lora_" in name for name in saved["model"])
    assert (tmp_path / "run" / "hf" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("flow", ["grpo_async", "agent_calc"])
def test_rollout_flows_sync_only_the_adapters(flow: str, tmp_path: Path) -> None:
    """The flows with a rollout role (its own lora table, or the actor's when it sets none): every weight sync
    carries exactly the adapter bytes the checkpoint holds, and no reference daemon runs."""
    own = ["roles.rollout.options.lora.rank=4"] if flow == "grpo_async" else []  # agent_calc's rollout gets the actor's
    out = controller(tmp_path / "run", flow, "steps=2", "checkpoint_every=2", "roles.actor.options.lora.rank=4", *own)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(out.stdout)["steps"] == 2
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    assert "rollout-0.log" in logs and not any("reference" in name for name in logs), logs
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    saved = torch.load(sorted((tmp_path / "run").glob("checkpoints/*/actor/local.pt"))[-1], weights_only=True)
    adapter_bytes = sum(t.numel() * t.element_size() for t in saved["model"].values())
    assert saved["model"] and all(".lora_" in name for name in saved["model"])
    assert all(r["sync/bytes"] == adapter_bytes for r in records), [r["sync/bytes"] for r in records]
    assert "kl/mean" in records[-1]  # the reference log-probs came from the actor (adapters off)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bad_lora_settings_are_refused_before_launch(tmp_path: Path) -> None:
    out = controller(tmp_path / "run", "grpo", "roles.actor.options.lora.rank=4",
                     "roles.actor.options.lora.target_modules=[\"qkv_proj\"]", timeout=120)
    assert out.returncode != 0
    assert "roles.actor: options.lora.target_modules=['qkv_proj'] matches no module" in out.stderr
    assert "'q_proj'" in out.stderr and "'down_proj'" in out.stderr  # the modules the model has
    assert not (tmp_path / "run" / "logs").exists()  # no daemon was started
    from hfrt.roles.check import problems

    found = problems({
        "critic": {"options": {"lora": {"rank": 0}}},
        "actor": {"options": {"lora": {"rank": 4}, "engine": {"backend": "tp"}}},
    })
    assert found[0] == "roles.critic: options.lora.rank must be an integer > 0, got 0"
    assert found[1].startswith("roles.actor: options.lora: LoRA adapters train on the local, fsdp2, deepspeed backends")
