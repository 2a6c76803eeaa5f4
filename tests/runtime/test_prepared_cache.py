"""The prepared-weights cache: the second load assigns what the first one prepared and gives
the same logits; a changed source file, a damaged entry or QKV_PREPARED_CACHE=0 prepare from
the source; the folder keeps the newest few; and the real SmolLM2 file round-trips exactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from qkv.models.hf.checkpoint import save_pretrained
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.runtime.native import native_kernels
from qkv.runtime import prepared_cache
from qkv.runtime.prepare import load_for_generation

pytestmark = pytest.mark.skipif(not native_kernels().available,
                                reason=f"qkv's kernels are not available here: {native_kernels().reason}")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(prepared_cache, "SMALLEST_SOURCE", 0)  # keep even a tiny model
    return tmp_path / "cache" / "prepared"


@pytest.fixture
def source(tmp_path: Path) -> Path:
    from tests.conftest import chat_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=296, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    folder = tmp_path / "model"
    save_pretrained(model, chat_tokenizer(), folder)
    return folder


IDS = torch.tensor([[5, 17, 42, 8, 99, 3]])


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_the_second_load_assigns_the_first_ones_weights(cache: Path, source: Path, precision: str) -> None:
    first, _, setup = load_for_generation(source, precision=precision)
    assert not setup.from_cache and len(list(cache.glob("*.safetensors"))) == 1
    second, _, again = load_for_generation(source, precision=precision)
    assert again.from_cache and again.precision == precision and again.layer_step is not None
    assert torch.equal(_logits(first), _logits(second))
    _, _, uncompiled = load_for_generation(source, precision=precision, compile=False)  # also from the cache
    state, kept = first.state_dict(), second.state_dict()
    assert state.keys() == kept.keys() and all(torch.equal(state[k], kept[k]) for k in state)
    assert uncompiled.from_cache and uncompiled.layer_step is None


def _change_weights(source: Path, step: int) -> None:
    """Rewrite the folder's weights with one value changed, same size, same modification time."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = next(source.glob("*.safetensors"))
    before = weights.stat()
    with safe_open(str(weights), "pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    tensors["model.norm.weight"][0] += step + 1
    save_file(tensors, weights, metadata=metadata)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size


def test_a_changed_source_or_precision_is_a_new_entry(cache: Path, source: Path) -> None:
    load_for_generation(source, precision="int8")
    weights = next(source.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    _, _, touched = load_for_generation(source, precision="int8")
    assert touched.from_cache  # the same bytes: the same entry, whatever the modification time
    _change_weights(source, 0)
    _, _, setup = load_for_generation(source, precision="int8")
    assert not setup.from_cache
    load_for_generation(source, precision="int4")
    assert len(list(cache.glob("*.safetensors"))) == 3


def test_a_damaged_entry_is_replaced(cache: Path, source: Path, capfd) -> None:
    first, _, _ = load_for_generation(source, precision="int8")
    entry = next(cache.glob("*.safetensors"))
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # cut short
    second, _, setup = load_for_generation(source, precision="int8")
    assert not setup.from_cache and torch.equal(_logits(first), _logits(second))
    assert "discarded" in capfd.readouterr().err
    third, _, setup = load_for_generation(source, precision="int8")
    assert setup.from_cache and torch.equal(_logits(first), _logits(third))


def test_an_entry_for_another_model_is_refused_and_replaced(cache: Path, source: Path, monkeypatch) -> None:
    load_for_generation(source, precision="int8")
    entry = next(cache.glob("*.safetensors"))
    from safetensors.torch import save_file

    save_file({"something.else": torch.zeros(3)}, entry)  # readable, but not this model's
    model, _, setup = load_for_generation(source, precision="int8")
    assert not setup.from_cache and _logits(model).shape == (1, 6, 296)


def test_turned_off_and_float_precisions_keep_nothing(cache: Path, source: Path, monkeypatch) -> None:
    load_for_generation(source, precision="float32")
    assert not cache.exists()
    monkeypatch.setenv("QKV_PREPARED_CACHE", "0")
    _, _, setup = load_for_generation(source, precision="int8")
    assert not setup.from_cache and not cache.exists()


def test_only_the_newest_entries_stay(cache: Path, source: Path, monkeypatch) -> None:
    monkeypatch.setattr(prepared_cache, "KEEP", 2)
    for step in range(4):  # each content is another source
        _change_weights(source, step)
        load_for_generation(source, precision="int8")
    assert len(list(cache.glob("*.safetensors"))) == 2 and not list(cache.glob("*.tmp"))


@pytest.mark.slow
def test_smollm2_from_the_cache_gives_the_prepared_logits(tmp_path: Path, monkeypatch) -> None:
    """At int8 SmolLM2 is prepared (its Q4_1 layers fitted to int8 rows) and kept; at its
    default int4 the file's blocks are its layers, with no cache (qkv.runtime.stored_four_bits)."""
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    first, tokenizer, setup = load_for_generation("smollm2", precision="int8")
    second, _, again = load_for_generation("smollm2", precision="int8")
    assert not setup.from_cache and again.from_cache and again.precision == "int8"
    _, _, default = load_for_generation("smollm2")
    assert default.precision == "int4" and not default.from_cache and not list(tmp_path.rglob("*int4*"))
    ids = torch.tensor([tokenizer.encode("The capital of France is").ids])
    with torch.inference_mode():
        assert torch.equal(first(ids), second(ids))


def test_a_cache_folder_that_cannot_be_written_only_loses_the_keeping(tmp_path: Path, source: Path,
                                                                      monkeypatch) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("QKV_CACHE_DIR", str(blocked))
    monkeypatch.setattr(prepared_cache, "SMALLEST_SOURCE", 0)
    model, _, setup = load_for_generation(source, precision="int8", compile=False)
    assert not setup.from_cache and _logits(model).shape == (1, 6, 296)
    assert blocked.read_text().startswith("a file")


def test_every_module_the_key_reads_exists() -> None:
    """The key hashes the source of the modules that decide the prepared tensors: a moved
    module must be named anew, not silently dropped (or every load fails)."""
    missing = [name for name in prepared_cache._CODE if not (prepared_cache._PACKAGE / name).exists()]
    assert missing == []
