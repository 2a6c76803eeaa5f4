"""A `qkv serve` subprocess on a tiny random Llama with a 1024-token context (room for a
tool list in the prompt), on a free loopback port; stopped by the fixture that starts it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from qkv.models.hf.checkpoint import save_pretrained
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from tests.conftest import CHAT_TEMPLATE, chat_tokenizer
from tests.serve_process import serve_process


# A person's record: every field bounded, so that even a random model completes it.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
    "member": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["name", "age", "city", "member", "tags"], "additionalProperties": False}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def tiny_long_context_folder(folder: Path) -> Path:
    tokenizer = chat_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=296, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.eos_token_ids = (tokenizer.token_to_id("<|end|>"),)
    folder.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, tokenizer, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|end|>"}))
    return folder


@contextmanager
def qkv_serve(model: Path | str, *extra: str) -> Iterator[str]:
    """The base URL of a running `qkv serve --model MODEL` (stopped on exit)."""
    with serve_process(model, "--max-batch", "4", "--threads", "1", "--max-tokens", "256", *extra) as server:
        yield server.url
