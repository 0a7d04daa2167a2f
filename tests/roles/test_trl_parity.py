"""The actor's supervised and preference training against TRL 1.16 on the same rows and model (the
tiny preset, fp32, AdamW at a constant learning rate): SFT rows tokenised as SFTTrainer does
(prompt-completion text and chats, multi-turn conversations masked to their assistant turns as
SFTTrainer's assistant_only_loss masks them with a template marking them), and its per-token loss
and token accuracy over three optimizer steps equal to SFTTrainer's at 1e-5 — as rows, and packed
under a token budget; pairs tokenised as DPOTrainer does, and each preference loss (sigmoid, ipo,
hinge, robust) equal to DPOTrainer's own loss code on the same log-probs at 1e-6, metrics
included, and over three optimizer steps at 1e-5. docs/pipeline.md states these; the
hfrt side runs on a local engine (no daemon), TRL's trainers run as they are. Skipped, saying so,
without trl (pip install "trl==1.16.*" with torch pinned: .ci/install does).
"""

from __future__ import annotations

import copy
import importlib.util
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hfrt.daemon.batch import Batch
from hfrt.roles.losses.preference import METRICS, preference_loss, preference_terms
from hfrt.roles.models import ModelConfig, load_model, load_tokenizer
from hfrt.roles.rows import merge
from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
from hfrt.roles.training.sequences import completion_row, conversation_row, pair_rows
from hfrt.roles.training.text_objectives import TextTraining, pair_log_probs
from hfrt.wire.loss_options import PreferenceLoss

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="trl is not installed (pip install \"trl==1.16.*\" -c <(echo torch==2.13.0+cpu))")

LR = 1e-3
SFT_ROWS = [{"prompt": "3+4=", "completion": "7"}, {"prompt": "1+1=", "completion": "2"},
            {"prompt": "12+30=", "completion": "42 is it"}, {"prompt": "0+0=", "completion": "0"}]
PAIRS = [{"prompt": "3+4=", "chosen": "7", "rejected": "8"}, {"prompt": "1+1=", "chosen": "2", "rejected": "x1"},
         {"prompt": "2+2=", "chosen": "4 ok", "rejected": "5"}, {"prompt": "0+1=", "chosen": "1", "rejected": "10"}]
CONVERSATION = [{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"},
                {"role": "user", "content": "and 1+1?"}, {"role": "assistant", "content": "2"}]
#: the tiny preset's chat template with TRL's assistant markers around each assistant turn's content and end
MARKED_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ '\\n' }}"
    "{% endgeneration %}{% else %}{{ m.content }}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
#: TRL's settings that match hfrt's defaults and these tests: fp32 (TRL turns bf16 on by default), constant lr
TRL_COMMON = {"learning_rate": LR, "lr_scheduler_type": "constant", "max_steps": 3, "logging_steps": 1, "report_to": [],
              "use_cpu": True, "save_strategy": "no", "bf16": False, "weight_decay": 0.0, "max_grad_norm": 1.0}


def tiny() -> Any:
    return load_model(ModelConfig("tiny"))


def engine(**settings: Any) -> Any:
    return build_train_engine(tiny(), EngineConfig(optim=OptimConfig(lr=LR), **settings))


def ids_and_labels(seq: Any) -> tuple[list[int], list[int]]:
    ids = seq.prompt + seq.completion
    return ids, [-100] * len(seq.prompt) + [t if m else -100 for t, m in zip(seq.completion, seq.loss_mask, strict=True)]


def sft_trainer(rows: list[dict[str, Any]], tokenizer: Any, tmp_path: Any, **args: Any) -> Any:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows), **(TRL_COMMON | args))
    return SFTTrainer(model=tiny(), args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)


