"""Micro-batches of a training engine's batch: which rows go together (a fixed row count, or as
many rows as fit a token budget, longest first, the same number of micro-batches on every
data-parallel rank), each micro-batch trimmed to its own longest row or packed into one
padding-free sequence, and outputs put back at full width in the original row order.

Budget rule (`max_tokens_per_micro_batch`): a trimmed micro-batch costs rows × (its longest
prompt + its longest response) tokens, a packed one the sum of its rows' real tokens. Rows are
taken longest first; trimmed, they are cut into consecutive runs, the fewest within the budget
and of those the least padded; packed, each goes into the first micro-batch with room. A row longer than the budget on its
own (because of its response) is a micro-batch of its own; a prompt longer than the budget is
refused, naming the row. Packing needs rows laid out as engines/base.py's batch (real tokens
contiguous, positions 0, 1, ...) and a prompt token before the response; a batch that is not so
is trimmed instead.

It knows the batch layout of engines/base.py (prompt left-padded, response right-padded, the
last R columns the response); nothing of models, losses, ranks or the wire.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: the model input naming, in a packed micro-batch, the positions whose logits predict a response token
PACKED_POSITIONS = "packed_positions"
#: a rollout's recorded MoE routing [B, T, layers, k], cut and packed as input_ids (training/router_replay.py)
ROUTED_EXPERTS = "routed_experts"


@dataclass(frozen=True)
class Lengths:
    """Per row: real prompt tokens (left of the response) and response columns up to the last real one."""

    prompt: list[int]
    response: list[int]

    def total(self, row: int) -> int:
        return self.prompt[row] + self.response[row]

    def reaching(self, extra: int, width: int) -> Lengths:
        """These lengths with `extra` more response columns per row (at most `width`): a value
        readout of the output at a row's last response token (column L) needs column L kept."""
        return Lengths(self.prompt, [min(r + extra, width) for r in self.response])


def row_lengths(batch: Mapping[str, torch.Tensor]) -> Lengths:
    """The real lengths of each row: a column is real where attention_mask (or response_mask) is 1."""
    width = int(batch["responses"].shape[1])
    real = batch["attention_mask"].bool()
    prompt_width = int(real.shape[1]) - width
    prompt, response = real[:, :prompt_width], real[:, prompt_width:]
    if "response_mask" in batch:
        response = response | batch["response_mask"].bool()
    first = torch.where(prompt.any(-1), prompt.int().argmax(-1), torch.full_like(prompt[:, 0], prompt_width, dtype=torch.long))
    last = torch.where(response.any(-1), width - response.flip(-1).int().argmax(-1), torch.zeros_like(first))
    return Lengths((prompt_width - first).tolist(), last.tolist())


def cost(lengths: Lengths, rows: Sequence[int], packed: bool) -> int:
    """Tokens the model processes for these rows: packed, their sum; trimmed, rows × longest."""
    if not rows:
        return 0
    if packed:
        return sum(lengths.total(r) for r in rows)
    return len(rows) * (max(lengths.prompt[r] for r in rows) + max(lengths.response[r] for r in rows))


