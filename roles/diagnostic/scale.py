"""Simulated role daemons for the controller at scale (`hfrt daemon-host`, `hfrt bench scale`).

The PPO roles' endpoints — actor, critic, reference, reward — under the built-in roles' names,
dispatch modes and parameters, so hfrt.flows.recipes.ppo's step runs against them unchanged.
They compute nothing: each call answers at once, or, in the class `with_compute` makes of one,
sleeps first the seconds the daemon's options state for its endpoint (`compute_s`: endpoint →
seconds; `hfrt daemon-host --workload` takes them from `hfrt plan`'s cost model). Each answers
with handles naming tensors that exist nowhere: a rollout
has the rows a real one would have, one handle column per shard, owned by the daemon that
answered, so the controller slices, concatenates, dispatches, tracks and frees them as it does
real ones (nothing pulls them: every endpoint takes raw handles). Every daemon also answers
`ping` (an empty call: broadcasts) and `take` (one batch shard in, its row count out: dispatch).

It knows handles and the endpoint decorator; no torch, nothing of the controller or of RL maths.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable
from typing import Any

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.protocols import BatchHandle, Shard, TensorHandle
from hfrt.wire.endpoints import Dispatch, chunk_bounds, endpoint, endpoint_table

#: the width (tokens) of a made-up response column
RESPONSE_WIDTH = 64
#: the metrics an update returns on every rank (reduce_rank_metrics wants the same keys everywhere)
UPDATE_METRICS = ("loss", "grad_norm", "timing/update_s")
#: endpoints every simulated daemon answers at once, compute or not
BASE_ENDPOINTS = frozenset({"describe", "ping", "take"})


class SimDaemon(Daemon):
    """What every simulated role shares: its stated compute times and made-up handles."""

    def __init__(self, context: DaemonContext) -> None:
        super().__init__(context)
        self.compute_s = _compute_seconds(context.options.get("compute_s", {}), context.identity)
        self._keys = itertools.count()

    @classmethod
    def check_config(cls, context: DaemonContext) -> None:
        _compute_seconds(context.options.get("compute_s", {}), context.identity)

    async def work(self, name: str) -> None:
        """Stand in for endpoint `name`'s compute: sleep its stated seconds (none: return at once)."""
        seconds = self.compute_s.get(name, 0.0)
        if seconds > 0:
            await asyncio.sleep(seconds)

    def batch(self, rows: int, column: str, meta: dict[str, Any] | None = None, **non_tensor: list[Any]) -> BatchHandle:
        """A one-shard batch of `rows` rows owned here: one made-up [rows, RESPONSE_WIDTH] float column."""
        handle = TensorHandle(self.context.identity, f"{column}-{next(self._keys)}", (rows, RESPONSE_WIDTH),
                              "float32", "cpu", rows * RESPONSE_WIDTH * 4)
        return BatchHandle((Shard(self.context.identity, rows, {column: handle}, non_tensor),), meta or {})

    @endpoint
    def ping(self) -> str:
        """An empty call: what a broadcast to every rank measures."""
        return "pong"

    @endpoint(dispatch=Dispatch.SPLIT, raw_handles=True)
    def take(self, batch: BatchHandle) -> int:
        """One shard of a split batch in (not pulled), its row count out: what a dispatch measures."""
        return len(batch)


