"""Supervised fine-tuning and preference (DPO-family) training of a causal LM's training engine on
text rows: the component the actor holds for its `sft_*` and `dpo_*` endpoints, and the pair
log-probs a reference computes for them.

- SFT: the rows tokenised as TRL's SFTTrainer does (training/sequences.py), one optimizer step on
  the token-mean negative log-likelihood of the counted tokens over every rank's rows; evaluation
  gives that loss and the token accuracy (the counted tokens that are their position's top-1).
- Preference: rows are pairs (prompt, chosen, rejected) with the reference's summed log-probs of
  each side (`ref_chosen_logps`, `ref_rejected_logps`); rows 2i / 2i+1 are pair i's chosen /
  rejected, a token budget keeps them in one micro-batch (engine.rows_together = 2), and the loss
  is the mean over every rank's pairs of hfrt.roles.losses.preference. The dispatch splits the
  pair rows, so a pair never spans ranks.

Every function is collective over the role's ranks (equal rows, reduced sums). It knows tokenising,
the losses and the engine contract; nothing of data files, steps or the wire.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from hfrt.daemon.batch import Batch
from hfrt.roles.losses import LossScale, agg_loss
from hfrt.roles.losses.preference import METRICS, preference_loss, preference_terms
from hfrt.roles.rows import Tensors, all_reduce, equal_rows, unpad
from hfrt.roles.training.engines import ForwardOutput, LossFn, TrainEngine
from hfrt.roles.training.sequences import (
    TRUNCATIONS,
    TokenRow,
    check_length,
    layout,
    pair_rows,
    sft_row,
    truncate_right,
)
from hfrt.roles.training.updates import UpdateSchedule, accumulate, run_updates
from hfrt.wire.loss_options import PreferenceLoss

#: the reference's columns a preference update reads, one value per pair
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad if pad is not None else 0)


def _rows(batch: Batch) -> list[Any]:
    return list(batch.non_tensor.get("row", range(len(batch))))


def sft_tensors(tokenizer: Any, batch: Batch, max_length: int | None, endpoint: str,
                truncation: str = "error") -> tuple[Tensors, int]:
    """The engine batch of SFT rows (columns messages, or prompt and completion / response) and how
    many rows were over max_length: cut to it with truncation "right", refused with "error"."""
    if truncation not in TRUNCATIONS:
        raise ValueError(f"{endpoint}: truncation={truncation!r}: use one of {', '.join(TRUNCATIONS)}")
    cols = batch.non_tensor
    if "messages" not in cols and "prompt" not in cols:
        raise KeyError(f"{endpoint} needs non-tensor column(s) messages, or prompt and completion; the batch has {list(cols)}")
    seqs: list[TokenRow] = []
    cut = 0
    for i, number in enumerate(_rows(batch)):
        row = {k: v[i] for k, v in cols.items()}
        where = f"{endpoint}: data row {number}"
        seq = sft_row(tokenizer, row, where)
        if truncation == "right" and max_length is not None and len(seq) > max_length:
            seq, cut = truncate_right(seq, max_length), cut + 1
        seqs.append(check_length(seq, max_length, where))
    return layout(seqs, _pad_id(tokenizer)), cut


def pair_tensors(tokenizer: Any, batch: Batch, max_length: int | None, endpoint: str) -> Tensors:
    """The engine batch of pairs: rows 2i / 2i+1 pair i's chosen / rejected, `pair_weight` 1 per
    row, and `ref_logps` (each side's reference log-prob) when the batch has REF_COLUMNS."""
    cols = batch.non_tensor
    missing = [c for c in ("prompt", "chosen", "rejected") if c not in cols]
    if missing:
        raise KeyError(f"{endpoint} needs non-tensor column(s) {missing}; the batch has {list(cols)}")
    seqs: list[TokenRow] = []
    for i, number in enumerate(_rows(batch)):
        where = f"{endpoint}: pair (data row {number})"
        for side, name in zip(pair_rows(tokenizer, cols["prompt"][i], cols["chosen"][i], cols["rejected"][i], where),
                              ("chosen", "rejected"), strict=True):
            seqs.append(check_length(side, max_length, f"{where} {name}"))
    tensors = layout(seqs, _pad_id(tokenizer)) | {"pair_weight": torch.ones(len(seqs))}
    if all(c in batch.tensors for c in REF_COLUMNS):
        ref = torch.stack([batch.tensors[c].float().reshape(-1) for c in REF_COLUMNS], dim=1)  # [pairs, 2]
        tensors["ref_logps"] = ref.reshape(-1)
    return tensors


def equal_pairs(tensors: Tensors, endpoint: str) -> tuple[Tensors, int]:
    """Rows padded to the group's largest count (every rank has 2 × its pairs, so whole pairs);
    padding pairs weigh 0."""
    padded, pad = equal_rows(tensors, endpoint)
    if pad:
        padded["pair_weight"] = padded["pair_weight"].clone()
        padded["pair_weight"][-pad:] = 0.0
    return padded, pad


def sequence_log_probs(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-prob over its counted tokens [rows]."""
    return (log_probs * mask.to(log_probs.dtype)).sum(dim=-1)


@contextlib.contextmanager
def pairs_together(engine: TrainEngine) -> Iterator[None]:
    """The engine keeps rows 2i, 2i+1 in one micro-batch inside (restored after)."""
    before = engine.rows_together
    engine.rows_together = 2
    try:
        yield
    finally:
        engine.rows_together = before


def pair_log_probs(engine: TrainEngine, tokenizer: Any, batch: Batch, endpoint: str, max_length: int | None = None) -> Batch:
    """Each pair's summed log-probs of its chosen and rejected completion under `engine`'s model
    (a reference's, or a LoRA actor's with its adapters off): `ref_chosen_logps`, `ref_rejected_logps` [pairs]."""
    tensors = pair_tensors(tokenizer, batch, max_length, endpoint)
    padded, pad = equal_rows({k: v for k, v in tensors.items() if k != "pair_weight"}, endpoint)
    out = engine.forward(padded)
    assert out.log_probs is not None
    sums = sequence_log_probs(unpad(out.log_probs, pad), tensors["response_mask"]).reshape(-1, 2)
    return Batch({REF_COLUMNS[0]: sums[:, 0].contiguous(), REF_COLUMNS[1]: sums[:, 1].contiguous()})


class TextTraining:
    """SFT and preference updates and evaluations of `engine` (a causal LM) on text rows tokenised
    with `tokenizer`; `role` names the endpoints in errors."""

    def __init__(self, engine: TrainEngine, tokenizer: Any, role: str) -> None:
        self.engine, self.tokenizer, self.role = engine, tokenizer, role

    # ------------------------------------------------------------------------------ SFT

    def sft_update(self, batch: Batch, *, max_length: int | None = None, micro_batch_size: int | None = None,
                   truncation: str = "error") -> dict[str, float]:
        """One optimizer step on the rows: sft/loss (token-mean NLL over every rank's counted
        tokens), sft/token_accuracy, sft/tokens, sft/truncated_rows (rows cut to max_length),
        sft/grad_norm, sft/lr; the same on every rank."""
        endpoint = f"{self.role}.sft_update"
        tensors, cut = sft_tensors(self.tokenizer, batch, max_length, endpoint, truncation)
        [tokens, truncated] = all_reduce([float(tensors["response_mask"].sum()), float(cut)], group=self.engine.dp_group)

        def make(scale: LossScale, shares: dict[str, float]) -> LossFn:
            def loss_fn(out: ForwardOutput, mb: Any, _: LossScale) -> tuple[torch.Tensor, dict[str, Any]]:
                assert out.log_probs is not None and out.top1 is not None
                mask = mb["response_mask"]
                accumulate(shares, "sft/token_accuracy", agg_loss(out.top1, mask, "token-mean", scale))
                return agg_loss(-out.log_probs, mask, "token-mean", scale), {}

            return loss_fn

        metrics = run_updates(self.engine, tensors, make, UpdateSchedule(micro_batch_size=micro_batch_size),
                              prefix="sft", endpoint=endpoint, with_top1=True)
        return metrics | {"sft/tokens": tokens, "sft/truncated_rows": truncated}

    def sft_evaluate(self, batch: Batch, *, max_length: int | None = None, truncation: str = "error") -> dict[str, float]:
        """The rows scored without training: val/loss (token-mean NLL), val/token_accuracy,
        val/tokens, val/rows, val/truncated_rows; the same on every rank."""
        endpoint = f"{self.role}.sft_evaluate"
        tensors, cut = sft_tensors(self.tokenizer, batch, max_length, endpoint, truncation)
        padded, pad = equal_rows(tensors, endpoint)
        out = self.engine.forward(padded, with_top1=True)
        assert out.log_probs is not None and out.top1 is not None
        mask = tensors["response_mask"].float()
        nll, correct, tokens, rows, truncated = all_reduce([
            float((-unpad(out.log_probs, pad) * mask).sum()), float((unpad(out.top1, pad) * mask).sum()),
            float(mask.sum()), float(len(mask)), float(cut),
        ], group=self.engine.dp_group)
        return {"val/loss": nll / max(tokens, 1.0), "val/token_accuracy": correct / max(tokens, 1.0),
                "val/tokens": tokens, "val/rows": rows, "val/truncated_rows": truncated}

    # ------------------------------------------------------------------------ preference

    def _pairs(self, batch: Batch, max_length: int | None, endpoint: str) -> tuple[Tensors, int, float]:
        """(the pair tensors padded to equal rows, the padding rows, every rank's pair count)."""
        tensors = pair_tensors(self.tokenizer, batch, max_length, endpoint)
        if "ref_logps" not in tensors:
            raise KeyError(f"{endpoint} needs the reference's columns {list(REF_COLUMNS)} (reference.compute_pair_log_probs "
                           f"of the same pairs); the batch has {batch.keys()}")
        padded, pad = equal_pairs(tensors, endpoint)
        [pairs] = all_reduce([float(padded["pair_weight"].sum()) / 2], group=self.engine.dp_group)
        return padded, pad, pairs

    def _terms(self, log_probs: torch.Tensor, mb: Mapping[str, torch.Tensor], cfg: PreferenceLoss) -> dict[str, torch.Tensor]:
        """Per pair of one micro-batch: its loss, weight and METRICS."""
        seq = sequence_log_probs(log_probs, mb["response_mask"])
        ref = mb["ref_logps"].to(seq.device)
        tokens = mb["response_mask"].sum(dim=-1).to(seq.dtype)
        loss = preference_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], cfg, tokens[0::2], tokens[1::2])
        terms = preference_terms(seq[0::2], seq[1::2], ref[0::2], ref[1::2], cfg.beta)
        return {"loss": loss, "weight": mb["pair_weight"][0::2].to(seq.device), **terms}

    def dpo_update(self, batch: Batch, cfg: PreferenceLoss, *, max_length: int | None = None,
                   micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step on the pairs: dpo/loss (the mean over every rank's pairs), TRL's
        rewards/* and logps/* means, dpo/grad_norm, dpo/lr, dpo/pairs; the same on every rank."""
        endpoint = f"{self.role}.dpo_update"
        padded, _, pairs = self._pairs(batch, max_length, endpoint)
        dp = self.engine.dp_size

        def make(scale: LossScale, shares: dict[str, float]) -> LossFn:
            def loss_fn(out: ForwardOutput, mb: Any, _: LossScale) -> tuple[torch.Tensor, dict[str, Any]]:
                assert out.log_probs is not None
                t = self._terms(out.log_probs, mb, cfg)
                for name in METRICS:
                    accumulate(shares, name, (t[name] * t["weight"]).sum() / max(pairs, 1.0) * dp)
                return (t["loss"] * t["weight"]).sum() / max(pairs, 1.0) * dp, {}

            return loss_fn

        micro = micro_batch_size or self.engine.config.micro_batch_size
        with pairs_together(self.engine):
            metrics = run_updates(self.engine, padded, make, UpdateSchedule(micro_batch_size=max(2, micro + micro % 2)),
                                  prefix="dpo", endpoint=endpoint)
        return metrics | {"dpo/pairs": pairs}

    def dpo_evaluate(self, batch: Batch, cfg: PreferenceLoss, *, max_length: int | None = None) -> dict[str, float]:
        """Held-out pairs scored without training: val/loss and val/ + each of TRL's rewards/* and
        logps/* means, val/pairs; the same on every rank."""
        endpoint = f"{self.role}.dpo_evaluate"
        padded, pad, pairs = self._pairs(batch, max_length, endpoint)
        with pairs_together(self.engine):
            out = self.engine.forward(padded)
        assert out.log_probs is not None
        t = self._terms(out.log_probs, padded, cfg)
        names = ("loss", *METRICS)
        sums = all_reduce([float((t[n] * t["weight"]).sum()) for n in names], group=self.engine.dp_group)
        return {f"val/{n}": v / max(pairs, 1.0) for n, v in zip(names, sums, strict=True)} | {"val/pairs": pairs}

