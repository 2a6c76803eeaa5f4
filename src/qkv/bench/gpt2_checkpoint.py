"""The random GPT-2-shaped checkpoint the GPT-2 sections measure, and both sides' models.

transformers writes the checkpoint (save_pretrained), so qkv loads it through its real
loader, exactly as it loads a downloaded GPT-2.

Shape legend: B batch, T prompt tokens, N new tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.generation import generate
from qkv.runtime.prepare import PreparedModel, prepare


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError:
        raise QkvError("this section builds its checkpoint with transformers; install it: pip install 'qkv[dev]'") from None
    return transformers


def _write_tokenizer(folder: Path) -> None:
    """A small word-level tokenizer.json: the benchmark feeds token ids, never text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "key": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def make_gpt2_checkpoint(folder: Path, n_layer: int, n_embd: int, n_head: int, vocab: int,
                         n_positions: int, *, seed: int = 0) -> Path:
    """A random-weight GPT-2 checkpoint written by transformers' save_pretrained."""
    tf = transformers_module()
    config = tf.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                           n_positions=n_positions, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    tf.GPT2LMHeadModel(config).save_pretrained(folder)
    _write_tokenizer(folder)
    return folder


def load_hf(folder: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    tf = transformers_module()
    return tf.GPT2LMHeadModel.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()


def load_qkv(folder: Path, *, precision: str = "float32", compile: bool = False) -> PreparedModel:
    """qkv's model prepared as `qkv generate --dtype PRECISION` prepares it (qkv.runtime.prepare)."""
    return prepare(folder, precision, compile=compile)


def hf_generate(model: nn.Module, ids: Tensor, new_tokens: int, pad_token_id: int = 0) -> Tensor:
    """transformers' greedy generate of exactly `new_tokens` tokens: (B, T + N)."""
    with torch.inference_mode():
        return model.generate(  # type: ignore[no-any-return]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id,
        )


def qkv_generate(prepared: PreparedModel, ids: Tensor, new_tokens: int, *, use_cache: bool = True) -> Tensor:
    return generate(prepared.model, ids, new_tokens, use_cache=use_cache, setup=prepared.setup)
