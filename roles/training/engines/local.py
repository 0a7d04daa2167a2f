"""The single-process training engine: plain module, AdamW, no sharding.

Used for one-rank roles (a frozen reference, a small critic) and as the reference the sharded
backends are tested against. It knows nothing of process groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hfrt.roles.models import transformer_blocks
from hfrt.roles.training.engines.base import EngineConfig, TrainEngine, named_buckets, optimizer_and_scheduler


class LocalEngine(TrainEngine):
    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        super().__init__(model, config)
        self.model.to(self.device)
        self.optimizer, self.scheduler = optimizer_and_scheduler(model, config)

    @property
    def forward_module(self) -> nn.Module:
        return self.model

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.mixed_precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _optimizer_step(self) -> float:
        assert self.optimizer is not None and self.scheduler is not None
        limit = self.config.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit if limit > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        return float(norm)

    def _gathered_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        params = dict(self.model.named_parameters())
        for _, names in named_buckets(self.model, transformer_blocks(self.model)):
            yield {name: params[name].detach() for name in names}

    def _model_state(self) -> dict[str, Any]:
        """The model's state dict; with LoRA only what trains (the base is the model option's)."""
        state = self.model.state_dict()
        if self.lora is not None:
            trains = {n for n, p in self.model.named_parameters() if p.requires_grad}
            state = {k: v for k, v in state.items() if k in trains}
        return state

    def _save_into(self, folder: Path) -> None:
        state: dict[str, Any] = {"model": self._model_state()}
        if self.optimizer is not None and self.scheduler is not None:
            state |= {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        torch.save(state, folder / "local.pt")

    def _load_from(self, folder: Path) -> None:
        state = torch.load(folder / "local.pt", map_location=self.device, weights_only=True)
        if self.lora is not None:
            from hfrt.roles.training.lora import check_saved_state

            check_saved_state(self.model, state["model"], str(folder))
        self.model.load_state_dict(state["model"], strict=self.lora is None)
        if self.optimizer is not None and self.scheduler is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
