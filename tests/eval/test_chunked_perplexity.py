"""llama-perplexity's scheme (qkv.eval.chunked_perplexity, `qkv perplexity --scheme llama-cpp`):
non-overlapping chunks, BOS in place of each chunk's first token, the second half scored.
The numbers equal transformers' loss on chunks built here from llama.cpp's rule (labels
-100 outside each chunk's second half), on a tiny random Llama whose tokenizer adds a BOS.
Bad input: one line, exit code 2. (benchmarks/quality/gguf_reference.py compares the scheme with
llama-perplexity itself on a real file.)"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from qkv.eval.chunked_perplexity import added_bos, chunk_count, chunked_perplexity, llama_cpp_text, scored_per_chunk
from qkv.cli.main import main
from qkv.errors import QkvError

TEXT = (
    "I had always thought him a cheap genius, though a good fellow enough. "
    "It was no great surprise to me to hear that, in the height of his glory, he had dropped "
    "his painting, married a rich widow, and established himself in a villa on the Riviera. "
) * 4
BOS = 0


def _tokenizer(template: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("<bos>", 0), ("<eos>", 1)])
    return tok


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, object]:
    """A 2-layer random Llama saved by transformers, its tokenizer adding <bos> (id 0)."""
    import transformers

    tok = _tokenizer("<bos> $A")
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1, bos_token_id=BOS, eos_token_id=1, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama-bos")
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder, model


def llama_cpp_reference(model, ids: list[int], n_ctx: int, bos: int | None) -> tuple[float, int]:
    """llama-perplexity's loop (tools/perplexity/perplexity.cpp) with transformers' loss."""
    first, nll, count = n_ctx // 2, 0.0, 0
    for i in range(len(ids) // n_ctx):
        chunk = torch.tensor([ids[i * n_ctx : (i + 1) * n_ctx]])
        if bos is not None:
            chunk[0, 0] = bos
        labels = chunk.clone()
        labels[0, : first + 1] = -100  # logits first .. n_ctx - 2 predict tokens first + 1 .. n_ctx - 1
        with torch.inference_mode():
            loss = model(chunk, labels=labels).loss.item()
        nll += loss * (n_ctx - first - 1)
        count += n_ctx - first - 1
    return math.exp(nll / count), count


@pytest.mark.parametrize("n_ctx", [32, 33, 64])
def test_chunks_equal_transformers_loss_on_llama_cpps_chunks(tiny, n_ctx: int) -> None:
    import qkv

    folder, hf_model = tiny
    model, tokenizer = qkv.load_pretrained(folder)
    ids = tokenizer.encode(TEXT).ids
    assert ids[0] == BOS and added_bos(tokenizer) == BOS and len(ids) % n_ctx != 0  # a tail is dropped
    ours = chunked_perplexity(model, torch.tensor(ids), context_length=n_ctx, bos_token_id=BOS)
    reference, count = llama_cpp_reference(hf_model, ids, n_ctx, BOS)
    assert ours.tokens == count == chunk_count(len(ids), n_ctx) * scored_per_chunk(n_ctx)
    assert ours.windows == len(ids) // n_ctx >= 2
    assert ours.perplexity == pytest.approx(reference, rel=1e-5)
    # the BOS matters: scoring the chunks as they are gives another number
    plain = chunked_perplexity(model, torch.tensor(ids), context_length=n_ctx, bos_token_id=None)
    assert plain.perplexity == pytest.approx(llama_cpp_reference(hf_model, ids, n_ctx, None)[0], rel=1e-5)
    assert plain.perplexity != pytest.approx(ours.perplexity, rel=1e-6)


def test_added_bos_is_what_the_tokenizer_puts_first() -> None:
    assert added_bos(_tokenizer("<bos> $A")) == 0
    assert added_bos(_tokenizer(None)) is None
    with pytest.raises(QkvError, match="adds 2 special tokens"):
        added_bos(_tokenizer("<bos> $A <eos>"))


def test_text_loses_one_final_newline_as_llama_cpps_file_option_does() -> None:
    assert llama_cpp_text("a\n\n") == "a\n" and llama_cpp_text("a") == "a"


@pytest.mark.parametrize("options, n_ctx", [(["--context-length", "32"], 32), ([], 128)],
                         ids=["given", "the model's 128 (under llama-perplexity's 512)"])
def test_cli_prints_the_llama_cpp_scheme(tiny, tmp_path: Path, capsys, options: list[str], n_ctx: int) -> None:
    folder, hf_model = tiny
    data = tmp_path / "text.txt"
    data.write_text(TEXT + "\n", encoding="utf-8")
    code = main(["perplexity", "--model", str(folder), "--data", str(data), "--scheme", "llama-cpp", *options])
    out, err = capsys.readouterr()
    assert code == 0, err
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids  # the final newline dropped
    reference, count = llama_cpp_reference(hf_model, ids, n_ctx, BOS)
    printed = float(re.search(r"perplexity ([0-9.]+)", out).group(1))
    assert printed == pytest.approx(reference, abs=1e-3)
    assert f"on {count} tokens" in out and f"{len(ids) // n_ctx} chunks of {n_ctx} tokens" in out


@pytest.mark.parametrize("options, message", [
    (["--stride", "8"], "drop --stride"),
    (["--kv-cache", "full"], "drop --kv-cache"),
    (["--context-length", "2"], "at least 3 tokens"),
    (["--context-length", "128"], "fewer than one chunk of 128"),
])
def test_cli_bad_input_is_one_line(tiny, tmp_path: Path, capsys, options: list[str], message: str) -> None:
    folder, _ = tiny
    data = tmp_path / "text.txt"
    data.write_text(TEXT[:100], encoding="utf-8")
    code = main(["perplexity", "--model", str(folder), "--data", str(data), "--scheme", "llama-cpp", *options])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err
