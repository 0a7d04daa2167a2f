"""Delivery adverbs as a call layer sees them: each way of calling an endpoint is named by an Adverb
member, and delivering a call again with its Delivery reaches the same ranks. No processes: a
recording caller stands in for the controller (tests/control/test_call_check.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from hfrt.control.group import Adverb, Delivery, EndpointRef
from tests.control.test_call_check import Shapes, group_of


class RecordingLayer:
    """A call layer that records each delivery and sends it as it came."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []

    def call(self, ref: EndpointRef, how: Delivery, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        self.deliveries.append(how)
        return ref.resend_now(how, args, kwargs)


async def test_each_adverb_is_named_by_its_member_and_resends_to_the_same_ranks() -> None:
    actor, caller = group_of(Shapes, world=3)
    layer = RecordingLayer()
    caller.recovery = layer  # type: ignore[assignment]
    await actor.sleep(0.1)
    await actor.sleep.call(0.2)
    await actor.sleep.call_one(2, 0.3, timeout_s=4.0)
    assert [(d.adverb, d.rank, d.timeout_s) for d in layer.deliveries] == [
        (Adverb.DISPATCH, 0, None), (Adverb.CALL, 0, None), (Adverb.CALL_ONE, 2, 4.0)]
    first = [(who, args) for who, _, args, _ in caller.sent]
    assert first == [("actor:0", [0.1]), ("actor:1", [0.1]), ("actor:2", [0.1]),  # sleep replicates
                     ("actor:0", [0.2]), ("actor:1", [0.2]), ("actor:2", [0.2]), ("actor:2", [0.3])]
    caller.sent.clear()
    for how, args in zip(list(layer.deliveries), ((0.1,), (0.2,), (0.3,)), strict=True):
        await actor.sleep.resend(how, args, {})
    assert [(who, args) for who, _, args, _ in caller.sent] == first


def test_adverb_values_are_the_adverbs_names() -> None:
    assert {a.value for a in Adverb} == {"dispatch", "call", "call_one"}
    assert Delivery(Adverb.CALL_ONE, 1, 2.0).with_deadline(1.0) == Delivery(Adverb.CALL_ONE, 1, 1.0)
