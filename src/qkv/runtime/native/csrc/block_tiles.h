// Tiles of a block product for many rows at once (a prefill's): MR rows of rounded activations
// against NR rows of weights, each weight block unpacked once for the MR rows and each
// activation block loaded once for the NR rows (block_tiles_x86.h). Every output is computed by
// exactly the float operations of its type's one-row kernel (block_format.h's RowDot), so a
// row's outputs are the same bits whether it runs alone or in a tile.
//
// Shape legend: M rows of x, K inputs; a tile's outputs out[m * ldo + n], m < MR, n < NR.
#pragma once

#include "block_format.h"
#include "kernels.h"

namespace qkv {
namespace blocks {

// NR rows of weights (row, row + row_bytes, ...) against the MR rows xs[0 .. MR).
using TileDot = void (*)(const uint8_t *row, int64_t row_bytes, const XRow *xs, int64_t K, float *out, int64_t ldo);

struct Tile {
    TileDot run = nullptr;  // nullptr: the variant has no tile for the type
    int64_t mr = 0, nr = 0;
};

Tile tile_of(int64_t type, Variant v);
#if QKV_X86
Tile avx2_tile(int64_t type);    // block_avx2.cpp
Tile avx512_tile(int64_t type);  // block_avx512.cpp
#endif

// Outputs [n0, n1) of rows [0, M) of y (ldo apart; bias[n] added where not null) from rows
// [n0, n1) of `blocks`, in whole tiles: n1 - n0 a multiple of tile.nr, M of tile.mr.
void run_tiles(const Tile &tile, const uint8_t *blocks, int64_t row_bytes, int64_t n0, int64_t n1, const XRow *xs,
               int64_t M, int64_t K, const float *bias, float *y, int64_t ldo);

}  // namespace blocks
}  // namespace qkv
