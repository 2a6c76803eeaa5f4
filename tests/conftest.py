"""Shared fixtures. The real SmolLM2-135M model is loaded at most once per test worker.

Tests that use the `smollm2*` fixtures are marked `xdist_group("smollm2")` so that
`pytest -n 2 --dist loadgroup` (the project's default) runs them all on one worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    from qkv.models.gguf import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_file: Path):
    """qkv's reading of the GGUF file: config, fp32 tensors (HF names), tokenizer, template."""
    from qkv.models.gguf import read_gguf

    return read_gguf(smollm2_file, torch.float32)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_file: Path, tmp_path_factory: pytest.TempPathFactory):
    """transformers' own GGUF loading of the same file: (model fp32, tokenizer), the reference."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("smollm2-hf")
    (folder / smollm2_file.name).symlink_to(smollm2_file)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=smollm2_file.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=smollm2_file.name, dtype=torch.float32
    )
    return model.eval(), tokenizer
