"""The grammar mask against the documents it should allow and refuse, and against jsonschema."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings, strategies as st

from qkv.errors import QkvError
from qkv.generation.constraints import Grammars, apply_bitmask, json_schema_grammar
from tests.conftest import chat_tokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 500},
                                           "word": {"type": "string", "maxLength": 8},
                                           "flag": {"type": "boolean"}},
          "required": ["n", "word", "flag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, vocab_size=296, stop_ids={tokenizer.token_to_id("<|end|>")})


def _walk(grammars: Grammars, tokenizer, text: str) -> tuple[bool, bool]:
    """(every token of `text` was allowed by the mask before it was taken, finished after)."""
    constraint = grammars.constraint(json_schema_grammar(SCHEMA))
    for token in tokenizer.encode(text).ids:
        masked = constraint.mask(torch.zeros(1, 296))  # (1, V)
        if masked[0, token].item() == -torch.inf:
            return False, False
        constraint.accept(token)
    return True, constraint.finished


@settings(max_examples=12, deadline=None)
# Control characters (category Cc) are left out: json.dumps writes U+007F-U+009F raw, and
# llguidance's JSON strings take control characters only escaped (found by this test), so
# such a document is valid JSON that the grammar does not produce; what it produces parses.
@given(n=st.integers(-5, 500), word=st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=8),
       flag=st.booleans())
def test_every_valid_document_is_allowed_and_completes(grammars, tokenizer, n, word, flag) -> None:
    document = json.dumps({"n": n, "word": word, "flag": flag}, ensure_ascii=False)
    assert _walk(grammars, tokenizer, document) == (True, True)


@pytest.mark.parametrize("document", ['{"n": 501, "word": "a", "flag": true}',
                                      '{"n": 1, "word": "abcdefghi", "flag": true}',
                                      '{"n": 1, "flag": true}', '{"n": 1, "word": "a", "flag": true, "x": 1}'])
def test_documents_outside_the_schema_are_refused(grammars, tokenizer, document) -> None:
    with pytest.raises(jsonschema.ValidationError):  # the reference agrees that it is outside
        jsonschema.validate(json.loads(document), SCHEMA)
    assert _walk(grammars, tokenizer, document)[0] is False


def test_the_layout_is_json_dumps(grammars, tokenizer) -> None:
    assert _walk(grammars, tokenizer, '{"n": 1, "word": "a", "flag": true}') == (True, True)
    assert _walk(grammars, tokenizer, '{"n":1, "word": "a", "flag": true}')[0] is False
    assert _walk(grammars, tokenizer, '{"n": 1,\n "word": "a", "flag": true}')[0] is False


def test_the_end_token_is_allowed_only_when_the_document_is_complete(grammars, tokenizer) -> None:
    end = tokenizer.token_to_id("<|end|>")
    constraint = grammars.constraint(json_schema_grammar({"type": "array", "items": {"type": "integer"}}))
    for token in tokenizer.encode("[1, 2").ids:
        assert constraint.mask(torch.zeros(296))[end].item() == -torch.inf
        constraint.accept(token)
    constraint.accept(tokenizer.encode("]").ids[0])
    allowed = constraint.mask(torch.zeros(296))
    assert allowed[end].item() == 0 and (allowed == 0).sum().item() == 1  # nothing but the end


def test_bitmask_bits_are_tokens() -> None:
    bitmask = torch.zeros(3, dtype=torch.int32)  # tokens 0..95
    bitmask[0] = 1 << 3
    bitmask[2] = -(1 << 31) | 1  # tokens 64 and 95 (the sign bit)
    kept = apply_bitmask(torch.zeros(1, 70), bitmask)
    assert torch.nonzero(kept[0] == 0).flatten().tolist() == [3, 64]  # 95 is past V = 70
    wide = apply_bitmask(torch.zeros(96), bitmask)
    assert torch.nonzero(wide == 0).flatten().tolist() == [3, 64, 95]


def test_a_schema_the_compiler_cannot_enforce_is_refused_by_name(grammars) -> None:
    with pytest.raises(QkvError, match="no-such"):
        grammars.check(json_schema_grammar({"type": "string", "format": "no-such"}))
    with pytest.raises(QkvError, match="refused token"):
        constraint = grammars.constraint(json_schema_grammar({"type": "boolean"}))
        constraint.accept(chat_tokenizer().encode("x").ids[0])


def _allowed_after(grammars, tokenizer, schema: dict, text: str) -> list[str]:
    """The texts of the tokens the grammar allows after `text` (each token of it allowed first)."""
    constraint = grammars.constraint(json_schema_grammar(schema))
    for token in tokenizer.encode(text).ids:
        assert constraint.mask(torch.zeros(296))[token].item() == 0, (text, token)
        constraint.accept(token)
    allowed = torch.nonzero(constraint.mask(torch.zeros(296)) == 0).flatten().tolist()
    return [tokenizer.decode([t]) for t in allowed]


@pytest.mark.parametrize("sign", ["", "-"])
def test_an_unbounded_integer_stops_at_16_digits(grammars, tokenizer, sign) -> None:
    """Where the schema gives no bound: 16 digits, as llama.cpp's JSON grammar, then only
    what may follow a number (so a model that keeps choosing digits cannot run away)."""
    schema = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"]}
    before = _allowed_after(grammars, tokenizer, schema, '{"population": ' + sign + "1" * 15)
    assert "1" in before
    after = _allowed_after(grammars, tokenizer, schema, '{"population": ' + sign + "1" * 16)
    assert after and not any(text[:1].isdigit() for text in after), after


def test_an_unbounded_number_has_at_most_10_decimals(grammars, tokenizer) -> None:
    assert "5" in _allowed_after(grammars, tokenizer, {"type": "number"}, "3." + "1" * 9)
    assert not any(t[:1].isdigit() for t in _allowed_after(grammars, tokenizer, {"type": "number"}, "3." + "1" * 10))
    assert not any(t[:1].isdigit() for t in _allowed_after(grammars, tokenizer, {"type": "number"}, "9" * 16))


def test_a_bound_the_schema_gives_is_kept(grammars, tokenizer) -> None:
    big = {"type": "integer", "minimum": 0, "maximum": 10**18}  # 19 digits: the schema's own bound wins
    assert "0" in _allowed_after(grammars, tokenizer, big, "1" + "0" * 17)


def test_json_object_mode_bounds_keys_and_values(grammars, tokenizer) -> None:
    """response_format json_object's schema: any JSON object, its keys at most MAX_KEY_LENGTH
    characters and its numbers 16 digits (a model that keeps choosing "1" cannot run away)."""
    from qkv.generation.schema_limits import ANY_JSON_OBJECT, MAX_KEY_LENGTH

    document = {"a": [1, -2.5, None, True, "x", {"b": {}}], "c": "d"}
    end = tokenizer.decode([tokenizer.token_to_id("<|end|>")])
    assert _allowed_after(grammars, tokenizer, ANY_JSON_OBJECT, json.dumps(document)) == [end]  # complete
    key = _allowed_after(grammars, tokenizer, ANY_JSON_OBJECT, '{"' + "1" * MAX_KEY_LENGTH)
    assert "1" not in key and '"' in key
    value = _allowed_after(grammars, tokenizer, ANY_JSON_OBJECT, '{"k": [' + "1" * 16)
    assert value and not any(text[:1].isdigit() for text in value)
