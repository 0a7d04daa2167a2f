"""The actor's transition streams block by block and the generation model adopts the resharded
pieces (hybrid.ReshardHybrid over a real TP engine, 4 gloo ranks, tiny preset): with equal layouts
the generation parameters are the training pieces (dp = 1: the very storage; dp = 2: the dp-gathered
rows and nothing more), every layout pair gives the exact slices, and to_train frees them;
pipeline-parallel generation (pp_g = 2, KV cache on every stage) samples like one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.roles.dist_workers import run_ranks
from tests.roles.reshard_stream_workers import stream_pairs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PAIRS = [
    ("t4p1d1", "t4p1d1"),
    ("t2p1d2", "t2p1d2"),
    ("t4p1d1", "t2p1d2"),
    ("t2p1d2", "t1p1d4"),
    ("t1p2d2", "t1p1d4"),
    ("t1p1d4", "t1p2d2"),
    ("t2p2d1", "t2p2d1"),
]
GREEDY = ["t2p1d2->t1p1d4", "t4p1d1->t2p1d2", "t1p1d4->t1p2d2", "t2p2d1->t2p2d1"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(stream_pairs, 4, tmp_path_factory.mktemp("stream"), pairs=PAIRS, greedy=GREEDY)


@pytest.mark.parametrize("train,gen", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_adopted_generation_weights_are_exact_slices_and_freed(results: list[dict[str, Any]], train: str, gen: str) -> None:
    for rank, res in enumerate(results):
        case = res[f"{train}->{gen}"]
        assert case["names_equal"] and case["bitwise"], f"rank {rank}: generation weights differ: {case}"
        assert case["freed"], f"rank {rank}: to_train left generation storage behind"
        assert case["train_intact"], f"rank {rank}: the transition changed the training weights"


@pytest.mark.parametrize("pair", ["t4p1d1->t4p1d1", "t2p2d1->t2p2d1"])
def test_equal_layouts_without_fsdp_share_the_training_storage(results: list[dict[str, Any]], pair: str) -> None:
    for rank, res in enumerate(results):
        case = res[pair]
        assert case["shared_with_training"] == case["n_gen"], f"rank {rank}: {case}"
        assert case["added_bytes"] == 0, f"rank {rank}: the transition allocated {case['added_bytes']} bytes"
        assert case["metrics"]["reshard/bytes_received"] == 0


def test_more_sharded_generation_without_fsdp_views_the_training_storage(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        case = res["t4p1d1->t2p1d2"]
        # norms replicated over tp are views; tp pieces are assembled from the micro-DP partner
        assert case["shared_with_training"] > 0, f"rank {rank}: {case}"


def test_equal_layouts_with_fsdp_add_only_the_dp_gathered_rows(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        case = res["t2p1d2->t2p1d2"]
        m = case["metrics"]
        assert m["reshard/bytes_received"] == 0 and m["reshard/bytes_sent"] == 0 and m["reshard/built"] == 0
        # one copy of the generation shard (= the dp-gathered training pieces), nothing else
        assert case["added_bytes"] == case["gen_bytes"], f"rank {rank}: {case['added_bytes']} vs {case['gen_bytes']}"


@pytest.mark.parametrize("pair", GREEDY)
def test_greedy_generation_after_the_streamed_transition_matches_one_process(results: list[dict[str, Any]], pair: str) -> None:
    for rank, res in enumerate(results):
        assert res[pair]["greedy_equal"], f"rank {rank}: greedy tokens differ from the single-process reference"
