"""The calculator recipe's SFT warm-up (bench/recipes/sft_calc_openai.py) on a dump in the layout
`eval_calc_openai --dump` writes: first calls get the calculator call on the task as target, second
calls (after "Observation:") the final_answer call on the right result, the max-steps final-answer
prompts are left out, and a trained model folder is written whole (tiny preset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hfrt.bench.recipes import sft_calc_openai
from hfrt.roles.models import load_tokenizer

FIRST = "<|im_start|>system\nCall one tool per reply.<|im_end|>\n<|im_start|>user\nNew task:\n{task}<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
SECOND = FIRST[: -len("<|im_start|>assistant\n<tool_call>\n")] + (
    "<|im_start|>assistant\nCalling tools: [...]<|im_end|>\n<|im_start|>user\nObservation:\n{truth}<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n")
FINAL = "<|im_start|>system\nAnswer the task from this memory:<|im_end|>\n<|im_start|>assistant\n"


def _dump(path: Path, tokenizer: object) -> None:
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    with path.open("w") as out:
        for task, truth in (("2+3", "5"), ("10+7", "17")):
            rows = [{"prompt_ids": ids(t.format(task=task, truth=truth)), "response_ids": [1], "gen_mask": [1]} for t in (FIRST, SECOND, FINAL)]
            out.write(json.dumps({"sample": {"prompt": task, "ground_truth": truth}, "answer": "x", "reward": 0.0, "error": "",
                                  "trajectories": rows}) + "\n")


def test_warm_up_targets_the_two_calls_and_writes_a_whole_model(tmp_path: Path) -> None:
    tokenizer = load_tokenizer("tiny")
    dump = tmp_path / "dump.jsonl"
    _dump(dump, tokenizer)
    found = sft_calc_openai.examples(dump, tokenizer)
    targets = [tokenizer.decode(t) for _, t in found]
    assert targets == ['{"name": "calculator", "arguments": {"expression": "2+3"}}',
                       '{"name": "final_answer", "arguments": {"answer": "5"}}',
                       '{"name": "calculator", "arguments": {"expression": "10+7"}}',
                       '{"name": "final_answer", "arguments": {"answer": "17"}}']
    out = tmp_path / "hf"
    assert sft_calc_openai.main(["--dump", str(dump), "--model", "tiny", "--out", str(out), "--examples", "0",
                                 "--batch-size", "2", "--lr", "1e-3", "--epochs", "3", "--report", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["steps"] == 6 and report["loss_last"] < report["loss_first"]
    assert (out / "config.json").exists() and not (tmp_path / "hf.partial").exists()
    from transformers import AutoModelForCausalLM

    from hfrt.roles.models import resolve_model_dir

    before = AutoModelForCausalLM.from_pretrained(resolve_model_dir("tiny"))
    after = AutoModelForCausalLM.from_pretrained(out)
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters(), strict=True))
    with pytest.raises(FileExistsError, match="exists"):
        sft_calc_openai.main(["--dump", str(dump), "--model", "tiny", "--out", str(out), "--examples", "2"])


def test_a_dump_without_the_opening_tool_call_is_refused(tmp_path: Path) -> None:
    tokenizer = load_tokenizer("tiny")
    dump = tmp_path / "dump.jsonl"
    row = {"prompt_ids": tokenizer("plain prompt", add_special_tokens=False)["input_ids"], "response_ids": [], "gen_mask": []}
    dump.write_text(json.dumps({"sample": {"prompt": "1+1", "ground_truth": "2"}, "trajectories": [row]}) + "\n")
    with pytest.raises(ValueError, match=r"dump.jsonl:1: a call's prompt does not end in the opening <tool_call>"):
        sft_calc_openai.examples(dump, tokenizer)
