"""The reward-model trainer role daemon: a value model (causal-LM backbone + scalar head, as the
critic's) trained on preference pairs with the Bradley-Terry loss -log sigmoid(r_chosen -
r_rejected - margin), evaluated by pair accuracy, and exported as a Hugging Face
*ForSequenceClassification folder (num_labels = 1) that the reward role serves.

Options (beyond roles/common.py's): `score_at` ("last" | "mean", roles/reward_scores.py; serve the
model with the same), `append_eos` (default true: the tokenizer's EOS ends every response that
does not end with it, as OpenRLHF does; the actor's responses end with EOS too), `max_length`
(default 1024 tokens per prompt + response; a longer pair is an error naming its row).
Rows arrive as the pairs' text (`prompt`, `chosen`, `rejected`, optional `margin`, `row`); the
daemon tokenises them like the actor does its prompts. It knows nothing of data files or steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.batch import Batch
from hfrt.roles.common import (
    CheckpointEndpoints,
    ModelOptions,
    build_engine,
    check_backend,
    check_options,
    close_group,
    needs_group,
    prepare_process,
    role_errors,
)
from hfrt.roles.generation.batches import encode_prompt
from hfrt.roles.losses import LossScale
from hfrt.roles.models import export_sequence_classifier, load_tokenizer, resolve_model_dir
from hfrt.roles.reward_scores import check_score_at, pool_scores
from hfrt.roles.rows import Tensors, all_reduce, equal_rows, unpad
from hfrt.roles.training.engines import ForwardOutput
from hfrt.wire.endpoints import Dispatch, endpoint

OPTIONS = frozenset({"score_at", "append_eos", "max_length"})


class PairError(ValueError):
    """A preference pair the trainer cannot use; the message names its data row."""


def _is_chat(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and all(isinstance(m, Mapping) for m in value)


def response_ids(tokenizer: Any, prompt: Any, prompt_ids: list[int], response: Any, where: str) -> list[int]:
    """Token ids of one response after its prompt: text is tokenised as is; a chat (assistant
    message(s)) is rendered after the prompt's messages with the chat template and cut after the
    prompt's own rendering."""
    if isinstance(response, str):
        return list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if _is_chat(response):
        if not _is_chat(prompt):
            raise PairError(f"{where}: a chat response needs a chat prompt (a list of messages)")
        rendered = tokenizer.apply_chat_template(list(prompt) + list(response), add_generation_prompt=False)
        full = list(rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)
        if full[: len(prompt_ids)] != prompt_ids:
            raise PairError(f"{where}: the chat template renders the prompt differently once the response follows it")
        return full[len(prompt_ids):]
    raise PairError(f"{where}: a response must be text or a list of messages, not {type(response).__name__}")


