"""Disaggregated rollout on real daemons (tiny preset): a generation-only `rollout` role beside the
training actor, versioned weight sync by handle (no bytes through the controller), checksums per
bucket with a corrupted bucket named, and the `grpo_async` flow."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hfrt.deploy.launchers.base import DaemonSpec
from hfrt.flows.batches import non_tensor, prompts_handle
from hfrt.flows.config import CALL_TIMEOUT_S
from hfrt.session import free_tcp_address
from hfrt.wire.errors import RemoteError
from tests.support import local_cluster

TRAIN = {"micro_batch_size": 32, "optim": {"lr": 2e-3}}
PROMPTS = {"prompt": ["1+1=", "2+0=", "0+1=", "2+2="], "ground_truth": ["2", "2", "1", "4"]}


def specs(rollout_ranks: int = 1) -> list[DaemonSpec]:
    group = {"dist_master": free_tcp_address().removeprefix("tcp://")} if rollout_ranks > 1 else {}
    return [
        DaemonSpec("actor", impl="actor", options={"model": "tiny", "engine": TRAIN}),
        *[DaemonSpec("rollout", rank, rollout_ranks, impl="rollout", options={"model": "tiny", "seed": 5, **group})
          for rank in range(rollout_ranks)],
    ]


async def responses(group: Any, seed: int) -> list[list[Any]]:
    out = await group.generate(prompts_handle(PROMPTS), n=2, max_new_tokens=6, seed=seed, timeout_s=CALL_TIMEOUT_S)
    return [non_tensor(out, "response"), non_tensor(out, "weight_version") if "weight_version" in out.shards[0].non_tensor else []]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_sync_by_handle_versions_and_checksums() -> None:
    async with local_cluster(specs()) as (ctl, _):
        actor, rollout = await ctl.role("actor", timeout_s=60), await ctl.role("rollout", timeout_s=60)
        assert await rollout.weight_version() == [-1]
        [_, versions] = await responses(rollout, seed=1)
        assert versions == [-1] * 8
        [published] = await actor.publish_weights(0, bucket_mb=0.05)
        assert len(published["buckets"]) > 2  # bucketed
        [loaded] = await rollout.load_weights(published, timeout_s=CALL_TIMEOUT_S)
        assert loaded["version"] == 0 and loaded["buckets"] == len(published["buckets"])
        assert loaded["held_verified"] == loaded["buckets"] and loaded["bytes"] > 0
        # the rollout daemon now samples exactly what the actor samples (its own seed-5 weights are gone)
        [texts, versions] = await responses(rollout, seed=3)
        [actor_texts, _] = await responses(actor, seed=3)
        assert texts == actor_texts and versions == [0] * 8
        assert ctl.stats()["controller_bulk_bytes"] == 0  # buckets moved daemon to daemon

        # a bucket damaged after the trainer's checksum is detected and named; no generation until fixed
        [bad] = await actor.publish_weights(1, bucket_mb=0.05, corrupt_buckets=[1])
        count = len(bad["buckets"])
        with pytest.raises(RemoteError, match=rf"rollout daemon rollout:0: weight sync to version 1: bucket 1 of {count} \(.*\) arrived corrupted"):
            await rollout.load_weights(bad, timeout_s=CALL_TIMEOUT_S)
        with pytest.raises(RemoteError, match="rollout:0 holds no valid weights: .*bucket 1"):
            await responses(rollout, seed=3)
        [good] = await actor.publish_weights(2, bucket_mb=0.05)
        await rollout.load_weights(good, timeout_s=CALL_TIMEOUT_S)
        assert await rollout.weight_version() == [2]
        assert ctl.stats()["controller_bulk_bytes"] == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_two_rollout_ranks_load_one_version_and_split_the_prompts() -> None:
    async with local_cluster(specs(rollout_ranks=2)) as (ctl, _):
        actor, rollout = await ctl.role("actor", timeout_s=60), await ctl.role("rollout", timeout_s=60)
        [published] = await actor.publish_weights(4, bucket_mb=0.1)
        loaded = await rollout.load_weights(published, timeout_s=CALL_TIMEOUT_S)
        assert [r["version"] for r in loaded] == [4, 4] and all(r["held_verified"] == r["buckets"] for r in loaded)
        out = await rollout.generate(prompts_handle(PROMPTS), n=2, max_new_tokens=4, seed=0, timeout_s=CALL_TIMEOUT_S)
        assert len(out) == 8 and sorted({s.owner for s in out.shards}) == ["rollout:0", "rollout:1"]
        assert non_tensor(out, "weight_version") == [4] * 8 and out.meta["weight_version"] == 4
        assert ctl.stats()["controller_bulk_bytes"] == 0


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_a_sharded_actor_publishes_from_rank_0() -> None:
    """Two fsdp2 actor ranks gather together; rank 0 alone keeps buckets; the rollout then samples
    what the actor samples."""
    master = {"dist_master": free_tcp_address().removeprefix("tcp://")}
    engine = {**TRAIN, "backend": "fsdp2"}
    daemons = [DaemonSpec("actor", rank, 2, impl="actor", options={"model": "tiny", "engine": engine, **master}) for rank in range(2)]
    daemons.append(DaemonSpec("rollout", impl="rollout", options={"model": "tiny", "seed": 5}))
    async with local_cluster(daemons) as (ctl, _):
        actor, rollout = await ctl.role("actor", timeout_s=90), await ctl.role("rollout", timeout_s=90)
        first, second = await actor.publish_weights(1, bucket_mb=0.1, timeout_s=CALL_TIMEOUT_S)
        assert first["buckets"] and second["buckets"] == []
        [loaded] = await rollout.load_weights(first, timeout_s=CALL_TIMEOUT_S)
        assert loaded["held_verified"] == loaded["buckets"]
        out = await actor.generate(prompts_handle(PROMPTS), n=2, max_new_tokens=6, seed=3, timeout_s=CALL_TIMEOUT_S)
        # the actor's rank 0 sampled the first two prompts with seed 3: so does the rollout daemon
        half = {k: v[:2] for k, v in PROMPTS.items()}
        mine = await rollout.generate(prompts_handle(half), n=2, max_new_tokens=6, seed=3, timeout_s=CALL_TIMEOUT_S)
        assert non_tensor(mine, "response") == non_tensor(out, "response")[:4]
        assert ctl.stats()["controller_bulk_bytes"] == 0


def run_cli(run_dir: Path, *sets: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo_async", "--run-dir", str(run_dir),
            "--set", "progress=off", "--set", "export_hf=false"]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_max_staleness_0_reproduces_grpo(tmp_path: Path) -> None:
    """Same seed, same samples, same losses: only timings (and float noise in kl/mean) differ."""
    sync = subprocess.run([sys.executable, "-m", "hfrt", "controller", "--flow", "grpo", "--run-dir", str(tmp_path / "grpo"),
                           "--set", "steps=2", "--set", "progress=off", "--set", "export_hf=false"],
                          capture_output=True, text=True, timeout=170)
    assert sync.returncode == 0, sync.stderr[-3000:]
    out = run_cli(tmp_path / "async", "steps=2", "max_staleness=0")
    assert out.returncode == 0, out.stderr[-3000:]
    for a, b in zip(records(tmp_path / "grpo"), records(tmp_path / "async"), strict=True):
        assert b["async/staleness_max"] == 0 and b["async/staleness_hist/0"] == 1.0
        for key, value in a.items():
            if key.startswith(("timing/", "rollout/", "perf/", "memory/", "stream/")):  # stream/: grpo's chunking
                continue
            if key.startswith(("reward/", "response_length/")) or key == "response_tokens":
                assert b[key] == value, key
            else:
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_max_staleness_1_runs_ahead_with_tis(tmp_path: Path) -> None:
    out = run_cli(tmp_path / "run", "steps=4", "max_staleness=1", "tis_cap=2", "sync_bucket_mb=0.1", "prompts_per_step=4", "n=4")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["controller_bulk_bytes"] == 0
    rows = records(tmp_path / "run")
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]  # step 0 had nothing older to use
    assert rows[1]["async/staleness_hist/1"] == 1.0 and rows[1]["async/weight_version_min"] == 0.0
    for r in rows:
        assert r["controller_bulk_bytes"] == 0 and "actor/tis_weight_mean" in r
        for key in ("async/train_wait_s", "async/rollout_idle_s", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s"):
            assert r[key] >= 0, key
    assert rows[0]["sync/version"] == 0 and rows[0]["sync/buckets"] >= 4 and rows[0]["sync/bytes"] > 0
    # later loads finish while steps run (the publish overlaps the next step): a record covers every
    # load that finished since the one before (sync/versions of them, the newest as sync/version),
    # so none is lost: versions 0, 1 and 2 were loaded before step 3's rollout was taken
    synced = [(r["sync/version"], r["sync/versions"]) for r in rows if "sync/version" in r]
    assert synced[0] == (0.0, 1.0) and synced[-1][0] >= 2.0, synced
    assert sum(n for _, n in synced) >= 3 and all(n >= 1 for _, n in synced), synced
    # the call trace shows the rollout role generating while the training side works on an
    # earlier step (its update, or that step's reference / reward stage: which one a rollout
    # overlaps depends on the machine's load)
    events = json.loads((tmp_path / "run" / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    training = {("actor", "update"), ("reference", "compute_log_prob"), ("reward", "score")}
    spans: dict[str, list[tuple[float, float]]] = {"rollout": [], "training": []}
    for e in events:
        if e.get("ph") == "X" and e["pid"] in names:
            side = "rollout" if (names[e["pid"]], e["name"]) == ("rollout", "generate") else (
                "training" if (names[e["pid"]], e["name"]) in training else None)
            if side:
                spans[side].append((e["ts"], e["ts"] + e["dur"]))
    assert any(a0 < b1 and b0 < a1 for a0, a1 in spans["rollout"] for b0, b1 in spans["training"]), spans


def daemon_pid(parent: int, role: str) -> int | None:
    """The pid of the `hfrt daemon --role ROLE` child of `parent`, if running."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"daemon" in argv and b"--role" in argv and argv[argv.index(b"--role") + 1] == role.encode():
            return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_kill_9_of_the_rollout_daemon_names_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "hfrt", "controller", "--flow", "grpo_async", "--run-dir", str(run_dir),
            "--set", "progress=off", "--set", "export_hf=false", "--set", "steps=100000"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        pid = daemon_pid(proc.pid, "rollout")
        assert pid is not None, "no rollout daemon found"
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    # the error the run ends with (its last line, not one raised while cleaning up) names the
    # daemon and says it is gone: the rollout call's own failure ("the rollout for step N failed:
    # rollout[0] (host pid P) is gone (process P killed by SIGKILL)"), or, when another role was
    # reading the rollout's samples as it died, that read's ("could not pull from rollout:0 via
    # shm: rollout:0 (pid P) is gone: ...")
    last = err.strip().splitlines()[-1]
    assert re.search(r"rollout(\[0\]|:0) \((\S+ )?pid \d+\) is gone", last), err[-3000:]


