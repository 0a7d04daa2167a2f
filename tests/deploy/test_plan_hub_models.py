"""`hfrt plan` with a model named by Hugging Face Hub id: its shape from the config.json in the Hub
cache (offline here; huggingface_hub's constants point at a tmp cache), the id written unchanged
into the spec, and an uncached id offline reported naming it. Pure logic, no processes."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from huggingface_hub import constants

from hfrt.deploy.plan.file import parse_plan
from hfrt.deploy.plan.search import search
from hfrt.deploy.plan.spec import spec_text
from hfrt.deploy.reader import SpecError
from tests.roles.hub_cache import put_in_hub_cache

REPO = "some-org/critic-model"
CONFIG = {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "vocab_size": 500,
          "intermediate_size": 256, "tie_word_embeddings": True}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "hub"
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(CONFIG))
    put_in_hub_cache(folder, REPO, source)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return folder


def test_a_hub_id_is_planned_from_its_cached_config_and_written_as_is(cache: Path) -> None:
    plan = parse_plan({"flow": "ppo", "cluster": {"hardware": "cpu"},
                       "models": {"actor": "tiny", "critic": REPO, "reference": "tiny"}}, "test.toml")
    critic = plan.problem.models["critic"]
    assert (critic.name, critic.layers, critic.hidden, critic.vocab, critic.tied) == (REPO, 4, 128, 500, True)
    spec = tomllib.loads(spec_text(plan, search(plan.problem).ranked[0]))
    assert spec["roles"]["critic"]["options"]["model"] == REPO


def test_an_uncached_hub_id_offline_is_a_problem_naming_it(cache: Path) -> None:
    with pytest.raises(SpecError) as info:
        parse_plan({"flow": "ppo", "cluster": {"hardware": "cpu"}, "models": {"critic": "some-org/not-here"}}, "p.toml")
    text = str(info.value)
    assert "[models] critic: Hugging Face Hub id 'some-org/not-here'" in text and str(cache) in text
    with pytest.raises(SpecError, match=r"'no/such/dir' is neither a preset .* nor a Hugging Face Hub id"):
        parse_plan({"flow": "ppo", "cluster": {"hardware": "cpu"}, "models": {"critic": "no/such/dir"}}, "p.toml")


def test_the_planner_reads_hub_ids_without_torch() -> None:
    code = ("import sys, hfrt.deploy.plan.file, hfrt.wire.hub as h; assert h.parse_hub_id('a/b') is not None; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