class SimActor(SimDaemon):
    """The actor's PPO endpoints (hfrt.roles.actor): generate, log-probs, advantages, update."""

    @endpoint(dispatch=Dispatch.SPLIT_GENERATION, raw_handles=True)
    def generate(self, batch: BatchHandle, *extra: BatchHandle, chunk: int | None = None, chunks: int = 1,
                       **sampling: Any) -> BatchHandle:
        """`n` responses per prompt of this rank's rows (of chunk `chunk` of `chunks`, when given)."""
        rows = len(batch)
        if chunk is not None:
            lo, hi = chunk_bounds(rows, chunks)[chunk]
            rows = hi - lo
        rows *= int(sampling.get("n") or 1)
        meta = {"response_tokens": rows * RESPONSE_WIDTH, "response_length/mean": float(RESPONSE_WIDTH)}
        return self.batch(rows, "responses", meta)

    @endpoint(dispatch=Dispatch.SPLIT, raw_handles=True)
    def compute_log_prob(self, batch: BatchHandle, *extra: BatchHandle, temperature: float | None = None,
                               sum_pi_squared: bool = False) -> BatchHandle:
        return self.batch(len(batch), "old_log_prob")

    @endpoint(dispatch=Dispatch.RANK0, raw_handles=True)
    def compute_advantages(self, batch: BatchHandle, *extra: BatchHandle, estimator: str = "gae",
                                 **params: Any) -> BatchHandle:
        """The whole batch's advantages on rank 0, as the real actor computes them."""
        return self.batch(len(batch), "advantages", {"metrics": {"critic/advantages_mean": 0.0}})

    @endpoint(dispatch=Dispatch.SPLIT, raw_handles=True)
    def update(self, batch: BatchHandle, *extra: BatchHandle, **loss: Any) -> dict[str, float]:
        return dict.fromkeys(UPDATE_METRICS, 0.0)


class SimCritic(SimDaemon):
    """The critic's endpoints (hfrt.roles.critic): values and update."""

    @endpoint(dispatch=Dispatch.SPLIT, raw_handles=True)
    def compute_values(self, batch: BatchHandle, *extra: BatchHandle) -> BatchHandle:
        return self.batch(len(batch), "values")

    @endpoint(dispatch=Dispatch.SPLIT, raw_handles=True)
    def update(self, batch: BatchHandle, *extra: BatchHandle, **loss: Any) -> dict[str, float]:
        return dict.fromkeys(UPDATE_METRICS, 0.0)


class SimReference(SimDaemon):
    """The reference's log-probs (hfrt.roles.reference)."""

    @endpoint(dispatch=Dispatch.SPLIT, raw_handles=True)
    def compute_log_prob(self, batch: BatchHandle, *extra: BatchHandle, temperature: float | None = None) -> BatchHandle:
        return self.batch(len(batch), "ref_log_prob")


class SimReward(SimDaemon):
    """The reward's scores (hfrt.roles.reward): a `score` value per row, as flows read them."""

    @endpoint(dispatch=Dispatch.SPLIT, raw_handles=True)
    def score(self, batch: BatchHandle, *extra: BatchHandle) -> BatchHandle:
        rows = len(batch)
        return self.batch(rows, "token_level_scores", score=[1.0] * rows)


def with_compute(cls: type[SimDaemon]) -> type[SimDaemon]:
    """`cls` with every role endpoint sleeping its stated compute first (SimDaemon.work): async, so
    the other daemons of a host run meanwhile. Without compute the endpoints stay plain functions,
    which a daemon runs at once, as it runs a real role's synchronous endpoints."""
    table = {name: (spec, fn) for name, (spec, fn) in endpoint_table(cls).items() if name not in BASE_ENDPOINTS}
    timed = {fn.__name__: endpoint(dispatch=spec.dispatch, raw_handles=spec.raw_handles)(_after_work(fn, name))
             for name, (spec, fn) in table.items()}
    return type(f"Computing{cls.__name__}", (cls,), timed)


def _after_work(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)  # the signature the endpoint declares stays fn's
    async def run(self: SimDaemon, *args: Any, **kwargs: Any) -> Any:
        await self.work(name)
        return fn(self, *args, **kwargs)

    return run


#: role name → its simulated daemon class (what `hfrt daemon-host` runs for a role by default)
SIM_ROLES: dict[str, type[SimDaemon]] = {
    "actor": SimActor, "critic": SimCritic, "reference": SimReference, "reward": SimReward,
}


def _compute_seconds(value: Any, where: str) -> dict[str, float]:
    """options["compute_s"] checked: endpoint name → seconds >= 0 (ValueError naming the daemon)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: options compute_s must be a table of endpoint → seconds, not {value!r}")
    out = {}
    for name, seconds in value.items():
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
            raise ValueError(f"{where}: options compute_s[{name!r}] = {seconds!r} is not a number of seconds >= 0")
        out[str(name)] = float(seconds)
    return out
