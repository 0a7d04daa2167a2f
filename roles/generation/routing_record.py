"""Recording the experts each token was routed to while the HF engine samples (routing replay's
rollout side), and fitting the record to the rollout's fixed widths.

A `Recorder` hooks every supported router of the generation model (training/router_replay.py's
SUPPORTED) and keeps each call's top-k ids: the prefill gives every prompt position, each decode
step one more position per row. `routed_experts` is [rows, P + R, layers, k], aligned with
`input_ids`, in router_replay.column_dtype (1 byte per id below 255 experts): layers × k bytes per
token (Qwen3-30B-A3B: 48 × 8 = 384 B). Positions that were never a model input (padding, tokens
after a row finished, the last sampled token) hold "not recorded". It knows nothing of training,
losses or the wire.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hfrt.roles.training import router_replay

#: the engine output key (and rollout column) of the record
ROUTED_EXPERTS = router_replay.ROUTED_EXPERTS


class Recorder:
    """Forward hooks on `model`'s routers keeping each call's top-k ids (on the model's device until
    `routed` gathers them to the CPU), while `recording`."""

    def __init__(self, model: nn.Module, where: str = "router_replay") -> None:
        router_replay.check_model(model, where)
        self.layers, self.k, experts = router_replay.shape_of(model)
        self.dtype = router_replay.column_dtype(experts)
        self._calls: list[list[torch.Tensor]] = [[] for _ in range(self.layers)]
        self._on = False
        for layer, router in enumerate(router_replay.routers(model)):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._on:
                self._calls[layer].append(output[2].detach().to(self.dtype))  # on its device: no sync per step

        return hook

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Keep the routers' choices of the forwards inside (earlier ones are dropped)."""
        self._calls = [[] for _ in range(self.layers)]
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def routed(self, rows: int, attention_mask: torch.Tensor) -> torch.Tensor:
        """[rows, T, layers, k] of the recorded calls (a prefill over the prompt, then one position
        per decode step), T = attention_mask's width (prompt + responses): "not recorded" where the
        mask is 0 and past the last recorded position."""
        per_layer = [torch.cat([c.reshape(rows, -1, self.k) for c in calls], dim=1).cpu() for calls in self._calls]
        got = torch.stack(per_layer, dim=2)  # [rows, positions, layers, k]
        width = int(attention_mask.shape[1])
        fill = router_replay.not_recorded(self.dtype)
        out = torch.full((rows, width, self.layers, self.k), fill, dtype=self.dtype)
        out[:, : min(width, got.shape[1])] = got[:, :width]
        out[~attention_mask.bool().cpu()] = fill
        return out


def fit(routed: torch.Tensor, engine_prompt_width: int, prompt_width: int, response_width: int) -> torch.Tensor:
    """An engine's `routed_experts` ([rows, P + R', layers, k], P = `engine_prompt_width`) at the
    rollout's widths: prompt columns left-padded to `prompt_width`, response columns right-padded
    (or cut) to `response_width`, the new columns "not recorded"."""
    fill = router_replay.not_recorded(routed.dtype)
    rows, _, layers, k = routed.shape
    out = torch.full((rows, prompt_width + response_width, layers, k), fill, dtype=routed.dtype)
    prompt, response = routed[:, :engine_prompt_width], routed[:, engine_prompt_width:][:, :response_width]
    out[:, prompt_width - engine_prompt_width : prompt_width] = prompt
    out[:, prompt_width : prompt_width + response.shape[1]] = response
    return out
