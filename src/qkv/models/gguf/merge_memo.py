"""Merges recovered from a SentencePiece vocabulary, remembered on disk under what they came from.

A GGUF file of the `llama` kind (Gemma, Llama 2, Mistral) lists no merges: qkv recovers them
from the vocabulary (tokenizer.derived_merges), which for Gemma 3's 262,144 tokens is 514,906
merges and about 2 s of Python on every load. They depend on nothing but the tokens, their
ranks and the code that recovers them, so `remembered_merges` keeps them in
`<cache>/merges/<key>.bin` (`<cache>`: qkv.util.cache_integrity.cache_folder), the key the
SHA-256 of exactly those three. A file holds the SHA-256 of its body, then the body: each
merge as the ids of its two parts (little-endian int32). A file too large to be one of ours,
one whose body fails its checksum, or one naming an id outside the vocabulary is deleted (one
line says so) and the merges are recovered again. Vocabularies under SMALLEST_VOCAB tokens
recover in a moment and are not kept; the KEEP most recently used files are.
QKV_PREPARED_CACHE=0 turns the keeping off, as it does for prepared weights.

Shape legend: V tokens, R merges (no tensors).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from qkv.errors import QkvError
from qkv.util.atomic import atomic_write_bytes
from qkv.util.cache_integrity import cache_folder, keeping_enabled, remove_stale_temporaries, say_discarded

SMALLEST_VOCAB = 32768  # tokens below which recovering is quick (well under 0.3 s): not kept
KEEP = 8  # memo files kept (the most recently used); Gemma 3's is 4 MB
MAX_MERGES = 1 << 23  # the most a memo file may hold (tokenizer.MAX_DERIVED_MERGES)
FORMAT = b"qkv-merges-1"  # part of the key: a new layout of the file gets new keys

Merges = list[tuple[str, str]]
Derive = Callable[[Sequence[str], Mapping[str, float]], Merges]



def memo_key(tokens: Sequence[str], rank: Mapping[str, float], derive: Derive) -> str:
    """The SHA-256 of the tokens, their ranks and the source of `derive`'s module."""
    digest = hashlib.sha256(FORMAT)
    source = inspect.getsourcefile(derive)
    digest.update(Path(source).read_bytes() if source else derive.__qualname__.encode())
    for words in (tokens, list(rank)):
        digest.update(len(words).to_bytes(8, "little"))
        digest.update("\0".join(words).encode("utf-8", "surrogatepass"))
    digest.update(array("d", rank.values()).tobytes())
    return digest.hexdigest()


def _encode(merges: Merges, tokens: Sequence[str]) -> bytes:
    index = {t: i for i, t in enumerate(tokens)}  # as derived_merges indexes them (the last of a repeated token)
    ids = array("i", (index[part] for merge in merges for part in merge))
    if sys.byteorder != "little":
        ids.byteswap()
    body = ids.tobytes()
    return hashlib.sha256(body).digest() + body


def _decode(data: bytes, tokens: Sequence[str]) -> Merges | str:
    """The merges in a memo file's bytes, or why they cannot be trusted."""
    body = data[32:]
    if len(data) < 32 or len(body) % 8:
        return "it is cut short"
    if hashlib.sha256(body).digest() != data[:32]:
        return "its checksum does not match its contents"
    ids = array("i")
    ids.frombytes(body)
    if sys.byteorder != "little":
        ids.byteswap()
    if ids and (min(ids) < 0 or max(ids) >= len(tokens)):
        return "it names tokens the vocabulary does not have"
    return list(zip(map(tokens.__getitem__, ids[0::2]), map(tokens.__getitem__, ids[1::2])))


def _read(path: Path, tokens: Sequence[str]) -> Merges | None:
    try:
        if path.stat().st_size > 32 + 8 * MAX_MERGES:
            merges: Merges | str = "it is larger than any memo qkv writes"
        else:
            merges = _decode(path.read_bytes(), tokens)
    except FileNotFoundError:
        return None
    except OSError as error:
        merges = f"it cannot be read ({error.strerror or type(error).__name__})"
    if isinstance(merges, str):
        say_discarded(path, merges, "recovering the merges again")
        path.unlink(missing_ok=True)
        return None
    try:
        os.utime(path)  # most recently used: kept longest
    except OSError:
        pass
    return merges


def _keep(path: Path, merges: Merges, tokens: Sequence[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        atomic_write_bytes(path, _encode(merges, tokens))
        kept = sorted(path.parent.glob("*.bin"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only or full cache folder: the merges are right, only not kept


def remembered_merges(tokens: Sequence[str], rank: Mapping[str, float], derive: Derive) -> Merges:
    """`derive(tokens, rank)`, read from the memo when it was recovered before (module docstring)."""
    if len(tokens) < SMALLEST_VOCAB or not keeping_enabled():
        return derive(tokens, rank)
    try:
        path = cache_folder() / "merges" / f"{memo_key(tokens, rank, derive)[:32]}.bin"
    except (QkvError, OSError):
        return derive(tokens, rank)  # no usable cache folder: recover, keep nothing
    merges = _read(path, tokens)
    if merges is None:
        merges = derive(tokens, rank)
        _keep(path, merges, tokens)
    return merges
