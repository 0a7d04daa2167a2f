"""The `agent_calc` flow: GRPO on multi-turn, tool-using rollouts of the addition task. The policy
may write `<calc>EXPR</calc>`; the agent loop runs the calculator and appends `[RESULT]` (masked out
of training); the policy then answers. Reward: 1 when the answer (the text after the last tool
output) starts with the right sum, else 0.

The step, `agent_on` and `max_staleness` are hfrt.flows.agent.grpo's (agent_grpo, its config, roles
and step functions); this recipe adds the calculator and the agent that calls it. It knows
endpoints, not engines.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from hfrt.flows.agent.grpo import ROLES, AgentCalcConfig, agent_grpo, roles_for
from hfrt.flows.agent.loop import Conversation
from hfrt.flows.tasks import leading_number

#: ROLES and roles_for are agent_grpo's: this flow's roles, as hfrt reads them from a flow module
__all__ = ["CALL", "OPS", "ROLES", "Config", "calc_agent", "calculator", "flow", "roles_for"]

CALL = re.compile(r"<calc>([^<>]{0,40})</calc>$")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> int:
    """+, - and * of integers (ValueError on anything else)."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return int(OPS[type(node.op)](value(node.left), value(node.right)))
        raise ValueError(f"calculator: {expression!r} is not +, - or * of integers")
    return value(ast.parse(expression.strip(), mode="eval").body)


async def calc_agent(conv: Conversation, sample: dict[str, Any], *, max_calls: int = 2) -> float:
    """Generate until a turn ends outside a tool call; run each `<calc>…</calc>` and append its result."""
    segment, calls = "", 0
    while True:
        turn = await conv.generate(stop=[">", "\n"])
        segment += turn.text
        found = CALL.search(segment)
        if found and calls < max_calls:
            result = await conv.tool(calculator, found.group(1), timeout_s=2.0)
            conv.add(f"[{result}]")
            segment, calls = "", calls + 1
        elif not segment.endswith("<calc>") or not turn.ids:
            break
    sample["tool_calls"] = calls
    got = leading_number(segment)
    return 1.0 if got is not None and got == int(sample["ground_truth"]) else 0.0

Config = AgentCalcConfig


async def flow(ctl: Any, config: AgentCalcConfig | dict[str, Any]) -> dict[str, Any]:
    return await agent_grpo(ctl, config, calc_agent)
