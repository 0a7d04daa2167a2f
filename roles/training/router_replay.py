"""Routing replay ("R3") for Qwen3-MoE-style routers: forward hooks that replace each router's
top-k choice by the experts a rollout recorded, and count where the model's own choice differs.

The definition followed is the one verl's Megatron router replay (and Megatron-LM's R3) uses: the
recorded expert ids replace `topk(softmax(logits))`'s indices, and the routing weights are the
router's own softmax probabilities gathered at those ids (renormalised over the k when the model
normalises its top-k, `norm_topk_prob`). The gate therefore still gets its gradient, through the
probabilities of the experts that were actually used — the same path the unpatched router's
gradient takes — so replay changes only *which* experts a token visits, never how the gate learns
from them (a straight-through or detached weight would change the objective the gate optimises).

Supported routers return `(logits, scores, indices)` from softmax → top-k → optional
renormalisation (SUPPORTED); any other MoE block is refused by name (check_model). The recorded
column is `routed_experts` [rows, T, layers, k] (uint8 when the model has fewer than 255 experts,
else int16), aligned with `input_ids`; an id outside [0, num_experts) means "not recorded" (a
padding position, the last sampled token) and the router keeps its own choice there. It knows
nothing of engines, ranks, losses or the wire: model_pass feeds one micro-batch's ids through
`feeding`, the role that installed a RouterReplay reads its tally.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hfrt.roles.training.batching import ROUTED_EXPERTS as ROUTED_EXPERTS  # [rows, T, layers, k], as input_ids

#: router classes whose forward is softmax(logits) → top-k → (norm_topk_prob) renormalise → cast
SUPPORTED = frozenset({"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter"})
#: a config attribute any MoE model of transformers sets (how an unsupported one is recognised)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

#: the current micro-batch's recorded ids as [tokens, layers, k] (model_pass sets it around a forward)
_CURRENT: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("hfrt_routed_experts", default=None)


def routers(model: nn.Module) -> list[nn.Module]:
    """The supported routers of `model`, in layer order."""
    return [m for m in model.modules() if type(m).__name__ in SUPPORTED]


def moe_block_names(model: nn.Module) -> list[str]:
    """Class names of the model's MoE blocks (a module holding `experts`) whose router is not supported."""
    out = []
    for module in model.modules():
        if hasattr(module, "experts") and type(getattr(module, "gate", None)).__name__ not in SUPPORTED:
            out.append(type(module).__name__)
    return sorted(set(out))


def check_model(model: nn.Module, where: str) -> None:
    """ValueError naming the model's MoE block class when routing replay cannot run on it (a block
    whose router is not a SUPPORTED one), or naming the model when it has no MoE router at all."""
    unsupported = moe_block_names(model)
    if unsupported:
        raise ValueError(
            f"{where}: routing replay supports routers {sorted(SUPPORTED)}; this model's MoE block "
            f"{', '.join(unsupported)} routes another way, so its routing cannot be replayed")
    if not routers(model):
        config = getattr(model, "config", None)
        moe = any(getattr(config, name, None) for name in _EXPERT_COUNTS)
        kind = type(model).__name__
        raise ValueError(f"{where}: routing replay needs a mixture-of-experts model with routers {sorted(SUPPORTED)}; "
                         f"{kind} {'routes experts in a way hfrt cannot replay' if moe else 'has no MoE blocks'}")


def shape_of(model: nn.Module) -> tuple[int, int, int]:
    """(MoE layers, k, experts) of the model's routers."""
    found = routers(model)
    first: Any = found[0]
    return len(found), int(first.top_k), int(first.num_experts)


def column_dtype(num_experts: int) -> torch.dtype:
    """uint8 (1 byte per id; 255 = not recorded) below 255 experts, else int16 (-1 = not recorded)."""
    return torch.uint8 if num_experts < 255 else torch.int16


