"""qkv.serve.api.answer: a choice's finish_reason when its text met a stop string.

The engine knows no stop strings (the answer cuts the text), so it may report a job that
reached max_tokens ("length") after the text already stopped; the choice still finished by its
stop string. Real tokenizer (byte-level BPE), real request parsing."""

from __future__ import annotations

from qkv.serve.api.answer import Choice
from qkv.serve.engine.jobs import Finished, Token
from qkv.serve.api.schemas import Limits, parse
from qkv.serve.api.tokens import TokenTexts
from tests.models.conftest import make_tokenizer


def _choice(stop: str) -> tuple[Choice, list[int]]:
    tokenizer = make_tokenizer()
    request = parse({"model": "tiny", "prompt": "Your", "max_tokens": 12, "stop": stop}, chat=False, limits=Limits())
    ids = tokenizer.encode(" journey starts with one step.").ids
    return Choice(request, False, TokenTexts(tokenizer), [0], "Your"), ids


def test_a_stop_string_met_before_the_length_is_the_finish_reason() -> None:
    choice, ids = _choice("with")
    for token in ids:
        choice.take(Token(token))
    choice.take(Finished("length"))  # the engine ran on to max_tokens: the stop string came first
    assert choice.text == " journey starts " and choice.finish == "stop"


def test_without_a_stop_string_the_length_stays_the_reason() -> None:
    choice, ids = _choice("never in the text")
    for token in ids:
        choice.take(Token(token))
    choice.take(Finished("length"))
    assert choice.text == " journey starts with one step." and choice.finish == "length"


def test_a_grammar_that_fails_mid_answer_is_the_requests_400_and_a_failed_step_the_servers_500() -> None:
    """The engine tells the two apart (Finished 'grammar' / 'error'); the request's own structure is
    never answered as the server's fault."""
    grammar, ids = _choice("never in the text")
    grammar.take(Token(ids[0]))
    grammar.take(Finished("grammar", "no token continues the JSON"))
    failure = grammar.failure()
    assert grammar.finish == "error" and failure.status == 400 and "no token continues the JSON" in failure.message
    assert failure.body()["error"]["type"] == "invalid_request_error"
    step, _ = _choice("never in the text")
    step.take(Finished("error", "RuntimeError: boom"))
    assert step.failure().status == 500
