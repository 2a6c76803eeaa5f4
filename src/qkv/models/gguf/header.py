"""A small, bounded reader for the header of a GGUF file (metadata and tensor table).

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every metadata array,
so the 49k-token vocabulary and 48k merges of SmolLM2 take seconds to read before the first
token can be generated. Here a string array is one loop over lengths and byte slices, a numeric
array one `np.frombuffer` view, and strings are decoded only when asked for (`contents()`).

The file is downloaded and treated as hostile: every count and length is checked against the
bytes left before anything is allocated or looped over, arrays nest at most
`MAX_ARRAY_DEPTH` deep, and any malformed header raises `GGUFFormatError` naming the problem
and its byte offset. Tensor data is memory-mapped, not read; dequantizing (and block sizes)
stay with the `gguf` library, which is why tensor types are its `GGMLQuantizationType`.

What it gives matches GGUFReader (fields, including its GGUF.version/tensor_count/kv_count,
contents(), tensor views) except where GGUFReader is looser: arrays of arrays come back nested
rather than flattened, big-endian files are refused, and the checks above apply.

Layout (GGUF v2/v3, little-endian): magic b"GGUF", uint32 version, uint64 tensor count,
uint64 key/value count; the key/value pairs (string key, uint32 value type, value); the tensor
infos (string name, uint32 n_dims, n_dims uint64 dims innermost first, uint32 ggml type,
uint64 offset into the data section); the data section, at the header's end rounded up to
`general.alignment` (default 32). A string is a uint64 length and UTF-8 bytes; an array is a
uint32 element type, a uint64 count and the elements.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 3  # an array of arrays of arrays; deeper nesting is refused
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ELEMENTS = 2**48  # per tensor; far beyond any real model, small enough to be no trick

_SCALARS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_ARRAY_DTYPES: dict[int, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# Fewest bytes one array element of each type can take (a string: its length; an array: its
# element type and count), to refuse counts the rest of the file cannot hold.
_MIN_SIZE = {**{t: s.size for t, s in _SCALARS.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_MIN_KV_SIZE = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
# Tensor types whose data the gguf library views as typed elements; the rest as raw bytes.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF v2/v3 file; the message names the byte offset."""


class GGUFTruncatedError(GGUFFormatError):
    """The header is whole but the tensors' data runs past the end of the file."""

    def __init__(self, needed: int, size: int) -> None:
        super().__init__(f"its tensors need {needed} bytes, the file has {size}")
        self.needed = needed
        self.size = size


@dataclass(frozen=True)
class GGUFField:
    """One metadata value. `value` is raw: bytes for strings, (element type, items) for arrays."""

    name: str
    offset: int  # of the key, in the file
    type: GGUFValueType
    value: Any
    count: int  # elements of an array, 1 for a scalar or string

    def contents(self) -> Any:
        """The value in Python: int, float, bool, str, or a (nested) list for an array.

        Strings are decoded strictly as UTF-8 here, as gguf's `ReaderField.contents()` does,
        so a bad byte fails only the key that is read (UnicodeDecodeError).
        """
        return _python(self.type, self.value)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's header entry and a memory-mapped view of its data (nothing read yet)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as GGUF stores it
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray  # as gguf.GGUFReader gives it: typed elements, or raw bytes per row


@dataclass(frozen=True)
class GGUFHeader:
    """The metadata and tensor table of a GGUF file, with the file memory-mapped."""

    path: str
    version: int
    fields: dict[str, GGUFField]  # GGUF.version, GGUF.tensor_count, GGUF.kv_count, then the file's keys
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int  # where the data section starts
    size: int  # of the file, in bytes


def _python(vtype: int, value: Any) -> Any:
    if vtype == GGUFValueType.STRING:
        return value.decode("utf-8")
    if vtype == GGUFValueType.ARRAY:
        item_type, items = value
        if item_type == GGUFValueType.STRING:
            return [item.decode("utf-8") for item in items]
        if item_type == GGUFValueType.ARRAY:
            return [_python(GGUFValueType.ARRAY, item) for item in items]
        return items.tolist()
    return value


