"""A contender that is not installed is skipped with a one-line message, not an error."""

from __future__ import annotations

import builtins
from typing import Any

import pytest

from qkv.bench import common, smollm2


def test_optional_returns_a_message_for_a_missing_module() -> None:
    message = common.optional("qkv_no_such_module", "llama.cpp")
    assert isinstance(message, str) and message.startswith("llama.cpp: skipped")
    assert len(message.splitlines()) == 1


@pytest.mark.parametrize("module", ["llama_cpp", "transformers"])
def test_smollm2_contenders_skip_when_not_importable(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == module or name.startswith(module + "."):
            raise ImportError(f"No module named {module!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no)
    monkeypatch.delitem(__import__("sys").modules, module, raising=False)
    if module == "llama_cpp":
        result = smollm2.llama_contender([1, 2], 2, 1)
    else:
        result = smollm2.transformers_contender(__import__("torch").tensor([[1, 2]]), 2)
    assert isinstance(result, str) and "skipped" in result and len(result.splitlines()) == 1
