"""parse_json against json.loads (the reference) on every well-formed body, and a 400 naming
the problem on every malformed number, string or nesting."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.serve.api.json_body import MAX_DEPTH, MAX_INT_DIGITS, parse_json
from qkv.serve.api.schemas import ApiError

valid_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)  # no surrogates
scalars = (st.none() | st.booleans() | st.integers(-(10**MAX_INT_DIGITS) + 1, 10**MAX_INT_DIGITS - 1)
           | st.floats(allow_nan=False, allow_infinity=False) | valid_text)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(valid_text, inner, max_size=5),
                      max_leaves=40)


@settings(max_examples=80, deadline=None)
@given(values)
def test_well_formed_bodies_parse_as_json_loads_does(value: object) -> None:
    raw = json.dumps(value).encode()
    assert parse_json(raw) == json.loads(raw)


def _refused(raw: bytes | str) -> str:
    with pytest.raises(ApiError) as caught:
        parse_json(raw.encode() if isinstance(raw, str) else raw)
    assert caught.value.status == 400 and caught.value.message.startswith("the request body")
    return caught.value.message


@given(st.integers(0xD800, 0xDFFF), st.sampled_from(['{"prompt": "%s"}', '{"%s": 1}', '["a", ["%s"]]']))
def test_lone_surrogates_are_refused(code: int, shape: str) -> None:
    assert "surrogate" in _refused(shape % f"\\u{code:04x}")


def test_surrogate_pairs_are_characters_not_refusals() -> None:
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}


def test_the_refusal_names_where_the_surrogate_is() -> None:
    message = _refused('{"messages": [{"role": "user", "content": "a\\udc00"}]}')
    assert "messages[0].content" in message


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1E309", "NaN", "Infinity", "-Infinity", "9" * 5000,
                                    "-" + "1" * (MAX_INT_DIGITS + 1), "0." + "1" * 5000],
                         ids=lambda number: number if len(number) < 12 else f"{len(number)} characters")
def test_numbers_beyond_bounds_are_refused(number: str) -> None:
    _refused('{"temperature": %s}' % number)


def test_numbers_within_bounds_are_kept() -> None:
    assert parse_json(('{"a": %s, "b": 1.7976931348623157e308}' % ("9" * MAX_INT_DIGITS)).encode()) == {
        "a": int("9" * MAX_INT_DIGITS), "b": 1.7976931348623157e308}


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1000, 100_000])
def test_deep_nesting_is_refused(depth: int) -> None:
    assert "nested deeper" in _refused("[" * depth + "]" * depth)
    assert "nested deeper" in _refused('{"a": ' * depth + "1" + "}" * depth)


def test_nesting_up_to_the_bound_is_kept() -> None:
    assert parse_json(("[" * MAX_DEPTH + "]" * MAX_DEPTH).encode()) is not None


@pytest.mark.parametrize("raw", [b"\xff", b'"\xed\xa0\x80"', '{"a": 1}'.encode("utf-16"), b"\xef\xbb\xbf{}",
                                 b"", b"{", b"{} x"])
def test_bodies_that_are_not_utf8_json_are_refused(raw: bytes) -> None:
    _refused(raw)
