"""Per-token cost of constrained decoding with the two grammar libraries installed beside vLLM,
xgrammar and llguidance, on a model's own tokenizer (the tiny preset's 259 tokens and SmolLM2's
49,152): the time to compile a JSON schema (and the json_object grammar) for the vocabulary, and
per token of a valid JSON answer (the compile a median over 10 variants of the schema) the time to fill the next-token bitmask, to apply it to the
logits and to advance the matcher — the work the HF engine adds to every sampled token of a
constrained turn. Both libraries walk the same token sequence; the numbers are medians and p99
over all tokens of `--rounds` walks, on one torch thread (a CPU role daemon's default). Then the HF engine itself (llguidance, what it uses): its time
per sampled token of a schema's answers against as many unconstrained tokens, one row.

It knows the two libraries' matcher APIs and the models' tokenizers; nothing of engines or serving.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from hfrt.bench.common import add_output_flags, emit, machine

#: an answer shape like the Agents SDK's output_type and LangChain's structured output send
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "activities"],
          "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                         "activities": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                                                   "required": ["name", "hours"],
                                                                   "properties": {"name": {"type": "string"}, "hours": {"type": "number"}}}}}}
ANSWER = {"city": "Lisbon", "days": 3, "activities": [{"name": "tram 28 ride", "hours": 1.5}, {"name": "Belem tower visit", "hours": 2},
                                                      {"name": "fado evening in Alfama", "hours": 3}]}


def _stats(seconds: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in seconds)
    return {"p50_us": round(statistics.median(us), 1), "p99_us": round(us[min(len(us) - 1, int(0.99 * len(us)))], 1),
            "mean_us": round(statistics.fmean(us), 1)}


def variants(schema: str, n: int = 10) -> list[str]:
    """`n` copies of the schema that differ by a title (so no compiled grammar is reused between them)."""
    return [json.dumps({**json.loads(schema), "title": f"answer{i}"}) for i in range(n)]


def _walk(fill: Callable[[], object], apply: Callable[[], object], accept: Callable[[int], bool], ids: list[int]) -> dict[str, list[float]]:
    """One pass over `ids`: each token's fill, apply and accept times (a refused token is an error)."""
    times: dict[str, list[float]] = {"fill": [], "apply": [], "accept": []}
    for token in ids:
        for name, step in (("fill", fill), ("apply", apply)):
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        if not accept(token):
            raise RuntimeError(f"the grammar refused token {token} of a valid answer")
        times["accept"].append(time.perf_counter() - start)
    return times


def xgrammar_run(tokenizer: Any, ids: list[int], rounds: int, schema: str) -> dict[str, Any]:
    import torch
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info)
    vocab_s = time.perf_counter() - start
    compiled = compiler.compile_json_schema(schema)
    compiles = []
    for variant in variants(schema):
        start = time.perf_counter()
        compiler.compile_json_schema(variant)
        compiles.append(time.perf_counter() - start)
    schema_s = statistics.median(compiles)
    start = time.perf_counter()
    compiler.compile_builtin_json_grammar()
    object_s = time.perf_counter() - start
    logits, mask = torch.zeros(1, len(tokenizer)), xgr.allocate_token_bitmask(1, info.vocab_size)
    times: dict[str, list[float]] = {"fill": [], "apply": [], "accept": []}
    for _ in range(rounds):
        matcher = xgr.GrammarMatcher(compiled)
        one = _walk(functools.partial(matcher.fill_next_token_bitmask, mask),
                    functools.partial(xgr.apply_token_bitmask_inplace, logits, mask), matcher.accept_token, ids)
        for k, v in one.items():
            times[k] += v
    return {"tokenizer_s": round(vocab_s, 3), "compile_schema_s": round(schema_s, 4), "compile_json_object_s": round(object_s, 4),
            **{k: _stats(v) for k, v in times.items()}}


