// Q4_K_X16 and Q5_K_X16 (q4k.h): the byte permutation to and from the file's rows, the
// minimums' activation sums, and the generic C++ product (the reference, the same bits as the
// x86 ones: q4k.h).
#include <math.h>
#include <string.h>

#include <type_traits>

#include "../kernels.h"
#include "q4k.h"

namespace qkv {
namespace blocks {
namespace q4k {

const Traits *traits(Type T) {
    static const Traits four{Q4_K_X16, "Q4_K_X16", 256, sizeof(BlockQ4_K), PER256, nullptr};
    static const Traits five{Q5_K_X16, "Q5_K_X16", 256, sizeof(BlockQ5_K), PER256, nullptr};
    return T == Q5_K ? &five : &four;
}

namespace {

template <Type T>
using Block = std::conditional_t<T == Q5_K, BlockQ5_K, BlockQ4_K>;

// Visit every (row block, tile bytes) pair of groups [g0, g1): move(block, tile, r) copies one
// row's block to or from row r of its tile.
template <Type T, class Move>
void each_block(int64_t row_bytes, int64_t g0, int64_t g1, Move &&move) {
    constexpr int64_t Z = sizeof(Block<T>);
    const int64_t supers = row_bytes / Z;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t i = 0; i < supers; i++)
            for (int64_t r = 0; r < ROWS; r++) move((g * ROWS + r) * row_bytes + i * Z, g * ROWS * row_bytes + i * tile_bytes(T), r);
}

}  // namespace

template <Type T>
void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block<T>(row_bytes, g0, g1, [&](int64_t from, int64_t to, int64_t r) {
        const Block<T> &b = *reinterpret_cast<const Block<T> *>(rows + from);
        uint8_t *t = packed + to;
        memcpy(t + D + 2 * r, &b.d, 2);
        memcpy(t + DMIN + 2 * r, &b.dmin, 2);
        memcpy(t + SA + 4 * r, b.scales, 4);
        memcpy(t + SB + 4 * r, b.scales + 4, 4);
        memcpy(t + SC + 4 * r, b.scales + 8, 4);
        for (int unit = 0; unit < 32; unit++) memcpy(t + QS + 64 * unit + 4 * r, b.qs + 4 * unit, 4);
        if constexpr (T == Q5_K)
            for (int unit = 0; unit < 8; unit++) memcpy(t + QH + 64 * unit + 4 * r, b.qh + 4 * unit, 4);
    });
}

template <Type T>
void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block<T>(row_bytes, g0, g1, [&](int64_t to, int64_t from, int64_t r) {
        Block<T> &b = *reinterpret_cast<Block<T> *>(rows + to);
        const uint8_t *t = packed + from;
        memcpy(&b.d, t + D + 2 * r, 2);
        memcpy(&b.dmin, t + DMIN + 2 * r, 2);
        memcpy(b.scales, t + SA + 4 * r, 4);
        memcpy(b.scales + 4, t + SB + 4 * r, 4);
        memcpy(b.scales + 8, t + SC + 4 * r, 4);
        for (int unit = 0; unit < 32; unit++) memcpy(b.qs + 4 * unit, t + QS + 64 * unit + 4 * r, 4);
        if constexpr (T == Q5_K)
            for (int unit = 0; unit < 8; unit++) memcpy(b.qh + 4 * unit, t + QH + 64 * unit + 4 * r, 4);
    });
}

template void repack<Q4_K>(const uint8_t *, uint8_t *, int64_t, int64_t, int64_t);
template void repack<Q5_K>(const uint8_t *, uint8_t *, int64_t, int64_t, int64_t);
template void unrepack<Q4_K>(const uint8_t *, uint8_t *, int64_t, int64_t, int64_t);
template void unrepack<Q5_K>(const uint8_t *, uint8_t *, int64_t, int64_t, int64_t);

void minimum_sums(const int16_t *sums16, int64_t K, int32_t *p) {
    for (int64_t i = 0; i < K / 256; i++, sums16 += 16, p += 4) {
        int32_t s32[8];
        for (int j = 0; j < 8; j++) s32[j] = sums16[2 * j] + sums16[2 * j + 1];
        const int pairs[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
        for (int k = 0; k < 4; k++)
            p[k] = static_cast<int32_t>((static_cast<uint32_t>(s32[pairs[k][0]]) & 0xFFFFu) | (static_cast<uint32_t>(s32[pairs[k][1]]) << 16));
    }
}

template <Type T>
void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *, int count, float *out) {
    for (int m = 0; m < count; m++) {
        const XRow &x = xs[m];
        for (int64_t r = 0; r < ROWS; r++) {
            float acc = 0.f, macc = 0.f;
            for (int64_t i = 0; i < K / 256; i++) {
                const uint8_t *t = group + i * tile_bytes(T);
                uint8_t packed[12], sc[8], mn[8];
                memcpy(packed, t + SA + 4 * r, 4);
                memcpy(packed + 4, t + SB + 4 * r, 4);
                memcpy(packed + 8, t + SC + 4 * r, 4);
                scale_min_k4(packed, sc, mn);
                const int8_t *c = x.q + 256 * i;
                const int16_t *sums = x.sums + 16 * i;
                int32_t isum = 0, msum = 0;
                for (int j = 0; j < 4; j++) {
                    int32_t lo = 0, hi = 0;
                    for (int s = 0; s < 8; s++)
                        for (int k = 0; k < 4; k++) {
                            const uint8_t q = t[QS + 64 * (8 * j + s) + 4 * r + k];
                            int low = q & 15, high = q >> 4;
                            if constexpr (T == Q5_K) {
                                const uint8_t h = t[QH + 64 * s + 4 * r + k];
                                low |= ((h >> (2 * j)) & 1) << 4;
                                high |= ((h >> (2 * j + 1)) & 1) << 4;
                            }
                            lo += low * c[64 * j + 4 * s + k];
                            hi += high * c[64 * j + 32 + 4 * s + k];
                        }
                    isum += sc[2 * j] * lo + sc[2 * j + 1] * hi;
                }
                for (int j = 0; j < 8; j++) msum += mn[j] * (sums[2 * j] + sums[2 * j + 1]);
                uint16_t d, dmin;
                memcpy(&d, t + D + 2 * r, 2);
                memcpy(&dmin, t + DMIN + 2 * r, 2);
                const float dx = x.d[i];
                acc = fmaf(half_to_float(d) * dx, static_cast<float>(isum), acc);
                macc = fmaf(half_to_float(dmin) * dx, static_cast<float>(msum), macc);
            }
            out[m * ROWS + r] = acc - macc;
        }
    }
}

template void generic_group<Q4_K>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);
template void generic_group<Q5_K>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);

}  // namespace q4k
}  // namespace blocks
}  // namespace qkv
