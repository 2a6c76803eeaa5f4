"""`qkv explain --model M` on a model with sliding-window layers (a tiny random Mistral):
the weights a local layer's query puts on its keys are transformers' (zero outside its
window), the keys outside it are named so, and `--keys` sums the local layers apart. Skipped
while qkv does not read Mistral folders."""

from __future__ import annotations

import json
import os

import pytest
import torch

from qkv.cli.main import main
from qkv.errors import QkvError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WINDOW = 4
TEXT = "The cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory, tiny_llama):
    import transformers as tf

    import qkv

    _, _, tok = tiny_llama  # its tokenizer
    folder = tmp_path_factory.mktemp("mistral")
    tok.save(str(folder / "tokenizer.json"))
    config = tf.MistralConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              max_position_embeddings=64, sliding_window=WINDOW, initializer_range=0.3,
                              bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    tf.MistralForCausalLM(config).save_pretrained(folder)
    try:
        qkv.load_pretrained(folder)
    except QkvError as error:
        pytest.skip(f"qkv does not read Mistral folders yet ({error})")
    reference = tf.MistralForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    return folder, reference, tok


def test_a_local_layers_weights_are_transformers_and_zero_outside_its_window(capsys, tiny_mistral) -> None:
    folder, reference, tok = tiny_mistral
    assert main(["explain", TEXT, "--model", str(folder), "--layer", "1", "--head", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layer_info"]["window"] == WINDOW and data["layer_info"]["attention"] == "local"
    position = data["query"]["position"]  # counted from 1
    assert data["outside_window"] == [s + 1 <= position - WINDOW for s in range(len(data["weights"]))]
    ids = torch.tensor([tok.encode(TEXT).ids])
    with torch.no_grad():
        expected = reference(ids, output_attentions=True).attentions[1][0, 2, position - 1]  # (S,)
    torch.testing.assert_close(torch.tensor(data["weights"]), expected, atol=1e-5, rtol=1e-4)
    assert all(w == 0.0 for w, out in zip(data["weights"], data["outside_window"]) if out)


def test_the_terminal_names_the_keys_outside_the_window(capsys, tiny_mistral) -> None:
    folder, _, _ = tiny_mistral
    assert main(["explain", TEXT, "--model", str(folder), "--layer", "0", "--query", "5"]) == 0
    out = capsys.readouterr().out
    assert f"local: sliding window of {WINDOW} keys" in " ".join(out.split())  # however the terminal wraps it
    assert out.count("(outside window)") == 1  # x(5) sees x(2) .. x(5): only x(1) lies before


def test_the_key_anatomy_sums_local_layers_apart(capsys, tiny_mistral) -> None:
    folder, _, _ = tiny_mistral
    assert main(["explain", TEXT, "--model", str(folder), "--keys", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["by_attention"]) == {"local"}
    assert data["by_attention"]["local"]["windows"] == [WINDOW]
    assert {row["attention"] for row in data["summary"]} == {"local"}
