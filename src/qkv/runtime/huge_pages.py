"""A prepared model's weights moved onto 2 MB pages, where Linux gives them.

A decode step reads every weight once, as a stream of hundreds of megabytes. On 4 KB pages
that stream crosses a page every 4 KB, and the TLB (2048 entries, 8 MB here) misses on most
of them; on 2 MB pages it crosses one every 2 MB. Measured here on GPT-2's output head (154
MB of float32, qkv's kernel, 2 threads): 24-26 GB/s on 4 KB pages, 28-31 GB/s on 2 MB pages.

Linux backs memory with 2 MB pages when transparent huge pages are "always" on, or, in the
common "madvise" mode, for memory that asked with madvise(MADV_HUGEPAGE). PyTorch's
allocator does not ask, so `place_on_huge_pages` copies the large tensors of a model into
one anonymous mapping that does (Python's `mmap`), and points each tensor at its copy
(`tensor.data = ...`: the same Parameter and buffer objects, so the layers and anything
holding them see the move). The mapping lives as long as the tensors viewing it.

Tensors that are views of a file's mapping (a GGUF file's blocks, qkv.models.gguf.header) stay
where they are: copying them would spend the time and the memory that mapping saves, for a
decode measured within a few percent either way (benchmarks/RESULTS.md, "Startup and load").

Elsewhere (no `madvise`, THP "never", not Linux) the copy is skipped: nothing else changes.

Where 2 MB pages cost far more to fault in than small ones, the weights go on 4 KB pages: a
virtual machine whose host backs guest memory lazily (a virtio balloon reporting free
memory) zeroes each fresh 2 MB page through 512 host faults. Measured on such a 2-core Zen 4:
4-5 ms a MB on 2 MB pages against 0.3 ms on 4 KB pages, so a 1B model's 700 MB of repacked
blocks took 4.4-4.8 s to place instead of 0.4 s, for a decode within 10% either way (Q4_K
tiles 9% faster on 2 MB pages, Q6_K tiles 14% slower). So an arena is faulted in CHUNK by
CHUNK as it is made (`_fault_in`); once a chunk comes slower than twice a small-page probe's
rate, the rest of it and every later arena of the process take 4 KB pages, having spent one
chunk. `QKV_HUGE_PAGES=1` takes 2 MB pages without watching, `=0` never.

A matrix copied out of the file's mapping at load (repacked, or stacked with others) leaves its
file pages resident in the process for nothing: `release_file_pages` drops them
(madvise(MADV_DONTNEED) on a private mapping never written: the page cache keeps them for the next
run, and a later read would fault the same bytes back in from the file).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import time
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.errors import QkvError

HUGE_PAGE = 2 << 20
SMALLEST = 1 << 20  # tensors below this are read from cache or once a step: not worth a move
ALIGN = 64  # each tensor starts on a cache line


CHUNK = 16 << 20  # bytes of an arena faulted in between two looks at the clock
PROBE = 8 << 20  # bytes of the small-page probe
_SWITCH = "QKV_HUGE_PAGES"
_MAPS = Path("/proc/self/maps")
_FIXED_MAPS: ContextVar[list[tuple[int, int]] | None] = ContextVar("qkv_file_maps_fixed", default=None)


def huge_pages_supported() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MAP_ANONYMOUS")


class _Seen:
    """What this process has seen of 2 MB pages: slow once a chunk faulted in too slowly."""
    slow = False


def huge_pages_pay() -> bool:
    """Whether new weights go onto 2 MB pages: supported, $QKV_HUGE_PAGES not 0, and no chunk
    of them seen faulting in slowly (module docstring)."""
    chosen = _switch()
    if chosen is not None:
        return chosen and huge_pages_supported()
    return huge_pages_supported() and not _Seen.slow


def _switch() -> bool | None:
    """$QKV_HUGE_PAGES: True (1), False (0), None (unset: watch the faults)."""
    chosen = os.environ.get(_SWITCH, "").strip().lower()
    if not chosen:
        return None
    if chosen in ("1", "true", "yes", "on"):
        return True
    if chosen in ("0", "false", "no", "off"):
        return False
    raise QkvError(f"{_SWITCH}={chosen!r}: use 1 (2 MB pages), 0 (4 KB pages), or leave it unset")


@functools.cache
def _small_page_seconds_per_byte() -> float:
    """Writing PROBE bytes of fresh memory advised for small pages, seconds a byte (once a process)."""
    mapping = mmap.mmap(-1, PROBE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            mapping.madvise(mmap.MADV_NOHUGEPAGE)
        raw = torch.frombuffer(mapping, dtype=torch.uint8)
        began = time.perf_counter()
        raw.fill_(0)
        took = time.perf_counter() - began
        del raw
    finally:
        mapping.close()
    return took / PROBE


_ADVISED: dict[int, tuple[int, int]] = {}  # id(mapping) -> the address range of an arena still alive


def _arena(nbytes: int, limit: float | None = None) -> Tensor:
    """nbytes of zeroed memory starting on a 2 MB boundary, advised to be huge pages and faulted
    in (`_fault_in`; `limit`: seconds a byte past which the rest takes small pages, by default
    twice the small-page probe's)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    _ADVISED[id(mapping)] = (raw.data_ptr(), raw.data_ptr() + raw.numel())
    weakref.finalize(mapping, _ADVISED.pop, id(mapping), None)  # its addresses may be reused once it goes
    start = (-raw.data_ptr()) % HUGE_PAGE
    if _switch() is None:
        _fault_in(mapping, raw, start, nbytes, 2 * _small_page_seconds_per_byte() if limit is None else limit)
    return raw[start:start + nbytes]


def _fault_in(mapping: mmap.mmap, raw: Tensor, start: int, nbytes: int, limit: float) -> None:
    """Write zeros over raw[start:start + nbytes] CHUNK by CHUNK while each takes at most `limit`
    seconds a byte; after the first that takes longer, advise the rest of the mapping for small
    pages and mark 2 MB pages slow for the process."""
    done = 0
    while done < nbytes and not _Seen.slow:
        size = min(CHUNK, nbytes - done)
        began = time.perf_counter()
        raw[start + done:start + done + size].fill_(0)
        if time.perf_counter() - began > limit * size:
            _Seen.slow = True
        done += size
    rest = start + done  # a multiple of 2 MB while chunks are whole huge pages
    if done < nbytes and hasattr(mmap, "MADV_NOHUGEPAGE"):
        rest -= rest % mmap.PAGESIZE
        mapping.madvise(mmap.MADV_NOHUGEPAGE, rest, len(mapping) - rest)


def huge_empty(rows: int, row_bytes: int) -> Tensor:
    """An uninitialised (rows, row_bytes) uint8 matrix on 2 MB pages where Linux gives them
    and they pay (plain memory otherwise): a weight written there once at load (a repacked matrix) is
    not copied again by `place_on_huge_pages`."""
    nbytes = rows * row_bytes
    if nbytes >= SMALLEST and huge_pages_pay():
        try:
            return _arena(nbytes).view(rows, row_bytes)
        except (OSError, ValueError):
            pass
    return torch.empty(rows, row_bytes, dtype=torch.uint8)


def huge_ones(count: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """`torch.ones(count)` on memory advised for 2 MB pages (plain memory where they are not
    supported or do not pay): the bandwidth probes read what prepared weights live on."""
    size = count * dtype.itemsize
    if not huge_pages_pay():
        return torch.ones(count, dtype=dtype)
    try:
        return _arena(size).view(dtype).fill_(1)
    except (OSError, ValueError):
        return torch.ones(count, dtype=dtype)


@contextlib.contextmanager
def file_maps_fixed() -> Iterator[None]:
    """Inside, `file_mapped_ranges()` answers from one reading of /proc/self/maps: a load that
    maps no new file while it copies many tensors out of one reads it once, not once a matrix
    (a 1B file's 81 matrices: 0.08-0.1 s of start-up)."""
    token = _FIXED_MAPS.set(file_mapped_ranges())
    try:
        yield
    finally:
        _FIXED_MAPS.reset(token)


def file_mapped_ranges(maps: Path = _MAPS) -> list[tuple[int, int]]:
    """The address ranges this process maps from files (inode not 0), sorted; [] where the
    kernel does not list them (not Linux). Inside `file_maps_fixed`, the reading it took."""
    fixed = _FIXED_MAPS.get()
    if fixed is not None and maps == _MAPS:
        return fixed
    ranges = []
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()  # start-end perms offset dev inode [path]
        if len(fields) >= 6 and fields[4] != "0":
            start, _, end = fields[0].partition("-")
            ranges.append((int(start, 16), int(end, 16)))
    return sorted(ranges)


def _in_ranges(address: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= address < end for start, end in ranges)


def place_on_huge_pages(model: nn.Module) -> int:
    """Move `model`'s CPU parameters and buffers of at least SMALLEST bytes onto 2 MB pages
    (module docstring), except views of a file's mapping; tensors that share storage move together. Embedding tables stay
    (a step reads one row of them) unless a layer also reads them whole (a tied output
    head). Returns the bytes moved (0 where `huge_pages_pay()` says no)."""
    if not huge_pages_pay():
        return 0
    read_whole = {id(m.weight) for m in model.modules()
                  if not isinstance(m, nn.Embedding) and isinstance(getattr(m, "weight", None), Tensor)}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - read_whole
    chosen: dict[int, list[Tensor]] = {}  # storage -> the tensors on it
    mapped = file_mapped_ranges() + list(_ADVISED.values())  # files' pages, and what is on 2 MB pages already
    for tensor in (*model.parameters(), *model.buffers()):
        if (tensor.device.type != "cpu" or tensor.is_meta or not tensor.is_contiguous()
                or id(tensor) in tables or _in_ranges(tensor.data_ptr(), mapped)):
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() >= SMALLEST:
            chosen.setdefault(storage.data_ptr(), []).append(tensor)
    # a storage moves whole, so views of it (tied weights, batched loads) stay views of one
    layout, total = [], 0
    for tensors in chosen.values():
        storage = tensors[0].untyped_storage()
        layout.append((storage, tensors, total))
        total += -(-storage.nbytes() // ALIGN) * ALIGN
    if total == 0:
        return 0
    try:
        arena = _arena(total)
    except (OSError, ValueError):
        return 0
    with torch.no_grad():
        for storage, tensors, offset in layout:
            moved = arena[offset:offset + storage.nbytes()]
            moved.copy_(_bytes_of(storage))
            seen: set[int] = set()
            for tensor in tensors:
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                start = tensor.storage_offset() * tensor.element_size()
                view = moved[start:start + tensor.numel() * tensor.element_size()]
                tensor.data = view.view(tensor.dtype).view(tensor.shape)
    return total


def _bytes_of(storage: torch.UntypedStorage) -> Tensor:
    """A storage's bytes as a uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def release_file_pages(tensor: Tensor, ranges: list[tuple[int, int]] | None = None) -> int:
    """Drop this process's resident pages of the file mapping under `tensor`, a view of a file's
    mapping whose bytes were copied elsewhere (module docstring): only whole pages inside its bytes,
    so a neighbour's pages stay. `ranges`: file_mapped_ranges(), when the caller has read it
    already. Returns the bytes released (0 off Linux, or where the tensor is not a file's)."""
    if not hasattr(mmap, "MADV_DONTNEED") or tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not _in_ranges(start, file_mapped_ranges() if ranges is None else ranges):
        return 0
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return 0
    done = _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)
    return last - first if done == 0 else 0


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
