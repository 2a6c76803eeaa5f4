"""qkv's whole-layer decode step (`qkv.runtime.layer_step`) against the same model running its
layers as PyTorch modules: Llama with grouped heads, Qwen2's biases, Qwen3's q/k norms and
GPT-2's LayerNorm, GELU and biases, in float32, int8 and int4, one row or ragged rows.
Kinds of cache the fused calls cannot write run the modules (and compile them, once)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.generation import generate
from qkv.runtime import DecodeSession, DecodeSetup
from qkv.generation.cache_kinds import cache_kind
from qkv.models.gpt2 import GPT2Decoder
from qkv.models.configs.gpt2 import GPTConfig
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.models.configs.qwen import Qwen2Config, Qwen3Config
from qkv.runtime.native import native_kernels
from qkv.runtime.layer_step import NativeLayerStep
from qkv.runtime import prepare as prepare_module
from qkv.runtime.prepare import prepare_for_decoding

pytestmark = pytest.mark.skipif(not native_kernels().available,
                                reason=f"qkv's kernels are not available here: {native_kernels().reason}")

FAMILIES = ("llama", "qwen2", "qwen3", "gpt2")


def _model(family: str, heads: int, kv_heads: int, head_dim: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "gpt2":
        model = GPT2Decoder(GPTConfig(vocab_size=101, context_length=64, emb_dim=heads * head_dim, n_heads=heads,
                                   n_layers=2, drop_rate=0.0, qkv_bias=True))
    else:
        config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
        model = LlamaForCausalLM(config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                        max_position_embeddings=64, rms_norm_eps=1e-5))
    with torch.no_grad():  # every weight and norm away from its initial value, biases included
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def _pair(family: str, precision: str, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, seed: int = 0):
    fused = _model(family, heads, kv_heads, head_dim, seed)
    modules = copy.deepcopy(fused)
    setup = prepare_for_decoding(fused, precision=precision, compile=True)
    assert prepare_for_decoding(modules, precision=precision, compile=False).layer_step is None
    assert setup.layer_step is not None
    return fused, modules, setup


def _steps(model, prompts: torch.Tensor, lengths: list[int], steps: int,
           chosen: list[torch.Tensor] | None = None, setup: DecodeSetup | None = None) -> list[torch.Tensor]:
    """Logits of a prefill then `steps` greedy decode steps, each row at its own length. With
    `chosen` (another run's logits), each step takes that run's greedy tokens, so a near-tie
    that int4's rounding flips does not send the two runs down different sequences."""
    out = []
    with DecodeSession(model, batch_size=prompts.shape[0], capacity=64, setup=setup) as session:
        logits = session.prefill(prompts, lengths=lengths)
        for step in range(steps):
            out.append(logits)
            logits = session.decode((logits if chosen is None else chosen[step]).argmax(-1))
    return out


def _tolerance(precision: str, reference: torch.Tensor) -> float:
    # int4 rounds activations to int8 per block: a float-rounding difference in a norm can move
    # one activation by a step (1/127 of its block's largest), so its bound is looser
    return (2e-2 if precision == "int4" else 1e-4) * (1.0 + float(reference.abs().max()))


@settings(max_examples=12, deadline=None)
@given(family=st.sampled_from(FAMILIES), precision=st.sampled_from(["float32", "int8", "int4"]),
       shape=st.sampled_from([(4, 2, 16), (4, 4, 16), (2, 1, 32), (8, 2, 8)]), ragged=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fused_steps_give_the_module_logits(family, precision, shape, ragged, seed) -> None:
    heads, kv_heads, head_dim = shape
    if family == "gpt2":
        kv_heads = heads  # GPT-2 is multi-head
    if precision == "int4" and (heads * head_dim) % 32:
        precision = "int8"  # int4 blocks need inputs in 32s
    fused, modules, setup = _pair(family, precision, heads, kv_heads, head_dim, seed)
    prompts = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(seed))
    lengths = [7, 4] if ragged else [7, 7]
    with torch.inference_mode():
        expected = _steps(modules, prompts, lengths, 6)
        got = _steps(fused, prompts, lengths, 6, chosen=expected, setup=setup)
    for want, have in zip(expected, got):
        assert torch.allclose(have, want, rtol=0, atol=_tolerance(precision, want))


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_float32_greedy_tokens_equal_the_modules(family: str) -> None:
    fused, modules, setup = _pair(family, "float32")
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35]])
    assert torch.equal(generate(fused, prompt, 40, setup=setup), generate(modules, prompt, 40))


