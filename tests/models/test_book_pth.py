"""The book's saved GPT (model.pth, model_and_optimizer.pth) through qkv's one loader: the
book's greedy text exactly, every key accounted for, nothing but tensors unpickled."""

from __future__ import annotations

import importlib.util
import json
import time
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


def save_config(folder: Path, cfg: dict = CFG) -> None:
    """The book's config dict beside its model.pth: what says the head count a state dict cannot."""
    (folder / "config.json").write_text(json.dumps(cfg), encoding="utf-8")


@pytest.fixture(scope="module")
def model_pth(book_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("book") / "model.pth"
    torch.save(book_model.state_dict(), path)  # the book's section 5.4
    save_config(path.parent)
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


def adamw_after_one_step(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW as the book makes it, with its state (step, exp_avg, exp_avg_sq) filled by one step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def test_model_and_optimizer_file_loads_the_model(tmp_path):
    torch.manual_seed(7)
    book_model = GPTModel(CFG)
    optimizer = adamw_after_one_step(book_model)
    book_model.eval()
    path = tmp_path / "model_and_optimizer.pth"
    torch.save({"model_state_dict": book_model.state_dict(), "optimizer_state_dict": optimizer.state_dict()}, path)
    save_config(tmp_path)
    model, tokenizer = load_pretrained(path)
    ids = torch.tensor([tokenizer.encode(PROMPT).ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), book_model(ids), atol=2e-5, rtol=1e-5)
    assert model.eos_token_ids == ()  # generate_text_simple never stops early


def _saved(tmp_path: Path, state: object, name: str = "model.pth") -> Path:
    path = tmp_path / name
    torch.save(state, path)
    save_config(tmp_path)
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


# ----------------------------------------------------------------------------- the head count


FOUR_HEADS = {**CFG, "n_heads": 4}  # the shape qkv's chapter-3 notebook uses: heads of 16 features


def the_books_gpt(cfg: dict) -> torch.nn.Module:
    """The book's own chapter-4 GPTModel (tests/training/book_reference), not qkv's copy."""
    source = Path(__file__).parents[1] / "training" / "book_reference" / "previous_chapters.py"
    spec = importlib.util.spec_from_file_location("book_previous_chapters", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(11)
    return module.GPTModel(cfg).eval()


@pytest.fixture(scope="module")
def four_heads() -> torch.nn.Module:
    return the_books_gpt(FOUR_HEADS)


def assert_same_logits(path: Path, book: torch.nn.Module) -> None:
    model, tokenizer = load_pretrained(path)
    ids = torch.tensor([tokenizer.encode(PROMPT).ids])
    assert model.cfg.n_heads == 4
    with torch.no_grad():
        torch.testing.assert_close(model(ids), book(ids), atol=2e-5, rtol=1e-5)


def test_a_width_that_does_not_say_its_heads_is_refused_by_name(four_heads, tmp_path, capsys):
    path = tmp_path / "model.pth"
    torch.save(four_heads.state_dict(), path)  # the book's section 5.4, nothing beside it
    with pytest.raises(QkvError, match=r"does not say how many attention heads its model has, and emb_dim 64 is "
                                       r"none of GPT-2's widths \(768, 1024, 1280, 1600.*config.json"):
        open_book_file(path)
    assert main(["generate", "--model", str(path), "--prompt", PROMPT]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "how many attention heads" in err


def test_the_books_config_beside_the_file_gives_the_books_logits(four_heads, tmp_path):
    path = tmp_path / "model.pth"
    torch.save(four_heads.state_dict(), path)
    save_config(tmp_path, FOUR_HEADS)
    assert_same_logits(path, four_heads)


def test_the_books_config_saved_in_the_file_gives_the_books_logits(four_heads, tmp_path):
    path = tmp_path / "model_and_optimizer.pth"
    optimizer = adamw_after_one_step(the_books_gpt(FOUR_HEADS))
    torch.save({"model_state_dict": four_heads.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
                "config": FOUR_HEADS}, path)
    assert_same_logits(path, four_heads)


def test_a_config_the_tensors_contradict_is_refused(four_heads, tmp_path):
    path = tmp_path / "model.pth"
    torch.save(four_heads.state_dict(), path)
    save_config(tmp_path, {**FOUR_HEADS, "emb_dim": 768})
    with pytest.raises(QkvError, match=r"config.json: emb_dim is 768, but the tensors of model.pth say 64"):
        open_book_file(path)
    save_config(tmp_path, {**FOUR_HEADS, "n_heads": 5})
    with pytest.raises(QkvError, match="n_heads 5 does not divide emb_dim 64 into whole heads"):
        open_book_file(path)
    both = tmp_path / "both.pth"
    torch.save({"model_state_dict": four_heads.state_dict(), "config": {**FOUR_HEADS, "n_heads": 2}}, both)
    with pytest.raises(QkvError, match="its saved config says n_heads 2, .*config.json says 5"):
        open_book_file(both)


def test_gpt2_widths_keep_their_heads_of_64_features(tmp_path):
    shape = {**CFG, "vocab_size": 8, "context_length": 4, "emb_dim": 768, "n_layers": 1}
    torch.manual_seed(0)
    path = _saved(tmp_path, GPTModel(shape).state_dict(), "gpt2-width.pth")
    (tmp_path / "config.json").unlink()
    assert open_book_file(path).cfg.n_heads == 12


# ----------------------------------------------------------------------------- the optimizer's pickle


def test_a_large_optimizer_pickle_is_refused_before_it_is_unpickled(book_model, tmp_path):
    """5.3 MB of Python floats in an optimizer state beside 2,033 tensors: unpickled, it took
    1.8 s and 69 MB of memory (ten times that, 16 s and 286 MB, for 54 MB; a loaded 2-core
    machine); bounded by the tensors the file stores (2 MB here), it is refused unread."""
    optimizer = adamw_after_one_step(GPTModel(CFG)).state_dict()
    optimizer["state"] = {i: {"step": torch.tensor(1.0), "exp_avg": [float(j) for j in range(300)]} for i in range(2000)}
    path = _saved(tmp_path, {"model_state_dict": book_model.state_dict(), "optimizer_state_dict": optimizer}, "big.pth")
    start = time.perf_counter()
    with pytest.raises(QkvError, match=r"its pickle part is 5\.\d MB for 2\d{3} stored tensors, more than their "
                                       r"state dicts need .*refusing to unpickle it"):
        open_book_file(path)
    assert time.perf_counter() - start < 2.0  # nothing was unpickled (it took seconds when it was)
