"""qkv.models.gguf.header checked against gguf.GGUFReader (the reference), and on hostile bytes.

The reference comparisons: on SmolLM2's GGUF file and on small random files written by the
gguf library's GGUFWriter, every field's contents() and every tensor's name, type, shape,
offset, size and data equal GGUFReader's. The hostile cases are written byte by byte here.
"""

from __future__ import annotations

import math
import struct
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.models.gguf.checkpoint import open_gguf
from qkv.models.gguf.header import MAX_ARRAY_DEPTH, GGUFFormatError, GGUFTruncatedError, read_header


def same(a: Any, b: Any) -> bool:
    """Equal values of equal Python types, NaN equal to NaN."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def assert_matches_gguf_reader(path: Path) -> None:
    ours, reference = read_header(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(reference.fields)
    for key, field in ours.fields.items():
        assert same(field.contents(), reference.fields[key].contents()), key
    for key, field in reference.fields.items():  # the element count qkv takes as the vocabulary size
        if field.types and field.types[0] == V.ARRAY:
            assert ours.fields[key].count == len(field.data), key
    assert len(ours.tensors) == len(reference.tensors)
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert (mine.name, mine.tensor_type, mine.shape, mine.n_elements, mine.n_bytes, mine.data_offset) == (
            theirs.name, theirs.tensor_type, tuple(theirs.shape.tolist()), theirs.n_elements, theirs.n_bytes,
            theirs.data_offset,
        )
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert mine.data.tobytes() == theirs.data.tobytes(), mine.name
    assert ours.data_offset == reference.data_offset and ours.alignment == reference.alignment


# ----------------------------------------------------------------------------- against GGUFReader


@pytest.mark.xdist_group("smollm2")
def test_smollm2_header_equals_gguf_reader(smollm2_file: Path) -> None:
    assert_matches_gguf_reader(smollm2_file)


_SCALAR_VALUES = {
    V.UINT8: st.integers(0, 2**8 - 1), V.INT8: st.integers(-(2**7), 2**7 - 1),
    V.UINT16: st.integers(0, 2**16 - 1), V.INT16: st.integers(-(2**15), 2**15 - 1),
    V.UINT32: st.integers(0, 2**32 - 1), V.INT32: st.integers(-(2**31), 2**31 - 1),
    V.UINT64: st.integers(0, 2**64 - 1), V.INT64: st.integers(-(2**63), 2**63 - 1),
    V.FLOAT32: st.floats(width=32), V.FLOAT64: st.floats(), V.BOOL: st.booleans(), V.STRING: st.text(max_size=12),
}


def _typed_value(vtype: V) -> st.SearchStrategy[tuple[V, V | None, Any]]:
    return _SCALAR_VALUES[vtype].map(lambda v: (vtype, None, v))


def _typed_array(vtype: V) -> st.SearchStrategy[tuple[V, V | None, Any]]:
    return st.lists(_SCALAR_VALUES[vtype], min_size=1, max_size=6).map(lambda v: (V.ARRAY, vtype, v))


values = st.sampled_from(list(_SCALAR_VALUES)).flatmap(lambda t: st.one_of(_typed_value(t), _typed_array(t)))
keys = st.text(min_size=1, max_size=16).filter(lambda k: not k.startswith("GGUF.") and not k.startswith("general."))


@st.composite
def tensors(draw: st.DrawFn) -> list[tuple[str, Q, tuple[int, ...]]]:
    """A few small tensors: (name, type, numpy shape, outermost first)."""
    names = draw(st.lists(st.text(min_size=1, max_size=10), max_size=4, unique=True))
    chosen = []
    for name in names:
        kind = draw(st.sampled_from([Q.F32, Q.F16, Q.Q8_0]))
        outer = draw(st.lists(st.integers(1, 3), max_size=2))
        inner = draw(st.sampled_from([32, 64])) if kind == Q.Q8_0 else draw(st.integers(1, 5))
        chosen.append((name, kind, (*outer, inner)))
    return chosen


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kvs=st.dictionaries(keys, values, max_size=8), specs=tensors(), alignment=st.sampled_from([None, 8, 64]),
       seed=st.integers(0, 2**32 - 1))
def test_random_files_written_by_gguf_equal_gguf_reader(
    kvs: dict, specs: list, alignment: int | None, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "r.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        if alignment is not None:
            writer.add_custom_alignment(alignment)
        for key, (vtype, sub_type, value) in kvs.items():
            writer.add_key_value(key, value, vtype, sub_type=sub_type)
        for name, kind, shape in specs:
            if kind == Q.Q8_0:
                raw = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(shape, kind), dtype=np.uint8)
                writer.add_tensor(name, raw, raw_dtype=kind)
            else:
                writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32 if kind == Q.F32 else np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert_matches_gguf_reader(path)


def test_string_values_decode_strictly_when_read_as_gguf_reader_does(tmp_path: Path) -> None:
    """A bad UTF-8 byte in a value fails only the reading of that key, as in gguf's contents()."""
    path = write(tmp_path, build(kvs=[kv("bad", V.STRING, string(b"\xff")), kv("ok", V.STRING, string(b"fine"))]))
    header = read_header(path)
    assert header.fields["ok"].contents() == "fine"
    with pytest.raises(UnicodeDecodeError):
        header.fields["bad"].contents()
    with pytest.raises(UnicodeDecodeError):
        gguf.GGUFReader(path).fields["bad"].contents()


