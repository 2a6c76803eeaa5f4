"""Constrained decoding: a grammar decides, token by token, which tokens may come next.

    grammars = Grammars(tokenizer, vocab_size=V, stop_ids={eos})   # once per model (~0.3 s)
    constraint = grammars.constraint(json_schema_grammar(schema))  # one per request
    logits = constraint.mask(logits)     # (1, V): tokens the grammar forbids -> -inf
    constraint.accept(token)             # advance the matcher by the sampled token
    constraint.finished                  # the grammar is complete: nothing may follow
    schema_constraint(read_schema(path), tokenizer, vocab_size=V, stop_ids=...)   # qkv generate

Each request (each row of a batch) has its own `Constraint`, so rows in different states of
different grammars decode together; the mask is applied to the row's logits before
sampling, so temperature, top-p and the seed act on the allowed tokens only. The end-of-turn
tokens are allowed exactly when the grammar accepts what was generated, so a reply can end
only when it is complete (or at max_tokens, as with OpenAI's API). A JSON schema is checked
and bounded before it is compiled (qkv.generation.schema_limits: too deep or recursive with
no finite document is a QkvError; numbers, strings and arrays it leaves unbounded get bounds).

The matcher is llguidance's (Microsoft, MIT, Rust with Python bindings and no dependencies).
Measured on this CPU with SmolLM2's 49,152-token vocabulary (benchmarks/serve/grammar_mask.py,
RESULTS.md "Issue 25"), its per-token mask is the cheapest of the three maintained libraries
we tried (llguidance, xgrammar, outlines-core), it compiles a JSON schema in milliseconds
(outlines-core builds a whole-vocabulary index per schema, seconds), it installs without
pulling a GPU stack (xgrammar's wheel depends on triton), and it reads the tokenizer straight
from the `tokenizers` JSON, so no transformers is needed at run time.

Shape legend: V vocabulary (the model's logits width), W = ceil(V / 32) mask words.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.generation.schema_limits import bounded, check_schema


def forbidden_tokens(bitmask: Tensor, vocab_size: int) -> Tensor:
    """(V,) bool: the tokens whose bit is 0 in bitmask (W,) int32. Bit i of word w is token 32 w + i."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]  # (V,) 0 or 1
    return torch.from_numpy(bits == 0)


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """logits (..., V) with the tokens whose bit is 0 in bitmask (W,) int32 set to -inf (a
    new tensor: the logits may be inference tensors)."""
    return logits.masked_fill(forbidden_tokens(bitmask, logits.shape[-1]), -torch.inf)


# JSON as json.dumps writes it: ", " and ": ", no other whitespace (so a model cannot pad a
# document with spaces and newlines until max_tokens).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def with_layout(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` carrying JSON_LAYOUT for llguidance (its own "x-guidance" options win)."""
    return {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}