def check_budget(budget: object, where: str = "engine.max_tokens_per_micro_batch") -> int | None:
    """The budget as an int, or None (row-count micro-batches); ValueError naming `where` otherwise."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"{where}: expected a whole number of tokens or null, got {budget!r}")
    if budget <= 0:
        raise ValueError(
            f"{where}={budget}: a token budget must be positive (omit it or set null for micro-batches of "
            "micro_batch_size rows)"
        )
    return budget


def check_settings(budget: object, pack: object, pp: int) -> None:
    """An engine's budget and pack settings (ValueError naming the key and value): no budget or
    packing with pipeline stages, which exchange activations of one static shape."""
    check_budget(budget)
    if not isinstance(pack, bool):
        raise ValueError(f"engine.pack: expected true or false, got {pack!r}")
    if pp > 1 and (budget is not None or pack):
        raise ValueError(
            f"engine: max_tokens_per_micro_batch={budget} / pack={pack} with pp={pp}: pipeline stages exchange "
            "activations of one static shape, so micro-batches there are micro_batch_size rows at the batch's "
            "width; unset both, or use pp=1"
        )


def plan(
    lengths: Lengths, *, budget: int | None, rows_per_micro: int, packed: bool, unit: int = 1
) -> list[list[int]]:
    """Row indices of each micro-batch. No budget: consecutive blocks of rows_per_micro rows.
    With a budget: rows longest first, as the module docstring says.
    `unit`: rows that must stay together and in order (e.g. 2 for chosen / rejected pairs)."""
    rows = len(lengths.prompt)
    if budget is None:
        if rows_per_micro <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {rows_per_micro}")
        step = max(rows_per_micro - rows_per_micro % unit, unit)
        return [list(range(start, min(start + step, rows))) for start in range(0, rows, step)]
    for row in range(rows):
        if lengths.prompt[row] > budget:
            raise ValueError(
                f"engine.max_tokens_per_micro_batch={budget} is smaller than row {row}'s prompt "
                f"({lengths.prompt[row]} tokens): the budget must hold every prompt"
            )
    units = [list(range(start, min(start + unit, rows))) for start in range(0, rows, unit)]
    units.sort(key=lambda u: -max(lengths.total(r) for r in u))  # stable: equal lengths keep row order
    if not packed:
        return _fewest_then_least(units, lengths, budget)
    groups: list[list[int]] = []
    for members in units:  # first fit: the first micro-batch with room
        home = next((g for g in groups if cost(lengths, g + members, True) <= budget), None)
        if home is None:
            groups.append(list(members))
        else:
            home.extend(members)
    return groups


def _fewest_then_least(units: list[list[int]], lengths: Lengths, budget: int) -> list[list[int]]:
    """Consecutive runs of the (longest-first) units: the fewest micro-batches within the budget
    (a unit over it alone), and of those the fewest padded token slots (dynamic programming over
    where each run ends; a run's cost only grows as it reaches back, so each search stops early)."""
    best: list[tuple[int, int]] = [(0, 0)]
    start: list[int] = [0]
    for end in range(1, len(units) + 1):
        choice: tuple[int, int] | None = None
        rows = p = r = 0
        for first in range(end - 1, -1, -1):
            rows += len(units[first])
            p = max(p, *(lengths.prompt[i] for i in units[first]))
            r = max(r, *(lengths.response[i] for i in units[first]))
            slots = rows * (p + r)
            if slots > budget and first < end - 1:
                break
            candidate = (best[first][0] + 1, best[first][1] + slots)
            if choice is None or candidate < choice:
                choice, cut = candidate, first
        assert choice is not None
        best.append(choice)
        start.append(cut)
    groups: list[list[int]] = []
    end = len(units)
    while end > 0:
        groups.insert(0, [i for u in units[start[end] : end] for i in u])
        end = start[end]
    return groups


def split_to(groups: list[list[int]], count: int, lengths: Lengths, packed: bool, unit: int = 1) -> list[list[int]]:
    """`groups` split until there are `count` (the largest-cost splittable one in halves each
    time), so every data-parallel rank runs the same number of micro-batches. Splitting never
    raises a micro-batch's cost; a rank has at least `count` units when every rank has as many rows."""
    out = [list(g) for g in groups]
    while len(out) < count:
        splittable = [g for g in out if len(g) > unit]
        if not splittable:
            raise ValueError(f"cannot make {count} micro-batches of {sum(len(g) for g in out)} rows")
        largest = max(splittable, key=lambda g: cost(lengths, g, packed))
        half = (len(largest) // unit + 1) // 2 * unit
        out.remove(largest)
        out += [largest[:half], largest[half:]]
    return out


def packable(batch: Mapping[str, torch.Tensor], lengths: Lengths) -> bool:
    """True when every row's real tokens are contiguous, its positions (if given) count 0, 1, ...
    over them, and it has a prompt token before its response (see the module docstring)."""
    width = int(batch["responses"].shape[1])
    total_width = int(batch["input_ids"].shape[1])
    start = total_width - width
    mask = batch["attention_mask"].bool()
    positions = batch.get("position_ids")
    for row in range(len(lengths.prompt)):
        p, r = lengths.prompt[row], lengths.response[row]
        if p == 0 or int(mask[row].sum()) != p + r or not bool(mask[row, start - p : start + r].all()):
            return False
        if positions is not None and not torch.equal(positions[row, start - p : start + r].long(), torch.arange(p + r)):
            return False
    return True


@dataclass
class Micro:
    """One micro-batch: its rows (indices into the batch), the model's inputs (trimmed, or packed
    into one row with PACKED_POSITIONS), and how to put an output back at [rows, R]."""

    rows: torch.Tensor
    inputs: dict[str, torch.Tensor]
    width: int
    #: packed only: (row within the micro-batch, response column) of each output element
    scatter: tuple[torch.Tensor, torch.Tensor] | None = None

    def expand(self, out: torch.Tensor | None) -> torch.Tensor | None:
        """An output of the model's inputs as [rows, R] (zeros where a row has no real column);
        differentiable."""
        if out is None:
            return None
        if self.scatter is None:
            return torch.nn.functional.pad(out, (0, self.width - int(out.shape[1])))
        full = out.new_zeros(len(self.rows), self.width)
        index = tuple(t.to(out.device) for t in self.scatter)
        return full.index_put(index, out[0])


def trimmed(batch: Mapping[str, torch.Tensor], rows: Sequence[int], lengths: Lengths, multiple: int = 1) -> Micro:
    """The rows' model inputs without the columns padding on all of them: the prompt cut on the
    left, the response on the right (at least one response column). `multiple`: the kept width
    is rounded up to a multiple of it where the batch has the columns (e.g. sequence parallel)."""
    width = int(batch["responses"].shape[1])
    start = int(batch["input_ids"].shape[1]) - width
    p = min(max(max(lengths.prompt[r] for r in rows), 1), start)  # a prompt column predicts the first response token
    r = max(max(lengths.response[r] for r in rows), 1)
    extra = -(p + r) % multiple
    p_more = min(extra, start - p)
    p, r = p + p_more, min(r + extra - p_more, width)
    index = torch.tensor(list(rows), dtype=torch.long)
    inputs = {
        name: batch[name][index][:, start - p : start + r]
        for name in ("input_ids", "attention_mask", "position_ids", ROUTED_EXPERTS)
        if name in batch
    }
    inputs["responses"] = batch["responses"][index][:, :r]
    return Micro(index, inputs, width)


def packed(batch: Mapping[str, torch.Tensor], rows: Sequence[int], lengths: Lengths, multiple: int = 1) -> Micro:
    """The rows' real tokens as one sequence [1, Σ lengths] with per-row positions (no attention
    mask: transformers then builds a block-diagonal causal mask from the position resets);
    PACKED_POSITIONS are where the logits of each response token are read. `multiple`: padded
    up to a multiple of it with a filler sequence of its own (positions 0, 1, ..., never read)."""
    width = int(batch["responses"].shape[1])
    start = int(batch["input_ids"].shape[1]) - width
    ids, pos, keep, targets, local, cols, routed = [], [], [], [], [], [], []
    offset = 0
    for i, row in enumerate(rows):
        p, r = lengths.prompt[row], lengths.response[row]
        ids.append(batch["input_ids"][row, start - p : start + r])
        if ROUTED_EXPERTS in batch:
            routed.append(batch[ROUTED_EXPERTS][row, start - p : start + r])
        pos.append(torch.arange(p + r))
        keep.append(torch.arange(offset + p - 1, offset + p + r - 1))
        targets.append(batch["responses"][row, :r])
        local.append(torch.full((r,), i, dtype=torch.long))
        cols.append(torch.arange(r))
        offset += p + r
    if extra := -offset % multiple:
        ids.append(torch.zeros(extra, dtype=ids[0].dtype))
        pos.append(torch.arange(extra))
        if routed:  # the filler's routing: not recorded (-1 cast to the column's dtype)
            routed.append(torch.full((extra, *routed[0].shape[1:]), -1).to(routed[0].dtype))
    inputs = {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat(pos)[None],
        "responses": torch.cat(targets)[None],
        PACKED_POSITIONS: torch.cat(keep),
    } | ({ROUTED_EXPERTS: torch.cat(routed)[None]} if routed else {})
    return Micro(torch.tensor(list(rows), dtype=torch.long), inputs, width, (torch.cat(local), torch.cat(cols)))


def micro_batches(
    batch: Mapping[str, torch.Tensor], groups: list[list[int]], lengths: Lengths, *, pack: bool, multiple: int = 1
) -> list[Micro]:
    """Each group's Micro: packed when `pack` (the caller checked `packable`), else trimmed."""
    return [packed(batch, g, lengths, multiple) if pack else trimmed(batch, g, lengths, multiple) for g in groups]


def in_row_order(micros: Sequence[Micro], parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-micro-batch outputs ([rows, R] each) as one [B, R] tensor in the batch's row order."""
    if not parts or parts[0] is None:
        return None
    stacked = torch.cat([p for p in parts if p is not None])
    order = torch.cat([m.rows for m in micros])
    out = torch.empty_like(stacked)
    out[order.to(stacked.device)] = stacked
    return out


def padding_fraction(lengths: Sequence[int] | Lengths, budget: int | None = None, *, rows_per_micro: int = 0,
                     pack: bool = False) -> float:
    """The share of processed token slots that are padding: `lengths` alone (a list of row
    lengths, prompts of 0), the whole batch padded to its longest row when neither budget nor
    rows_per_micro is given; else micro-batches as the engine plans them (budget / rows, trimmed
    or packed). 0.0 for an empty batch."""
    if not isinstance(lengths, Lengths):
        lengths = Lengths([0] * len(lengths), [int(n) for n in lengths])
    rows = len(lengths.prompt)
    real = sum(lengths.total(r) for r in range(rows))
    if budget is None and rows_per_micro <= 0:
        groups = [list(range(rows))] if rows else []
    else:
        groups = plan(lengths, budget=budget, rows_per_micro=rows_per_micro, packed=pack)
    slots = sum(cost(lengths, g, pack) for g in groups)
    return 0.0 if slots == 0 else 1.0 - real / slots
