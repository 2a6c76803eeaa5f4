"""Tokenizers from strangers, run inside bounds: the pipeline checked before use, encoding
bounded by what the input can grow into.

A tokenizer.json is code as much as data: its normalizer can replace one character by
forty, five times over (40^5 = 10^8 characters for every "o" of a prompt, allocated by
Rust, which aborts the process when it cannot), its pre-tokenizer can split with a regex
that backtracks catastrophically (Oniguruma then panics, and a pyo3 panic is a
BaseException that escapes `except Exception`). `guard` wraps a loaded tokenizer after:

- **a static worst case**: every normalizer step has a worst-case growth in UTF-8 bytes
  (`Replace("o", "o"*40)`: 40x; `NFKC`: 18x; `Prepend`: its length per piece; a
  `Sequence` multiplies), the pre-tokenizer and decoder likewise. A chain whose factor is
  above `MAX_EXPANSION` (1024: legitimate chains reach about 72, BERT's about 24) is
  refused at load, naming the steps;
- **a regex probe**: every regex the file brings (Split pre-tokenizers, Replace with a
  Regex) is run once at load on inputs built from its own characters repeated (the shape
  catastrophic backtracking needs: `"a"*64 + "!"` for `(a|aa)+$`); exponential growth or a
  panic refuses the file. We guard rather than try to recognise
  dangerous patterns by their syntax: real tokenizers (Llama 3's, Qwen's) nest quantifiers
  inside alternations too. A probe whose time grows more than 16x when its length doubles
  (lengths 8 to 64) is exponential and refused there, in milliseconds; Oniguruma's own
  retry limit bounds each match beyond that, so what remains is to turn its panic into one
  line. That is the second half: every call into
  the Rust pipeline catches the panic (`TokenizerPanicError`, a QkvError), and for files with
  their own regexes the Rust panic hook's text on fd 2 is captured and dropped;
- **an output bound measured on the input**: before `encode`, the input's UTF-8 size times
  the static factor is compared with `limit_for(size)`: 2 MiB (every byte its own token
  costs about 230 bytes of Rust memory, so about 450 MB at the bound), or 4 times the input
  when that is more, so a large text of the user's own still encodes but never grows more. Within it, the
  encode runs. Beyond it the normalizer runs alone on pieces small enough that even the
  worst case stays within the bound, summing what they grow into, and the text is refused
  as soon as the sum passes the bound: nothing larger than the bound is ever made.

Shape legend: none (text in, token ids out).
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from qkv.errors import QkvError

MAX_EXPANSION = 1024  # worst-case growth of a normalizer, pre-tokenizer or decoder chain
MAX_ENCODE_BYTES = 2 << 20  # normalized UTF-8 bytes one encode may make, or
MAX_GROWTH = 4  # this many times the input's bytes, whichever is more (a large file of one's own)
SLOW_PROBE_SECONDS = 5e-4  # a probe slower than this, and
GROWTH_RATIO = 16.0  # this many times slower than the one of half its length, is exponential
_PROBE_LADDER = (8, 12, 16, 24, 32, 64)
# Worst growth of one character in UTF-8 bytes (measured over every code point with Python's
# unicodedata, then rounded up for Rust's Unicode version: NFKC U+FDFA 3 -> 33 bytes).
_UNICODE_GROWTH = {"NFC": 4.0, "NFD": 4.0, "NFKC": 18.0, "NFKD": 18.0, "Lowercase": 3.0}
_NEUTRAL = {"Strip", "StripAccents", "Nmt", "ByteLevel"}  # never grow (ByteLevel normalizer: 2x below)
_SPLITTERS = {"Whitespace", "WhitespaceSplit", "Punctuation", "Digits", "UnicodeScripts", "BertPreTokenizer",
              "CharDelimiterSplit", "Split", "FixedLength"}
_DECODERS_NEUTRAL = {"ByteLevel", "WordPiece", "Metaspace", "BPEDecoder", "CTC", "Fuse", "Strip", "ByteFallback"}

T = TypeVar("T")


class TokenizerPanicError(QkvError):
    """The Rust tokenizer panicked (a regex over its retry limit, an internal error)."""


@dataclass(frozen=True)
class Growth:
    """Worst-case size of a step's output: factor * input bytes + extra bytes."""

    factor: float = 1.0
    extra: int = 0
    steps: tuple[str, ...] = field(default=())

    def then(self, other: Growth) -> Growth:
        return Growth(self.factor * other.factor, int(self.extra * other.factor) + other.extra, self.steps + other.steps)

    def bound(self, size: int) -> float:
        return self.factor * size + self.extra


def _nbytes(text: Any) -> int:
    return len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0


