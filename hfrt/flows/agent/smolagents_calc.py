"""The smolagents driver of the `agent_openai` flow: one conversation of a smolagents ToolCallingAgent
with a `calculator` tool (and smolagents' own `final_answer`) on a sample's task, against hfrt's
OpenAI-compatible endpoint, every request tagged with the conversation's session id; and the
calculator task's reward on the agent's final answer.

The agent is smolagents' own loop (its tool-call parsing, memory, retries, final-answer step);
only its prompts are replaced by short ones (its default system prompt is ~1,000 tokens of
examples, more than small models' context or CPU time allow) and its stop strings are replaced by
the flow's `agent_stop` (the short prompts' tool calls end at their JSON, which smolagents' own
"Observation:" would not catch). It knows smolagents and the OpenAI endpoint's session header;
nothing of hfrt's training.
"""

from __future__ import annotations

import importlib.resources
from typing import Any

from hfrt.flows.agent.external import DriverCall
from hfrt.flows.recipes.agent_calc import calculator as evaluate
from hfrt.flows.tasks import leading_number

#: the system prompt: the two calls of a worked example, in the form the endpoint parses (the
#: tools' schemas reach the model only if its chat template renders `tools`; SmolLM2's does not)
SYSTEM_PROMPT = (
    "Call one tool per reply. First the calculator, e.g. for 23+45:\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "23+45"}}\n</tool_call>\n'
    "After \"Observation: 68\", the final answer:\n"
    '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "68"}}\n</tool_call>'
)
FINAL_PRE = "Answer the task from this memory:"
FINAL_POST = "Task: {{task}}\nThe answer is:"


def prompt_templates() -> dict[str, Any]:
    """smolagents' ToolCallingAgent templates with the short system and final-answer prompts."""
    import yaml

    text = importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml").read_text()
    templates: dict[str, Any] = yaml.safe_load(text)
    templates["system_prompt"] = SYSTEM_PROMPT
    templates["final_answer"] = {"pre_messages": FINAL_PRE, "post_messages": FINAL_POST}
    return templates


def calculator_tool() -> Any:
    """The calculator as a smolagents Tool (+, - and * of integers)."""
    import smolagents

    class Calculator(smolagents.Tool):  # type: ignore[misc]
        name = "calculator"
        description = "Evaluates +, - and * of integers."
        inputs = {"expression": {"type": "string", "description": "the arithmetic, e.g. 23+45"}}
        output_type = "integer"

        def forward(self, expression: str) -> int:
            return evaluate(expression)

    return Calculator()


def drive(call: DriverCall) -> Any:
    """Run a ToolCallingAgent on the sample's `prompt` (the task) and return its final answer;
    the sample's `tool_calls` counts the calculator calls that ran."""
    import smolagents

    class EndpointModel(smolagents.OpenAIServerModel):  # type: ignore[misc]
        """OpenAIServerModel without smolagents' own stop strings; the call's `stop` strings (the
        flow's agent_stop) are sent instead, kept in the reply's text."""

        @property
        def supports_stop_parameter(self) -> bool:
            return False

    model = EndpointModel(model_id=call.model, api_base=call.base_url, api_key=call.api_key,
                          client_kwargs={"default_headers": {"X-Session-Id": call.session}, "max_retries": 0,
                                         "timeout": call.timeout_s},
                          max_tokens=call.max_tokens, temperature=call.temperature,
                          # the stop string stays in the text (the call's JSON ends with it; vLLM's extension field)
                          **({"stop": list(call.stop), "extra_body": {"include_stop_str_in_output": True}} if call.stop else {}))
    agent = smolagents.ToolCallingAgent(tools=[calculator_tool()], model=model, max_steps=call.max_steps,
                                        verbosity_level=-1, prompt_templates=prompt_templates())
    try:
        return agent.run(str(call.sample["prompt"]))
    finally:
        steps = [s for s in agent.memory.steps if isinstance(s, smolagents.ActionStep)]
        call.sample["tool_calls"] = sum(1 for s in steps for c in s.tool_calls or [] if c.name == "calculator")


def calc_reward(answer: Any, sample: dict[str, Any]) -> float:
    """1 when the final answer starts with the right result (the sample's `ground_truth`), else 0."""
    return 1.0 if leading_number(str(answer)) == int(sample["ground_truth"]) else 0.0