class _Cursor:
    """Reads forward through the file's bytes; every read is bounds-checked first."""

    def __init__(self, buffer: mmap.mmap, size: int) -> None:
        self.buffer = buffer
        self.size = size
        self.pos = 0

    def fail(self, problem: str, at: int | None = None) -> GGUFFormatError:
        return GGUFFormatError(f"{problem} at byte {self.pos if at is None else at}")

    def need(self, n: int, what: str) -> int:
        """Claim the next n bytes; their start offset."""
        start = self.pos
        if n > self.size - start:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - start} remain")
        self.pos = start + n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buffer, self.need(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buffer, self.need(8, what))[0]

    def raw_string(self, what: str) -> bytes:
        length = self.u64(f"the length of {what}")
        start = self.need(length, what)
        return self.buffer[start : start + length]

    def name(self, what: str) -> str:
        at = self.pos
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8", at) from None

    def check_count(self, count: int, min_size: int, what: str) -> None:
        if count * min_size > self.size - self.pos:
            least, left = count * min_size, self.size - self.pos
            raise self.fail(f"{what} {count} needs at least {least} bytes but only {left} remain")

    def value(self, vtype: int, depth: int = 0) -> Any:
        """One value of type `vtype` in raw form (see GGUFField.value)."""
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return scalar.unpack_from(self.buffer, self.need(scalar.size, "a number"))[0]
        if vtype == GGUFValueType.STRING:
            return self.raw_string("a string")
        if vtype == GGUFValueType.ARRAY:
            return self.array(depth + 1)
        raise self.fail(f"unknown value type {vtype}", self.pos - 4)

    def array(self, depth: int) -> tuple[int, Any]:
        at = self.pos
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(f"arrays nest more than {MAX_ARRAY_DEPTH} deep", at)
        item_type = self.u32("an array's element type")
        if item_type not in _MIN_SIZE:
            raise self.fail(f"unknown array element type {item_type}", at)
        count = self.u64("an array's length")
        self.check_count(count, _MIN_SIZE[item_type], "array length")
        dtype = _ARRAY_DTYPES.get(item_type)
        if dtype is not None:
            start = self.need(count * dtype.itemsize, "an array")
            if not count:
                return item_type, np.empty(0, dtype)
            return item_type, np.frombuffer(self.buffer, dtype=dtype, count=count, offset=start)
        if item_type == GGUFValueType.STRING:
            return item_type, self._strings(count)
        return item_type, [self.array(depth + 1) for _ in range(count)]

    def _strings(self, count: int) -> list[bytes]:
        """`count` strings; the one loop that meets a whole vocabulary, so kept flat."""
        buffer, size, pos, unpack = self.buffer, self.size, self.pos, _U64.unpack_from
        items = []
        for _ in range(count):
            if size - pos < 8:
                raise self.fail(f"the length of a string needs 8 bytes but only {size - pos} remain", pos)
            length = unpack(buffer, pos)[0]
            pos += 8
            if length > size - pos:
                raise self.fail(f"a string needs {length} bytes but only {size - pos} remain", pos)
            items.append(buffer[pos : pos + length])
            pos += length
        self.pos = pos
        return items


_TensorInfo = tuple[str, tuple[int, ...], GGMLQuantizationType, int, int, int]


