"""The KV cache bytes the server predicts before allocating equal the bytes the engine's session
then allocates (the reference: the real buffers), and a cache too big is refused by name."""

from __future__ import annotations

import pytest
import torch

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.errors import QkvError
from qkv.runtime.session import DecodeSession
from qkv.models.gpt2 import GPT2Decoder
from qkv.models.configs.gpt2 import GPTConfig
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.serve.engine.kv_memory import kv_cache_bytes, require_kv_memory, slot_capacity


def _llama(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).to(dtype).eval()


def _gpt() -> GPT2Decoder:
    torch.manual_seed(0)
    return GPT2Decoder(GPTConfig(vocab_size=64, context_length=300, emb_dim=32, n_heads=4, n_layers=2)).eval()


def _allocated(model: torch.nn.Module, max_batch: int, capacity: int | None) -> int:
    capacity = None if capacity is None else min(capacity, model.context_length)  # as the Engine clamps it
    session = DecodeSession(model, batch_size=max_batch, capacity=capacity, kind=SlotKVCache)  # as the Engine builds it
    with session:
        return sum(buffer.nbytes for cache in session.caches for buffer in cache.buffers())


@pytest.mark.parametrize(("make", "max_batch", "capacity"), [
    (lambda: _llama(torch.float32), 3, 100), (lambda: _llama(torch.float32), 1, None),
    (lambda: _llama(torch.bfloat16), 5, 512), (lambda: _llama(torch.float32), 2, 257), (_gpt, 4, 1024),
])
def test_predicted_bytes_equal_what_the_session_allocates(make, max_batch: int, capacity: int | None) -> None:
    model = make()
    assert kv_cache_bytes(model, max_batch=max_batch, capacity=capacity) == _allocated(model, max_batch, capacity)


def test_capacity_is_rounded_and_capped_as_the_session_does() -> None:
    model = _gpt()
    assert slot_capacity(model, 1024) == 300 and slot_capacity(model, None) == 300
    assert slot_capacity(_llama(torch.float32), 100) == DecodeSession(_llama(torch.float32), capacity=100).capacity


def test_a_cache_beyond_the_memory_available_is_refused_naming_the_flags() -> None:
    model = _llama(torch.float32)
    needed = kv_cache_bytes(model, max_batch=1000, capacity=512)
    assert require_kv_memory(model, max_batch=1000, capacity=512, available=2 * needed) == needed
    with pytest.raises(QkvError, match="--max-batch 1000 .*--context.* lower --max-batch or --context"):
        require_kv_memory(model, max_batch=1000, capacity=512, available=needed)
    with pytest.raises(QkvError, match="--max-batch"):
        require_kv_memory(model, max_batch=10**12, capacity=512)  # the machine's own memory
