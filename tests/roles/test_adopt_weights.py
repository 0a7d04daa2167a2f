"""HFGenerationEngine.adopt_weights: the generation model takes tensors as its parameters without
copying them (same storage), converts only another dtype, names what is wrong, and sleep drops
the adopted storage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hfrt.roles.generation.hf import HFGenerationEngine


def engine() -> HFGenerationEngine:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2, bias=False))
    gen = HFGenerationEngine(model, pad_token_id=0, eos_token_id=None, device=torch.device("cpu"))
    gen.sleep()
    return gen


def pieces(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {"0.weight": torch.randn(4, 3).t(), "0.bias": torch.randn(3), "1.weight": torch.randn(2, 3).to(dtype)}


def test_adopted_tensors_are_the_parameters_storage() -> None:
    gen, named = engine(), pieces()
    assert gen.adopt_weights(named.items()) == 0
    params = dict(gen.model.named_parameters())
    for name, tensor in named.items():  # a non-contiguous view is kept as it is
        assert params[name].untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr(), name
        assert torch.equal(params[name], tensor)
    assert gen.awake
    gen.sleep()
    assert all(p.numel() == 0 for p in gen.model.parameters())


def test_another_dtype_is_converted_and_counted() -> None:
    gen, named = engine(), pieces(torch.float64)
    assert gen.adopt_weights(named.items()) == 2 * 3 * 4  # the float64 weight, as float32
    assert gen.model[1].weight.dtype == torch.float32


def test_wrong_shape_unknown_name_and_missing_parameter_are_named() -> None:
    named = pieces()
    with pytest.raises(ValueError, match=r"0.bias is \(4,\), the generation model wants \(3,\)"):
        engine().adopt_weights((named | {"0.bias": torch.zeros(4)}).items())
    with pytest.raises(KeyError, match="no parameter 'extra'"):
        engine().adopt_weights((named | {"extra": torch.zeros(1)}).items())
    with pytest.raises(KeyError, match=r"no tensor came for \['1.weight'\]"):
        engine().adopt_weights((n, t) for n, t in named.items() if n != "1.weight")
