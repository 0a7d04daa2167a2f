"""Constrained decoding on the built-in HF engine with llguidance: a response that must be JSON (any
object, or one following a JSON schema) samples each token from the logits with every token the
grammar forbids at -inf, so what is sampled always parses. llguidance rather than xgrammar (both
come with vLLM; `hfrt bench grammar-masks`, docs/agents-and-openai.md): either fills a mask in a
fraction of a millisecond, and llguidance has no dependencies of its own and is vLLM's guidance
backend, which the vLLM engine runs with the same settings — both engines allow the same tokens.

The JSON is compact (no free whitespace), and an object whose schema does not say otherwise takes
no properties beyond those it lists (as vLLM's default backend, xgrammar in strict mode, does): a
weak policy cannot wander into unbounded extra keys. It knows a tokenizer and llguidance; nothing
of engines, calls or HTTP.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from hfrt.wire.errors import InvalidArgument

#: schemas whose compiled grammar is kept (a client sends the same schema on every turn)
CACHED_GRAMMARS = 64


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that lists properties and
    does not say otherwise."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class JsonConstraint:
    """One row's llguidance matcher: `mask` forbids what the grammar does, `accept` advances it,
    `done` once it stopped (the JSON is whole and the end of sequence was sampled)."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        import llguidance.torch as llt

        self.matcher, self.vocab, self._llt = matcher, vocab, llt
        self._bitmask = llt.allocate_token_bitmask(1, vocab)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] (float, changed in place) with what the grammar forbids at -inf; the bitmask
        is unpacked eagerly here: llguidance's own apply is a torch.compile'd kernel whose first
        call takes seconds."""
        self._llt.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        forbidden = ((self._bitmask[0].unsqueeze(-1) >> self._shifts) & 1).view(-1)[:self.vocab] == 0
        logits[:self.vocab].masked_fill_(forbidden.to(logits.device), float("-inf"))
        logits[self.vocab:] = float("-inf")  # the model's head may be wider than the tokenizer: those ids are never valid
        return logits

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"json_schema: the grammar refused token {token}: {self.matcher.get_error()}")

    def done(self) -> bool:
        return bool(self.matcher.is_stopped())


class Grammars:
    """JSON constraints for one tokenizer. The llguidance tokenizer is built on first use (about
    a second for a 50k vocabulary, once per daemon); compiled grammars are kept per schema."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lltok: Any = None
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=len(self.tokenizer))
            return self._lltok

    def check(self, schema: Mapping[str, Any]) -> None:
        """InvalidArgument naming what llguidance refuses in `schema` (before anything is sampled)."""
        self.constraint(schema)

    def constraint(self, schema: Mapping[str, Any]) -> JsonConstraint:
        """A fresh constraint that a response follows `schema` (a JSON schema; {"type": "object"}: any object)."""
        import llguidance as llg

        key = json.dumps(schema, sort_keys=True)
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = llg.LLMatcher.grammar_from_json_schema(closed(copy.deepcopy(dict(schema))),
                                                              defaults={"whitespace_flexible": False})
            self._grammars[key] = grammar
            while len(self._grammars) > CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        lltok = self._llg_tokenizer()
        matcher = llg.LLMatcher(lltok, grammar)
        if matcher.is_error():
            self._grammars.pop(key, None)
            raise InvalidArgument("json_schema", f"json_schema: the schema cannot be followed: {matcher.get_error()}")
        return JsonConstraint(matcher, len(self.tokenizer))
