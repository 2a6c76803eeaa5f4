// The tiles' dispatch (block_tiles.h): which variant's tile a type runs, and the walk over a
// task's outputs in tiles, a band of rows at a time so that the band's rounded activations
// stay in cache while every weight row of the task passes them.
#include "block_tiles.h"

namespace qkv {
namespace blocks {

namespace {
constexpr int64_t BAND = 64;  // rows of x a pass over the task's weights (64 x K int8: 128 KiB at K = 2048)
}

Tile tile_of(int64_t type, Variant v) {
#if QKV_X86
    if (v >= AVX512) return avx512_tile(type);
    if (v >= AVX2) return avx2_tile(type);
#endif
    (void)type, (void)v;
    return {};
}

void run_tiles(const Tile &tile, const uint8_t *blocks, int64_t row_bytes, int64_t n0, int64_t n1, const XRow *xs,
               int64_t M, int64_t K, const float *bias, float *y, int64_t ldo) {
    const int64_t band = std::max(tile.mr, BAND / tile.mr * tile.mr);
    for (int64_t m0 = 0; m0 < M; m0 += band) {
        const int64_t m1 = std::min(M, m0 + band);
        for (int64_t n = n0; n < n1; n += tile.nr)
            for (int64_t m = m0; m < m1; m += tile.mr) tile.run(blocks + n * row_bytes, row_bytes, xs + m, K, y + m * ldo + n, ldo);
    }
    if (bias != nullptr)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) y[m * ldo + n] += bias[n];
}

}  // namespace blocks
}  // namespace qkv
