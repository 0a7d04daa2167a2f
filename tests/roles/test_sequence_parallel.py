"""Sequence parallelism in the TP engine (parallel/sequence) against one process: tiny random
models of every verified family at t2p1d1, plus Qwen3 with loss_parallel, a Qwen3 critic and Llama
with packed micro-batches: log-probs, entropy, loss, every gradient and the weights after one PPO
update equal to 1e-5 (fp32), and the sequence really is split (the first norm's input is a Shard(1)
DTensor holding half of the padded-to-even columns on each rank); checkpoints moved between an
engine with it and one without (DCP, both ways); then the refusals before launch
(tp=1, an unverified model type). Cases with FSDP (t2p1d2) and pipelines (t2p2d1, 1F1B and
interleaved, a tied head) sit in test_mesh_engine's 4-rank spawn.

One spawn of 2 real ranks (gloo) runs every rank-side case; the tests read its results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hfrt.roles.training.engines import EngineConfig, OptimConfig, build_train_engine
from hfrt.roles.training.parallel import sequence

from . import model_zoo
from .dist_workers import make_batch, ppo_loss, rows_for, run_ranks

#: (family, extra) at tp=2, pp=1 on 2 ranks; extra "lp": with loss_parallel, "pack": packed
#: micro-batches (padded with a filler sequence to even length); family "critic-<f>": a value model
CASES = [(f, "") for f in model_zoo.FAMILIES] + [("qwen3", "lp"), ("critic-qwen3", ""), ("llama", "pack")]
TOL = 1e-5

pytestmark = [pytest.mark.timeout(600)]


def _config(tp: int = 1, **kwargs: Any) -> EngineConfig:
    backend = "tp" if tp > 1 else "local"
    return EngineConfig(backend=backend, tp=tp, micro_batch_size=2, optim=OptimConfig(lr=1e-2, eps=1e-3), **kwargs)


def _model(family: str) -> Any:
    return model_zoo.value_model(family.removeprefix("critic-")) if family.startswith("critic-") else model_zoo.model(family)


def _one_update(engine: Any, batch: dict[str, torch.Tensor], value: bool) -> dict[str, Any]:
    if value:
        out, entropy = engine.forward_values(batch), None
    else:
        out = engine.forward_logprobs(batch)
        entropy = engine.forward(batch, with_entropy=True).entropy
    metrics = engine.step(model_zoo.value_loss_fn if value else ppo_loss, batch, micro_batch_size=2)
    return {"out": out, "entropy": entropy, "metrics": metrics}


def sp_ranks(rank: int, world: int, *, out_dir: Path, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """Each case at t2p1d(world/2) with sequence_parallel: one PPO (value) update on this dp rank's rows."""
    out: dict[str, Any] = {}
    for family, extra in cases:
        value = family.startswith("critic-")
        config = _config(2, sequence_parallel=True, loss_parallel=extra == "lp", pack=extra == "pack")
        engine = build_train_engine(_model(family), config)
        seen = _norm_inputs(engine)
        batch = rows_for(make_batch(128), engine.dp_rank, engine.dp_size)
        res = _one_update(engine, batch, value)
        res["norm_inputs"] = seen
        res["grads"] = engine.full_gradients() if engine.dp_size == 1 else None
        res["weights"] = engine.full_parameters()
        out[f"{family}-{extra}"] = res
        dist.barrier()
        del engine
    out["checkpoints"] = _checkpoints_across(out_dir)
    return out


def _checkpoints_across(folder: Path) -> dict[str, float]:
    """Qwen3 at t2p1d1: a step with sequence parallelism, saved, loaded without it (then back):
    the weights equal after each load, the next step's loss equals the saving engine's."""

    def engine(sp: bool, seed: int) -> Any:
        return build_train_engine(model_zoo.model("qwen3", seed=seed), _config(2, sequence_parallel=sp))

    batch = make_batch(128)
    out = {}
    on = engine(True, 0)
    on.step(ppo_loss, batch)
    for name, other in (("off", engine(False, 1)), ("on_again", engine(True, 2))):
        on.save(folder / name)
        other.load(folder / name)
        a, b = on.full_parameters(), other.full_parameters()
        out[f"{name}_weights"] = max(float((a[k] - b[k]).abs().max()) for k in a)
        out[f"{name}_loss"] = abs(on.step(ppo_loss, batch)["loss"] - other.step(ppo_loss, batch)["loss"])
        on = other
    return out


