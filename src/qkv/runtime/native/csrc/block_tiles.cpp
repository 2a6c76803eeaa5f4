// The tiles' dispatch (block_tiles.h): which variant's tile a type runs, and the walk over a
// task's outputs in tiles, a band of rows at a time so that the band's rounded activations
// stay in cache while every weight row of the task passes them.
#include "block_tiles.h"

namespace qkv {
namespace blocks {

Tile tile_of(int64_t type, Variant v) {
#if QKV_X86
    if (v >= AVX512) return avx512_tile(type);
    if (v >= AVX2) return avx2_tile(type);
#endif
    (void)type, (void)v;
    return {};
}

void prepare_parts(const Linear &L, const XRow *rows32, const XRow *rows256, int64_t M, Variant v, PreparedParts &out) {
    for (int64_t p = 0; p < L.part_count; p++) {
        const Tile tile = tile_of(L.parts[p].type, v);
        if (tile.prepare == nullptr || M < TILE_ROWS) continue;
        std::vector<uint8_t> &bytes = out.bytes[p];
        bytes.resize(static_cast<size_t>(tile.prepared_bytes(M, L.K) + 64));
        uint8_t *at = bytes.data() + (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64;
        tile.prepare(traits_of(L.parts[p].type)->activation == PER32 ? rows32 : rows256, M, L.K, at);
        out.at[p] = at;
    }
}

void run_tiles(const Tile &tile, const uint8_t *blocks, int64_t row_bytes, int64_t n0, int64_t n1, const XRow *xs,
               int64_t M, int64_t K, const void *prepared, const float *bias, float *y, int64_t ldo) {
    for (int64_t m0 = 0; m0 < M; m0 += BAND) {
        const void *band = prepared ? static_cast<const uint8_t *>(prepared) + tile.prepared_bytes(m0, K) : nullptr;
        for (int64_t n = n0; n < n1; n += tile.nr)
            tile.run(blocks + n * row_bytes, row_bytes, xs + m0, std::min(BAND, M - m0), K, band, y + m0 * ldo + n, ldo);
    }
    if (bias != nullptr)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) y[m * ldo + n] += bias[n];
}

}  // namespace blocks
}  // namespace qkv
