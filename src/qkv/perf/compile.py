"""Optional `torch.compile` of a decoder's forward pass, with a clean fall back to eager.

Compiling the forward pass fuses the small element-wise operations of each layer and,
together with `DecodeLinear`/`Int8Linear`, turns each matrix-vector product of a decode
step into one bandwidth-bound loop. It needs a working compiler tool chain (Inductor
writes and builds C++), which not every machine has: the first call that fails to
compile warns once and the model runs eagerly from then on, with identical results.

Only decode steps (one new token) are compiled. The KV cache's length is a plain Python
int that grows by one per token. Compiling with `dynamic=True` and letting Dynamo treat
int attributes of modules as symbolic (a config switch scoped to each compiled call, not
set globally) keeps one compiled graph for every cache length instead of one per token.
The cache's capacity is rounded up (`cache_capacity`), so generations of different
lengths share graphs too: one for everything up to 2048 positions.

Two Inductor options (scoped to this compilation) matter for speed, measured on a 2-core
AVX-512 CPU with a GPT-2-124M-shaped model:

- `realize_opcount_threshold=0`, `realize_reads_threshold=1`: store each layer norm's
  output once. Left to itself Inductor inlines the norm into the following
  matrix-vector loop and recomputes it for every weight row, which made bfloat16
  decoding compute-bound (about 50 tokens/s instead of 80);
- the one-row products and single-query attention are written as reductions
  (`DecodeLinear`, `one_query_attention`), so no external kernel call interrupts the
  fused loops.

Shape legend: B batch, T new tokens.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from qkv.perf.linear import Int8Linear, use_decode_linears

# See the module docstring: keep norm outputs as buffers instead of recomputing them per row.
INDUCTOR_OPTIONS: dict[str, Any] = {"realize_opcount_threshold": 0, "realize_reads_threshold": 1}
# Dynamo specialises on the cache buffers' shapes (module buffers are static even with
# dynamic=True), so each capacity is a compilation of its own (seconds to minutes).
# Every generation of up to 2048 positions shares one; longer ones go by powers of two.
# The unused tail costs memory only: attention reads the filled part.
SMALLEST_CAPACITY = 2048


def cache_capacity(tokens: int, context_length: int) -> int:
    """The KV-cache capacity a compiled model uses for `tokens`: the next power of two
    (at least SMALLEST_CAPACITY), capped at the context length."""
    capacity = max(SMALLEST_CAPACITY, 1 << max(0, tokens - 1).bit_length())
    return max(tokens, min(capacity, context_length))


def _describe(error: BaseException) -> str:
    """One line: the outer error's type and the root cause's message (the useful part)."""
    root = error
    for _ in range(10):  # Dynamo wraps the compiler's error (inner_exception or __cause__)
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if inner is None:
            break
        root = inner
    lines = [line for line in str(root).splitlines() if line.strip()]
    return f"{type(error).__name__}: {type(root).__name__}: {lines[0] if lines else ''}"


@dataclass
class CompileState:
    """What happened to a compiled model: whether it still runs compiled, and why not."""

    backend: str
    active: bool = True
    error: str | None = None
    calls: int = field(default=0)  # decode steps sent to the compiled path
    decoding: bool = False  # set while a decode step runs, so the compiled regions engage


def repeated_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of identical layers: the longest ModuleList of one module type."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > (len(best) if best is not None else 1):
            if len({type(child) for child in module}) == 1:
                best = module
    return best


def _regions(model: nn.Module, whole_model: bool) -> list[nn.Module]:
    """What to compile: the whole model, or each repeated layer plus every linear layer
    outside them (the output head), which then share one compiled graph per kind."""
    blocks = None if whole_model else repeated_blocks(model)
    if blocks is None:
        return [model]
    inside = {id(m) for block in blocks for m in block.modules()}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear | Int8Linear) and id(m) not in inside]
    return [*blocks, *linears]


def compile_decoder(
    model: nn.Module,
    *,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    decode_linears: bool = True,
    whole_model: bool = False,
) -> nn.Module:
    """Compile the decode steps of `model` in place; fall back to eager (one warning) if
    compiling fails.

    Only one-token calls (decode steps, the bandwidth-bound part) run compiled; a prompt
    (compute-bound, large matrix products that eager PyTorch already runs well) runs
    eagerly, which keeps the compiled graphs to one shape family and the compile short.

    By default each repeated layer is compiled on its own ("regional" compilation): every
    layer reuses one compiled graph, so compiling takes the time of one layer whatever the
    depth (SmolLM2's 30 layers compiled whole took 10 minutes on 2 cores), and the output
    head gets its own graph. `whole_model=True` compiles the forward pass as one graph
    instead (fusion across layers, a compile that grows with the depth).

    decode_linears: first swap `nn.Linear` for row-major `DecodeLinear` (same parameters),
    whose one-row product compiles to a fused multiply-and-reduce. `model.compile_state`
    tells afterwards whether the compiled path is in use. `model.setup_cache` rounds the
    capacity up (see `cache_capacity`).
    """
    if decode_linears:
        use_decode_linears(model, layout="row")
    # torch.compile takes a mode or options, not both; a chosen mode wins.
    options = dict(INDUCTOR_OPTIONS) if backend == "inductor" and mode is None else None
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")
    state = CompileState(backend=name)

    def fail(error: BaseException) -> None:
        state.active = False
        state.error = _describe(error)
        warnings.warn(f"torch.compile ({name}) failed, running eagerly instead: {state.error}",
                      RuntimeWarning, stacklevel=4)

    def compile_region(region: nn.Module) -> None:
        eager = region.forward
        compiled = torch.compile(eager, backend=backend, mode=mode, dynamic=True, options=options)

        @functools.wraps(eager)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not (state.active and state.decoding):
                return eager(*args, **kwargs)
            try:
                return compiled(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - any compiler failure means "run eagerly"
                # Bad input fails in eager mode too: that error is the user's, raise it as is.
                result = eager(*args, **kwargs)
                fail(error)
                return result

        region.forward = forward  # type: ignore[method-assign]

    for region in _regions(model, whole_model):
        compile_region(region)
    model_forward = model.forward  # the compiled region itself when the whole model is one

    @functools.wraps(model_forward)
    def forward(input_ids: Tensor, *args: Any, **kwargs: Any) -> Any:
        decoding = state.active and input_ids.shape[-1] == 1
        if decoding:
            state.calls += 1
        state.decoding = decoding
        try:
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
                return model_forward(input_ids, *args, **kwargs)
        finally:
            state.decoding = False

    setup_cache = model.setup_cache

    @functools.wraps(setup_cache)
    def rounded_setup_cache(batch_size: int, max_seq_len: int, **kwargs: Any) -> Any:
        return setup_cache(batch_size, cache_capacity(max_seq_len, model.context_length), **kwargs)

    model.forward = forward  # type: ignore[method-assign]
    model.setup_cache = rounded_setup_cache  # type: ignore[method-assign]
    model.compile_state = state  # type: ignore[assignment]
    return model
