"""Tensor/pipeline-parallel tiny model and the TP × DP engine: 4 real ranks (spawned, gloo)
against the single-process model — logits, log-probs, greedy generation, a PPO step, checkpoints.

One spawn runs every rank-side check (tp_workers.everything); the tests read its results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hfrt.roles.models import ModelConfig, ModelLoadError, load_model, resolve_model_dir
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

from .dist_workers import make_batch, ppo_loss, run_ranks
from .tp_workers import TRAIN_LAYOUTS, everything, forward_layouts, tied_tiny

LAYOUTS = [(2, 1), (4, 1), (1, 2), (2, 2)]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(everything, 4, tmp_path_factory.mktemp("tp"), layouts=LAYOUTS)


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_forward_equals_single_process(ranks: list[dict[str, Any]], tp: int, pp: int) -> None:
    results = [r["forward"][f"t{tp}p{pp}"] for r in ranks]
    for rank, res in enumerate(results):
        assert res["logits_diff"] < 1e-5, (rank, res["logits_diff"])
        assert res["empty_logits_diff"] < 1e-5, (rank, res["empty_logits_diff"])
        assert res["logprob_diff"] < 1e-5, (rank, res["logprob_diff"])
    coords = [r["coords"] for r in results]  # rank = (pp_rank * dp + dp_rank) * tp + tp_rank
    dp = 4 // (tp * pp)
    assert all(((p * dp + d) * tp + t) == rank for rank, (t, p, d) in enumerate(coords))
    if tp == 4:  # 2 kv heads over 4 ranks: each rank holds one (replicated) kv head of 16 rows
        pieces = results[3]["pieces"]
        assert pieces["model.layers.0.self_attn.k_proj.weight"] == (16, 64)
        assert pieces["model.layers.0.self_attn.q_proj.weight"] == (16, 64)
        assert pieces["model.layers.0.self_attn.o_proj.weight"] == (64, 16)
        assert pieces["model.embed_tokens.weight"] == (64, 64)  # 259 = 65 + 3 × 64
        assert results[0]["pieces"]["lm_head.weight"] == (65, 64)
    if pp == 2:  # stage 0 holds layer 0 and the embedding, stage 1 layer 1, norm and head
        first, last = results[0]["pieces"], results[-1]["pieces"]
        assert any(n.startswith("model.layers.0.") for n in first) and not any("layers.1." in n for n in first)
        assert "lm_head.weight" in last and "model.embed_tokens.weight" not in last


def test_tp_groups_in_any_rank_order(ranks: list[dict[str, Any]]) -> None:
    """tp ranks follow the order given (tp_ranks), not the group's ascending global ranks."""
    assert [r["strided"]["t4_0213"]["tp_rank"] for r in ranks] == [0, 2, 1, 3]
    assert [r["strided"]["t2_reversed"]["tp_rank"] for r in ranks] == [1, 1, 0, 0]
    for res in ranks:
        assert res["strided"]["t4_0213"]["diff"] < 1e-5
        assert res["strided"]["t2_reversed"]["diff"] < 1e-5


def test_greedy_generation_over_tp2_is_token_identical(ranks: list[dict[str, Any]]) -> None:
    for res in (r["greedy"] for r in ranks):
        assert res["tokens_equal"], res["tokens"]
        assert res["logprob_diff"] < 1e-5
    assert len({str(r["greedy"]["tokens"]) for r in ranks}) == 1


def _reference(model: torch.nn.Module) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    engine = build_train_engine(model, EngineConfig(backend="local", micro_batch_size=2, optim=OptimConfig(lr=1e-2)))
    metrics = engine.step(ppo_loss, make_batch(model.config.vocab_size), micro_batch_size=2)
    return metrics, {k: v.detach().clone() for k, v in model.named_parameters()}


def test_critic_values_over_tp4(ranks: list[dict[str, Any]]) -> None:
    for res in (r["critic"] for r in ranks):
        assert res["values_diff"] < 1e-5


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    return _reference(load_model(ModelConfig("tiny")))


@pytest.mark.parametrize(("tp", "pp"), TRAIN_LAYOUTS)
def test_ppo_step_matches_one_process(ranks: list[dict[str, Any]], reference: tuple, tp: int, pp: int) -> None:
    """tp2×dp2 (FSDP2 over dp), tp4 (replicated kv heads), pp2×dp2, tp2×pp2 against the local
    engine on the whole batch: loss, grad norm, updated weights; checkpoint round trip."""
    _check_step([r["train"][f"t{tp}p{pp}"] for r in ranks], reference, tp, pp)


