"""The one loader's pieces that need no real model: shapes from configs, names, limits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.errors import QkvError
from qkv.models.key_maps import hf as hf_keys
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.models.configs.qwen import Qwen2Config, Qwen3Config
from qkv.models.hf.untrusted import inside, parse_size, require_memory

SMALL = dict(vocab_size=11, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2)


@pytest.mark.parametrize("cfg", [
    LlamaConfig(**SMALL),
    LlamaConfig(**SMALL, num_key_value_heads=1, attention_bias=True, attention_out_bias=True, mlp_bias=True,
                tie_word_embeddings=True),
    Qwen2Config(**SMALL, num_key_value_heads=1),
    Qwen3Config(**SMALL, num_key_value_heads=1, head_dim=6),
])
def test_llama_shapes_from_the_config_are_the_models_own(cfg: LlamaConfig) -> None:
    model = LlamaForCausalLM(cfg)
    assert hf_keys.llama_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_key_maps_from_the_config_cover_the_model(tied: bool) -> None:
    cfg = GPTConfig(vocab_size=11, context_length=5, emb_dim=8, n_heads=2, n_layers=2, qkv_bias=True)
    model = GPT2Decoder(cfg)
    if tied:
        model.tie_weights()
    hf = hf_keys.gpt2_to_hf(model)
    assert {m.hf_name: m.shape for m in hf_keys.gpt2_key_maps(cfg, tied)} == {k: tuple(v.shape) for k, v in hf.items()}


def test_paths_from_metadata_stay_inside(tmp_path: Path) -> None:
    (tmp_path / "ok.safetensors").touch()
    assert inside(tmp_path, "ok.safetensors", what="entry") == (tmp_path / "ok.safetensors").resolve()
    assert inside(tmp_path, "sub/../ok.safetensors", what="entry").name == "ok.safetensors"
    for bad in ("../x", "/etc/passwd", ".", "a/../../x"):
        with pytest.raises(QkvError, match="outside the model folder"):
            inside(tmp_path, bad, what="entry")
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(QkvError, match="outside the model folder"):
        inside(tmp_path, "link/passwd", what="entry")
    for bad in (5, None, ["a"], "", "a\x00b"):
        with pytest.raises(QkvError, match="must be a file name"):
            inside(tmp_path, bad, what="entry")


def test_sizes_and_memory_refusal() -> None:
    assert parse_size("2GB") == 2 * 2**30 and parse_size("512 MiB") == 512 * 2**20 and parse_size("1000") == 1000
    for bad in ("lots", "-1GB", "1e400", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(QkvError, match="more than --max-memory"):
        require_memory(2 * 2**30, max_memory=2**30, what="m")
    with pytest.raises(QkvError, match="available"):  # no machine here has a petabyte
        require_memory(2**50, max_memory=None, what="m")
    require_memory(2**20, max_memory=None, what="m")


def test_the_address_space_limit_counts_as_available_memory() -> None:
    code = (
        "import os, resource; from qkv.models.hf.untrusted import available_memory;"
        "vm = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE');"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + 2**28, resource.RLIM_INFINITY));"
        "print(available_memory())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ}, check=True)
    assert int(out.stdout) <= 2**28


def test_an_unknown_name_is_refused_with_the_built_in_names(tmp_path: Path, monkeypatch) -> None:
    from qkv.models.loader import NAMED_MODELS, load_pretrained

    monkeypatch.chdir(tmp_path)  # "nosuchmodel" is no file or folder here
    with pytest.raises(QkvError) as refused:
        load_pretrained("nosuchmodel")
    message = str(refused.value)
    assert "nosuchmodel does not exist" in message and len(message.splitlines()) == 1
    assert NAMED_MODELS and all(name in message for name in NAMED_MODELS)
