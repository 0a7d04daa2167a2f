"""A server says at start when the model's chat template drops `tools`, and a built-in tool
template it is given travels with every chat item (scripted rollout role: pure logic; the daemon's
probe and template are in tests/roles/test_templates.py)."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from hfrt.serve.server import OpenAIServer
from tests.flows.test_agent_loop import ScriptedRollout


class DescribedRollout(ScriptedRollout):
    """A scripted role that answers serving_info as a daemon whose template ignores tools does."""

    endpoints = {"serving_info": {"dispatch": "replicate"}}

    def __init__(self, sees_tools: bool | None) -> None:
        super().__init__()
        self.sees_tools = sees_tools

    async def serving_info(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        return [{"context_tokens": 512, "max_token_bytes": 5, "template_sees_tools": self.sees_tools, "tool_templates": ["hermes"]}]


async def test_a_template_that_ignores_tools_is_said_at_start() -> None:
    with capture_logs() as logs:
        async with OpenAIServer(DescribedRollout(False), model="smol"):
            pass
    warned = [e for e in logs if e["event"] == "template_ignores_tools"]
    assert warned and warned[0]["log_level"] == "warning" and "--tool-template hermes" in warned[0]["message"], logs
    with capture_logs() as logs:
        async with OpenAIServer(DescribedRollout(False), model="smol", tool_template="hermes"):  # the fix: no warning
            pass
        async with OpenAIServer(DescribedRollout(True), model="tiny"):
            pass
    assert not [e for e in logs if e["event"] == "template_ignores_tools"]


async def test_an_unknown_tool_template_is_refused_at_start_and_a_known_one_goes_with_every_chat() -> None:
    with pytest.raises(ValueError, match=r"tool template 'qwen9' is not one the rollout role has: \['hermes'\]"):
        async with OpenAIServer(DescribedRollout(True), model="tiny", tool_template="qwen9"):
            pass
    server = OpenAIServer(DescribedRollout(False), model="smol", tool_template="hermes")
    turn = server.chat_turn({"messages": [{"role": "user", "content": "hi"}]})
    assert turn.append[0]["template"] == "hermes" and server.responses_turn({"input": "hi"}).turn.append[0]["template"] == "hermes"