def test_the_fused_calls_write_the_cache_as_the_layers_do() -> None:
    fused, modules, setup = _pair("qwen3", "float32")
    prompt = torch.tensor([[5, 6, 7, 8]])
    caches = []
    for model, how in ((fused, setup), (modules, None)):
        with torch.inference_mode(), DecodeSession(model, capacity=64, setup=how) as session:
            token = session.prefill(prompt).argmax(-1)
            for _ in range(3):
                token = session.decode(token).argmax(-1)
            caches.append([(c.contents(), c.length) for c in session.caches])
    for ((k1, v1), n1), ((k2, v2), n2) in zip(*caches):
        assert n1 == n2 == 7
        assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)


@pytest.mark.parametrize("kind_name", ["int4", "sink"])
def test_other_cache_kinds_run_the_modules_and_compile_them_once(kind_name: str) -> None:
    """A quantized or sink cache has no fused buffers: the model runs its layers (the same
    tokens as the unprepared path) and `on_modules` is called once, for the first session."""
    model = _model("llama", 4, 2, 16, seed=1)
    reference = copy.deepcopy(model)
    prepare_for_decoding(reference, precision="float32", compile=False)
    calls = []
    setup = prepare_for_decoding(model, precision="float32", compile=False)
    setup = dataclasses.replace(  # the native layers, with a probe for Inductor's fallback
        setup, layer_step=NativeLayerStep.for_model(model, on_modules=lambda: calls.append(1)))
    kind = cache_kind(kind_name, residual=8, group_size=8, sinks=2, window=16)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35]])
    assert torch.equal(generate(model, prompt, 24, kv_cache=kind, setup=setup),
                       generate(reference, prompt, 24, kv_cache=kind))
    generate(model, prompt, 4, kv_cache=kind, setup=setup)
    assert calls == [1]
    assert torch.equal(generate(model, prompt, 24, setup=setup), generate(reference, prompt, 24))  # static again: fused


