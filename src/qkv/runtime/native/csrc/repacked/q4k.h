// Q4_K repacked at load into groups of 16 interleaved rows (block_format.h's Q4_K_X16), and the
// products that read it: one activation row (a decode step) and tiles of up to MR rows (a
// prompt's prefill), each output the same float operations whatever the tile (batch invariance)
// and whatever the variant (generic C++, AVX2, AVX-512 compute it bit for bit alike).
//
// Layout: rows 16 g .. 16 g + 15 of the (N, K / 256 * 144) matrix hold group g, its super-blocks
// i one after another as tiles of 16 * 144 = 2304 bytes, a byte permutation of the 16 rows'
// BlockQ4_K i (lossless: q4k_unrepack gives the file's bytes back):
//   [0, 32)      d of rows 0..15 (float16 bits)        [32, 64)   dmin of rows 0..15
//   [64, 128)    scales[0..3] of rows 0..15 (4 bytes a row, in row order)
//   [128, 192)   scales[4..7]                          [192, 256) scales[8..11]
//   [256, 2304)  for the 32-byte chunk j (0..3) of qs and its 4-byte step s (0..7), unit 8 j + s
//                of 64 bytes: qs[32 j + 4 s .. + 4) of rows 0..15
// so one 64-byte load is 16 rows x 8 weights (a lane a row: the low nibbles are weights
// 64 j + 4 s + 0..3, the high ones 64 j + 32 + 4 s + 0..3) against 4 activation codes broadcast,
// and the scales unpack for 16 rows with a few whole-register operations.
//
// The math, per row and activation row, super-block by super-block (Q4_K's w = d sc q - dmin mn
// per 32, x' = dx c the activations rounded per 256):
//   isum = sum_s sc_s * sum_32(q c),  msum = sum_s mn_s * sum_32(c)    (exact int32)
//   acc  = fma(d * dx, float(isum), acc),  macc = fma(dmin * dx, float(msum), macc)
//   y    = acc - macc
// in exactly that order in every variant (a SIMD lane is a row; the integer sums are exact), so
// the generic C++, AVX2 and AVX-512 results are the same bits.
//
// Shape legend: K inputs, N outputs (N % 16 == 0), M activation rows.
#pragma once

#include <stdint.h>

#include "../block_format.h"

namespace qkv {
namespace blocks {
namespace q4k {

constexpr int64_t ROWS = 16;                                // rows in a group
constexpr int64_t TILE = ROWS * sizeof(BlockQ4_K);         // bytes of one super-block of a group
constexpr int64_t D = 0, DMIN = 32, SA = 64, SB = 128, SC = 192, QS = 256;  // offsets in a tile
constexpr int MR = 4;                                       // activation rows a tile of the products takes

// The Q4_K_X16 row of the format table (no per-block decode: q4k_unrepack first).
const Traits *traits();

// rows (N, row_bytes) Q4_K -> the groups' layout, groups [g0, g1) (and back)
void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1);
void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1);

// The minimums' activation sums, as the kernels read them: for each super-block i of a row,
// four int32 words p[4 i + k] = the 32-sums (s_a | s_b << 16) with (a, b) = (0, 2), (1, 3), (4, 6), (5, 7).
void minimum_sums(const int16_t *sums16, int64_t K, int32_t *p);

// One group (its first tile at `group`) against `count` (1 .. MR) activation rows xs[0 .. count)
// (their minimum_sums at p[m * K / 64]): out[m * 16 + r], row r of the group.
using GroupRows = void (*)(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);

void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
#if defined(__x86_64__) || defined(_M_X64)
void avx2_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
void avx512_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
#endif

}  // namespace q4k
}  // namespace blocks

struct BlockPart;       // kernels.h
enum Variant : int64_t;

namespace blocks {
namespace q4k {

// apply_blocks' share of a Q4_K_X16 part: outputs first + [n0, n1) of y (M, ldy), rows [n0, n1)
// of the part, from the rounded activation rows xs[0 .. M), in variant v (ops.cpp).
void rows(const BlockPart &part, const XRow *xs, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1, int64_t first,
          const float *bias, float *y, Variant v);

}  // namespace q4k
}  // namespace blocks
}  // namespace qkv
