"""Reading a GGUF file's tokenizer: qkv against transformers, and encoding with the result.

Contenders, on the same file: qkv's header parse and `read_gguf_tokenizer` (what `qkv
generate` pays for the tokenizer before its first token, the regex probes of qkv's
tokenizer guard included), and `AutoTokenizer.from_pretrained(folder,
gguf_file=...)` (transformers parses the file itself). Then both encode the book's story,
with the ids compared. The default file is SmolLM2's (byte-level BPE, 49,152 tokens); a
SentencePiece vocabulary is timed on a model trained here on the story (--spm-vocab pieces).

Times are medians of --rounds runs (transformers' read once: it takes seconds); the two
encoders alternate round by round (benchmarks/harness.py: qkv.bench.measure.timing's
`alternate`, no warm-up round).

    python benchmarks/gguf/gguf_tokenizer.py [--json PATH]
    python benchmarks/gguf/gguf_tokenizer.py --rounds 3 --spm-vocab 2000   # (--repeats: the same)

Shape legend: none (text in, token ids out).
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

VERDICT = harness.VERDICT


def sentencepiece_gguf(folder: Path, text: str, vocab_size: int) -> Path:
    """A Llama-style GGUF holding a SentencePiece BPE model trained on `text`."""
    import gguf
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in text.splitlines() if line.strip()]), model_writer=model,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    path = folder / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
                            for i in range(n)])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def measure(path: Path, text: str, repeats: int) -> dict[str, Any]:
    import transformers

    from qkv.models.gguf.checkpoint import open_gguf
    from qkv.models.gguf.tokenizer import read_gguf_tokenizer

    ours = read_gguf_tokenizer(open_gguf(path), path)
    qkv_read = harness.alternate({"qkv read": lambda: read_gguf_tokenizer(open_gguf(path), path)}, work=1,
                                 unit="reads", repeats=repeats, warmup=0)["qkv read"]
    loaded: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        link = Path(folder) / path.name
        os.symlink(path.resolve(), link)

        def hf_load() -> None:
            loaded["theirs"] = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=path.name)

        hf_read = harness.alternate({"transformers read": hf_load}, work=1, unit="reads", repeats=1,
                                    warmup=0)["transformers read"]  # once: it takes seconds
    theirs = loaded["theirs"]
    ids = ours.tokenizer.encode(text).ids
    same = ids == theirs(text)["input_ids"]
    encode = harness.alternate({"qkv encode": lambda: ours.tokenizer.encode(text), "transformers encode": lambda: theirs(text)},
                               work=1, unit="texts", repeats=repeats, warmup=0)
    return {"file": path.name, "kind": ours.vocabulary.kind, "tokens": len(ours.vocabulary.tokens),
            "qkv_read_s": qkv_read.median_s, "hf_read_s": hf_read.median_s,
            "qkv_encode_ms": encode["qkv encode"].median_s * 1e3,
            "hf_encode_ms": encode["transformers encode"].median_s * 1e3, "story_tokens": len(ids), "same_ids": same,
            "read_ratio": harness.ratio(qkv_read, hf_read).to_dict(),
            **harness.summary([qkv_read, hf_read, *encode.values()])}


def main() -> None:
    parser = harness.parser(__doc__, rounds=5, rounds_aliases=("--repeats",), json=True)
    parser.add_argument("--spm-vocab", type=int, default=2000)
    args = parser.parse_args()
    from qkv.models.loader import smollm2_path

    text = VERDICT.read_text(encoding="utf-8")
    facts = harness.header("GGUF tokenizers: qkv against transformers, read and encode",
                           packages=("transformers", "tokenizers", "gguf"))
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(smollm2_path(), text, args.rounds),
                measure(sentencepiece_gguf(Path(folder), text, args.spm_vocab), text, args.rounds)]
    print("| file | kind | tokens | qkv read | transformers read | ratio | qkv encode | transformers encode | same ids |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['file']} | {r['kind']} | {r['tokens']:,} | {r['qkv_read_s']:.2f} s | {r['hf_read_s']:.2f} s "
              f"| {r['read_ratio']['value']:.1f}x | {r['qkv_encode_ms']:.1f} ms | {r['hf_encode_ms']:.1f} ms "
              f"| {r['same_ids']} ({r['story_tokens']:,} tokens) |")
    if args.json:
        harness.write_json(args.json, {"rows": rows}, facts)


if __name__ == "__main__":
    main()