SPLIT_SPEC = """
# split.toml: training on device 0, generation on device 1 of this machine
name = "grpo-async-split"

[[nodes]]
name = "localhost"
devices = 2

[pools.train]
nodes = ["localhost"]
devices = [0]

[pools.gen]
nodes = ["localhost"]
devices = [1]

[roles.actor]
pool = "train"
options = { model = "tiny", engine = { micro_batch_size = 32, optim = { lr = 2e-3 } }, sampling = { top_k = 0 } }

[roles.reference]
pool = "train"
options = { model = "tiny", engine = { micro_batch_size = 32 } }

[roles.reward]
pool = "train"
options = { kind = "function", function = "hfrt.flows.tasks:task_reward" }

[roles.rollout]
pool = "gen"
options = { model = "tiny", sampling = { top_k = 0 } }
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_grpo_async_on_split_pools_from_a_cluster_spec(tmp_path: Path) -> None:
    """`hfrt controller --cluster split.toml --flow grpo_async`: training roles on one pool, the
    rollout role on another, as a user runs it."""
    spec = tmp_path / "split.toml"
    spec.write_text(SPLIT_SPEC)
    out = subprocess.run([sys.executable, "-m", "hfrt", "controller", "--cluster", str(spec), "--flow", "grpo_async",
                          "--run-dir", str(tmp_path / "run"), "--set", "steps=2", "--set", "progress=off",
                          "--set", "export_hf=false"], capture_output=True, text=True, timeout=190)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = records(tmp_path / "run")
    assert len(rows) == 2 and rows[1]["async/staleness_max"] == 1.0 and rows[1]["controller_bulk_bytes"] == 0
