"""Schemas checked before llguidance sees them: too deep (nesting, $ref chains of every kind)
and recursive with no finite document are refused by name; recursion with a way out, and
everything up to the bounds, compiles in the real library. The bounds added to a schema
keep every document they allow valid under the original (jsonschema is the reference)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from qkv.errors import QkvError
from qkv.generation.constraints import Grammars, json_schema_grammar
from qkv.generation.schema_limits import (INTEGER_BOUND, MAX_ARRAY_ITEMS, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NESTING,
                                          MAX_STRING_LENGTH, bounded, check_schema)
from tests.conftest import chat_tokenizer


def ref_chain(n: int, kind: str = "pointer") -> dict[str, Any]:
    """n definitions, each referring to the next, the last an integer: by JSON pointer, by
    $anchor, or by $id URI (all three are resolved by llguidance)."""
    if kind == "pointer":
        defs: dict[str, Any] = {str(i): {"$ref": f"#/$defs/{i + 1}"} for i in range(n)}  # short: 30,000 in 1 MB
        defs[str(n)] = {"type": "integer"}
        return {"$ref": "#/$defs/0", "$defs": defs}
    if kind == "anchor":
        defs = {f"d{i}": {"$anchor": f"a{i}", "$ref": f"#a{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"$anchor": f"a{n}", "type": "integer"}
        return {"$ref": "#a0", "$defs": defs}
    defs = {f"d{i}": {"$id": f"https://qkv.test/d{i}", "$ref": f"d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"$id": f"https://qkv.test/d{n}", "type": "integer"}
    return {"$id": "https://qkv.test/root", "$ref": "d0", "$defs": defs}


def nested_arrays(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


LOOPS = {
    "a -> a": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "a -> b -> a": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    "a required self-reference": {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}},
    "the root required in itself": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    "a non-empty array of itself": {"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"},
                                                                          "minItems": 1}}},
    "allOf itself": {"$ref": "#/$defs/a", "$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}, {"type": "integer"}]}}},
}
TREE = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value"], "additionalProperties": False}}}
WAYS_OUT = {
    "a tree": TREE,
    "an optional self-reference": {"type": "object", "properties": {"next": {"$ref": "#"}}},
    "a list ended by null": {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["next"]}}},
}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tokenizer = chat_tokenizer()
    return Grammars(tokenizer, vocab_size=296, stop_ids={tokenizer.token_to_id("<|end|>")})


@pytest.mark.parametrize("kind", ["pointer", "anchor", "id"])
@pytest.mark.parametrize("n", [3_000, 30_000])
def test_long_ref_chains_are_refused_before_the_library(n: int, kind: str) -> None:
    with pytest.raises(QkvError, match=f"too deep.*{n + 3} levels.*at most {MAX_SCHEMA_DEPTH}"):
        json_schema_grammar(ref_chain(n, kind))


@pytest.mark.parametrize("n", [MAX_SCHEMA_NESTING, 3_000, 30_000])
def test_deep_nesting_is_refused(n: int) -> None:
    with pytest.raises(QkvError, match=f"nested deeper than {MAX_SCHEMA_NESTING} levels"):
        check_schema(nested_arrays(n))


@pytest.mark.parametrize("kind", ["pointer", "anchor", "id"])
def test_chains_within_the_bound_compile_in_the_library(grammars, kind: str) -> None:
    """The longest chain allowed (depth MAX_SCHEMA_DEPTH: the root, its $defs, the chain)."""
    grammar = json_schema_grammar(ref_chain(MAX_SCHEMA_DEPTH - 3, kind))
    grammars.check(grammar)
    constraint = grammars.constraint(grammar)
    for token in chat_tokenizer().encode("42").ids:
        constraint.accept(token)
    with pytest.raises(QkvError, match="too deep"):
        check_schema(ref_chain(MAX_SCHEMA_DEPTH - 2, kind))


def test_nesting_within_the_bound_compiles(grammars) -> None:
    grammars.check(json_schema_grammar(nested_arrays(MAX_SCHEMA_NESTING - 2)))


@pytest.mark.parametrize("name", list(LOOPS))
def test_loops_with_no_finite_document_are_refused_by_name(name: str) -> None:
    with pytest.raises(QkvError, match="recursive with no finite document: #.* needs itself again"):
        check_schema(LOOPS[name])


@pytest.mark.parametrize("name", list(WAYS_OUT))
def test_recursion_with_a_way_out_compiles_and_completes(grammars, name: str) -> None:
    grammar = json_schema_grammar(WAYS_OUT[name])
    grammars.check(grammar)
    document = {"a tree": {"value": 1, "children": [{"value": 2}]}, "an optional self-reference": {"next": {}},
                "a list ended by null": {"next": {"next": None}}}[name]
    jsonschema.validate(document, WAYS_OUT[name])  # the reference agrees the document is valid
    constraint = grammars.constraint(grammar)
    for token in chat_tokenizer().encode(json.dumps(document)).ids:
        constraint.accept(token)
    assert constraint.finished


def test_a_recursive_group_counts_all_its_members() -> None:
    """A cycle of n definitions: a resolver's recursion may walk all of it before it meets
    the start again, so the group counts n deep even though it loops."""
    n = MAX_SCHEMA_DEPTH
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{(i + 1) % n}"}, {"type": "null"}]} for i in range(n)}
    with pytest.raises(QkvError, match="too deep"):
        check_schema({"$ref": "#/$defs/d0", "$defs": defs})


def test_bounds_are_added_only_where_the_schema_has_none() -> None:
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "s": {"type": "string"}, "a": {"type": "array"},
        "kept": {"type": "integer", "minimum": 3, "maximum": 7}, "word": {"type": "string", "maxLength": 4},
        "code": {"type": "string", "pattern": "^[A-Z]+$"}, "c": {"const": {"type": "string"}}},
        "$defs": {"d": {"type": "string"}}}
    out = bounded(schema)
    props = out["properties"]
    assert props["n"] == {"type": "integer", "minimum": -INTEGER_BOUND, "maximum": INTEGER_BOUND}
    assert props["x"]["multipleOf"] == 1e-10 and props["x"]["maximum"] == INTEGER_BOUND
    assert props["s"]["maxLength"] == MAX_STRING_LENGTH and out["$defs"]["d"]["maxLength"] == MAX_STRING_LENGTH
    assert props["a"]["maxItems"] == MAX_ARRAY_ITEMS
    for name in ("kept", "word", "code", "c"):  # bounded already, or data: unchanged
        assert props[name] == schema["properties"][name]
    assert schema["properties"]["n"] == {"type": "integer"}  # the caller's schema is not changed


def test_bounds_never_empty_what_the_schema_allows(grammars) -> None:
    """Where a bound would leave no value (a minimum past the cap, a range narrower than the
    decimal step), it is not added: the schema still compiles and still takes its values."""
    cases = [({"type": "integer", "minimum": 10**17}, "100000000000000000"),
             ({"type": "number", "minimum": 0.5, "maximum": 0.50000000000001}, "0.500000000000005"),
             ({"type": "string", "minLength": MAX_STRING_LENGTH + 1}, '"' + "a" * (MAX_STRING_LENGTH + 1) + '"'),
             ({"type": "array", "minItems": MAX_ARRAY_ITEMS + 1}, json.dumps([1] * (MAX_ARRAY_ITEMS + 1)))]
    tokenizer = chat_tokenizer()
    for schema, document in cases:
        jsonschema.validate(json.loads(document), bounded(schema))
        constraint = grammars.constraint(json_schema_grammar(schema))
        for token in tokenizer.encode(document).ids:
            constraint.accept(token)