def not_recorded(dtype: torch.dtype) -> int:
    """The fill value meaning "not recorded" in a column of `dtype` (-1 cast: 255 for uint8)."""
    return int(torch.tensor(-1).to(dtype).item())


@contextlib.contextmanager
def feeding(routed: torch.Tensor | None) -> Iterator[None]:
    """Make `routed` ([rows, T, layers, k], the rows and columns of the model's input_ids) the
    recorded ids the installed routers read during the forward inside; None: nothing recorded."""
    flat = None if routed is None else routed.reshape(-1, *routed.shape[-2:])
    token = _CURRENT.set(flat)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class RouterReplay:
    """Forward hooks on every supported router of `model`: with `replay`, its top-k indices become
    the recorded ones (weights: softmax probabilities gathered there, see the module docstring).
    Each (token, layer) with a record is counted, as a set of k experts: whether the experts the
    forward *used* differ from the rollout's (the mismatch replay removes: 0 with replay), and
    whether the router's *own* top-k does (what replay overrides; the same as the first without
    replay). `metrics()` returns the tally since the last call and clears it."""

    def __init__(self, model: nn.Module, *, replay: bool, where: str = "router_replay") -> None:
        check_model(model, where)
        self.replay = replay
        self.where = where
        self.routers = routers(model)
        self._tally: list[torch.Tensor] = []  # [compared, used differ, own differ] per call, on its device (no sync)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def counts(self) -> tuple[int, int, int]:
        """(compared, used routing differs, own top-k differs) over (token, layer) routings since
        the last call, which clears them."""
        if not self._tally:
            return 0, 0, 0
        compared, used, own = torch.stack([t.cpu() for t in self._tally]).sum(0).tolist()
        self._tally = []
        return int(compared), int(used), int(own)

    def metrics(self) -> dict[str, float]:
        """`router_mismatch/share` (the used routing differs), `router_mismatch/own_share` (the
        router's own top-k differs) and `router_mismatch/routings` (compared), since the last call;
        {} when no routing was compared."""
        return mismatch_metrics(*self.counts())

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, _args: Any, output: Any) -> Any:  # a SUPPORTED router
            recorded = _CURRENT.get()
            if recorded is None:
                return None
            logits, _scores, own = output
            if recorded.shape[0] != logits.shape[0] or layer >= recorded.shape[1]:
                raise ValueError(
                    f"{self.where}: the recorded routing covers {recorded.shape[0]} tokens x {recorded.shape[1]} MoE layers, "
                    f"but router {layer} of {len(self.routers)} routes {logits.shape[0]} tokens")
            ids = recorded[:, layer].to(device=own.device, dtype=torch.long)
            valid = ((ids >= 0) & (ids < int(module.num_experts))).all(dim=-1)
            chosen = torch.where(valid[:, None], ids, own) if self.replay else own
            self._count(own, chosen, ids, valid)
            if not self.replay:
                return None
            return logits, replayed_weights(module, logits, chosen), chosen

        return hook

    def _count(self, own: torch.Tensor, chosen: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> None:
        with torch.no_grad():
            recorded = ids.sort(dim=-1).values
            used = (chosen.sort(dim=-1).values != recorded).any(dim=-1) & valid
            mine = (own.sort(dim=-1).values != recorded).any(dim=-1) & valid
            self._tally.append(torch.stack([valid.sum(), used.sum(), mine.sum()]))


def mismatch_metrics(compared: int, used: int, own: int) -> dict[str, float]:
    """The router_mismatch/ metrics of counts (RouterReplay.counts); {} when nothing was compared."""
    if not compared:
        return {}
    return {"router_mismatch/share": used / compared, "router_mismatch/own_share": own / compared,
            "router_mismatch/routings": float(compared)}


def replayed_weights(router: nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The routing weights of experts `chosen` [tokens, k]: softmax(logits) gathered there, in fp32,
    renormalised over the k when the router normalises its top-k, cast back to the logits' dtype —
    what the router computes for its own top-k, so replaying its own choice changes nothing."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)
