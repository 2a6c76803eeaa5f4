"""qkv.runtime.native.iq_grids: the grid types' tables rendered for the C++ build are the gguf
package's, row for row (the block products' tests check the decoded weights against the gguf
library's dequantizer on top of this)."""

from __future__ import annotations

import re

import numpy as np
from gguf import quants

from qkv.runtime.native import iq_grids


def parsed(text: str) -> dict[str, np.ndarray]:
    """Each table of the rendered header: name -> (rows, bytes a row), uint8 (IQ1_S's int8)."""
    tables = {}
    for ctype, name, body in re.findall(r"(uint64_t|uint32_t) (\w+_GRID)\[\d+\] = \{(.*?)\};", text, flags=re.S):
        width = 8 if ctype == "uint64_t" else 4
        words = [int(w, 16) for w in re.findall(r"0x[0-9a-f]+", body)]
        rows = np.array([[(w >> (8 * j)) & 0xFF for j in range(width)] for w in words], dtype=np.uint8)
        tables[name] = rows.view(np.int8) if name == "IQ1_S_GRID" else rows
    return tables


def test_every_table_is_the_gguf_packages_row_for_row() -> None:
    tables = parsed(iq_grids.render())
    assert set(tables) == {name for name, _ in iq_grids.GRIDS}
    for name, owner in iq_grids.GRIDS:
        cls = getattr(quants, owner)
        cls.init_grid()
        expected = np.asarray(cls.grid).reshape(cls.grid_shape)
        assert tables[name].shape == expected.shape, name
        assert np.array_equal(tables[name].astype(np.float32), expected), name


def test_the_build_key_follows_the_tables_source() -> None:
    assert iq_grids.source_bytes() == open(quants.__file__, "rb").read()