def test_sft_rows_are_tokenised_as_sfttrainer_does(tmp_path: Any) -> None:
    tok = load_tokenizer("tiny")
    chat = [{"prompt": [{"role": "user", "content": "3+4="}], "completion": [{"role": "assistant", "content": "7"}]}]
    for rows in (SFT_ROWS, chat):
        prepared = sft_trainer(rows, tok, tmp_path).train_dataset
        for i, row in enumerate(rows):
            assert ids_and_labels(completion_row(tok, row["prompt"], row["completion"], "row")) == (
                prepared[i]["input_ids"], prepared[i]["labels"])
    marked = copy.deepcopy(tok)
    marked.chat_template = MARKED_TEMPLATE  # TRL masks assistant turns by the template's markers; hfrt by rendering
    prepared = sft_trainer([{"messages": CONVERSATION}], marked, tmp_path, assistant_only_loss=True).train_dataset[0]
    ids, labels = ids_and_labels(conversation_row(tok, CONVERSATION, "row"))
    assert (ids, labels) == (prepared["input_ids"], prepared["labels"])
    assert sum(label != -100 for label in labels) == 4  # "7\n" and "2\n": the user turns and headers are context


@pytest.mark.parametrize("settings", [{"micro_batch_size": 2}, {"max_tokens_per_micro_batch": 24, "pack": True}],
                         ids=["rows", "packed"])
def test_sft_loss_and_token_accuracy_equal_sfttrainers(tmp_path: Any, settings: dict[str, Any]) -> None:
    tok = load_tokenizer("tiny")
    trainer = sft_trainer(SFT_ROWS, tok, tmp_path)
    trainer.train()
    theirs = [(h["loss"], h["mean_token_accuracy"]) for h in trainer.state.log_history if "loss" in h]
    ours = TextTraining(engine(**settings), tok, "actor")
    batch = Batch({}, {"prompt": [r["prompt"] for r in SFT_ROWS], "completion": [r["completion"] for r in SFT_ROWS]})
    got = [(m["sft/loss"], m["sft/token_accuracy"]) for m in (ours.sft_update(batch) for _ in range(3))]
    assert len(theirs) == 3 and theirs[0][0] > theirs[-1][0]  # it learned: the comparison is not of constants
    for (loss, accuracy), (want_loss, want_accuracy) in zip(got, theirs, strict=True):
        assert loss == pytest.approx(want_loss, abs=1e-5) and accuracy == pytest.approx(want_accuracy, abs=1e-5)
    after = ours.sft_evaluate(batch)
    assert after["val/tokens"] == 15 and after["val/loss"] < theirs[-1][0]


def trl_dpo_loss(logps: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor, cfg: PreferenceLoss) -> tuple[float, dict[str, float]]:
    """DPOTrainer._compute_loss (TRL's own loss code) on given summed log-probs: rows [chosen..., rejected...],
    each row's sum placed on its first completion token, its completion `tokens` long."""
    from trl.trainer.dpo_trainer import DPOTrainer

    rows, width = logps.shape[0], int(tokens.max()) + 1
    completion = torch.zeros(rows, width, dtype=torch.long)
    per_token = torch.zeros(rows, width - 1)
    for row in range(rows):
        completion[row, 1 : 1 + int(tokens[row])] = 1
        per_token[row, 0] = logps[row]
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros(rows, width - 1), mean_logits=torch.zeros(rows, width - 1),
                              is_top1=torch.zeros(rows, width - 1, dtype=torch.bool))
    same = lambda value: value  # noqa: E731 - one rank: gathering is the identity
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=SimpleNamespace(device="cpu", gather=same, gather_for_metrics=same),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=[cfg.loss_type], loss_weights=[1.0], beta=cfg.beta, label_smoothing=cfg.label_smoothing, use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )
    half = rows // 2
    inputs = {"input_ids": torch.zeros(rows, width, dtype=torch.long), "attention_mask": torch.ones(rows, width, dtype=torch.long),
              "completion_mask": completion, "ref_chosen_logps": ref[:half], "ref_rejected_logps": ref[half:]}
    loss = DPOTrainer._compute_loss(trainer, lambda **_: outputs, inputs, False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items() if k in METRICS}


@pytest.mark.parametrize("cfg", [PreferenceLoss("sigmoid", 0.1), PreferenceLoss("sigmoid", 0.5), PreferenceLoss("ipo", 0.1),
                                 PreferenceLoss("hinge", 0.2), PreferenceLoss("robust", 0.1, 0.1)], ids=str)
