"""reasoning-gym tasks as data (`data = "reasoning_gym:TASK"`, hfrt/flows/gym_data.py and
hfrt/wire/reasoning_gym_tasks.py): the rows and their stated answer format, train and validation from
disjoint seeds, the task's own scorer as the default reward, composite mixtures (as a table and as
reasoning-gym's YAML file), resume, the errors before launch, and no torch in the controller.
Documented in docs/configuration.md ("reasoning-gym tasks")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install -e '.[envs]')")

from hfrt.flows.config import FlowConfig  # noqa: E402
from hfrt.flows.data import config_task  # noqa: E402
from hfrt.flows.gym_data import GymSource  # noqa: E402
from hfrt.flows.tasks import task_reward  # noqa: E402
from hfrt.wire.reasoning_gym_tasks import CONFIG_KEY, INDEX_KEY, TASK_KEY, VAL_SEED_OFFSET, GymTaskError, parse, score  # noqa: E402

ARITH = "reasoning_gym:basic_arithmetic"


def task(data: str = ARITH, seed: int = 0, **options: object):  # type: ignore[no-untyped-def]
    cfg = FlowConfig.read({"data": data, "data_options": options, "seed": seed})
    return config_task(data=cfg.data, val_data="", seed=cfg.seed, max_operand=cfg.max_operand, data_options=cfg.data_options)


def test_rows_state_the_answer_format_and_carry_the_entry() -> None:
    rows = task(size=40).prompts().batch(4)
    assert set(rows) == {"prompt", "ground_truth", "data_source", "extra_info"}
    system, user = rows["prompt"][0]
    assert system["role"] == "system" and "<answer>answer here</answer>" in system["content"]  # reasoning-gym's "default" prompt
    assert user["role"] == "user" and user["content"].startswith("Calculate ")
    assert rows["data_source"] == [ARITH] * 4
    info = rows["extra_info"][0]
    assert info[TASK_KEY] == "basic_arithmetic" and '"size": 40' in info[CONFIG_KEY] and 0 <= info[INDEX_KEY] < 40
    assert len(task(size=40, system_prompt="").prompts().batch(1)["prompt"][0]) == 1  # no system message
    assert parse(ARITH, {}, seed=3).config == {"seed": 3, "size": 500}  # the page: size defaults to the task's, seed to the run's


def test_the_tasks_own_scorer_is_the_default_reward() -> None:
    rows = task(size=20).prompts().batch(3)
    for truth, source, info in zip(rows["ground_truth"], rows["data_source"], rows["extra_info"], strict=True):
        assert task_reward(f"thinking... <answer>{truth}</answer>", truth, source, info) == 1.0
        assert task_reward(f"<answer>{truth}</answer> <answer>x{truth}1</answer>", truth, source, info) < 1.0  # the last tag counts
        assert task_reward(truth, truth, source, info) == 0.0  # no <answer> tag: no answer
    with pytest.raises(GymTaskError, match="different reasoning-gym versions"):
        score("<answer>1</answer>", "not the entry's answer", rows["extra_info"][0])
    with pytest.raises(GymTaskError, match="extra_info keys"):
        score("<answer>1</answer>", "1", {})


def test_validation_rows_come_from_seeds_training_never_uses() -> None:
    gym = task(size=300, seed=5)
    train = {row[1]["content"] for row in gym.prompts().batch(300)["prompt"]}
    val = gym.validation_rows(16)
    assert len(val["prompt"]) == 16 and val == gym.validation_rows(16)  # fixed
    assert not {row[1]["content"] for row in val["prompt"]} & train
    assert VAL_SEED_OFFSET == 7919 and f'"seed": {5 + 7919}' in val["extra_info"][0][CONFIG_KEY]  # the page's figure
    assert gym.correct(1.0) and not gym.correct(0.5)


def test_composite_mixture_as_reasoning_gym_defines_it(tmp_path: Path) -> None:
    parts = [{"name": "basic_arithmetic", "weight": 1}, {"name": "chain_sum", "weight": 3, "config": {"seed": 11}}]
    gym = task("reasoning_gym:composite", size=50, datasets=parts)
    rows = gym.prompts().batch(50)
    sources = rows["data_source"]
    assert {"reasoning_gym:basic_arithmetic", "reasoning_gym:chain_sum"} == set(sources)
    assert sources.count("reasoning_gym:chain_sum") > sources.count("reasoning_gym:basic_arithmetic")  # weight 3 to 1
    for truth, source, info in list(zip(rows["ground_truth"], sources, rows["extra_info"], strict=True))[:6]:
        assert task_reward(f"<answer>{truth}</answer>", truth, source, info) == 1.0
    val = gym.validation_rows(4)["extra_info"][0][CONFIG_KEY]
    assert f'"seed": {11 + VAL_SEED_OFFSET}' in val  # a part's explicit seed moves too
    yaml_file = tmp_path / "mix.yaml"
    yaml_file.write_text("size: 30\nseed: 2\ndatasets:\n  - name: chain_sum\n    weight: 1\n    config: {min_terms: 2, max_terms: 2}\n")
    from_yaml = task(f"reasoning_gym:{yaml_file}")
    assert from_yaml.name == "reasoning_gym:composite" and len(from_yaml.prompts().batch(3)["prompt"]) == 3


def test_resume_continues_the_same_order() -> None:
    gym = task(size=7)
    first = gym.prompts()
    first.batch(5)
    saved = first.state_dict()
    expected = first.batch(6)["extra_info"]  # wraps into epoch 1
    again = gym.prompts()
    again.load_state_dict(saved)
    assert again.batch(6)["extra_info"] == expected and saved == {"task": "basic_arithmetic", "size": 7, "epoch": 0, "position": 5}
    other = GymSource(parse(ARITH, {"size": 8}, seed=0), 0)
    with pytest.raises(GymTaskError, match="checkpoint was taken over"):
        other.load_state_dict(saved)


@pytest.mark.parametrize(("config", "message"), [
    ({"data": "reasoning_gym:basic_arithmetc"}, r"no task 'basic_arithmetc' \(did you mean basic_arithmetic"),
    ({"data": ARITH, "data_options": {"bogus": 1}}, r"data_options \['bogus'\] are not keys of the task's config"),
    ({"data": ARITH, "data_options": {"size": 0}}, "size=0 must be a positive number"),
    ({"data": ARITH, "data_options": {"min_terms": 5, "max_terms": 2}}, "the task refused its config"),
    ({"data": ARITH, "data_options": {"system_prompt": "terse"}}, "no such reasoning-gym prompt"),
    ({"data_options": {"size": 10}}, "read only with data"),
    ({"data": "reasoning_gym:composite", "data_options": {"datasets": "chain_sum"}}, "list of"),
])
def test_bad_tasks_are_refused_before_launch(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FlowConfig.read(config)


def test_the_controller_side_imports_no_torch() -> None:
    code = ("import sys; from hfrt.flows.data import config_task; "
            "t = config_task(data='reasoning_gym:basic_arithmetic', val_data='', seed=0, max_operand=2); "
            "t.prompts().batch(2); t.validation_rows(2); assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_pinned_version_is_the_one_the_page_names() -> None:
    import importlib.metadata
    import tomllib

    extra = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]["envs"]
    assert "reasoning-gym==0.1.25" in extra and importlib.metadata.version("reasoning-gym") == "0.1.25"  # docs/configuration.md
