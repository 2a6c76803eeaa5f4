"""Checkpoint names of a `SpecDecoder`, from its `DecoderSpec` alone, and the key maps.

The decoder's modules carry the checkpoints' names (qkv.models.spec_decoder), so the map is
the identity but for two transforms: a tied lm_head is filled from embed_tokens, and a
checkpoint that stores q/k/v or gate/up stacked (Phi-3: self_attn.qkv_proj, mlp.gate_up_proj)
is split into the projections the model holds (rows: queries, keys, values; gate, up).
A Gemma 3 checkpoint saved whole (Gemma3ForConditionalGeneration) keeps its text model under
`language_model`; `gemma3_rename` moves those names home, and the vision tower's tensors are
skipped by name.

Shape legend: C hidden size, F feed-forward size, V vocabulary, D head size.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from torch import Tensor

from qkv.models.configs.decoder_spec import DecoderSpec
from qkv.models.key_maps.key_map import KeyMap
from qkv.models.spec_decoder import norm_names

BUFFERS = re.compile(r"model\.(layers\.\d+\.self_attn\.)?(rotary_emb|extra_rotary\.\d+)\.(inv_freq|long_inv_freq)"
                     r"|model\.embed_tokens\.embed_scale")
GEMMA3_VISION = re.compile(BUFFERS.pattern + r"|(model\.)?(vision_tower|multi_modal_projector)\..*")


def spec_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of SpecDecoder(spec), with its shape, in model order (lm_head last)."""
    c = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, c)}
    for i, layer in enumerate(spec.layers):
        p, a, m = f"model.layers.{i}.", layer.attention, layer.mlp
        q, kv, f = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, m.intermediate_size
        names = norm_names(layer)
        if "attn_norm" in names:
            shapes[p + names["attn_norm"] + ".weight"] = (c,)
        shapes.update({p + "self_attn.q_proj.weight": (q, c), p + "self_attn.k_proj.weight": (kv, c),
                       p + "self_attn.v_proj.weight": (kv, c), p + "self_attn.o_proj.weight": (c, q)})
        if a.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if a.out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c,)
        if a.qk_norm is not None:
            over_all = a.qk_norm_over == "all"
            shapes[p + "self_attn.q_norm.weight"] = (q if over_all else a.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (kv if over_all else a.head_dim,)
        for role in ("attn_post_norm", "mlp_norm"):
            if role in names:
                shapes[p + names[role] + ".weight"] = (c,)
        shapes.update({p + "mlp.gate_proj.weight": (f, c), p + "mlp.up_proj.weight": (f, c),
                       p + "mlp.down_proj.weight": (c, f)})
        if m.bias:
            shapes.update({p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,), p + "mlp.down_proj.bias": (c,)})
        if "mlp_post_norm" in names:
            shapes[p + names["mlp_post_norm"] + ".weight"] = (c,)
    shapes["model.norm.weight"] = (c,)
    shapes["lm_head.weight"] = (spec.vocab_size, c)
    return shapes


def _same(*names: str) -> Callable[[Tensor], dict[str, Tensor]]:
    return lambda t: {n: t for n in names}


def _split(names: tuple[str, ...], sizes: tuple[int, ...]) -> Callable[[Tensor], dict[str, Tensor]]:
    """A stacked tensor's rows (dim 0) -> one tensor per name."""
    return lambda t: dict(zip(names, t.split(sizes, dim=0)))


def spec_key_maps(spec: DecoderSpec) -> list[KeyMap]:
    """Checkpoint tensor -> model tensors, for every tensor the checkpoint must hold."""
    shapes = spec_shapes(spec)
    maps: list[KeyMap] = []
    for i, layer in enumerate(spec.layers):
        p, a = f"model.layers.{i}.", layer.attention
        if spec.stacked_qkv:
            parts = tuple(f"{p}self_attn.{n}_proj.weight" for n in "qkv")
            sizes = tuple(shapes[n][0] for n in parts)
            maps.append(KeyMap(f"{p}self_attn.qkv_proj.weight", (sum(sizes), spec.hidden_size), _split(parts, sizes)))
            if a.qkv_bias:
                bias = tuple(n.replace(".weight", ".bias") for n in parts)
                maps.append(KeyMap(f"{p}self_attn.qkv_proj.bias", (sum(sizes),), _split(bias, sizes)))
        if spec.stacked_gate_up:
            parts = (f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight")
            f = layer.mlp.intermediate_size
            maps.append(KeyMap(f"{p}mlp.gate_up_proj.weight", (2 * f, spec.hidden_size), _split(parts, (f, f))))
            if layer.mlp.bias:
                bias = tuple(n.replace(".weight", ".bias") for n in parts)
                maps.append(KeyMap(f"{p}mlp.gate_up_proj.bias", (2 * f,), _split(bias, (f, f))))
    stacked = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)")
    tied = spec.tie_word_embeddings
    for name, shape in shapes.items():
        if tied and name == "lm_head.weight":
            continue
        is_stacked = stacked.fullmatch(name) and (
            (spec.stacked_qkv and "self_attn" in name) or (spec.stacked_gate_up and ".mlp." in name))
        if is_stacked:
            continue
        aliases = ("lm_head.weight",) if tied and name == "model.embed_tokens.weight" else ()
        maps.append(KeyMap(name, shape, _same(name, *aliases)))
    return maps


def gemma3_rename(names: Iterable[str]) -> Callable[[str], str]:
    """A whole Gemma 3 checkpoint's text names (transformers 4: language_model.model.*,
    language_model.lm_head.*; 5: model.language_model.*) -> the text model's own."""
    del names

    def rename(name: str) -> str:
        for prefix, home in (("language_model.model.", "model."), ("model.language_model.", "model."),
                             ("language_model.lm_head.", "lm_head.")):
            if name.startswith(prefix):
                return home + name[len(prefix):]
        return name

    return rename
