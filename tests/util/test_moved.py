"""The old import paths of 0.1 still work for one release: each warns and gives the new module's objects."""

from __future__ import annotations

import importlib
import sys

import pytest

from qkv.util.moved import MOVED, RENAMED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_gives_the_new_objects(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=old.replace(".", r"\.") + " moved to"):
        module = importlib.import_module(old)
    for home in MOVED[old]:
        new = importlib.import_module(home)
        public = [name for name in vars(new) if not name.startswith("_")]
        assert public, home
        for name in public:
            if name in MOVED.get(old, ()) or isinstance(getattr(module, name), type(sys)):
                continue  # a submodule bound on an old package is its own old path
            assert getattr(module, name) is getattr(new, name), f"{old}.{name}"
    for name, (home, new_name) in RENAMED.get(old, {}).items():
        assert getattr(module, name) is getattr(importlib.import_module(home), new_name)


def test_an_old_submodule_of_an_old_package_imports_by_its_dotted_path() -> None:
    for name in ("qkv.perf.quantize", "qkv.perf", "qkv.native.build", "qkv.native"):
        sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning):
        import qkv.perf.quantize as old  # noqa: F401
    from qkv.runtime.linear import quantized

    assert old.Int8Linear is quantized.Int8Linear
    with pytest.warns(DeprecationWarning):
        from qkv.native import native_kernels
    from qkv.runtime.native import native_kernels as new

    assert native_kernels is new


def test_a_path_that_never_existed_is_still_an_import_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("qkv.perf.no_such_module")


def test_renamed_classes_of_modules_that_stayed_warn_and_give_the_new_class() -> None:
    import qkv.chat
    import qkv.models.gpt2
    from qkv.chat.conversation import ReplySettings
    from qkv.models.gpt2 import GPT2Decoder

    with pytest.warns(DeprecationWarning, match="GPT2Decoder"):
        assert qkv.models.gpt2.GPTModel is GPT2Decoder
    with pytest.warns(DeprecationWarning, match="ReplySettings"):
        assert qkv.chat.Sampling is ReplySettings
