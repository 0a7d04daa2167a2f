"""The actor's shortcuts give what the long way gives: an on-policy update without an
old-log-prob pass, and log-probs from logits made only at response positions."""

from __future__ import annotations

import pytest
import torch

from hfrt.roles.actor import actor_loss
from hfrt.roles.models import ModelConfig, load_model
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
from hfrt.roles.training.engines.base import token_log_probs
from hfrt.roles.training.updates import require_one_step, run_updates
from hfrt.wire.loss_options import ActorLoss, UpdateSchedule

from .dist_workers import make_batch


def update(with_old: bool, schedule: UpdateSchedule = UpdateSchedule()) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One actor update on the tiny preset, with old log-probs from a forward pass or without."""
    model = load_model(ModelConfig("tiny"))
    engine = build_train_engine(model, EngineConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-2)))
    batch = make_batch(model.config.vocab_size)
    if with_old:
        batch["old_log_probs"] = engine.forward(batch).log_probs * batch["response_mask"]
    else:
        del batch["old_log_probs"]
    metrics = run_updates(engine, batch, actor_loss(ActorLoss(entropy_coeff=0.01)), schedule,
                          prefix="actor", endpoint="actor.update", with_entropy=True)
    metrics.pop("timing/update_actor_s")
    return metrics, {k: v.detach().clone() for k, v in model.named_parameters()}


def test_on_policy_update_without_old_log_probs_equals_the_update_with_them() -> None:
    with_old, params_old = update(True)
    without, params_new = update(False)
    assert with_old.keys() == without.keys()
    for key, value in with_old.items():
        assert without[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, param in params_old.items():
        assert torch.allclose(params_new[name], param, atol=1e-6), name


@pytest.mark.parametrize("schedule", [UpdateSchedule(ppo_epochs=2), UpdateSchedule(ppo_mini_batch_size=4)])
def test_an_update_of_more_than_one_step_needs_old_log_probs(schedule: UpdateSchedule) -> None:
    with pytest.raises(ValueError, match="actor.update: no old_log_probs column.*one optimizer step"):
        require_one_step(schedule, 8, "actor.update")
    require_one_step(UpdateSchedule(ppo_mini_batch_size=8), 8, "actor.update")  # one mini-batch: fine


def test_log_probs_from_response_positions_only_equal_the_full_logits() -> None:
    model = load_model(ModelConfig("tiny")).eval()
    engine = build_train_engine(model, EngineConfig(micro_batch_size=3, trainable=False))
    batch = make_batch(model.config.vocab_size, seed=3)
    out = engine.forward(batch, temperature=0.7, with_entropy=True)
    with torch.no_grad():  # the long way: every position's logits, the response ones cut out after
        width = batch["responses"].shape[1]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -width - 1 : -1] / 0.7
    assert out.log_probs is not None and out.entropy is not None
    assert torch.allclose(out.log_probs, token_log_probs(logits, batch["responses"]), atol=1e-5)
    probs = torch.softmax(logits, -1)
    assert torch.allclose(out.entropy, -(probs * torch.log_softmax(logits, -1)).sum(-1), atol=1e-4)
