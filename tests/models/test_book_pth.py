"""The book's saved GPT (model.pth, model_and_optimizer.pth) through qkv's one loader: the
book's greedy text exactly, every key accounted for, nothing but tensors unpickled."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from qkv.book import GPTModel, generate_text_simple
from qkv.cli.main import main
from qkv.errors import QkvError
from qkv.models.book_pth import open_book_file
from qkv.models.hf.gpt2_tokenizer import gpt2_tokenizer
from qkv.models.loader import load_pretrained

PROMPT = "Every effort moves you"
CFG = {"vocab_size": 50257, "context_length": 32, "emb_dim": 64, "n_heads": 1, "n_layers": 2,
       "drop_rate": 0.1, "qkv_bias": False}  # heads of 64 features, as the book's GPT-2 sizes


@pytest.fixture(scope="module")
def book_model() -> GPTModel:
    torch.manual_seed(7)
    return GPTModel(CFG).eval()


@pytest.fixture(scope="module")
def model_pth(book_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("book") / "model.pth"
    torch.save(book_model.state_dict(), path)  # the book's section 5.4
    return path


def book_text(model: GPTModel, new_tokens: int) -> str:
    tok = gpt2_tokenizer()
    ids = torch.tensor([tok.encode(PROMPT).ids])
    return tok.decode(generate_text_simple(model, ids, new_tokens, CFG["context_length"])[0].tolist())


def test_generate_gives_the_books_greedy_text(book_model, model_pth, capsys):
    code = main(["generate", "--model", str(model_pth), "--prompt", PROMPT, "--max-new-tokens", "20"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert out == book_text(book_model, 20) + "\n"


def test_model_and_optimizer_file_loads_the_model(book_model, tmp_path):
    optimizer = torch.optim.AdamW(book_model.parameters(), lr=4e-4, weight_decay=0.1)
    path = tmp_path / "model_and_optimizer.pth"
    torch.save({"model_state_dict": book_model.state_dict(), "optimizer_state_dict": optimizer.state_dict()}, path)
    model, tokenizer = load_pretrained(path)
    ids = torch.tensor([tokenizer.encode(PROMPT).ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), book_model(ids), atol=2e-5, rtol=1e-5)
    assert model.eos_token_ids == ()  # generate_text_simple never stops early


def _saved(tmp_path: Path, state: object, name: str = "model.pth") -> Path:
    path = tmp_path / name
    torch.save(state, path)
    return path


def test_unknown_and_missing_keys_are_named(book_model, tmp_path, capsys):
    state = dict(book_model.state_dict())
    extra = _saved(tmp_path, {**state, "trf_blocks.0.att.W_extra.weight": torch.zeros(2)}, "extra.pth")
    code = main(["generate", "--model", str(extra), "--prompt", PROMPT])
    err = capsys.readouterr().err
    assert code == 2 and "unknown key trf_blocks.0.att.W_extra.weight" in err and len(err.strip().splitlines()) == 1
    state.pop("trf_blocks.1.ff.layers.2.bias")
    with pytest.raises(QkvError, match="missing key trf_blocks.1.ff.layers.2.bias"):
        open_book_file(_saved(tmp_path, state, "missing.pth"))


def test_shapes_and_masks_are_checked(book_model, tmp_path):
    state = dict(book_model.state_dict())
    with pytest.raises(QkvError, match="out_proj.weight has shape"):
        open_book_file(_saved(tmp_path, {**state, "trf_blocks.0.att.out_proj.weight": torch.zeros(64, 3)}, "a.pth"))
    bad = open_book_file(_saved(tmp_path, {**state, "trf_blocks.0.att.mask": torch.zeros(32, 32)}, "b.pth"))
    with pytest.raises(QkvError, match="not the book's causal mask"):
        bad.read_tensors(torch.float32)


class Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_only_tensors_are_unpickled(tmp_path, capsys):
    path = _saved(tmp_path, {"tok_emb.weight": Payload()}, "evil.pth")
    with pytest.raises(QkvError, match="weights_only=True"):
        open_book_file(path)
    assert "this must never run" not in capsys.readouterr().out


def test_not_a_state_dict_and_old_formats_are_refused(tmp_path):
    with pytest.raises(QkvError, match="not a state dict"):
        open_book_file(_saved(tmp_path, [torch.zeros(2)], "list.pth"))
    legacy = tmp_path / "legacy.pth"
    torch.save({"tok_emb.weight": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(QkvError, match="zip format"):
        open_book_file(legacy)
    bomb = tmp_path / "bomb.pth"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\0" * (65 * 2**20))
    with pytest.raises(QkvError, match="refusing to unpickle"):
        open_book_file(bomb)


def test_perplexity_and_explain_read_the_books_file(model_pth, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("I had always thought Jack Gisburn rather a cheap genius. " * 4, encoding="utf-8")
    assert main(["perplexity", "--model", str(model_pth), "--data", str(text)]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out.lower()
    assert main(["explain", PROMPT, "--model", str(model_pth), "--json"]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert traced["query"]["position"] == 4
    model = book_model_from(model_pth)
    ids = torch.tensor([gpt2_tokenizer().encode(PROMPT).ids])  # (1, T)
    with torch.no_grad():
        x = model.tok_emb(ids) + model.pos_emb(torch.arange(ids.shape[1]))
        block = model.trf_blocks[0]
        query = block.att.W_query(block.norm1(x))[0, 3]  # the one head of layer 0, last token
    torch.testing.assert_close(torch.tensor(traced["query_vector"]), query, atol=1e-5, rtol=1e-4)


def book_model_from(path: Path) -> GPTModel:
    model = GPTModel(CFG)
    model.load_state_dict(torch.load(path, weights_only=True))  # the book's own way back (section 5.4)
    return model.eval()
