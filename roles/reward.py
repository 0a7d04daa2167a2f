"""The reward role daemon: one score per response, placed at its last token — from a rule
function (registry name, `module:function` or `file.py:function`) or from a reward model (a
value model's output at the last response token). A second instance under another role name
(`--role cost=reward`) is Safe-RLHF's cost model.

Options (beyond roles/common.py's, which only `kind: model` reads): `kind` ("function" |
"model"), `function`, `settings` (a table the function reads read-only by declaring `settings`),
`row_fields` (the flow's own rollout columns a function may declare besides roles/reward_inputs.py's;
a function declaring any other name is refused before launch), `token_column` / `score_column`
(output names, default `token_level_scores` / `score`), and `error_score` (default 0.0): the score of a sample on which
the rule function raises or returns no finite number — the row's `<score_column>_error` column
says what went wrong (the first of each kind with its traceback) and a warning is logged here; the
controller logs each kind once and stops a run whose step has more than `reward_error_limit` of
them (hfrt/flows/reward_errors.py); null makes such a sample fail the call instead. A model-based reward reads the rollout's token columns, so it
must share the actor's tokenizer; `model` may be a *ForSequenceClassification folder (what
`hfrt controller --flow rm` exports, or a TRL / OpenRLHF reward model) or a value-model folder,
and a folder without a trained score head is refused before launch. Model options:
`score_at` ("last": the output at the last non-padding token, default; "mean": over the response),
`normalize` ("none", "running": running mean / std of the scores served, "config": the model's
config.json `mean` / `std`), `clip` (null or c: scores clipped to [-c, c] after normalising);
see roles/reward_scores.py. It knows nothing of advantages or of the actor.
"""

from __future__ import annotations

from typing import Any

import torch

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.batch import Batch
from hfrt.log import get_logger
from hfrt.roles.common import (
    ModelOptions,
    build_engine,
    check_options,
    close_group,
    needs_group,
    prepare_process,
    role_errors,
)
from hfrt.roles.models import check_reward_model_dir
from hfrt.roles.reward_fns import RewardFn, RewardFunctionError, resolve, score_all, token_level_rewards
from hfrt.roles.reward_inputs import check_declared, check_row_fields, check_settings, own_fields, wanted
from hfrt.roles.reward_scores import NORMALIZE, RunningMoments, check_score_at, normalized, pool_scores
from hfrt.roles.rows import all_reduce, equal_rows, merge, take, unpad
from hfrt.roles.training.engines import TrainEngine
from hfrt.roles.training.engines.base import split_micro
from hfrt.wire.endpoints import Dispatch, endpoint

#: Non-tensor columns a rule function receives positionally; every other one may go in as info.
TEXT_COLUMNS = ("response", "ground_truth")
MODEL_COLUMNS = ("input_ids", "attention_mask", "response_mask")


@torch.no_grad()
def last_token_values(
    engine: TrainEngine, tensors: dict[str, torch.Tensor], micro_batch_size: int, score_at: str = "last"
) -> torch.Tensor:
    """[rows] the value model's score of each row (roles/reward_scores.py's pool_scores): by default
    its output at the row's last response token (its last prompt token when the response is empty)."""
    module = engine.forward_module
    module.eval()
    width = int(tensors["input_ids"].shape[1] - tensors["response_mask"].shape[1])
    out = []
    for mb in split_micro(tensors, micro_batch_size):
        mask = mb["attention_mask"].to(engine.device)
        positions = mb.get("position_ids")
        if positions is None:
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        values = module(input_ids=mb["input_ids"].to(engine.device), attention_mask=mask, position_ids=positions.to(engine.device))
        shifted = values.float()[:, max(width - 1, 0) : width + mb["response_mask"].shape[1]]
        out.append(pool_scores(shifted, mb["response_mask"], score_at).cpu())
    return torch.cat(out)


