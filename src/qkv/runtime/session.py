"""A decode session: the one owner of its KV caches and of how its steps run.

    with DecodeSession(model, batch_size=B, capacity=S) as session:
        logits = session.prefill(ids (B, T), lengths=None)   # (B, V), the caches filled
        logits = session.decode(tokens (B,))                  # (B, V), one position each

The session builds its caches when entered (one per attention layer, from the model's
`cache_specs`) and drops them when left; it hands them to every call of the model, which
holds none itself, so any number of sessions run on one model side by side (a server's
slots and an explorer's trace).

How a step runs is chosen once, when the session is entered (`step`): "native" runs every
layer and the head as one call of qkv's C++ (`qkv.runtime.layer_step`), given the setup of a
model prepared for it (`setup=`, qkv.runtime.prepare) and a cache kind it takes; "modules"
runs the PyTorch modules (compiled where the preparation compiled them); "auto" (the
default) takes native where it can. A trace, whose hooks must see every module, asks for
"modules" (a session entered while a forward hook is on the model runs the modules too,
but for a tensor-parallel rank's own collectives, `own_hooks`); asked for "native" where it
cannot run, the session says so in one line. Positions are tensors: a prefill writes
[n, n + T) of every row, a decode step each row's next position; rows may differ in length
(`lengths`: padding at the end, positions (B, 1), each row's mask hiding what lies beyond it).
A decode step has the same shapes at every length: one compiled graph for the whole capacity.

Prompts run eagerly even on a compiled model (`qkv.runtime.compile.eager_prompts`). Where
the native layers run, a prompt runs natively too (`NativeLayerStep.prompt`: its tokens as
rows of the row's cache, one call instead of some 40 operations a layer), computing what the
decode steps would for its tokens one at a time, bit for bit; `prefill_rows` and
`decode_with_pieces` put several rows' prompt pieces (and a step's decode rows) in one such
call. Every call of a session running the modules goes through them in aligned parts
(PREFILL_ALIGN).

Shape legend: B batch, T prompt tokens, S cache capacity, V vocabulary.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import TracebackType

import torch
from torch import Tensor

from qkv.attention.caches.kv_cache import CacheKind, CacheSpec, KVCache, SlotKVCache, SlotSelection, StaticKVCache
from qkv.attention.caches.window_cache import cache_kind_for
from qkv.errors import QkvError
from qkv.models.decoder import CausalDecoder
from qkv.runtime.compile import eager_prompts
from qkv.runtime.layer_step import NativeLayerStep, has_forward_hooks
from qkv.runtime.prepare import DecodeSetup
from qkv.runtime.prompt_parts import PREFILL_ALIGN, aligned_parts

STEPS = ("auto", "native", "modules")

# Capacities are rounded up to these steps so that generations of similar lengths share
# buffers of one shape (and a compiled model its graphs); attention reads every slot of
# the capacity (masked), so the rounding is kept small for short generations.
SMALLEST_CAPACITY = 256
ROW_REACH_STEP = 64  # calls on some slot rows read keys up to a multiple of this


def cache_capacity(tokens: int, context_length: int) -> int:
    """The capacity a session allocates for `tokens` positions: the next power of two, at
    least SMALLEST_CAPACITY, capped at the context length."""
    if tokens > context_length:
        raise QkvError(f"{tokens} tokens exceed the model's context length ({context_length})")
    rounded = max(SMALLEST_CAPACITY, 1 << max(0, tokens - 1).bit_length())
    return min(rounded, context_length)


class DecodeSession:
    """Owns `model`'s caches for the duration of a `with` block (see the module docstring).

    capacity: positions each row can hold (default: the model's context length, rounded
    as `cache_capacity` rounds); kind: the cache kind (qkv.attention.caches.kv_cache);
    setup: how the model was prepared (`qkv.runtime.prepare`), whose native layers the session
    binds to its caches; None runs the modules.
    """

    def __init__(
        self,
        model: CausalDecoder,
        *,
        batch_size: int = 1,
        capacity: int | None = None,
        kind: CacheKind = StaticKVCache,
        dtype: torch.dtype | None = None,
        step: str = "auto",
        exact_capacity: bool = False,
        setup: DecodeSetup | None = None,
    ) -> None:
        if batch_size < 1:
            raise QkvError(f"batch_size must be at least 1, got {batch_size}")
        if step not in STEPS:
            raise QkvError(f"unknown decode step {step!r}; choose one of {', '.join(STEPS)}")
        self.step = step
        self.model = model
        self.setup = setup
        self.batch_size = batch_size
        exact = exact_capacity and capacity is not None  # a window cache's size, say: not rounded
        self.capacity = capacity if exact else cache_capacity(capacity or model.context_length, model.context_length)
        self.kind = kind
        self.dtype = dtype
        self.device = next(model.parameters()).device
        self.lengths = [0] * batch_size  # positions held per row (Python ints: no reads back)
        self._next: Tensor | None = None  # (B, 1) or (1,): the positions of the next decode step
        # The last decode on some rows: those rows, their lengths after it, and its rows (b,) and
        # positions (b, 1) tensors, reused (positions moved on in place) while the same rows step on.
        self._row_step: tuple[tuple[int, ...], list[int], Tensor, Tensor] | None = None
        self._was_training = model.training
        self._open = False
        self.caches: list[KVCache] = []
        self._selection = SlotSelection()  # the slot rows a call carries (every SlotKVCache of this session)
        self._native: NativeLayerStep | None = None

    # -- lifetime --------------------------------------------------------------------
    def __enter__(self) -> DecodeSession:
        self._was_training = self.model.training
        self.model.eval()
        specs = self.model.cache_specs(self.batch_size, self.capacity, dtype=self.dtype, device=self.device)
        windows = [getattr(layer, "window", None) for layer in self.model.attention_layers()]
        self.caches = [self._cache(spec, window) for spec, window in zip(specs, windows)]
        self._native = self._native_layers()
        self._open = True
        return self

    def _cache(self, spec: CacheSpec, window: int | None) -> KVCache:
        """One layer's cache: a ring of its window for a sliding-window layer (its memory
        stays flat past the window), else the session's kind; slots share the selection."""
        if window is not None:
            return cache_kind_for(window, self.kind, selection=self._selection)(spec)
        if self.kind is SlotKVCache:
            return SlotKVCache(spec, self._selection)
        return self.kind(spec)

    def _native_layers(self) -> NativeLayerStep | None:
        """The native layers bound to this session's caches, when its step may use them."""
        if self.step == "modules" or has_forward_hooks(self.model):
            return None
        layer_step = None if self.setup is None else self.setup.layer_step
        native = None if layer_step is None else layer_step.bound_to(self.model, self.caches)
        if native is None and self.step == "native":
            print("qkv: native decode layers cannot run this session (model not prepared for them, or its "
                  "cache kind); decoding through the modules", file=sys.stderr)
        return native

    @property
    def keeps_every_position(self) -> bool:
        """Whether every cache keeps all its positions (no sliding-window ring dropping old keys)."""
        return not any(getattr(cache, "windowed", False) for cache in self.caches)

    @property
    def prompt_align(self) -> int:
        """Where a prompt may be cut (pieces, a kept prefix) and write one prefill's numbers: anywhere
        where the native layers run it and every cache keeps every position (each token alone), else on
        parts (prompt_parts): a ring's prompt past its window reads its keys in another order."""
        return 1 if self.runs_native and self.keeps_every_position else PREFILL_ALIGN

    @property
    def decodes_rows(self) -> bool:
        """Whether `decode(tokens, rows=...)` steps some rows only (a session of slots)."""
        return self.kind is SlotKVCache

    @property
    def runs_native(self) -> bool:
        """Whether this session's decode steps run qkv's native layers."""
        return self._native is not None

    def _forward(self, ids: Tensor, positions: Tensor, *, last_only: bool = False) -> Tensor:
        """The model on `ids` (B, T) at `positions` with this session's caches -> logits (B, T, V),
        or the last position's, (B, 1, V), with last_only (models take `last_only` then)."""
        native = self._native
        if native is not None and ids.shape[1] == 1:
            x = self.model.embed(ids, positions)  # (B, 1, C)
            if native.takes(x, positions, None):
                return native(x, positions)  # (B, 1, V): every layer and the head in one native call
        if last_only:
            return self.model(ids, positions=positions, caches=self.caches, last_only=True)
        return self.model(ids, positions=positions, caches=self.caches)

    def _prompt_layers(self) -> NativeLayerStep | None:
        """The native layers, when they may run this session's prompts."""
        native = self._native
        return native if native is not None and native.takes_prompts() else None

    def cache_nbytes(self) -> int:
        """Bytes held by this session's KV caches."""
        return sum(cache.nbytes for cache in self.caches)

    def cache_length(self) -> int:
        """Positions the longest row holds."""
        return max(self.lengths)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._open:
            self.caches, self._native = [], None
            self.model.train(self._was_training)
            self._open = False

    def reset(self) -> None:
        """Forget every row's tokens; the buffers stay for the next prompt."""
        self._check_open()
        for cache in self.caches:
            cache.reset()
        self.lengths = [0] * self.batch_size
        self._next = None

    def truncate(self, length: int) -> None:
        """Keep each row's first `length` positions (a chat rewinds to a common prefix)."""
        self._check_open()
        for cache in self.caches:
            cache.truncate(length)
        self.lengths = [min(n, length) for n in self.lengths]
        self._next = None

    # -- steps -----------------------------------------------------------------------
    def room(self) -> int:
        """How many more positions the longest row can take."""
        return self.capacity - max(self.lengths)

    def prefill(self, ids: Tensor, *, lengths: list[int] | None = None) -> Tensor:
        """Run (B, T) prompt tokens after what each row holds; returns each row's logits
        for the token after its last real one, (B, V). `lengths` (default: T for every
        row) says how many of a row's T tokens are real; the rest is padding whose cache
        entries are never attended to and are overwritten by that row's next tokens."""
        self._check_open()
        b, t = ids.shape
        if b != self.batch_size or t < 1:
            raise QkvError(f"this session decodes {self.batch_size} row(s); got prompt ids of shape {tuple(ids.shape)}")
        lengths = [t] * b if lengths is None else list(lengths)
        if len(lengths) != b or not all(1 <= n <= t for n in lengths):
            raise QkvError(f"lengths must give 1..{t} real tokens for each of the {b} rows, got {lengths}")
        start = self.lengths[0]
        if any(n != start for n in self.lengths):
            raise QkvError("a prompt can follow only rows of equal length; reset the session first")
        self._need(start + t)
        caches = self.caches
        chunk = caches[0].prefill_chunk if caches else None  # a sink cache: a window at a time
        if chunk is not None:
            parts = [(start + begin, start + min(begin + chunk, t)) for begin in range(0, t, chunk)]
        elif lengths == [t] * b:
            parts = aligned_parts(start, start + t)
        else:  # ragged rows in one call: one part (a session of slots prefills each row alone instead)
            parts = [(start, start + t)]
        if len(parts) > 1 and lengths != [t] * b:
            raise QkvError(f"prompts longer than {chunk} tokens are prefilled in parts, which needs rows "
                           "of equal length; prefill them one at a time")
        with torch.inference_mode(), eager_prompts():
            native = self._prompt_layers() if chunk is None else None
            if native is not None:  # every row's tokens (its padding too, as the modules write it) in one call
                out = native.pieces([(r, ids[r], start) for r in range(b)], [n - 1 for n in lengths])
            else:
                for begin, end in parts:
                    positions = torch.arange(begin, end, device=self.device)  # (t',)
                    logits = self._forward(ids[:, begin - start:end - start].to(self.device), positions)  # (B, t', V)
                skipped = t - logits.shape[1]  # tokens of earlier parts
                last = torch.tensor([n - 1 - skipped for n in lengths], device=self.device)  # (B,)
                out = logits[torch.arange(b, device=self.device), last]  # (B, V)
        self.lengths = [start + n for n in lengths]
        self._next = self._positions()
        return out  # (B, V)

    def prefill_scores(self, ids: Tensor) -> Tensor:
        """One row's next tokens ids (T,) after what it holds -> the logits at each of them,
        (T, V): row t scores the token after ids[t] (perplexity through a cache)."""
        self._check_open()
        if self.batch_size != 1 or ids.dim() != 1 or ids.shape[0] < 1:
            raise QkvError(f"prefill_scores takes one row's ids (T,) in a one-row session, got {tuple(ids.shape)}")
        start = self.lengths[0]
        self._need(start + ids.shape[0])
        positions = torch.arange(start, start + ids.shape[0], device=self.device)  # (T,)
        with torch.inference_mode(), eager_prompts():
            native = self._prompt_layers()
            if native is not None:
                scores = native.pieces([(0, ids, start)], None)  # (T, V)
            else:
                scores = self._forward(ids.to(self.device)[None], positions)[0]  # (T, V)
        self.lengths = [start + ids.shape[0]]
        self._next = None
        return scores  # (T, V)

    def prefill_row(self, row: int, ids: Tensor, *, start: int = 0) -> Tensor:
        """Start row `row` afresh with one request's prompt ids (T,), leaving the other rows
        as they are (a continuous batch: needs kind=SlotKVCache). Returns the logits of its
        last token, (V,). start: see `prefill_row_all`."""
        return self._prefill_row(row, ids, start, last_only=True)[-1]

    def prefill_row_all(self, row: int, ids: Tensor, *, start: int = 0) -> Tensor:
        """`prefill_row`, returning the logits at every prompt position, (T, V): row t
        scores the token after ids[t] (a server scoring a prompt's own tokens needs them).
        The ids go at positions [start, start + T): start > 0 keeps the row's first `start`
        positions (a prompt prefix the row holds already, qkv.serve.engine.prefix_cache)."""
        return self._prefill_row(row, ids, start, last_only=False)

    def prefill_rows(self, pieces: list[tuple[int, Tensor, int]]) -> list[Tensor]:
        """Several rows' prompt pieces at once, each (row, ids (t,), start) as `prefill_row` takes
        them, on distinct rows -> each piece's last token's logits, (V,) each. Where the native
        layers run the prompts they all go in one call, the weights read once for every row (a
        server's prompts that arrive together), and each piece's numbers are its own
        `prefill_row`'s, since each token is computed alone; else one `prefill_row` each."""
        self._check_open()
        self._check_distinct(pieces, "prefill_rows")
        with torch.inference_mode():
            native = self._prompt_layers()
        if native is None or len(pieces) < 2:
            return [self.prefill_row(row, ids, start=start) for row, ids, start in pieces]
        for row, ids, start in pieces:
            self._check_piece(row, ids, start)
        with torch.inference_mode():
            logits = native.pieces(pieces, [ids.shape[0] - 1 for _, ids, _ in pieces])  # (pieces, V)
        for row, ids, start in pieces:
            self.lengths[row] = start + ids.shape[0]
        self._next = None
        return list(logits)

    def decode_with_pieces(self, tokens: Tensor, rows: list[int], pieces: list[tuple[int, Tensor, int]]
                           ) -> tuple[Tensor, list[Tensor]]:
        """One decode step of `rows` (as `decode(tokens, rows=rows)`) and other rows' prompt pieces
        (as `prefill_rows(pieces)`) -> (the rows' logits (b, V), each piece's last logits (V,)).
        Where the native layers run prompts, all of it is one call: the weights are read once for
        the step's rows and the pieces' tokens (a decode token is a one-token piece at the row's
        next position), so a piece beside the streams costs its own tokens, not another pass
        over the weights. Each token is computed alone, so the numbers are the two calls'."""
        self._check_open()
        if not pieces:
            return self.decode(tokens, rows=rows), []
        if not rows:
            return tokens.new_empty((0,)), self.prefill_rows(pieces)
        b = len(rows)
        self._check_rows(tokens, rows)
        self._check_distinct([(row, tokens, 0) for row in rows] + pieces, "decode_with_pieces")
        with torch.inference_mode():
            native = self._prompt_layers()
        if native is None:
            return self.decode(tokens, rows=rows), self.prefill_rows(pieces)
        self._need(max(self.lengths[r] for r in rows) + 1)
        for row, ids, start in pieces:
            self._check_piece(row, ids, start)
        steps = [(row, tokens[i:i + 1], self.lengths[row]) for i, row in enumerate(rows)]  # one-token pieces
        with torch.inference_mode():
            logits = native.pieces(steps + pieces, [0] * b + [ids.shape[0] - 1 for _, ids, _ in pieces])
        for row in rows:
            self.lengths[row] += 1
        for row, ids, start in pieces:
            self.lengths[row] = start + ids.shape[0]
        self._next, self._row_step = None, None
        return logits[:b], list(logits[b:])  # (b, V), (V,) each

    @staticmethod
    def _check_distinct(pieces: list[tuple[int, Tensor, int]], call: str) -> None:
        if len({row for row, _, _ in pieces}) != len(pieces):
            raise QkvError(f"{call} takes distinct rows, got rows {[row for row, _, _ in pieces]}")

    def _check_rows(self, tokens: Tensor, rows: list[int]) -> None:
        b = len(rows)
        if tokens.shape != (b,) or len(set(rows)) != b or not all(0 <= r < self.batch_size for r in rows):
            raise QkvError(f"decode on rows {rows} takes distinct rows in 0..{self.batch_size - 1} and one token "
                           f"per row, shape ({b},); got {tuple(tokens.shape)}")

    def _check_piece(self, row: int, ids: Tensor, start: int) -> None:
        if self.kind is not SlotKVCache:
            raise QkvError("calls on some rows of the batch need a session with kind=SlotKVCache")
        if not 0 <= row < self.batch_size or ids.dim() != 1 or ids.shape[0] < 1 or start < 0:
            raise QkvError(f"prefill_row takes a row in 0..{self.batch_size - 1}, ids (T,) and start >= 0, got row "
                           f"{row}, ids of shape {tuple(ids.shape)}, start {start}")
        self._need(start + ids.shape[0])

    def _prefill_row(self, row: int, ids: Tensor, start: int, *, last_only: bool) -> Tensor:
        """The prompt through the native layers in one call, or through the model in aligned
        pieces; last_only: the head runs on the last position only (of each piece, through the
        model) and the prompt's is returned (the head over a 512-token prompt, or over every
        piece but the last, is most of a prefill's work on a large vocabulary), (1, V); else (T, V)."""
        self._check_open()
        self._check_piece(row, ids, start)
        end = start + ids.shape[0]
        pieces = []
        with torch.inference_mode(), eager_prompts():
            native = self._prompt_layers()
            if native is not None:
                wanted = [ids.shape[0] - 1] if last_only else None
                pieces.append(native.pieces([(row, ids, start)], wanted))  # (1 or T, V)
            else:
                for begin, stop in aligned_parts(start, end):  # positions [begin, stop)
                    positions = torch.arange(begin, stop, device=self.device)  # (t',)
                    with self._on_rows([row], reach=stop):
                        # last_only: a piece before the last keeps only its cache, one position through the head
                        pieces.append(self._forward(ids[begin - start:stop - start].to(self.device)[None], positions,
                                                    last_only=last_only)[0])
        self.lengths[row] = end
        self._next = None
        if last_only:
            return pieces[-1]  # (1, V); the pieces before it are the prompt's, their logits unused
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # (T, V)

    def copy_row(self, source: int, target: int, length: int) -> None:
        """Row `target` starts with the first `length` positions row `source` holds (one
        prompt prefilled once for several answers to it; a prefix a released row still holds,
        as qkv.serve.engine.prefix_cache knows); needs kind=SlotKVCache."""
        self._check_open()
        if source == target or not (0 <= source < self.batch_size and 0 <= target < self.batch_size):
            raise QkvError(f"copy_row takes two different rows in 0..{self.batch_size - 1}, got {source}, {target}")
        if not 1 <= length <= self.capacity:
            raise QkvError(f"a row holds at most {self.capacity} positions; cannot copy {length}")
        caches = self.caches
        if not all(isinstance(cache, SlotKVCache) for cache in caches):
            raise QkvError("copy_row needs a session with kind=SlotKVCache")
        for cache in caches:
            cache.copy_row(source, target, length)  # type: ignore[attr-defined]
        self.lengths[target] = length
        self._next = None

    def release_row(self, row: int) -> None:
        """Row `row` holds nothing any more: it idles (see `decode`) until prefilled again."""
        self._check_open()
        self.lengths[row] = 0
        self._next = None

    def decode(self, tokens: Tensor, rows: list[int] | None = None) -> Tensor:
        """One step: each row's newest token (B,) at its next position -> logits (B, V).

        With `rows` (kind=SlotKVCache), only those rows step: tokens (b,) -> logits (b, V),
        and the other rows are neither computed nor touched (a server decodes its occupied
        slots only)."""
        self._check_open()
        if rows is not None:
            return self._decode_rows(tokens, rows)
        if tokens.shape != (self.batch_size,):
            raise QkvError(f"decode takes one token per row, shape ({self.batch_size},); got {tuple(tokens.shape)}")
        self._need(max(self.lengths) + 1)
        if self._next is None:
            self._next = self._positions()
        with torch.inference_mode():
            logits = self._forward(tokens.to(self.device)[:, None], self._next)  # (B, 1, V)
        if all(self.lengths):
            self._next.add_(1)  # in place: the next step reuses the same tensor
            self.lengths = [n + 1 for n in self.lengths]
        else:  # idle rows (holding nothing) wrote a dummy token at position 0 and stay empty
            self.lengths = [n + 1 if n else 0 for n in self.lengths]
            self._next = None
        return logits[:, -1]  # (B, V)

    def _decode_rows(self, tokens: Tensor, rows: list[int]) -> Tensor:
        self._check_rows(tokens, rows)
        lengths = [self.lengths[r] for r in rows]
        reach = max(lengths) + 1
        self._need(reach)
        key = tuple(rows)
        step = self._row_step
        if step is not None and step[0] == key and step[1] == lengths:  # the same rows, one step on
            rows_tensor, positions = step[2], step[3]
        else:
            rows_tensor = torch.tensor(rows, device=self.device)  # (b,)
            positions = torch.tensor(lengths, device=self.device)[:, None]  # (b, 1)
        with self._on_rows(rows_tensor, reach=reach), torch.inference_mode():
            logits = self._forward(tokens.to(self.device)[:, None], positions)  # (b, 1, V)
        for r in rows:
            self.lengths[r] += 1
        positions.add_(1)  # in place: the next step of the same rows reuses both tensors
        self._row_step = (key, [n + 1 for n in lengths], rows_tensor, positions)
        self._next = None
        return logits[:, -1]  # (b, V)

    @contextlib.contextmanager
    def _on_rows(self, rows: list[int] | Tensor, reach: int) -> Iterator[None]:
        """The slot caches carry only `rows` for the calls made inside, and attention reads
        the first `reach` positions, rounded up to a multiple of ROW_REACH_STEP (a few
        shapes, not one per length) rather than the whole capacity."""
        if self.kind is not SlotKVCache:
            raise QkvError("calls on some rows of the batch need a session with kind=SlotKVCache")
        selection = self._selection
        selection.rows = rows if isinstance(rows, Tensor) else torch.tensor(rows, device=self.device)  # (b,)
        selection.limit = -(-reach // ROW_REACH_STEP) * ROW_REACH_STEP
        try:
            yield
        finally:
            selection.rows, selection.limit = None, None

    # -- helpers ---------------------------------------------------------------------
    def _positions(self) -> Tensor:
        """The next decode step's positions: (1,) shared by every row, or (B, 1)."""
        if all(n == self.lengths[0] for n in self.lengths):
            return torch.tensor([self.lengths[0]], device=self.device)  # (1,)
        return torch.tensor(self.lengths, device=self.device)[:, None]  # (B, 1)

    def _need(self, positions: int) -> None:
        if self._open and self.model.streams_past_context(self.kind):
            return  # a sink cache evicts old tokens: any length goes
        if positions > self.capacity:
            raise QkvError(
                f"{positions} tokens exceed this session's KV cache ({self.capacity} positions); "
                "start a session with a larger capacity"
            )

    def _check_open(self) -> None:
        if not self._open:
            raise QkvError("the decode session is not open: use it inside `with DecodeSession(...)`")