def _pattern(spec: Any) -> tuple[str, str]:
    """("String" | "Regex", text) of a tokenizer.json pattern."""
    if isinstance(spec, dict) and len(spec) == 1:
        (kind, text), = spec.items()
        if kind in ("String", "Regex") and isinstance(text, str):
            return kind, text
    raise QkvError(f"a pattern must be {{'String': ...}} or {{'Regex': ...}}, got {str(spec)[:60]}")


def _replace_growth(spec: dict[str, Any]) -> Growth:
    kind, text = _pattern(spec.get("pattern"))
    content = _nbytes(spec.get("content"))
    if kind == "String" and text:
        factor = max(1.0, content / _nbytes(text))
    else:  # a regex (or an empty string) may match between every two characters
        factor = 1.0 + content
    return Growth(factor, content, (f"Replace({text[:20]!r} -> {content} bytes)",))


def _precompiled_growth(spec: dict[str, Any]) -> Growth:
    """SentencePiece's charsmap: a trie then the replacement strings, NUL-separated; one
    character becomes at most the longest of them."""
    try:
        blob = base64.b64decode(spec.get("precompiled_charsmap") or b"", validate=False)
        trie = int.from_bytes(blob[:4], "little")
        longest = max((len(s) for s in blob[4 + trie:].split(b"\0")), default=1)
    except (ValueError, TypeError):
        raise QkvError("the Precompiled normalizer's charsmap cannot be read") from None
    return Growth(float(max(1, longest)), 0, (f"Precompiled(up to {longest} bytes a character)",))


