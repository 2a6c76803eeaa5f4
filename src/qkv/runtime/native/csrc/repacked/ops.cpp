// The repacked layouts (Q4_K_X16 and Q5_K_X16: q4k.h, Q8_0_X16 and Q5_0_X16: q8_0.h, IQ4_XS_X16: iq4xs.h, Q6_K_X16: q6k.h) in the library: their products inside
// a BLOCKS Linear (block_products.cpp's apply_blocks hands such a part here), and the ops that
// repack a matrix at load (a copy: the file's mapping is never written):
//
//   qkv::q4k_repack(blocks (N, K / 256 * 144) u8 Q4_K, N % 16 == 0) -> the same shape, Q4_K_X16
//   qkv::q4k_unrepack(packed (N, K / 256 * 144) u8 Q4_K_X16) -> the file's Q4_K bytes
//   qkv::q5k_repack / q5k_unrepack: the same for Q5_K (N, K / 256 * 176) and Q5_K_X16
//   qkv::q8_0_repack / q8_0_unrepack: the same for Q8_0 (N, K / 32 * 34) and Q8_0_X16
//   qkv::q5_0_repack / q5_0_unrepack: the same for Q5_0 (N, K / 32 * 22) and Q5_0_X16
//   qkv::iq4xs_repack / iq4xs_unrepack: the same for IQ4_XS (N, K / 256 * 136) and IQ4_XS_X16
//   qkv::q6k_repack / q6k_unrepack: the same for Q6_K (N, K / 256 * 210) and Q6_K_X16
//   qkv::q4k_repack_into / q5k_repack_into / q8_0_repack_into / q5_0_repack_into / iq4xs_repack_into / q6k_repack_into(blocks, out): the repacking written into `out` (a slice
//   of a stacked matrix on 2 MB pages: one copy at load, not three)
//
// A product over M activation rows takes them MR at a time per group of 16 weight rows, and up
// to PASS rows per pass over the task's weights: a prompt reads each weight once per MR rows
// from cache, not once a row from memory, and each output is the same float operations
// whatever M (q4k.h).
//
// Shape legend: M activation rows, K inputs, N outputs.
#include <string.h>

#include <algorithm>
#include <vector>

#include "../kernels.h"
#include "q4k.h"
#include "iq4xs.h"
#include "q6k.h"
#include "q8_0.h"

