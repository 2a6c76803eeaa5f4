// IQ4_XS_X16 (iq4xs.h): the byte permutation to and from the file's rows, and the generic C++
// product (the reference: the generic IQ4_XS product's operations, the same bits as the x86
// ones: iq4xs.h).
#include <string.h>

#include "../kernels.h"
#include "iq4xs.h"

namespace qkv {
namespace blocks {
namespace iq4xs {

const Traits *traits() {
    static const Traits t{IQ4_XS_X16, "IQ4_XS_X16", 256, sizeof(BlockIQ4_XS), PER256, nullptr};
    return &t;
}

namespace {

// Visit every (row block, tile) pair of groups [g0, g1): move(block, tile, r) copies one row's
// block to or from row r of its tile.
template <class Move>
void each_block(int64_t row_bytes, int64_t g0, int64_t g1, Move &&move) {
    constexpr int64_t Z = sizeof(BlockIQ4_XS);
    const int64_t supers = row_bytes / Z;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t i = 0; i < supers; i++)
            for (int64_t r = 0; r < ROWS; r++) move((g * ROWS + r) * row_bytes + i * Z, g * ROWS * row_bytes + i * TILE, r);
}

}  // namespace

void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block(row_bytes, g0, g1, [&](int64_t from, int64_t to, int64_t r) {
        const BlockIQ4_XS &b = *reinterpret_cast<const BlockIQ4_XS *>(rows + from);
        uint8_t *t = packed + to;
        memcpy(t + D + 2 * r, &b.d, 2);
        memcpy(t + SH + 2 * r, &b.scales_h, 2);
        memcpy(t + SL + 4 * r, b.scales_l, 4);
        for (int unit = 0; unit < 32; unit++) memcpy(t + QS + 64 * unit + 4 * r, b.qs + 4 * unit, 4);
    });
}

void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block(row_bytes, g0, g1, [&](int64_t to, int64_t from, int64_t r) {
        BlockIQ4_XS &b = *reinterpret_cast<BlockIQ4_XS *>(rows + to);
        const uint8_t *t = packed + from;
        memcpy(&b.d, t + D + 2 * r, 2);
        memcpy(&b.scales_h, t + SH + 2 * r, 2);
        memcpy(b.scales_l, t + SL + 4 * r, 4);
        for (int unit = 0; unit < 32; unit++) memcpy(b.qs + 4 * unit, t + QS + 64 * unit + 4 * r, 4);
    });
}

void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *, int count, float *out) {
    for (int m = 0; m < count; m++) {
        const XRow &x = xs[m];
        for (int64_t r = 0; r < ROWS; r++) {
            float acc = 0.f;
            for (int64_t i = 0; i < K / 256; i++) {
                const uint8_t *t = group + i * TILE;
                BlockIQ4_XS scales{};
                memcpy(&scales.scales_h, t + SH + 2 * r, 2);
                memcpy(scales.scales_l, t + SL + 4 * r, 4);
                const int8_t *c = x.q + 256 * i;
                int32_t isum = 0;
                for (int b = 0; b < 8; b++) {
                    int32_t dot = 0;
                    for (int s = 0; s < 4; s++)
                        for (int k = 0; k < 4; k++) {
                            const uint8_t q = t[QS + 64 * (4 * b + s) + 4 * r + k];
                            dot += IQ4_NL_VALUES[q & 15] * c[32 * b + 4 * s + k] + IQ4_NL_VALUES[q >> 4] * c[32 * b + 16 + 4 * s + k];
                        }
                    isum += (iq4_xs_scale(scales, b) - 32) * dot;
                }
                uint16_t d;
                memcpy(&d, t + D + 2 * r, 2);
                acc += (half_to_float(d) * x.d[i]) * static_cast<float>(isum);
            }
            out[m * ROWS + r] = acc;
        }
    }
}

}  // namespace iq4xs
}  // namespace blocks
}  // namespace qkv
