"""What `hfrt daemon-host` builds from its arguments: the daemons it serves, and the compute each
simulated endpoint stands in for, priced by `hfrt plan`'s cost model (no processes)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hfrt.daemon_host import add_arguments, daemons, plan_compute_s
from hfrt.roles.diagnostic.scale import SimActor, SimDaemon, SimReward
from hfrt.wire.endpoints import Dispatch, endpoint_table

PLAN_70B = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "plan-ppo-70b-h100.toml"


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--controller", "tcp://127.0.0.1:1", *argv])


def test_a_host_serves_its_slice_of_the_role_as_the_roles_simulated_daemon() -> None:
    hosted = daemons(parse("--role", "actor", "--count", "3", "--first-rank", "4", "--world-size", "8"))
    assert [(h.daemon_cls, h.context.identity, h.context.world_size) for h in hosted] == [
        (SimActor, f"actor:{r}", 8) for r in (4, 5, 6)]
    assert daemons(parse("--role", "rank", "--count", "1"))[0].daemon_cls is SimDaemon


def test_compute_s_gives_every_endpoint_the_same_sleep() -> None:
    [hosted] = daemons(parse("--role", "reward", "--count", "1", "--compute-s", "0.25"))
    assert issubclass(hosted.daemon_cls, SimReward) and hosted.daemon_cls is not SimReward
    assert hosted.context.options["compute_s"]["score"] == 0.25
    spec, _ = endpoint_table(hosted.daemon_cls)["score"]
    assert spec.is_async and spec.raw_handles and spec.dispatch is Dispatch.SPLIT, "it sleeps without holding the host's loop"
    assert str(spec.signature) == str(endpoint_table(SimReward)["score"][0].signature)
    assert not endpoint_table(hosted.daemon_cls)["ping"][0].is_async
    assert not endpoint_table(SimReward)["score"][0].is_async, "without compute, a plain function answers at once"


def test_the_cost_model_prices_each_ppo_call_of_a_named_workload() -> None:
    actor = plan_compute_s(str(PLAN_70B), "actor")
    assert set(actor) == {"generate", "compute_log_prob", "update"}
    assert all(s > 0 for s in actor.values())
    assert actor["update"] > actor["compute_log_prob"]  # a training pass costs more than a forward pass
    assert set(plan_compute_s(str(PLAN_70B), "critic")) == {"compute_values", "update"}
    scaled = plan_compute_s(str(PLAN_70B), "actor", time_scale=0.01)
    assert scaled["generate"] == pytest.approx(actor["generate"] * 0.01)
    [hosted] = daemons(parse("--role", "reference", "--count", "1", "--workload", str(PLAN_70B), "--time-scale", "0.5"))
    assert hosted.context.options["compute_s"] == plan_compute_s(str(PLAN_70B), "reference", 0.5)


def test_bad_arguments_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"ranks 6\.\.7 do not fit --world-size 7"):
        daemons(parse("--role", "actor", "--count", "2", "--first-rank", "6", "--world-size", "7"))
    with pytest.raises(ValueError, match="--options must be a JSON object"):
        daemons(parse("--role", "actor", "--count", "1", "--options", "[1]"))
    missing = tmp_path / "nope.toml"
    with pytest.raises(ValueError, match="nope.toml"):
        plan_compute_s(str(missing), "actor")