namespace qkv {
namespace blocks {
namespace {

constexpr int64_t ROWS = q4k::ROWS, MR = q4k::MR;
constexpr int64_t PASS = 64;  // activation rows per pass over a task's weights (their codes stay in L2)

// Outputs [r0, r1) of group g (its out[n - 16 g]) into y's row, plus the bias. A whole group
// without bias is a copy of a size the compiler knows (two or four vector moves): written as a
// loop, it became a call to memmove for every 16 floats, 4% of a prompt's time.
inline void put(const float *out, int64_t g, int64_t r0, int64_t r1, const float *bias, float *row) {
    if (bias == nullptr && r1 - r0 == ROWS) {
        memcpy(row + r0, out, ROWS * sizeof(float));
        return;
    }
    for (int64_t n = r0; n < r1; n++) {
        const float s = out[n - g * ROWS];
        row[n] = bias ? s + bias[n] : s;
    }
}

constexpr int64_t WIDEST = std::max({MR, int64_t{q6k::AVX512_MR}, int64_t{q4k::AVX512_MR}});  // the most activation rows a kernel call takes

// Outputs first + [n0, n1) of y from a part's groups, `kernel` a group at a time against `tile`
// (MR unless the kernel takes more) activation rows at a time (p: the rows' `words`
// precomputed int32 each, or none).
void group_rows(const BlockPart &part, q4k::GroupRows kernel, const int32_t *p, int64_t words, const XRow *xs, int64_t M, int64_t K,
                int64_t ldy, int64_t n0, int64_t n1, int64_t first, const float *bias, float *y, int64_t tile = MR) {
    float out[WIDEST * ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += PASS) {
        const int64_t m1 = std::min(M, m0 + PASS);
        for (int64_t g = n0 / ROWS; g * ROWS < n1; g++) {
            const uint8_t *group = part.blocks + g * ROWS * part.row_bytes;
            const int64_t r0 = std::max(n0, g * ROWS), r1 = std::min(n1, (g + 1) * ROWS);
            for (int64_t m = m0; m < m1; m += tile) {
                const int count = static_cast<int>(std::min<int64_t>(tile, m1 - m));
                kernel(group, K, xs + m, p ? p + m * words : nullptr, count, out);
                for (int c = 0; c < count; c++) put(out + c * ROWS, g, r0, r1, bias, y + (m + c) * ldy + first);
            }
        }
    }
}

#if QKV_X86
// group_rows with each tile of a group unpacked once a pass (q4k.h's panel) where the pass has
// at least PANEL_ROWS activation rows: `unpack` makes a tile's panel, every row of the pass runs
// against it (avx512_panel_step), the rows' sums kept between tiles; a shorter pass is
// group_rows' with `kernel`.
constexpr int64_t PANEL_ROWS = 16;

using Unpack = void (*)(const uint8_t *tile, uint8_t *panel);

void panel_rows(const BlockPart &part, Unpack unpack, int64_t tile_bytes, q4k::GroupRows kernel, const int32_t *p, int64_t words,
                const XRow *xs, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1, int64_t first, const float *bias,
                float *y) {
    alignas(64) uint8_t panel[q4k::PANEL_TILE];
    alignas(64) float acc[PASS * ROWS], macc[PASS * ROWS];  // the pass's rows' sums, 16 outputs a row
    for (int64_t m0 = 0; m0 < M; m0 += PASS) {
        const int64_t m1 = std::min(M, m0 + PASS), rows = m1 - m0;
        if (rows < PANEL_ROWS) {  // a short last pass: tiles as group_rows takes them
            group_rows(part, kernel, p + m0 * words, words, xs + m0, rows, K, ldy, n0, n1, first, bias, y + m0 * ldy);
            continue;
        }
        for (int64_t g = n0 / ROWS; g * ROWS < n1; g++) {
            const uint8_t *group = part.blocks + g * ROWS * part.row_bytes;
            const int64_t r0 = std::max(n0, g * ROWS), r1 = std::min(n1, (g + 1) * ROWS);
            std::fill(acc, acc + rows * ROWS, 0.0f);
            std::fill(macc, macc + rows * ROWS, 0.0f);
            for (int64_t i = 0; i < K / 256; i++) {
                unpack(group + i * tile_bytes, panel);
                for (int64_t m = m0; m < m1; m += q4k::AVX512_MR) {
                    const int count = static_cast<int>(std::min<int64_t>(q4k::AVX512_MR, m1 - m));
                    q4k::avx512_panel_step(panel, i, xs + m, p + m * words, words, count, acc + (m - m0) * ROWS,
                                           macc + (m - m0) * ROWS);
                }
            }
            for (int64_t m = m0; m < m1; m++) {
                float *a = acc + (m - m0) * ROWS;
                const float *b = macc + (m - m0) * ROWS;
                for (int r = 0; r < ROWS; r++) a[r] -= b[r];
                put(a, g, r0, r1, bias, y + m * ldy + first);
            }
        }
    }
}
#endif

}  // namespace

namespace q4k {

std::vector<int32_t> row_words(const XRow *xs, int64_t M, int64_t K) {
    const int64_t words = K / 64;
    std::vector<int32_t> p(static_cast<size_t>(M * words));
    for (int64_t m = 0; m < M; m++) minimum_sums(xs[m].sums, K, p.data() + m * words);
    return p;
}

void rows(const BlockPart &part, const XRow *xs, const int32_t *p, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1,
          int64_t first, const float *bias, float *y, Variant v) {
    const bool five = part.type == Q5_K_X16;
#if QKV_X86
    if (five && v >= AVX512 && M >= PANEL_ROWS)  // Q4_K's tiles unpack in 3 instructions a load: a panel was 0.88-1.09x them
        return panel_rows(part, avx512_unpack<Q5_K>, tile_bytes(Q5_K), avx512_group<Q5_K>, p, K / 64, xs, M, K, ldy, n0, n1,
                          first, bias, y);
    const q4k::GroupRows kernel = v >= AVX512 ? (five ? avx512_group<Q5_K> : avx512_group<Q4_K>)
                                  : v >= AVX2 ? (five ? avx2_group<Q5_K> : avx2_group<Q4_K>)
                                              : (five ? generic_group<Q5_K> : generic_group<Q4_K>);
#else
    const q4k::GroupRows kernel = five ? generic_group<Q5_K> : generic_group<Q4_K>;
    (void)v;
#endif
    group_rows(part, kernel, p, K / 64, xs, M, K, ldy, n0, n1, first, bias, y);
}

}  // namespace q4k

namespace q8_0 {

std::vector<int32_t> row_words(const XRow *xs, int64_t M, int64_t K) {
    const int64_t words = K / 32;
    std::vector<int32_t> p(static_cast<size_t>(M * words));
    for (int64_t m = 0; m < M; m++) code_sums(xs[m].q, K, p.data() + m * words);
    return p;
}

void rows(const BlockPart &part, const XRow *xs, const int32_t *p, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1,
          int64_t first, const float *bias, float *y, Variant v) {
    const bool five = part.type == Q5_0_X16;
#if QKV_X86
    const q4k::GroupRows kernel = v >= AVX512 ? (five ? avx512_group<Q5_0> : avx512_group<Q8_0>)
                                  : v >= AVX2 ? (five ? avx2_group<Q5_0> : avx2_group<Q8_0>)
                                              : (five ? generic_group<Q5_0> : generic_group<Q8_0>);
#else
    const q4k::GroupRows kernel = five ? generic_group<Q5_0> : generic_group<Q8_0>;
    (void)v;
#endif
    group_rows(part, kernel, p, K / 32, xs, M, K, ldy, n0, n1, first, bias, y);
}

}  // namespace q8_0

namespace iq4xs {

void rows(const BlockPart &part, const XRow *xs, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1, int64_t first,
          const float *bias, float *y, Variant v) {
#if QKV_X86
    const q4k::GroupRows kernel = v >= AVX512 ? avx512_group : v >= AVX2 ? avx2_group : generic_group;
#else
    const q4k::GroupRows kernel = generic_group;
    (void)v;
#endif
    group_rows(part, kernel, nullptr, 0, xs, M, K, ldy, n0, n1, first, bias, y);
}

}  // namespace iq4xs

namespace q6k {

void rows(const BlockPart &part, const XRow *xs, const int32_t *p, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1,
          int64_t first, const float *bias, float *y, Variant v) {
#if QKV_X86
    const q4k::GroupRows kernel = v >= AVX512 ? avx512_group : v >= AVX2 ? avx2_group : generic_group;
    const int64_t tile = v >= AVX512 ? AVX512_MR : MR;
#else
    const q4k::GroupRows kernel = generic_group;
    const int64_t tile = MR;
    (void)v;
#endif
    group_rows(part, kernel, p, K / 16, xs, M, K, ldy, n0, n1, first, bias, y, tile);
}

}  // namespace q6k
}  // namespace blocks

namespace {

using torch::headeronly::ScalarType;

using Permute = void (*)(const uint8_t *from, uint8_t *to, int64_t row_bytes, int64_t g0, int64_t g1);

bool whole_groups(const Tensor &t, int64_t block_bytes) {
    return t.dim() == 2 && t.scalar_type() == ScalarType::Byte && t.is_contiguous() && t.size(0) % blocks::q4k::ROWS == 0 &&
           t.size(0) > 0 && t.size(1) > 0 && t.size(1) % block_bytes == 0;
}

// `from` (never written: it may be the file's mapping) permuted group by group into `to`, of
// the same shape (a slice of a larger matrix: stacked q/k/v repacked straight into place).
void permute_into(const Tensor &from, Tensor &to, Permute permute) {
    const uint8_t *src = static_cast<const uint8_t *>(from.data_ptr());
    uint8_t *dst = static_cast<uint8_t *>(to.data_ptr());
    const int64_t row_bytes = from.size(1), groups = from.size(0) / blocks::q4k::ROWS;
    torch::stable::parallel_for(0, groups, std::max<int64_t>(1, groups / 64), [&](int64_t g0, int64_t g1) {
        permute(src, dst, row_bytes, g0, g1);
    });
}

// A copy of `from` permuted group by group.
Tensor permuted(const Tensor &from, int64_t block_bytes, Permute permute, const char *message) {
    check(whole_groups(from, block_bytes), message);
    Tensor to = torch::stable::new_empty(from, {from.size(0), from.size(1)});
    permute_into(from, to, permute);
    return to;
}

// `from` permuted into the caller's `out` (same shape, contiguous, not overlapping `from`).
Tensor permuted_out(const Tensor &from, Tensor out, int64_t block_bytes, Permute permute, const char *message) {
    check(whole_groups(from, block_bytes) && whole_groups(out, block_bytes) && out.size(0) == from.size(0) &&
              out.size(1) == from.size(1),
          message);
    const uint8_t *a = static_cast<const uint8_t *>(from.data_ptr());
    const uint8_t *b = static_cast<const uint8_t *>(out.data_ptr());
    const int64_t n = from.size(0) * from.size(1);
    check(a + n <= b || b + n <= a, message);
    permute_into(from, out, permute);
    return out;
}

constexpr int64_t Q4K = sizeof(blocks::BlockQ4_K), Q5K = sizeof(blocks::BlockQ5_K), Q6K = sizeof(blocks::BlockQ6_K),
                  Q80 = sizeof(blocks::BlockQ8_0), Q50 = sizeof(blocks::BlockQ5_0), IQ4XS = sizeof(blocks::BlockIQ4_XS);

Tensor q4k_repack(Tensor blocks) {
    return permuted(blocks, Q4K, blocks::q4k::repack<blocks::Q4_K>, "qkv::q4k_repack: blocks must be contiguous uint8 Q4_K rows (N, K / 256 * 144), N a multiple of 16");
}

Tensor q4k_unrepack(Tensor packed) {
    return permuted(packed, Q4K, blocks::q4k::unrepack<blocks::Q4_K>, "qkv::q4k_unrepack: packed must be contiguous uint8 (N, K / 256 * 144), N a multiple of 16");
}

Tensor q5k_repack(Tensor blocks) {
    return permuted(blocks, Q5K, blocks::q4k::repack<blocks::Q5_K>, "qkv::q5k_repack: blocks must be contiguous uint8 Q5_K rows (N, K / 256 * 176), N a multiple of 16");
}

Tensor q5k_unrepack(Tensor packed) {
    return permuted(packed, Q5K, blocks::q4k::unrepack<blocks::Q5_K>, "qkv::q5k_unrepack: packed must be contiguous uint8 (N, K / 256 * 176), N a multiple of 16");
}

Tensor q5k_repack_into(Tensor blocks, Tensor out) {
    return permuted_out(blocks, out, Q5K, blocks::q4k::repack<blocks::Q5_K>, "qkv::q5k_repack_into: blocks and out must be contiguous uint8 Q5_K rows of one shape (N, K / 256 * 176), N a multiple of 16, not overlapping");
}

Tensor q4k_repack_into(Tensor blocks, Tensor out) {
    return permuted_out(blocks, out, Q4K, blocks::q4k::repack<blocks::Q4_K>, "qkv::q4k_repack_into: blocks and out must be contiguous uint8 Q4_K rows of one shape (N, K / 256 * 144), N a multiple of 16, not overlapping");
}

Tensor q8_0_repack(Tensor blocks) {
    return permuted(blocks, Q80, blocks::q8_0::repack<blocks::Q8_0>, "qkv::q8_0_repack: blocks must be contiguous uint8 Q8_0 rows (N, K / 32 * 34), N a multiple of 16");
}

Tensor q8_0_repack_into(Tensor blocks, Tensor out) {
    return permuted_out(blocks, out, Q80, blocks::q8_0::repack<blocks::Q8_0>, "qkv::q8_0_repack_into: blocks and out must be contiguous uint8 Q8_0 rows of one shape (N, K / 32 * 34), N a multiple of 16, not overlapping");
}

Tensor q8_0_unrepack(Tensor packed) {
    return permuted(packed, Q80, blocks::q8_0::unrepack<blocks::Q8_0>, "qkv::q8_0_unrepack: packed must be contiguous uint8 (N, K / 32 * 34), N a multiple of 16");
}

Tensor q5_0_repack(Tensor blocks) {
    return permuted(blocks, Q50, blocks::q8_0::repack<blocks::Q5_0>, "qkv::q5_0_repack: blocks must be contiguous uint8 Q5_0 rows (N, K / 32 * 22), N a multiple of 16");
}

Tensor q5_0_repack_into(Tensor blocks, Tensor out) {
    return permuted_out(blocks, out, Q50, blocks::q8_0::repack<blocks::Q5_0>, "qkv::q5_0_repack_into: blocks and out must be contiguous uint8 Q5_0 rows of one shape (N, K / 32 * 22), N a multiple of 16, not overlapping");
}

Tensor q5_0_unrepack(Tensor packed) {
    return permuted(packed, Q50, blocks::q8_0::unrepack<blocks::Q5_0>, "qkv::q5_0_unrepack: packed must be contiguous uint8 (N, K / 32 * 22), N a multiple of 16");
}

Tensor iq4xs_repack(Tensor blocks) {
    return permuted(blocks, IQ4XS, blocks::iq4xs::repack, "qkv::iq4xs_repack: blocks must be contiguous uint8 IQ4_XS rows (N, K / 256 * 136), N a multiple of 16");
}

Tensor iq4xs_repack_into(Tensor blocks, Tensor out) {
    return permuted_out(blocks, out, IQ4XS, blocks::iq4xs::repack, "qkv::iq4xs_repack_into: blocks and out must be contiguous uint8 IQ4_XS rows of one shape (N, K / 256 * 136), N a multiple of 16, not overlapping");
}

Tensor q6k_repack(Tensor blocks) {
    return permuted(blocks, Q6K, blocks::q6k::repack, "qkv::q6k_repack: blocks must be contiguous uint8 Q6_K rows (N, K / 256 * 210), N a multiple of 16");
}

Tensor q6k_repack_into(Tensor blocks, Tensor out) {
    return permuted_out(blocks, out, Q6K, blocks::q6k::repack, "qkv::q6k_repack_into: blocks and out must be contiguous uint8 Q6_K rows of one shape (N, K / 256 * 210), N a multiple of 16, not overlapping");
}

Tensor q6k_unrepack(Tensor packed) {
    return permuted(packed, Q6K, blocks::q6k::unrepack, "qkv::q6k_unrepack: packed must be contiguous uint8 (N, K / 256 * 210), N a multiple of 16");
}

Tensor iq4xs_unrepack(Tensor packed) {
    return permuted(packed, IQ4XS, blocks::iq4xs::unrepack, "qkv::iq4xs_unrepack: packed must be contiguous uint8 (N, K / 256 * 136), N a multiple of 16");
}

}  // namespace
}  // namespace qkv

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("q4k_repack(Tensor blocks) -> Tensor");
    m.def("q4k_unrepack(Tensor packed) -> Tensor");
    m.def("q5k_repack(Tensor blocks) -> Tensor");
    m.def("q5k_unrepack(Tensor packed) -> Tensor");
    m.def("q5k_repack_into(Tensor blocks, Tensor(a!) out) -> Tensor(a!)");
    m.def("q4k_repack_into(Tensor blocks, Tensor(a!) out) -> Tensor(a!)");
    m.def("q8_0_repack(Tensor blocks) -> Tensor");
    m.def("q8_0_unrepack(Tensor packed) -> Tensor");
    m.def("q8_0_repack_into(Tensor blocks, Tensor(a!) out) -> Tensor(a!)");
    m.def("q5_0_repack(Tensor blocks) -> Tensor");
    m.def("q5_0_unrepack(Tensor packed) -> Tensor");
    m.def("q5_0_repack_into(Tensor blocks, Tensor(a!) out) -> Tensor(a!)");
    m.def("iq4xs_repack(Tensor blocks) -> Tensor");
    m.def("iq4xs_unrepack(Tensor packed) -> Tensor");
    m.def("iq4xs_repack_into(Tensor blocks, Tensor(a!) out) -> Tensor(a!)");
    m.def("q6k_repack(Tensor blocks) -> Tensor");
    m.def("q6k_unrepack(Tensor packed) -> Tensor");
    m.def("q6k_repack_into(Tensor blocks, Tensor(a!) out) -> Tensor(a!)");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("q4k_repack", TORCH_BOX(&qkv::q4k_repack));
    m.impl("q4k_unrepack", TORCH_BOX(&qkv::q4k_unrepack));
    m.impl("q5k_repack", TORCH_BOX(&qkv::q5k_repack));
    m.impl("q5k_unrepack", TORCH_BOX(&qkv::q5k_unrepack));
    m.impl("q5k_repack_into", TORCH_BOX(&qkv::q5k_repack_into));
    m.impl("q4k_repack_into", TORCH_BOX(&qkv::q4k_repack_into));
    m.impl("q8_0_repack", TORCH_BOX(&qkv::q8_0_repack));
    m.impl("q8_0_unrepack", TORCH_BOX(&qkv::q8_0_unrepack));
    m.impl("q8_0_repack_into", TORCH_BOX(&qkv::q8_0_repack_into));
    m.impl("q5_0_repack", TORCH_BOX(&qkv::q5_0_repack));
    m.impl("q5_0_unrepack", TORCH_BOX(&qkv::q5_0_unrepack));
    m.impl("q5_0_repack_into", TORCH_BOX(&qkv::q5_0_repack_into));
    m.impl("iq4xs_repack", TORCH_BOX(&qkv::iq4xs_repack));
    m.impl("iq4xs_unrepack", TORCH_BOX(&qkv::iq4xs_unrepack));
    m.impl("iq4xs_repack_into", TORCH_BOX(&qkv::iq4xs_repack_into));
    m.impl("q6k_repack", TORCH_BOX(&qkv::q6k_repack));
    m.impl("q6k_unrepack", TORCH_BOX(&qkv::q6k_unrepack));
    m.impl("q6k_repack_into", TORCH_BOX(&qkv::q6k_repack_into));
}
