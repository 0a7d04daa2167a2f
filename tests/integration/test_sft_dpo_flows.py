"""`hfrt controller --flow sft` and `--flow dpo` as a user runs them, on real daemons and the tiny
preset: SFT on a conversation file (assistant turns only) checkpoints, resumes where it stopped and
exports a folder transformers loads; SFT on two FSDP2 ranks gives the one-rank run's held-out loss
and token accuracy; SFT with LoRA exports the merged model and the adapter; DPO against a reference
daemon raises the held-out reward accuracy, and on two FSDP2 ranks (pairs kept whole) gives the
one-rank numbers; DPO with LoRA takes its reference from the actor
(adapters off: the margins before training are exactly 0) and launches no reference daemon; a bad
row is refused before any daemon starts, naming it; the page's table of sft and dpo on DeepSpeed
ZeRO-3 and the TP engine (tp=2, pp=2) is the committed check's (bench/recipes/offline_engines.py).
docs/pipeline.md describes these runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

QUIET = ("--set", "progress=off", "--set", "tensorboard=false", "--set", "trace=false")


def hfrt(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hfrt", *args], capture_output=True, text=True, timeout=timeout)


def summary(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout[done.stdout.index("{"):]))


def records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def conversations(tmp_path: Path, count: int = 40) -> Path:
    """Two-turn addition conversations: the assistant answers two sums; the user's turns are context."""
    path = tmp_path / "chats.jsonl"
    with path.open("w") as f:
        for i in range(count):
            a, b, c = i % 3, (i // 3) % 3, (i // 9) % 3
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)},
                {"role": "user", "content": f"{b}+{c}="}, {"role": "assistant", "content": str(b + c)}]}) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_on_conversations_checkpoints_resumes_and_exports(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    data, run = conversations(tmp_path), tmp_path / "sft"
    base = ("--flow", "sft", "--set", f"data={data}", "--set", "rows_per_step=8", "--set", "val_every=2", *QUIET)
    first = summary(hfrt("controller", *base, "--set", "max_steps=2", "--set", "checkpoint_every=2",
                         "--set", "export_hf=false", "--run-dir", str(run)))
    assert (first["steps"], first["train_rows"], first["val_rows"]) == (2, 36, 4) and "hf_export" not in first
    second = summary(hfrt("controller", "--flow", "sft", "--resume", str(run), "--set", "max_steps=4", "--set", "export_hf=true"))
    assert second["resumed_from_step"] == 2 and second["steps"] == 4
    steps = records(run)
    assert [r["step"] for r in steps] == [0, 1, 2, 3] and steps[0]["val_before/loss"] > steps[-1]["val/loss"]
    assert all(r["controller_bulk_bytes"] == 0 for r in steps)  # rows travel as text, tensors never through the controller
    assert second["val_tokens"] == 4 * 4  # 4 held-out conversations, two answers of a digit and "\n" each
    model = AutoModelForCausalLM.from_pretrained(second["hf_export"])
    assert model.config.num_hidden_layers == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_on_two_fsdp2_ranks_gives_the_one_rank_numbers(tmp_path: Path) -> None:
    common = ("--flow", "sft", "--set", "max_steps=3", "--set", "rows_per_step=16", "--set", "rows_count=200",
              "--set", "export_hf=false", *QUIET)
    one = summary(hfrt("controller", *common, "--run-dir", str(tmp_path / "one")))
    two = summary(hfrt("controller", *common, "--run-dir", str(tmp_path / "two"), "--set", "roles.actor.world_size=2",
                       "--set", "roles.actor.options.engine.backend=fsdp2"))
    assert two["val_loss"] == pytest.approx(one["val_loss"], abs=1e-4) and one["val_loss"] < one["val_before_loss"]
    assert two["val_token_accuracy"] == pytest.approx(one["val_token_accuracy"], abs=1e-6) and one["val_token_accuracy"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_with_lora_exports_the_merged_model_and_the_adapter(tmp_path: Path) -> None:
    """Also truncation: at max_length=5 every addition row (4 prompt tokens, the digit, EOS) is cut
    after its digit (truncation="right", the default), counted in sft/truncated_rows, and trains."""
    done = summary(hfrt("controller", "--flow", "sft", "--run-dir", str(tmp_path / "lora"), "--set", "max_steps=3",
                        "--set", "rows_count=200", "--set", "roles.actor.options.lora.rank=8", "--set", "max_length=5",
                        "--set", "roles.actor.options.lora.target_modules=all-linear", *QUIET))
    assert done["val_loss"] < done["val_before_loss"]
    assert (Path(done["hf_export"]) / "adapter" / "adapter_config.json").is_file()
    assert done["val_tokens"] == done["val_rows"]  # one counted token a row: the digit, its EOS cut
    assert [r["sft/truncated_rows"] for r in records(tmp_path / "lora")] == [32.0, 32.0, 32.0]


DPO = ("--flow", "dpo", "--set", "pairs_count=400", "--set", "pairs_per_step=16", "--set", "export_hf=false", *QUIET)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dpo_against_a_reference_daemon_learns_the_preferences(tmp_path: Path) -> None:
    run = tmp_path / "dpo"
    done = summary(hfrt("controller", *DPO, "--set", "max_steps=8", "--set", "val_every=4", "--run-dir", str(run)))
    assert done["val_before_rewards_margins"] == 0.0  # policy and reference start equal
    assert done["val_rewards_accuracies"] > 0.6 and done["val_rewards_margins"] > 0 and done["val_loss"] < done["val_before_loss"]
    steps = records(run)
    assert [r["step"] for r in steps] == list(range(8)) and all(r["dpo/pairs"] == 16 for r in steps)
    assert all("timing/reference_s" in r and "rewards/accuracies" in r for r in steps)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dpo_on_two_fsdp2_ranks_keeps_pairs_whole_and_gives_the_one_rank_numbers(tmp_path: Path) -> None:
    """15 pairs a step over 2 ranks (8 and 7: the short rank pads a whole pair of weight 0) under a
    token budget of about two sequences a micro-batch: the same held-out figures as one rank."""
    common = (*DPO, "--set", "pairs_per_step=15", "--set", "max_steps=3",
              "--set", "roles.actor.options.engine.max_tokens_per_micro_batch=40")
    one = summary(hfrt("controller", *common, "--run-dir", str(tmp_path / "one")))
    two = summary(hfrt("controller", *common, "--run-dir", str(tmp_path / "two"), "--set", "roles.actor.world_size=2",
                       "--set", "roles.actor.options.engine.backend=fsdp2"))
    for key in ("val_loss", "val_rewards_accuracies", "val_rewards_margins"):
        assert two[key] == pytest.approx(one[key], abs=1e-5), key
    assert one["val_rewards_margins"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dpo_with_lora_takes_its_reference_from_the_actor(tmp_path: Path) -> None:
    run = tmp_path / "dpo-lora"
    done = summary(hfrt("controller", *DPO, "--set", "max_steps=4", "--run-dir", str(run), "--set", "loss_type=ipo",
                        "--set", "roles.actor.options.lora.rank=8", "--set", "roles.actor.options.lora.target_modules=all-linear"))
    assert done["val_before_rewards_margins"] == 0.0 and done["val_rewards_margins"] != 0.0
    assert "reference" not in json.loads((run / "config.json").read_text())["roles"]  # no reference daemon launched


def test_a_bad_row_is_refused_before_launch_naming_it(tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    done = hfrt("controller", "--flow", "sft", "--set", f"data={data}", "--run-dir", str(tmp_path / "x"), timeout=60)
    assert done.returncode == 2 and f"{data}: row 2: an SFT row has `messages`, or `prompt` and `completion`" in done.stderr


def test_the_engine_check_is_the_pages() -> None:
    """docs/pipeline.md's table of sft and dpo on every engine is bench/results/offline-engines-2026-11-27.json
    (python -m hfrt.bench.recipes.offline_engines), and every engine held the local run's figures."""
    root = Path(__file__).resolve().parents[2]
    results = json.loads((root / "bench" / "results" / "offline-engines-2026-11-27.json").read_text())
    flows = results["flows"]
    assert results["all_equal_at_fp32"] is True and results["tolerance"] == 1e-5
    assert set(flows["sft"]) == set(flows["dpo"]) == {"local", "deepspeed-zero3-2ranks", "tp2", "pp2"}
    worst = {e: max(flows[f][e]["max_rel_diff_vs_local"] for f in ("sft", "dpo")) for e in flows["sft"]}
    assert max(worst.values()) == pytest.approx(1.6e-7, abs=0.05e-7)
    page = (root / "docs" / "pipeline.md").read_text()
    assert "at most **1.6e-7** apart" in page
    for engine, name in (("deepspeed-zero3-2ranks", "DeepSpeed ZeRO-3"), ("tp2", "TP, tp=2"), ("pp2", "TP engine, pp=2")):
        sft, dpo = (flows[f][engine]["figures"]["val_loss"] for f in ("sft", "dpo"))
        assert f"| {name} | {sft:.7f} | {dpo:.7f} | {worst[engine]:.1e} |" in page, engine
    assert f"| local (1 rank) | {flows['sft']['local']['figures']['val_loss']:.7f} | {flows['dpo']['local']['figures']['val_loss']:.7f} | — |" in page
