"""Models named by Hugging Face Hub id on real daemons: `hfrt controller --flow grpo` trains with
every model option set to `org/name`, resolved offline from a Hub cache that holds the tiny
preset's files, and an id missing from the cache is refused before launch naming it
(docs/real-models.md, "Models from the Hugging Face Hub")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.roles.hub_cache import put_in_hub_cache

REPO = "some-org/some-model"
MODEL_OPTIONS = ("roles.actor.options.model", "roles.reference.options.model")


def offline_env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE")}
    return env | {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def controller(run_dir: Path, env: dict[str, str], model: str, *sets: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo", "--run-dir", str(run_dir)]
    for item in (*sets, *(f"{key}={model}" for key in MODEL_OPTIONS)):
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, timeout=170, env=env)


@pytest.fixture
def hub_home(tmp_path: Path) -> Path:
    """HF_HOME whose Hub cache holds the tiny preset as REPO, plus a model card only that copy has."""
    from huggingface_hub import snapshot_download

    from hfrt.roles.models import resolve_model_dir

    source = tmp_path / "source"
    shutil.copytree(resolve_model_dir("tiny", 0), source)
    (source / "README.md").write_text("some-org's model card\n")
    home = tmp_path / "hf"
    snapshot = put_in_hub_cache(home / "hub", REPO, source)
    found = snapshot_download(REPO, cache_dir=home / "hub", local_files_only=True)
    assert Path(found) == snapshot and (snapshot / "config.json").is_file()
    return home


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_grpo_trains_on_a_model_from_the_hub_cache_offline(hub_home: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = controller(run, offline_env(hub_home), REPO, "steps=1", "val_every=0")
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["steps"] == 1 and 0.0 <= summary["reward_first"] <= 1.0
    saved = json.loads((run / "config.json").read_text())["roles"]
    assert saved["actor"]["options"]["model"] == saved["reference"]["options"]["model"] == REPO
    # the exported model was written from the Hub snapshot: the card only that copy has came along
    assert (run / "hf" / "README.md").read_text() == "some-org's model card\n"


@pytest.mark.timeout(60)
def test_an_id_missing_from_the_cache_offline_is_refused_before_launch(hub_home: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = controller(run, offline_env(hub_home), "some-org/not-downloaded", "steps=1")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "'some-org/not-downloaded'" in out.stderr and str(hub_home / "hub") in out.stderr
    assert "HF_HUB_OFFLINE=1" in out.stderr and "roles.actor" in out.stderr
    assert not (run / "logs").exists()  # no daemon was started
