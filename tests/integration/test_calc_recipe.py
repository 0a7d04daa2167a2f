"""The calculator-tool recipe (bench/recipes): its data maker, its run config, and the evaluation entry
(greedy and sampled) on the tiny preset (a real rollout daemon; no SmolLM2 training here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hfrt import config as runconfig
from hfrt.bench.recipes import eval_calc, make_calc_data
from hfrt.flows import load_flow
from hfrt.flows.data import read_rows
from hfrt.flows.recipes.agent_calc import CALL, calculator

RECIPE = Path(__file__).resolve().parents[2] / "bench" / "recipes" / "smollm2-calc.toml"


def test_data_maker_writes_disjoint_seeded_rows_in_the_flows_tool_syntax(tmp_path: Path) -> None:
    assert make_calc_data.main(["--out", str(tmp_path / "a"), "--train", "40", "--val", "10", "--seed", "3"]) == 0
    make_calc_data.main(["--out", str(tmp_path / "b"), "--train", "40", "--val", "10", "--seed", "3"])
    make_calc_data.main(["--out", str(tmp_path / "c"), "--train", "40", "--val", "10", "--seed", "4"])
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()  # deterministic by seed
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()
    train, val = read_rows(tmp_path / "a" / "train.jsonl"), read_rows(tmp_path / "a" / "val.jsonl")
    assert (len(train), len(val)) == (40, 10)
    questions = []
    for row in train + val:
        text = row["prompt"]
        assert isinstance(text, str) and text.startswith("Use the calculator.\n")
        *examples, question = text.split("\n")
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", question).groups())  # type: ignore[union-attr]
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["ground_truth"] == str(a + b)
        questions.append(question)
        for line in examples[1:]:  # each worked example is a call the flow runs, with its true result
            head, rest = line.split("</calc>")
            found = CALL.search(head + "</calc>")
            assert found is not None and rest == f"[{calculator(found.group(1))}]{calculator(found.group(1))}"
            assert question != line.split("<calc>")[0]  # an example is never asked
    assert len(set(questions)) == 50  # no question twice, so train and val are disjoint


def test_data_maker_refuses_more_rows_than_operand_pairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        make_calc_data.main(["--out", str(tmp_path), "--train", "10", "--val", "0", "--min-operand", "1", "--max-operand", "2"])
    assert stop.value.code == 2 and "leave only 4 unused pairs" in capsys.readouterr().err


def test_recipe_config_parses_as_an_agent_calc_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # as the README runs it: from a folder where the recipe's first command wrote runs/calc
    monkeypatch.chdir(tmp_path)
    make_calc_data.write(Path("runs/calc"), train=4, val=2)
    flow = load_flow("agent_calc")
    rc = runconfig.build(flow.roles, file=RECIPE)
    cfg = flow.config_cls.read({**rc.flow, "run_dir": str(tmp_path)})
    assert (cfg.n, cfg.prompts_per_step, cfg.max_new_tokens, cfg.max_total_tokens) == (4, 4, 12, 160)
    assert 10 <= cfg.steps <= 20 and cfg.data == "runs/calc/train.jsonl" and cfg.val_every == 0
    assert rc.roles["actor"]["options"]["engine"]["optim"]["lr"] == 1e-6
    assert {rc.roles[r]["options"]["model"] for r in ("actor", "reference", "rollout")} == {"smollm2-135m"}
    assert rc.roles["reward"]["options"]["function"] == "hfrt.flows.agent.loop:agent_reward"  # the flow's own, kept
    runconfig.check_role_options(rc.roles)  # every role accepts its options (raises ConfigError otherwise)


def test_eval_entry_runs_the_agent_greedily_and_sampled_on_a_real_rollout_daemon(tmp_path: Path) -> None:
    make_calc_data.write(tmp_path / "data", train=1, val=6)
    out = tmp_path / "eval.json"
    code = eval_calc.main(["--data", str(tmp_path / "data" / "val.jsonl"), "--model", "tiny", "--model", "tiny",
                           "--run-dir", str(tmp_path / "runs"), "--out", str(out), "--threads", "1"])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["model"] for r in report["results"]] == ["tiny", "tiny"]
    first, second = report["results"]
    assert first["samples"] == 6 and first["turns_mean"] >= 1
    for key in ("accuracy", "tool_call_rate", "error_rate"):
        assert 0.0 <= first[key] <= 1.0
    assert {k: v for k, v in first.items() if k != "generate_s"} == {k: v for k, v in second.items() if k != "generate_s"}  # greedy
    assert (tmp_path / "runs" / "model1" / "logs" / "rollout-0.log").is_file()
    sampled = tmp_path / "sampled.json"
    assert eval_calc.main(["--data", str(tmp_path / "data" / "val.jsonl"), "--model", "tiny", "--temperature", "1",
                           "--samples", "3", "--run-dir", str(tmp_path / "runs2"), "--out", str(sampled), "--threads", "1"]) == 0
    report = json.loads(sampled.read_text())
    assert (report["temperature"], report["samples_per_row"], report["rows"]) == (1.0, 3, 6)
    assert report["results"][0]["samples"] == 18


def test_eval_entry_refuses_no_samples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_calc_data.write(tmp_path, train=1, val=2)
    with pytest.raises(SystemExit) as stop:
        eval_calc.main(["--data", str(tmp_path / "val.jsonl"), "--model", "tiny", "--samples", "0"])
    assert stop.value.code == 2 and "need at least 1 sample" in capsys.readouterr().err


def test_eval_entry_names_a_model_folder_that_is_no_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_calc_data.write(tmp_path, train=1, val=2)
    with pytest.raises(SystemExit) as stop:
        eval_calc.main(["--data", str(tmp_path / "val.jsonl"), "--model", str(tmp_path / "run" / "hf")])
    assert stop.value.code == 2 and "no config.json there" in capsys.readouterr().err
