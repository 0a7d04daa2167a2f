"""Run configuration: --config files (TOML, YAML), --set overrides with dotted keys, role
overrides merged into a flow's role table, and errors raised before any daemon starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfrt import config as runconfig
from hfrt.flows import BUILTIN, load_flow
from hfrt.flows.ppo_family import PPOConfig

FLOW_ROLES = {
    "actor": {"impl": "actor", "options": {"model": "tiny", "engine": {"micro_batch_size": 32, "optim": {"lr": 2e-3}}}},
    "reward": {"impl": "reward", "options": {"kind": "function"}},
}


def test_parse_set_nests_dotted_keys_and_parses_json() -> None:
    out = runconfig.parse_set(["steps=5", "roles.actor.options.engine.optim.lr=1e-3", "data=/x.jsonl", "flag=true"])
    assert out == {"steps": 5, "roles": {"actor": {"options": {"engine": {"optim": {"lr": 1e-3}}}}}, "data": "/x.jsonl", "flag": True}
    with pytest.raises(runconfig.ConfigError, match="key=value"):
        runconfig.parse_set(["steps"])
    with pytest.raises(runconfig.ConfigError, match="dots nest"):
        runconfig.parse_set(["roles..x=1"])


def test_layers_saved_then_file_then_set(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 7\ntemperature = 0.5\n[roles.actor.options.engine.optim]\nlr = 5e-4\n[roles.actor]\nworld_size = 2\n')
    base = {"flow": {"steps": 3, "seed": 9}, "roles": {"reward": {"options": {"function": "exact_match"}}}}
    rc = runconfig.build(FLOW_ROLES, file=toml, sets=["steps=11"], base=base)
    assert rc.flow == {"steps": 11, "seed": 9, "temperature": 0.5}
    actor = rc.roles["actor"]
    assert actor["world_size"] == 2 and actor["options"]["engine"] == {"micro_batch_size": 32, "optim": {"lr": 5e-4}}
    assert rc.roles["reward"]["options"] == {"kind": "function", "function": "exact_match"}
    assert FLOW_ROLES["actor"]["options"]["engine"]["optim"]["lr"] == 2e-3  # the flow's table is not mutated


def test_yaml_file_and_new_role(tmp_path: Path) -> None:
    yml = tmp_path / "run.yaml"
    yml.write_text("steps: 4\nroles:\n  cost:\n    impl: reward\n    options: {kind: function}\n")
    rc = runconfig.build(FLOW_ROLES, file=yml)
    assert rc.flow == {"steps": 4} and rc.roles["cost"] == {"impl": "reward", "options": {"kind": "function"}}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[roles.critic]\nworld_size = 1\n", "the flow has no role 'critic', so its impl must be given"),
        ("[roles.actor]\nworld_sise = 2\n", r"roles.actor: unknown key\(s\) \['world_sise'\]"),
        ("[roles.actor]\nworld_size = 0\n", "roles.actor.world_size=0: expected a positive integer"),
        ("steps = [1,\n", "run.toml"),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    bad = tmp_path / "run.toml"
    bad.write_text(text)
    with pytest.raises(runconfig.ConfigError, match=message):
        runconfig.build(FLOW_ROLES, file=bad)


def test_flow_config_values_are_checked() -> None:
    flow = load_flow("ppo")
    flow.check({"steps": 2})
    for bad, message in [
        ({"steps": 0}, "steps=0: must be at least 1"),
        ({"kl_ctrl": "pid"}, "kl_ctrl='pid': use fixed or adaptive"),
        ({"progress": "loud"}, "progress='loud'"),
        ({"data": "/nonexistent/train.jsonl"}, "data='/nonexistent/train.jsonl': no such file"),
        ({"temperature": "hot"}, "temperature='hot': expected float"),
    ]:
        with pytest.raises(ValueError, match=message):
            flow.check(bad)
    assert PPOConfig.read({"gamma": 1}).gamma == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "stepz=3"], r"unknown config key\(s\) \['stepz'\] \(did you mean `steps`\?\); this flow reads"),
        (["--set", "roles.actor.options.engine.optim.lr=1e-3", "--set", "roles.critik.world_size=2"],
         r"roles.critik: the flow has no role 'critik', so its impl must be given \(did you mean `critic`\?\)"),
        (["--set", "roles.actor.wordl_size=2"], r"roles.actor: unknown key\(s\) \['wordl_size'\] \(did you mean `world_size`\?\)"),
        (["--config", "/nonexistent.toml"], "config file /nonexistent.toml does not exist"),
        (["--resume", "/nonexistent-run"], "no config.json there"),
        (["--set", "roles.actor.options.engine.optim.lrr=1e-3"], r"roles.actor: engine.optim: unknown field\(s\) \['lrr'\]"),
        (["--set", "roles.reward.options.function=nope"], "roles.reward: unknown reward function 'nope'"),
    ],
)
def test_controller_rejects_bad_config_before_starting_daemons(tmp_path: Path, args: list[str], message: str) -> None:
    start = time.monotonic()
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", "ppo", "--run-dir", str(run_dir), *args],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "hfrt controller:" in out.stderr
    import re

    assert re.search(message, out.stderr), out.stderr
    assert not (run_dir / "logs").exists(), "a daemon was started before the config was checked"
    assert time.monotonic() - start < 30


def test_controller_writes_the_resolved_config(tmp_path: Path) -> None:
    """The ping flow (no model) shows config.json: flow settings and the merged role table."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "hfrt", "controller", "--flow", "ping", "--run-dir", str(run_dir), "--set", "rounds=5"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["flow"] == {"rounds": 5} and saved["roles"]["echo"]["world_size"] == 2


