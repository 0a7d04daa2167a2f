"""Token-by-token sampling on the built-in HF engine for one conversation: one prefill of the
prompt, then one decode step per token on the KV cache the generator keeps between its steps, each
token yielded as soon as it is sampled. With the same SamplingParams it draws exactly the tokens and
log-probs HFGenerationEngine.generate draws for that single row (the same seeded generator, the same
model inputs step by step), so a streamed turn is recorded as the non-streamed one would be.

Between two yields the caller may run anything on the same thread (another generate call, say):
each step sets no_grad and eval mode only for its own forward. A weight load between steps applies
from the next step on (the cache holds keys computed before it). It knows the engine's model and
sampling; nothing of calls, turns, tokenizers or the wire.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from hfrt.roles.generation.hf import (
    HFGenerationEngine,
    SamplingParams,
    row_generators,
    sample_next,
    shaper_for,
    top_log_probs,
)

#: what each step yields: (token id, its log-prob, the top-k alternatives [(id, log-prob)] when asked)
Step = tuple[int, float, list[tuple[int, float]]]


def _forward(engine: HFGenerationEngine, **inputs: Any) -> Any:
    """One model call in eval mode without autograd, restoring the module's mode after it."""
    model = engine.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(**inputs)
    finally:
        model.train(was_training)


def stream_tokens(engine: HFGenerationEngine, prompt: Sequence[int], params: SamplingParams,
                  top_k: int = 0) -> Generator[Step, None, None]:
    """Sample one response to `prompt` token by token (see the module docstring); ends after a stop
    token (eos unless ignore_eos), a stop string, a complete json_schema or max_new_tokens.
    Closing the generator drops its KV cache."""
    if not engine.awake:
        raise RuntimeError("generation engine is asleep: wake() and push weights first")
    if params.max_new_tokens < 1 or not prompt:
        raise ValueError("a streamed turn needs a prompt and max_new_tokens of at least 1")
    device = next(iter(engine._params.values())).device
    seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
    generator: torch.Generator | list[torch.Generator] = (
        torch.Generator().manual_seed(seed) if params.row_offset is None else row_generators(seed, params.row_offset, 1)
    )
    stops = {int(t) for t in engine._stop_ids(params).tolist()}
    texts = engine.text_stops(params)
    constraints = engine.constraints_for(params, 1)
    constraint = constraints[0] if constraints else None
    shaper = shaper_for(params, 1, constraints)
    sampled: list[int] = []
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    attn = torch.ones_like(ids)
    last = len(prompt) - 1  # the prompt's last position
    out = _forward(engine, input_ids=ids, attention_mask=attn, position_ids=torch.arange(len(prompt), device=device)[None],
                   use_cache=True, logits_to_keep=1)
    for step in range(params.max_new_tokens):
        logits = out.logits[:, -1]
        if shaper is not None:
            logits = shaper.shape(logits)
        token, logp = sample_next(logits, params, generator)
        top = top_log_probs(logits, top_k, params.temperature)[0] if top_k else []
        yield int(token[0]), float(logp[0]), top
        sampled.append(int(token[0]))
        if shaper is not None:
            shaper.observe(token, torch.ones(1, dtype=torch.bool, device=token.device), logits.shape[-1])
        ended = (texts is not None and texts.hit(sampled)) or (constraint is not None and constraint.done())
        if int(token[0]) in stops or ended or step + 1 == params.max_new_tokens:
            return
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        out = _forward(engine, input_ids=token[:, None], attention_mask=attn,
                       position_ids=torch.tensor([[last + step + 1]], device=device),
                       past_key_values=out.past_key_values, use_cache=True)
