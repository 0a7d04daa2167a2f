"""Token-budget micro-batches, trimming and padding-free packing (roles/training/batching.py):
the plan's rules, budgets refused before launch, and exactness — log-probs, values, losses and
gradients equal to one padded micro-batch of the whole batch, for every loss_agg_mode, on one
process and on two real gloo ranks (FSDP2) whose rows differ in length."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from hfrt.roles.losses import PolicyLossConfig, policy_loss, value_loss
from hfrt.roles.models import ModelConfig, load_model
from hfrt.roles.training import batching
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine

from .dist_workers import run_ranks

P, R = 20, 40
#: rows of very different lengths: prompts 1..20 tokens, responses 1..40
PROMPTS = [2, 20, 5, 12, 3, 17, 8, 1]
RESPONSES = [40, 1, 3, 25, 2, 38, 10, 5]
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
#: (engine settings) compared with one padded micro-batch of all rows
SETTINGS = (
    {"micro_batch_size": 3},  # row-count micro-batches, each trimmed
    {"max_tokens_per_micro_batch": 64},  # a budget: the 58-token row runs alone
    {"max_tokens_per_micro_batch": 100, "pack": True},
)


def make_batch(vocab: int, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompts, responses = torch.tensor(PROMPTS), torch.tensor(RESPONSES)
    n = len(PROMPTS)
    mask = torch.cat([(torch.arange(P)[None] >= P - prompts[:, None]), (torch.arange(R)[None] < responses[:, None])], 1).long()
    ids = torch.randint(3, vocab, (n, P + R), generator=g) * mask
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, P:],
        "response_mask": mask[:, P:],
        "advantages": torch.randn(n, R, generator=g),
        "old_log_probs": -5.5 + 0.3 * torch.randn(n, R, generator=g),
    }
    return {k: v[rows] for k, v in batch.items()}


def policy(mode: str) -> Any:
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, agg_mode=mode)

    def loss_fn(out: Any, mb: Any, scale: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return policy_loss(out.log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"], config, scale)

    return loss_fn


def critic(out: Any, mb: Any, scale: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    return value_loss(out.values, mb["advantages"], torch.zeros_like(mb["advantages"]), mb["response_mask"], 0.5, scale=scale)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad
        out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


def steps(model: torch.nn.Module, loss_fns: dict[str, Any], **settings: Any) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """(loss, gradients) of one step per loss function, on a local engine with lr 0 (the weights
    do not change, so one model serves every setting)."""
    engine = build_train_engine(model, EngineConfig(backend="local", optim=OptimConfig(lr=0.0), **settings))
    config = model.backbone.config if hasattr(model, "backbone") else model.config
    batch = make_batch(config.vocab_size)
    return {name: (engine.step(fn, batch)["loss"], grads(model)) for name, fn in loss_fns.items()}


def assert_same(got: tuple[float, dict[str, torch.Tensor]], want: tuple[float, dict[str, torch.Tensor]], what: str) -> None:
    assert got[0] == pytest.approx(want[0], abs=1e-6), what
    worst = max(float((got[1][n] - want[1][n]).abs().max()) for n in want[1])
    assert worst < 1e-6, f"{what}: gradients differ by {worst:.2e}"


# ------------------------------------------------------------------------------------ the plan


def test_plan_groups_by_length_under_the_budget() -> None:
    lengths = batching.Lengths([2, 20, 5, 12], [40, 1, 3, 25])
    groups = batching.plan(lengths, budget=64, rows_per_micro=0, packed=False)
    assert groups == [[0], [3], [1, 2]]  # 42 alone, 37 alone (2 × 37 > 64), then 21 and 8: 2 × (20 + 3)
    assert all(batching.cost(lengths, g, False) <= 64 or len(g) == 1 for g in groups)
    long = batching.plan(lengths, budget=30, rows_per_micro=0, packed=False)
    assert [0] in long and [3] in long  # rows longer than the budget run alone
    packed = batching.plan(lengths, budget=64, rows_per_micro=0, packed=True)
    assert sorted(r for g in packed for r in g) == [0, 1, 2, 3]
    assert all(batching.cost(lengths, g, True) <= 64 for g in packed)  # 42 + 21, 37 + 8
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=10 is smaller than row 1's prompt \(20 tokens\)"):
        batching.plan(lengths, budget=10, rows_per_micro=0, packed=False)
    assert batching.plan(lengths, budget=None, rows_per_micro=3, packed=False) == [[0, 1, 2], [3]]
    # of the plans with the fewest micro-batches, the least padding: not [50, 10] + 7 × [10] (170 slots)
    flat = batching.Lengths([0] * 9, [50] + [10] * 8)
    assert batching.plan(flat, budget=100, rows_per_micro=0, packed=False) == [[0], list(range(1, 9))]


def test_split_to_the_group_count_and_pairs_stay_together() -> None:
    lengths = batching.Lengths([1] * 6, [3, 3, 2, 2, 1, 1])
    groups = batching.plan(lengths, budget=100, rows_per_micro=0, packed=False)
    assert len(groups) == 1
    four = batching.split_to(groups, 4, lengths, False)
    assert len(four) == 4 and sorted(r for g in four for r in g) == list(range(6))
    pairs = batching.plan(batching.Lengths([1] * 6, [1, 9, 1, 1, 9, 1]), budget=22, rows_per_micro=0, packed=False, unit=2)
    assert all(len(g) % 2 == 0 and all(g[i] + 1 == g[i + 1] for i in range(0, len(g), 2)) for g in pairs)
    assert len(batching.split_to(pairs, 3, batching.Lengths([1] * 6, [1, 9, 1, 1, 9, 1]), False, unit=2)) == 3


def test_padding_fraction() -> None:
    lengths = [100, 10, 10, 10, 90, 20, 5, 5]
    padded = batching.padding_fraction(lengths)
    assert padded == pytest.approx(1 - 250 / 800)
    rows = batching.padding_fraction(lengths, rows_per_micro=2)  # trimmed row micro-batches
    assert rows == pytest.approx(1 - 250 / (200 + 20 + 180 + 10))
    budget = batching.padding_fraction(lengths, 200)
    assert budget < rows < padded
    assert batching.padding_fraction(lengths, 200, pack=True) == 0.0
    assert batching.padding_fraction([]) == 0.0


# ------------------------------------------------------------------------- refused before launch


@pytest.mark.parametrize("bad", [0, -8, "512", 1.5, True])
def test_bad_budget_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        EngineConfig(max_tokens_per_micro_batch=bad)


def test_budget_checked_before_launch_and_refused_with_pipeline_stages() -> None:
    from hfrt.roles.check import problems

    found = problems({
        "actor": {"impl": "actor", "options": {"engine": {"max_tokens_per_micro_batch": 0}}},
        "critic": {"impl": "critic", "options": {"engine": {"max_tokens_per_micro_batch": -1}}},
        "reference": {"impl": "reference", "options": {"engine": {"max_tokens_per_micro_batch": 4096, "pack": True}}},
    })  # fmt: skip
    assert len(found) == 2, found
    assert found[0].startswith("roles.actor:") and "max_tokens_per_micro_batch=0" in found[0]
    assert found[1].startswith("roles.critic:") and "max_tokens_per_micro_batch=-1" in found[1]
    with pytest.raises(ValueError, match="pp=2"):
        EngineConfig(backend="tp", pp=2, max_tokens_per_micro_batch=1024)
    with pytest.raises(ValueError, match="engine.pack"):
        EngineConfig(pack="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ exactness


@pytest.mark.slow
def test_forward_outputs_match_one_padded_micro_batch_in_row_order() -> None:
    model = load_model(ModelConfig("tiny"))
    batch = make_batch(model.config.vocab_size)
    mask = batch["response_mask"].bool()
    padded = build_train_engine(model, EngineConfig(trainable=False, micro_batch_size=8))
    want = padded.forward(batch, with_entropy=True, temperature=0.7)
    assert want.log_probs is not None and want.entropy is not None
    for settings in SETTINGS:
        engine = build_train_engine(model, EngineConfig(trainable=False, **settings))
        got = engine.forward(batch, with_entropy=True, temperature=0.7)
        assert got.log_probs is not None and got.entropy is not None
        assert got.log_probs.shape == (8, R)
        assert float((got.log_probs - want.log_probs)[mask].abs().max()) < 1e-5, settings
        assert float((got.entropy - want.entropy)[mask].abs().max()) < 1e-5, settings
        if settings.get("pack"):  # packed: zeros wherever a row has no real column
            assert float(got.log_probs[~mask].abs().max()) == 0.0


def test_values_match_one_padded_micro_batch() -> None:
    model = load_model(ModelConfig("tiny", value_head=True))
    batch = make_batch(model.backbone.config.vocab_size)
    mask = batch["response_mask"].bool()
    want = build_train_engine(model, EngineConfig(trainable=False, micro_batch_size=8)).forward_values(batch)
    for settings in SETTINGS:
        got = build_train_engine(model, EngineConfig(trainable=False, **settings)).forward_values(batch)
        assert float((got - want)[mask].abs().max()) < 1e-5, settings


@pytest.mark.slow
def test_step_is_exact_for_every_agg_mode() -> None:
    losses = {mode: policy(mode) for mode in MODES}
    actor, value = load_model(ModelConfig("tiny")), load_model(ModelConfig("tiny", value_head=True))
    want = steps(actor, losses, micro_batch_size=8)
    want_critic = steps(value, {"critic": critic}, micro_batch_size=8)["critic"]
    for settings in SETTINGS:
        got = steps(actor, losses, **settings)
        for mode in MODES:
            assert_same(got[mode], want[mode], f"{mode} {settings}")
        assert_same(steps(value, {"critic": critic}, **settings)["critic"], want_critic, f"critic {settings}")


def test_packed_log_probs_match_unpacked_llama_and_qwen() -> None:
    from . import model_zoo

    for family in ("llama", "qwen2", "qwen3"):
        model = model_zoo.model(family, layers=2)
        batch = make_batch(128)
        mask = batch["response_mask"].bool()
        unpacked = build_train_engine(model, EngineConfig(trainable=False, micro_batch_size=8)).forward_logprobs(batch)
        engine = build_train_engine(model, EngineConfig(trainable=False, micro_batch_size=8, pack=True))
        assert engine.micro_batches(batch)[0].inputs["input_ids"].shape == (1, sum(PROMPTS) + sum(RESPONSES))
        packed = engine.forward_logprobs(batch)
        assert float((packed - unpacked)[mask].abs().max()) < 1e-5, family


def test_a_batch_that_cannot_be_packed_is_trimmed() -> None:
    model = load_model(ModelConfig("tiny"))
    batch = make_batch(model.config.vocab_size)
    batch["attention_mask"] = batch["attention_mask"].clone()
    batch["attention_mask"][0, P + 5] = 0  # a hole inside row 0's response
    engine = build_train_engine(model, EngineConfig(trainable=False, micro_batch_size=8, pack=True))
    micro = engine.micro_batches(batch)
    assert batching.PACKED_POSITIONS not in micro[0].inputs and micro[0].inputs["input_ids"].shape[0] == 8


def test_widths_rounded_to_the_engines_multiple() -> None:
    model = load_model(ModelConfig("tiny"))
    batch = make_batch(model.config.vocab_size)
    mask = batch["response_mask"].bool()
    want = build_train_engine(model, EngineConfig(trainable=False, micro_batch_size=8)).forward_logprobs(batch)
    for settings in SETTINGS:
        engine = build_train_engine(model, EngineConfig(trainable=False, **settings))
        engine.seq_multiple = 8  # what an engine sharding the sequence over 8 ranks would ask
        for micro in engine.micro_batches(batch):
            width = int(micro.inputs["input_ids"].shape[1])
            assert width % 8 == 0 or width == P + R, (settings, width)
        got = engine.forward_logprobs(batch)
        assert float((got - want)[mask].abs().max()) < 1e-5, settings


# ------------------------------------------------------------------------------- two real ranks


def two_rank_steps(rank: int, world: int, *, out_dir: Path) -> dict[str, Any]:
    """Rank 0 holds the 4 long rows, rank 1 the 4 short: their own plans differ in count."""
    vocab = load_model(ModelConfig("tiny")).config.vocab_size
    order = sorted(range(8), key=lambda r: -(PROMPTS[r] + RESPONSES[r]))
    mine = order[:4] if rank == 0 else order[4:]
    batch = {k: v[mine] for k, v in make_batch(vocab).items()}
    out: dict[str, Any] = {"rows": mine}
    for pack in (False, True):
        model = load_model(ModelConfig("tiny"))
        engine = build_train_engine(model, EngineConfig(backend="fsdp2", optim=OptimConfig(lr=0.0),
                                                        max_tokens_per_micro_batch=64, pack=pack))
        lengths = batching.row_lengths(batch)
        out[f"own_plan_{pack}"] = len(batching.plan(lengths, budget=64, rows_per_micro=0, packed=pack))
        out[f"micro_batches_{pack}"] = len(engine.micro_batches(batch))
        for mode in MODES:
            metrics = engine.step(policy(mode), batch)
            out[f"{mode}_{pack}"] = (metrics["loss"], grads(engine.model))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_with_unequal_lengths_match_one_padded_process(tmp_path: Path) -> None:
    results = run_ranks(two_rank_steps, 2, tmp_path)
    for pack in (False, True):
        counts = [r[f"micro_batches_{pack}"] for r in results]
        assert counts[0] == counts[1] == max(r[f"own_plan_{pack}"] for r in results)
        assert results[0][f"own_plan_{pack}"] != results[1][f"own_plan_{pack}"]  # the count was equalised
    want = steps(load_model(ModelConfig("tiny")), {mode: policy(mode) for mode in MODES}, micro_batch_size=8)
    for mode in MODES:
        for pack in (False, True):
            for rank, res in enumerate(results):
                assert_same(res[f"{mode}_{pack}"], want[mode], f"rank {rank} {mode} pack={pack}")


def test_config_fields_are_plain_dataclass_fields() -> None:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {"max_tokens_per_micro_batch", "pack"} <= names
    assert EngineConfig().max_tokens_per_micro_batch is None and EngineConfig().pack is False


def test_a_budget_smaller_than_the_longest_prompt_is_refused_before_launch(tmp_path: Path) -> None:
    """sampling.max_prompt_tokens bounds the prompts a generating role accepts, so `hfrt controller`
    refuses a token budget below it before any daemon starts, naming both settings; a prompt over
    it is refused at generate, naming its row, before anything is sampled."""
    import subprocess
    import sys

    from hfrt.roles.check import problems
    from hfrt.roles.generation.batches import encode_prompts

    run = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo", "--run-dir", str(tmp_path / "run"),
         "--set", "roles.actor.options.sampling.max_prompt_tokens=64",
         "--set", "roles.reference.options.engine.max_tokens_per_micro_batch=48"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode != 0
    assert ("roles.reference: engine.max_tokens_per_micro_batch=48 is smaller than "
            "roles.actor.options.sampling.max_prompt_tokens=64") in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "run" / "logs").exists()  # no daemon was started
    fits = {"actor": {"impl": "actor", "options": {"sampling": {"max_prompt_tokens": 64}, "engine": {"max_tokens_per_micro_batch": 64}}}}
    assert problems(fits) == []
    assert "max_prompt_tokens" in problems({"actor": {"impl": "actor", "options": {"sampling": {"max_prompt_tokens": 0}}}})[0]
    assert encode_prompts(None, [[1, 2, 3], [4]], 3, "actor.generate") == [[1, 2, 3], [4]]
    with pytest.raises(ValueError, match=r"actor.generate: prompt row 1 is 4 tokens, more than sampling.max_prompt_tokens=3"):
        encode_prompts(None, [[1, 2], [1, 2, 3, 4]], 3, "actor.generate")


def test_the_output_at_the_last_response_token_is_kept_for_a_score_readout() -> None:
    """A reward model scores each row by the output at its last response token: column L of a
    [rows, R + 1] value readout. Trimmed or packed micro-batches must keep that column
    (engine.columns_past_response = 1); without it the longest rows read a zero fill."""
    from hfrt.roles.training.engines.base import model_forward

    model = load_model(ModelConfig("tiny", value_head=True))
    batch = make_batch(model.backbone.config.vocab_size)
    batch = {k: torch.nn.functional.pad(v, (0, 1)) if v.shape[1] in (P + R, R) else v for k, v in batch.items()}
    last = torch.tensor(RESPONSES)[:, None]  # column L of each row
    with torch.no_grad():
        full = model_forward(model, batch, device=torch.device("cpu"), is_value=True).values
    assert full is not None
    want = full.gather(1, last)
    for settings in SETTINGS:
        engine = build_train_engine(model, EngineConfig(trainable=False, **settings))
        engine.columns_past_response = 1
        got = engine.forward_values(batch).gather(1, last)
        assert float((got - want).abs().max()) < 1e-5, settings
    unkept = build_train_engine(model, EngineConfig(trainable=False, micro_batch_size=3)).forward_values(batch)
    assert float(unkept.gather(1, last)[0]) == 0.0  # the row of 40 response tokens: its column 40 was cut
