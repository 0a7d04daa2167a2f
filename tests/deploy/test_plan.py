"""The device-mapping planner (deploy/plan*.py): Algorithm 1's procedures one by one, the cost
model on hand-computed cases, the paper's qualitative findings, PLAN.toml errors and the spec it
writes. Pure logic, no processes."""

from __future__ import annotations

import ast
import dataclasses
import tomllib
from pathlib import Path

import pytest

from hfrt.deploy import parse_spec
from hfrt.deploy.plan.calibrate import nnls_ridge
from hfrt.deploy.plan.file import flow_stages, parse_plan
from hfrt.deploy.plan.model import (
    HARDWARE,
    MODELS,
    Cost,
    Efficiency,
    Layout,
    ModelSpec,
    Workload,
    generate_cost,
    static_memory,
)
from hfrt.deploy.plan.search import (
    Choice,
    Problem,
    Stage,
    auto_parallel,
    candidate_layouts,
    d_cost,
    enum_alloc,
    get_min_alloc,
    get_placements,
    layout_slots,
    search,
    simu,
)
from hfrt.deploy.plan.spec import spec_text
from hfrt.deploy.reader import Reader, SpecError

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
PPO = (
    Stage("generate", {"actor": ("generate",)}),
    Stage("stage2", {"critic": ("forward",), "reference": ("forward",), "reward": ("forward",)}),
    Stage("old_log_prob", {"actor": ("forward",)}),
    Stage("update", {"actor": ("train",), "critic": ("train",)}),
)
ONES = Efficiency(forward=1, train=1, decode=1, comm=1, latency=1, call_s=0)
#: A made-up 10B-parameter model whose layers and heads divide every tp/pp up to 8.
TEN_B = ModelSpec("ten-b", layers=8, hidden=1024, heads=8, vocab=1000, params=10e9)
TINY_WORK = Workload(prompts_per_step=8, prompt_len=2, response_len=2, micro_batch_size=1)


def problem(models: dict[str, ModelSpec], hw: str = "H100", nodes: int = 1, per_node: int = 8,
            workload: Workload = TINY_WORK, stages: tuple[Stage, ...] = PPO, **hw_changes: float) -> Problem:
    used = {r for s in stages for r in s.calls}
    stages = tuple(Stage(s.name, {r: o for r, o in s.calls.items() if r in models}) for s in stages)
    assert set(models) <= used
    return Problem(models, stages, workload, dataclasses.replace(HARDWARE[hw], **hw_changes), nodes, per_node)


# -- get_placements ---------------------------------------------------------------------------


def test_placements_of_four_models_are_the_15_set_partitions() -> None:
    roles = ["actor", "critic", "reference", "reward"]
    placements = get_placements(roles)
    assert len(placements) == 15  # Bell(4)
    canonical = {frozenset(frozenset(g) for g in p) for p in placements}
    assert len(canonical) == 15
    for p in placements:
        assert sorted(r for g in p for r in g) == sorted(roles)
    assert [len(get_placements(roles[:k])) for k in range(1, 4)] == [1, 2, 5]
    assert len(get_placements(["a", "b", "c", "d", "e"])) == 52


# -- get_min_alloc ----------------------------------------------------------------------------


def test_min_alloc_follows_memory() -> None:
    """Trained: 2+2 bytes (bf16 weights, grads) sharded over tp·pp, 12 bytes (fp32 master + Adam)
    over all devices → 16 B/param at full sharding: 160 GB for 10B params. Inference: 2 B/param.
    With 100 GB devices: actor alone 160/n ≤ 100 → n = 2; actor + critic 320/n → 4; + reference 340/n → 4;
    all four 360/n → 4 (90 GB)."""
    m = {"actor": TEN_B, "critic": TEN_B, "reference": TEN_B, "reward": TEN_B}
    p = problem(m, memory_bytes=100e9)
    assert static_memory(TEN_B, Layout(2, 1, 1), True, p.hw) == pytest.approx(80e9)
    assert static_memory(TEN_B, Layout(1, 2, 4), True, p.hw) == pytest.approx(2 * 2 * 10e9 / 2 + 12 * 10e9 / 8)
    assert static_memory(TEN_B, Layout(1, 4, 1), False, p.hw) == pytest.approx(5e9)
    assert get_min_alloc(p, (("actor",), ("critic",), ("reference",), ("reward",))) == (2, 2, 1, 1)
    assert get_min_alloc(p, (("actor", "critic"), ("reference", "reward"))) == (4, 1)
    assert get_min_alloc(p, (("actor", "critic", "reference", "reward"),)) == (4,)
    small = problem(m, memory_bytes=10e9)
    assert get_min_alloc(small, (("actor", "critic", "reference", "reward"),)) is None  # 360/8 = 45 GB > 10 GB