def test_docs_run_config_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/configuration.md's run.toml is a valid configuration for the ppo flow, with the data
    files its comment says how to write (bench/recipes/make_addition_data.py)."""
    import re

    from hfrt.bench.recipes import make_addition_data

    readme = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    [block] = [b for b in re.findall(r"```toml\n(.*?)```", readme.read_text(), re.S) if "# run.toml" in b]
    (tmp_path / "run.toml").write_text(block)
    flow = load_flow("ppo")
    rc = runconfig.build(flow.roles, file=tmp_path / "run.toml", sets=["steps=300"])
    assert rc.flow["steps"] == 300 and rc.roles["actor"]["world_size"] == 2
    assert rc.roles["actor"]["options"]["engine"]["backend"] == "fsdp2"
    assert rc.roles["actor"]["options"]["engine"]["micro_batch_size"] == 32  # the flow's own setting kept
    make_addition_data.write(tmp_path / "data", train=64, val=8)
    monkeypatch.chdir(tmp_path)
    flow.check(dict(rc.flow))


def test_role_options_are_checked_without_loading_models() -> None:
    """Each implementation's check_config, as the controller runs it before launch."""
    from hfrt.roles.check import problems

    ok = {
        "actor": {"impl": "actor", "world_size": 2, "options": {"engine": {"backend": "fsdp2"}, "sampling": {"top_k": 5}}},
        "critic": {"impl": "critic", "options": {"engine": {"optim": {"lr": 1e-4}}}},
        "reference": {"impl": "reference"},
        "cost": {"impl": "reward", "options": {"kind": "function", "function": "hfrt.flows.tasks:addition_cost"}},
        "both": {"impl": "actor_ref", "options": {"reference": {"dtype": "float32"}}},
    }
    assert problems(ok) == []
    bad = {
        "actor": {"impl": "actor", "options": {"generator": "sglang"}},
        "critic": {"impl": "critic", "world_size": 2},
        "reward": {"impl": "reward", "options": {"kind": "model", "engine": {"backend": "megatron"}}},
        "both": {"impl": "actor_ref", "options": {"reference": {"modle": "x"}}},
        "ghost": {"impl": "no.such.module:Daemon"},
    }
    found = problems(bad)
    assert len(found) == 5
    assert found[0] == "roles.actor: unknown generator 'sglang': use hf or vllm"
    assert found[1].startswith("roles.critic: engine backend 'local' cannot train with world_size 2")
    assert "roles.reward:" in found[2] and "megatron" in found[2]
    assert found[3].startswith("roles.both: option reference: unknown field(s) ['modle']")
    assert found[4].startswith("roles.ghost: No module named 'no'")


