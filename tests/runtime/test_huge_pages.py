"""place_on_huge_pages: large tensors move into one mapping advised for 2 MB pages, the
same objects (tied weights still tied), the same numbers, small tensors left alone; arenas
watched as they fault in take 4 KB pages once 2 MB ones come slowly; QKV_HUGE_PAGES decides."""

from __future__ import annotations

import sys

import pytest
import torch

from qkv.models.gpt2 import GPT2Decoder
from qkv.models.configs.gpt2 import GPTConfig
from qkv.runtime import huge_pages
from qkv.runtime.huge_pages import SMALLEST, huge_ones, huge_pages_supported, place_on_huge_pages

pytestmark = pytest.mark.skipif(not huge_pages_supported(), reason="this Python has no mmap.madvise(MADV_HUGEPAGE)")


@pytest.fixture(autouse=True)
def _on_huge_pages(monkeypatch):
    """The placement tests take 2 MB pages without watching (QKV_HUGE_PAGES=1), whatever this
    machine's faults cost; the watch tests below unset it. The process's verdict is restored."""
    monkeypatch.setenv("QKV_HUGE_PAGES", "1")
    slow = huge_pages._Seen.slow
    yield
    huge_pages._Seen.slow = slow


def _advised_ranges(flag: str = "hg") -> list[tuple[int, int]]:
    """Address ranges of this process's mappings flagged `flag` in smaps ("hg": MADV_HUGEPAGE,
    "nh": MADV_NOHUGEPAGE)."""
    ranges, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                current = (start, end)
            elif head == "VmFlags:" and flag in line.split()[1:] and current is not None:
                ranges.append(current)
    return ranges


def _inside(address: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= address < end for start, end in ranges)


