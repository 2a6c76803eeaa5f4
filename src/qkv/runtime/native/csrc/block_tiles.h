// Tiles of a block product for many rows at once (a prefill's): a band of up to BAND rows of
// rounded activations against NR rows of weights, each weight block unpacked once for the
// whole band and each activation block loaded once for the NR rows (block_tiles_x86.h), the
// band's accumulators in a scratch of the tile's own. Every output is computed by
// exactly the float operations of its type's one-row kernel (block_format.h's RowDot), so a
// row's outputs are the same bits whether it runs alone or in a tile.
//
// Shape legend: M rows of x, K inputs; a tile's outputs out[m * ldo + n], m < M <= BAND, n < NR.
#pragma once

#include <vector>

#include "block_format.h"
#include "kernels.h"

namespace qkv {
namespace blocks {

constexpr int64_t TILE_ROWS = 4;  // fewer rows (a decode step) run the one-row kernels alone
constexpr int64_t BAND = 64;  // rows of x a tile takes (64 x K int8: 128 KiB at K = 2048, in cache)

// NR rows of weights (row, row + row_bytes, ...) against the M <= BAND rows xs[0 .. M), or
// `prepared`: those rows as the tile's prepare laid them out.
using TileDot = void (*)(const uint8_t *row, int64_t row_bytes, const XRow *xs, int64_t M, int64_t K, const void *prepared,
                         float *out, int64_t ldo);

struct Tile {
    TileDot run = nullptr;  // nullptr: the variant has no tile for the type
    int64_t nr = 0;
    // a tile reading the activations in a layout of its own: the bytes of M rows (M a multiple of
    // BAND: where the next band begins) and the layout's making, once a product for all its rows
    int64_t (*prepared_bytes)(int64_t M, int64_t K) = nullptr;
    void (*prepare)(const XRow *xs, int64_t M, int64_t K, void *prepared) = nullptr;
};

// Each part's activations as its tile reads them (at[p] null where the tile reads xs as they
// are), made before a product's outputs are split over the threads.
struct PreparedParts {
    std::vector<uint8_t> bytes[MAX_PARTS];
    const void *at[MAX_PARTS] = {};
};
void prepare_parts(const Linear &L, const XRow *rows32, const XRow *rows256, int64_t M, Variant v, PreparedParts &out);

Tile tile_of(int64_t type, Variant v);
#if QKV_X86
Tile avx2_tile(int64_t type);    // block_avx2.cpp
Tile avx512_tile(int64_t type);  // block_avx512.cpp
#endif

// Outputs [n0, n1) of rows [0, M) of y (ldo apart; bias[n] added where not null) from rows
// [n0, n1) of `blocks`, in whole tiles (n1 - n0 a multiple of tile.nr), a band of rows at a time.
void run_tiles(const Tile &tile, const uint8_t *blocks, int64_t row_bytes, int64_t n0, int64_t n1, const XRow *xs,
               int64_t M, int64_t K, const void *prepared, const float *bias, float *y, int64_t ldo);

}  // namespace blocks
}  // namespace qkv