def normalizer_growth(spec: Any) -> Growth:
    if spec is None:
        return Growth()
    if not isinstance(spec, dict):
        raise QkvError(f"a normalizer must be an object, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind == "Sequence":
        total = Growth()
        for step in spec.get("normalizers") or []:
            total = total.then(normalizer_growth(step))
        return total
    if kind == "Replace":
        return _replace_growth(spec)
    if kind == "Prepend":  # prepended to every piece between added tokens: per byte at worst
        n = _nbytes(spec.get("prepend"))
        return Growth(1.0 + n, n, (f"Prepend({n} bytes)",))
    if kind in _UNICODE_GROWTH:
        return Growth(_UNICODE_GROWTH[kind], 0, (kind,))
    if kind == "BertNormalizer":  # spaces around CJK characters, NFD for accents, lowercase
        return Growth(2.0 * _UNICODE_GROWTH["NFD"] * _UNICODE_GROWTH["Lowercase"], 0, (kind,))
    if kind == "Precompiled":
        return _precompiled_growth(spec)
    if kind == "ByteLevel":
        return Growth(2.0, 0, (kind,))
    if kind in _NEUTRAL:
        return Growth(1.0, 0, (kind,))
    raise QkvError(f"the normalizer type {kind!r} is not one qkv knows how to bound")


def pre_tokenizer_growth(spec: Any) -> Growth:
    if spec is None:
        return Growth()
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "Sequence":
        total = Growth()
        for step in spec.get("pretokenizers") or []:
            total = total.then(pre_tokenizer_growth(step))
        return total
    # Counted in symbols the model sees (the memory of an encode goes with them), per byte:
    if kind == "ByteLevel":  # one symbol per byte, and perhaps a space first
        return Growth(1.0, 1, (kind,))
    if kind == "Metaspace":  # ' ' -> the replacement, and one more before every piece
        return Growth(2.0, 1, (kind,))
    if kind in _SPLITTERS:
        return Growth(1.0, 0, (kind,))
    raise QkvError(f"the pre-tokenizer type {kind!r} is not one qkv knows how to bound")


def decoder_growth(spec: Any) -> Growth:
    if spec is None:
        return Growth()
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "Sequence":
        total = Growth()
        for step in spec.get("decoders") or []:
            total = total.then(decoder_growth(step))
        return total
    if kind == "Replace":
        return _replace_growth(spec)
    if kind in _DECODERS_NEUTRAL:
        return Growth(2.0 if kind in ("WordPiece", "BPEDecoder", "Metaspace") else 1.0, 0, (kind,))
    raise QkvError(f"the decoder type {kind!r} is not one qkv knows how to bound")


def _regexes(spec: Any) -> Iterable[str]:
    """Every regex pattern in a normalizer or pre-tokenizer tree."""
    if isinstance(spec, dict):
        if spec.get("type") in ("Split", "Replace"):
            try:
                kind, text = _pattern(spec.get("pattern"))
            except QkvError:
                return
            if kind == "Regex":
                yield text
        for value in spec.values():
            yield from _regexes(value)
    elif isinstance(spec, list):
        for value in spec:
            yield from _regexes(value)


def probes(pattern: str) -> list[tuple[str, str]]:
    """(character, end) pairs: inputs made of one of the pattern's own characters repeated,
    then a character that breaks the match, the shape on which backtracking blows up."""
    alphabet = {c for c in pattern if c.isprintable() and c not in "\\()[]{}|?*+^$.,:!<=>-"}
    alphabet |= {"a", " ", "1", "\n"}
    return [(c, end) for c in sorted(alphabet)[:24] for end in ("!", "\u00e9", "\x00")]


# ----------------------------------------------------------------------------- Rust calls


class _StderrTrap:
    """While a Rust call that may panic runs, fd 2 points at a scratch file: the panic
    hook's lines are dropped when it panicked, anything else is written back afterwards.
    One lock for the process: fd 2 is shared by every thread."""

    lock = threading.Lock()
    scratch: int | None = None

    @classmethod
    def run(cls, call: Callable[[], T]) -> tuple[T | None, BaseException | None]:
        with cls.lock:
            if cls.scratch is None:
                handle, name = tempfile.mkstemp(prefix="qkv-stderr-")
                os.unlink(name)
                cls.scratch = handle
            os.ftruncate(cls.scratch, 0)
            os.lseek(cls.scratch, 0, os.SEEK_SET)
            saved = os.dup(2)
            os.dup2(cls.scratch, 2)
            result: T | None = None
            failure: BaseException | None = None
            try:
                result = call()
            except BaseException as error:  # noqa: BLE001 - the pyo3 panic is a BaseException
                failure = error
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            if failure is None or not _is_panic(failure):
                size = os.lseek(cls.scratch, 0, os.SEEK_END)
                if size:
                    os.lseek(cls.scratch, 0, os.SEEK_SET)
                    os.write(2, os.read(cls.scratch, size))
            return result, failure


def _is_panic(error: BaseException) -> bool:
    return type(error).__name__ == "PanicException"


def rust_call(call: Callable[[], T], *, what: str, trap: bool) -> T:
    """`call()`, with a Rust panic turned into TokenizerPanicError (and, with `trap`, the
    panic hook's text kept off the terminal)."""
    if trap:
        result, failure = _StderrTrap.run(call)
    else:
        try:
            return call()
        except BaseException as error:
            result, failure = None, error
    if failure is None:
        return result  # type: ignore[return-value]
    if _is_panic(failure):
        first = (str(failure).splitlines() or [""])[0][:160]
        raise TokenizerPanicError(f"the tokenizer failed while {what} ({first}); its file is faulty") from None
    raise failure


# ----------------------------------------------------------------------------- the wrapper


def limit_for(size: int) -> int:
    """What a text of `size` UTF-8 bytes may grow into: MAX_ENCODE_BYTES, or MAX_GROWTH times
    itself when that is more (a 100 MB text of one's own may be encoded, but not made 40x)."""
    return max(MAX_ENCODE_BYTES, MAX_GROWTH * size)


class BoundedTokenizer:
    """A `tokenizers.Tokenizer` whose encode and decode run inside the bounds above; every
    other attribute is the wrapped tokenizer's."""

    def __init__(self, inner: Any, *, normalizer: Growth, pre_tokenizer: Growth, trap: bool, source: str) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "growth", normalizer.then(pre_tokenizer))
        object.__setattr__(self, "pre_tokenizer_growth", pre_tokenizer)
        object.__setattr__(self, "trap", trap)
        object.__setattr__(self, "source", source)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def check_size(self, text: str, *, limit: int | None = None) -> None:
        """Refuse `text` when what the normalizer makes of it passes `limit` bytes (default:
        `limit_for` its size), finding out on pieces whose worst case fits the limit."""
        size = _nbytes(text)
        limit = limit_for(size) if limit is None else limit
        if self.growth.bound(size) <= limit:
            return
        normalizer = self.inner.normalizer
        if normalizer is None:  # only the pre-tokenizer grows it
            grown = size
        else:
            piece = max(1, int(limit / max(self.growth.factor, 1.0)) // 4)  # characters of <= 4 bytes
            grown = 0
            for start in range(0, len(text), piece):
                part = text[start:start + piece]
                grown += _nbytes(rust_call(lambda p=part: normalizer.normalize_str(p), what="normalizing", trap=self.trap))
                if grown > limit:
                    break
        if self.pre_tokenizer_growth.bound(grown) > limit:
            raise QkvError(
                f"the tokenizer ({self.source}) would grow this {size:,}-byte text past {limit:,} bytes "
                f"(its normalizer makes about {grown:,} bytes of it); give a shorter text or another tokenizer")

    def encode(self, sequence: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(sequence, str):
            self.check_size(sequence)
        return rust_call(lambda: self.inner.encode(sequence, *args, **kwargs), what="encoding", trap=self.trap)

    def encode_batch(self, inputs: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        for text in inputs:
            if isinstance(text, str):
                self.check_size(text)
        return rust_call(lambda: self.inner.encode_batch(inputs, *args, **kwargs), what="encoding", trap=self.trap)

    def decode(self, ids: Sequence[int], *args: Any, **kwargs: Any) -> str:
        return rust_call(lambda: self.inner.decode(ids, *args, **kwargs), what="decoding", trap=self.trap)

    def decode_batch(self, batch: Sequence[Sequence[int]], *args: Any, **kwargs: Any) -> list[str]:
        return rust_call(lambda: self.inner.decode_batch(batch, *args, **kwargs), what="decoding", trap=self.trap)


def _probe_regex(pattern: str, source: str) -> None:
    """Refuse `pattern` when doubling a probe's length multiplies its time (exponential
    backtracking, found in milliseconds, before Oniguruma's retry limit is reached) or when
    a probe panics."""
    from tokenizers import Regex, pre_tokenizers

    try:
        split = pre_tokenizers.Split(Regex(pattern), "isolated")
    except Exception as error:  # noqa: BLE001 - Oniguruma refuses the pattern
        raise QkvError(f"{source}: the regex {pattern[:60]!r} does not compile ({str(error)[:100]})") from None

    def timed(text: str) -> float:
        start = time.perf_counter()
        try:
            rust_call(lambda: split.pre_tokenize_str(text), what="probing", trap=True)
        except TokenizerPanicError:
            raise QkvError(f"{source}: the regex {pattern[:60]!r} panics the tokenizers library on {text[:1]!r} * "
                           f"{len(text) - 1} (catastrophic backtracking); refusing the tokenizer") from None
        return time.perf_counter() - start

    for c, end in probes(pattern):
        seconds: dict[int, float] = {}
        for length in _PROBE_LADDER:
            seconds[length] = timed(c * length + end)
            half = seconds.get(length // 2)
            if half is None or seconds[length] <= SLOW_PROBE_SECONDS:
                continue
            if seconds[length] > GROWTH_RATIO * max(half, 10e-6):
                again = min(seconds[length], timed(c * length + end))  # not a stall of the machine
                if again > SLOW_PROBE_SECONDS and again > GROWTH_RATIO * max(half, 10e-6):
                    raise QkvError(
                        f"{source}: the regex {pattern[:60]!r} backtracks exponentially on {c!r} repeated "
                        f"({length // 2} of them: {half * 1e3:.2f} ms, {length}: {again * 1e3:.1f} ms); "
                        "refusing the tokenizer")


def guard(tokenizer: Any, source: str, *, pipeline: dict[str, Any] | None = None) -> BoundedTokenizer:
    """Check `tokenizer`'s pipeline (module docstring) and wrap it; QkvError when it can grow
    text more than MAX_EXPANSION times or its regexes backtrack out of bounds. `pipeline`:
    its normalizer, pre_tokenizer and decoder as tokenizer.json spells them, when the caller
    built them (saves serializing a large vocabulary to read them back)."""
    if isinstance(tokenizer, BoundedTokenizer):
        return tokenizer
    try:
        spec = pipeline if pipeline is not None else json.loads(tokenizer.to_str())
    except Exception as error:  # noqa: BLE001
        raise QkvError(f"{source}: the tokenizer cannot be serialized for checking ({str(error)[:100]})") from None
    try:
        normalizer = normalizer_growth(spec.get("normalizer"))
        pre = pre_tokenizer_growth(spec.get("pre_tokenizer"))
        decoder = decoder_growth(spec.get("decoder"))
    except QkvError as error:
        raise QkvError(f"{source}: {error}") from None
    for name, growth in (("normalizer", normalizer), ("pre-tokenizer", pre), ("decoder", decoder),
                         ("normalizer and pre-tokenizer", normalizer.then(pre))):
        if growth.factor > MAX_EXPANSION:
            steps = ", ".join(growth.steps[:6]) + (", ..." if len(growth.steps) > 6 else "")
            raise QkvError(f"{source}: its {name} can grow text {growth.factor:,.0f} times (at most {MAX_EXPANSION:,}): "
                           f"{steps}; refusing the tokenizer")
    patterns = sorted(set(_regexes(spec.get("normalizer"))) | set(_regexes(spec.get("pre_tokenizer"))))
    for pattern in patterns:
        _probe_regex(pattern, source)
    return BoundedTokenizer(tokenizer, normalizer=normalizer, pre_tokenizer=pre, trap=bool(patterns), source=source)
