"""The output folder as a model folder: config.json, model.safetensors, tokenizer.json.

The trained model is written in Hugging Face's GPT-2 layout by
qkv.models.hf.checkpoint.save_pretrained (each file replaced atomically), so
`qkv generate --model DIR`, `qkv explain --model DIR` and transformers load it as it is.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from qkv.models.hf.checkpoint import TOKENIZER, save_pretrained
from qkv.models.gpt2 import GPT2Decoder
from qkv.util.atomic import atomic_write_with
from qkv.training.tokenizer import END_OF_TEXT

TOKENIZER_NAME = TOKENIZER


def write_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    atomic_write_with(path, lambda tmp: tokenizer.save(tmp))


def export_model_folder(model: GPT2Decoder, tokenizer: Tokenizer, out: str | Path) -> None:
    """Write the model folder into `out`; <|endoftext|> (when the tokenizer has it) ends generation."""
    eos = tokenizer.token_to_id(END_OF_TEXT)
    model.eos_token_ids = () if eos is None else (eos,)
    save_pretrained(model, tokenizer, out)
