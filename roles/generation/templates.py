"""Chat templates and tools: whether a tokenizer's own template shows the model the `tools` it is
given (many small models' templates drop them silently, SmolLM2-135M-Instruct's among them), and
built-in tool-calling templates a server can choose instead (`hfrt serve-openai --tool-template`).

`hermes` is the ChatML layout Hermes and Qwen 2.5 models were trained on: the tool signatures as
JSON lines inside `<tools></tools>` in the system turn with an instruction to answer with
`<tool_call>{"name", "arguments"}</tool_call>` (what the `hermes` tool parser reads), an assistant's
earlier calls rendered the same way, and tool results as a user turn of `<tool_response>` blocks.
It knows Jinja templates and a tokenizer's apply_chat_template; nothing of engines or calls.
"""

from __future__ import annotations

from typing import Any

HERMES = r"""
{%- set system = messages[0].content if messages and messages[0].role in ("system", "developer") else none -%}
{%- if tools -%}
    {{- "<|im_start|>system\n" -}}
    {%- if system -%}{{- system + "\n\n" -}}{%- endif -%}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" -}}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" -}}
    {%- for tool in tools -%}{{- "\n" + (tool | tojson) -}}{%- endfor -%}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within " -}}
    {{- "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n" -}}
    {{- "</tool_call><|im_end|>\n" -}}
{%- elif system -%}
    {{- "<|im_start|>system\n" + system + "<|im_end|>\n" -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.first and system is not none -%}
    {%- elif message.role == "tool" -%}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" -%}{{- "<|im_start|>user" -}}{%- endif -%}
        {{- "\n<tool_response>\n" + message.content + "\n</tool_response>" -}}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" -%}{{- "<|im_end|>\n" -}}{%- endif -%}
    {%- elif message.role == "assistant" -%}
        {{- "<|im_start|>assistant" -}}
        {%- if message.content -%}{{- "\n" + message.content -}}{%- endif -%}
        {%- for call in message.tool_calls or [] -%}
            {{- "\n<tool_call>\n{\"name\": " + (call.function.name | tojson) + ", \"arguments\": " -}}
            {{- (call.function.arguments | tojson) + "}\n</tool_call>" -}}
        {%- endfor -%}
        {{- "<|im_end|>\n" -}}
    {%- else -%}
        {{- "<|im_start|>" + message.role + "\n" + message.content + "<|im_end|>\n" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|im_start|>assistant\n" -}}{%- endif -%}
"""

#: the built-in tool-calling templates by name (`--tool-template`)
TOOL_TEMPLATES: dict[str, str] = {"hermes": HERMES}

_PROBE_MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_add", "description": "add two integers",
                                                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


def template_sees_tools(tokenizer: Any, template: str | None = None) -> bool | None:
    """Whether the chat template (the tokenizer's, or `template`) renders the `tools` it is given:
    one conversation rendered with a tool and without must differ. None: there is no chat template."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        return None
    kw: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
    if template is not None:
        kw["chat_template"] = template
    try:
        with_tools = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=[_PROBE_TOOL], **kw)
    except Exception:  # a template that fails on tools cannot show them
        return False
    return bool(with_tools != tokenizer.apply_chat_template(_PROBE_MESSAGES, **kw))