def test_nested_arrays_are_nested_lists(tmp_path: Path) -> None:
    """(GGUFReader flattens arrays of arrays; qkv reads none, and keeps the structure.)"""
    inner = [array(V.INT32, struct.pack("<2i", 1, 2), 2), array(V.STRING, string(b"a") + string(b"b"), 2),
             array(V.UINT8, b"", 0)]
    path = write(tmp_path, build(kvs=[kv("n", V.ARRAY, array(V.ARRAY, b"".join(inner), 3))]))
    field = read_header(path).fields["n"]
    assert field.contents() == [[1, 2], ["a", "b"], []] and field.count == 3


# ----------------------------------------------------------------------------- hostile bytes


def string(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return string(key.encode() if isinstance(key, str) else key) + struct.pack("<I", vtype) + payload


def array(item_type: int, items: bytes, count: int) -> bytes:
    return struct.pack("<IQ", item_type, count) + items


def tensor_info(
    name: str | bytes, dims: tuple[int, ...], ggml_type: int = Q.F32, offset: int = 0, n_dims: int | None = None
) -> bytes:
    raw = name.encode() if isinstance(name, str) else name
    n = len(dims) if n_dims is None else n_dims
    return string(raw) + struct.pack(f"<I{len(dims)}QIQ", n, *dims, ggml_type, offset)


def build(kvs: list[bytes] = (), infos: list[bytes] = (), data: bytes = b"", *, version: int = 3,
          n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    """A GGUF file from its parts, the data section at the next multiple of 32."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % 32) + data


def write(folder: Path, raw: bytes, name: str = "h.gguf") -> Path:
    path = folder / name
    path.write_bytes(raw)
    return path


def refused(folder: Path, raw: bytes, match: str) -> GGUFFormatError:
    with pytest.raises(GGUFFormatError, match=match) as caught:
        read_header(write(folder, raw))
    return caught.value


def valid_small_file(folder: Path) -> Path:
    writer = gguf.GGUFWriter(str(folder / "small.gguf"), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_token_list(["a", "b", "ab", "é"])
    writer.add_token_types([1, 1, 1, 3])
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("q", np.arange(34, dtype=np.uint8).reshape(1, 34), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder / "small.gguf"


def test_truncated_at_every_byte_raises_format_error(tmp_path: Path) -> None:
    full = valid_small_file(tmp_path).read_bytes()
    header = read_header(tmp_path / "small.gguf")
    end = max(t.data_offset + t.n_bytes for t in header.tensors)
    for size in range(len(full) + 1):
        path = write(tmp_path, full[:size], "cut.gguf")
        if size >= end:  # only padding is missing: the file is whole
            assert [t.name for t in read_header(path).tensors] == ["token_embd.weight", "q"]
            continue
        start = time.perf_counter()
        with pytest.raises(GGUFFormatError) as caught:
            read_header(path)
        assert time.perf_counter() - start < 1.0
        if isinstance(caught.value, GGUFTruncatedError):  # the header is whole, the data is not
            assert caught.value.needed == end and caught.value.size == size
        else:
            assert size < header.data_offset and "at byte" in str(caught.value)


@settings(max_examples=200, deadline=None)
@given(changes=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4))
def test_changed_bytes_parse_or_raise_format_error(changes: list[tuple[int, int]]) -> None:
    """Any bytes of the header changed: the file parses or raises GGUFFormatError, nothing else."""
    with tempfile.TemporaryDirectory() as folder:
        path = valid_small_file(Path(folder))
        raw = bytearray(path.read_bytes())
        header_end = read_header(path).data_offset
        for position, byte in changes:
            raw[position % header_end] = byte
        path.write_bytes(raw)
        try:
            header = read_header(path)
        except GGUFFormatError:
            return
        for field in header.fields.values():
            try:
                field.contents()
            except UnicodeDecodeError:  # a changed byte inside a string value, as in gguf's contents()
                pass


HUGE = 10**12


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (build(n_tensors=HUGE), "tensor count 1000000000000 needs at least"),
        (build(n_kv=HUGE), "key/value count 1000000000000 needs at least"),
        (build(kvs=[struct.pack("<Q", HUGE) + b"k"]), "a metadata key needs 1000000000000 bytes"),
        (build(kvs=[kv("s", V.STRING, struct.pack("<Q", HUGE))]), "a string needs 1000000000000 bytes"),
        (build(kvs=[kv("a", V.ARRAY, array(V.UINT8, b"\0", HUGE))]), "array length 1000000000000 needs"),
        (build(kvs=[kv("a", V.ARRAY, array(V.STRING, b"", HUGE))]), "array length 1000000000000 needs"),
        (build(kvs=[kv("a", V.ARRAY, array(V.STRING, struct.pack("<Q", HUGE), 1))]), "a string needs 1000000000000"),
        (build(kvs=[kv("a", V.ARRAY, array(V.ARRAY, array(V.INT64, b"", HUGE), 1))]), "array length 1000000000000"),
        (build(infos=[tensor_info("t", (2**24, 2**24))]), "tensors need 1125899906842720 bytes, the file has 96"),
        (build(infos=[tensor_info("t", (4,), offset=2**64 - 1)]), "tensors need"),
    ],
    ids=["tensors", "kvs", "key", "string", "array", "string-array", "array-string", "nested", "dims", "offset"],
)
def test_huge_counts_and_lengths_fail_at_once(tmp_path: Path, raw: bytes, match: str) -> None:
    assert len(raw) < 200
    path = write(tmp_path, raw)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(GGUFFormatError, match=match):
            read_header(path)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 0.5 and peak < 1_000_000


def test_versions_and_magic(tmp_path: Path) -> None:
    refused(tmp_path, build(version=1), "version 1 .*not supported")
    refused(tmp_path, build(version=4), "version 4 is not supported")
    refused(tmp_path, build(version=3 << 24), "big-endian")
    refused(tmp_path, b"GGML" + build()[4:], "not GGUF's magic")
    refused(tmp_path, b"", "0 bytes")
    refused(tmp_path, b"GGUF\x03\0", "the version needs 4 bytes but only 2 remain at byte 4")
    assert read_header(write(tmp_path, build(version=2))).version == 2


def test_arrays_nested_too_deep(tmp_path: Path) -> None:
    def nested(depth: int) -> bytes:
        value = array(V.UINT8, b"\1", 1)
        for _ in range(depth - 1):
            value = array(V.ARRAY, value, 1)
        return value

    read_header(write(tmp_path, build(kvs=[kv("a", V.ARRAY, nested(MAX_ARRAY_DEPTH))])))
    error = refused(tmp_path, build(kvs=[kv("a", V.ARRAY, nested(MAX_ARRAY_DEPTH + 1))]), "nest more than")
    assert f"at byte {24 + 8 + 1 + 4 + 12 * MAX_ARRAY_DEPTH}" in str(error)
    refused(tmp_path, build(kvs=[kv("a", V.ARRAY, nested(10_000))]), "nest more than")


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (build(kvs=[kv("k", 13, b"\0")]), "unknown value type 13 at byte 33"),
        (build(kvs=[kv("k", V.ARRAY, array(99, b"", 0))]), "unknown array element type 99"),
        (build(kvs=[kv("k", V.UINT8, b"\1"), kv("k", V.UINT8, b"\2")]), "duplicate key 'k' at byte 38"),
        (build(kvs=[kv("GGUF.version", V.UINT32, b"\3\0\0\0")]), "duplicate key 'GGUF.version'"),
        (build(kvs=[kv(b"\xff", V.UINT8, b"\1")]), "a metadata key is not valid UTF-8 at byte 24"),
        (build(kvs=[kv("general.alignment", V.UINT32, struct.pack("<I", 3))]), "power of two"),
        (build(kvs=[kv("general.alignment", V.UINT64, struct.pack("<Q", 32))]), "stored as UINT32"),
        (build(infos=[tensor_info(b"\xc3", (4,))], data=bytes(16)), "tensor name is not valid UTF-8"),
        (build(infos=[tensor_info("t", (4,)), tensor_info("t", (4,), offset=16)], data=bytes(32)),
         "duplicate tensor name 't'"),
        (build(infos=[tensor_info("t", (4,), ggml_type=31)], data=bytes(64)), "tensor 't' has unknown type 31"),
        (build(infos=[tensor_info("t", (), n_dims=0)], data=bytes(64)), "0 dimensions, not 1 to 4"),
        (build(infos=[tensor_info("t", (1,) * 5)], data=bytes(64)), "5 dimensions, not 1 to 4"),
        (build(infos=[tensor_info("t", (4, 0))], data=bytes(64)), r"shape \[4, 0\], with no or absurdly many"),
        (build(infos=[tensor_info("t", (2**40, 2**40))]), "absurdly many elements"),
        (build(infos=[tensor_info("t", (16,), ggml_type=Q.Q8_0)], data=bytes(64)), "not whole Q8_0 blocks of 32"),
        (build(infos=[tensor_info("t", (4,), offset=8)], data=bytes(16)), "its tensors need 88 bytes, the file has 80"),
        (build(infos=[tensor_info("t", (4,)), tensor_info("u", (4,))], data=bytes(32)),
         "tensors 't' and 'u' overlap: their data share bytes 96 to 111, at byte 96"),
        (build(infos=[tensor_info("big", (8,)), tensor_info("mid", (2,), offset=32), tensor_info("in", (2,), offset=8)],
               data=bytes(64)), "tensors 'big' and 'in' overlap"),
    ],
    ids=["value-type", "element-type", "duplicate-key", "duplicate-pseudo-key", "key-utf8", "alignment",
         "alignment-type", "name-utf8", "duplicate-tensor", "tensor-type", "no-dims", "five-dims", "zero-dim",
         "absurd-dims", "partial-block", "past-end", "same-data", "data-inside-another"],
)
def test_malformed_headers(tmp_path: Path, raw: bytes, match: str) -> None:
    refused(tmp_path, raw, match)


def test_open_gguf_words_both_failures(tmp_path: Path) -> None:
    short = write(tmp_path, build(infos=[tensor_info("t", (4,), offset=8)], data=bytes(16)), "short.gguf")
    with pytest.raises(QkvError, match=r"short.gguf is truncated: its tensors need 88 bytes, the file has 80$"):
        open_gguf(short)
    bad = write(tmp_path, build(version=1), "old.gguf")
    with pytest.raises(QkvError, match=r"old.gguf is not a readable GGUF file \(GGUFFormatError: GGUF version 1 .*"
                                       r"download it again"):
        open_gguf(bad)
