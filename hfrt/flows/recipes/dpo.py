"""The `dpo` flow: direct preference optimisation of the actor on preference pairs (the `rm` flow's
data format, hfrt/flows/pairs.py) against a frozen reference — a reference daemon, or with LoRA on
the actor the actor itself with its adapters off (hfrt.flows.reference) — with TRL's losses
(sigmoid, ipo, hinge, robust; beta, label_smoothing: hfrt.wire.loss_options.PreferenceLoss) and
metric names (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/...).
Held-out pairs are scored the same way; checkpoints, resume and the export are hfrt.flows.offline's.

A step: the reference's summed log-probs of the step's pairs (started while the previous step's
update ran: RefAhead), then one actor update. Pairs travel as text, one row per pair, so the
dispatch never splits a pair across ranks, and the actor keeps each pair in one micro-batch. It
knows the actor's and the reference's endpoints; nothing of tokenizers or engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from hfrt.flows.metrics import reduce_rank_metrics
from hfrt.flows.offline import OfflineConfig, OfflineLoop, Rows
from hfrt.flows.pairs import PairDataError, addition_pairs, columns, read_pairs, split_pairs
from hfrt.flows.timing import Stage, StageTimer
from hfrt.flows.trainer import get_roles
from hfrt.protocols import BatchHandle
from hfrt.wire.loss_options import check_preference_options
from hfrt.wire.role_views import Actor, Reference

#: The embedded default: the tiny preset as the policy and as its frozen reference.
ROLES: dict[str, dict[str, Any]] = {
    "actor": {"impl": "actor", "options": {"model": "tiny", "engine": {"micro_batch_size": 32, "optim": {"lr": 2e-3}}}},
    "reference": {"impl": "reference", "options": {"model": "tiny", "engine": {"micro_batch_size": 32}}},
}


@dataclass(frozen=True)
class DPOConfig(OfflineConfig):
    """The `dpo` flow's settings (the `#:` comment above a field is its description)."""

    #: the pair file (JSONL / JSON / Parquet rows of prompt, chosen, rejected; hfrt/flows/pairs.py);
    #: "" makes pairs for the built-in addition task from its rule reward (hfrt.flows.pairs.addition_pairs)
    data: str = ""
    #: pairs made for the addition task when data is ""
    pairs_count: int = 4000
    #: the addition task's largest addend when data is ""
    max_operand: int = 2
    #: pairs per optimizer step, over all data-parallel ranks
    pairs_per_step: int = 32
    #: the preference loss: sigmoid (DPO; cDPO with label_smoothing), ipo, hinge or robust (TRL's formulas)
    loss_type: str = "sigmoid"
    #: the strength of the implicit KL to the reference (IPO's τ)
    beta: float = 0.1
    #: the assumed share of flipped labels (sigmoid and robust), in [0, 0.5)
    label_smoothing: float = 0.0
    #: with LoRA on the actor (roles.actor.options.lora) the reference log-probs are the actor's
    #: with its adapters off, and no reference daemon is launched (hfrt.flows.reference); false
    #: keeps the reference role. No effect without LoRA
    reference_from_actor: bool = True

    FLOW: ClassVar[str] = "dpo"
    PER_STEP: ClassVar[str] = "pairs_per_step"

    def __post_init__(self) -> None:
        try:
            self.loss_options()
        except ValueError as exc:
            raise ValueError(f"config: {exc}") from None
        super().__post_init__()

    def loss_options(self) -> dict[str, Any]:
        """The actor's dpo_update / dpo_evaluate loss options, checked."""
        options = {"loss_type": self.loss_type, "beta": self.beta, "label_smoothing": self.label_smoothing}
        check_preference_options(options, "dpo")
        return options

    def rows(self) -> tuple[Rows, Rows]:
        if self.pairs_count < 2 or self.max_operand < 0:
            raise ValueError(f"config pairs_count={self.pairs_count!r}, max_operand={self.max_operand!r}: "
                             "need at least 2 pairs and a non-negative addend")
        try:
            rows = read_pairs(self.data) if self.data else addition_pairs(self.pairs_count, self.seed, self.max_operand)
            for number, row in enumerate(rows, start=1):
                row.setdefault("margin", 0.0)
                row.setdefault("row", number)
            if self.val_data:
                return rows, read_pairs(self.val_data)
            return split_pairs(rows, self.val_fraction, self.seed)
        except PairDataError as exc:
            raise ValueError(f"config data: {exc}") from None


Config = DPOConfig


class RefAhead:
    """The reference's log-probs of step i + 1's pairs, started while step i's update runs (start
    early, await late); the loop that uses it:

        ref = await ahead.take(step, batch)   # started during the previous step, or now
        ahead.start(step + 1)                 # overlaps this step's update
        await actor.dpo_update(batch, ref)

    `close()` waits for a call still running (a run that stopped early), so none is left behind."""

    def __init__(self, compute: Callable[[BatchHandle], Awaitable[Any]], batch_for: Callable[[int], BatchHandle], steps: int) -> None:
        self.compute, self.batch_for, self.steps = compute, batch_for, steps
        self.pending: tuple[int, Awaitable[Any]] | None = None

    async def take(self, step: int, batch: BatchHandle) -> Any:
        if self.pending is not None and self.pending[0] == step:
            call, self.pending = self.pending[1], None
            return await call
        await self.close()
        return await self.compute(batch)

    def start(self, step: int) -> None:
        if step < self.steps:
            self.pending = (step, self.compute(self.batch_for(step)))

    async def close(self) -> None:
        if self.pending is not None:
            call, self.pending = self.pending[1], None
            with contextlib.suppress(Exception):
                await call


async def flow(ctl: Any, config: DPOConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = DPOConfig.read(config)
    train, val = cfg.rows()
    roles = await get_roles(ctl, "actor", "reference")
    actor: Actor = roles["actor"]
    reference: Reference = roles["reference"]
    loop = OfflineLoop(cfg, trained={"actor": actor}, actor=actor, train=train, val=val, columns=columns, ctl=ctl)
    loss = cfg.loss_options()

    def ref_log_probs(batch: BatchHandle) -> Awaitable[Any]:
        return reference.compute_pair_log_probs(batch, max_length=cfg.max_length)

    val_batch = loop.val_batch()
    val_ref = await ref_log_probs(val_batch)  # the reference is frozen: one pass for the whole run
    ahead = RefAhead(ref_log_probs, loop.batch_for, loop.steps)

    async def step(index: int, batch: BatchHandle, t: StageTimer) -> dict[str, float]:
        ref = await t.one(Stage.REFERENCE, ahead.take(index, batch))
        ahead.start(index + 1)
        return reduce_rank_metrics(await t.one(Stage.UPDATE, actor.dpo_update(batch, ref, max_length=cfg.max_length, **loss)))

    async def validate() -> dict[str, float]:
        return reduce_rank_metrics(await actor.dpo_evaluate(val_batch, val_ref, max_length=cfg.max_length, **loss))

    try:
        return await loop.run(step, validate)
    finally:
        await ahead.close()
