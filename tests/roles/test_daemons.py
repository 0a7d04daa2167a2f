"""Role daemons as real processes driven by a controller: every endpoint of actor, critic,
reference and reward (function- and model-based, the second instance as a Safe-RLHF cost role),
set-up failures that name the role, a raising reward function, and 2-rank actors on FSDP2
(colocated with a reference) and DeepSpeed ZeRO-3. Everything on CPU with the `tiny` preset.
"""

from __future__ import annotations

import asyncio
import math
import socket
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from hfrt import BadArguments, Controller, DaemonGone, RemoteError
from hfrt.deploy.launchers.base import DaemonSpec, expand
from hfrt.deploy.launchers.local import LocalLauncher
from hfrt.protocols import new_key
from tests.support import STARTED_PIDS, local_cluster

from .daemon_helpers import prompt_handle

# Every test here starts real daemons (or shares the module's cluster, whose start-up lands in
# whichever test runs first), so each takes more than 10 s on its own: all are marked slow.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow, pytest.mark.timeout(300)]

HELPER = f"{Path(__file__).parent / 'daemon_helpers.py'}:AdvantageHelper"
TRAIN = {"micro_batch_size": 2, "optim": {"lr": 1e-2}}
SAMPLING = {"max_new_tokens": 8, "temperature": 0.8, "top_k": 50}
PROMPTS = ["1+1=", "the cat sat", "3*3="]
TRUTHS = ["2", "mat", "9"]

REWARD_FN = '''
def score(response, ground_truth, prompt=None):
    if ground_truth == "boom":
        raise ValueError("cannot score " + repr(prompt))
    return float(len(response) % 3) + (1.0 if prompt else 0.0)
'''


def free_master() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


# ------------------------------------------------------------------- one rank per role (local)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Any]:
    folder = tmp_path_factory.mktemp("reward")
    (folder / "my_reward.py").write_text(textwrap.dedent(REWARD_FN))
    specs = [
        DaemonSpec("actor", impl="actor", options={"engine": TRAIN, "sampling": SAMPLING}),
        DaemonSpec("reference", impl="reference"),
        DaemonSpec("critic", impl="critic", options={"engine": TRAIN}),
        DaemonSpec("reward", impl="reward", options={"kind": "function", "function": f"{folder}/my_reward.py:score"}),
        DaemonSpec(  # a bad sample fails the call instead of scoring error_score
            "strict", impl="reward",
            options={"kind": "function", "function": f"{folder}/my_reward.py:score", "error_score": None},
        ),
        DaemonSpec(
            "cost", impl="reward",
            options={"kind": "model", "seed": 7, "token_column": "token_level_costs", "score_column": "cost"},
        ),
        DaemonSpec("helper", impl=HELPER),
    ]
    async with local_cluster(specs) as (ctl, _):
        yield ctl


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def roles(cluster: Any) -> dict[str, Any]:
    names = ["actor", "reference", "critic", "reward", "cost", "helper"]
    groups = await asyncio.gather(*(cluster.role(n, timeout_s=180) for n in names))
    return dict(zip(names, groups, strict=True))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(roles: dict[str, Any]) -> Any:
    return await roles["actor"].generate(prompt_handle(PROMPTS, ground_truth=TRUTHS, data_source=["a", "b", "c"]), n=2)


async def test_generate_carries_columns_and_reports_transitions(cluster: Any, rollout: Any) -> None:
    assert len(rollout) == 6 and rollout.owners == ["actor:0"]
    assert set(rollout.keys()) == {
        "prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids", "rollout_log_probs",
    }
    for key in ("timing/reshard_to_generate_s", "timing/generate_s", "timing/reshard_to_train_s", "memory/peak_rss_mb"):
        assert rollout.meta[key] > 0, key
    assert rollout.meta["temperature"] == 0.8
    batch = await cluster.fetch(rollout)
    assert batch["ground_truth"] == ["2", "2", "mat", "mat", "9", "9"]
    assert batch["prompt"] == [p for p in PROMPTS for _ in range(2)]
    uids = batch["uid"]
    assert uids[0] == uids[1] != uids[2] == uids[3] != uids[4] == uids[5]
    assert batch["responses"].shape[1] == SAMPLING["max_new_tokens"]
    assert len(batch["response"]) == 6 and all(isinstance(t, str) for t in batch["response"])