class RewardDaemon(Daemon):
    """Endpoint: score (SPLIT) → Batch {token_level_scores [rows, R]}, non-tensor {score}."""

    OPTIONS = frozenset({
        "kind", "function", "settings", "row_fields", "token_column", "score_column", "error_score", "score_at", "normalize", "clip",
    })
    #: whether setup joined the role's process group (teardown leaves it); False until it does
    _joined: bool = False

    @classmethod
    def check_config(cls, context: DaemonContext) -> None:
        options = context.options
        check_options(context, cls.OPTIONS)
        error_score = options.get("error_score", 0.0)
        if error_score is not None and (isinstance(error_score, bool) or not isinstance(error_score, int | float)):
            raise ValueError(f"option error_score={error_score!r} must be a number or null")
        kind = options.get("kind", "function")
        if kind == "function":
            check_function(options)
        elif kind == "model":
            ModelOptions.read(options, trainable=False)
            check_model_reward_options(options)
        else:
            raise ValueError(f"unknown reward kind {kind!r}: use function or model")

    async def setup(self) -> None:
        with role_errors(self.context):
            ctx = self.context
            self.check_config(ctx)
            self.kind = str(ctx.options.get("kind", "function"))
            self.token_column = str(ctx.options.get("token_column", "token_level_scores"))
            self.score_column = str(ctx.options.get("score_column", "score"))
            error_score = ctx.options.get("error_score", 0.0)
            self.error_score = None if error_score is None else float(error_score)
            if self.kind == "function":
                self._joined = prepare_process(ctx, needs_group=False)
                self.function_name = str(ctx.options.get("function", "exact_match"))
                self.function = check_function(ctx.options)
                self.settings = check_settings(ctx.options.get("settings", {}))
                self.wanted, self.any_field = wanted(self.function)
            elif self.kind == "model":
                opts = ModelOptions.read(ctx.options, trainable=False)
                self._joined = prepare_process(ctx, needs_group=needs_group(ctx, opts.engine))
                self.engine = build_engine(ctx, opts, value_head=True)
                config: Any = self.engine.model.config
                self.vocab_size = int(config.vocab_size)
                self.score_at = str(ctx.options.get("score_at", "last"))
                self.normalize = str(ctx.options.get("normalize", "none"))
                clip = ctx.options.get("clip")
                self.clip = None if clip is None else float(clip)
                self.moments = RunningMoments()
                self.config_moments = (float(getattr(config, "mean", 0.0)), float(getattr(config, "std", 1.0)))
                if self.normalize == "config" and not hasattr(config, "mean"):
                    raise ValueError(f"normalize=config: model {opts.model!r} has no `mean` / `std` in its config.json")
            else:
                raise ValueError(f"unknown reward kind {self.kind!r}: use function or model")

    async def teardown(self) -> None:
        close_group(self._joined)

    @endpoint(dispatch=Dispatch.SPLIT)
    def score(self, batch: Batch, *extra: Batch) -> Batch:
        """Scores of the responses: rule functions read `response` (+ `ground_truth` and any other
        non-tensor column they name), a reward model the token columns. Needs `response_mask`."""
        merged = merge(batch, extra)
        errors: list[str] = []
        if self.kind == "function":
            scores = self._function_scores(merged, errors)
        else:
            scores = self._model_scores(merged)
        mask = take(merged, ["response_mask"], f"{self.context.role}.score")["response_mask"]
        columns: dict[str, list[Any]] = {self.score_column: scores}
        if errors:
            columns[f"{self.score_column}_error"] = errors
        return Batch({self.token_column: token_level_rewards(scores, mask)}, columns)

    def _function_scores(self, batch: Batch, errors: list[str]) -> list[float]:
        if "response" not in batch.non_tensor:
            raise KeyError(f"{self.context.role}.score needs a non-tensor column 'response'; the batch has {list(batch.non_tensor)}")
        rows = len(batch)
        truths = batch.non_tensor.get("ground_truth", [None] * rows)
        others = {k: v for k, v in batch.non_tensor.items() if k not in TEXT_COLUMNS}
        own = own_fields(self.wanted, batch.tensors, self.settings, rows, f"{self.context.role}.score", optional=self.any_field)
        infos = [{**{k: v[i] for k, v in others.items()}, **own[i]} for i in range(rows)]
        try:
            scores = score_all(
                self.function, batch.non_tensor["response"], truths, infos, name=self.function_name,
                error_score=self.error_score, errors=errors,
            )
        except RewardFunctionError as exc:
            raise RewardFunctionError(f"role {self.context.role!r} (rank {self.context.rank}): {exc}") from exc
        bad = [message for message in errors if message]
        if bad:
            get_logger(part="reward", role=self.context.role, rank=self.context.rank).warning("bad_samples_scored", count=len(bad), error_score=self.error_score, first=bad[0])
        return scores

    def _model_scores(self, batch: Batch) -> list[float]:
        names = [*MODEL_COLUMNS] + (["position_ids"] if "position_ids" in batch.tensors else [])
        tensors = take(batch, names, f"{self.context.role}.score")
        local_top = int(tensors["input_ids"].max()) if tensors["input_ids"].numel() else 0
        [top] = all_reduce([local_top], "max")  # every rank raises together, or none does
        if top >= self.vocab_size:
            raise ValueError(
                f"token id {int(top)} is outside the reward model's vocabulary ({self.vocab_size}): "
                "a model-based reward must share the actor's tokenizer"
            )
        padded, pad = equal_rows(tensors, f"{self.context.role}.score")
        values = unpad(last_token_values(self.engine, padded, self.engine.config.micro_batch_size, self.score_at), pad)
        if self.normalize == "running":
            self.moments.update(values)
            values = normalized(values, self.moments.mean, self.moments.std, self.clip)
        elif self.normalize == "config":
            values = normalized(values, *self.config_moments, self.clip)
        elif self.clip is not None:
            values = values.clamp(-self.clip, self.clip)
        return [float(v) for v in values]


def check_function(options: dict[str, Any]) -> RewardFn:
    """The rule function the options name, its declared parameters checked (before launch), and
    the options only a rule function reads."""
    name = str(options.get("function", "exact_match"))
    row_fields = check_row_fields(options.get("row_fields", []))
    check_settings(options.get("settings", {}))
    fn = resolve(name)
    check_declared(fn, repr(name), row_fields)
    return fn


def check_model_reward_options(options: dict[str, Any]) -> None:
    """A model reward's own options, and a trained score head in its model folder (before launch)."""
    check_score_at(options.get("score_at", "last"), "reward option")
    if options.get("normalize", "none") not in NORMALIZE:
        raise ValueError(f"reward option normalize={options.get('normalize')!r}: use one of {', '.join(NORMALIZE)}")
    clip = options.get("clip")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int | float) or clip <= 0):
        raise ValueError(f"reward option clip={clip!r}: must be a positive number or null")
    check_reward_model_dir(str(options.get("model", "tiny")))
