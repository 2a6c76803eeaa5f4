// Q6_K_X16 (q6k.h): the byte permutation to and from the file's rows, the rows' offsets, and the
// generic C++ product (the reference: the generic Q6_K product's operations, the same bits as the
// x86 ones: q6k.h).
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

// Visit every (row block, tile) pair of groups [g0, g1): move(block, tile, r) copies one row's
// block to or from row r of its tile.
template <class Move>
void each_block(int64_t row_bytes, int64_t g0, int64_t g1, Move &&move) {
    constexpr int64_t Z = sizeof(BlockQ6_K);
    const int64_t supers = row_bytes / Z;
    for (int64_t g = g0; g < g1; g++)
        for (int64_t i = 0; i < supers; i++)
            for (int64_t r = 0; r < ROWS; r++) move((g * ROWS + r) * row_bytes + i * Z, g * ROWS * row_bytes + i * TILE, r);
}

// Weight w's code 0..63 in a tile, row r (the layout of q6k.h).
inline int code(const uint8_t *t, int64_t r, int w) {
    const int h = w / 128, k = (w / 32) % 4, l = w % 32;  // quarter k of half h, offset l
    const uint8_t low = t[ql_at(16 * h + 8 * (k % 2) + l / 4) + 4 * r + l % 4];
    const uint8_t high = t[qh_at(8 * h + l / 4) + 4 * r + l % 4];
    return ((low >> (4 * (k / 2))) & 15) | (((high >> (2 * k)) & 3) << 4);
}

}  // namespace

void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block(row_bytes, g0, g1, [&](int64_t from, int64_t to, int64_t r) {
        const BlockQ6_K &b = *reinterpret_cast<const BlockQ6_K *>(rows + from);
        uint8_t *t = packed + to;
        memcpy(t + D + 2 * r, &b.d, 2);
        for (int j = 0; j < 16; j++) t[SC + 16 * j + r] = static_cast<uint8_t>(b.scales[j]);
        for (int u = 0; u < 32; u++) memcpy(t + ql_at(u) + 4 * r, b.ql + 4 * u, 4);
        for (int v = 0; v < 16; v++) memcpy(t + qh_at(v) + 4 * r, b.qh + 4 * v, 4);
    });
}

void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1) {
    each_block(row_bytes, g0, g1, [&](int64_t to, int64_t from, int64_t r) {
        BlockQ6_K &b = *reinterpret_cast<BlockQ6_K *>(rows + to);
        const uint8_t *t = packed + from;
        memcpy(&b.d, t + D + 2 * r, 2);
        for (int j = 0; j < 16; j++) b.scales[j] = static_cast<int8_t>(t[SC + 16 * j + r]);
        for (int u = 0; u < 32; u++) memcpy(b.ql + 4 * u, t + ql_at(u) + 4 * r, 4);
        for (int v = 0; v < 16; v++) memcpy(b.qh + 4 * v, t + qh_at(v) + 4 * r, 4);
    });
}

std::vector<int32_t> row_words(const XRow *xs, int64_t M, int64_t K) {
    const int64_t words = K / 16;
    std::vector<int32_t> p(static_cast<size_t>(M * words));
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < words; j++) p[m * words + j] = -32 * xs[m].sums[j];
    return p;
}

void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out) {
    for (int m = 0; m < count; m++) {
        const XRow &x = xs[m];
        const int32_t *pm = p + m * (K / 16);
        for (int64_t r = 0; r < ROWS; r++) {
            float acc = 0.f;
            for (int64_t i = 0; i < K / 256; i++) {
                const uint8_t *t = group + i * TILE;
                const int8_t *c = x.q + 256 * i;
                int32_t isum = 0;
                for (int j = 0; j < 16; j++) {
                    int32_t dot = pm[16 * i + j];  // -32 s_j: the codes' offset
                    for (int k = 0; k < 16; k++) dot += code(t, r, 16 * j + k) * c[16 * j + k];
                    isum += static_cast<int8_t>(t[SC + 16 * j + r]) * dot;
                }
                uint16_t d;
                memcpy(&d, t + D + 2 * r, 2);
                acc += (half_to_float(d) * x.d[i]) * static_cast<float>(isum);
            }
            out[m * ROWS + r] = acc;
        }
    }
}

}  // namespace q6k
}  // namespace blocks
}  // namespace qkv