class RewardModelDaemon(CheckpointEndpoints, Daemon):
    """Endpoints: update, evaluate (SPLIT; rows are pairs); export_hf, save, load (REPLICATE)."""

    #: whether setup joined the role's process group (teardown leaves it); False until it does
    _joined: bool = False

    @classmethod
    def check_config(cls, context: DaemonContext) -> None:
        check_options(context, OPTIONS)
        check_score_at(context.options.get("score_at", "last"), "reward_model option")
        max_length = context.options.get("max_length", 1024)
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
            raise ValueError(f"option max_length={max_length!r}: must be a whole number >= 2")
        check_backend(context, ModelOptions.read(context.options, trainable=True).engine)

    async def setup(self) -> None:
        with role_errors(self.context):
            ctx = self.context
            self.check_config(ctx)
            self.opts = ModelOptions.read(ctx.options, trainable=True)
            self.score_at = str(ctx.options.get("score_at", "last"))
            self.append_eos = bool(ctx.options.get("append_eos", True))
            self.max_length = int(ctx.options.get("max_length", 1024))
            self._joined = prepare_process(ctx, needs_group=needs_group(ctx, self.opts.engine))
            self.engine = build_engine(ctx, self.opts, value_head=True)
            self.engine.rows_together = 2  # a token budget keeps each chosen / rejected pair in one micro-batch
            self.engine.columns_past_response = 1  # the score is the output at the last response token
            self.tokenizer = load_tokenizer(self.opts.model, self.opts.seed)
            self.moments: dict[str, float] = {}  # the last evaluation's score mean / std, for export

    async def teardown(self) -> None:
        close_group(self._joined)

    # ---------------------------------------------------------------------------- tokenising

    def _encode(self, batch: Batch) -> Tensors:
        """Rows 2i / 2i+1: pair i's chosen / rejected, prompt left-padded to P, response right-padded
        to R + 1 (one column more than the longest, so column L of the shifted values is the
        output at the last response token); `margin` and `pair_weight` per row."""
        cols = batch.non_tensor
        missing = [c for c in ("prompt", "chosen", "rejected") if c not in cols]
        if missing:
            raise KeyError(f"{self.context.role}.update needs non-tensor column(s) {missing}; the batch has {list(cols)}")
        rows = cols.get("row", list(range(len(batch))))
        margins = cols.get("margin", [0.0] * len(batch))
        eos = self.tokenizer.eos_token_id
        seqs: list[tuple[list[int], list[int]]] = []
        for i, prompt in enumerate(cols["prompt"]):
            where = f"pair (data row {rows[i]})"
            prompt_ids = encode_prompt(self.tokenizer, prompt)
            for side in ("chosen", "rejected"):
                ids = response_ids(self.tokenizer, prompt, prompt_ids, cols[side][i], f"{where} {side}")
                if self.append_eos and eos is not None and (not ids or ids[-1] != eos):
                    ids.append(eos)
                if len(prompt_ids) + len(ids) > self.max_length:
                    raise PairError(f"{where} {side}: {len(prompt_ids) + len(ids)} tokens, over max_length {self.max_length}")
                seqs.append((prompt_ids, ids))
        pad = self.tokenizer.pad_token_id
        width_p = max(len(p) for p, _ in seqs)
        width_r = max(len(r) for _, r in seqs) + 1
        input_ids = torch.full((len(seqs), width_p + width_r), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        response_mask = torch.zeros((len(seqs), width_r), dtype=torch.long)
        for row, (p, r) in enumerate(seqs):
            input_ids[row, width_p - len(p) : width_p] = torch.tensor(p, dtype=torch.long)
            input_ids[row, width_p : width_p + len(r)] = torch.tensor(r, dtype=torch.long)
            mask[row, width_p - len(p) : width_p + len(r)] = 1
            response_mask[row, : len(r)] = 1
        margin = torch.tensor([float(m or 0.0) for m in margins], dtype=torch.float32).repeat_interleave(2)
        return {
            "input_ids": input_ids, "attention_mask": mask, "responses": input_ids[:, width_p:], "response_mask": response_mask,
            "margin": margin, "pair_weight": torch.ones(len(seqs)),
        }

    def _equal(self, tensors: Tensors, endpoint: str) -> tuple[Tensors, int]:
        padded, pad = equal_rows(tensors, endpoint)  # pads are whole pairs: every rank has 2 x pairs rows
        if pad:
            padded["pair_weight"] = padded["pair_weight"].clone()
            padded["pair_weight"][-pad:] = 0.0
        return padded, pad

    def _pair_terms(self, values: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scores = pool_scores(values, mb["response_mask"][:, :-1], self.score_at)
        diff = scores[0::2] - scores[1::2]
        weight = mb["pair_weight"][0::2].to(diff.device)
        loss = -F.logsigmoid(diff - mb["margin"][0::2].to(diff.device))
        return {"scores": scores, "diff": diff, "weight": weight, "loss": loss}

    # ---------------------------------------------------------------------------- endpoints

    @endpoint(dispatch=Dispatch.SPLIT)
    def update(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on this call's pairs (all ranks' pairs: the loss is their mean).
        Returns rm/loss, rm/accuracy, rm/margin_mean, rm/grad_norm, rm/lr, the same on every rank."""
        padded, _ = self._equal(self._encode(batch), f"{self.context.role}.update")
        [pairs] = all_reduce([float(padded["pair_weight"].sum()) / 2])
        sums = {"correct": 0.0, "margin": 0.0}
        dp = self.engine.dp_size

        def loss_fn(out: ForwardOutput, mb: Any, _: LossScale) -> tuple[torch.Tensor, dict[str, Any]]:
            assert out.values is not None
            t = self._pair_terms(out.values, mb)
            d = t["diff"].detach()
            sums["correct"] += float(((d > 0).float() * t["weight"]).sum())
            sums["margin"] += float((d * t["weight"]).sum())
            return (t["loss"] * t["weight"]).sum() / max(pairs, 1.0) * dp, {}

        micro = max(2, self.engine.config.micro_batch_size + self.engine.config.micro_batch_size % 2)
        metrics = self.engine.step(loss_fn, padded, micro)
        correct, margin = all_reduce([sums["correct"], sums["margin"]])
        return {
            "rm/loss": metrics["loss"], "rm/accuracy": correct / max(pairs, 1.0), "rm/margin_mean": margin / max(pairs, 1.0),
            "rm/grad_norm": metrics["grad_norm"], "rm/lr": metrics["lr"], "rm/pairs": pairs,
        }

    @endpoint(dispatch=Dispatch.SPLIT)
    def evaluate(self, batch: Batch) -> dict[str, float]:
        """Held-out pairs scored without training: val/accuracy (chosen scored above rejected; a
        tie counts as wrong), val/margin_mean (r_chosen - r_rejected), val/loss, val/score_mean and
        val/score_std (over both sides; kept for export as the model's `mean` / `std`)."""
        tensors = self._encode(batch)
        padded, pad = self._equal(tensors, f"{self.context.role}.evaluate")
        out = self.engine.forward(padded)
        assert out.values is not None
        t = self._pair_terms(unpad(out.values, pad), unpad_map(padded, pad))
        scores = t["scores"].double()
        n, correct, margin, loss, total, squares = all_reduce([
            float(len(t["diff"])), float((t["diff"] > 0).sum()), float(t["diff"].sum()), float(t["loss"].sum()),
            float(scores.sum()), float((scores * scores).sum()),
        ])
        mean = total / max(2 * n, 1.0)
        std = max(squares / max(2 * n, 1.0) - mean * mean, 0.0) ** 0.5
        self.moments = {"mean": mean, "std": std}
        return {
            "val/accuracy": correct / max(n, 1.0), "val/margin_mean": margin / max(n, 1.0),
            "val/loss": loss / max(n, 1.0), "val/score_mean": mean, "val/score_std": std, "val/pairs": n,
        }

    @endpoint(dispatch=Dispatch.REPLICATE)
    def export_hf(self, path: str) -> str:
        """Write the model as a *ForSequenceClassification folder (num_labels = 1) with the base
        model's tokenizer; config.json also holds `mean` / `std` (the last evaluation's scores,
        OpenRLHF's names) and `hfrt_score_at`. Every rank gathers the weights; rank 0 writes."""
        keep = self.context.rank == 0
        weights: dict[str, torch.Tensor] = {}
        for bucket in self.engine.state_dict_for_generation():
            if keep:
                weights.update({name: t.detach().to("cpu", torch.float32, copy=True) for name, t in bucket.items()})
        if keep:
            # the Bradley-Terry loss cannot see a constant: the head's bias (moved only by Adam
            # amplifying rounding noise) is dropped, which shifts every score, and the mean, by it
            bias = float(weights.pop("value_head.bias", torch.zeros(1)).reshape(-1)[0])
            moments = {"mean": self.moments["mean"] - bias, "std": self.moments["std"]} if self.moments else {}
            extra: dict[str, Any] = {"hfrt_score_at": self.score_at, **moments}
            export_sequence_classifier(resolve_model_dir(self.opts.model, self.opts.seed), weights, Path(path), extra)
        return str(path)


def unpad_map(tensors: Mapping[str, torch.Tensor], pad: int) -> dict[str, torch.Tensor]:
    return {k: unpad(v, pad) for k, v in tensors.items()}
