"""The tokenizer a GGUF file describes, as a `tokenizers.Tokenizer`.

A GGUF file has no tokenizer.json: llama.cpp's converter writes the vocabulary as metadata
(`tokenizer.ggml.tokens`, `.scores`, `.token_type`, `.merges`, the special ids, the flags)
and names the algorithm in `tokenizer.ggml.model`. Two kinds cover the files people run:

- **`gpt2`, byte-level BPE** (Qwen, SmolLM, Llama 3, GPT-2): every byte is spelled as one
  printable character (GPT-2's byte alphabet), merges are listed best first, and the text
  is split before merging by the regex `tokenizer.ggml.pre` names (`PRE_TOKENIZERS`; one qkv
  does not know is refused by name rather than guessed, since a wrong split gives other ids).
- **`llama`, SentencePiece** (Llama 2, Mistral, Gemma): spaces become the marker U+2581,
  a space is put before the text (`add_space_prefix`), pieces merge by their scores, and a
  character with no piece falls back to its UTF-8 bytes as the tokens `<0x00>`..`<0xFF>`.
  This is BPE with byte fallback whose merges are recovered from the vocabulary: every way
  to cut a piece into two pieces is a merge, ranked by the whole piece's score (Gemma's
  scores do not follow its merge order, its file order does, so there the rank is the
  position). This is how transformers reads these files, and qkv's ids equal its ids; they
  also equal SentencePiece's own encoding, but for a text that starts with a space, which
  gets one marker here (as in transformers) where SentencePiece puts two. Unlike
  transformers, `add_space_prefix = false` is honoured (transformers goes by architecture:
  Gemma's files say false, Llama's true). `add_space_prefix` is read for SentencePiece only,
  as llama.cpp reads it.

Tokens typed CONTROL (and the bos/eos/unk/pad tokens) are special: matched whole in the text
and skipped by `decode(skip_special_tokens=True)`; USER_DEFINED ones are matched whole but
are text. Every count is checked before anything is built from it: the header reader has
checked each array against the bytes left in the file; here the vocabulary is bounded by
MAX_VOCAB, a token by MAX_TOKEN_BYTES, and the arrays must agree in length.

Shape legend: V vocabulary (text in, token ids out; no tensors).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.models.configs.fields import MAX_VOCAB, is_int

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3  # special: <|im_start|>, <s>, ...
TOKEN_TYPE_USER_DEFINED = 4  # added text tokens, matched whole: <think>, ...
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6  # SentencePiece's byte fallback pieces <0x00>..<0xFF>

KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
SPACE_MARKER = "\u2581"  # SentencePiece's visible space
MAX_TOKEN_BYTES = 1 << 16  # one token's spelling; real ones stay under a few hundred bytes
MAX_VOCAB_CHARS = 1 << 26  # all tokens together (Gemma's 262k tokens: about 2.6M characters)
MAX_DERIVED_MERGES = 1 << 23  # merges recovered from scores (a real vocabulary: under one per token)

# The split each pre-tokenizer name stands for (llama.cpp's names; the regexes are the ones
# in the tokenizer.json files these vocabularies were trained with). None: GPT-2's own split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED_WORD = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"  # o200k's split: a word's upper, then lower letters
_LOWER_WORD = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_SPLIT = "|".join([
    rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED_WORD}*{_LOWER_WORD}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED_WORD}+{_LOWER_WORD}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None,
    "smollm": None,  # GPT-2's split after every digit is cut off on its own (`_pre_tokenizer`)
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,  # Phi-4-mini
}
_GEMMA = ("gemma", "gemma2", "gemma3")  # merges ranked by file order, spaces spelled as-is
_PHI3 = ("phi3",)  # the space marker goes before every piece between special tokens


@dataclass(frozen=True)
class GGUFVocabulary:
    """The tokenizer metadata of a GGUF file, every value checked."""

    kind: str  # "gpt2" | "llama"
    pre: str  # a PRE_TOKENIZERS name ("default" for SentencePiece)
    architecture: str
    tokens: list[str]  # (V,)
    types: list[int]  # (V,)
    scores: list[float] | None  # (V,), SentencePiece
    merges: list[tuple[str, str]] | None  # as the file lists them, best first
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    def token(self, index: int | None) -> str | None:
        return None if index is None else self.tokens[index]


@dataclass(frozen=True)
class GGUFTokenizer:
    """The tokenizer with what comes with it: the special tokens and the chat template."""

    tokenizer: Any  # qkv.models.hf.tokenizer_guard.BoundedTokenizer around a tokenizers.Tokenizer
    vocabulary: GGUFVocabulary

    @property
    def chat_template(self) -> str | None:
        return self.vocabulary.chat_template

    @property
    def special_tokens(self) -> dict[str, str | None]:
        v = self.vocabulary
        return {"bos": v.token(v.bos_id), "eos": v.token(v.eos_id), "unk": v.token(v.unk_id), "pad": v.token(v.pad_id)}


# ----------------------------------------------------------------------------- metadata


def _value(reader: Any, key: str, path: Path, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as error:  # a bad UTF-8 byte or a malformed field
        raise QkvError(f"{path}: metadata key {key!r} cannot be read ({type(error).__name__})") from None


def _flag(reader: Any, key: str, path: Path, default: bool) -> bool:
    value = _value(reader, key, path, default)
    if not isinstance(value, bool):
        raise QkvError(f"{path}: {key} must be true or false, not {str(value)[:40]}")
    return value


def _token_id(reader: Any, key: str, path: Path, count: int) -> int | None:
    value = _value(reader, key, path)
    if value is None:
        return None
    if not is_int(value) or not 0 <= value < count:
        raise QkvError(f"{path}: {key} is {str(value)[:40]}, not a token id between 0 and {count - 1}")
    return int(value)


def _array(reader: Any, key: str, path: Path, count: int | None, what: str) -> list[Any] | None:
    """The array at `key` (None when absent), its length checked before it is decoded."""
    field = reader.fields.get(key)
    if field is None:
        return None
    if count is not None and field.count != count:
        raise QkvError(f"{path}: {key} holds {field.count} entries, not one per token ({count})")
    if field.count > MAX_VOCAB * 8:
        raise QkvError(f"{path}: {key} holds {field.count:,} entries, more than qkv reads ({MAX_VOCAB * 8:,})")
    values = _value(reader, key, path)
    if not isinstance(values, list):
        raise QkvError(f"{path}: {key} must be an array of {what}")
    return values


def read_vocabulary(reader: Any, path: Path) -> GGUFVocabulary:
    """The tokenizer metadata of `reader` (a GGUF header), checked; QkvError names what is wrong."""
    kind = _value(reader, "tokenizer.ggml.model", path)
    if not isinstance(kind, str) or kind not in KINDS:
        known = ", ".join(f"{name!r} ({what})" for name, what in KINDS.items())
        named = "names no tokenizer kind" if kind is None else f"has a {str(kind)[:40]!r} tokenizer"
        raise QkvError(f"{path} {named} (tokenizer.ggml.model); qkv reads {known}")
    pre = _value(reader, "tokenizer.ggml.pre", path, "default")
    if kind == "gpt2" and (not isinstance(pre, str) or pre not in PRE_TOKENIZERS):
        raise QkvError(
            f"{path} uses the pre-tokenizer {str(pre)[:40]!r} (tokenizer.ggml.pre), which qkv does not read; "
            f"it reads {', '.join(PRE_TOKENIZERS)}")
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise QkvError(f"{path} holds no tokenizer (tokenizer.ggml.tokens); give a GGUF file written with its tokenizer")
    if not 0 < field.count <= MAX_VOCAB:
        raise QkvError(f"{path}: tokenizer.ggml.tokens holds {field.count:,} tokens, not 1 to {MAX_VOCAB:,}")
    count = field.count
    tokens = _array(reader, "tokenizer.ggml.tokens", path, count, "strings")
    if not all(isinstance(t, str) for t in tokens):
        raise QkvError(f"{path}: tokenizer.ggml.tokens must be an array of strings")
    if sum(map(len, tokens)) > MAX_VOCAB_CHARS:
        raise QkvError(f"{path}: the tokens hold more than {MAX_VOCAB_CHARS:,} characters; the vocabulary is not a real one")
    if max(map(len, tokens)) * 4 > MAX_TOKEN_BYTES and max(len(t.encode("utf-8")) for t in tokens) > MAX_TOKEN_BYTES:
        raise QkvError(f"{path}: a token is longer than {MAX_TOKEN_BYTES:,} bytes; the vocabulary is not a real one")
    types = _array(reader, "tokenizer.ggml.token_type", path, count, "integers")
    if types is None:
        types = [TOKEN_TYPE_NORMAL] * count
    elif not all(type(t) is int for t in types):  # (a numeric array's items are ints or floats)
        raise QkvError(f"{path}: tokenizer.ggml.token_type must give one integer type per token")
    scores = _array(reader, "tokenizer.ggml.scores", path, count, "numbers")
    if scores is not None and not all(isinstance(s, (int, float)) and math.isfinite(s) for s in scores):
        raise QkvError(f"{path}: tokenizer.ggml.scores must be finite numbers")
    raw_merges = _array(reader, "tokenizer.ggml.merges", path, None, "strings")
    merges = None
    if raw_merges is not None:
        merges = [tuple(m.split(" ")) for m in raw_merges] if all(type(m) is str for m in raw_merges) else []
        if len(merges) != len(raw_merges) or [m for m in merges if len(m) != 2 or not (m[0] and m[1])]:
            raise QkvError(f"{path}: tokenizer.ggml.merges must be a list of 'left right' strings")
    if kind == "gpt2" and merges is None:  # (llama.cpp refuses these too)
        raise QkvError(f"{path}: a byte-level BPE tokenizer needs tokenizer.ggml.merges; the file has none")
    if kind == "llama" and merges is None and scores is None:
        raise QkvError(f"{path}: a SentencePiece tokenizer needs tokenizer.ggml.scores (or merges); the file has neither")
    template = _value(reader, "tokenizer.chat_template", path)
    if template is not None and not isinstance(template, str):
        raise QkvError(f"{path}: tokenizer.chat_template must be a string")
    architecture = _value(reader, "general.architecture", path, "")
    return GGUFVocabulary(
        kind=kind, pre=pre if kind == "gpt2" else "default", architecture=str(architecture),
        tokens=tokens, types=[int(t) for t in types], scores=scores, merges=merges,
        bos_id=_token_id(reader, "tokenizer.ggml.bos_token_id", path, count),
        eos_id=_token_id(reader, "tokenizer.ggml.eos_token_id", path, count),
        unk_id=_token_id(reader, "tokenizer.ggml.unknown_token_id", path, count),
        pad_id=_token_id(reader, "tokenizer.ggml.padding_token_id", path, count),
        # llama.cpp puts BOS before a SentencePiece text unless the file says otherwise
        add_bos=_flag(reader, "tokenizer.ggml.add_bos_token", path, kind == "llama"),
        add_eos=_flag(reader, "tokenizer.ggml.add_eos_token", path, False),
        add_space_prefix=_flag(reader, "tokenizer.ggml.add_space_prefix", path, kind == "llama"),
        chat_template=template,
    )


# ----------------------------------------------------------------------------- building


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of every byte as one printable character (printable Latin-1 bytes
    stand for themselves, the other 68 for code points from U+0100 up, in byte order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    spelling = {b: chr(b) for b in kept}
    extra = 256
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(extra)
            extra += 1
    return spelling


def _byte_level_spelling(tokens: Sequence[str]) -> list[str]:
    """Tokens as the byte-level model spells them: a token with a character outside the byte
    alphabet (a mislabelled added token such as '<|fim pad|>') is respelled from its bytes."""
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    if set("".join(tokens)) <= alphabet:  # a real byte-level vocabulary: nothing to respell
        return list(tokens)
    return [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]


def derived_merges(tokens: Sequence[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges recovered from a vocabulary that lists none: each way to cut a token into
    two tokens is a merge, and merges are ordered by `rank` of the whole token (highest
    first), then the longer left part, then the longer right part; ties keep the vocabulary's
    order, cuts of one token ordered by the ids of their parts. At most one merge per
    character of the vocabulary (MAX_VOCAB_CHARS), and refused past MAX_DERIVED_MERGES:
    `a`, `aa`, `aaa`, ... recovers a merge for every pair, quadratic in its length."""
    index = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, int, str, str]] = []
    for whole, score in rank.items():
        cuts = []
        for k in range(1, len(whole)):
            left = whole[:k]
            if left in index:
                right = whole[k:]
                if right in index:
                    cuts.append((index[left], index[right], left, right))
        cuts.sort()
        for _, _, left, right in cuts:
            found.append((-score, -len(left), -len(right), len(found), left, right))
        if len(found) > MAX_DERIVED_MERGES:
            raise QkvError(f"the vocabulary implies more than {MAX_DERIVED_MERGES:,} merges; it is not a real one")
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece_model(vocab: GGUFVocabulary) -> tuple[Any, list[str]]:
    """(BPE model with byte fallback, tokens as the model spells them)."""
    from tokenizers import models

    tokens = list(vocab.tokens)
    if vocab.architecture in _GEMMA:
        # llama.cpp writes Gemma's whitespace-only pieces with real spaces, not the marker;
        # each space becomes the marker again (transformers makes the whole piece markers,
        # which differs only for a piece mixing spaces with tabs or newlines)
        tokens = [t.replace(" ", SPACE_MARKER) if " " in t and not t.strip() else t for t in tokens]
    merges = vocab.merges
    if merges is None:
        from qkv.models.gguf.merge_memo import remembered_merges  # recovered once per vocabulary, then read

        rank = {t: -i for i, t in enumerate(tokens)} if vocab.architecture in _GEMMA else dict(zip(tokens, vocab.scores))
        merges = remembered_merges(tokens, rank, derived_merges)
    unk = vocab.token(vocab.unk_id)
    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=unk,
                       fuse_unk=True, byte_fallback=True)
    return model, tokens


