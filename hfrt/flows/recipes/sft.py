"""The `sft` flow: supervised fine-tuning of the actor on demonstrations — prompt-completion rows or
chat conversations (hfrt/flows/sft_data.py), the loss on the completion / assistant tokens only,
the chat template as the model defines it — one optimizer step per `rows_per_step` rows, held-out
loss and token accuracy, rows over max_length cut to it (truncation, counted in sft/truncated_rows), checkpoints, resume and the Hugging Face export of every flow
(hfrt.flows.offline). The per-token loss is TRL's SFTTrainer's (tests/roles/test_trl_parity.py).

The controller reads and checks the rows and picks each step's; the rows travel as text and the
actor (roles/actor.py's sft_update / sft_evaluate) tokenises and trains them on whatever engine and
LoRA setting its options name (a token budget packs rows: engine.max_tokens_per_micro_batch). It
knows the actor's endpoints; nothing of tokenizers, engines or devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hfrt.flows.metrics import reduce_rank_metrics
from hfrt.flows.offline import OfflineConfig, OfflineLoop, Rows
from hfrt.flows.pairs import split_pairs
from hfrt.flows.sft_data import SFTDataError, addition_demonstrations, read_sft_rows, sft_columns
from hfrt.flows.timing import Stage, StageTimer
from hfrt.flows.trainer import get_roles
from hfrt.protocols import BatchHandle
from hfrt.wire.loss_options import SFT_TRUNCATIONS as TRUNCATIONS
from hfrt.wire.role_views import Actor

#: The embedded default: one local actor on the `tiny` preset (AdamW at 2e-3, as the RL flows').
ROLES: dict[str, dict[str, Any]] = {
    "actor": {"impl": "actor", "options": {"model": "tiny", "engine": {"micro_batch_size": 32, "optim": {"lr": 2e-3}}}},
}


@dataclass(frozen=True)
class SFTConfig(OfflineConfig):
    """The `sft` flow's settings (the `#:` comment above a field is its description)."""

    #: the rows' file (JSONL / JSON / Parquet of prompt + completion, or messages;
    #: hfrt/flows/sft_data.py); "" makes demonstrations of the built-in addition task
    data: str = ""
    #: demonstrations made for the addition task when data is ""
    rows_count: int = 2000
    #: the addition task's largest addend when data is ""
    max_operand: int = 2
    #: rows per optimizer step, over all data-parallel ranks
    rows_per_step: int = 32
    #: a row over max_length tokens: "right" cuts its end, keeping the first max_length tokens
    #: (TRL's truncation_mode="keep_start"; verl's `truncation: right`), counted in
    #: sft/truncated_rows; "error" refuses it, naming the row
    truncation: str = "right"

    FLOW: ClassVar[str] = "sft"

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"config truncation={self.truncation!r}: use one of {', '.join(TRUNCATIONS)}")
        super().__post_init__()

    def rows(self) -> tuple[Rows, Rows]:
        if self.rows_count < 2 or self.max_operand < 0:
            raise ValueError(f"config rows_count={self.rows_count!r}, max_operand={self.max_operand!r}: "
                             "need at least 2 rows and a non-negative addend")
        try:
            rows = read_sft_rows(self.data) if self.data else addition_demonstrations(self.rows_count, self.seed, self.max_operand)
            if self.val_data:
                return rows, read_sft_rows(self.val_data)
            return split_pairs(rows, self.val_fraction, self.seed, noun="row")
        except (SFTDataError, ValueError) as exc:
            raise ValueError(f"config data: {exc}") from None


Config = SFTConfig


async def flow(ctl: Any, config: SFTConfig | dict[str, Any]) -> dict[str, Any]:
    cfg = SFTConfig.read(config)
    train, val = cfg.rows()
    actor: Actor = (await get_roles(ctl, "actor"))["actor"]
    loop = OfflineLoop(cfg, trained={"actor": actor}, actor=actor, train=train, val=val, columns=sft_columns, ctl=ctl)
    val_batch = loop.val_batch()

    async def step(index: int, batch: BatchHandle, t: StageTimer) -> dict[str, float]:
        return reduce_rank_metrics(await t.one(Stage.UPDATE, actor.sft_update(batch, max_length=cfg.max_length, truncation=cfg.truncation)))

    async def validate() -> dict[str, float]:
        return reduce_rank_metrics(await actor.sft_evaluate(val_batch, max_length=cfg.max_length, truncation=cfg.truncation))

    return await loop.run(step, validate)
