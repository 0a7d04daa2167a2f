"""The TP × PP × DP training engine on torch's own parallelism (DTensor TP from each model's
transformers plan, torch.distributed.pipelining, FSDP2, DCP) against one process: every model
family at t2p1d1, t1p2d1, t1p1d2, t2p2d1 and t2p1d2 — log-probs, entropy and Σπ², loss, gradients
and weights after one PPO update — the interleaved 1F1B schedule (2 stages per pipeline rank) at
t1p2d1 for three families and at t2p2d1 / t1p2d2 (FSDP) for some, plus checkpoints moved across
layouts (through an interleaved layout too) and the refusals before launch.

Two spawns (2 and 4 real ranks, gloo) run every rank-side case; the tests read their results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
from hfrt.roles.training.parallel import pipeline, tp_plan

from . import model_zoo
from .dist_workers import make_batch, ppo_loss, run_ranks
from .mesh_workers import across_layouts, case_name, zoo

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

WORLD2 = [(2, 1), (1, 2), (1, 1)]  # t2p1d1, t1p2d1, t1p1d2
WORLD4 = [(2, 2), (2, 1)]  # t2p2d1, t2p1d2 (mixed: tp and dp)
IL = "interleaved-1f1b"  # 4 stages of one decoder layer each: stages 0, 2 on pp rank 0, 1, 3 on rank 1
#: the interleaved schedule splits decoder layers, which every family has alike: a plain family, the
#: fused projections and the MoE cover it (every family runs 1F1B at t1p2d1 above; keeps CI time down)
IL_FAMILIES = ("llama", "phi3", "qwen3_moe")
CASES = {2: [(f, tp, pp, False, "1f1b") for f in model_zoo.FAMILIES for tp, pp in WORLD2]
            + [(f, 1, 2, False, IL) for f in IL_FAMILIES]
            + [("llama", 2, 1, False, "1f1b", "lp"), ("qwen3", 2, 1, False, "1f1b", "lp")]
            + [("qwen3", 1, 2, False, "1f1b", "bf16"), ("qwen3", 1, 2, False, IL, "bf16")],
         4: [(f, tp, pp, False, "1f1b") for f in model_zoo.FAMILIES for tp, pp in WORLD4]
            + [("llama", 2, 2, True, "1f1b"), ("critic-qwen3", 2, 2, False, "1f1b"), ("critic-qwen3", 1, 2, False, "1f1b")]
            + [("qwen3", 2, 2, False, IL), ("qwen3_moe", 2, 2, False, IL), ("llama", 2, 2, True, IL),
               ("llama", 1, 2, False, IL), ("critic-qwen3", 1, 2, False, IL)]
            + [("qwen3", 2, 2, False, "1f1b", "lp"), ("llama", 2, 1, False, "1f1b", "lp")]
            + [("llama", 2, 1, False, "1f1b", "sp"), ("qwen3", 2, 2, False, IL, "sp"), ("llama", 2, 2, True, "1f1b", "sp")]}  # fmt: skip
#: interleaved training → generation (one stage): the two stages' ranks of one tp rank form a micro-DP group
RESHARD = [("t2p2d1v2", "t2p1d2")]
#: fp32 sums of a few hundred terms in another order: 1e-5 relative to the tensor's scale. AdamW
#: runs with eps=1e-3 so that its first step is a smooth function of the gradient (with the usual
#: 1e-8 it is lr·sign(grad), which flips on gradients that are zero up to rounding)
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    return {world: run_ranks(zoo, world, tmp_path_factory.mktemp(f"zoo{world}"), cases=cases,
                             reshard=RESHARD if world == 4 else None)
            for world, cases in CASES.items()}  # fmt: skip


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, bool], dict[str, Any]]:
    out = {}
    for family, tied in {(c[0], c[3]) for cases in CASES.values() for c in cases}:
        value = family.startswith("critic-")
        base = family.removeprefix("critic-")
        model = model_zoo.value_model(base) if value else model_zoo.model(family, tied=tied)
        engine = build_train_engine(model, EngineConfig(backend="local", micro_batch_size=2, optim=OptimConfig(lr=1e-2, eps=1e-3)))
        batch = make_batch(128)
        log_probs = engine.forward_values(batch) if value else engine.forward_logprobs(batch)
        both = None if value else engine.forward(batch, with_entropy=True, with_sum_pi_squared=True)
        entropy, sum_pi_squared = (None, None) if both is None else (both.entropy, both.sum_pi_squared)
        metrics = engine.step(model_zoo.value_loss_fn if value else ppo_loss, batch, micro_batch_size=2)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[(family, tied)] = {"log_probs": log_probs, "entropy": entropy, "sum_pi_squared": sum_pi_squared, "metrics": metrics,
                               "grads": grads, "weights": weights}  # fmt: skip
    return out


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-3)) for k in a)


@pytest.mark.parametrize("case", [c for cases in CASES.values() for c in cases], ids=lambda c: case_name(*c))
def test_one_update_equals_one_process(
    ranks: dict[int, list[dict[str, Any]]], references: dict[tuple[str, bool], dict[str, Any]], case: tuple[Any, ...]
) -> None:
    family, tp, pp, tied = case[:4]
    loss_parallel = case[5:] == ("lp",)
    if case[5:] == ("bf16",):  # torch infers the stages' shapes, probing the loss once: not counted
        for res in (r[case_name(*case)] for r in ranks[2]):
            for name in ("loss", "grad_norm"):
                assert res["metrics"][name] == pytest.approx(references[(family, tied)]["metrics"][name], rel=2e-2), name
        return
    world = next(w for w, cases in CASES.items() if case in cases)
    key = case_name(*case)
    ref = references[(family, tied)]
    results = [r[key] for r in ranks[world]]
    dp = world // (tp * pp)
    per = 8 // dp
    mask = make_batch(128)["response_mask"]  # outside it engines may leave zeros (trimmed micro-batches)
    for rank, res in enumerate(results):
        t, p, d = res["coords"]
        assert (p * dp + d) * tp + t == rank  # tp innermost, then dp, then pp
        rows = slice(d * per, (d + 1) * per)
        diff = (res["log_probs"] - ref["log_probs"][rows]) * mask[rows]
        assert float(diff.abs().max()) < TOL, (rank, "log-probs")
        for name in ("entropy", "sum_pi_squared") if ref["entropy"] is not None else ():
            assert float(((res[name] - ref[name][rows]) * mask[rows]).abs().max()) < TOL, (rank, name)
        if loss_parallel:  # the [tokens, vocabulary] logits were never gathered; without it the head gathers them
            assert res["gathers"] == 0, (rank, res["gathers"])
        elif tp > 1 and pp == 1 and not tied:
            assert res["gathers"] > 0, (rank, "the gathered head's all-gather was not seen")
        for name in ("loss", "grad_norm"):
            assert res["metrics"][name] == pytest.approx(ref["metrics"][name], rel=TOL, abs=1e-7), (rank, name)
    if results[0]["grads"] is not None:
        assert _diff(results[0]["grads"], ref["grads"]) < TOL
    assert _diff(results[0]["weights"], ref["weights"]) < TOL


def test_checkpoint_loads_at_any_layout(tmp_path: Path) -> None:
    """Saved at t2p1d2, resumed at t1p2d2 interleaved (two stages per pipeline rank), then t2p2d1
    (1F1B), then t1p1d4: weights equal after every load and the run continues as the
    uninterrupted one does (each step's loss, the final weights)."""
    layouts: list[tuple[Any, ...]] = [(2, 1), (1, 2, IL), (2, 2), (1, 1)]
    results = run_ranks(across_layouts, 4, tmp_path, family="qwen3", layouts=layouts)
    for res in results:
        assert all(d < 1e-6 for d in res["loaded_diff"]), res["loaded_diff"]
        assert res["losses"] == pytest.approx(res["ref_losses"], rel=1e-5)
        assert res["final_diff"] < 1e-5
    assert "dcp" in results[0]["files"] and "hfrt_engine.json" in results[0]["files"]


def test_bad_layouts_are_refused_naming_the_numbers() -> None:
    qwen3 = model_zoo.config("qwen3")
    with pytest.raises(tp_plan.PlanError, match="tp=4 does not divide the model's 2 key/value heads"):
        tp_plan.check_tp(qwen3, 4)
    with pytest.raises(tp_plan.PlanError, match="tp=3 does not divide the model's 4 attention heads"):
        tp_plan.check_tp(qwen3, 3)
    with pytest.raises(ValueError, match="pp=5 must be between 1 and the model's 4 layers"):
        pipeline.check_pp(qwen3, 5)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'; use one of gpipe, 1f1b, interleaved-1f1b"):
        pipeline.check_schedule("zb")
    with pytest.raises(ValueError, match=r"pp=2 × 3 stages per rank = 6 stages, more than the model's 4 decoder layers"):
        pipeline.check_pp(qwen3, 2, virtual=pipeline.stages_per_rank(IL, 3, 2))
    with pytest.raises(ValueError, match="pp_stages_per_rank=2 needs an interleaved schedule"):
        pipeline.stages_per_rank("1f1b", 2, 2)
    with pytest.raises(ValueError, match="needs pp_stages_per_rank >= 2"):
        pipeline.stages_per_rank(IL, 1, 2)
    assert pipeline.stages_per_rank(IL, 0, 2) == 2 and pipeline.stages_per_rank(IL, 0, 1) == 1
    with pytest.raises(ValueError, match="interleaved-1f1b needs a multiple of pp=2 micro-batches, got 3"):
        pipeline.check_micro_batches(IL, 3, 2)
    # the engine cuts rows into a multiple of pp micro-batches when interleaved (short ones padded)
    assert pipeline.micro_batch_count(6, 2, 2, IL) == 4 and pipeline.micro_batch_count(6, 2, 2, "1f1b") == 3


def test_loss_parallel_is_refused_where_it_cannot_apply() -> None:
    llama = model_zoo.config("llama")  # vocabulary 128
    with pytest.raises(tp_plan.PlanError, match="loss_parallel needs tp > 1"):
        tp_plan.check_loss_parallel(llama, 1)
    with pytest.raises(tp_plan.PlanError, match="tp=3 does not divide 128"):
        tp_plan.check_loss_parallel(llama, 3)
    with pytest.raises(tp_plan.PlanError, match="needs an untied head"):
        tp_plan.check_loss_parallel(model_zoo.config("llama", tied=True), 2)
    tp_plan.check_loss_parallel(llama, 2)
    plan = tp_plan.resolve_plan(model_zoo.model("llama"), 2, loss_parallel=True)
    assert plan["lm_head"] == tp_plan.LOSS_PARALLEL_HEAD and tp_plan.resolve_plan(model_zoo.model("llama"), 2)["lm_head"] != plan["lm_head"]


def test_a_model_without_a_tp_plan_is_refused_saying_what_to_add() -> None:
    config = model_zoo.config("llama")
    config.base_model_tp_plan = None
    with pytest.raises(tp_plan.PlanError, match="has no tensor-parallel plan.*options.parallel.tp_plan"):
        tp_plan.check_tp(config, 2)


def test_uneven_vocabulary_keeps_embedding_and_head_replicated() -> None:
    model = model_zoo.model("llama")
    plan = tp_plan.resolve_plan(model, 3)
    assert "lm_head" not in plan and "model.embed_tokens" not in plan
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert tp_plan.chunk_bounds(10, 4, 3) == (9, 10) and tp_plan.chunk_bounds(259, 2, 1) == (130, 259)


def test_interleaved_stage_rule_and_generation_reshard(ranks: dict[int, list[dict[str, Any]]]) -> None:
    """With 2 stages per pipeline rank, rank 0 holds layers 0 and 2 (and the embedding), rank 1
    layers 1 and 3 (and the norm and head): the stage rule says so, the engine holds exactly those
    pieces, and the actor's reshard to a generation layout (one stage) gets the exact slices."""
    from hfrt.roles.training.parallel.stages import stage_of

    assert [stage_of(f"model.layers.{i}.mlp.up_proj.weight", 4, 2, 2) for i in range(4)] == [{0}, {1}, {0}, {1}]
    assert stage_of("model.embed_tokens.weight", 4, 2, 2) == {0} and stage_of("lm_head.weight", 4, 2, 2) == {1}
    for rank, res in enumerate(ranks[4]):
        for pair in (f"{a}->{b}" for a, b in RESHARD):
            r = res["reshard"][pair]
            assert r["train_names"] and r["train_equal"], (rank, pair, "training pieces")
            assert r["gen_names"] and r["gen_equal"], (rank, pair, "generation pieces")
            assert r["bytes_received"] > 0, (rank, pair)