def test_calls_with_gradients_masks_or_other_dtypes_run_the_modules() -> None:
    fused, _, setup = _pair("llama", "float32")
    x = torch.zeros(1, 1, 64)
    with DecodeSession(fused, capacity=64, setup=setup) as session:
        layers = session._native
        assert layers is not None and session.runs_native
        with torch.inference_mode():
            assert layers.takes(x, torch.tensor([0]), None)
            assert not layers.takes(torch.zeros(1, 3, 64), torch.arange(3), None)  # a prompt: `prompt` runs it
            assert layers.takes_prompts()
            assert not layers.takes(x, torch.tensor([0]), torch.ones(1, 1, 1, 64, dtype=torch.bool))
            assert not layers.takes(x.bfloat16(), torch.tensor([0]), None)
        assert not layers.takes(x, torch.tensor([0]), None) and not layers.takes_prompts()  # gradients on


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_piece_is_one_native_call_giving_the_module_logits_and_caches(family: str) -> None:
    """A prompt through the native layers (its tokens as rows of one cache row, stack.cpp): one
    `qkv::stack_step` a piece and no PyTorch attention, giving the modules' logits (the last
    token's, and every position's after a kept prefix) and the modules' keys and values. Its
    rows are computed alone, so the prompt prefilled whole and in two pieces agree bit for bit."""
    from qkv.attention.caches.kv_cache import SlotKVCache

    fused, modules, setup = _pair(family, "float32")
    prompt = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79, 32, 38])
    runs = []
    for model, how in ((fused, setup), (modules, None)):
        with torch.inference_mode(), DecodeSession(model, batch_size=3, capacity=64, kind=SlotKVCache,
                                                   setup=how) as session:
            with torch.profiler.profile() as profile:
                last = session.prefill_row(2, prompt)  # (V,)
                session.prefill_row(0, prompt[:4])
                every = session.prefill_row_all(0, prompt[4:], start=4)  # (6, V), positions 4..9
            ops = {event.name for event in profile.events()}
            caches = [(c.k_cache[[0, 2], :, :10].clone(), c.v_cache[[0, 2], :, :10].clone()) for c in session.caches]
        runs.append((last, every, caches, ops))
    (last, every, caches, ops), (want_last, want_every, want_caches, module_ops) = runs
    assert "qkv::stack_step" in ops and not any("scaled_dot_product" in op for op in ops)
    assert "qkv::stack_step" not in module_ops
    torch.testing.assert_close(last, want_last, rtol=0, atol=_tolerance("float32", want_last))
    torch.testing.assert_close(every, want_every, rtol=0, atol=_tolerance("float32", want_every))
    for (keys, values), (want_keys, want_values) in zip(caches, want_caches):
        torch.testing.assert_close(keys, want_keys, rtol=0, atol=1e-4)
        torch.testing.assert_close(values, want_values, rtol=0, atol=1e-4)
        assert torch.equal(keys[0], keys[1]) and torch.equal(values[0], values[1])  # two pieces = whole
    assert torch.equal(every[-1], last)


@pytest.mark.parametrize("precision", ["float32", "int8", "int4"])
def test_a_native_prompt_is_its_tokens_decoded_one_at_a_time_bit_for_bit(precision: str) -> None:
    """The native prompt path is the decode step's math, not an approximation of it: a prompt
    prefilled natively gives, at every position, the logits, keys and values that native decode
    steps give fed its tokens one at a time, bit for bit; several rows' prompts in one call
    (`prefill_rows`) give what each gives alone. Against the modules, the bound is int4's
    rounding (`_tolerance`; qkv.runtime.layer_step's docstring), as for the decode steps."""
    from qkv.attention.caches.kv_cache import SlotKVCache

    fused, modules, setup = _pair("llama", precision)
    prompt = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19])
    t = prompt.shape[0]
    with torch.inference_mode(), DecodeSession(fused, batch_size=4, capacity=64, kind=SlotKVCache,
                                               setup=setup) as session:
        every = session.prefill_row_all(0, prompt)  # (T, V): row t scores the token after prompt[t]
        session.prefill_row(1, prompt[:1])
        steps = torch.stack([session.decode(token[None], rows=[1])[0] for token in prompt[1:]])  # (T - 1, V)
        with torch.profiler.profile() as profile:
            together = session.prefill_rows([(2, prompt, 0), (3, prompt[:7], 0)])
        assert [event.name for event in profile.events()].count("qkv::stack_step") == 1  # both rows in one call
        caches = [(c.k_cache[:, :, :t].clone(), c.v_cache[:, :, :t].clone()) for c in session.caches]
    assert torch.equal(every[1:], steps)
    assert torch.equal(together[0], every[-1]) and torch.equal(together[1], every[6])
    for keys, values in caches:
        assert torch.equal(keys[0], keys[1]) and torch.equal(values[0], values[1])  # prefilled = decoded
        assert torch.equal(keys[0], keys[2]) and torch.equal(values[0], values[2])  # with another row = alone
        assert torch.equal(keys[0, :, :7], keys[3, :, :7])
    with torch.inference_mode(), DecodeSession(modules, capacity=64, kind=SlotKVCache) as session:
        want = session.prefill_row_all(0, prompt)  # (T, V)
    torch.testing.assert_close(every, want, rtol=0, atol=_tolerance(precision, want))


