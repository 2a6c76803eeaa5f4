"""GGUF tokenizers of both kinds checked against transformers' reading of the same file.

The files are written here with the gguf package's GGUFWriter, as llama.cpp's converter
writes them: SentencePiece vocabularies (`tokenizer.ggml.model = llama`) from a real
SentencePiece BPE model trained on the book's story in a fraction of a second (Llama-,
Gemma- and Phi-3-style files), byte-level BPE ones (`gpt2`) from a BPE trained with the
tokenizers library under each pre-tokenizer qkv reads, and SmolLM2's real file. The
reference is `AutoTokenizer.from_pretrained(folder, gguf_file=...)`: same ids on a list of
hard texts and on hypothesis-made ones, same decoded text, and decode round trips.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.models.gguf.checkpoint import open_gguf, open_gguf_file
from qkv.models.gguf.tokenizer import (
    TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED,
    byte_alphabet, derived_merges, read_gguf_tokenizer,
)

VERDICT = Path(__file__).resolve().parents[4] / "shared" / "data" / "the-verdict.txt"
TEXTS = [
    "",
    "Hello, world!",
    " leading space",
    "  two  spaces, a\ttab,\n\nand blank lines   ",
    "Digits 1234567, 3.14159, -42 and 2024-11-30",
    "naïve café über straße 東京 Ελληνικά Ñandú",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "it's they're we'll I'd DON'T",
    "    indented code():\n        return {'a': [1, 2]}",
    "\n\n\n",
]
ALPHABET = string.ascii_letters + string.digits + " \n\t.,'!?-_()<>|" + "éßñ東京😀\u2581"


@dataclass
class Written:
    """One GGUF file written here, with what the tests feed it."""

    path: Path
    specials: list[str] = field(default_factory=list)  # special and added tokens, put into texts
    prefix: bool = False  # a SentencePiece file that puts a space before the text
    processor: Any = None  # the SentencePiece model its vocabulary came from


def write_gguf(path: Path, arch: str, kind: str | None, tokens: list[str], types: list[int], **meta: Any) -> Path:
    """A GGUF holding only a tokenizer (and the few hyperparameters transformers wants)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    if kind is not None:
        writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if isinstance(meta.get("pre"), list):  # a malformed file: an array where a string belongs
        writer.add_array("tokenizer.ggml.pre", meta["pre"])
    elif meta.get("pre") is not None:
        writer.add_tokenizer_pre(meta["pre"])
    if meta.get("scores") is not None:
        writer.add_token_scores(meta["scores"])
    if meta.get("merges") is not None:
        writer.add_token_merges(meta["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if meta.get(key) is not None:
            add(meta[key])
    for key, add in (("add_bos", writer.add_add_bos_token), ("add_eos", writer.add_add_eos_token),
                     ("add_space_prefix", writer.add_add_space_prefix)):
        if meta.get(key) is not None:
            add(meta[key])
    if meta.get("template") is not None:
        writer.add_chat_template(meta["template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ----------------------------------------------------------------------------- the files


@pytest.fixture(scope="session")
def story() -> list[str]:
    assert VERDICT.is_file(), f"the test data {VERDICT} is missing"
    lines = [line for line in VERDICT.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines + ["    " + line for line in lines[:40]]  # indentation: whitespace-only pieces


def train_sentencepiece(lines: list[str], gemma: bool, prefix: bool) -> Any:
    """A real SentencePiece BPE model with byte fallback (as Llama 2's and Gemma's are)."""
    import io

    spm = pytest.importorskip("sentencepiece")
    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>") \
        if gemma else dict(unk_id=0, bos_id=1, eos_id=2)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=420, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", add_dummy_prefix=prefix, minloglevel=2,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"] if gemma else ["<tool>"],
        control_symbols=["<mask>", "<ctrl>"] if gemma else ["<ctrl>"], **ids,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def sentencepiece_types(sp: Any) -> list[int]:
    """Token types as llama.cpp's converter assigns them."""
    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return TOKEN_TYPE_UNKNOWN
        if sp.is_control(i):
            return TOKEN_TYPE_CONTROL
        if sp.is_byte(i):
            return TOKEN_TYPE_BYTE
        if sp.id_to_piece(i) in ("<start_of_turn>", "<end_of_turn>", "<tool>"):
            return TOKEN_TYPE_USER_DEFINED
        return TOKEN_TYPE_NORMAL
    return [kind(i) for i in range(sp.get_piece_size())]


@pytest.fixture(scope="session")
def sentencepiece_files(story: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    files = {}
    for name, arch in (("llama", "llama"), ("phi3", "phi3"), ("gemma3", "gemma3"), ("llama-noprefix", "llama"),
                       ("llama-merges", "llama")):
        gemma, prefix = arch == "gemma3", arch != "gemma3" and name != "llama-noprefix"
        sp = train_sentencepiece(story, gemma, prefix)
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        if gemma:  # llama.cpp writes Gemma's runs of spaces as spaces
            pieces = [p.replace("\u2581", " ") if set(p) == {"\u2581"} and len(p) > 1 else p for p in pieces]
            assert any(p.startswith("  ") for p in pieces)  # so the respelling is exercised
        types = sentencepiece_types(sp)
        folder = tmp_path_factory.mktemp(f"spm-{name}")
        scores = [sp.get_score(i) for i in range(len(pieces))]
        # a file that lists its merges is read by them, not by its scores: here worst first
        merges = [f"{a} {b}" for a, b in reversed(derived_merges(pieces, dict(zip(pieces, scores))))
                  if " " not in a + b] if name == "llama-merges" else None
        path = write_gguf(
            folder / "t.gguf", arch, "llama", pieces, types, scores=scores, merges=merges,
            bos=sp.bos_id(), eos=sp.eos_id(), unk=sp.unk_id(), pad=sp.pad_id() if gemma else None,
            add_bos=True, add_eos=False, add_space_prefix=prefix,
            template="{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}",
        )
        specials = [p for p, t in zip(pieces, types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
        files[name] = Written(path, specials + ["<unk>", "<0x41>"], prefix=prefix, processor=sp)
    return files


@pytest.fixture(scope="session")
def byte_level_files(story: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(story, trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=specials,
        show_progress=False))
    spec = json.loads(bpe.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    # an added text token, and a control token with a space that llama.cpp mislabels
    tokens += ["<think>", "<|fim pad|>"]
    types = [TOKEN_TYPE_CONTROL if t in specials else TOKEN_TYPE_NORMAL for t in tokens]
    types[-2:] = [TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_CONTROL]
    files = {}
    for pre in ("default", "gpt2", "llama-bpe", "qwen2", "smollm", "gpt-4o"):
        folder = tmp_path_factory.mktemp(f"bpe-{pre}")
        path = write_gguf(folder / "t.gguf", "llama", "gpt2", tokens, types, pre=pre, merges=merges,
                          bos=1, eos=2, unk=0 if pre == "default" else None, add_bos=pre == "llama-bpe",
                          template="{{ messages[0]['content'] }}")
        files[pre] = Written(path, specials + ["<think>", "<|fim pad|>"])
    return files


@pytest.fixture(scope="session")
def all_files(sentencepiece_files, byte_level_files, smollm2_file: Path) -> dict[str, Written]:
    smollm2 = Written(smollm2_file, ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"])
    return {**{f"spm-{k}": v for k, v in sentencepiece_files.items()},
            **{f"bpe-{k}": v for k, v in byte_level_files.items()}, "smollm2": smollm2}


_OURS: dict[str, Any] = {}
_THEIRS: dict[str, Any] = {}


def ours_for(all_files: dict[str, Written], name: str) -> Any:
    """qkv's GGUFTokenizer for one file, read once a session."""
    if name not in _OURS:
        path = all_files[name].path
        _OURS[name] = read_gguf_tokenizer(open_gguf(path), path)
    return _OURS[name]


def pair(all_files: dict[str, Written], name: str, request: pytest.FixtureRequest | None = None) -> tuple[Any, Any]:
    """(qkv's GGUFTokenizer, transformers' tokenizer) for one file, read once a session
    (SmolLM2's reference is the session's shared one: transformers takes seconds to read it)."""
    if name not in _THEIRS:
        import transformers

        path = all_files[name].path
        if name == "smollm2":
            _THEIRS[name] = request.getfixturevalue("hf_smollm2_tokenizer")
        else:
            _THEIRS[name] = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours_for(all_files, name), _THEIRS[name]


SMOLLM2 = pytest.param("smollm2", marks=pytest.mark.xdist_group("smollm2"))  # with the other tests of the file
NAMES = ["spm-llama", "spm-phi3", "spm-gemma3", "spm-llama-merges", "bpe-default", "bpe-gpt2", "bpe-llama-bpe",
         "bpe-qwen2", "bpe-smollm", "bpe-gpt-4o", SMOLLM2]


def reference_ids(ours: Any, theirs: Any, text: str) -> list[int]:
    """transformers' ids for `text`, but for SmolLM's pre-tokenizer, which transformers' GGUF
    reading applies in the other order: llama.cpp (its `\\p{N}` split, then GPT-2's, each within
    the pieces before) and SmolLM2's own tokenizer.json (Digits, then ByteLevel) cut every digit
    off first, so a run of spaces before a digit stays one piece ("   0": llama-tokenize on
    SmolLM2's file gives [333, 32], transformers' reading [256, 216, 32]). There the reference
    is transformers encoding each piece of that first cut."""
    if ours.vocabulary.pre != "smollm":
        return list(theirs(text)["input_ids"])
    bos = [ours.vocabulary.bos_id] if ours.vocabulary.add_bos else []
    pieces = [p for p in regex.split(r"(\p{N})", text) if p]
    return bos + [i for p in pieces for i in theirs(p, add_special_tokens=False)["input_ids"]]


def check_text(all_files: dict[str, Written], name: str, text: str, request: pytest.FixtureRequest) -> None:
    ours, theirs = pair(all_files, name, request)
    ids = ours.tokenizer.encode(text).ids
    assert ids == reference_ids(ours, theirs, text), (name, text)
    for skip in (True, False):
        assert ours.tokenizer.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    written = all_files[name]
    plain = not any(s in text for s in written.specials)
    if name.startswith("spm-"):
        # the prefix space is stripped again on decode, so text that starts with its own
        # space loses it (transformers' reading does the same, checked above); the marker
        # itself in the text is read as a space, as SentencePiece does
        if plain and "\u2581" not in text and not (written.prefix and text[:1].isspace()):
            assert ours.tokenizer.decode(ids, skip_special_tokens=True) == text
    elif all(ours.tokenizer.token_to_id(byte_alphabet()[b]) is not None for b in text.encode()):
        # (a vocabulary may lack a byte no training text had, SmolLM2's lacks 0xF1: such
        # bytes are dropped, by transformers' reading too)
        bos = ours.vocabulary.token(ours.vocabulary.bos_id) if ours.vocabulary.add_bos else ""
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == bos + text


# ----------------------------------------------------------------------------- ids equal transformers


@pytest.mark.parametrize("name", NAMES)
def test_ids_equal_transformers_on_hard_texts(all_files, name: str, request) -> None:
    specials = all_files[name].specials
    if ours_for(all_files, name).vocabulary.pre == "smollm":  # reference_ids' digit cut never splits one
        assert not any(regex.search(r"\p{N}", s) for s in specials)
    texts = TEXTS + ["  0", "x  0", "   0", "a \t 7 b  12"] + [f"a{s}b {s} {s}{s}\n{s}" for s in specials] + ["".join(specials)]
    for text in texts:
        check_text(all_files, name, text, request)


@pytest.mark.parametrize("name", ["spm-llama", "spm-gemma3", "bpe-llama-bpe", "bpe-qwen2", SMOLLM2])
def test_ids_equal_transformers_on_the_story(all_files, story: list[str], name: str, request) -> None:
    check_text(all_files, name, "\n".join(story[:120]), request)


def texts_with(specials: list[str]) -> st.SearchStrategy[str]:
    piece = st.one_of(st.text(ALPHABET, max_size=10), st.text(max_size=4), st.sampled_from(specials))
    return st.lists(piece, max_size=8).map("".join)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_ids_equal_transformers_on_generated_text(all_files, name: str, request, data: st.DataObject) -> None:
    check_text(all_files, name, data.draw(texts_with(all_files[name].specials)), request)


@pytest.mark.parametrize("name", ["spm-llama", "spm-llama-noprefix"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(ALPHABET.replace("<", "").replace("\u2581", ""), max_size=40))
def test_sentencepiece_ids_equal_sentencepiece_itself(all_files, name: str, text: str) -> None:
    """The merges recovered from the scores encode as the SentencePiece model the vocabulary
    came from, with its space prefix (`add_space_prefix`) and without. (A text that starts
    with a space gets one marker, not two, as in transformers' reading: the one difference.)"""
    written, ours = all_files[name], ours_for(all_files, name)
    if written.prefix and text[:1].isspace():
        text = "x" + text
    assert ours.tokenizer.encode(text).ids == [ours.vocabulary.bos_id, *written.processor.encode(text)]


# ----------------------------------------------------------------------------- what comes with it


def test_special_tokens_ids_and_template(sentencepiece_files, all_files) -> None:
    ours, theirs = pair(all_files, "spm-gemma3")
    assert ours.special_tokens == {"bos": "<bos>", "eos": "<eos>", "unk": "<unk>", "pad": "<pad>"}
    assert (theirs.bos_token, theirs.eos_token, theirs.unk_token, theirs.pad_token) == ("<bos>", "<eos>", "<unk>", "<pad>")
    assert ours.chat_template == theirs.chat_template
    # bos first, a special token is one id, user-defined ones are matched whole but are text
    ids = ours.tokenizer.encode("<start_of_turn>hi<eos>").ids
    assert ids[0] == theirs.bos_token_id and ids[1] == theirs.convert_tokens_to_ids("<start_of_turn>")
    assert ids[-1] == theirs.eos_token_id
    assert "<start_of_turn>" in ours.tokenizer.decode(ids, skip_special_tokens=True)
    assert "<eos>" not in ours.tokenizer.decode(ids, skip_special_tokens=True)
    # the whole file, as the loader reads it, carries the same template and special tokens
    ours, theirs = pair(all_files, "spm-llama")
    file = open_gguf_file(sentencepiece_files["llama"].path)
    assert (file.bos_token, file.eos_token, file.chat_template) == ("<s>", "</s>", theirs.chat_template)
    assert file.tokenizer.encode("hi").ids == theirs("hi")["input_ids"]


def test_byte_fallback_and_space_marker(all_files) -> None:
    ours, _ = pair(all_files, "spm-llama")
    tokens = ours.tokenizer.encode("Hi 東").tokens
    assert tokens[1].startswith("\u2581")  # the space put before the text
    assert [t for t in tokens if t.startswith("<0x")] == ["<0xE6>", "<0x9D>", "<0xB1>"]  # UTF-8 of 東


def test_respelled_control_token_stays_plain(all_files) -> None:
    """'<|fim pad|>' is not in the byte alphabet: no added token, its entry respelled."""
    ours, theirs = pair(all_files, "bpe-default")
    spelled = "".join(byte_alphabet()[b] for b in "<|fim pad|>".encode())
    assert ours.tokenizer.token_to_id(spelled) == theirs.convert_tokens_to_ids(spelled) is not None
    assert len(ours.tokenizer.encode("<|fim pad|>").ids) > 1


def test_byte_alphabet_is_gpt2s(all_files) -> None:
    from tokenizers import pre_tokenizers

    assert set(byte_alphabet().values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert byte_alphabet()[ord(" ")] == "\u0120" and byte_alphabet()[ord("A")] == "A"


# ----------------------------------------------------------------------------- bad input


def tiny(path: Path, kind: str = "gpt2", **meta: Any) -> Path:
    tokens = meta.pop("tokens", ["a", "b", "ab"])
    types = meta.pop("types", [1] * len(tokens))
    if kind == "gpt2":
        meta.setdefault("merges", ["a b"])
    return write_gguf(path, "llama", kind, tokens, types, **meta)


@pytest.mark.parametrize("meta, message", [
    (dict(kind="rwkv"), r"'rwkv' tokenizer \(tokenizer.ggml.model\); qkv reads 'gpt2' \(byte-level BPE\), 'llama'"),
    (dict(kind="bert"), "'bert' tokenizer"),
    (dict(kind=None), r"names no tokenizer kind \(tokenizer.ggml.model\); qkv reads 'gpt2'"),
    (dict(pre=["gpt2"]), r"pre-tokenizer .\['gpt2'\]. \(tokenizer.ggml.pre\)"),
    (dict(pre="falcon"), r"pre-tokenizer 'falcon' \(tokenizer.ggml.pre\), which qkv does not read; it reads default"),
    (dict(kind="llama"), "needs tokenizer.ggml.scores"),
    (dict(merges=None), "byte-level BPE tokenizer needs tokenizer.ggml.merges"),
    (dict(kind="llama", scores=[0.0, 0.0]), "holds 2 entries, not one per token"),
    (dict(types=[1, 1]), "token_type holds 2 entries"),
    (dict(merges=["a b c"]), "must be a list of 'left right' strings"),
    (dict(merges=["a x"]), "inconsistent"),
    (dict(bos=7), "bos_token_id is 7, not a token id between 0 and 2"),
])
def test_bad_tokenizers_are_refused_by_name(tmp_path: Path, meta: dict[str, Any], message: str) -> None:
    path = tiny(tmp_path / "t.gguf", **meta)
    with pytest.raises(QkvError, match=message):
        read_gguf_tokenizer(open_gguf(path), path)


def test_quadratic_merges_are_refused_before_they_are_built(tmp_path: Path, monkeypatch) -> None:
    """'a', 'aa', ... 'a'*100 recovers 4,950 merges from 100 tokens; past the bound: refused
    (the bound is lowered here so the file stays small; the real one is 8M)."""
    from qkv.models.gguf import tokenizer as gguf_tokenizer

    monkeypatch.setattr(gguf_tokenizer, "MAX_DERIVED_MERGES", 1000)
    tokens = ["a" * n for n in range(1, 101)]
    path = tiny(tmp_path / "t.gguf", kind="llama", tokens=tokens, scores=[-float(n) for n in range(100)])
    with pytest.raises(QkvError, match=r"t.gguf: the vocabulary implies more than 1,000 merges"):
        read_gguf_tokenizer(open_gguf(path), path)
    monkeypatch.setattr(gguf_tokenizer, "MAX_DERIVED_MERGES", 5000)  # and within it, the file reads
    assert read_gguf_tokenizer(open_gguf(path), path).tokenizer.encode("aaaa").tokens == ["a" * 4]


def test_unknown_kind_is_one_line_and_exit_code_2(tmp_path: Path, capsys) -> None:
    from qkv.cli.main import main

    path = tiny(tmp_path / "m.gguf", kind="rwkv")
    code = main(["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    assert len(err.strip().splitlines()) == 1 and "'rwkv' tokenizer" in err and "Traceback" not in err


@pytest.mark.parametrize("rows", [4, 3])
def test_sentencepiece_model_loads_and_vocabulary_must_fit(tmp_path: Path, rows: int) -> None:
    """A whole (tiny, zero-weight) Llama with a SentencePiece tokenizer goes through qkv's
    loader: with as many embedding rows as tokens it loads and encodes with BOS and the space
    marker; with fewer rows the loader's check refuses the tokenizer."""
    import qkv

    path, hidden, ffn = tmp_path / "m.gguf", 32, 64
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 16),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, 2), (writer.add_vocab_size, rows)):
        add(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<s>", "\u2581", "a", "\u2581a"])
    writer.add_token_scores([0.0, -3.0, -2.0, -1.0])
    writer.add_token_types([TOKEN_TYPE_CONTROL, 1, 1, 1])
    writer.add_bos_token_id(0)
    shapes = {"token_embd": (rows, hidden), "output_norm": (hidden,), "blk.0.attn_norm": (hidden,),
              "blk.0.ffn_norm": (hidden,), "blk.0.attn_q": (hidden, hidden), "blk.0.attn_k": (hidden, hidden),
              "blk.0.attn_v": (hidden, hidden), "blk.0.attn_output": (hidden, hidden),
              "blk.0.ffn_gate": (ffn, hidden), "blk.0.ffn_up": (ffn, hidden), "blk.0.ffn_down": (hidden, ffn)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if rows == 3:
        with pytest.raises(QkvError, match="4 tokens but the model's vocabulary has 3"):
            qkv.load_pretrained(path)
        return
    model, tokenizer = qkv.load_pretrained(path)
    assert tokenizer.encode("a a").ids == [0, 3, 3]  # <s> ▁a ▁a: BOS added, the space put first
    assert tokenizer.decode([0, 3, 2, 1, 2], skip_special_tokens=True) == "aa a"
    assert model.cfg.vocab_size == 4


def test_listed_merges_are_followed_not_the_scores(all_files, request) -> None:
    """The same pieces and scores, with merges listed worst first: other ids than the scores
    give (and still transformers' ids, checked above), so the file's merges are what counts."""
    by_scores, _ = pair(all_files, "spm-llama", request)
    by_merges, theirs = pair(all_files, "spm-llama-merges", request)
    text = "the picture of the painter"
    assert by_merges.tokenizer.encode(text).ids == theirs(text)["input_ids"]
    assert by_merges.tokenizer.encode(text).tokens != by_scores.tokenizer.encode(text).tokens