def _tensor_info(cursor: _Cursor, names: set[str]) -> _TensorInfo:
    """(name, dims, type, offset into the data section, n_elements, n_bytes) of the next tensor."""
    at = cursor.pos
    name = cursor.name("a tensor name")
    if name in names:
        raise cursor.fail(f"duplicate tensor name {name[:80]!r}", at)
    n_dims = cursor.u32(f"tensor {name[:80]!r}'s dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cursor.fail(f"tensor {name[:80]!r} has {n_dims} dimensions, not 1 to {MAX_DIMS}", cursor.pos - 4)
    dims = tuple(cursor.u64(f"tensor {name[:80]!r}'s dimensions") for _ in range(n_dims))
    n_elements = 1
    for n in dims:
        n_elements *= n
    if n_elements == 0 or n_elements > MAX_ELEMENTS:
        raise cursor.fail(f"tensor {name[:80]!r} has shape {list(dims)}, with no or absurdly many elements", at)
    raw_type = cursor.u32(f"tensor {name[:80]!r}'s type")
    try:
        tensor_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[tensor_type]
    except (ValueError, KeyError):
        raise cursor.fail(f"tensor {name[:80]!r} has unknown type {raw_type}", cursor.pos - 4) from None
    if dims[0] % block != 0:
        problem = f"rows of {dims[0]} are not whole {tensor_type.name} blocks of {block}"
        raise cursor.fail(f"tensor {name[:80]!r} {problem}", at)
    offset = cursor.u64(f"tensor {name[:80]!r}'s data offset")
    names.add(name)
    return name, dims, tensor_type, offset, n_elements, n_elements // block * type_size


def _tensor_data(buffer: mmap.mmap, start: int, info: _TensorInfo) -> np.ndarray:
    """The tensor's bytes viewed as gguf.GGUFReader views them (and gguf.quants.dequantize takes)."""
    _, dims, tensor_type, _, _, n_bytes = info
    shape = tuple(reversed(dims))
    dtype = _ELEMENT_DTYPES.get(tensor_type)
    if dtype is not None:
        return np.frombuffer(buffer, dtype=dtype, count=n_bytes // dtype.itemsize, offset=start).reshape(shape)
    data = np.frombuffer(buffer, dtype=np.uint8, count=n_bytes, offset=start)
    return data.reshape(quant_shape_to_byte_shape(shape, tensor_type))


def _check_no_overlap(infos: list[_TensorInfo], data_start: int) -> None:
    """Refuse two tensors whose data ranges share bytes: writing one would change the other,
    and no writer makes such a file (llama.cpp lays tensors out one after another)."""
    spans = sorted((offset, offset + n_bytes, name) for name, _, _, offset, _, n_bytes in infos)
    for (start, end, name), (next_start, _, next_name) in zip(spans, spans[1:]):
        if next_start < end:
            raise GGUFFormatError(
                f"tensors {name[:80]!r} and {next_name[:80]!r} overlap: their data share bytes "
                f"{data_start + next_start} to {data_start + end - 1}, at byte {data_start + next_start}"
            )


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse and check the header of the GGUF file at `path`; a malformed one -> GGUFFormatError."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < 4:
            raise GGUFFormatError(f"the file has {size} bytes, too few for GGUF's magic, at byte 0")
        # copy-on-write: tensors are views of the file's pages (shared with the page cache, never
        # read into memory of their own), writable as torch wants, and a write stays private
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    cursor = _Cursor(buffer, size)
    magic = buffer[:4]
    if magic != MAGIC:
        raise GGUFFormatError(f"the file starts with {magic!r}, not GGUF's magic {MAGIC!r}, at byte 0")
    cursor.pos = 4
    version = cursor.u32("the version")
    if version == 1:
        raise cursor.fail("GGUF version 1 (32-bit counts, from 2023) is not supported; only versions 2 and 3 are", 4)
    if version not in SUPPORTED_VERSIONS:
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 and version else ""
        raise cursor.fail(f"GGUF version {version}{endian} is not supported; only versions 2 and 3 are", 4)
    tensor_count = cursor.u64("the tensor count")
    kv_count = cursor.u64("the key/value count")
    cursor.check_count(kv_count, _MIN_KV_SIZE, "key/value count")
    cursor.check_count(tensor_count, _MIN_TENSOR_INFO_SIZE, "tensor count")

    fields: dict[str, GGUFField] = {}
    for name, value, vtype, at in (("GGUF.version", version, GGUFValueType.UINT32, 4),
                                   ("GGUF.tensor_count", tensor_count, GGUFValueType.UINT64, 8),
                                   ("GGUF.kv_count", kv_count, GGUFValueType.UINT64, 16)):
        fields[name] = GGUFField(name, at, vtype, value, 1)
    for _ in range(kv_count):
        at = cursor.pos
        key = cursor.name("a metadata key")
        vtype = cursor.u32(f"key {key[:80]!r}'s value type")
        value = cursor.value(vtype)
        if key in fields:
            raise cursor.fail(f"duplicate key {key[:80]!r}", at)
        count = len(value[1]) if vtype == GGUFValueType.ARRAY else 1
        fields[key] = GGUFField(key, at, GGUFValueType(vtype), value, count)

    cursor.check_count(tensor_count, _MIN_TENSOR_INFO_SIZE, "tensor count")
    names: set[str] = set()
    infos = [_tensor_info(cursor, names) for _ in range(tensor_count)]

    alignment = DEFAULT_ALIGNMENT
    align_field = fields.get("general.alignment")
    if align_field is not None:
        alignment = align_field.value
        if align_field.type != GGUFValueType.UINT32 or alignment == 0 or alignment & (alignment - 1):
            stated = f"{align_field.type.name} {str(alignment)[:40]}"
            raise cursor.fail(f"general.alignment must be a power of two stored as UINT32, not {stated}", align_field.offset)
    data_start = -(-cursor.pos // alignment) * alignment
    end = max((data_start + offset + n_bytes for _, _, _, offset, _, n_bytes in infos), default=0)
    if end > size:
        raise GGUFTruncatedError(end, size)
    _check_no_overlap(infos, data_start)
    tensors = []
    for info in infos:
        name, dims, tensor_type, offset, n_elements, n_bytes = info
        start = data_start + offset
        tensors.append(GGUFTensor(name, tensor_type, dims, n_elements, n_bytes, start, _tensor_data(buffer, start, info)))
    return GGUFHeader(os.fspath(path), version, fields, tensors, alignment, data_start, size)

