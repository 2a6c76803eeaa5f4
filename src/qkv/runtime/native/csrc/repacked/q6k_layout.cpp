// Q6_K_X16 (q6k.h): the byte permutation to and from the file's rows, and the generic C++
// product (the reference, the same bits as the x86 ones: q6k.h).
#include <math.h>
#include <string.h>

#include "../kernels.h"
#include "q6k.h"

namespace qkv {
namespace blocks {
namespace q6k {

const Traits *traits() {
    static const Traits t{Q6_K_X16, "Q6_K_X16", 256, sizeof(BlockQ6_K), PER256, nullptr};
    return &t;
}

namespace {

// Visit every (row block, tile bytes, row) of groups [g0, g1).
template <class Move>
void each_block(int64_t row_bytes, int64_t g0, int64_t g1, Move &&move) {
    const int64_t supers = row_bytes / static_cast<int64_t>(sizeof(BlockQ6_K));
    for (int64_t g = g0; g < g1; g++)
        for (int64_t i = 0; i < supers; i++)
            for (int64_t r = 0; r < ROWS; r++)
                move((g * ROWS + r) * row_bytes + i * static_cast<int64_t>(sizeof(BlockQ6_K)), g * ROWS * row_bytes + i * TILE, r);
}

// The 6-bit code of weight 128 n + 32 t + 4 l + k of row r in tile t_.
inline int code(const uint8_t *tile, int64_t r, int n, int t, int l, int k) {
    const uint8_t ql = tile[QL + 64 * (16 * n + 8 * (t & 1) + l) + 4 * r + k];
    const uint8_t qh = tile[QH + 64 * (8 * n + l) + 4 * r + k];
    return ((t < 2 ? ql : ql >> 4) & 15) | (((qh >> (2 * t)) & 3) << 4);
}

}  // namespace

void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block(row_bytes, g0, g1, [&](int64_t from, int64_t to, int64_t r) {
        const BlockQ6_K &b = *reinterpret_cast<const BlockQ6_K *>(rows + from);
        uint8_t *t = packed + to;
        for (int u = 0; u < 32; u++) memcpy(t + QL + 64 * u + 4 * r, b.ql + 4 * u, 4);
        for (int v = 0; v < 16; v++) memcpy(t + QH + 64 * v + 4 * r, b.qh + 4 * v, 4);
        for (int k = 0; k < 4; k++) memcpy(t + SC + 64 * k + 4 * r, b.scales + 4 * k, 4);
        memcpy(t + D + 2 * r, &b.d, 2);
    });
}

void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block(row_bytes, g0, g1, [&](int64_t to, int64_t from, int64_t r) {
        BlockQ6_K &b = *reinterpret_cast<BlockQ6_K *>(rows + to);
        const uint8_t *t = packed + from;
        for (int u = 0; u < 32; u++) memcpy(b.ql + 4 * u, t + QL + 64 * u + 4 * r, 4);
        for (int v = 0; v < 16; v++) memcpy(b.qh + 4 * v, t + QH + 64 * v + 4 * r, 4);
        for (int k = 0; k < 4; k++) memcpy(b.scales + 4 * k, t + SC + 64 * k + 4 * r, 4);
        memcpy(&b.d, t + D + 2 * r, 2);
    });
}

void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *, int count, float *out) {
    for (int m = 0; m < count; m++) {
        const XRow &x = xs[m];
        for (int64_t r = 0; r < ROWS; r++) {
            float acc = 0.f;
            for (int64_t i = 0; i < K / 256; i++) {
                const uint8_t *t = group + i * TILE;
                const int8_t *c = x.q + 256 * i;
                int32_t sub[16] = {};
                for (int n = 0; n < 2; n++)
                    for (int tt = 0; tt < 4; tt++)
                        for (int l = 0; l < 8; l++)
                            for (int k = 0; k < 4; k++)
                                sub[8 * n + 2 * tt + l / 4] += code(t, r, n, tt, l, k) * c[128 * n + 32 * tt + 4 * l + k];
                int32_t isum = 0;
                for (int j = 0; j < 16; j++)
                    isum += static_cast<int8_t>(t[SC + 64 * (j / 4) + 4 * r + j % 4]) * (sub[j] - 32 * x.sums[16 * i + j]);
                uint16_t d;
                memcpy(&d, t + D + 2 * r, 2);
                acc = fmaf(half_to_float(d) * x.d[i], static_cast<float>(isum), acc);
            }
            out[m * ROWS + r] = acc;
        }
    }
}

}  // namespace q6k
}  // namespace blocks
}  // namespace qkv
