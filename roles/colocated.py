"""Colocation: an actor and a reference policy in one daemon process, sharing its device (the
paper's colocated placement), as the built-in implementation `actor_ref`.

The choice: a Daemon subclass that *is* an actor (every actor endpoint, unchanged) and *has* a
FrozenPolicy, exposed as `compute_ref_log_prob`. One process means one endpoint queue, so the two
roles' calls run one at a time in arrival order — which is what sharing a device needs anyway —
and both still go through the same protocol. A flow that wants the reference as its own role name
calls `compute_ref_log_prob` on the actor group instead of `compute_log_prob` on a reference group.
Option `reference` (model, dtype, seed, engine) overrides what the reference takes from the actor's
options. It knows nothing beyond composing the two.
"""

from __future__ import annotations

from hfrt.daemon.base import DaemonContext
from hfrt.daemon.batch import Batch
from hfrt.roles.actor import ActorDaemon
from hfrt.roles.common import ModelOptions, role_errors
from hfrt.roles.reference import FrozenPolicy, reference_options
from hfrt.roles.rows import merge
from hfrt.roles.training.text_objectives import pair_log_probs
from hfrt.wire.endpoints import Dispatch, endpoint


class ActorRefDaemon(ActorDaemon):
    """Actor endpoints plus compute_ref_log_prob (SPLIT) → Batch {ref_log_prob}, and the reference's
    pair log-probs as compute_ref_pair_log_probs."""

    OPTIONS = ActorDaemon.OPTIONS | {"reference"}

    @classmethod
    def check_config(cls, context: DaemonContext) -> None:
        super().check_config(context)
        overrides = dict(context.options.get("reference") or {})
        reference_options(ModelOptions.read(context.options, trainable=True), overrides)

    async def setup(self) -> None:
        await super().setup()
        with role_errors(self.context, "reference setup"):
            overrides = dict(self.context.options.get("reference") or {})
            self.reference = FrozenPolicy(self.context, reference_options(self.opts, overrides))

    @endpoint(dispatch=Dispatch.SPLIT)
    def compute_ref_log_prob(self, batch: Batch, *extra: Batch, temperature: float | None = None) -> Batch:
        """Reference log-probs of the responses (`ref_log_prob`), 0 where response_mask is 0."""
        merged = merge(batch, extra)
        return Batch({"ref_log_prob": self.reference.log_probs(merged, "actor_ref.compute_ref_log_prob", temperature)})

    @endpoint(dispatch=Dispatch.SPLIT)
    def compute_ref_pair_log_probs(self, batch: Batch, *extra: Batch, max_length: int | None = None) -> Batch:
        """Each preference pair's summed reference log-probs of its chosen and rejected completion
        (`ref_chosen_logps`, `ref_rejected_logps`), as a reference daemon's compute_pair_log_probs."""
        return pair_log_probs(self.reference.engine, self.tokenizer, merge(batch, extra), "actor_ref.compute_ref_pair_log_probs", max_length)
