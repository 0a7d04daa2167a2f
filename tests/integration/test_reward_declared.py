"""A user reward function that declares response_ids, response_length and settings, in real
`hfrt controller --flow grpo` runs: it sees each response's token ids (the response text decoded),
their count, and the threshold given with `--set roles.reward.options.settings.max_len=3`, read-only;
the step's reward metric is what its token-length penalty implies. A misspelt declaration is
refused before any daemon starts. (docs/roles-and-losses.md, "What a reward function may declare".)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

PENALTY = '''
import json


def score(response, ground_truth, response_ids, response_length, settings):
    try:
        settings["max_len"] = 0
        read_only = False
    except TypeError:
        read_only = True
    with open("seen.jsonl", "a") as seen:
        seen.write(json.dumps({"response": response, "ids": response_ids, "length": response_length,
                               "settings": dict(settings), "read_only": read_only}) + "\\n")
    return 1.0 - 0.25 * max(0, response_length - settings["max_len"])


def typo(response, ground_truth, response_len):
    return 0.0
'''
FAST = ["--set", "steps=1", "--set", "val_every=0", "--set", "prompts_per_step=4", "--set", "n=4",
        "--set", "max_new_tokens=6", "--set", "export_hf=false", "--set", "trace=false", "--set", "tensorboard=false"]


def hfrt(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hfrt", *args], cwd=cwd, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_a_length_penalty_reads_token_ids_length_and_its_threshold_from_set(tmp_path: Path) -> None:
    from hfrt.roles.models import load_tokenizer

    (tmp_path / "length_penalty.py").write_text(PENALTY)
    out = hfrt(tmp_path, "controller", "--flow", "grpo", "--run-dir", "run", *FAST,
               "--set", "roles.reward.options.function=length_penalty.py:score",
               "--set", "roles.reward.options.settings.max_len=3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["controller_bulk_bytes"] == 0  # token ids made on the reward daemon
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(seen) == 16  # 4 prompts x 4 samples, each scored once
    tokenizer = load_tokenizer("tiny")
    for one in seen:
        assert one["settings"] == {"max_len": 3} and one["read_only"]
        assert one["length"] == len(one["ids"]) and 1 <= one["length"] <= 6
        assert tokenizer.decode(one["ids"], skip_special_tokens=True) == one["response"]
    [record] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lengths = [one["length"] for one in seen]
    assert record["response_length/mean"] == pytest.approx(sum(lengths) / len(lengths))  # the actor's own count
    penalties = [1.0 - 0.25 * max(0, n - 3) for n in lengths]
    assert record["reward/mean"] == pytest.approx(sum(penalties) / len(penalties))
    assert record["reward/min"] == pytest.approx(min(penalties))


@pytest.mark.slow
def test_a_misspelt_declaration_is_refused_before_launch(tmp_path: Path) -> None:
    (tmp_path / "length_penalty.py").write_text(PENALTY)
    out = hfrt(tmp_path, "controller", "--flow", "grpo", "--run-dir", "run", *FAST,
               "--set", "roles.reward.options.function=length_penalty.py:typo")
    assert out.returncode == 2, out.stderr[-3000:]
    assert ("roles.reward: reward function 'length_penalty.py:typo' declares parameter 'response_len' "
            "(did you mean 'response_length'?)") in out.stderr
    assert "may declare prompt, data_source, extra_info, uid, response_ids, response_length, settings" in out.stderr
    assert not (tmp_path / "seen.jsonl").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