def _norm_inputs(engine: Any) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Records (placements, global shape, local shape) of the first layer norm's inputs."""
    seen: list[Any] = []
    norm = engine.blocks[0].input_layernorm

    def hook(_m: Any, args: tuple[Any, ...]) -> None:
        x = args[0]
        seen.append((str(getattr(x, "placements", "plain")), tuple(x.shape), tuple(getattr(x, "_local_tensor", x).shape)))

    norm.register_forward_pre_hook(hook)
    return seen


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(sp_ranks, 2, tmp_path_factory.mktemp("sp"), cases=CASES)


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-3)) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(x for x in c if x))
def test_sequence_parallel_update_equals_one_process(ranks: list[dict[str, Any]], case: tuple[str, str]) -> None:
    family, extra = case
    value = family.startswith("critic-")
    model = _model(family)
    ref = _one_update(build_train_engine(model, _config(pack=extra == "pack")), make_batch(128), value)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    mask = make_batch(128)["response_mask"]
    for rank, r in enumerate(ranks):
        res = r[f"{family}-{extra}"]
        assert float(((res["out"] - ref["out"]) * mask).abs().max()) < TOL, (rank, "log-probs / values")
        if not value:
            assert float(((res["entropy"] - ref["entropy"]) * mask).abs().max()) < TOL, (rank, "entropy")
        for name in ("loss", "grad_norm"):
            assert res["metrics"][name] == pytest.approx(ref["metrics"][name], rel=TOL, abs=1e-7), (rank, name)
        assert _diff(res["grads"], ref_grads) < TOL, rank
        assert _diff(res["weights"], ref_weights) < TOL, rank
        # the sequence was split: the norm saw a Shard(1) DTensor, half the (even) columns here
        placements, full, local = res["norm_inputs"][0]
        assert "Shard(dim=1)" in placements and full[1] % 2 == 0 and local[1] * 2 == full[1], res["norm_inputs"][0]


@pytest.mark.slow
def test_checkpoints_load_with_and_without_sequence_parallel(ranks: list[dict[str, Any]]) -> None:
    for res in (r["checkpoints"] for r in ranks):
        assert res["off_weights"] == 0 and res["on_again_weights"] == 0, res
        assert res["off_loss"] < 1e-6 and res["on_again_loss"] < 1e-6, res


def test_sequence_parallel_is_refused_where_it_cannot_apply() -> None:
    llama = model_zoo.config("llama")
    with pytest.raises(sequence.SequenceParallelError, match="needs tp > 1"):
        EngineConfig(backend="tp", tp=1, sequence_parallel=True)
    config = model_zoo.config("llama")
    config.model_type = "gpt2"
    with pytest.raises(sequence.SequenceParallelError, match="not 'gpt2'"):
        sequence.check(config, 2)
    sequence.check(llama, 2)
    EngineConfig(backend="tp", tp=2, pp=2, sequence_parallel=True)  # pipelines take it (test_mesh_engine's cases)


def test_sequence_parallel_is_checked_before_launch() -> None:
    from hfrt.roles.check import problems

    found = problems({
        "actor": {"impl": "actor", "world_size": 2, "options": {"parallel": {"tp": 1}, "engine": {"sequence_parallel": True}}},
        "critic": {"impl": "critic", "world_size": 4,
                   "options": {"engine": {"backend": "tp", "tp": 2, "pp": 2, "sequence_parallel": True}}},
        "fine": {"impl": "actor", "world_size": 2, "options": {"parallel": {"tp": 2}, "engine": {"sequence_parallel": True}}},
    })  # fmt: skip
    assert len(found) == 1, found
    assert found[0].startswith("roles.actor:") and "sequence_parallel needs tp > 1" in found[0]