def test_ppo_step_tied_embeddings_over_two_stages(ranks: list[dict[str, Any]]) -> None:
    """tp2×pp2 with the head tied to the embedding: stage 0 and stage 1 each hold a copy, their
    gradients are summed, both copies stay equal to the one-process step."""
    results = [r["train_tied"] for r in ranks]
    _check_step(results, _reference(tied_tiny()), 2, 2)
    last_stage_head = results[3]["pieces"]["lm_head.weight"]  # rank 3: stage 1, tp rank 1
    assert torch.equal(last_stage_head, results[1]["pieces"]["model.embed_tokens.weight"])  # stage 0, tp rank 1


def _check_step(results: list[dict[str, Any]], reference: tuple, tp: int, pp: int) -> None:
    ref_metrics, ref_params = reference
    for res in results:
        assert res["metrics"]["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
        assert res["metrics"]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
        assert res["generation_equal"], "state_dict_for_generation differs from the gathered weights"
        assert res["after_load"]["loss"] == pytest.approx(res["after_save"]["loss"], abs=1e-7)
    full = results[0]["full"]
    assert sorted(full) == sorted(ref_params)
    # Adam's first step is about lr · sign(grad): float noise in near-zero gradients (keys carry a
    # softmax-invariant direction) shows up as ~2e-5 of the 1e-2 step; real errors are ~1e-2
    for name, value in ref_params.items():
        assert torch.allclose(full[name], value, atol=5e-5), name
    # this rank's pieces are the slices shard.tp_piece names of the trained full weights
    t, _, _ = results[1]["coords"]
    q = results[1]["pieces"]["model.layers.0.self_attn.q_proj.weight"]
    rows = 64 // tp
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"][t * rows : (t + 1) * rows])
    assert f"dcp_tp{tp - 1}_pp{pp - 1}" in results[0]["ckpt_files"]


def test_tp_backend_validation() -> None:
    model = load_model(ModelConfig("tiny"))
    with pytest.raises(ValueError, match="needs backend 'tp' or 'fsdp2', not 'deepspeed'"):
        build_train_engine(model, EngineConfig(backend="deepspeed", tp=2))
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        build_train_engine(model, EngineConfig(backend="tp", tp=2))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_smollm2_tp3_and_pp3_tied_embeddings(tmp_path: Path) -> None:
    """SmolLM2-135M (9 heads, 3 kv heads, tied embedding/head) over 3 ranks: tp=3, and pp=3 where
    the last stage holds the tied head."""
    try:
        resolve_model_dir("smollm2-135m")
    except ModelLoadError as exc:
        pytest.skip(f"smollm2-135m not available: {exc}")
    results = run_ranks(forward_layouts, 3, tmp_path, layouts=[(3, 1), (1, 3)], preset="smollm2-135m")
    for rank, res in enumerate(results):
        for key, case in res.items():
            if key == "ok":
                continue
            # 30 layers of fp32 sums in another order: logits (|x| ~ 20) move by ~1e-3, log-probs ~2e-5
            assert case["logits_diff"] < 3e-3, (rank, key, case["logits_diff"])
            assert case["logprob_diff"] < 1e-4, (rank, key, case["logprob_diff"])
            assert case["empty_logits_diff"] < 3e-3, (rank, key, case["empty_logits_diff"])
    assert "lm_head.weight" in results[2]["t1p3"]["pieces"]  # the tied head's copy on the last stage
    assert "model.embed_tokens.weight" in results[0]["t1p3"]["pieces"]
    assert results[0]["t3p1"]["pieces"]["model.embed_tokens.weight"] == (16384, 576)


def test_load_pieces_names_what_is_wrong() -> None:
    """Single process (tp = pp = 1, no groups): the piece API's errors name the parameter and shapes."""
    from hfrt.roles.training.parallel import tp_model

    model = load_model(ModelConfig("tiny"))
    layout = tp_model.parallelize(model)
    assert (layout.tp, layout.pp) == (1, 1)
    blocks = list(tp_model.local_pieces(model))
    assert len(blocks) == 3  # two decoder layers, then embedding / norm / head
    with pytest.raises(ValueError, match=r"q_proj.weight piece is \(32, 64\) but this rank .* holds \(64, 64\)"):
        tp_model.load_pieces(model, [("model.layers.0.self_attn.q_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(KeyError, match="holds no parameter 'model.layers.9.mlp.up_proj.weight'"):
        tp_model.load_pieces(model, [("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    tp_model.load_pieces(model, [("model.norm.weight", torch.full((64,), 2.0))])
    assert torch.equal(model.model.norm.weight, torch.full((64,), 2.0))
    with pytest.raises(ValueError, match="already parallelized"):
        tp_model.parallelize(model)