def test_a_native_prompt_on_two_threads_is_its_tokens_decoded_one_at_a_time_bit_for_bit() -> None:
    """A prompt of 40 tokens splits its norms, activations, shortcuts and attention over two
    threads (attention taking rows from both ends of the prompt); each row's numbers are still
    its own: the same logits, keys and values as decode steps fed its tokens one at a time."""
    from qkv.attention.caches.kv_cache import SlotKVCache

    fused, _, setup = _pair("llama", "int8")
    prompt = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.inference_mode(), DecodeSession(fused, batch_size=2, capacity=64, kind=SlotKVCache,
                                                   setup=setup) as session:
            every = session.prefill_row_all(0, prompt)  # (T, V)
            session.prefill_row(1, prompt[:1])
            steps = torch.stack([session.decode(token[None], rows=[1])[0] for token in prompt[1:]])  # (T - 1, V)
            caches = [(c.k_cache[:, :, :40].clone(), c.v_cache[:, :, :40].clone()) for c in session.caches]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(every[1:], steps)
    for keys, values in caches:
        assert torch.equal(keys[0], keys[1]) and torch.equal(values[0], values[1])


@pytest.mark.parametrize("precision", ["float32", "int4"])
def test_a_decode_step_with_prompt_pieces_beside_is_one_call_giving_each_calls_numbers(precision: str) -> None:
    """`decode_with_pieces`: a step of some rows and other rows' prompt pieces in one native call
    (a server's chunked prefill beside its streams) gives, bit for bit, the decode step's logits
    and each piece's last logits that the two calls give apart, and leaves the same caches."""
    from qkv.attention.caches.kv_cache import SlotKVCache

    fused, _, setup = _pair("llama", precision)
    prompt = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28])
    runs = []
    for together in (True, False):
        with torch.inference_mode(), DecodeSession(fused, batch_size=4, capacity=64, kind=SlotKVCache,
                                                   setup=setup) as session:
            session.prefill_row(0, prompt[:5])
            session.prefill_row(1, prompt[:9])
            session.prefill_row(2, prompt[:4])
            tokens, rows, pieces = torch.tensor([7, 11]), [0, 1], [(2, prompt[4:12], 4), (3, prompt[:6], 0)]
            with torch.profiler.profile() as profile:
                if together:
                    logits, lasts = session.decode_with_pieces(tokens, rows, pieces)
                else:
                    logits, lasts = session.decode(tokens, rows=rows), session.prefill_rows(pieces)
            calls = [event.name for event in profile.events()].count("qkv::stack_step")
            after = session.decode(torch.tensor([5, 6, 7, 8]), rows=[0, 1, 2, 3])  # every row goes on
            caches = [(c.k_cache[:, :, :13].clone(), c.v_cache[:, :, :13].clone()) for c in session.caches]
            assert session.lengths == [7, 11, 13, 7]
        runs.append((calls, logits, torch.stack(lasts), after, caches))
    (calls, logits, lasts, after, caches), (apart_calls, *apart) = runs
    assert calls == 1 and apart_calls == 2
    assert torch.equal(logits, apart[0]) and torch.equal(lasts, apart[1]) and torch.equal(after, apart[2])
    for (k, v), (want_k, want_v) in zip(caches, apart[3]):
        assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_models_the_kernels_cannot_run_whole_are_not_fused() -> None:
    model = _model("llama", 4, 2, 16, seed=2)
    prepare_for_decoding(model, precision="bfloat16", compile=False)
    assert NativeLayerStep.for_model(model) is None  # bfloat16 activations: the modules (and Inductor)
    unfused = _model("llama", 4, 2, 16, seed=2)  # gate and up not stacked: no layer parts
    assert unfused.layer_parts() is None and NativeLayerStep.for_model(unfused) is None


