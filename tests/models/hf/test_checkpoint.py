"""Hugging Face folders in and out: GPT-2 parity with transformers, round trips, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qkv
from qkv.errors import QkvError
from qkv.models.hf.checkpoint import build_from_hf, save_pretrained
from qkv.models.loader import load_pretrained
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM


VOCAB = 288  # the tiny checkpoints' vocabulary (conftest.py)


def ids(batch: int = 2, tokens: int = 17, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_logits_match_transformers(shared_checkpoint, tied: bool) -> None:
    folder, reference = shared_checkpoint("gpt2", tie_word_embeddings=tied)
    model, tokenizer = qkv.load_pretrained(folder)
    assert isinstance(model, GPT2Decoder) and model.weights_tied == tied
    assert tokenizer.decode(tokenizer.encode("Your journey").ids) == "Your journey"
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x).logits, rtol=0, atol=1e-4)


def test_gpt2_folder_without_transformer_prefix(tiny_checkpoint, tmp_path: Path) -> None:
    """GPT2Model checkpoints (like the original gpt2 upload) name keys h.0..., wte, ..."""
    folder, reference = tiny_checkpoint("gpt2")
    tensors = load_file(folder / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, folder / "model.safetensors")
    model, _ = load_pretrained(folder)
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), reference(ids()).logits, rtol=0, atol=1e-4)


def test_book_model_saves_a_folder_transformers_loads(tmp_path: Path, tokenizer, hf_class) -> None:
    """The book's GPT (untied head, no q/k/v bias) as training leaves it."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, context_length=32, emb_dim=64, n_heads=4, n_layers=2, qkv_bias=False)
    model = GPT2Decoder(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    save_pretrained(model, tokenizer, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    reference = hf_class("gpt2").from_pretrained(tmp_path / "out").eval()
    loaded, _ = load_pretrained(tmp_path / "out")
    assert loaded.cfg == cfg and not loaded.weights_tied
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(reference(x).logits, model(x), rtol=0, atol=1e-4)
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_llama_family_round_trip_loads_in_transformers(shared_checkpoint, hf_class, tmp_path: Path, kind: str) -> None:
    folder, reference = shared_checkpoint(kind)
    model, tokenizer = load_pretrained(folder)
    save_pretrained(model, tokenizer, tmp_path / "again")
    again = hf_class(kind).from_pretrained(tmp_path / "again").eval()
    reloaded, _ = load_pretrained(tmp_path / "again")
    assert isinstance(reloaded, LlamaForCausalLM) and reloaded.cfg == model.cfg
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, reference(x).logits, rtol=0, atol=0)
        torch.testing.assert_close(reloaded(x), model(x), rtol=0, atol=0)


def test_sharded_checkpoint(tiny_checkpoint) -> None:
    folder, reference = tiny_checkpoint("llama")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = load_pretrained(folder)
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), reference(ids()).logits, rtol=0, atol=1e-4)


def test_bfloat16_load(tiny_checkpoint) -> None:
    folder, _ = tiny_checkpoint("qwen3")
    model, _ = load_pretrained(folder, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(ids()).dtype == torch.bfloat16


def test_build_from_hf_takes_a_config_dict_and_tensors(shared_checkpoint) -> None:
    folder, reference = shared_checkpoint("llama")
    config = json.loads((folder / "config.json").read_text())
    model = build_from_hf(config, load_file(folder / "model.safetensors"), torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), reference(ids()).logits, rtol=0, atol=1e-4)


# ---- bad input: one QkvError that names the problem -------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(QkvError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")


def test_unknown_architecture(tiny_checkpoint) -> None:
    folder, _ = tiny_checkpoint("gpt2")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QkvError, match="unknown architecture.*MambaForCausalLM"):
        load_pretrained(folder)


def test_missing_key(tiny_checkpoint) -> None:
    folder, _ = tiny_checkpoint("llama")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QkvError, match=r"missing weight\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(folder)


def test_unexpected_key(tiny_checkpoint) -> None:
    folder, _ = tiny_checkpoint("gpt2")
    tensors = load_file(folder / "model.safetensors")
    tensors["transformer.h.0.attn.extra.weight"] = torch.zeros(3)
    tensors["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)  # a known buffer: skipped
    save_file(tensors, folder / "model.safetensors")
    # masked_bias is skipped: the message lists extra.weight alone
    with pytest.raises(QkvError, match=r"unexpected weight\(s\) transformer\.h\.0\.attn\.extra\.weight;"):
        load_pretrained(folder)


def test_wrong_shape(tiny_checkpoint) -> None:
    folder, _ = tiny_checkpoint("qwen2")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(7)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QkvError, match=r"k_proj\.bias has shape \(7,\), expected \(32,\)"):
        load_pretrained(folder)


