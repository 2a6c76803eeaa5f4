"""A tiny random Llama with a chat template, saved as a checkpoint folder, and a real
`qkv serve` app under uvicorn on a free loopback port (stopped after the tests)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from qkv.models.checkpoint import save_pretrained
from qkv.models.llama import LlamaForCausalLM
from qkv.models.llama_config import LlamaConfig

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
API_KEY = "test-key"


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=288, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["The cat sat on the mat.", "Attention is all you need, they said.",
                             "Keys, queries and values."], trainer)
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])
    return tok


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat")
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=296, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.eos_token_ids = (tokenizer.token_to_id("<|end|>"),)
    save_pretrained(model, tokenizer, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|end|>"}))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Running:
    url: str
    served: object
    app: object


@pytest.fixture(scope="module")
def start_server(tiny_folder: Path):
    import uvicorn

    from qkv.serve.app import build_app
    from qkv.serve.schemas import Limits
    from qkv.serve.server import load_served

    started: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(*, max_batch: int = 4, max_waiting: int | None = None, api_key: str | None = API_KEY,
              limits: Limits = Limits(max_tokens=64)) -> Running:
        served = load_served(str(tiny_folder), max_batch=max_batch, max_waiting=max_waiting)
        app = build_app(served, limits=limits, api_key=api_key)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        started.append((server, thread))
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return Running(f"http://127.0.0.1:{port}", served, app)

    yield start
    for server, thread in started:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(start_server) -> Iterator[Running]:
    yield start_server()