def test_a_position_outside_the_cache_is_refused_in_one_line() -> None:
    fused, _, setup = _pair("llama", "int8")
    with torch.inference_mode(), DecodeSession(fused, capacity=64, setup=setup) as session:
        with pytest.raises(RuntimeError, match="a position lies outside the KV cache"):
            session._native(torch.zeros(1, 1, 64), torch.tensor([64]))


def test_a_forward_hook_sees_every_step() -> None:
    """A hook (a trace) on the model when a session starts: that session runs the modules, so
    the hook sees every step; a session asked for step="modules" does so too."""
    fused, _, setup = _pair("llama", "float32")
    seen = []
    handle = fused.model.layers[1].self_attn.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    try:
        generate(fused, torch.tensor([[3, 14, 15]]), 5, setup=setup)
    finally:
        handle.remove()
    assert len(seen) == 5  # the prompt, then four decode steps (the fifth token needs no step)
    with torch.inference_mode(), DecodeSession(fused, capacity=64, setup=setup) as session:
        assert session.runs_native  # no hook now
    with torch.inference_mode(), DecodeSession(fused, capacity=64, step="modules", setup=setup) as session:
        assert not session.runs_native
        token = session.prefill(torch.tensor([[3, 14, 15]])).argmax(-1)
        handle = fused.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.append(0))
        try:
            session.decode(token)
        finally:
            handle.remove()
        assert seen[-1] == 0


def test_two_sessions_on_one_model_keep_their_own_caches_and_native_layers() -> None:
    """Sessions are independent: one opened and closed inside another (an explorer trace
    beside a server's slots) neither changes the other's numbers nor unbinds its layers."""
    fused, _, setup = _pair("llama", "float32")
    prompt = torch.tensor([[3, 14, 15, 92]])
    with torch.inference_mode(), DecodeSession(fused, capacity=64, setup=setup) as alone:
        expected = [alone.prefill(prompt)]
        for _ in range(4):
            expected.append(alone.decode(expected[-1].argmax(-1)))
    with torch.inference_mode(), DecodeSession(fused, capacity=64, setup=setup) as outer:
        got = [outer.prefill(prompt)]
        for _ in range(4):
            with DecodeSession(fused, capacity=64, step="modules", setup=setup) as inner:  # a trace in between
                inner.prefill(torch.tensor([[7, 7, 7]]))
            assert outer.runs_native
            got.append(outer.decode(got[-1].argmax(-1)))
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


FALLBACK = """
import json, torch
from qkv.generation import generate
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.runtime.prepare import prepare_for_decoding
cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
model, reference = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
reference.load_state_dict(model.state_dict())
setup = prepare_for_decoding(model, precision="int8")
prepare_for_decoding(reference, precision="int8", compile=False)
prompt = torch.tensor([[3, 14, 15, 92]])
print(json.dumps({"fused": setup.layer_step is not None, "kernels": setup.kernels.reason,
                  "same": torch.equal(generate(model, prompt, 12, setup=setup), generate(reference, prompt, 12))}))
"""