def llguidance_run(tokenizer: Any, ids: list[int], rounds: int, schema: str) -> dict[str, Any]:
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch as llt
    import torch

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    vocab_s = time.perf_counter() - start
    grammar = llg.LLMatcher.grammar_from_json_schema(json.loads(schema))
    compiles = []
    for variant in variants(schema):
        start = time.perf_counter()
        llg.LLMatcher(lltok, llg.LLMatcher.grammar_from_json_schema(json.loads(variant)))
        compiles.append(time.perf_counter() - start)
    schema_s = statistics.median(compiles)
    start = time.perf_counter()
    llg.LLMatcher(lltok, llg.LLMatcher.grammar_from_json_schema({"type": "object"}))
    object_s = time.perf_counter() - start
    logits, mask = torch.zeros(1, len(tokenizer)), llt.allocate_token_bitmask(1, lltok.vocab_size)
    times: dict[str, list[float]] = {"fill": [], "apply": [], "accept": []}
    for _ in range(rounds):
        matcher = llg.LLMatcher(lltok, grammar)
        one = _walk(functools.partial(llt.fill_next_token_bitmask, matcher, mask, 0),
                    functools.partial(llt.apply_token_bitmask_inplace, logits, mask), matcher.consume_token, ids)
        for k, v in one.items():
            times[k] += v
    return {"tokenizer_s": round(vocab_s, 3), "compile_schema_s": round(schema_s, 4), "compile_json_object_s": round(object_s, 4),
            **{k: _stats(v) for k, v in times.items()}}


def engine_cost(model: str, rounds: int) -> dict[str, Any]:
    """The HF engine's time per sampled token of SCHEMA's answers (llguidance masks) against the same
    number of unconstrained tokens, alternating, one row at a time."""
    from hfrt.roles.generation.build import generation_engine
    from hfrt.roles.generation.hf import SamplingParams
    from hfrt.roles.models import load_tokenizer

    tokenizer = load_tokenizer(model, 0)
    engine = generation_engine("hf", model=model, dtype="float32", seed=0, tokenizer=tokenizer)
    prompt = list(tokenizer("Plan a trip as JSON:", add_special_tokens=False)["input_ids"])
    engine.generate([prompt], SamplingParams(max_new_tokens=4, json_schema=SCHEMA))  # the grammar compiled and the vocabulary read once
    per_token: dict[str, list[float]] = {"constrained": [], "free": []}
    for seed in range(rounds):
        start = time.perf_counter()
        out = engine.generate([prompt], SamplingParams(max_new_tokens=64, seed=seed, json_schema=SCHEMA))
        tokens = int(out["response_mask"].sum())
        per_token["constrained"].append((time.perf_counter() - start) / tokens)
        start = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_new_tokens=tokens, seed=seed, ignore_eos=True))
        per_token["free"].append((time.perf_counter() - start) / tokens)
    c, f = statistics.median(per_token["constrained"]), statistics.median(per_token["free"])
    return {"ms_per_token_constrained": round(c * 1000, 3), "ms_per_token_free": round(f * 1000, 3), "overhead": round(c / f, 3)}


def measure(model: str, rounds: int) -> dict[str, Any]:
    from hfrt.roles.models import load_tokenizer

    tokenizer = load_tokenizer(model, 0)
    ids = list(tokenizer(json.dumps(ANSWER), add_special_tokens=False)["input_ids"]) + [int(tokenizer.eos_token_id)]
    schema = json.dumps(SCHEMA)
    return {"model": model, "vocab": len(tokenizer), "answer_tokens": len(ids),
            "xgrammar": xgrammar_run(tokenizer, ids, rounds, schema), "llguidance": llguidance_run(tokenizer, ids, rounds, schema),
            "hf_engine": engine_cost(model, 6)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfrt bench grammar-masks", description=__doc__)
    p.add_argument("--models", default="tiny,smollm2-135m", help="comma-separated model presets (their tokenizers are used)")
    p.add_argument("--rounds", type=int, default=20, help="walks over the answer's tokens per library and model")
    add_output_flags(p)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as a role daemon on CPU runs (its `threads` option's default)
    result = {"bench": "grammar-masks", "machine": machine(), "schema": SCHEMA,
              "results": [measure(m, args.rounds) for m in args.models.split(",")]}
    for r in result["results"]:
        for lib in ("xgrammar", "llguidance"):
            one = r[lib]
            print(f"{r['model']:>14} {lib:>10}: fill p50 {one['fill']['p50_us']:7.1f} us  p99 {one['fill']['p99_us']:7.1f} us  "
                  f"accept p50 {one['accept']['p50_us']:6.1f} us  apply p50 {one['apply']['p50_us']:6.1f} us  "
                  f"compile schema {one['compile_schema_s'] * 1000:7.1f} ms  tokenizer {one['tokenizer_s']:.2f} s")
        cost = r["hf_engine"]
        print(f"{r['model']:>14}  HF engine: {cost['ms_per_token_constrained']:.2f} ms/token constrained (llguidance) vs "
              f"{cost['ms_per_token_free']:.2f} free ({cost['overhead']:.2f}x)")
    emit(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
