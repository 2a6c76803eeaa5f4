"""compile_decoder: compiled decoding gives the eager tokens, one set of graphs serves every
length and every session, and where no compiler works the model stays eager and says why."""

from __future__ import annotations

import pytest
import torch

from qkv.generation import generate
from qkv.runtime import DecodeSession
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.runtime.compile import compile_decoder
from qkv.runtime import prepare_for_decoding
from qkv.runtime.compile import regions


def _pair(make=None) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    if make is None:
        cfg = GPTConfig(vocab_size=61, context_length=48, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
        make = lambda: GPT2Decoder(cfg)  # noqa: E731
    a, b = make().eval(), make().eval()
    b.load_state_dict(a.state_dict())
    return a, b


def _no_compiler(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """A backend that fails as Inductor does where no C compiler can be run."""
    raise RuntimeError("no working C compiler found")


PROMPT = torch.tensor([[5, 9, 2, 33, 7]])


def test_a_failing_compiler_leaves_the_model_eager_and_says_why() -> None:
    model, reference = _pair()
    report = compile_decoder(model, backend=_no_compiler)
    assert not report.compiled and "no working C compiler" in report.reason
    assert "no working C compiler" in report.describe()
    assert torch.equal(generate(model, PROMPT, 12), generate(reference, PROMPT, 12))


def test_regions_are_each_layer_and_the_output_head() -> None:
    model, _ = _pair()
    assert regions(model) == [*model.trf_blocks, model.out_head]


def test_one_set_of_graphs_for_every_length_and_session() -> None:
    torch._dynamo.reset()
    model, reference = _pair()
    report = compile_decoder(model, backend="eager")
    assert report.compiled and report.regions == 3
    torch._dynamo.utils.counters.clear()
    longer = generate(model, PROMPT, 20)
    # 19 decode steps at 19 lengths over 2 layers: one graph for the layers and at most one
    # for the output head (prompts run eagerly; PyTorch may leave its own nn.Linear to eager),
    # not one per token, per layer or per session.
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2
    shorter = generate(model, PROMPT, 6)  # a new session, a different length
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(shorter, generate(reference, PROMPT, 6))
    assert torch.equal(longer, generate(reference, PROMPT, 20))


def test_bad_input_still_raises_on_a_compiled_model() -> None:
    model, _ = _pair()
    compile_decoder(model, backend="eager")
    with DecodeSession(model, capacity=8) as session:
        assert session.capacity == 48  # rounded up: to the context length here
        session.prefill(PROMPT)
        with pytest.raises(Exception, match="exceed"):
            for _ in range(48):
                session.decode(torch.tensor([1]))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_inductor_compiled_tokens_equal_eager_tokens(precision: str) -> None:
    """The real compiler (Inductor, C++): the same greedy tokens as the same model eager,
    for a grouped-query Llama, in float32 and with int8 weights (the layers compiled as
    modules, as for cache kinds qkv's layer step do not take)."""
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model, reference = _pair(lambda: LlamaForCausalLM(cfg))
    eager = prepare_for_decoding(reference, precision=precision, compile=False)
    prepared = prepare_for_decoding(model, precision=precision, compile=False)
    report = compile_decoder(model)
    assert eager.compile is None and prepared.layer_step is None
    if not report.compiled:
        pytest.fail(f"Inductor does not work on this machine: {report.reason}")
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35]])
    assert torch.equal(generate(model, prompt, 24), generate(reference, prompt, 24))


@pytest.mark.parametrize("kind_name", ["int4", "sink"])
def test_key_aware_caches_compile_to_one_set_of_graphs(kind_name: str) -> None:
    """A quantized cache's decode step (groups quantized through torch.where) and a sink
    cache's (keys rotated by their slot) compile without graph breaks: one set of graphs
    over lengths that fill groups and wrap the window, giving the eager tokens."""
    from qkv.generation.cache_kinds import cache_kind

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model, reference = _pair(lambda: LlamaForCausalLM(cfg))
    kind = cache_kind(kind_name, residual=8, group_size=8, sinks=2, window=16)
    torch._dynamo.reset()
    assert compile_decoder(model, backend="eager").compiled
    torch._dynamo.utils.counters.clear()
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35]])
    compiled = generate(model, prompt, 60, kv_cache=kind)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2 and not torch._dynamo.utils.counters["graph_break"]
    assert torch.equal(generate(model, prompt, 30, kv_cache=kind), compiled[:, :36])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(compiled, generate(reference, prompt, 60, kv_cache=kind))


@pytest.mark.slow
def test_inductor_fuses_the_quantized_cache_and_gives_the_eager_tokens() -> None:
    """Inductor compiles the int4 cache's decode step (the cache's write in the graph, its
    attention one call of qkv's quantized kernel): the same greedy tokens as eager, past
    several quantized groups.
    The model prepared with compile=True has qkv's layer step, which hand this cache kind
    to Inductor's regions when the first session opens."""
    from qkv.generation.cache_kinds import cache_kind

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model, reference = _pair(lambda: LlamaForCausalLM(cfg))
    setup = prepare_for_decoding(model, precision="float32", compile=True)
    prepare_for_decoding(reference, precision="float32", compile=False)
    if not setup.compiled:
        pytest.fail(f"Inductor does not work on this machine: {setup.compile.reason}")
    kind = cache_kind("int4", residual=8, group_size=8, sinks=2)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35]])
    assert torch.equal(generate(model, prompt, 48, kv_cache=kind, setup=setup),
                       generate(reference, prompt, 48, kv_cache=kind))
    assert setup.layer_step is not None and setup.layer_step.fallback.compiled


def test_a_working_inductor_is_probed_once_per_machine(tmp_path, monkeypatch) -> None:
    """The first process probes and leaves a marker; the next one trusts it and skips the probe.
    A failing backend is never remembered."""
    from qkv.runtime import compile as compiling

    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    calls: list[object] = []

    def counted(backend):
        calls.append(backend)
        return None if backend == "inductor" else "no compiler"

    monkeypatch.setattr(compiling, "_probe", counted)
    marker = compiling._probe_marker()
    if marker is None:
        pytest.skip("no C++ compiler on PATH to key the marker on")
    assert compiling.probe_once("inductor") is None and calls == ["inductor"]
    assert marker.is_file() and marker.parent.parent == tmp_path
    assert compiling.probe_once("inductor") is None and calls == ["inductor"]  # skipped the second time
    assert compiling.probe_once("eager") == "no compiler" and compiling.probe_once("eager") == "no compiler"
    assert calls == ["inductor", "eager", "eager"]  # other backends are probed every time