def test_without_a_compiler_for_the_kernels_decoding_falls_back_to_the_modules(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "QKV_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["fused"] is False and "compiler" in result["kernels"] and result["same"] is True


def test_slot_rows_decode_through_the_fused_calls_as_through_the_modules() -> None:
    """A server's continuous batch (SlotKVCache): prompts in some slots, then steps on some
    rows only; the fused calls write and read the slots they are given, as the modules do."""
    from qkv.attention.caches.kv_cache import SlotKVCache

    fused, modules, setup = _pair("qwen2", "int8")
    prompts = {1: torch.tensor([3, 14, 15, 92]), 3: torch.tensor([65, 35]), 0: torch.tensor([8, 9, 7])}
    out = []
    for model, how in ((fused, setup), (modules, None)):
        steps = []
        with torch.inference_mode(), DecodeSession(model, batch_size=4, capacity=64, kind=SlotKVCache,
                                                   setup=how) as session:
            last = {row: session.prefill_row(row, ids).argmax(-1) for row, ids in prompts.items()}
            for rows in ([1, 3], [3], [0, 1, 3], [1, 0]):
                logits = session.decode(torch.stack([last[r] for r in rows]), rows=rows)  # (b, V)
                steps.append(logits)
                last.update({r: logits[i].argmax(-1) for i, r in enumerate(rows)})
        out.append(steps)
    for have, want in zip(*out):
        assert torch.allclose(have, want, atol=_tolerance("int8", want), rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_description_says_what_its_modules_are(family: str) -> None:
    """Every family describes its own layers (`layer_specs()`), GPT-2 included, and the
    description agrees with the modules it runs beside: RMS norms, RoPE at the rotary's base and
    frequencies, SwiGLU for Llama/Qwen (q/k norms for Qwen3); LayerNorms with shifts at the
    modules' eps, no RoPE and a plain tanh-GELU of the first feed-forward layer's width for GPT-2."""
    from qkv.runtime.layer_step_spec import declined, rope_frequencies

    model = _model(family, 4, 2 if family != "gpt2" else 4, 16, seed=0)
    prepare_for_decoding(model, precision="float32", compile=False)
    rotary = model.rotary_embedding()
    specs, parts = model.layer_specs(), model.layer_parts()
    assert specs is not None and len(specs) == len(parts) == len(list(model.attention_layers()))
    for spec, part in zip(specs, parts):
        assert declined(spec) is None
        att = part.attention
        assert (spec.attention.num_heads, spec.attention.num_kv_heads, spec.attention.head_dim) == (
            att.num_heads, att.num_kv_heads, att.head_dim)
        assert (spec.attention.qk_norm is not None) == (family == "qwen3")
        if family == "gpt2":
            block = model.trf_blocks[0]
            assert spec.rope is None and rotary is None
            assert spec.attn_norm.kind == spec.mlp_norm.kind == "layer" and spec.attn_norm.bias
            assert spec.attn_norm.eps == block.norm1.eps and spec.mlp_norm.eps == block.norm2.eps
            assert len(part.attn_norm) == len(part.mlp_norm) == 2  # LayerNorm: weight and shift
            assert spec.mlp.activation == "gelu_tanh" and not spec.mlp.gated
            assert spec.mlp.intermediate_size == part.up.out_features
        else:
            assert spec.attn_norm.kind == "rms" and spec.mlp.activation == "silu" and spec.mlp.gated
            assert spec.rope.base == rotary.theta
            assert torch.equal(rope_frequencies(spec.rope), rotary.inv_freq.float())


def test_llama3_rope_scaling_reaches_the_native_layer_through_the_description() -> None:
    """A scaled RoPE (Llama 3.x) is part of the description: the frequencies computed from it
    are the modules' own, and the fused steps give the modules' logits."""
    from qkv.attention.rope import Llama3RopeScaling
    from qkv.runtime.layer_step_spec import rope_frequencies

    scaling = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=16)
    torch.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         rope_scaling=scaling)).eval()
    modules = copy.deepcopy(model)
    setup = prepare_for_decoding(model, precision="float32", compile=True)
    prepare_for_decoding(modules, precision="float32", compile=False)
    assert setup.layer_step is not None
    spec = model.layer_specs()[0]
    assert dict(spec.rope.scaling)["factor"] == 8.0
    assert torch.equal(rope_frequencies(spec.rope), model.rotary_embedding().inv_freq.float())
    prompts = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        for want, have in zip(_steps(modules, prompts, [9], 5), _steps(model, prompts, [9], 5, setup=setup)):
            assert torch.allclose(have, want, rtol=0, atol=_tolerance("float32", want))


