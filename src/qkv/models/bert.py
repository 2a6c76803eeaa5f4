"""The BERT encoder (bidirectional attention), as all-MiniLM-L6-v2 and other BERT checkpoints use it.

Every token attends to every real token on both sides; padding is hidden by a key mask.
The attention layer is qkv's GroupedQueryAttention with as many key/value heads as query
heads, biased projections, no RoPE and `is_causal=False`, so BERT goes through the same
kernel (and the same trace) as the decoders. Position information comes from learned
absolute position embeddings added to the token embeddings.

Loading maps Hugging Face's names onto qkv's with a short explicit table (`_RENAMES`);
every checkpoint key is accounted for, and weights are read only with safetensors.

Shape legend: B batch, T tokens, C hidden size, I intermediate size, V vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import Tensor, nn

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.names import ATTENTION_KERNELS, AttentionKernel
from qkv.attention.masks import padding_mask
from qkv.errors import QkvError


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    attention_backend: AttentionKernel = "fused"

    def __post_init__(self) -> None:
        sizes = {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"BertConfig sizes must be positive integers, got {bad}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"BertConfig hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.attention_backend not in ATTENTION_KERNELS:
            raise ValueError(
                f"BertConfig attention_backend must be one of {ATTENTION_KERNELS}, got {self.attention_backend!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(cls, config: dict) -> BertConfig:
        """Read a Hugging Face BERT config.json; refuse variants this encoder does not compute."""
        if config.get("model_type") != "bert":
            raise ValueError(f"not a BERT config: model_type={config.get('model_type')!r}")
        unsupported = {
            key: config[key]
            for key, ok in (("hidden_act", ("gelu",)), ("position_embedding_type", ("absolute",)))
            if key in config and config[key] not in ok
        }
        if unsupported:
            raise ValueError(f"unsupported BERT config values {unsupported}")
        names = {f.name for f in fields(cls)} - {"attention_backend"}
        return cls(**{k: config[k] for k in names if k in config})


class BertEmbeddings(nn.Module):
    """Token + learned absolute position + token type embeddings, then LayerNorm."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_type_ids))  # (B, T, C)
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    """Post-norm block: x = LN(x + attention(x)); x = LN(x + W_out gelu(W_in x))."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = GroupedQueryAttention(
            cfg.hidden_size, cfg.num_attention_heads, qkv_bias=True, out_bias=True,
            backend=cfg.attention_backend,
        )
        self.attention_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.output_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = self.attention_norm(x + self.attention(x, mask=mask, is_causal=False))
        hidden = torch.nn.functional.gelu(self.intermediate(x))  # (B, T, I), exact GELU
        return self.output_norm(x + self.output(hidden))


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.num_hidden_layers)])


class BertModel(nn.Module):
    """forward(input_ids (B, T), *, attention_mask=None (B, T), token_type_ids=None) -> (B, T, C)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    @property
    def context_length(self) -> int:
        return self.cfg.max_position_embeddings

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(
                f"{input_ids.shape[1]} tokens exceed BERT's {self.cfg.max_position_embeddings} "
                "positions; shorten the input"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        mask = None if attention_mask is None else padding_mask(attention_mask)  # (B, 1, 1, S)
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, C)
        for block in self.encoder.layer:
            x = block(x, mask)
        return x


# Hugging Face name fragment -> qkv name fragment, applied to encoder.layer.N.<rest>.
_RENAMES: tuple[tuple[str, str], ...] = (
    ("attention.self.query.", "attention.q_proj."),
    ("attention.self.key.", "attention.k_proj."),
    ("attention.self.value.", "attention.v_proj."),
    ("attention.output.dense.", "attention.o_proj."),
    ("attention.output.LayerNorm.", "attention_norm."),
    ("intermediate.dense.", "intermediate."),
    ("output.dense.", "output."),
    ("output.LayerNorm.", "output_norm."),
)
# Checkpoint keys qkv knowingly does not use: the position-id buffer and the [CLS] pooler
# (sentence embeddings mean-pool the tokens instead).
_UNUSED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


def _qkv_name(hf_name: str) -> str:
    name = hf_name.removeprefix("bert.")
    if name.startswith("encoder.layer."):
        prefix, rest = name.split(".", 3)[:3], name.split(".", 3)[3]
        for old, new in _RENAMES:
            if rest.startswith(old):
                return ".".join(prefix) + "." + new + rest[len(old):]
    return name


def load_bert(path: str | Path, *, backend: AttentionKernel = "fused") -> BertModel:
    """A BertModel from a folder with config.json and model.safetensors, in eval mode."""
    folder = Path(path)
    config_file, weights_file = folder / "config.json", folder / "model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise QkvError(f"{needed} not found: a BERT folder needs config.json and model.safetensors")
    try:
        cfg = BertConfig.from_hf_config(json.loads(config_file.read_text()))
    except ValueError as error:
        raise QkvError(f"{config_file}: {error}") from None
    cfg = BertConfig(**{**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, "attention_backend": backend})
    model = BertModel(cfg)
    expected = model.state_dict()
    renamed: dict[str, Tensor] = {}
    for key, value in load_file(str(weights_file)).items():
        if key.removeprefix("bert.") in _UNUSED:
            continue
        name = _qkv_name(key)
        if name not in expected:
            raise QkvError(f"{weights_file}: unexpected checkpoint key {key!r} (no {name!r} in BertModel)")
        if value.shape != expected[name].shape:
            raise QkvError(
                f"{weights_file}: {key!r} has shape {tuple(value.shape)}, "
                f"BertModel expects {tuple(expected[name].shape)}"
            )
        renamed[name] = value
    missing = sorted(set(expected) - set(renamed))
    if missing:
        raise QkvError(f"{weights_file}: missing checkpoint keys for {missing[:5]}")
    model.load_state_dict(renamed)
    return model.eval()


def load_wordpiece(path: str | Path, *, max_length: int = 512) -> Tokenizer:
    """The folder's tokenizer.json (WordPiece, adds [CLS] ... [SEP]), unpadded, truncated."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise QkvError(f"{file} not found: the BERT folder needs its tokenizer.json")
    tokenizer = Tokenizer.from_file(str(file))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    return tokenizer


def encode(tokenizer: Tokenizer, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
    """(input_ids, attention_mask), both (B, T), padded on the right to the longest text."""
    encodings = tokenizer.encode_batch(list(texts))
    longest = max(len(e.ids) for e in encodings)
    ids = torch.zeros(len(encodings), longest, dtype=torch.long)  # [PAD] is id 0 in BERT vocabularies
    real = torch.zeros(len(encodings), longest, dtype=torch.long)
    for row, e in enumerate(encodings):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        real[row, : len(e.ids)] = 1
    return ids, real


@torch.no_grad()
def sentence_embeddings(model: BertModel, tokenizer: Tokenizer, texts: Sequence[str]) -> Tensor:
    """(N, C): the mean of each text's token vectors (padding left out), L2-normalised,
    as sentence-transformers' all-MiniLM-L6-v2 pipeline (Transformer, Pooling, Normalize)."""
    if not texts:
        raise QkvError("give at least one text to embed")
    ids, real = encode(tokenizer, texts)
    hidden = model(ids, attention_mask=real)  # (N, T, C)
    weights = real.unsqueeze(-1).to(hidden.dtype)  # (N, T, 1)
    mean = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)  # (N, C)
    return torch.nn.functional.normalize(mean, p=2, dim=1)
