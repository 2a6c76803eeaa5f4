"""`qkv explain --model M TEXT --why QUERY:KEY` and its patches on a tiny random Llama: the
split's numbers add up to transformers' attention, rows fit 80 columns, files are written,
bad values are one line and exit code 2."""

from __future__ import annotations

import json
import os

import pytest
import torch

from qkv.cli.main import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = "The cat sat on the mat. The cat"


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """tests/cli/conftest.py's random Llama, its folder as a string."""
    folder, reference, tok = tiny_llama
    return str(folder), reference, tok


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_why_json_adds_up_to_transformers_attention(capsys, tiny):
    folder, reference, tok = tiny
    ids = tok.encode(TEXT).ids
    data = _json(capsys, ["explain", TEXT, "--model", folder, "--layer", "1", "--head", "3",
                          "--why", f"{len(ids)}:2", "--json"])
    why = data["why"]
    assert why["query"]["position"] == len(ids) and why["shared_by"] == [2, 3] and why["kv_head"] == 1
    (key,) = why["keys"]
    assert key["position"] == 2 and key["sum_of_terms"] == pytest.approx(key["score"], abs=1e-5)
    with torch.no_grad():
        weights = reference(torch.tensor([ids]), output_attentions=True).attentions[1][0]  # (H, T, T)
    assert key["weight"] == pytest.approx(float(weights[3, len(ids) - 1, 1]), abs=1e-5)
    assert [g["head"] for g in key["group"]] == [2, 3]
    assert key["group"][0]["weight"] == pytest.approx(float(weights[2, len(ids) - 1, 1]), abs=1e-5)
    assert sum(p["rotated"] for p in key["rope_pairs"]) == pytest.approx(key["score"], abs=1e-5)
    assert len(key["top_pairs"]) == 12
    by_text = _json(capsys, ["explain", TEXT, "--model", folder, "--layer", "1", "--head", "3",
                             "--why", f"{len(ids)}:cat", "--json"])
    assert by_text["why"]["keys"][0]["position"] == 2 and by_text["why"]["keys"][0]["score"] == key["score"]


def test_terminal_rows_fit_80_columns_and_the_row_view_lists_every_key(capsys, tiny):
    folder, _, tok = tiny
    assert main(["explain", TEXT, "--model", folder, "--layer", "1", "--why", "8:2", "--top", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert any("exact" in line for line in lines) and any("RoPE pairs" in line for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("query source"))
    assert lines[header + 6].startswith("the other")  # five terms, then the rest
    assert main(["explain", TEXT, "--model", folder, "--why", "8:all"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in rows) <= 80 and rows.index("") == 2 + 8  # then the legend
    assert rows[rows.index("") + 1] == "How to read this:"


def test_why_and_sinks_end_with_one_legend_of_their_words(capsys, tiny):
    folder, _, _ = tiny
    assert main(["explain", TEXT, "--model", folder, "--layer", "1", "--why", "8:2", "--sinks", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80 and lines.count("How to read this:") == 1
    legend = " ".join(" ".join(lines[lines.index("How to read this:"):]).split())
    for words in ("L0.mlp = layer 0's MLP output", "embed = the token embedding", "query source / key source",
                  "negative or over 100%", "wavelength", "unrotated", "sink = the mean weight",
                  "this list is by head"):
        assert words in legend
    assert legend.count("Sources, what wrote the residual stream") == 1


def test_patching_with_its_own_text_changes_nothing_and_a_source_removal_does(capsys, tiny):
    folder, _, _ = tiny
    same = _json(capsys, ["explain", TEXT, "--model", folder, "--layer", "1", "--why", "8:2",
                          "--patch-from", TEXT, "--json"])["patch"]
    assert same["kl"] == 0.0 and same["weights_before"] == same["weights_after"]
    removed = _json(capsys, ["explain", TEXT, "--model", folder, "--layer", "1", "--why", "8:2",
                             "--patch-source", "embed", "--json"])["patch"]
    assert removed["weights_before"] != removed["weights_after"] and removed["kl"] > 0
    assert sum(removed["weights_after"]) == pytest.approx(1.0, abs=1e-5)


def test_sweep_and_sinks_json(capsys, tiny):
    folder, _, tok = tiny
    t = len(tok.encode(TEXT).ids)
    data = _json(capsys, ["explain", TEXT, "--model", folder, "--patch-sweep", "--sinks", "2", "--json"])
    assert [row["layer"] for row in data["sweep"]["layers"]] == [0, 1]
    assert all(len(row["kl"]) == t for row in data["sweep"]["layers"])
    assert data["sweep"]["donor"] == "mean" and len(data["sinks"]) == 2
    best = max(kl for row in data["sweep"]["layers"] for kl in row["kl"])
    assert data["sweep"]["strongest"][0]["kl"] == best
    one = _json(capsys, ["explain", TEXT, "--model", folder, "--patch-sweep", "--layer", "1", "--patch-value",
                         "--patch-from", TEXT, "--json"])["sweep"]
    assert [row["layer"] for row in one["layers"]] == [1] and one["kind"] == "value"
    assert max(one["layers"][0]["kl"]) < 1e-9


def test_png_and_html(capsys, tiny, tmp_path):
    folder, _, _ = tiny
    page = tmp_path / "why.html"
    assert main(["explain", TEXT, "--model", folder, "--why", "8:1", "--png", str(tmp_path / "f"),
                 "--html", str(page)]) == 0
    assert (tmp_path / "f" / "why_pairs.png").is_file() and (tmp_path / "f" / "why_rope_pairs.png").is_file()
    text = page.read_text()
    assert "Why query 8" in text and "data:image/png;base64," in text


@pytest.mark.parametrize("argv,words", [
    (["--why", "5"], "give QUERY:KEY"),
    (["--why", "2:5"], "comes after query 2"),
    (["--why", "99:1"], "positions are counted from 1, between 1 and"),
    (["--why", "8:dog"], "neither a position nor one of the tokens"),
    (["--patch-from", "The dog"], "needs --why QUERY:KEY or --patch-sweep"),
    (["--top", "3", "--sinks", "1"], "--top sets how many terms"),
    (["--why", "8:2", "--query", "3"], "--why names the query"),
    (["--why", "8:2", "--layer", "1", "--patch-source", "L1.mlp"], "not a source of layer 1"),
    (["--why", "8:all", "--patch-from", TEXT], "a patch needs one key"),
    (["--patch-sweep", "--patch-from", "The cat"], "same length"),
])
def test_bad_values_are_one_line_and_exit_2(capsys, tiny, argv, words):
    folder, _, _ = tiny
    assert main(["explain", TEXT, "--model", folder, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_why_without_a_model_is_refused(capsys):
    assert main(["explain", "--why", "2:1"]) == 2
    assert "--why needs a decoder: give --model" in capsys.readouterr().err