def test_a_model_whose_own_description_the_kernel_lacks_runs_its_modules() -> None:
    """A model that describes its layers (`layer_specs()`) is read from that description: one
    with a q/k norm over all heads (OLMo 2's) is declined there, so nothing is fused."""
    import dataclasses

    from qkv.models.configs.layer_spec import NormSpec

    model = _model("llama", 4, 2, 16, seed=3)
    prepare_for_decoding(model, precision="float32", compile=False)
    specs = list(model.layer_specs())
    model.layer_specs = lambda: specs
    assert NativeLayerStep.for_model(model) is not None  # the same description as the modules': fused
    over_all = dataclasses.replace(specs[1], attention=dataclasses.replace(
        specs[1].attention, qk_norm=NormSpec("rms"), qk_norm_over="all"))
    model.layer_specs = lambda: [specs[0], over_all]
    assert NativeLayerStep.for_model(model) is None


@pytest.mark.parametrize("precision", ["float32", "int8", "int4"])
def test_a_rows_decode_logits_do_not_depend_on_the_rows_beside_it(precision: str) -> None:
    """Batch invariance of a whole fused decode step: prompts prefilled one slot at a time,
    then one step for three rows at once against each row's step alone: the same logits, bit
    for bit (the kernels compute a row with the same operations whatever the batch)."""
    from qkv.attention.caches.kv_cache import SlotKVCache

    fused, _, setup = _pair("llama", precision)
    prompts = {0: torch.tensor([3, 14, 15, 92]), 1: torch.tensor([65, 35]), 2: torch.tensor([8, 9, 7, 9, 3])}
    with torch.inference_mode():
        with DecodeSession(fused, batch_size=3, capacity=64, kind=SlotKVCache, setup=setup) as session:
            last = {row: session.prefill_row(row, ids).argmax(-1) for row, ids in prompts.items()}
            together = session.decode(torch.stack([last[r] for r in (0, 1, 2)]), rows=[0, 1, 2])  # (3, V)
        alone = []
        for row in (0, 1, 2):
            with DecodeSession(fused, batch_size=3, capacity=64, kind=SlotKVCache, setup=setup) as session:
                token = session.prefill_row(row, prompts[row]).argmax(-1)
                alone.append(session.decode(token[None], rows=[row])[0])
    assert torch.equal(together, torch.stack(alone))


@pytest.mark.parametrize("family", FAMILIES)
def test_one_native_call_runs_every_layer_and_the_head_as_the_modules_do(family: str) -> None:
    """A decode step is one `qkv::stack_step` call: the layers, the final norm and the output
    head (stack.cpp), giving the modules' logits; the session's close releases the stack."""
    fused, modules, setup = _pair(family, "float32")
    prompt = torch.tensor([[3, 14, 15, 92]])
    with DecodeSession(fused, capacity=16, setup=setup) as session:
        native = session._native
        assert native is not None and native.runs_head
        handle = native._stack.handle
        logits = session.prefill(prompt)
        steps = [session.decode(logits.argmax(-1)) for _ in range(3)]
    with DecodeSession(modules, capacity=16) as session:
        logits = session.prefill(prompt)
        reference = [session.decode(logits.argmax(-1)) for _ in range(3)]
    for got, want in zip(steps, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=_tolerance("float32", want))
    del native, session
    import gc

    gc.collect()
    with pytest.raises(RuntimeError, match="no open stack"):
        torch.ops.qkv.stack_step.default(handle, torch.zeros(1, 64), torch.zeros(1, dtype=torch.long), None)


def test_how_a_model_was_prepared_travels_as_a_value() -> None:
    """Nothing remembers a preparation on the side: a session given the setup runs the native
    layers, one not given it runs the modules, on the same model."""
    fused, _, setup = _pair("llama", "float32")
    with DecodeSession(fused, capacity=64) as session:
        assert not session.runs_native
    with DecodeSession(fused, capacity=64, setup=setup) as session:
        assert session.runs_native
    assert not hasattr(prepare_module, "setup_of") and not hasattr(prepare_module, "_PREPARED")
