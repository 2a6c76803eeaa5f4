"""The book's GPTModel state dict (chapter 4's `model.pth`) <-> qkv's GPT and GPT-2 names.

The book's names are qkv's GPTModel names except in the attention: the book's W_query,
W_key, W_value, out_proj are qkv's q_proj, k_proj, v_proj, o_proj, and the book keeps its
causal mask as a (P, P) buffer `att.mask` in every block (qkv derives causality instead).
Everything else (tok_emb, pos_emb, ff.layers.0/2, norm1/norm2 scale and shift, final_norm,
out_head) is the same, so conversion is renaming: no number changes.

A state dict does not say how many heads its attention had: a (C, C) W_query is one head of
C features or C / 64 heads of 64 alike, and the logits differ. The book's GPT-2 configs (124M
to 1558M: emb_dim 768, 1024, 1280, 1600) all use heads of 64 features, so `infer_config` takes
that for those four widths only; any other width must be told its head count (qkv.models.
book_pth reads it from the book's config saved in or beside the file) and is refused by name
otherwise, never guessed.

Shape legend: C embedding (emb_dim), V vocabulary, P context length, F = 4C.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.models.configs.gpt2 import GPTConfig
from qkv.models.key_maps.hf import names_preview

BOOK_HEAD_DIM = 64  # every GPT-2 size in the book: emb_dim / n_heads = 64
GPT2_HEADS = {768: 12, 1024: 16, 1280: 20, 1600: 25}  # emb_dim -> n_heads of GPT-2 124M, 355M, 774M, 1558M
_RENAMES = {"W_query": "q_proj", "W_key": "k_proj", "W_value": "v_proj", "out_proj": "o_proj"}
_BOOK_ATT = re.compile(r"(trf_blocks\.\d+\.att\.)(W_query|W_key|W_value|out_proj)(\.weight|\.bias)")
_QKV_ATT = re.compile(r"(trf_blocks\.\d+\.att\.)(q_proj|k_proj|v_proj|o_proj)(\.weight|\.bias)")
_BLOCK = re.compile(r"trf_blocks\.(\d+)\.")
_MASK = re.compile(r"trf_blocks\.\d+\.att\.mask")


def book_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every entry of the book's GPTModel(cfg).state_dict() with its shape (no model is built)."""
    c, f, v, p = cfg.emb_dim, 4 * cfg.emb_dim, cfg.vocab_size, cfg.context_length
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (v, c), "pos_emb.weight": (p, c)}
    for i in range(cfg.n_layers):
        b = f"trf_blocks.{i}."
        for name in ("W_query", "W_key", "W_value"):
            shapes[f"{b}att.{name}.weight"] = (c, c)
            if cfg.qkv_bias:
                shapes[f"{b}att.{name}.bias"] = (c,)
        shapes |= {
            f"{b}att.out_proj.weight": (c, c), f"{b}att.out_proj.bias": (c,), f"{b}att.mask": (p, p),
            f"{b}ff.layers.0.weight": (f, c), f"{b}ff.layers.0.bias": (f,),
            f"{b}ff.layers.2.weight": (c, f), f"{b}ff.layers.2.bias": (c,),
            f"{b}norm1.scale": (c,), f"{b}norm1.shift": (c,), f"{b}norm2.scale": (c,), f"{b}norm2.shift": (c,),
        }
    shapes |= {"final_norm.scale": (c,), "final_norm.shift": (c,), "out_head.weight": (v, c)}
    return shapes


