"""Routing replay on tiny random MoE models: replaying a model's own routing changes nothing
(1e-6), forcing other experts changes the outputs and counts as mismatch, the gate still gets its
gradient, the HF engine's record matches a plain forward, micro-batches carry the column, and
models without a supported router are refused by name."""

from __future__ import annotations

import pytest
import torch

from hfrt.roles.generation.hf import HFGenerationEngine, SamplingParams
from hfrt.roles.generation.routing_record import Recorder, fit
from hfrt.roles.training import batching, router_replay
from hfrt.roles.training.engines import EngineConfig, build_train_engine
from hfrt.roles.training.engines.model_pass import position_ids_from_mask
from hfrt.roles.training.router_replay import ROUTED_EXPERTS, RouterReplay, feeding
from tests.roles import model_zoo


def _inputs(rows: int = 3, width: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (rows, width), generator=g)
    return ids, torch.ones_like(ids)


def _complement(routed: torch.Tensor, experts: int = 4) -> torch.Tensor:
    """The k experts a token was *not* routed to (k = experts / 2), in the same layout."""
    used = torch.nn.functional.one_hot(routed.long(), experts).sum(-2).bool()  # [..., experts]
    order = torch.arange(experts).expand_as(used)
    return order[~used].reshape(routed.shape).to(routed.dtype)


def _own_routing(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[rows, T, layers, k] of the model's own top-k on a full forward (a Recorder over one call)."""
    rec = Recorder(model)
    with rec.recording(), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    return rec.routed(ids.shape[0], mask)


def _moe(family: str) -> torch.nn.Module:
    """A tiny random causal LM of a family whose router SUPPORTED lists (2 layers, 4 experts, k=2)."""
    import transformers as tf

    if family == "qwen3_moe":
        return model_zoo.model(family, layers=2)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    config = (tf.Qwen2MoeConfig(**common, moe_intermediate_size=32, shared_expert_intermediate_size=32)
              if family == "qwen2_moe" else tf.OlmoeConfig(**common))
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe"])
def test_replaying_own_routing_is_the_plain_forward(family: str) -> None:
    model = _moe(family).eval()
    ids, mask = _inputs()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
    routed = _own_routing(model, ids, mask)
    assert routed.dtype == torch.uint8 and routed.shape == (3, 10, 2, 2)  # 4 experts, k=2, 2 layers: 4 bytes a token
    # Qwen3-30B-A3B (128 experts, 8 per token, 48 layers): 1 byte an id, 384 bytes a token; DeepSeek-V3's 256: 2 bytes
    assert router_replay.column_dtype(128) == torch.uint8 and router_replay.column_dtype(256) == torch.int16
    replay = RouterReplay(model, replay=True)
    with feeding(routed), torch.no_grad():
        replayed = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(replayed, plain, atol=1e-6, rtol=0)
    assert replay.metrics() == {"router_mismatch/share": 0.0, "router_mismatch/own_share": 0.0, "router_mismatch/routings": 60.0}


def test_forcing_other_experts_changes_outputs_and_counts_mismatch() -> None:
    model = model_zoo.model("qwen3_moe", layers=2).eval()
    ids, mask = _inputs()
    routed = _own_routing(model, ids, mask)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
    other = _complement(routed)
    replay = RouterReplay(model, replay=True)
    with feeding(other), torch.no_grad():
        forced = model(input_ids=ids, attention_mask=mask).logits
    assert (forced - plain).abs().max() > 1e-3
    metrics = replay.metrics()
    assert metrics["router_mismatch/share"] == 0.0  # the forward used the forced experts everywhere
    assert metrics["router_mismatch/own_share"] > 0.5  # layer 0's own choice all differs; a later layer's may match
    replay.remove()
    measure = RouterReplay(model, replay=False)  # measuring only: outputs unchanged
    with feeding(other), torch.no_grad():
        again = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(again, plain, atol=0, rtol=0)
    measured = measure.metrics()  # measuring: the used routing is the own one, all of it elsewhere
    assert measured["router_mismatch/share"] == measured["router_mismatch/own_share"] == 1.0


def test_unrecorded_positions_keep_own_routing() -> None:
    model = model_zoo.model("qwen3_moe", layers=2).eval()
    ids, mask = _inputs()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
    nothing = torch.full((3, 10, 2, 2), router_replay.not_recorded(torch.uint8), dtype=torch.uint8)
    replay = RouterReplay(model, replay=True)
    with feeding(nothing), torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=0)
    assert replay.metrics() == {}


def test_gate_gets_gradient_through_replayed_weights() -> None:
    model = model_zoo.model("qwen3_moe", layers=2).train()
    ids, mask = _inputs()
    routed = _own_routing(model, ids, mask)
    other = _complement(routed)
    RouterReplay(model, replay=True)
    with feeding(other):
        loss = model(input_ids=ids, attention_mask=mask).logits.square().mean()
    loss.backward()
    gates = router_replay.routers(model)
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in gates)


def test_generation_record_equals_a_plain_forward_of_the_rollout() -> None:
    """The HF engine's routing of each sampled token equals a full forward's over the finished
    rollout (the KV cache routes each position as the full pass does); the last token is unrecorded."""
    model = model_zoo.model("qwen3_moe", layers=2).eval()
    engine = HFGenerationEngine(model, pad_token_id=0, eos_token_id=None, share_weights=True)
    engine.recorder = Recorder(model)
    out = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=4, seed=3))
    routed = out[ROUTED_EXPERTS]
    assert routed.shape == (2, 3 + 4, 2, 2)
    full = _own_routing(model, out["input_ids"], out["attention_mask"])
    seen = routed != 255
    assert not seen[:, -1].any() and not seen[1, 0].any()  # the last sampled token, the left padding
    assert torch.equal(routed[seen], full[seen])
    wide = fit(routed, 3, 5, 6)
    assert wide.shape == (2, 11, 2, 2) and torch.equal(wide[:, 2:9], routed) and (wide[:, :2] == 255).all()