def prepared(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` as it is compiled: checked first (too deep, or recursive with no finite
    document: QkvError, before llguidance can overflow its stack on it), then given bounds
    where it has none and laid out as JSON_LAYOUT (qkv.generation.schema_limits)."""
    check_schema(schema)
    return with_layout(bounded(schema))


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """A llguidance grammar for JSON documents valid under `schema` (bounded and laid out
    by `prepared`)."""
    import llguidance

    schema = prepared(schema)  # QkvError naming the problem, before the compiler sees it
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except (ValueError, TypeError) as error:
        raise QkvError(f"the JSON schema cannot be compiled: {error}") from None


def lark_grammar(source: str) -> str:
    """A llguidance grammar from Lark text (which may embed `%json {schema}` rules)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(source)


class Constraint:
    """One request's matcher state: masks its logits and advances with each chosen token."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # (W,)

    def mask(self, logits: Tensor) -> Tensor:
        """logits (..., V) -> the same with every token the grammar forbids now at -inf."""
        return logits.masked_fill(self.forbidden(logits.shape[-1]), -torch.inf)

    def forbidden(self, vocab_size: int) -> Tensor:
        """(V,) bool: the tokens the grammar forbids now (what the decode loop masks in place)."""
        self._check()
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        self._check()
        return forbidden_tokens(self._bitmask, vocab_size)

    def accept(self, token: int) -> None:
        """Advance by the sampled token (a forbidden one is an error that names it)."""
        if not self._matcher.consume_token(token):
            raise QkvError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """Complete, and nothing more may follow (the reply ends here)."""
        return bool(self._matcher.is_stopped())

    def _check(self) -> None:
        if self._matcher.is_error():
            raise QkvError(f"constrained decoding failed: {self._matcher.get_error()}")


class Grammars:
    """Compiles grammars for one tokenizer (the token tables are built once, here)."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, stop_ids: Iterable[int]) -> None:
        import llguidance

        stops = sorted(stop_ids)
        if not stops:
            raise QkvError("constrained decoding needs an end-of-turn token to end a complete reply")
        self.vocab_size = vocab_size
        # n_vocab: the logits' width, which may exceed the tokenizer's (padded embeddings).
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=stops)

    def check(self, grammar: str) -> None:
        """Raise QkvError naming the problem if `grammar` cannot be used: one the compiler
        refuses, or one whose first step already fails (it admits no document)."""
        import llguidance

        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer,
                                                                                limits=quiet_limits())
        if failed:
            raise QkvError(f"the grammar cannot be used: {messages[0][:300]}")
        try:
            self.constraint(grammar).mask(torch.zeros(1, self.vocab_size))
        except QkvError as error:
            raise QkvError(f"the grammar admits no document ({str(error).split(': ', 1)[-1][:200]}); check the "
                           "schema's $refs and required fields") from None

    def constraint(self, grammar: str) -> Constraint:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=quiet_limits())
        if matcher.is_error():
            raise QkvError(f"the grammar cannot be used: {matcher.get_error()[:300]}")
        return Constraint(matcher, self.vocab_size)


def quiet_limits() -> Any:
    """llguidance's default limits, with errors that say what failed without the parser's
    internal state and the whole grammar (which it adds by default; no client needs them)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


MAX_SCHEMA_BYTES = 1 << 20


def read_schema(path: str) -> dict[str, Any]:
    """The JSON schema in file `path` (qkv generate --json-schema), bounded, checked to be an object."""
    from pathlib import Path

    file = Path(path).expanduser()
    try:
        if file.stat().st_size > MAX_SCHEMA_BYTES:
            raise QkvError(f"--json-schema {path}: over {MAX_SCHEMA_BYTES} bytes; give a smaller schema")
        schema = json.loads(file.read_text(encoding="utf-8"))
    except OSError as error:
        raise QkvError(f"--json-schema {path}: cannot read it ({error.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise QkvError(f"--json-schema {path}: not JSON ({error})") from None
    except RecursionError:  # json.loads recurses once per level (about 1,000 levels)
        raise QkvError(f"--json-schema {path}: nested too deep to read; flatten the schema") from None
    if not isinstance(schema, dict):
        raise QkvError(f"--json-schema {path}: a JSON schema is an object, got {type(schema).__name__}")
    import llguidance

    try:
        grammar = json_schema_grammar(schema)  # checked for depth and $ref loops first
    except QkvError as error:
        raise QkvError(f"--json-schema {path}: {error}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=quiet_limits())
    if failed:
        raise QkvError(f"--json-schema {path}: the schema cannot be enforced: {messages[0][:300]}")
    return schema


def schema_constraint(schema: dict[str, Any], tokenizer: Any, *, vocab_size: int,
                      stop_ids: Iterable[int]) -> Constraint:
    """A Constraint for `schema` on this tokenizer (qkv generate --json-schema)."""
    grammars = Grammars(tokenizer, vocab_size=vocab_size, stop_ids=stop_ids)
    grammar = json_schema_grammar(schema)
    grammars.check(grammar)
    return grammars.constraint(grammar)
