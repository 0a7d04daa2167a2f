"""The sampling contract every generation engine keeps, as one function run on an engine built in
the calling process (HF) or a spawned one (vLLM, through dist_workers.run_alone): stop strings of
several tokens, logit_bias and penalties shaping what is sampled and the log-probs recorded, and
a JSON schema every response follows. SmolLM2-135M's tokenizer: "a" is token 81, "b" 82, "ab" 369."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SCHEMA = {"type": "object", "properties": {"sum": {"type": "integer"}, "op": {"enum": ["add", "mul"]}, "ok": {"type": "boolean"}},
          "required": ["sum", "op", "ok"], "additionalProperties": False}


def contract(engine: Any, tok: Any) -> dict[str, Any]:
    """What `engine` samples for each option (plain values, compared by the caller)."""
    from hfrt.roles.generation.hf import SamplingParams

    chat = [{"role": "user", "content": "Write two letters."}]
    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
    out: dict[str, Any] = {}

    def run(**kw: Any) -> tuple[list[list[int]], list[list[float]]]:
        params = SamplingParams(**{"temperature": 1.0, "max_new_tokens": 24, "seed": 0, **kw})
        res = engine.generate([prompt], params)
        mask = res["response_mask"].bool()
        return [r[m].tolist() for r, m in zip(res["responses"], mask, strict=True)], [lp[m].tolist() for lp, m in zip(res["log_probs"], mask, strict=True)]

    ab = {81: 100.0, 82: 100.0, 369: 100.0}  # "a", "b" and "ab" only
    ids, lps = run(logit_bias=ab, stop_strings=("ab",), n=3)
    out["stop_texts"] = [tok.decode(r, skip_special_tokens=True) for r in ids]
    out["shaped_log_probs_min"] = min(min(r) for r in lps)
    ids, _ = run(logit_bias={106: 12.0}, temperature=0.0, max_new_tokens=12)
    out["z_plain"] = tok.decode(ids[0], skip_special_tokens=True)
    ids, _ = run(logit_bias={106: 12.0}, temperature=0.0, max_new_tokens=12, frequency_penalty=2.0)
    out["z_frequency"] = tok.decode(ids[0], skip_special_tokens=True)
    ids, _ = run(json_schema=SCHEMA, n=3, max_new_tokens=60)
    out["json"] = [tok.decode(r, skip_special_tokens=True) for r in ids]
    return out


def check(out: dict[str, Any]) -> None:
    """The contract's assertions, the same for every engine."""
    for text in out["stop_texts"]:  # ends at the first "ab", the ids keep the tokens that spelled it
        assert text.endswith("ab") and "ab" not in text[:-1] and set(text) <= {"a", "b"}, out["stop_texts"]
    assert out["shaped_log_probs_min"] > math.log(0.05), out["shaped_log_probs_min"]  # the biased distribution's, not the model's
    assert out["z_plain"] == "z" * 12 and 1 <= out["z_frequency"].count("z") < 12, (out["z_plain"], out["z_frequency"])
    for text in out["json"]:
        value = json.loads(text)
        assert set(value) == {"sum", "op", "ok"} and isinstance(value["sum"], int) and value["op"] in ("add", "mul"), text


def vllm_contract(*, out_dir: Path) -> dict[str, Any]:
    from hfrt.roles.generation.vllm_engine import VLLMConfig, VLLMGenerationEngine
    from hfrt.roles.models import load_tokenizer, resolve_model_dir

    tok = load_tokenizer("smollm2-135m")
    engine = VLLMGenerationEngine(VLLMConfig(str(resolve_model_dir("smollm2-135m")), dtype="float32", max_model_len=256,
                                             kv_cache_memory_bytes=64 << 20), pad_token_id=tok.pad_token_id)
    return {"contract": contract(engine, tok)}
