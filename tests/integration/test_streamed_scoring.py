"""Streamed scoring (stream_chunks): the grpo step with its rollout generated in 2 chunks, the
reference and reward started on each chunk as it arrives, trains on what one generate call gives
— the same tokens, rewards and advantages, and the same losses up to float rounding (the
reference's forward runs over smaller batches) — on real local daemons with the tiny model (the
built-in HF engine, row-seeded). Each run: fresh daemons, two steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hfrt.flows import Flow
from hfrt.flows.batches import prompts_handle
from hfrt.flows.grpo_family import GRPOFlowConfig
from hfrt.flows.recipes import grpo
from hfrt.flows.tasks import AdditionTask
from hfrt.session import run_flow
from hfrt.wire.loop import run

EXACT = ("reward/mean", "reward/max", "reward/min", "response_tokens", "response_length/mean",
         "response_length/max", "advantages/mean", "advantages/max", "advantages/min")
CLOSE = ("actor/pg_loss", "actor/kl_loss", "kl/mean", "actor/grad_norm")
PROMPTS, STEPS = 4, 2


def two_steps(chunks: int, run_dir: Path) -> list[dict[str, Any]]:
    cfg = GRPOFlowConfig.read({"run_dir": "", "progress": "off", "tensorboard": False, "trace": False,
                                    "prompts_per_step": PROMPTS, "n": 4, "max_new_tokens": 6, "seed": 3,
                                    "stream_chunks": chunks})
    rows = AdditionTask(3, 9).batch(PROMPTS * STEPS)

    async def flow(ctl: Any, _config: dict[str, Any]) -> dict[str, Any]:
        roles = {name: await ctl.role(name, timeout_s=120) for name in ("actor", "reference", "reward")}
        records = []
        for step in range(STEPS):
            prompts = prompts_handle({k: v[step * PROMPTS:(step + 1) * PROMPTS] for k, v in rows.items()})
            records.append(await grpo.grpo_step(cfg, step, prompts, **roles))
        return {"records": records}

    out = run(run_flow(Flow("streamed", flow, grpo.ROLES), run_dir=run_dir, config={}))
    return list(out["records"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_grpo_streamed_in_two_chunks_trains_as_one_call(tmp_path: Path) -> None:
    one, two = two_steps(1, tmp_path / "c1"), two_steps(2, tmp_path / "c2")
    assert len(one) == len(two) == STEPS
    for a, b in zip(one, two, strict=True):
        assert a["stream/chunks"] == 1.0 and b["stream/chunks"] == 2.0
        for key in EXACT:
            assert a[key] == b[key], (key, a[key], b[key])
        for key in CLOSE:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert b["timing/stage2_streamed_s"] > 0.0  # chunk 0's scoring was sent before chunk 1 arrived
        assert b["rollout/reshard/push_skipped"] == 0.0  # the HF engine's private copy is pushed on every call
    # the second step trained on new weights and new prompts: not a copy of the first
    assert (one[1]["actor/pg_loss"], one[1]["response_tokens"]) != (one[0]["actor/pg_loss"], one[0]["response_tokens"])
