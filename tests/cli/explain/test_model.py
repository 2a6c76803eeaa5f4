"""`qkv explain TEXT --model M`: the numbers printed are transformers' (MiniLM, a tiny
Llama), the options select what they say, the files are written, bad input is one line
and exit code 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from qkv.cli.main import main
from qkv.models.hf.minilm import minilm_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = "The cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def hf_bert():
    from transformers import AutoTokenizer, BertModel

    folder = str(minilm_path())
    return BertModel.from_pretrained(folder, attn_implementation="eager").eval(), AutoTokenizer.from_pretrained(folder)


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_minilm_json_is_transformers_bert(capsys, hf_bert):
    model, tokenizer = hf_bert
    data = _json(capsys, ["explain", TEXT, "--model", "minilm", "--layer", "1", "--head", "3",
                          "--query", "3", "--json"])
    encoded = tokenizer(TEXT, return_tensors="pt")
    assert data["tokens"] == tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    assert data["layer"] == 1 and data["head"] == 3
    assert data["query"] == {"position": 3, "token": "cat"}
    with torch.no_grad():
        out = model(**encoded, output_attentions=True, output_hidden_states=True)
    expected = out.attentions[1][0, 3, 2]  # query "cat" (position 3, index 2)
    torch.testing.assert_close(torch.tensor(data["weights"]), expected, atol=1e-6, rtol=1e-4)
    assert len(data["keys"]) == len(data["tokens"]) and len(data["keys"][0]) == 32
    # The context: these weights mixing head 3's values of layer 1, computed from transformers.
    value = model.encoder.layer[1].attention.self.value
    values = value(out.hidden_states[1][0])[:, 3 * 32:4 * 32]  # (T, 32)
    torch.testing.assert_close(torch.tensor(data["context"]), expected @ values, atol=1e-5, rtol=1e-4)
    assert set(data["analysis"]["sink_share"]) == {str(h) for h in range(12)}


def test_query_by_text_equals_query_by_position(capsys):
    by_text = _json(capsys, ["explain", TEXT, "--model", "minilm", "--query", "mat", "--json"])
    by_position = _json(capsys, ["explain", TEXT, "--model", "minilm", "--query", "7", "--json"])
    assert by_text["query"] == by_position["query"] == {"position": 7, "token": "mat"}
    assert by_text["weights"] == by_position["weights"]
    assert by_text["layer"] == 0 and by_text["head"] == 0  # the defaults


def test_terminal_tables_show_tokens_and_weights(capsys, hf_bert):
    model, tokenizer = hf_bert
    assert main(["explain", TEXT, "--model", "minilm", "--layer", "5", "--head", "7", "--query", "it"]) == 0
    shown = capsys.readouterr().out
    assert "\x1b[" not in shown  # plain text when not a terminal
    with torch.no_grad():
        weights = model(**tokenizer(TEXT, return_tensors="pt"), output_attentions=True).attentions[5][0, 7, 8]
    for token, weight in zip(["[CLS]", "cat", "mat", "tired"], weights[[0, 2, 6, 10]].tolist()):
        assert any(token in line and f"{weight:.4f}" in line for line in shown.splitlines())


def test_piped_output_keeps_the_heat_strip_and_says_what_the_sink_numbers_average(capsys, tmp_path, hf_bert):
    model, tokenizer = hf_bert
    figures = tmp_path / ("a-folder-name-long-enough-to-need-more-than-one-line-at-eighty-columns-" * 2)
    assert main(["explain", TEXT, "--model", "minilm", "--layer", "2", "--head", "5", "--query", "it",
                 "--png", str(figures)]) == 0
    lines = capsys.readouterr().out.splitlines()
    with torch.no_grad():
        weights = model(**tokenizer(TEXT, return_tensors="pt"), output_attentions=True).attentions[2][0]
    start = next(i for i, line in enumerate(lines) if line.startswith("weights:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("context ="))
    strip = " ".join(lines[start:end])  # wrapped between tokens, not inside them
    assert f"[CLS] {float(weights[5, 8, 0]):.2f}" in strip and f"tired {float(weights[5, 8, 10]):.2f}" in strip
    sink = next(i for i, line in enumerate(lines) if line.startswith("weight on the first token"))
    said = " ".join(lines[sink:sink + 3])
    assert 'first token "[CLS]", per head, averaged over 12 queries' in said
    assert f"5:{float(weights[5, :, 0].mean()):.2f}" in said  # the mean over every query
    assert f"wrote 3 figures into {figures}: scores.png, heatmap.png, heads.png" in lines


def test_png_and_html_for_a_model(tmp_path, capsys):
    assert main(["explain", "A <script>alert(1)</script> test", "--model", "minilm", "--png",
                 str(tmp_path / "figs"), "--html", str(tmp_path / "page.html")]) == 0
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["heads.png", "heatmap.png", "scores.png"]
    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    data = json.loads(page.split('id="trace-data">')[1].split("</script>")[0])
    assert [layer["layer"] for layer in data["layers"]] == list(range(6))  # every layer, to switch


def test_book_example_figures_and_page(tmp_path, capsys):
    assert main(["explain", "--query", "journey", "--png", str(tmp_path), "--html", str(tmp_path / "b.html")]) == 0
    out = capsys.readouterr().out
    assert "[0.3061, 0.8210]" in out  # the book's printed context vector of "journey"
    assert (tmp_path / "keys_plane.png").is_file() and (tmp_path / "b.html").is_file()


def test_decoder_generate_shows_the_cache_growing(capsys, tiny_llama, tmp_path):
    import html

    folder, reference, tok = tiny_llama
    data = _json(capsys, ["explain", "The cat sat", "--model", str(folder), "--layer", "1", "--head", "3",
                          "--generate", "3", "--json", "--html", str(tmp_path / "kv.html")])
    ids = tok.encode("The cat sat").ids
    t = len(ids)
    assert data["kv_head"] == 1 and data["query"]["position"] == t
    assert [g["kv_head"] for g in data["analysis"]["kv_groups"]] == [0, 1]
    assert data["analysis"]["kv_groups"][1]["query_heads"] == [2, 3]
    assert data["analysis"]["rope"]["largest_spread_at_equal_distance"] < 1e-4
    steps = data["generation"]
    assert [s["cached_keys"] for s in steps] == [t, t + 1, t + 2]
    with torch.no_grad():
        greedy = reference.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
        attentions = reference(greedy, output_attentions=True).attentions[1][0, 3]
    # Keys before and after RoPE: the rotated ones are transformers' cached keys, and the
    # rotation keeps their lengths.
    with torch.no_grad():
        cached = reference(torch.tensor([ids]), use_cache=True).past_key_values.layers[1].keys[0, 1]
    torch.testing.assert_close(torch.tensor(data["keys"]), cached, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(data["keys_unrotated"]).norm(dim=-1), cached.norm(dim=-1),
                               atol=1e-5, rtol=1e-4)
    page = (tmp_path / "kv.html").read_text(encoding="utf-8")
    for i, step in enumerate(steps):
        torch.testing.assert_close(torch.tensor(step["weights"]), attentions[t + i, : t + i + 1],
                                   atol=1e-5, rtol=1e-4)
        assert step["token"] == tok.decode([int(greedy[0, t + i])]).replace(" ", "␣")
        assert f'<td class="tok">{html.escape(step["token"])}</td><td>{t + i} + 1</td>' in page


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["explain", "hello", "--model", "no-such-model"], "model folder no-such-model does not exist"),
        (["explain", TEXT, "--model", "minilm", "--layer", "6"], "--layer 6 is out of range"),
        (["explain", TEXT, "--model", "minilm", "--head", "12"], "--head 12 is out of range"),
        (["explain", "", "--model", "minilm"], "the text is empty"),
        (["explain", "   ", "--model", "minilm"], "the text is empty"),
        (["explain", TEXT, "--model", "minilm", "--query", "13"], "between 1 and 12"),
        (["explain", TEXT, "--model", "minilm", "--query", "dog"], "neither a position nor one of the tokens"),
        (["explain", TEXT, "--model", "minilm", "--generate", "2"], "needs a decoder"),
        (["explain", TEXT], "TEXT needs --model"),
        (["explain", TEXT, "--model", "minilm", "--generate", "0"], "--generate needs at least 1 token"),
        (["explain", "--layer", "1", "--html", "x.html"], "--layer 1 is out of range: the book's example"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and err.startswith("qkv explain: error:")
    assert not (tmp_path / "x.html").exists()


def test_keys_png_and_html_beside_the_json(capsys, tiny_llama, tmp_path):
    folder, _, _ = tiny_llama
    page, figures = tmp_path / "keys.html", tmp_path / "figs"
    code = main(["explain", "--model", str(folder), "--keys", "--json", "--png", str(figures),
                 "--html", str(page), "The cat sat on the mat."])
    out, err = capsys.readouterr()
    assert code == 0
    data = json.loads(out)  # stdout stays the JSON alone; the files are reported on stderr
    assert "wrote 4 figures" in err and str(page) in err
    assert sorted(p.name for p in figures.iterdir()) == ["channels.png", "key_norms.png", "rope_bands.png", "sink.png"]
    text = page.read_text(encoding="utf-8")
    assert text.count("<tr>") == len(data["summary"]) + 1
    assert all(f"<td>{row['sink_mass']:.4g}</td>" in text for row in data["summary"])


def test_a_model_without_text_explains_the_default_sentence_and_says_so(capsys):
    from qkv.cli.explain.model import DEFAULT_SENTENCE

    assert main(["explain", "--model", "minilm", "--json"]) == 0
    out, err = capsys.readouterr()
    assert f'No TEXT given: explaining the default sentence "{DEFAULT_SENTENCE}"' in " ".join(err.split())
    default = json.loads(out)
    assert main(["explain", DEFAULT_SENTENCE, "--model", "minilm", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == default  # the same trace as typing it


def test_keys_in_a_pipe_keep_one_line_per_layer_and_kv_head(tiny_llama):
    folder, _, _ = tiny_llama
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR")}
    done = subprocess.run([sys.executable, "-m", "qkv", "explain", "--model", str(folder), "--keys",
                           "--threads", "1", "The cat sat on the mat."], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "\x1b[" not in done.stdout
    header = [line.split() for line in lines if line.split()[:1] == ["layer"]]
    assert header == [["layer", "head", "max/med", "(stability", "%)", "max/med", "outliers", "/median", "mass"]]
    assert len([line for line in lines if re.match(r"\s+\d+\s+\d+\s", line)]) == 2 * 2  # 2 layers, 2 KV heads
