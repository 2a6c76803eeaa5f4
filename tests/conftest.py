"""Shared fixtures. The real SmolLM2-135M model is loaded at most once per test worker.

Tests that use the `smollm2*` fixtures are marked `xdist_group("smollm2")` so that
`pytest -n 2 --dist loadgroup` (the project's default) runs them all on one worker.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _threads_per_worker() -> int | None:
    """Under `pytest -n N` each of the N workers gets an equal share of this machine's cores,
    None outside xdist. PyTorch's OpenMP team defaults to every core in each worker: N teams
    on the same cores wait for each other at every parallel region (a 135M model's decode step
    then takes a scheduler quantum per op, 5-10x slower), which made most of the suite's time."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or not workers.isdigit() or int(workers) < 1:
        return None
    return max(1, len(os.sched_getaffinity(0)) // int(workers))


_SHARE = _threads_per_worker()
if _SHARE is not None:  # before torch is imported, so that processes the tests start inherit it too
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from qkv.models.hf.checkpoint import save_pretrained  # noqa: E402
from qkv.models.llama import LlamaForCausalLM  # noqa: E402
from qkv.models.configs.llama import LlamaConfig  # noqa: E402

if _SHARE is not None:
    torch.set_num_threads(_SHARE)

# In CI the property tests draw the same examples on every run, so a red build can be
# reproduced and a green one is not luck; locally they keep exploring new examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    from qkv.models.loader import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_file: Path):
    """qkv's reading of the GGUF file: config, fp32 tensors (HF names), tokenizer, template."""
    from qkv.models.gguf.checkpoint import read_gguf

    return read_gguf(smollm2_file, torch.float32)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_checkpoint):
    """(qkv model fp32, tokenizers.Tokenizer), built as the loader builds it, from the tensors
    already read (the loader itself is tested on a tiny file, saving a second read here)."""
    from qkv.models.hf.checkpoint import build_from_hf

    ck = smollm2_checkpoint
    model = build_from_hf(ck.config, ck.state_dict, torch.float32, source=str(ck.path))
    return model.eval(), ck.tokenizer


@pytest.fixture(scope="session")
def hf_smollm2_folder(smollm2_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2-hf")
    (folder / smollm2_file.name).symlink_to(smollm2_file)
    return folder


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_file: Path, hf_smollm2_folder: Path):
    """transformers' own reading of the GGUF tokenizer (and chat template), the reference."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(hf_smollm2_folder, gguf_file=smollm2_file.name)


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_file: Path, hf_smollm2_folder: Path):
    """transformers' own GGUF loading of the same file (fp32), the reference model."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_smollm2_folder, gguf_file=smollm2_file.name, dtype=torch.float32
    )
    return model.eval()


# A tiny random Llama (RoPE, grouped-query) with a chat template, for commands and the server.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer() -> Tokenizer:
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
def tiny_chat_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat")
    tokenizer = chat_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=296, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.eos_token_ids = (tokenizer.token_to_id("<|end|>"),)
    save_pretrained(model, tokenizer, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|end|>"}))
    return folder


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, the controller builds qkv's kernels (or finds them in the cache) before the
    workers start: otherwise every worker's first native test compiles the same library at
    once, each on a share of the cores (minutes of the suite's time), and one rename wins."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        from qkv.runtime.native import native_kernels

        native_kernels()