@pytest.mark.parametrize("pack", [False, True])
def test_engine_forward_replays_through_micro_batches(pack: bool) -> None:
    """The local engine's forward (trimmed or packed micro-batches) cuts the column as input_ids:
    replaying the model's own routing gives its plain log-probs and no mismatch."""
    model = model_zoo.model("qwen3_moe", layers=2)
    engine = build_train_engine(model, EngineConfig(micro_batch_size=2, pack=pack, trainable=False))
    ids, mask = _inputs(rows=4, width=12)
    mask[0, :3] = 0  # left padding on one row
    mask[1, -2:] = 0  # a shorter response
    batch = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, -5:], "response_mask": mask[:, -5:]}
    plain = engine.forward(batch).log_probs
    replay = RouterReplay(model, replay=True)
    assert batching.row_lengths(batch).prompt[0] == 4
    rec = Recorder(model)
    with rec.recording(), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    routed = rec.routed(4, mask)  # padding positions: not recorded
    replay.counts()  # clear
    out = engine.forward(batch | {ROUTED_EXPERTS: routed}).log_probs
    assert out is not None and plain is not None
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=0)
    metrics = replay.metrics()
    assert metrics["router_mismatch/share"] == 0.0 and metrics["router_mismatch/routings"] > 0


def test_unsupported_moe_block_is_refused_by_name() -> None:
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="MixtralSparseMoeBlock"):
        RouterReplay(tf.MixtralForCausalLM(cfg), replay=True)
    with pytest.raises(ValueError, match="has no MoE blocks"):
        RouterReplay(model_zoo.model("qwen3", layers=1), replay=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replay_on_fsdp2_and_tp_engines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two gloo ranks: FSDP2 at dp=2 and the TP engine at tp=2 replay a tiny Qwen3-MoE's own routing
    to its plain log-probs (1e-5), change them with other experts forced, and give every router a
    gradient in an update with replay."""
    from tests.roles.dist_workers import run_ranks
    from tests.roles.replay_workers import replay_on_engines

    for rank in run_ranks(replay_on_engines, 2, tmp_path):
        for name in ("fsdp2_d2", "tp_t2"):
            got = rank[name]
            assert got["same_diff"] < 1e-5 and got["same_share"] == 0.0, (name, got)
            assert got["forced_diff"] > 1e-3 and got["forced_share"] > 0.5 and got["forced_used"] == 0.0, (name, got)
            assert got["gate_grads"] == 2 and got["gate_grad_abs"] > 0, (name, got)


def test_refused_before_launch_with_the_reason() -> None:
    """The actor's and rollout's check_config (run before anything starts) refuse router_replay
    with vLLM (why: no routed experts on this build), a model without MoE blocks, pipeline stages,
    and a value that is not a boolean."""
    from hfrt.daemon.base import DaemonContext
    from hfrt.roles.actor import ActorDaemon
    from hfrt.roles.rollout import RolloutDaemon

    def actor(world: int = 1, **options: object) -> None:
        ActorDaemon.check_config(DaemonContext("actor", 0, world, options=dict(options)))

    actor(model="tiny-moe", router_replay=True)
    actor(model="tiny-moe", router_replay=False, parallel={"tp": 2}, world=2)
    with pytest.raises(ValueError, match=r"roles.actor.options.router_replay with generator = \"vllm\": .*Triton"):
        actor(model="tiny-moe", router_replay=True, generator="vllm")
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MoE blocks"):
        actor(model="tiny", router_replay=True)
    with pytest.raises(ValueError, match=r"not with pipeline stages \(pp=2\)"):
        actor(model="tiny-moe", router_replay=True, parallel={"pp": 2}, world=2)
    with pytest.raises(ValueError, match="expected true or false"):
        actor(model="tiny-moe", router_replay="yes")
    with pytest.raises(ValueError, match="has no MoE blocks"):
        RolloutDaemon.check_config(DaemonContext("rollout", 0, 1, options={"model": "tiny", "router_replay": False}))


def test_rows_sharing_a_prompt_replay_whole() -> None:
    """GRPO's n samples share their prompt, which the engine would run once (shared_prefix, on by
    default); with a recorded routing the rows run whole, so every position is replayed."""
    model = model_zoo.model("qwen3_moe", layers=2)
    engine = build_train_engine(model, EngineConfig(micro_batch_size=4, trainable=False))
    prompt = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2)).expand(4, 40)
    ids = torch.cat([prompt, torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(3))], dim=1)
    mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, -6:], "response_mask": mask[:, -6:]}
    plain = engine.forward(batch).log_probs
    assert engine.sharing.tokens[0] < engine.sharing.tokens[1]  # without a record the prompt ran once
    replay = RouterReplay(model, replay=True)
    out = engine.forward(batch | {ROUTED_EXPERTS: _complement(_own_routing(model, ids, mask))}).log_probs
    assert out is not None and plain is not None and (out - plain).abs().max() > 1e-3
    metrics = replay.metrics()
    assert metrics["router_mismatch/routings"] == 4 * 46 * 2 and metrics["router_mismatch/share"] == 0.0