def _byte_level_model(vocab: GGUFVocabulary) -> tuple[Any, list[str]]:
    from tokenizers import models

    tokens = _byte_level_spelling(vocab.tokens)
    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=vocab.merges, fuse_unk=False,
                       byte_fallback=False)
    return model, tokens


def _pipeline(vocab: GGUFVocabulary) -> tuple[Any, Any, Any]:
    """(normalizer, pre-tokenizer, decoder) for the vocabulary's kind and flags."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    if vocab.kind == "gpt2":
        split = PRE_TOKENIZERS[vocab.pre]
        if split is not None:
            pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif vocab.pre == "smollm":  # SmolLM cuts every digit off on its own, then splits as GPT-2
            pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        else:
            pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        return None, pre, decoders.ByteLevel()
    steps = [decoders.Replace(SPACE_MARKER, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))  # the space the encoder put first
    decoder = decoders.Sequence(steps)
    if vocab.add_space_prefix and vocab.architecture in _PHI3:
        # Phi-3 puts the marker before every piece between special tokens, even one that
        # starts with a space ("  hi" -> 3 markers), which Metaspace does not
        normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARKER), normalizers.Replace(" ", SPACE_MARKER)])
        return normalizer, None, decoder
    scheme = "first" if vocab.add_space_prefix else "never"
    return None, pre_tokenizers.Metaspace(replacement=SPACE_MARKER, prepend_scheme=scheme, split=False), decoder


def _added_tokens(vocab: GGUFVocabulary, spelled: Sequence[str]) -> list[Any]:
    """Tokens matched whole in the text: CONTROL ones and the named special ids as special,
    USER_DEFINED ones as text. A token that had to be respelled (a byte-level one outside the
    byte alphabet; a Gemma whitespace piece llama.cpp writes with spaces) is no real added
    token and stays a plain vocabulary entry: added as written, it would take a new id past
    the vocabulary."""
    from tokenizers import AddedToken

    named = {i for i in (vocab.bos_id, vocab.eos_id, vocab.unk_id, vocab.pad_id) if i is not None}
    added = []
    for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.types)):
        if not token or spelled[i] != token:  # respelled (a byte-level token outside the byte alphabet,
            continue  # a Gemma whitespace piece written with spaces): a plain vocabulary entry, its own id
        if kind == TOKEN_TYPE_CONTROL or i in named:
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_TYPE_USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def build_tokenizer(vocab: GGUFVocabulary, source: str) -> Any:
    """The checked vocabulary as a bounded `tokenizers.Tokenizer` (qkv.models.hf.tokenizer_guard)."""
    from tokenizers import Tokenizer, processors

    from qkv.models.hf.tokenizer_guard import guard

    build = _byte_level_model if vocab.kind == "gpt2" else _sentencepiece_model
    try:
        model, spelled = build(vocab)
    except QkvError as error:
        raise QkvError(f"{source}: {error}") from None
    except Exception as error:  # tokenizers refuses merges of tokens it does not have
        raise QkvError(f"{source}: the tokenizer in the metadata is inconsistent ({str(error)[:120]})") from None
    tokenizer = Tokenizer(model)
    normalizer, pre, decoder = _pipeline(vocab)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre is not None:
        tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoder
    tokenizer.add_tokens(_added_tokens(vocab, spelled))
    single, special = ["$A"], []
    for wanted, index, at_start in ((vocab.add_bos, vocab.bos_id, True), (vocab.add_eos, vocab.eos_id, False)):
        if wanted and index is not None:
            single.insert(0 if at_start else len(single), vocab.tokens[index])
            special.append((vocab.tokens[index], index))
    tokenizer.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=special)
    pipeline = {name: None if part is None else json.loads(part.__getstate__())
                for name, part in (("normalizer", normalizer), ("pre_tokenizer", pre), ("decoder", decoder))}
    return guard(tokenizer, source, pipeline=pipeline)


def read_gguf_tokenizer(reader: Any, path: Path) -> GGUFTokenizer:
    """The tokenizer in a GGUF header with its special tokens and chat template."""
    vocab = read_vocabulary(reader, path)
    return GGUFTokenizer(tokenizer=build_tokenizer(vocab, str(path)), vocabulary=vocab)


def read_tokenizer(reader: Any, path: Path) -> Any:
    """The tokenizer in a GGUF header as a bounded `tokenizers.Tokenizer`."""
    return read_gguf_tokenizer(reader, path).tokenizer