# -- enum_alloc and layouts -------------------------------------------------------------------


def test_enum_alloc_gives_every_device_and_respects_minimums() -> None:
    p = problem({"actor": TEN_B, "critic": TEN_B})
    assert list(enum_alloc(p, (2, 4))) == [(2, 6), (3, 5), (4, 4)]
    assert list(enum_alloc(p, (8,))) == [(8,)]


def test_enum_alloc_on_several_nodes_uses_whole_nodes_above_one_node() -> None:
    p = problem({"actor": TEN_B, "critic": TEN_B, "reference": TEN_B}, nodes=4)
    allocs = list(enum_alloc(p, (1, 1, 1)))
    assert all(sum(a) == 32 for a in allocs)
    assert all(n <= 8 or n % 8 == 0 for a in allocs for n in a)
    assert (16, 8, 8) in allocs and (24, 4, 4) in allocs and (12, 12, 8) not in allocs
    # 24 + 6 + 2: the 6 and the 2 share the last node, contiguously
    assert layout_slots(p, (24, 6, 2)) == [
        [(k // 8, k % 8) for k in range(24)], [(3, d) for d in range(6)], [(3, d) for d in range(6, 8)]]
    assert layout_slots(p, (16, 6, 6, 4)) is None  # 6 + 6 + 4 cannot share two 8-device nodes


def test_layouts_keep_tp_in_a_node_and_dp_within_the_batch() -> None:
    p = problem({"actor": MODELS["llama-7b"]}, nodes=2, workload=Workload(prompts_per_step=4),
                stages=(Stage("update", {"actor": ("train",)}),))
    layouts = candidate_layouts(p, "actor", 16)
    assert layouts and all(lay.devices == 16 and lay.tp <= 8 and lay.dp <= 4 for lay in layouts)
    assert Layout(1, 8, 2) in layouts and Layout(1, 1, 16) not in layouts


# -- simu and the cost model ------------------------------------------------------------------


def test_decode_is_bandwidth_bound_and_scales_with_response_length() -> None:
    """One sequence on one device: each decode step reads the whole weights (2 B/param) and the KV
    cache; prefill is compute. Doubling the response doubles the weight reads."""
    hw = HARDWARE["H100"]
    lay = Layout(1, 1, 1)
    w1 = Workload(prompts_per_step=1, prompt_len=8, response_len=100)
    w2 = dataclasses.replace(w1, response_len=200)
    c1 = generate_cost(TEN_B, lay, lay, w1, "generate", hw, 8, 50e9)
    c2 = generate_cost(TEN_B, lay, lay, w2, "generate", hw, 8, 50e9)
    assert c1 is not None and c2 is not None
    weights = 100 * 2 * 10e9 / hw.mem_bw
    assert weights < c1.decode < weights * 1.01  # the KV reads of one short sequence are tiny
    assert c2.decode == pytest.approx(2 * c1.decode, rel=0.02)
    assert c1.forward < c1.decode / 100  # batch 1: decode is not compute-bound
    assert generate_cost(TEN_B, lay, lay, w1, "generate", hw, 8, 1.0) is None  # no room for one KV cache


def test_tensor_parallel_adds_communication_and_dp_adds_gradient_allreduce() -> None:
    p = problem({"actor": TEN_B}, workload=Workload(prompts_per_step=64), stages=(Stage("update", {"actor": ("train",)}),))
    tp = simu(p, "actor", "train", Layout(1, 8, 1), None, 1e12)
    dp = simu(p, "actor", "train", Layout(1, 1, 8), None, 1e12)
    assert tp is not None and dp is not None
    assert tp.train == pytest.approx(dp.train, rel=0.01)  # same FLOPs on the same 8 devices
    grads = 2 * 10e9 * 2 * 7 / 8 / p.hw.intra_bw  # ring all-reduce of bf16 grads, one mini-batch
    assert dp.comm == pytest.approx(grads, rel=0.01)
    assert tp.comm > 0


def test_d_cost_sums_within_a_set_and_takes_the_max_across_sets() -> None:
    """Stage 1: max(actor 2 + reference 1, critic 2.5) = 3; stage 2: max(0, critic 4) = 4 → 7 s."""
    p = problem({"actor": TEN_B, "critic": TEN_B, "reference": TEN_B},
                stages=(Stage("s1", {"actor": ("forward",), "reference": ("forward",), "critic": ("forward",)}),
                        Stage("s2", {"critic": ("train",)})))
    p = dataclasses.replace(p, eff=ONES)
    lay = Layout(1, 1, 1)

    def choice(role: str, s1: float, s2: float) -> Choice:
        return Choice(role, lay, None, 0.0, (0.0, 0.0), (Cost(forward=s1, calls=1), Cost(train=s2)))

    choices = {"actor": choice("actor", 2, 0), "reference": choice("reference", 1, 0), "critic": choice("critic", 2.5, 4)}
    stages = d_cost(p, (("actor", "reference"), ("critic",)), choices)
    assert stages == pytest.approx((3.0, 4.0)) and sum(stages) == pytest.approx(7.0)
    assert sum(d_cost(p, (("actor", "reference", "critic"),), choices)) == pytest.approx(5.5 + 4.0)
    assert sum(d_cost(dataclasses.replace(p, eff=dataclasses.replace(ONES, call_s=0.5)), (("actor", "reference"), ("critic",)), choices)) \
        == pytest.approx(3.0 + 1.0 + 4.0)  # two calls in the actor's set in stage 1


def test_auto_parallel_picks_the_fastest_layout_that_fits() -> None:
    p = problem({"actor": MODELS["llama-7b"]}, workload=Workload(prompts_per_step=64, prompt_len=256, response_len=256),
                stages=PPO[:1] + PPO[2:3] + (Stage("update", {"actor": ("train",)}),))
    best = auto_parallel(p, "actor", 8, p.hw.memory_bytes)
    assert best is not None and best.gen is not None
    for lay in candidate_layouts(p, "actor", 8):
        other = auto_parallel(dataclasses.replace(p, hw=dataclasses.replace(p.hw, max_tp=lay.tp, max_pp=lay.pp)), "actor", 8, p.hw.memory_bytes)
        if other is not None:
            assert best.seconds(p.eff) <= other.seconds(p.eff) + 1e-12
    assert best.static + max(best.transient) <= p.hw.memory_bytes
    assert auto_parallel(p, "actor", 1, 1e9) is None  # 7B with Adam on one 1 GB device


# -- the paper's qualitative findings ---------------------------------------------------------


def test_colocation_wins_at_small_scale() -> None:
    """7B actor/critic/reference/reward, PPO with the paper's 1024 × (1024 + 1024) batch, 16 H100s."""
    seven = {r: MODELS["llama-7b"] for r in ("actor", "critic", "reference", "reward")}
    best = search(problem(seven, nodes=2, workload=Workload())).ranked[0]
    assert len(best.placement) == 1


SMALL_BATCH = Workload(prompts_per_step=32, prompt_len=256, response_len=256)
THIRTEEN_SEVENTY = {"actor": MODELS["llama-13b"], "reference": MODELS["llama-13b"],
                    "critic": MODELS["llama-70b"], "reward": MODELS["llama-70b"]}


def test_13b_actor_70b_critic_colocated_on_32_gpus_split_on_128() -> None:
    """The paper's placement experiment (13B actor/reference, 70B critic/reward, A100s): colocation
    on a small cluster; on 128 GPUs a split placement, with more GPUs for the 70B critic than for
    the actor, because this batch no longer keeps 128 GPUs busy (see README: the cost model). The
    paper's own split (actor+reference | critic+reward) also beats colocation there."""
    small = search(problem(THIRTEEN_SEVENTY, hw="A100", nodes=4, workload=SMALL_BATCH)).ranked[0]
    assert len(small.placement) == 1
    result = search(problem(THIRTEEN_SEVENTY, hw="A100", nodes=16, workload=SMALL_BATCH))
    best = result.ranked[0]
    devices = {r: n for g, n in zip(best.placement, best.alloc, strict=True) for r in g}
    assert len(best.placement) >= 2 and devices["critic"] > devices["actor"]
    colocated = next(m for m in result.ranked if len(m.placement) == 1)
    assert best.step_s < 0.9 * colocated.step_s
    paper = next(m for m in result.ranked if {frozenset(g) for g in m.placement} == {
        frozenset({"actor", "reference"}), frozenset({"critic", "reward"})})
    assert paper.step_s < colocated.step_s
    assert paper.alloc[[set(g) for g in paper.placement].index({"critic", "reward"})] > 64


def test_70b_class_on_128_gpus_searches_every_placement() -> None:
    seventy = {r: MODELS["llama-70b"] for r in ("actor", "critic", "reference", "reward")}
    result = search(problem(seventy, nodes=16, workload=Workload()))
    assert result.ranked and result.candidates_evaluated > 100
    assert len(result.ranked) + len(result.infeasible) == 15
    assert all(sum(m.alloc) == 128 for m in result.ranked)
    assert [m.step_s for m in result.ranked] == sorted(m.step_s for m in result.ranked)


# -- flows, presets, PLAN.toml ----------------------------------------------------------------


@pytest.mark.parametrize("flow", ["ppo", "grpo", "rloo", "reinforce_pp", "remax", "safe_rlhf", "dapo"])
def test_every_builtin_flow_declares_stages_over_its_roles(flow: str) -> None:
    r = Reader("test")
    stages, roles = flow_stages(flow, r)
    assert not r.problems and stages
    assert {role for s in stages for role in s.calls} == set(roles)
    assert any("generate" in ops for s in stages for ops in s.calls.values())


def test_tiny_preset_numbers_match_roles_models() -> None:
    """The planner hard-codes `tiny`; roles/models.py builds it: read its LlamaConfig(...) call."""
    tree = ast.parse((ROOT / "roles" / "models.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "LlamaConfig")
    kw = {k.arg: k.value.value for k in call.keywords if isinstance(k.value, ast.Constant)}
    tiny = MODELS["tiny"]
    assert (tiny.hidden, tiny.intermediate, tiny.layers, tiny.heads, tiny.kv_heads) == (
        kw["hidden_size"], kw["intermediate_size"], kw["num_hidden_layers"], kw["num_attention_heads"], kw["num_key_value_heads"])
    assert tiny.tied == kw["tie_word_embeddings"] and tiny.vocab == 3 + 256  # 3 specials + the byte symbols
    assert MODELS["smollm2-135m"].params == pytest.approx(134.5e6, rel=0.01)
    assert MODELS["llama-7b"].params == pytest.approx(6.74e9, rel=0.01)
    assert MODELS["llama-70b"].params == pytest.approx(69.0e9, rel=0.01)


def test_plan_toml_models_from_presets_folders_and_numbers(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, '
                                        '"vocab_size": 500, "intermediate_size": 256, "tie_word_embeddings": true}')
    plan = parse_plan({
        "flow": "ppo", "cluster": {"hardware": "cpu"},
        "models": {"actor": "smollm2-135m", "critic": str(folder), "reference": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 300}},
    }, "test.toml")
    m = plan.problem.models
    assert set(m) == {"actor", "critic", "reference"}  # the flow's rule reward takes no devices
    assert m["actor"] == MODELS["smollm2-135m"] and m["critic"].layers == 4 and m["critic"].tied
    assert m["reference"].params == pytest.approx(m["reference"].counted_params())
    assert plan.problem.devices == 2 and plan.node_names == ("localhost",) and plan.launcher == "local"


def test_plan_toml_errors_name_every_problem() -> None:
    with pytest.raises(SpecError) as info:
        parse_plan({"flow": "ppo", "clustr": {}, "cluster": {"hardware": "TPU", "nodes": 0},
                    "workload": {"prompts_per_step": 0}, "models": {"critic": "no-such-model", "judge": "tiny"}}, "bad.toml")
    text = str(info.value)
    for needle in ("unknown key 'clustr'", "hardware = 'TPU'", "nodes and devices_per_node must be >= 1",
                   "prompts_per_step must be >= 1", "'no-such-model' is neither a preset", "unknown role 'judge'"):
        assert needle in text, (needle, text)
    with pytest.raises(SpecError, match="not a built-in flow"):
        parse_plan({"flow": "nope"})


def test_written_spec_loads_with_the_spec_reader_and_places_the_flows_roles() -> None:
    plan = parse_plan({"flow": "ppo", "cluster": {"hardware": "H100", "nodes": 2},
                       "workload": {"prompts_per_step": 64, "prompt_len": 256, "response_len": 256},
                       "models": {"actor": "llama-7b", "critic": "llama-7b", "reference": "llama-7b"}}, "p.toml")
    result = search(plan.problem)
    for mapping in result.ranked[:5]:
        spec = parse_spec(tomllib.loads(spec_text(plan, mapping)), "out.toml")
        spec.check_roles(plan.flow_roles, "flow 'ppo'")
        for role, choice in mapping.choices.items():
            placed = spec.roles[role]
            assert (placed.world_size, placed.dp_size, placed.tp_size, placed.pp_size) == (
                choice.layout.devices, choice.layout.dp, choice.layout.tp, choice.layout.pp)
        for group in mapping.placement:
            assert len({spec.roles[r].pool for r in group}) == 1
        assert spec.roles["reward"].options["kind"] == "function"
        assert {n.device_type for n in spec.nodes} == {"cuda"} and spec.launcher == "ssh"


def test_calibration_fit_recovers_known_factors() -> None:
    """Rows are raw seconds per category (forward, train, decode, comm, latency, calls); measured
    times made with 1/eff = (2, 3, 1.5, 1, 1) and call_s 0.01 are fitted back from a wrong prior."""
    xs: list[list[float]] = [[1, 0, 0, 0, 0, 1], [0, 1, 0, 0, 0, 2], [0.2, 0, 1, 0, 0.5, 1], [0.5, 0.5, 0, 0, 0, 3], [0, 0, 0, 0, 1, 1]]
    truth = [2, 3, 1.5, 1, 1, 0.01]
    ys = [sum(a * b for a, b in zip(x, truth, strict=True)) for x in xs]
    fitted = nnls_ridge(xs, ys, [1, 1, 1, 1, 1, 0.02])
    assert fitted[3] == 1  # comm never exercised: keeps its prior
    for got, want in zip(fitted[:3] + fitted[4:], truth[:3] + truth[4:], strict=True):
        assert got == pytest.approx(want, rel=0.05, abs=2e-3)


def test_grpo_old_log_prob_pass_is_priced_only_off_policy() -> None:
    """GRPO skips the old-log-prob pass when the update is one optimizer step (its default)."""
    def old_log_prob_s(**workload: int) -> float:
        plan = parse_plan({"flow": "grpo", "cluster": {"hardware": "H100"}, "workload": workload,
                           "models": {"actor": "llama-7b", "reference": "llama-7b"}})
        best = search(plan.problem).ranked[0]
        return best.stage_s[[s.name for s in plan.problem.stages].index("old_log_prob")]

    assert old_log_prob_s() == 0.0
    assert old_log_prob_s(ppo_epochs=2) > 0 and old_log_prob_s(ppo_mini_batches=4) > 0
