// Q8_0_X16 and Q5_0_X16 (q8_0.h): the byte permutation to and from the file's rows, the
// activations' code sums, and the generic C++ product (the reference: the generic 32-block
// product's operations, the same bits as the x86 ones: q8_0.h).
#include <stddef.h>
#include <string.h>

#include "../kernels.h"
#include "q8_0.h"

namespace qkv {
namespace blocks {
namespace q8_0 {

const Traits *traits(Type T) {
    static const Traits q8{Q8_0_X16, "Q8_0_X16", 32, sizeof(BlockQ8_0), PER32, nullptr};
    static const Traits q5{Q5_0_X16, "Q5_0_X16", 32, sizeof(BlockQ5_0), PER32, nullptr};
    return T == Q5_0 ? &q5 : &q8;
}

namespace {

// Visit every (row block, its place in the group) of groups [g0, g1): move copies one row's
// block i to or from the group (d at `d`, the block's weights from `body` on), r its row.
template <Type T, class Move>
void each_block(int64_t row_bytes, int64_t g0, int64_t g1, Move &&move) {
    const int64_t B = row_bytes / block_bytes(T);
    for (int64_t g = g0; g < g1; g++) {
        const int64_t group = g * ROWS * row_bytes;
        for (int64_t i = 0; i < B; i++)
            for (int64_t r = 0; r < ROWS; r++)
                move((g * ROWS + r) * row_bytes + i * block_bytes(T), group + 32 * i, group + 32 * B + body_bytes(T) * i, r);
    }
}

// The bytes of one row's block (its d apart) and their places in the group's body, as
// (offset in the block, offset in the body, length): Q8_0's 8 units of 4 codes; Q5_0's qh,
// then its 4 units of 4 bytes of nibbles.
template <Type T, class Copy>
void each_piece(int64_t r, Copy &&copy) {
    if constexpr (T == Q8_0) {
        for (int u = 0; u < 8; u++) copy(offsetof(BlockQ8_0, qs) + 4 * u, 64 * u + 4 * r, 4);
    } else {
        copy(offsetof(BlockQ5_0, qh), 4 * r, 4);
        for (int u = 0; u < 4; u++) copy(offsetof(BlockQ5_0, qs) + 4 * u, QH5 + 64 * u + 4 * r, 4);
    }
}

}  // namespace

template <Type T>
void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block<T>(row_bytes, g0, g1, [&](int64_t from, int64_t d, int64_t body, int64_t r) {
        memcpy(packed + d + 2 * r, rows + from, 2);  // d leads both blocks
        each_piece<T>(r, [&](int64_t at, int64_t to, int64_t n) { memcpy(packed + body + to, rows + from + at, n); });
    });
}

template <Type T>
void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block<T>(row_bytes, g0, g1, [&](int64_t to, int64_t d, int64_t body, int64_t r) {
        memcpy(rows + to, packed + d + 2 * r, 2);
        each_piece<T>(r, [&](int64_t at, int64_t from, int64_t n) { memcpy(rows + to + at, packed + body + from, n); });
    });
}

template void repack<Q8_0>(const uint8_t *, uint8_t *, int64_t, int64_t, int64_t);
template void repack<Q5_0>(const uint8_t *, uint8_t *, int64_t, int64_t, int64_t);
template void unrepack<Q8_0>(const uint8_t *, uint8_t *, int64_t, int64_t, int64_t);
template void unrepack<Q5_0>(const uint8_t *, uint8_t *, int64_t, int64_t, int64_t);

void code_sums(const int8_t *codes, int64_t K, int32_t *p) {
    for (int64_t i = 0; i < K / 32; i++) {
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) sum += codes[32 * i + j];
        p[i] = sum;
    }
}

namespace {

// Row r's 32 weights q (signed: Q5_0's code less 16) of the block whose body starts at `body`.
template <Type T>
void block_weights(const uint8_t *body, int64_t r, int q[32]) {
    if constexpr (T == Q8_0) {
        for (int u = 0; u < 8; u++)
            for (int k = 0; k < 4; k++) q[4 * u + k] = static_cast<int8_t>(body[64 * u + 4 * r + k]);
    } else {
        uint32_t qh;
        memcpy(&qh, body + 4 * r, 4);
        for (int u = 0; u < 4; u++)
            for (int k = 0; k < 4; k++) {
                const uint8_t byte = body[QH5 + 64 * u + 4 * r + k];
                const int j = 4 * u + k;
                q[j] = static_cast<int>((byte & 15) | (((qh >> j) & 1) << 4)) - 16;
                q[j + 16] = static_cast<int>((byte >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
            }
    }
}

}  // namespace

template <Type T>
void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *, int count, float *out) {
    const int64_t B = K / 32;
    const uint8_t *bodies = group + 32 * B;
    for (int m = 0; m < count; m++) {
        const XRow &x = xs[m];
        for (int64_t r = 0; r < ROWS; r++) {
            float acc = 0.f;
            for (int64_t i = 0; i < B; i++) {
                const int8_t *c = x.q + 32 * i;
                int q[32];
                block_weights<T>(bodies + body_bytes(T) * i, r, q);
                int32_t isum = 0;
                for (int j = 0; j < 32; j++) isum += q[j] * c[j];
                uint16_t d;
                memcpy(&d, group + 32 * i + 2 * r, 2);
                acc += (half_to_float(d) * x.d[i]) * static_cast<float>(isum);
            }
            out[m * ROWS + r] = acc;
        }
    }
}

template void generic_group<Q8_0>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);
template void generic_group<Q5_0>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);

}  // namespace q8_0
}  // namespace blocks
}  // namespace qkv