def test_truncated_safetensors(tiny_checkpoint) -> None:
    folder, _ = tiny_checkpoint("gpt2")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(QkvError, match=r"model\.safetensors is truncated or corrupt"):
        load_pretrained(folder)


def test_broken_config_and_missing_tokenizer(tiny_checkpoint) -> None:
    folder, _ = tiny_checkpoint("qwen3")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(QkvError, match="has no tokenizer.json"):
        load_pretrained(folder)
    (folder / "config.json").write_text('{"model_type": "qwen3",')
    with pytest.raises(QkvError, match=r"cannot read .*config\.json"):
        load_pretrained(folder)


def test_pickle_only_folder_is_refused(tiny_checkpoint) -> None:
    folder, _ = tiny_checkpoint("gpt2")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(QkvError, match="never loads pickle"):
        load_pretrained(folder)


def test_save_keeps_old_files_when_it_fails(tmp_path: Path, tokenizer) -> None:
    """A failed save leaves the previous folder as it was (files are replaced atomically)."""
    model = GPT2Decoder(GPTConfig(vocab_size=VOCAB, context_length=16, emb_dim=32, n_heads=2, n_layers=1))
    save_pretrained(model, tokenizer, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    class BrokenTokenizer:
        def save(self, path: str) -> None:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, BrokenTokenizer(), tmp_path)  # type: ignore[arg-type]
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after.keys() == before.keys()
    assert after["config.json"] == before["config.json"] and after["tokenizer.json"] == before["tokenizer.json"]


# ---- building without random init, weights assigned --------------------------------------


def old_way(config: dict, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """What ModelPlan.build did before: a randomly initialised model, weights copied in."""
    from qkv.models.hf.checkpoint import FAMILIES

    family = FAMILIES[config["model_type"]]
    model = family.build(family.parse(config))
    model.load_state_dict(tensors, strict=True)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_built_model_gives_the_logits_of_a_copied_one(shared_checkpoint, kind: str) -> None:
    folder, _ = shared_checkpoint(kind)
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    if config.get("tie_word_embeddings"):
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    model = build_from_hf(config, dict(tensors), torch.float32)
    with torch.no_grad():
        assert torch.equal(model(ids()), old_way(config, tensors)(ids()))
    assert all(not t.is_meta for t in [*model.parameters(), *model.buffers()])
    if config.get("tie_word_embeddings"):
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_build_copies_what_it_is_given_unless_handed_over(shared_checkpoint) -> None:
    from qkv.models.hf.checkpoint import plan_model

    folder, _ = shared_checkpoint("llama")
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    plan = plan_model(config, {k: tuple(v.shape) for k, v in tensors.items()}, source="test")
    name = "model.layers.0.mlp.up_proj.weight"
    copied = plan.build(dict(tensors))
    assert copied.state_dict()[name].data_ptr() != tensors[name].data_ptr()
    taken = plan.build(dict(tensors), owned=True)
    assert taken.state_dict()[name].data_ptr() == tensors[name].data_ptr()
    assert all(p.requires_grad for p in taken.parameters())


def test_bad_values_are_named_in_views_of_one_tensor() -> None:
    from qkv.models.hf.checkpoint import _tilings, check_tensors

    flat = torch.randn(30)
    views = {"a": flat[:10].view(2, 5), "b": flat[10:25], "c": flat[25:]}
    assert _tilings(views) == [["a", "b", "c"]]
    check_tensors(views, "x")
    for bad in (float("nan"), float("inf"), -float("inf")):
        flat[12] = bad
        with pytest.raises(QkvError, match="weight b holds NaN or infinite"):
            check_tensors(views, "x")
        flat[12] = 0.0
    partial = {"a": flat[:10], "c": flat[25:]}  # a gap: each is checked alone
    assert sorted(_tilings(partial)) == [["a"], ["c"]]
    flat[15] = float("nan")  # in the gap, in no tensor given
    check_tensors(partial, "x")
