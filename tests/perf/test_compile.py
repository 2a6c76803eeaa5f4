"""compile_decoder: the compiled model generates what the eager one does, one compiled
graph serves every cache length, and a compiler that fails leaves a working eager model."""

from __future__ import annotations

import warnings

import pytest
import torch

from qkv.generation import generate
from qkv.models.gpt2 import GPTConfig, GPTModel
from qkv.perf import compile_decoder


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
    # 19 decode steps over 19 cache lengths, one graph for all of them.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert model.compile_state.active and model.compile_state.calls == 19
    first = generate(model, PROMPT, 6)  # another cache capacity: at most one more graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
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
