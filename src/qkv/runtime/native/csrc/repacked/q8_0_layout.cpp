// Q8_0_X16 (q8_0.h): the byte permutation to and from the file's rows, the AVX-512 kernel's
// offsets, and the generic C++ product (the reference: the generic Q8_0 product's operations,
// the same bits as the x86 ones: q8_0.h).
#include <string.h>

#include "../kernels.h"
#include "q8_0.h"

namespace qkv {
namespace blocks {
namespace q8_0 {

const Traits *traits() {
    static const Traits t{Q8_0_X16, "Q8_0_X16", 32, sizeof(BlockQ8_0), PER32, nullptr};
    return &t;
}

namespace {

// Visit every (row block, d bytes, qs bytes, row) of groups [g0, g1): move copies one row's
// block to or from its place in the group.
template <class Move>
void each_block(int64_t row_bytes, int64_t g0, int64_t g1, Move &&move) {
    const int64_t B = row_bytes / Z;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t group = g * ROWS * row_bytes;
        for (int64_t i = 0; i < B; i++)
            for (int64_t r = 0; r < ROWS; r++) move((g * ROWS + r) * row_bytes + i * Z, group + 32 * i, group + 32 * B + UNITS * i, r);
    }
}

}  // namespace

void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block(row_bytes, g0, g1, [&](int64_t from, int64_t d, int64_t qs, int64_t r) {
        const BlockQ8_0 &b = *reinterpret_cast<const BlockQ8_0 *>(rows + from);
        memcpy(packed + d + 2 * r, &b.d, 2);
        for (int u = 0; u < 8; u++) memcpy(packed + qs + 64 * u + 4 * r, b.qs + 4 * u, 4);
    });
}

void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block(row_bytes, g0, g1, [&](int64_t to, int64_t d, int64_t qs, int64_t r) {
        BlockQ8_0 &b = *reinterpret_cast<BlockQ8_0 *>(rows + to);
        memcpy(&b.d, packed + d + 2 * r, 2);
        for (int u = 0; u < 8; u++) memcpy(b.qs + 4 * u, packed + qs + 64 * u + 4 * r, 4);
    });
}

void offsets(const int8_t *codes, int64_t K, int32_t *p) {
    for (int64_t i = 0; i < K / 32; i++) {
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) sum += codes[32 * i + j];
        p[i] = -128 * sum;
    }
}

void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *, int count, float *out) {
    const int64_t B = K / 32;
    const int8_t *qs = reinterpret_cast<const int8_t *>(group + 32 * B);
    for (int m = 0; m < count; m++) {
        const XRow &x = xs[m];
        for (int64_t r = 0; r < ROWS; r++) {
            float acc = 0.f;
            for (int64_t i = 0; i < B; i++) {
                const int8_t *c = x.q + 32 * i;
                int32_t isum = 0;
                for (int u = 0; u < 8; u++)
                    for (int k = 0; k < 4; k++) isum += qs[UNITS * i + 64 * u + 4 * r + k] * c[4 * u + k];
                uint16_t d;
                memcpy(&d, group + 32 * i + 2 * r, 2);
                acc += (half_to_float(d) * x.d[i]) * static_cast<float>(isum);
            }
            out[m * ROWS + r] = acc;
        }
    }
}

}  // namespace q8_0
}  // namespace blocks
}  // namespace qkv