async def test_compute_log_prob_matches_the_samplers_log_probs(cluster: Any, roles: dict[str, Any], rollout: Any) -> None:
    actor, reference = roles["actor"], roles["reference"]
    old, ref = await asyncio.gather(actor.compute_log_prob(rollout), reference.compute_log_prob(rollout))
    got, sampled, ref_lp = await asyncio.gather(cluster.fetch(old), cluster.fetch(rollout), cluster.fetch(ref))
    mask = sampled["response_mask"]
    assert masked_max_diff(got["old_log_probs"], sampled["rollout_log_probs"], mask) < 1e-4
    assert got["entropy"].shape == mask.shape and bool((got["entropy"] * mask >= 0).all())
    # the reference starts from the same weights (same preset and seed): same log-probs
    assert masked_max_diff(ref_lp["ref_log_prob"], got["old_log_probs"], mask) < 1e-4


async def test_function_and_model_rewards(cluster: Any, roles: dict[str, Any], rollout: Any) -> None:
    scores, costs = await asyncio.gather(roles["reward"].score(rollout), roles["cost"].score(rollout))
    sampled, s, c = await asyncio.gather(cluster.fetch(rollout), cluster.fetch(scores), cluster.fetch(costs))
    expected = [float(len(r) % 3) + 1.0 for r in sampled["response"]]
    assert s["score"] == expected
    lengths = sampled["response_mask"].sum(-1)
    rows = torch.arange(6)
    assert s["token_level_scores"][rows, lengths - 1].tolist() == expected
    assert float(s["token_level_scores"].abs().sum()) == pytest.approx(sum(abs(x) for x in expected))
    assert c.keys() == ["token_level_costs"] and len(c["cost"]) == 6
    assert c["token_level_costs"][rows, lengths - 1].tolist() == pytest.approx(c["cost"])
    assert len(set(c["cost"])) > 1  # a value model's output, not a constant


async def test_actor_update_with_kl_loss_then_pushed_weights_equal_trained(
    cluster: Any, roles: dict[str, Any], rollout: Any
) -> None:
    actor = roles["actor"]
    [before] = await actor.weight_sync_report()
    old, ref, adv = await asyncio.gather(
        actor.compute_log_prob(rollout), roles["reference"].compute_log_prob(rollout), roles["helper"].advantages(rollout)
    )
    [metrics] = await actor.update(
        rollout, old, ref, adv, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01,
        clip_ratio_high=0.28, ppo_epochs=2, ppo_mini_batch_size=3,
    )
    assert metrics["actor/optimizer_steps"] == 4.0  # 2 epochs × 2 mini-batches of 3 rows
    for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert math.isfinite(metrics[key]), key
    assert metrics["actor/grad_norm"] > 0
    # token positions the passes ran (trimmed micro-batches) against the rows' real tokens, 2 epochs of them
    assert metrics["actor/tokens_computed"] >= metrics["actor/tokens_in_batch"] > 0
    [after] = await actor.weight_sync_report()
    assert after["max_abs_diff"] == 0.0 and after["compared"] == before["compared"] > 0
    assert after["train_checksum"] == after["generation_checksum"] != before["train_checksum"]
    # the next rollout samples from the trained weights: its log-probs are the trained policy's
    again = await actor.generate(prompt_handle(PROMPTS[:1]), n=2, seed=3)
    recomputed = await actor.compute_log_prob(again)
    got, sampled = await asyncio.gather(cluster.fetch(recomputed), cluster.fetch(again))
    assert masked_max_diff(got["old_log_probs"], sampled["rollout_log_probs"], sampled["response_mask"]) < 1e-4


