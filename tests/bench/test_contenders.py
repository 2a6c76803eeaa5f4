"""A contender that is not installed is skipped with a one-line message, not an error."""

from __future__ import annotations

import sys

import pytest
import torch

from qkv.bench import common
from qkv.bench.sections import smollm2


def test_optional_returns_a_message_for_a_missing_module() -> None:
    message = common.optional("qkv_no_such_module", "llama.cpp")
    assert isinstance(message, str) and message.startswith("llama.cpp: skipped")
    assert len(message.splitlines()) == 1


def test_optional_returns_the_module_when_importable() -> None:
    assert common.optional("json", "json") is sys.modules["json"]


@pytest.mark.parametrize("module", ["llama_cpp", "transformers"])
def test_smollm2_contenders_skip_when_not_importable(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    if module == "llama_cpp":
        result = smollm2.llama_contender([1, 2], 2, 1)
    else:
        result = smollm2.transformers_contender(torch.tensor([[1, 2]]), 2)
    assert isinstance(result, str) and "skipped" in result and len(result.splitlines()) == 1


def test_a_contender_that_kills_its_process_is_reported_not_fatal(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path) -> None:
    monkeypatch.setattr(smollm2, "LLAMA_PROBE", "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    message = smollm2.llama_crash(tmp_path / "model.gguf")
    assert message is not None and "SIGILL" in message and "AVX-512" in message
    monkeypatch.setattr(smollm2, "LLAMA_PROBE", "import sys\nsys.exit('no model here')\n")
    assert smollm2.llama_crash(tmp_path / "model.gguf") == "loading the model failed: no model here"
    monkeypatch.setattr(smollm2, "LLAMA_PROBE", "pass\n")
    assert smollm2.llama_crash(tmp_path / "model.gguf") is None