def test_each_preference_loss_equals_trls_on_the_same_log_probs(cfg: PreferenceLoss) -> None:
    gen = torch.Generator().manual_seed(7)
    pairs = 16
    logps = -torch.rand(2 * pairs, generator=gen, dtype=torch.float64).float() * 20
    ref = logps + torch.randn(2 * pairs, generator=gen) * 3
    tokens = torch.randint(1, 9, (2 * pairs,), generator=gen)
    want, want_metrics = trl_dpo_loss(logps, ref, tokens, cfg)
    c, r = slice(0, pairs), slice(pairs, 2 * pairs)
    losses = preference_loss(logps[c], logps[r], ref[c], ref[r], cfg, tokens[c].float(), tokens[r].float())
    assert float(losses.mean()) == pytest.approx(want, abs=1e-6) and want != 0.0
    terms = preference_terms(logps[c], logps[r], ref[c], ref[r], cfg.beta)
    assert {k: float(v.mean()) for k, v in terms.items()} == pytest.approx(want_metrics, abs=1e-6)


def test_cdpo_label_smoothing_mixes_the_flipped_preference() -> None:
    """sigmoid with label smoothing ε is cDPO: (1 − ε) of DPO's loss plus ε of the loss with the
    pair's labels flipped (TRL 1.16's sigmoid takes no smoothing: ε = 0 is its loss, checked above)."""
    chosen, rejected, ref_c, ref_r = (torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.5))
    plain = preference_loss(chosen, rejected, ref_c, ref_r, PreferenceLoss("sigmoid", 0.5))
    flipped = preference_loss(rejected, chosen, ref_r, ref_c, PreferenceLoss("sigmoid", 0.5))
    mixed = preference_loss(chosen, rejected, ref_c, ref_r, PreferenceLoss("sigmoid", 0.5, 0.2))
    assert float(mixed) == pytest.approx(float(0.8 * plain + 0.2 * flipped), abs=1e-7)


def dpo_trainer(tokenizer: Any, cfg: PreferenceLoss, tmp_path: Any) -> Any:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(PAIRS), beta=cfg.beta,
                       loss_type=[cfg.loss_type], label_smoothing=cfg.label_smoothing, **TRL_COMMON)
    return DPOTrainer(model=tiny(), ref_model=tiny(), args=config, train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer)


def test_pairs_are_tokenised_as_dpotrainer_does(tmp_path: Any) -> None:
    tok = load_tokenizer("tiny")
    prepared = dpo_trainer(tok, PreferenceLoss(), tmp_path).train_dataset
    for i, row in enumerate(PAIRS):
        chosen, rejected = pair_rows(tok, row["prompt"], row["chosen"], row["rejected"], "pair")
        assert (chosen.prompt, chosen.completion, rejected.completion) == (
            prepared[i]["prompt_ids"], prepared[i]["chosen_ids"], prepared[i]["rejected_ids"])


@pytest.mark.parametrize("cfg", [PreferenceLoss("sigmoid", 0.1), PreferenceLoss("ipo", 0.1), PreferenceLoss("robust", 0.1, 0.1)], ids=str)
def test_dpo_training_equals_dpotrainers(tmp_path: Any, cfg: PreferenceLoss) -> None:
    tok = load_tokenizer("tiny")
    trainer = dpo_trainer(tok, cfg, tmp_path)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h]
    pairs = Batch({}, {k: [r[k] for r in PAIRS] for k in ("prompt", "chosen", "rejected")})
    ref = pair_log_probs(build_train_engine(tiny(), EngineConfig(trainable=False)), tok, pairs, "reference")
    ours = TextTraining(engine(micro_batch_size=2, max_tokens_per_micro_batch=20), tok, "actor")  # pairs kept whole
    got = [ours.dpo_update(merge(pairs, [ref]), cfg) for _ in range(3)]
    assert len(theirs) == 3 and theirs[-1]["rewards/accuracies"] == 1.0
    for mine, want in zip(got, theirs, strict=True):
        assert mine["dpo/loss"] == pytest.approx(want["loss"], abs=1e-5)
        for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert mine[key] == pytest.approx(want[key], abs=1e-5), key
