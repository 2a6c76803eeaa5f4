"""qkv's BERT encoder against sentence-transformers (embeddings) and transformers' BertModel
(hidden states, attentions), on the real all-MiniLM-L6-v2 and on a tiny random BERT."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from qkv.errors import QkvError
from qkv.models.bert import encode, load_bert, sentence_embeddings
from qkv.models.hf.minilm import load_minilm, minilm_path
from qkv.trace import trace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched

TEXTS = [
    "Your journey starts with one step.",
    "Attention weighs every word against every other word!",
    "short",
]


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


@pytest.fixture(scope="module")
def hf_minilm():
    from transformers import BertModel

    return BertModel.from_pretrained(str(minilm_path()), attn_implementation="eager").eval()


def test_sentence_embeddings_match_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    model, tokenizer = minilm
    reference = SentenceTransformer(str(minilm_path()), device="cpu").encode(TEXTS, convert_to_tensor=True)
    ours = sentence_embeddings(model, tokenizer, TEXTS)
    torch.testing.assert_close(ours, reference.cpu(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(TEXTS)))


def test_wordpiece_ids_match_transformers_tokenizer(minilm):
    from transformers import AutoTokenizer

    _, tokenizer = minilm
    hf = AutoTokenizer.from_pretrained(str(minilm_path()))
    for text in TEXTS + ["Tokenization of unbelievably long words"]:
        assert tokenizer.encode(text).ids == hf(text)["input_ids"]


@pytest.mark.parametrize("layer", [0, 3, 5])
def test_traced_attentions_match_transformers_bert(minilm, hf_minilm, layer):
    model, tokenizer = minilm
    ids, real = encode(tokenizer, TEXTS)  # padded batch: the padding keys must get no weight
    with torch.no_grad():
        expected = hf_minilm(input_ids=ids, attention_mask=real, output_attentions=True)
    recorded = trace(model, ids, layer=layer, attention_mask=real).layers[0]
    assert recorded.num_heads == 12 and recorded.head_dim == 32 and not recorded.causal
    hf_weights = expected.attentions[layer]  # (B, 12, T, T)
    for row in range(len(TEXTS)):
        n = int(real[row].sum())  # compare the real query rows; padded ones are a convention
        torch.testing.assert_close(recorded.weights[row, :, :n], hf_weights[row, :, :n], atol=2e-6, rtol=1e-4)
        assert torch.all(recorded.weights[row, :, :, n:] == 0)
    if layer == 0:
        hidden = trace(model, ids, layer=0, attention_mask=real).output
        for row in range(len(TEXTS)):
            n = int(real[row].sum())
            torch.testing.assert_close(hidden[row, :n], expected.last_hidden_state[row, :n],
                                       atol=5e-5, rtol=1e-4)


def _tiny_bert_folder(tmp_path):
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=40, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                        intermediate_size=48, max_position_embeddings=32)
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(tmp_path)
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{f"w{i}": 4 + i for i in range(36)}}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_tiny_random_bert_matches_transformers(tmp_path):
    from transformers import BertModel

    folder = _tiny_bert_folder(tmp_path)
    ours = load_bert(folder)
    reference = BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    ids = torch.randint(0, 40, (2, 9))
    real = torch.ones(2, 9, dtype=torch.long)
    real[1, 6:] = 0
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=real, output_attentions=True)
        got = ours(ids, attention_mask=real)
    torch.testing.assert_close(got[0], expected.last_hidden_state[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1, :6], expected.last_hidden_state[1, :6], atol=1e-5, rtol=1e-4)
    weights = trace(ours, ids, layer=1, attention_mask=real).layers[0].weights
    torch.testing.assert_close(weights[0], expected.attentions[1][0], atol=1e-6, rtol=1e-4)


def test_unknown_checkpoint_key_is_named(tmp_path):
    from safetensors.torch import load_file

    folder = _tiny_bert_folder(tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    weights["encoder.layer.0.attention.self.extra.weight"] = torch.zeros(2)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(QkvError, match="attention.self.extra.weight"):
        load_bert(folder)


def test_missing_files_and_other_architectures_are_user_errors(tmp_path):
    with pytest.raises(QkvError, match="config.json"):
        load_bert(tmp_path)
    folder = _tiny_bert_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(QkvError, match="not a BERT config"):
        load_bert(folder)
