"""A rank's native decode step (qkv.runtime.tensor_parallel.TensorParallelLayerStep): qkv's layer
in two calls, attention half and MLP half, with the residual added between them, computes what
the rank's modules compute and what one process's whole-layer step computes. Checked here on
one rank (no collective), where the all-reduces are the identity, so the halves alone are
under test; tests/models/tensor_parallel/test_ranks.py checks 2 and 3 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.models.loader import open_model
from qkv.models.tensor_parallel.group import TensorParallel
from qkv.models.tensor_parallel.opened import open_rank
from qkv.runtime.layer_step import NativeLayerStep
from qkv.runtime.native import native_kernels
from qkv.runtime.prepare import prepare
from qkv.runtime.session import DecodeSession
from qkv.runtime.tensor_parallel import TensorParallelLayerStep, prepare_rank
from tests.models.conftest import make_tokenizer, save_tiny

pytestmark = pytest.mark.skipif(not native_kernels().available, reason="qkv's kernels are not built here")

PROMPT = torch.tensor([[3, 17, 41, 5, 99, 12]])  # (1, T)


def _steps(model, setup, *, step: str = "auto", steps: int = 6) -> torch.Tensor:
    """Logits (steps, V) of greedy decode steps after PROMPT, in a session of 2 slots (row 1)."""
    out = []
    with DecodeSession(model, batch_size=2, capacity=64, kind=SlotKVCache, setup=setup, step=step) as session:
        logits = session.prefill_row(1, PROMPT[0])  # (V,)
        for _ in range(steps):
            token = logits.argmax()[None]  # (1,)
            logits = session.decode(token, rows=[1])[0]
            out.append(logits)
        assert session.runs_native == (step != "modules")
    return torch.stack(out)


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def model_path(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        save_tiny("llama", folder)
        return folder
    from tests.models.gguf.gguf_convert import write_gguf
    from tests.models.gguf.test_arch import _source

    return write_gguf(folder / "gemma2.gguf", _source("gemma2"), make_tokenizer())  # post-norms, soft-caps


def test_the_halves_compute_the_modules_and_one_process_layer_step(model_path: Path) -> None:
    loaded, setup = prepare_rank(open_rank(open_model(model_path), TensorParallel()), "float32")
    assert isinstance(setup.layer_step, TensorParallelLayerStep)
    halves = _steps(loaded.model, setup)
    modules = _steps(loaded.model, setup, step="modules")
    whole = prepare(str(model_path), "float32", inductor=False)  # as the server prepares: the layer step, no Inductor
    assert isinstance(whole.setup.layer_step, NativeLayerStep)
    one_process = _steps(whole.model, whole.setup)
    scale = 1 + float(modules.abs().max())
    torch.testing.assert_close(halves, modules, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(halves, one_process, rtol=0, atol=1e-5 * scale)
    assert torch.equal(halves.argmax(-1), one_process.argmax(-1))


def test_a_part_outside_the_three_is_refused() -> None:
    with pytest.raises(RuntimeError, match="part is 0"):
        torch.ops.qkv.decoder_layer.default(torch.zeros(1, 4), torch.zeros(1, dtype=torch.float64), [], [], [], [],
                                            [], torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.long),
                                            torch.zeros(1, dtype=torch.long), None, None, 3)
