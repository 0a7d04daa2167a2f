"""The actor's parallel options: options.parallel / options.generation.parallel → layouts and the
engine's tp / pp (pure logic)."""

from __future__ import annotations

import pytest

from hfrt.daemon.base import DaemonContext
from hfrt.roles.actor import ActorDaemon
from hfrt.roles.actor_layout import check_vllm_layout, read_layouts, with_layout
from hfrt.roles.training.parallel.layout import Layout


def ctx(world: int = 4, **options: object) -> DaemonContext:
    return DaemonContext("actor", 0, world, options=dict(options))


def test_layouts_from_options_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HFRT_TP_SIZE", "4")  # the environment no longer carries the layout
    assert read_layouts(ctx()) is None
    layouts = read_layouts(ctx(parallel={"tp": 2, "pp": 1}, generation={"parallel": {"tp": 1}}))
    assert layouts == (Layout(2, 1, 2), Layout(1, 1, 4))
    assert read_layouts(ctx(parallel={"tp": 2})) == (Layout(2, 1, 2), Layout(2, 1, 2))  # generation follows
    # a cluster spec's tp_size arrives as options.parallel (hfrt.deploy.placement)
    assert read_layouts(ctx(parallel={"tp": 4, "pp": 1}, generation={"parallel": {"tp": 2}})) == (Layout(4, 1, 1), Layout(2, 1, 2))
    engine = with_layout({"engine": {"backend": "local", "micro_batch_size": 2}}, layouts)["engine"]
    assert engine == {"backend": "tp", "micro_batch_size": 2, "tp": 2, "pp": 1}
    assert with_layout({"engine": {"backend": "fsdp2"}}, layouts)["engine"]["backend"] == "fsdp2"


def test_bad_parallel_options_name_the_option() -> None:
    with pytest.raises(ValueError, match=r"roles.actor.options.parallel: tp=3 × pp=1 does not divide world_size=4"):
        read_layouts(ctx(parallel={"tp": 3}))
    with pytest.raises(ValueError, match="does not nest"):
        read_layouts(ctx(parallel={"tp": 2, "pp": 2}, generation={"parallel": {"tp": 4}}, world=8))
    # generation runs with one pipeline stage: a training pipeline merges into it
    assert read_layouts(ctx(parallel={"pp": 2})) == (Layout(1, 2, 2), Layout(1, 1, 4))
    assert read_layouts(ctx(parallel={"tp": 2, "pp": 2})) == (Layout(2, 2, 1), Layout(2, 1, 2))
    for generator in ("hf", "vllm"):
        with pytest.raises(ValueError, match=r"roles.actor.options.generation.parallel: pp=2 is not supported; generation runs at its tp with one pipeline stage"):
            ActorDaemon.check_config(ctx(parallel={"pp": 2}, generation={"parallel": {"pp": 2}}, generator=generator))
    with pytest.raises(ValueError, match="options.parallel must be a table"):
        read_layouts(ctx(parallel=2))
    # vllm at a generation tp: consecutive TP groups only (vLLM's external_launcher rank order)
    ActorDaemon.check_config(ctx(parallel={"tp": 2}, generator="vllm"))
    with pytest.raises(ValueError, match="consecutive ranks"):  # (the tiny preset's 2 kv heads refuse tp=4 first)
        check_vllm_layout(Layout(4, 1, 1), Layout(2, 1, 2), "roles.actor.options.generation.parallel")



def test_placement_passes_the_layout_as_options_and_the_users_parallel_wins() -> None:
    from hfrt.deploy.placement import layout_options
    from hfrt.deploy.spec import RolePlacement

    def role(tp: int, pp: int = 1, **options: object) -> RolePlacement:
        return RolePlacement("actor", "pool", "actor", 4, 4 // (tp * pp), tp, pp, options=dict(options))

    assert layout_options(role(1)) == {}
    assert layout_options(role(2, model="tiny")) == {"model": "tiny", "parallel": {"tp": 2, "pp": 1}}
    assert layout_options(role(2, 2, parallel={"tp": 4})) == {"parallel": {"tp": 4, "pp": 2}}
    assert layout_options(role(2, parallel=2)) == {"parallel": 2}  # left for the actor to refuse by name
    assert read_layouts(ctx(**layout_options(role(2)))) == (Layout(2, 1, 2), Layout(2, 1, 2))
    assert read_layouts(ctx(**layout_options(role(2, parallel={"tp": 4})))) == (Layout(4, 1, 1), Layout(4, 1, 1))
