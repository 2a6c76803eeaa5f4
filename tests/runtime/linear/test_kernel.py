"""One linear interface (qkv.runtime.linear.kernel): every linear kind the preparation path
makes says what qkv's whole-layer kernel reads of it, its own tensors in the kernel's order,
and the layer step that asks them decodes as the modules do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from torch import nn

from qkv.models.configs.llama import LlamaConfig
from qkv.models.llama import LlamaForCausalLM
from qkv.runtime import DecodeSession, DecodeSetup
from qkv.runtime.linear.block import BlockLinear, StackedBlockLinear, native_reason
from qkv.runtime.linear.float import NativeFloatLinear
from qkv.runtime.linear.kernel import KernelLinear
from qkv.runtime.linear.quantized import Int4Linear, Int8Linear
from qkv.runtime.linear.transposed import InputMajorLinear
from qkv.runtime.native import native_kernels
from qkv.runtime.prepare import prepare, prepare_for_decoding
from tests.models.gguf.block_files import write_block_gguf

pytestmark = pytest.mark.skipif(native_reason() is not None, reason="qkv's kernels do not build here")

# what each kind hands the kernel (runtime/native/csrc/kernels.h's Linear), before the bias
EXPECTED = {
    NativeFloatLinear: lambda m: [m.weight],
    Int8Linear: lambda m: [m.weight, m.scales],
    Int4Linear: lambda m: [m.q, m.d_bits, m.m_bits],
    BlockLinear: lambda m: [m.blocks, m.type_code],
    StackedBlockLinear: lambda m: [t for p in m.parts for t in (p.blocks, p.type_code)],
}
# q/k/v of three block types (one stacked layer of parts), gate and up of one (one block layer)
MIXED = {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "attn_v": Q.Q5_0, "attn_output": Q.Q8_0,
         "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0}


def _llama(bias: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         attention_bias=bias))
    return model.eval()


def _layer_linears(model: nn.Module) -> list[nn.Module]:
    """The linear layers of the decoder layers (what the layer step runs), stacked ones whole."""
    parts = model.layer_parts()
    return [m for p in parts for m in (p.attention.qkv_proj, p.attention.o_proj, p.up, p.down)]


def _prepared(kind: str, tmp_path: Path) -> tuple[nn.Module, DecodeSetup]:
    if kind == "blocks":
        prepared = prepare(write_block_gguf(tmp_path / "mixed.gguf", layer_types=MIXED), "blocks", compile=True)
        return prepared.model, prepared.setup
    model = _llama(bias=True)
    return model, prepare_for_decoding(model, precision=kind, compile=True)


@pytest.mark.parametrize("kind", ["float32", "int8", "int4", "blocks"])
def test_every_kind_the_preparation_makes_hands_the_kernel_its_own_tensors(kind: str, tmp_path: Path) -> None:
    linears = _layer_linears(_prepared(kind, tmp_path)[0])
    assert linears
    for layer in linears:
        assert isinstance(layer, KernelLinear), type(layer)
        tensors = layer.kernel_tensors()
        assert tensors is not None, type(layer)
        want = EXPECTED[type(layer)](layer) + ([] if layer.bias is None else [layer.bias])
        assert len(tensors) == len(want) and all(t is w for t, w in zip(tensors, want)), type(layer)
    kinds = {type(layer) for layer in linears}
    assert kinds == {"float32": {NativeFloatLinear}, "int8": {Int8Linear}, "int4": {Int4Linear},
                     "blocks": {StackedBlockLinear, BlockLinear}}[kind]


def test_what_the_kernel_cannot_read_answers_none() -> None:
    linear = nn.Linear(64, 96)
    assert InputMajorLinear(linear).kernel_tensors() is None  # made only where the kernels do not build
    assert not isinstance(linear, KernelLinear)  # torch's own layer: the modules run it
    native = NativeFloatLinear(linear)
    assert native.kernel_tensors() is not None
    assert native.to(torch.bfloat16).kernel_tensors() is None  # a cast model runs as modules
    model = _llama()
    assert prepare_for_decoding(model, precision="bfloat16", compile=True).layer_step is None


def _steps(model: nn.Module, setup: DecodeSetup, step: str, n: int = 5) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode(), DecodeSession(model, capacity=32, step=step, setup=setup) as session:
        assert session.runs_native == (step == "native")
        logits = session.prefill(torch.tensor([[0, 1, 2, 2, 1]]))
        for _ in range(n):
            out.append(logits)
            logits = session.decode(logits.argmax(-1))
    return out


@pytest.mark.parametrize("kind", ["float32", "int8", "int4", "blocks"])
def test_the_layer_step_through_the_interface_decodes_as_the_modules(kind: str, tmp_path: Path) -> None:
    model, setup = _prepared(kind, tmp_path)
    native, modules = _steps(model, setup, "native"), _steps(model, setup, "modules")
    # int4 and blocks round activations: one on a rounding step's boundary may move one step
    # (tests/runtime/test_layer_step.py's bound); else float rounding
    rounded = kind in ("int4", "blocks")
    for have, want in zip(native, modules):
        assert torch.allclose(have, want, rtol=0, atol=(2e-2 if rounded else 1e-4) * (1 + float(want.abs().max())))
