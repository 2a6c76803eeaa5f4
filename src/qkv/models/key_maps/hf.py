"""Hugging Face checkpoint names <-> qkv module names, with every key accounted for.

A `KeyMap` says how one checkpoint tensor (its name and expected shape) becomes one or
more model tensors. Loading checks the whole checkpoint against the maps before taking
anything in: a missing key, an unexpected key or a wrong shape raises a QkvError naming it.
Known non-weight buffers (GPT-2's attn.bias/attn.masked_bias masks, rotary inv_freq) are
skipped by an explicit pattern, never by a catch-all.

GPT-2 stores its linear layers as Conv1D, (in, out), the transpose of nn.Linear's
(out, in), and fuses queries, keys and values into one c_attn of (C, 3C): the map splits
it into the shared attention layer's q_proj, k_proj, v_proj (the book's W_query, W_key,
W_value). The Llama family's names are qkv's own, so its map is the identity (the
names and shapes come from its layer description: qkv.models.key_maps.spec).

Shape legend: C embedding, V vocabulary, P positions (context length), F feed-forward size.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.configs.families import llama_decoder_spec
from qkv.models.key_maps.key_map import KeyMap
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.models.key_maps.spec import spec_shapes

GPT2_BUFFERS = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)")
LLAMA_BUFFERS = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def names_preview(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_names_and_shapes(
    maps: list[KeyMap],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    skip: re.Pattern[str],
    tied_duplicates: Mapping[str, str],
    source: str,
) -> None:
    """Every expected key present with its shape, and no unknown key (one pass each way)."""
    expected = {m.hf_name: m for m in maps}
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise QkvError(f"{source}: missing weight(s) {names_preview(missing)}; the checkpoint is incomplete")
    unexpected = sorted(
        k for k in shapes if k not in expected and k not in tied_duplicates and not skip.fullmatch(k)
    )
    if unexpected:
        raise QkvError(
            f"{source}: unexpected weight(s) {names_preview(unexpected)}; the checkpoint does not match its config.json"
        )
    for m in maps:
        shape = tuple(shapes[m.hf_name])
        if shape != m.shape:
            raise QkvError(f"{source}: weight {m.hf_name} has shape {shape}, expected {m.shape}")
    for name, original in tied_duplicates.items():
        if name in shapes and tuple(shapes[name]) != tuple(shapes[original]):
            raise QkvError(f"{source}: weight {name} has shape {tuple(shapes[name])}, expected {tuple(shapes[original])}")


def load_mapped(
    model: torch.nn.Module,
    maps: list[KeyMap],
    tensors: dict[str, Tensor],
    *,
    skip: re.Pattern[str],
    tied_duplicates: dict[str, str],
    source: str,
    copy: bool = True,
) -> None:
    """Check `tensors` against `maps`, then make them `model`'s parameters (cast to its dtype).

    tied_duplicates: {name: original} checkpoint keys that may repeat a tied weight.
    The tensors are assigned (`load_state_dict(assign=True)`), so `model` may have been
    built with its parameters on the meta device (qkv.util.empty_init). copy=False: a
    tensor already of the right dtype and contiguous becomes the parameter itself, for a
    caller that hands over tensors nothing else holds (the loader's freshly read ones).
    """
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    check_names_and_shapes(maps, shapes, skip=skip, tied_duplicates=tied_duplicates, source=source)
    for name, original in tied_duplicates.items():
        if name in tensors and not torch.equal(tensors[name], tensors[original]):
            raise QkvError(
                f"{source}: config.json ties {name} to {original}, but the checkpoint holds different values"
            )
    state: dict[str, Tensor] = {}
    for m in maps:
        state.update(m.to_model(tensors[m.hf_name]))
    model.load_state_dict(_like_model(model, state, copy=copy), strict=True, assign=True)


def _like_model(model: torch.nn.Module, state: dict[str, Tensor], *, copy: bool) -> dict[str, Tensor]:
    """`state` with each tensor in the dtype of the model's entry, contiguous, and a
    Parameter where the model has one. One tensor under several names (a tied head) stays
    one Parameter, so the modules keep sharing it after assignment."""
    targets = model.state_dict(keep_vars=True)
    made: dict[tuple[int, torch.dtype, bool], Tensor] = {}
    out: dict[str, Tensor] = {}
    for name, value in state.items():
        target = targets.get(name)
        if target is None:  # load_state_dict(strict=True) names it
            out[name] = value
            continue
        is_param = isinstance(target, torch.nn.Parameter)
        key = (id(value), target.dtype, is_param)
        if key not in made:
            tensor = value.detach().to(dtype=target.dtype, memory_format=torch.contiguous_format, copy=copy)
            made[key] = torch.nn.Parameter(tensor, requires_grad=target.requires_grad) if is_param else tensor
        out[name] = made[key]
    return out


def _same(name: str, *aliases: str) -> Callable[[Tensor], dict[str, Tensor]]:
    return lambda t: {n: t for n in (name, *aliases)}


def _transposed(name: str) -> Callable[[Tensor], dict[str, Tensor]]:
    return lambda t: {name: t.t()}


def gpt2_key_maps(cfg: GPTConfig, tied: bool) -> list[KeyMap]:
    """GPT2LMHeadModel names -> qkv's GPT2Decoder names (from the config alone)."""
    c, f = cfg.emb_dim, 4 * cfg.emb_dim
    maps = [
        KeyMap("transformer.wte.weight", (cfg.vocab_size, c),
               _same("tok_emb.weight", *(["out_head.weight"] if tied else []))),
        KeyMap("transformer.wpe.weight", (cfg.context_length, c), _same("pos_emb.weight")),
        KeyMap("transformer.ln_f.weight", (c,), _same("final_norm.scale")),
        KeyMap("transformer.ln_f.bias", (c,), _same("final_norm.shift")),
    ]
    if not tied:
        maps.append(KeyMap("lm_head.weight", (cfg.vocab_size, c), _same("out_head.weight")))
    for i in range(cfg.n_layers):
        hf, qkv = f"transformer.h.{i}.", f"trf_blocks.{i}."
        maps += [
            KeyMap(hf + "ln_1.weight", (c,), _same(qkv + "norm1.scale")),
            KeyMap(hf + "ln_1.bias", (c,), _same(qkv + "norm1.shift")),
            KeyMap(hf + "ln_2.weight", (c,), _same(qkv + "norm2.scale")),
            KeyMap(hf + "ln_2.bias", (c,), _same(qkv + "norm2.shift")),
            KeyMap(hf + "attn.c_attn.weight", (c, 3 * c), _split_qkv(qkv + "att.", "weight", c)),
            KeyMap(hf + "attn.c_attn.bias", (3 * c,),
                   _split_qkv(qkv + "att.", "bias", c) if cfg.qkv_bias else _zero_bias(hf + "attn.c_attn.bias")),
            KeyMap(hf + "attn.c_proj.weight", (c, c), _transposed(qkv + "att.o_proj.weight")),
            KeyMap(hf + "attn.c_proj.bias", (c,), _same(qkv + "att.o_proj.bias")),
            KeyMap(hf + "mlp.c_fc.weight", (c, f), _transposed(qkv + "ff.layers.0.weight")),
            KeyMap(hf + "mlp.c_fc.bias", (f,), _same(qkv + "ff.layers.0.bias")),
            KeyMap(hf + "mlp.c_proj.weight", (f, c), _transposed(qkv + "ff.layers.2.weight")),
            KeyMap(hf + "mlp.c_proj.bias", (c,), _same(qkv + "ff.layers.2.bias")),
        ]
    return maps


def _split_qkv(prefix: str, kind: str, c: int) -> Callable[[Tensor], dict[str, Tensor]]:
    """Conv1D c_attn (C, 3C) weight or (3C,) bias -> q_proj, k_proj, v_proj (Linear layout)."""

    def convert(t: Tensor) -> dict[str, Tensor]:
        q, k, v = t.split(c, dim=-1)  # each (C, C) or (C,)
        if kind == "weight":
            q, k, v = q.t(), k.t(), v.t()  # (C_out, C_in)
        return {f"{prefix}q_proj.{kind}": q, f"{prefix}k_proj.{kind}": k, f"{prefix}v_proj.{kind}": v}

    return convert


def _zero_bias(hf_name: str) -> Callable[[Tensor], dict[str, Tensor]]:
    def check(t: Tensor) -> dict[str, Tensor]:
        if bool(t.any()):
            raise QkvError(f"{hf_name} is not zero, but config.json says qkv_bias=false")
        return {}

    return check


def gpt2_to_hf(model: GPT2Decoder) -> dict[str, Tensor]:
    """qkv's GPT2Decoder -> GPT2LMHeadModel tensors (Conv1D layout, fused c_attn)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    return gpt2_state_to_hf(sd, model.cfg, tied=model.weights_tied)


def gpt2_state_to_hf(sd: Mapping[str, Tensor], cfg: GPTConfig, *, tied: bool) -> dict[str, Tensor]:
    """A state dict with qkv's GPT2Decoder names -> GPT2LMHeadModel tensors."""
    out = {
        "transformer.wte.weight": sd["tok_emb.weight"],
        "transformer.wpe.weight": sd["pos_emb.weight"],
        "transformer.ln_f.weight": sd["final_norm.scale"],
        "transformer.ln_f.bias": sd["final_norm.shift"],
    }
    if not tied:
        out["lm_head.weight"] = sd["out_head.weight"]
    for i in range(cfg.n_layers):
        hf, qkv = f"transformer.h.{i}.", f"trf_blocks.{i}."
        att = qkv + "att."
        weights = [sd[f"{att}{n}_proj.weight"].t() for n in ("q", "k", "v")]  # each (C, C)
        if cfg.qkv_bias:
            bias = torch.cat([sd[f"{att}{n}_proj.bias"] for n in ("q", "k", "v")])  # (3C,)
        else:
            bias = torch.zeros(3 * cfg.emb_dim, dtype=weights[0].dtype, device=weights[0].device)
        out.update({
            hf + "ln_1.weight": sd[qkv + "norm1.scale"],
            hf + "ln_1.bias": sd[qkv + "norm1.shift"],
            hf + "ln_2.weight": sd[qkv + "norm2.scale"],
            hf + "ln_2.bias": sd[qkv + "norm2.shift"],
            hf + "attn.c_attn.weight": torch.cat(weights, dim=1),  # (C, 3C)
            hf + "attn.c_attn.bias": bias,
            hf + "attn.c_proj.weight": sd[att + "o_proj.weight"].t(),
            hf + "attn.c_proj.bias": sd[att + "o_proj.bias"],
            hf + "mlp.c_fc.weight": sd[qkv + "ff.layers.0.weight"].t(),
            hf + "mlp.c_fc.bias": sd[qkv + "ff.layers.0.bias"],
            hf + "mlp.c_proj.weight": sd[qkv + "ff.layers.2.weight"].t(),
            hf + "mlp.c_proj.bias": sd[qkv + "ff.layers.2.bias"],
        })
    return out


def llama_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of LlamaForCausalLM(cfg) with its shape, from the config alone (no model
    is built: loading checks a checkpoint against this before allocating anything)."""
    return spec_shapes(llama_decoder_spec(cfg))


def llama_key_maps(cfg: LlamaConfig) -> list[KeyMap]:
    """Identity map over the model's own names; a tied lm_head is filled from embed_tokens."""
    tied = cfg.tie_word_embeddings
    maps = []
    for name, shape in llama_shapes(cfg).items():
        if tied and name == "lm_head.weight":
            continue
        aliases = ("lm_head.weight",) if tied and name == "model.embed_tokens.weight" else ()
        maps.append(KeyMap(name, shape, _same(name, *aliases)))
    return maps


def llama_to_hf(model: LlamaForCausalLM) -> dict[str, Tensor]:
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        del sd["lm_head.weight"]
    return sd
