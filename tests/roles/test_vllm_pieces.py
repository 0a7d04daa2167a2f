"""vLLM at a generation tp fed micro-DP pieces (roles/generation/vllm_pieces.py): the pieces,
presented full-shaped to vLLM's checkpoint-format loaders, build exactly the fused per-rank weights
that today's full push builds (recorded before vLLM packs them), with the same greedy tokens and
log-probs; the pure parts (which parameters go by pieces, the full-shaped view) checked alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hfrt.roles.generation.vllm_pieces import full_shaped, piece_dims
from tests.roles.dist_workers import run_ranks
from tests.roles.vllm_pieces_workers import vllm_pieces
from tests.roles.vllm_tp_workers import write_model
from tests.support import skip_without_vllm


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_full_shaped_holds_the_piece_where_the_loader_narrows(dim: int) -> None:
    full = torch.randn(6, 8, 4)
    start, n = 2, 2
    piece = full.narrow(dim, start, n).clone()
    view = full_shaped(piece, tuple(full.shape), dim, start)
    assert tuple(view.shape) == tuple(full.shape)
    assert torch.equal(view.narrow(dim, start, n), piece)
    assert view.untyped_storage().nbytes() <= full.numel() * 4
    if dim > 0:  # the storage is the piece plus at most one row of the full tensor
        assert view.untyped_storage().nbytes() < (piece.numel() + full[0].numel()) * 4 + 4


def test_full_shaped_refuses_a_piece_of_another_shape() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        full_shaped(torch.zeros(3, 5), (6, 8), 0, 0)


def test_piece_dims_go_whole_where_vllm_splits_otherwise() -> None:
    shapes = {"embed.weight": (259, 8), "q.weight": (8, 8), "o.weight": (8, 8), "norm.weight": (8,), "k.weight": (2, 8)}
    # vLLM at tp 2, rank 0: the vocabulary padded to 320, 160 rows each; q and o even halves;
    # k: one KV head replicated on both ranks (rows [0, 2) everywhere)
    rows = {"embed.weight": (0, 0, 160), "q.weight": (0, 0, 4), "o.weight": (1, 0, 4), "k.weight": (0, 0, 2)}
    dims = piece_dims(shapes, {"q.weight": 0, "o.weight": 1}, rows, 2, 0)
    assert dims == {"embed.weight": None, "q.weight": 0, "o.weight": 1, "norm.weight": None, "k.weight": None}
    # a vocabulary that is a multiple of 64·tp splits evenly: pieces
    assert piece_dims({"embed.weight": (384, 8)}, {}, {"embed.weight": (0, 192, 384)}, 2, 1) == {"embed.weight": 0}
    # training split along another dim than vLLM's: whole
    assert piece_dims({"q.weight": (8, 8)}, {"q.weight": 1}, {"q.weight": (0, 0, 4)}, 2, 0) == {"q.weight": None}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_tp2_fed_pieces_builds_the_weights_a_full_push_builds(tmp_path: Path) -> None:
    skip_without_vllm("vLLM pieces test", smollm2=False)
    model_dir = tmp_path / "model"
    write_model(model_dir)  # vocabulary 259: vLLM pads it per partition, so embedding and head go whole
    results = run_ranks(vllm_pieces, 2, tmp_path, model_dir=str(model_dir))
    for rank, res in enumerate(results):
        print(rank, res["metrics"], res["full_metrics"], res["whole"])
        assert res["linear_layers"], f"rank {rank}: no linear layer was loaded"
        assert res["linear_changed"], f"rank {rank}: a layer kept the checkpoint's weights (the push did not land)"
        assert res["linear_equal"], f"rank {rank}: the fused per-rank weights differ from a full push's"
        assert res["own_equal"], f"rank {rank}: embedding / norms / head differ from a full push's"
        assert res["tokens_equal"] and res["logprob_diff"] == 0.0, f"rank {rank}: {res['logprob_diff']}"
        assert res["checksums"][0] == res["checksums"][1]
        assert res["whole"] == ["lm_head.weight", "model.embed_tokens.weight"]
        m, naive = res["metrics"], res["full_metrics"]
        # equal layouts: the generation pieces are the training pieces; vLLM gets half of each
        # split matrix's bytes instead of the whole model
        assert m["reshard/bytes_received"] == 0 and m["reshard/whole_params"] == 2
        assert m["reshard/pushed_mb"] < 0.75 * naive["reshard/pushed_mb"]


def test_bench_reshard_vllm_refuses_strided_pairs_and_judges_its_targets(capsys: pytest.CaptureFixture[str]) -> None:
    from hfrt.bench import reshard, reshard_vllm

    with pytest.raises(SystemExit):
        reshard.main(["--vllm", "--pairs", "t4p1d1:t2p1d2"])
    assert "consecutive ranks" in capsys.readouterr().err
    rank = {"time": [0.1], "naive_time": [0.2], "peak": [1.0], "naive_peak": [2.0], "micro_dp": 2, "bytes": [30.0],
            "naive_bytes": [90.0], "stats_bytes": 30.0, "pushed_mb": 1.0, "naive_pushed_mb": 2.0, "whole": [],
            "tokens_equal": True, "logprob_diff": 0.0}  # fmt: skip
    case = reshard_vllm.summarize("llama-small", "t2p2d1:t2p1d2", [rank, dict(rank, bytes=[40.0])])
    assert case["bytes_per_rank"] == 40.0 and case["targets"]["bytes_le_naive_over_tg"]  # 40 <= 90 / 2
    assert not case["targets"]["bytes_counted_match_exchange_stats"]  # the busiest rank's count is not the exchange's
