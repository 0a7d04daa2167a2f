"""The prompt shapes `hfrt bench vs-trl` can run beside the addition task's bare prompts, and TRL's
generation mode: a long shared prefix (a tool-schema system prompt, as agent rollouts have) put
before every prompt, the mean prompt length in tokens, and GRPOConfig's vLLM colocate arguments.

It knows prompt text and TRL's config names; nothing of how either side computes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

#: tools a calculator agent is offered, in the JSON-schema form OpenAI's tools field takes
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers and return their exact sum.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "the first addend"},
            "b": {"type": "integer", "description": "the second addend"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "subtract", "description": "Subtract the second integer from the first and return the difference.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "the minuend"},
            "b": {"type": "integer", "description": "the subtrahend"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers and return the product.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "the first factor"},
            "b": {"type": "integer", "description": "the second factor"}}, "required": ["a", "b"]}}},
]

TOOLS_SYSTEM = (
    "You are a careful arithmetic assistant. You may call the tools below; to call one, answer with "
    "<tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call> and nothing else. When you know the "
    "answer, write it as a bare integer after the equals sign.\n<tools>\n"
    + "\n".join(json.dumps(tool) for tool in TOOLS)
    + "\n</tools>\n"
)

#: --prompt-prefix name → the text put before every prompt ("" : the bare addition prompts)
PREFIXES: dict[str, str] = {"": "", "tools": TOOLS_SYSTEM}


def with_prefix(rows: dict[str, list[Any]], prefix: str) -> dict[str, list[Any]]:
    """rows with PREFIXES[prefix] put before every prompt (other columns unchanged)."""
    if prefix not in PREFIXES:
        raise ValueError(f"prompt prefix {prefix!r}: expected one of {sorted(PREFIXES)}")
    if not prefix:
        return rows
    return rows | {"prompt": [PREFIXES[prefix] + p for p in rows["prompt"]]}


def mean_prompt_tokens(tokenizer: Any, prompts: Sequence[str]) -> float:
    """Mean prompt length in tokens as both sides tokenise it (special tokens included)."""
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    return round(sum(lengths) / max(len(lengths), 1), 1)


def trl_mode(use_vllm: bool) -> str:
    """The JSON's shape.trl_mode: how TRL samples."""
    return "vllm-colocate" if use_vllm else "transformers-generate"


def trl_vllm_args(use_vllm: bool, max_model_len: int) -> dict[str, Any]:
    """GRPOConfig's arguments for TRL's vLLM colocate mode (vLLM in the trainer's process, weights
    pushed in place before each generation; no sleep mode: CPU has none), or none."""
    if not use_vllm:
        return {}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (vLLM's default takes a share of RAM)
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False,
            "vllm_max_model_length": max_model_len, "vllm_gpu_memory_utilization": 0.3,
            "vllm_importance_sampling_correction": False}


def shape_label(shape: dict[str, Any]) -> str:
    """How the docs name a run's shape: prompts × n, new tokens, the prefix and prompt length."""
    label = f"{shape['prompts']} × {shape['n']}, {shape['max_new_tokens']} new tokens"
    if shape.get("prompt_prefix"):
        label += f", {shape['prompt_prefix']} prefix ({shape['prompt_tokens']:.0f} prompt tokens)"
    if shape.get("micro_batch_size"):
        label += f", {shape['micro_batch_size']}-row micro-batches"
    return label


def table_row(result: dict[str, Any], link: str) -> str:
    """One run as a row of docs/bench-and-performance.md's table (tests hold the page to the JSON)."""
    s, h, t = result["shape"], result["hfrt_stages_s"], result["trl_stages_s"]
    return (f"| {shape_label(s)} | [{result['date']}]({link}) | {s['trl_mode']} | {result['hfrt_step_s']:.2f} s | "
            f"{result['trl_step_s']:.2f} s | {result['speedup']:.2f}× | "
            f"{h['update_s']:.2f} / {h['generate_s']:.2f} / {h['ref_log_prob_s']:.2f} s | "
            f"{t['generate_score_ref']:.2f} / {t['update']:.2f} s | {cpu_cell(result)} | {result['load_avg'][0]:.1f} |")


def cpu_cell(result: dict[str, Any]) -> str:
    """CPU seconds a step, hfrt / TRL (TRL's over hfrt's), or a dash for a run before they were measured."""
    if "speedup_cpu" not in result:
        return "—"
    return f"{result['hfrt_cpu_s']:.1f} / {result['trl_cpu_s']:.1f} s ({result['speedup_cpu']:.2f}×)"