async def test_critic_values_update_and_checkpoints(
    cluster: Any, roles: dict[str, Any], rollout: Any, tmp_path: Path
) -> None:
    critic, actor = roles["critic"], roles["actor"]
    values, adv = await asyncio.gather(critic.compute_values(rollout), roles["helper"].advantages(rollout))
    v = await cluster.fetch(values)
    assert v["values"].shape == (6, SAMPLING["max_new_tokens"])
    losses = [(await critic.update(rollout, values, adv, cliprange_value=10.0))[0]["critic/loss"] for _ in range(4)]
    assert losses[-1] < losses[0]

    [path] = await critic.save(str(tmp_path / "critic"))
    first = await cluster.fetch(await critic.compute_values(rollout))
    await critic.update(rollout, values, adv)
    moved = await cluster.fetch(await critic.compute_values(rollout))
    assert not torch.equal(moved["values"], first["values"])
    assert await critic.load(path) == [{"steps": 4}]
    restored = await cluster.fetch(await critic.compute_values(rollout))
    assert torch.equal(restored["values"], first["values"])

    [actor_path] = await actor.save(str(tmp_path / "actor"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor", "critic"]  # no staging folders left
    [state] = await actor.load(actor_path)
    assert state["steps"] >= 4


@asynccontextmanager
async def logged_cluster(specs: list[DaemonSpec], log_dir: Path) -> AsyncIterator[Controller]:
    """Like tests.support.local_cluster, with each daemon's stderr in log_dir: a daemon that dies
    is then reported with the last lines of its log, whichever of its Bye or its exit comes first."""
    key = new_key()
    async with Controller("tcp://127.0.0.1:0", key, heartbeat_s=1.0) as ctl:
        launcher = LocalLauncher(heartbeat_s=1.0, orphan_timeout_s=30.0, log_dir=log_dir)
        try:
            await launcher.start(specs, controller=ctl.address, key=key, on_exit=ctl.mark_gone)
            STARTED_PIDS.update(p.pid for p in launcher.processes.values())
            yield ctl
        finally:
            await ctl.shutdown_daemons(wait_s=5.0)
            await launcher.stop(timeout_s=5.0)


async def test_setup_failures_name_the_role_and_the_reason(tmp_path: Path) -> None:
    specs = [
        DaemonSpec("badpath", impl="actor", options={"model": "/no/such/model-dir"}),
        DaemonSpec("toobig", impl="critic", options={"memory_limit_mb": 1}),
    ]
    async with logged_cluster(specs, tmp_path) as ctl:
        with pytest.raises(DaemonGone, match=r"(?s)setup.failed.*role badpath:0: setup: ModelLoadError: model '/no/such/model-dir'"):
            await ctl.role("badpath", timeout_s=90)
        with pytest.raises(DaemonGone, match=r"(?s)setup.failed.*role toobig:0: setup: ModelDoesNotFit: .*needs at least [\d.]+ MiB"):
            await ctl.role("toobig", timeout_s=90)


async def test_errors_come_back_naming_the_role_and_the_daemon_keeps_serving(
    cluster: Any, roles: dict[str, Any], rollout: Any
) -> None:
    reward, actor, strict = roles["reward"], roles["actor"], await cluster.role("strict")
    boom = await actor.generate(prompt_handle(["2+2=", "1+1="], ground_truth=["boom", "2"]), max_new_tokens=2)
    scored = await cluster.fetch(await reward.score(boom))  # the run survives a bad sample ...
    assert scored["score"][0] == 0.0 and "raised on sample 0: ValueError: cannot score '2+2='" in scored["score_error"][0]
    assert scored["score_error"][1] == "" and scored["score"][1] > 0  # ... and the good one is scored
    with pytest.raises(RemoteError, match=r"strict\[0\]\.score raised RewardFunctionError: role 'strict'.*raised on sample 0"):
        await strict.score(boom)
    with pytest.raises(BadArguments, match=r"actor\.update got an unexpected keyword argument 'clip_ratio' — did you mean .*ppo_epochs"):
        await actor.update(rollout, clip_ratio=0.2)  # refused before sending (the declared update options)
    with pytest.raises(RemoteError, match=r"actor\[0\]\.update raised ValueError: actor.update: unknown option\(s\) \['clip_ratio'\]; accepted: .*ppo_epochs"):
        await cluster.submit(actor.daemons[0], "update", [rollout], {"clip_ratio": 0.2})  # sent anyway: the actor refuses it too
    with pytest.raises(RemoteError, match=r"needs tensor column\(s\) \['advantages'\]"):  # old_log_probs: optional on-policy
        await actor.update(rollout)
    assert len(await strict.score(rollout)) == 6  # both keep serving
    assert len(await actor.compute_log_prob(rollout)) == 6


# ---------------------------------------------------------------------------- two-rank actors


def two_ranks(role: str, impl: str, engine: dict[str, Any]) -> list[DaemonSpec]:
    options = {"engine": {**TRAIN, **engine}, "sampling": SAMPLING, "dist_master": free_master()}
    return expand(role, 2, impl, options=options)


async def _exercise_two_ranks(ctl: Any, actor: Any, helper: Any, *, colocated: bool) -> dict[str, float]:
    rollout = await actor.generate(prompt_handle(PROMPTS), n=2)  # 3 prompts: 2 on rank 0, 1 on rank 1
    assert rollout.owners == [f"{actor.name}:0", f"{actor.name}:1"] and len(rollout) == 6
    old, adv = await asyncio.gather(actor.compute_log_prob(rollout), helper.advantages(rollout))
    got, sampled = await asyncio.gather(ctl.fetch(old), ctl.fetch(rollout))
    assert masked_max_diff(got["old_log_probs"], sampled["rollout_log_probs"], sampled["response_mask"]) < 1e-4
    extra = [old, adv]
    if colocated:
        ref = await actor.compute_ref_log_prob(rollout)
        extra.append(ref)
    metrics = await actor.update(rollout, *extra, use_kl_loss=colocated, ppo_mini_batch_size=4)
    assert len(metrics) == 2 and metrics[0] == metrics[1]  # the same figures on both ranks
    assert math.isfinite(metrics[0]["actor/loss"]) and metrics[0]["actor/grad_norm"] > 0
    reports = await actor.weight_sync_report()
    assert all(r["max_abs_diff"] == 0.0 and r["compared"] > 0 for r in reports)
    assert reports[0]["train_checksum"] == reports[1]["train_checksum"] == reports[0]["generation_checksum"]
    return metrics[0]


async def test_two_rank_actors_on_fsdp2_colocated_with_a_reference_and_on_deepspeed(tmp_path: Path) -> None:
    specs = (
        two_ranks("fsdp", "actor_ref", {"backend": "fsdp2"})
        + two_ranks("zero", "actor", {"backend": "deepspeed", "zero_stage": 3})
        + [DaemonSpec("helper", impl=HELPER)]
    )
    async with local_cluster(specs) as (ctl, _):
        fsdp, zero, helper = await asyncio.gather(
            ctl.role("fsdp", timeout_s=240), ctl.role("zero", timeout_s=240), ctl.role("helper", timeout_s=240)
        )
        assert "compute_ref_log_prob" in fsdp.endpoints  # the colocated reference's; a plain actor's serves only LoRA
        fsdp_metrics = await _exercise_two_ranks(ctl, fsdp, helper, colocated=True)
        assert math.isfinite(fsdp_metrics["actor/kl_loss"])
        await _exercise_two_ranks(ctl, zero, helper, colocated=False)
        paths = await fsdp.save(str(tmp_path / "fsdp"))
        assert paths == [str(tmp_path / "fsdp")] * 2
        assert await fsdp.load(paths[0]) == [{"steps": 2}, {"steps": 2}]
