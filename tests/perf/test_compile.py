"""compile_decoder: the compiled model generates what the eager one does, one compiled
graph serves every cache length, and a compiler that fails leaves a working eager model."""

from __future__ import annotations

import warnings

import pytest
import torch

from qkv.generation import generate
from qkv.models.gpt2 import GPTConfig, GPTModel
from qkv.models.llama import LlamaForCausalLM
from qkv.models.llama_config import LlamaConfig
from qkv.perf import DecodeLinear, compile_decoder
from qkv.perf.compile import cache_capacity


def _pair() -> tuple[GPTModel, GPTModel]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=61, context_length=48, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
    a, b = GPTModel(cfg).eval(), GPTModel(cfg).eval()
    b.load_state_dict(a.state_dict())
    return a, b


def _no_compiler(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """A backend that fails as Inductor does where no C compiler can be run."""
    raise RuntimeError("no working C compiler found")


PROMPT = torch.tensor([[5, 9, 2, 33, 7]])


def test_failing_compiler_falls_back_once_with_identical_outputs() -> None:
    torch._dynamo.reset()
    model, reference = _pair()
    compile_decoder(model, backend=_no_compiler)
    with pytest.warns(RuntimeWarning, match="running eagerly instead"):
        tokens = generate(model, PROMPT, 12)
    assert not model.compile_state.active and "no working C compiler" in model.compile_state.error
    assert torch.equal(tokens, generate(reference, PROMPT, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        with torch.inference_mode():  # the same values; the weights' layout changes rounding only
            torch.testing.assert_close(model(PROMPT), reference(PROMPT), rtol=1e-5, atol=1e-5)


def test_compiled_decoder_matches_eager_without_a_graph_per_token() -> None:
    torch._dynamo.reset()
    model, reference = _pair()
    compile_decoder(model, backend="eager")
    torch._dynamo.utils.counters.clear()
    longer = generate(model, PROMPT, 20)
    # 19 decode steps over 19 cache lengths and 2 layers: one graph for the layers, one
    # for the output head, not one per token or per layer.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert model.compile_state.active and model.compile_state.calls == 19
    first = generate(model, PROMPT, 6)  # a shorter generation: the same rounded capacity
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert torch.equal(first, generate(reference, PROMPT, 6))
    assert torch.equal(longer, generate(reference, PROMPT, 20))
    with torch.inference_mode():
        torch.testing.assert_close(model(PROMPT), reference(PROMPT), rtol=1e-5, atol=1e-5)


def test_bad_input_still_raises_and_keeps_the_compiled_path() -> None:
    torch._dynamo.reset()
    model, _ = _pair()
    compile_decoder(model, backend="eager")
    with pytest.raises(ValueError, match="exceed"):
        with torch.inference_mode():
            model(torch.zeros(1, 60, dtype=torch.long))
    assert model.compile_state.active


def test_cache_capacity_rounds_up_within_the_context() -> None:
    assert cache_capacity(5, 48) == 48  # capped at the context length
    assert cache_capacity(100, 4096) == 2048  # one capacity for every short generation
    assert cache_capacity(2049, 8192) == 4096
    assert cache_capacity(8192, 8192) == 8192
    for tokens in range(1, 5000, 97):
        assert tokens <= cache_capacity(tokens, 8192) <= 8192


def _tiny_llama(**overrides) -> LlamaForCausalLM:
    cfg = LlamaConfig(**{
        "vocab_size": 83, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 64, **overrides,
    })
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama-gqa", "qwen3-qk-norm-bf16"])
def test_inductor_compiled_decoding_matches_eager(family: str) -> None:
    """The real compiler (Inductor, C++): row-major multiply-and-reduce linears and
    single-query attention produce the eager model's tokens and logits, one graph for
    generations of different lengths."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    dtype = torch.bfloat16 if family.endswith("bf16") else torch.float32
    if family == "gpt2":
        model, reference = _pair()
    else:
        extra = {"qk_norm": True, "head_dim": 12} if family.startswith("qwen3") else {}
        model = _tiny_llama(**extra)
        reference = _tiny_llama(**extra)
        reference.load_state_dict(model.state_dict())
    model, reference = model.to(dtype), reference.to(dtype)
    compile_decoder(model)
    assert all(type(m) is DecodeLinear for m in model.modules() if isinstance(m, torch.nn.Linear))
    torch._dynamo.utils.counters.clear()
    tokens, short = generate(model, PROMPT, 24), generate(model, PROMPT, 9)
    assert model.compile_state.active, model.compile_state.error
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the layers' and the head's
    if dtype == torch.float32:  # bfloat16 rounds differently (float32 accumulation): near-ties may flip
        assert torch.equal(tokens, generate(reference, PROMPT, 24))
        assert torch.equal(short, generate(reference, PROMPT, 9))
    # Step by step: the logits of every decode step agree with eager ones.
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for m in (model, reference):
        m.setup_cache(1, 16)
    with torch.inference_mode():
        ours, theirs = model(PROMPT), reference(PROMPT)
        for token in (3, 17, 41, 8):
            step = torch.tensor([[token]])
            torch.testing.assert_close(model(step).float(), reference(step).float(), **tol)
    model.remove_cache()
    reference.remove_cache()
    torch.testing.assert_close(ours.float(), theirs.float(), **tol)


def test_whole_model_compilation_is_one_graph_with_the_same_tokens() -> None:
    torch._dynamo.reset()
    model, reference = _pair()
    compile_decoder(model, backend="eager", whole_model=True)
    torch._dynamo.utils.counters.clear()
    assert torch.equal(generate(model, PROMPT, 15), generate(reference, PROMPT, 15))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert model.compile_state.calls == 14
