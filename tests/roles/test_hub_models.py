"""Hugging Face Hub ids as `model` options: telling them from presets and paths, resolving them
from a Hub cache offline (once per process), the errors that name the id and the cache, and the
check before launch reading only an uncached id's config.json. The Hub cache is a tmp folder
(huggingface_hub's constants patched); integration: tests/integration/test_hub_models.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants

from hfrt.roles import models
from hfrt.roles.models import ModelLoadError, check_reward_model_dir, load_model, load_tokenizer, resolve_model_dir
from hfrt.wire import hub
from hfrt.wire.hub import HubId, parse_hub_id
from tests.roles.hub_cache import put_in_hub_cache

REPO = "some-org/some-model"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache, offline, and no Hub id resolved yet in this process."""
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(models, "_HUB_FOLDERS", {})
    monkeypatch.setattr(models, "_CONFIGS_ONLY", False)
    return folder


@pytest.fixture
def cached_tiny(cache: Path) -> Path:
    """The tiny preset's files as REPO's snapshot in the cache; returns the snapshot folder."""
    return put_in_hub_cache(cache, REPO, resolve_model_dir("tiny", 0))


@pytest.mark.parametrize(("text", "expected"), [
    ("Qwen/Qwen3-0.6B", HubId("Qwen/Qwen3-0.6B")),
    ("Qwen/Qwen3-0.6B@main", HubId("Qwen/Qwen3-0.6B", "main")),
    ("org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
    ("tiny", None), ("gpt2", None), ("/abs/path", None), ("runs/x/hf", None), ("./x", None),
    ("org/name@", None), ("org--x/name", None), ("org/na me", None),
])
def test_hub_ids_are_told_from_presets_and_paths(text: str, expected: HubId | None) -> None:
    assert parse_hub_id(text) == expected


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(cached_tiny: Path) -> None:
    assert resolve_model_dir(REPO) == cached_tiny
    assert resolve_model_dir(f"{REPO}@main") == cached_tiny
    assert resolve_model_dir(f"{REPO}@{cached_tiny.name}") == cached_tiny  # a commit hash
    tokenizer = load_tokenizer(REPO)
    assert tokenizer.decode(tokenizer("1+2=3")["input_ids"]) == "1+2=3"
    assert load_model(models.ModelConfig(REPO)).config.num_hidden_layers == 2


def test_a_hub_id_resolves_once_per_process(cached_tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = hub.snapshot_folder
    monkeypatch.setattr(hub, "snapshot_folder", lambda hub_id, **kw: calls.append(hub_id) or real(hub_id, **kw))
    for _ in range(3):
        assert resolve_model_dir(REPO) == cached_tiny
    load_tokenizer(REPO)
    assert calls == [HubId(REPO)]


def test_a_folder_wins_over_a_hub_id_of_the_same_spelling(
    cached_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "work" / REPO
    shutil.copytree(cached_tiny, local)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_dir(REPO) == Path(REPO)


def test_an_id_missing_offline_names_the_id_and_the_cache(cache: Path) -> None:
    with pytest.raises(ModelLoadError) as err:
        resolve_model_dir("some-org/not-downloaded@v2")
    text = str(err.value)
    assert "'some-org/not-downloaded@v2'" in text and f"not in the Hub cache {cache}" in text
    assert "HF_HUB_OFFLINE=1" in text and "hf download some-org/not-downloaded --revision v2" in text


def test_anything_else_says_a_hub_id_is_accepted(cache: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model 'no/such/dir': no such directory and not a preset \(.*tiny.*\) "
                                             r"nor a Hugging Face Hub id \(org/name or org/name@revision\)"):
        resolve_model_dir("no/such/dir")


def test_the_check_before_launch_reads_an_uncached_ids_config_alone(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(resolve_model_dir("tiny", 0) / "config.json", config_only / "config.json")
    fetched: list[HubId] = []
    monkeypatch.setattr(hub, "config_file", lambda hub_id: fetched.append(hub_id) or config_only / "config.json")
    monkeypatch.setattr(models, "_CONFIGS_ONLY", True)  # as hfrt.roles.check's main sets it
    assert resolve_model_dir(REPO) == config_only and fetched == [HubId(REPO)]
    check_reward_model_dir(REPO)  # its score head is checked by the daemon, once downloaded
    assert models._HUB_FOLDERS == {}  # the daemons resolve the whole snapshot themselves
    monkeypatch.setattr(models, "_CONFIGS_ONLY", False)
    monkeypatch.setattr(hub, "snapshot_folder", lambda hub_id, **kw: config_only)
    with pytest.raises(ModelLoadError, match=r"reward model 'some-org/some-model': no \*.safetensors weights"):
        check_reward_model_dir(REPO)


def test_every_role_that_reads_a_model_accepts_a_hub_id(cached_tiny: Path, cache: Path, tmp_path: Path) -> None:
    from hfrt.roles.check import problems

    reward_folder = tmp_path / "rm"
    models.save_value_model(load_model(models.ModelConfig("tiny", value_head=True)), reward_folder)
    put_in_hub_cache(cache, "some-org/some-rm", reward_folder)
    roles = {
        "actor": {"options": {"model": REPO}}, "critic": {"options": {"model": REPO}},
        "reference": {"options": {"model": REPO}}, "rm": {"impl": "reward_model", "options": {"model": REPO}},
        "reward": {"options": {"kind": "model", "model": "some-org/some-rm"}},
        "rollout": {"impl": "rollout", "options": {"model": REPO}},
        "both": {"impl": "actor_ref", "options": {"model": "tiny", "reference": {"model": REPO}}},
    }
    assert problems(roles) == []
    absent = json.loads(json.dumps(roles).replace(REPO, "some-org/absent").replace("some-org/some-rm", "some-org/absent"))
    found = problems(absent)  # each role names the id it cannot resolve
    assert sorted(p.split(":")[0] for p in found) == sorted(f"roles.{name}" for name in roles)
    assert all("'some-org/absent'" in p and str(cache) in p for p in found), found


def test_vllm_is_given_the_snapshot_folder(cached_tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from hfrt.roles.generation import build, vllm_engine

    given = []
    monkeypatch.setattr(vllm_engine, "VLLMGenerationEngine", lambda config, **kw: given.append(config) or "engine")
    engine = build.generation_engine("vllm", model=REPO, dtype="float32", seed=0, tokenizer=load_tokenizer(REPO))
    assert engine == "engine" and [c.model_dir for c in given] == [str(cached_tiny)]