def test_attach_accepts_only_role_settings_the_daemons_already_have() -> None:
    running = {"actor": {"impl": "actor", "world_size": 2, "options": {"engine": {"backend": "fsdp2"}}}}
    runconfig.refuse_role_overrides({"actor": {"world_size": 2, "options": {"engine": {"backend": "fsdp2"}}}}, running, "--set")
    runconfig.refuse_role_overrides({"actor": {"impl": "actor", "dp_size": -1}}, running, "--role")  # the defaults
    runconfig.refuse_role_overrides({}, {}, "--set")
    with pytest.raises(runconfig.ConfigError, match=r"these from --set cannot apply: roles.actor.world_size=4 \(they have 2\), "
                                                     r"roles.actor.options.engine.optim.lr=0.1, roles.critic.world_size=1;"):
        runconfig.refuse_role_overrides(
            {"actor": {"world_size": 4, "options": {"engine": {"optim": {"lr": 0.1}}}}, "critic": {"world_size": 1}}, running, "--set"
        )
    assert runconfig.role_overrides(sets=["steps=3", "roles.actor.world_size=2"]) == {"actor": {"world_size": 2}}


def test_check_recovery_policy_and_run_share_one_read(tmp_path: Path) -> None:
    """`hfrt controller` checks {config + run_dir} before launch; the session's recovery policy
    and Flow.run get that same typed config back instead of reading the dict again."""
    from hfrt.session import recovery_policy, with_run_dir

    flow = load_flow("ppo")
    config = with_run_dir({"steps": 2, "recovery": "on"}, tmp_path)
    flow.check(config)
    first = flow.read(config)
    assert recovery_policy(flow, dict(config)).enabled
    assert flow.read(dict(config)) is first


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_saved_config_json_holds_every_setting_and_reads_back_the_same(tmp_path: Path, name: str) -> None:
    """config.json is the resolved configuration of every built-in flow: all its keys (defaults
    included, none of the run's own), and `--config RUN_DIR/config.json` reads back the same config."""
    import dataclasses

    from hfrt.cli import RUN_ONLY, _write_config

    flow = load_flow(name)
    given = required_settings(name, tmp_path)
    _write_config(tmp_path, flow, given, flow.roles)
    saved = json.loads((tmp_path / "config.json").read_text())
    if flow.config_cls is None:
        assert saved == {"flow": {}, "roles": flow.roles}
        return
    fields = {f.name for f in dataclasses.fields(flow.config_cls)}
    assert set(saved["flow"]) == fields - set(RUN_ONLY) and saved["roles"] == flow.roles
    again = runconfig.build(flow.roles, file=tmp_path / "config.json")
    assert again.roles == flow.roles
    assert flow.config_cls.read(again.flow) == flow.config_cls.read(given)


def required_settings(name: str, tmp_path: Path) -> dict[str, str]:
    """The settings a built-in flow cannot run without: agent_replay's recorded conversations."""
    if name != "agent_replay":
        return {}
    from hfrt.serve.record import Recorder
    from hfrt.serve.sessions import Session, SessionCall

    recorder = Recorder(tmp_path / "recorded")
    recorder.conversation("s", Session([SessionCall([1], [2], [-0.1], 0)]), reward=1.0)
    recorder.close()
    return {"data": str(tmp_path / "recorded")}
