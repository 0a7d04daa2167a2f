"""One contract for every training engine: TrainEngine alone defines forward and step (an engine
supplies hooks, so none can drop an argument), and every engine — local, FSDP2, DeepSpeed ZeRO-3,
the TP engine at tp=2 and with two pipeline stages — gives the local engine's numbers on the tiny
preset: forward with entropy, Σπ², the top-1 flags (token accuracy) and a temperature, one optimizer step whose loss reads the
entropy, and the log-probs after it, for an actor and for a critic, to 1e-5 on 2 real gloo ranks
(docs/parallel-training.md states both).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hfrt.roles.training.engines.base import CONTRACT, TrainEngine
from hfrt.roles.training.engines.deepspeed_zero import DeepSpeedEngine
from hfrt.roles.training.engines.fsdp2 import FSDP2Engine
from hfrt.roles.training.engines.local import LocalEngine
from hfrt.roles.training.engines.tp import TPEngine

from .contract_workers import LAYOUTS, build, calls, contract, vocabulary
from .dist_workers import make_batch, run_ranks

ENGINES = (LocalEngine, FSDP2Engine, DeepSpeedEngine, TPEngine)
#: fp32 sums in another order (sharded matmuls, reduce-scattered gradients): 1e-5 of each tensor's scale
TOL = 1e-5
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.mark.parametrize("engine", ENGINES, ids=lambda cls: cls.__name__)
def test_every_engine_takes_the_base_forward_and_step(engine: type[TrainEngine]) -> None:
    for name in CONTRACT:
        assert name not in vars(engine), f"{engine.__name__} overrides {name}"
        assert inspect.signature(getattr(engine, name)) == inspect.signature(getattr(TrainEngine, name))
    forward = inspect.signature(engine.forward).parameters
    assert {"temperature", "with_entropy", "with_sum_pi_squared", "with_top1", "micro_batch_size"} <= set(forward)
    assert {"temperature", "with_entropy", "with_top1", "micro_batch_size"} <= set(inspect.signature(engine.step).parameters)


def test_an_engine_overriding_forward_or_step_is_refused_naming_the_hooks() -> None:
    with pytest.raises(TypeError, match=r"Partial defines forward: TrainEngine owns forward and step .* _forward_pass"):

        class Partial(LocalEngine):
            def forward(self, batch: Any, **kwargs: Any) -> Any:  # type: ignore[override]
                return None

    with pytest.raises(TypeError, match=r"Again defines step"):

        class Again(TPEngine):
            def step(self, *args: Any, **kwargs: Any) -> dict[str, float]:  # type: ignore[override]
                return {}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    layouts = [name for name in LAYOUTS if name != "deepspeed" or HAS_DEEPSPEED]
    results = run_ranks(contract, 2, tmp_path_factory.mktemp("contract"), layouts=layouts)
    return {f"{case}@{rank}": value for rank, res in enumerate(results) for case, value in res.items() if case != "ok"}


@pytest.fixture(scope="module")
def local() -> dict[str, Any]:
    """The local engine's numbers on all 8 rows: what every engine must give."""
    batch = make_batch(vocabulary())
    return {kind: calls(build({"backend": "local"}, kind == "critic"), batch, kind == "critic") for kind in ("actor", "critic")}


def _outputs(result: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor | None]]:
    for when in ("before", "after"):
        for field, value in result[when].items():
            yield f"{when}.{field}", value


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["actor", "critic"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_engine_gives_the_local_engines_numbers(ranks: dict[str, Any], local: dict[str, Any], layout: str, kind: str) -> None:
    if layout == "deepspeed" and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed (pip install deepspeed with DS_BUILD_OPS=0)")
    want = local[kind]
    mask = make_batch(vocabulary())["response_mask"].bool()  # outside it engines may leave zeros (trimming)
    for rank in (0, 1):
        got = ranks[f"{layout}-{kind}@{rank}"]
        dp_rank, dp_size = got["rows"]
        rows = slice(dp_rank * 8 // dp_size, (dp_rank + 1) * 8 // dp_size)
        wanted = dict(_outputs(want))
        for name, value in _outputs(got):
            if wanted[name] is None:
                assert value is None, (layout, kind, rank, name, "an output nobody asked for")
                continue
            assert value is not None, (layout, kind, rank, name, "missing")
            diff = float((value - wanted[name][rows])[mask[rows]].abs().max())
            assert diff < TOL * max(1.0, float(wanted[name].abs().max())), (layout, kind, rank, name, diff)
        assert sorted(got["metrics"]) == sorted(want["metrics"]), (layout, kind, rank)
        for key, value in want["metrics"].items():
            assert got["metrics"][key] == pytest.approx(value, rel=TOL, abs=1e-7), (layout, kind, rank, key)
    if kind == "actor":  # what the optimal token baselines read: Σπ² is a probability's square sum, in (0, 1]
        spi = want["before"]["sum_pi_squared"][mask]
        assert bool(((spi > 0) & (spi <= 1)).all()) and want["before"]["entropy"] is not None