def _assert_plain(make) -> None:
    """`make()` returns plain memory: no new arena (qkv's 2 MB-page mappings) and none of the live
    ones. Not "outside every range smaps flags huge": where the allocator puts a plain tensor
    depends on what ran before in the process, and a CI worker's 1 MB tensor landed in such a
    range without any arena made for it."""
    before = set(huge_pages._ADVISED)
    tensor = make()
    assert set(huge_pages._ADVISED) <= before
    assert not _inside(tensor.data_ptr(), list(huge_pages._ADVISED.values()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux's")
def test_an_arena_faulting_in_slowly_takes_small_pages_for_the_rest(monkeypatch) -> None:
    """Watched (QKV_HUGE_PAGES unset) with a limit no chunk meets, an arena's first chunk stays
    advised for 2 MB pages, the rest is advised for small ones, its bytes are zeros, and the
    process takes no more 2 MB pages; with a limit every chunk meets, all of it stays huge."""
    monkeypatch.delenv("QKV_HUGE_PAGES")
    huge_pages._Seen.slow = False
    roomy = huge_pages._arena(3 * huge_pages.CHUNK, limit=float("inf"))
    assert not huge_pages._Seen.slow and huge_pages.huge_pages_pay()
    assert _inside(roomy.data_ptr(), _advised_ranges()) and _inside(roomy.data_ptr() + roomy.numel() - 1, _advised_ranges())
    arena = huge_pages._arena(3 * huge_pages.CHUNK, limit=0.0)
    assert arena.numel() == 3 * huge_pages.CHUNK and not bool(arena.any())
    assert huge_pages._Seen.slow and not huge_pages.huge_pages_pay()
    first, rest = arena.data_ptr(), arena.data_ptr() + huge_pages.CHUNK
    assert _inside(first, _advised_ranges("hg")) and not _inside(first, _advised_ranges("nh"))
    assert _inside(rest, _advised_ranges("nh")) and _inside(arena.data_ptr() + arena.numel() - 1, _advised_ranges("nh"))
    _assert_plain(lambda: huge_pages.huge_empty(SMALLEST // 512, 1024))
    model = torch.nn.Module()
    model.register_buffer("weight", torch.ones(SMALLEST))
    assert place_on_huge_pages(model) == 0


def test_qkv_huge_pages_0_keeps_weights_on_plain_memory(monkeypatch) -> None:
    monkeypatch.setenv("QKV_HUGE_PAGES", "0")
    assert not huge_pages.huge_pages_pay()
    model = torch.nn.Module()
    model.register_buffer("weight", torch.ones(SMALLEST))
    pointer = model.weight.data_ptr()
    assert place_on_huge_pages(model) == 0 and model.weight.data_ptr() == pointer
    _assert_plain(lambda: huge_pages.huge_empty(SMALLEST // 512, 1024))


def test_a_misspelt_qkv_huge_pages_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv("QKV_HUGE_PAGES", "maybe")
    with pytest.raises(ValueError, match="QKV_HUGE_PAGES='maybe'"):
        huge_pages.huge_pages_pay()


def test_large_tensors_move_to_advised_memory_and_keep_their_numbers() -> None:
    torch.manual_seed(0)
    model = GPT2Decoder(GPTConfig(vocab_size=4096, context_length=32, emb_dim=128, n_heads=4, n_layers=2,
                               drop_rate=0.0)).eval()
    model.tie_weights()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(ids)
    head = model.out_head.weight
    small = model.final_norm.scale
    small_pointer = small.data_ptr()
    moved = place_on_huge_pages(model)
    assert moved >= head.numel() * 4 >= SMALLEST
    assert model.out_head.weight is head and model.tok_emb.weight is head  # same objects, still tied
    assert small.data_ptr() == small_pointer  # below SMALLEST: left where it was
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    if sys.platform.startswith("linux"):
        assert any(start <= head.data_ptr() < end for start, end in _advised_ranges())
        assert head.data_ptr() % 64 == 0


def test_an_embedding_table_read_a_row_at_a_time_stays() -> None:
    torch.manual_seed(0)
    model = GPT2Decoder(GPTConfig(vocab_size=4096, context_length=32, emb_dim=128, n_heads=4, n_layers=1,
                               drop_rate=0.0)).eval()  # untied: the head has its own weight
    table = model.tok_emb.weight.data_ptr()
    place_on_huge_pages(model)
    assert model.tok_emb.weight.data_ptr() == table
    if sys.platform.startswith("linux"):
        assert any(start <= model.out_head.weight.data_ptr() < end for start, end in _advised_ranges())


def test_views_of_one_storage_stay_views_of_one_storage() -> None:
    flat = torch.arange(2 * SMALLEST // 4, dtype=torch.float32)
    module = torch.nn.Module()
    module.register_buffer("first", flat[: SMALLEST // 4])
    module.register_buffer("second", flat[SMALLEST // 4:])
    place_on_huge_pages(module)
    assert module.first.untyped_storage().data_ptr() == module.second.untyped_storage().data_ptr()
    assert torch.equal(torch.cat([module.first, module.second]), torch.arange(2 * SMALLEST // 4, dtype=torch.float32))


def test_huge_ones_are_ones_on_advised_memory() -> None:
    probe = huge_ones(SMALLEST)  # 4 MB of float32
    assert probe.shape == (SMALLEST,) and probe.dtype == torch.float32 and bool((probe == 1).all())
    if sys.platform.startswith("linux"):
        assert any(start <= probe.data_ptr() < end for start, end in _advised_ranges())


def test_views_of_a_file_mapping_stay_on_the_file(tmp_path) -> None:
    """A large tensor that is a view of a file's mapping (as a GGUF file's blocks are) is left
    on the file's pages, with its numbers; an ordinary tensor beside it moves."""
    import mmap

    from qkv.runtime.huge_pages import file_mapped_ranges

    torch.manual_seed(0)
    values = torch.randn(2 * SMALLEST // 4)
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    on_file = torch.frombuffer(mapping, dtype=torch.float32)
    model = torch.nn.Module()
    model.register_buffer("on_file", on_file)
    model.register_buffer("in_memory", values.clone())
    file_pointer, memory_pointer = on_file.data_ptr(), model.in_memory.data_ptr()
    if sys.platform.startswith("linux"):
        assert any(start <= file_pointer < end for start, end in file_mapped_ranges())
        assert not any(start <= memory_pointer < end for start, end in file_mapped_ranges())
    moved = place_on_huge_pages(model)
    assert model.on_file.data_ptr() == file_pointer and torch.equal(model.on_file, values)
    assert moved == values.numel() * 4 and model.in_memory.data_ptr() != memory_pointer
    assert torch.equal(model.in_memory, values)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")
def test_file_maps_fixed_reads_the_maps_once(tmp_path):
    """Inside `file_maps_fixed` the file ranges are the reading taken on entry (a file mapped
    inside is not in them); after it, each call reads /proc/self/maps again and sees it."""
    import mmap

    from qkv.runtime.huge_pages import file_mapped_ranges, file_maps_fixed

    path = tmp_path / "later.bin"
    path.write_bytes(bytes(4 * mmap.PAGESIZE))
    with file_maps_fixed():
        before = file_mapped_ranges()
        with open(path, "rb") as handle:
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)  # as a GGUF file is mapped
        pointer = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
        assert file_mapped_ranges() == before
        assert not any(start <= pointer < end for start, end in file_mapped_ranges())
    assert any(start <= pointer < end for start, end in file_mapped_ranges())


def test_a_matrix_made_on_huge_pages_is_not_copied_again() -> None:
    """`huge_empty` memory (where a repacked matrix is written at load) is advised for 2 MB
    pages, and `place_on_huge_pages` leaves it where it is."""
    from qkv.runtime.huge_pages import huge_empty

    made = huge_empty(SMALLEST // 512, 1024)
    made.fill_(7)
    model = torch.nn.Module()
    model.register_buffer("made", made)
    pointer = made.data_ptr()
    assert place_on_huge_pages(model) == 0 and model.made.data_ptr() == pointer
    if sys.platform.startswith("linux"):
        assert any(start <= pointer < end for start, end in _advised_ranges())


def _resident_kb(path) -> int:
    """This process's resident kB of the mappings of the file at `path` (smaps' Rss)."""
    total, current = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                current = len(fields) >= 6 and fields[5] == str(path)
            elif fields[0] == "Rss:" and current:
                total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps and madvise are Linux's")
def test_released_file_pages_leave_the_process_and_read_back_the_same(tmp_path) -> None:
    """`release_file_pages` on a view of a file's copy-on-write mapping (as a GGUF file's blocks
    are, once repacked elsewhere): its whole pages stop being resident in this process, a page
    only partly its own stays, and reading the view again gives the file's bytes."""
    import mmap

    from qkv.runtime.huge_pages import release_file_pages

    torch.manual_seed(0)
    values = torch.randn(64 * mmap.PAGESIZE // 4)  # 64 pages of float32
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    on_file = torch.frombuffer(mapping, dtype=torch.float32)
    assert torch.equal(on_file, values)  # every page read, so resident
    before = _resident_kb(path)
    assert before >= 64 * mmap.PAGESIZE // 1024
    quarter = mmap.PAGESIZE // 4 // 4  # floats in a quarter page
    part = on_file[quarter:]  # starts a quarter into page 0: pages 1..63 are wholly its own
    assert release_file_pages(part) == 63 * mmap.PAGESIZE
    assert _resident_kb(path) == before - 63 * mmap.PAGESIZE // 1024
    assert torch.equal(on_file, values)  # faulted back in from the file, the same bytes
    assert release_file_pages(values) == 0  # not a file's: nothing to release