def infer_config(
    shapes: Mapping[str, tuple[int, ...]], *, source: str, n_heads: int | None = None,
    how_to_say_heads: str = "pass its n_heads",
) -> GPTConfig:
    """The GPTConfig a book state dict was made with, read from its shapes and `n_heads`
    (None: GPT-2's head count for its four widths; any other width -> QkvError saying
    `how_to_say_heads`)."""
    for name in ("tok_emb.weight", "pos_emb.weight"):
        if name not in shapes or len(shapes[name]) != 2:
            raise QkvError(
                f"{source}: no {name} of two dimensions; it is not the book's GPTModel state dict "
                "(torch.save(model.state_dict(), 'model.pth'))"
            )
    vocab, emb = shapes["tok_emb.weight"]
    context = shapes["pos_emb.weight"][0]
    blocks = {int(m.group(1)) for k in shapes if (m := _BLOCK.match(k))}
    if not blocks or blocks != set(range(len(blocks))):
        raise QkvError(f"{source}: its transformer blocks are not numbered 0..N-1 (found {sorted(blocks)[:5]})")
    heads = n_heads if n_heads is not None else GPT2_HEADS.get(emb)
    if heads is None:
        sizes = ", ".join(str(width) for width in GPT2_HEADS)
        raise QkvError(
            f"{source}: a state dict does not say how many attention heads its model has, and emb_dim {emb} "
            f"is none of GPT-2's widths ({sizes}, heads of {BOOK_HEAD_DIM} features); {how_to_say_heads}"
        )
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or emb % heads != 0:
        raise QkvError(f"{source}: n_heads {str(heads)[:40]} does not divide emb_dim {emb} into whole heads")
    try:
        return GPTConfig(
            vocab_size=vocab, context_length=context, emb_dim=emb, n_heads=heads, n_layers=len(blocks),
            drop_rate=0.0, qkv_bias="trf_blocks.0.att.W_query.bias" in shapes,
        )
    except ValueError as error:
        raise QkvError(f"{source}: not a usable GPT shape: {error}") from None


def check_book_state(shapes: Mapping[str, tuple[int, ...]], cfg: GPTConfig, *, source: str) -> None:
    """Every key of the book's GPTModel(cfg) present with its shape, and no other key."""
    expected = book_shapes(cfg)
    unknown = sorted(k for k in shapes if k not in expected)
    if unknown:
        raise QkvError(f"{source}: unknown key {names_preview(unknown, 3)}; it is not the book's GPTModel state dict")
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise QkvError(f"{source}: missing key {names_preview(missing, 3)}; the state dict is incomplete")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise QkvError(f"{source}: {name} has shape {tuple(shapes[name])}, expected {shape}")


def book_to_qkv_state(state: Mapping[str, Tensor], cfg: GPTConfig, *, source: str = "state dict") -> dict[str, Tensor]:
    """The book's names -> qkv's GPTModel names (masks dropped after checking they are causal)."""
    check_book_state({k: tuple(v.shape) for k, v in state.items()}, cfg, source=source)
    causal = torch.triu(torch.ones(cfg.context_length, cfg.context_length), diagonal=1)  # (P, P)
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if _MASK.fullmatch(name):
            if not torch.equal(tensor.to(causal.dtype), causal):
                raise QkvError(f"{source}: {name} is not the book's causal mask (1 above the diagonal)")
            continue
        out[_BOOK_ATT.sub(lambda m: m.group(1) + _RENAMES[m.group(2)] + m.group(3), name)] = tensor
    return out


def qkv_to_book_state(state: Mapping[str, Tensor], cfg: GPTConfig) -> dict[str, Tensor]:
    """qkv's GPTModel names -> the book's, with the book's causal mask buffers added."""
    back = {v: k for k, v in _RENAMES.items()}
    out = {_QKV_ATT.sub(lambda m: m.group(1) + back[m.group(2)] + m.group(3), k): v for k, v in state.items()}
    mask = torch.triu(torch.ones(cfg.context_length, cfg.context_length), diagonal=1)  # (P, P)
    for i in range(cfg.n_layers):
        out[f"trf_blocks.{i}.att.mask"] = mask.clone()
    return out


__all__ = [
    "BOOK_HEAD_DIM", "GPT2_HEADS", "book_shapes", "book_to_qkv_state", "check_book_state", "infer_config", "qkv_to_book_state",
]
