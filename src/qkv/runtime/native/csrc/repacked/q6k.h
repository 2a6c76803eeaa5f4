// Q6_K repacked at load into groups of 16 interleaved rows (block_format.h's Q6_K_X16), and the
// products that read it, in the shape of Q4_K_X16's (q4k.h: a SIMD lane is a row of the group,
// one activation row for a decode step or tiles of up to MR for a prefill; each output the same
// float operations whatever the tile and whatever the variant).
//
// Layout: rows 16 g .. 16 g + 15 of the (N, K / 256 * 210) matrix hold group g, its super-blocks
// i one after another as tiles of 16 * 210 = 3360 bytes, a byte permutation of the 16 rows'
// BlockQ6_K i (lossless: q6k_unrepack gives the file's bytes back):
//   [0, 2048)     unit u (0..31) of 64 bytes: ql[4 u .. + 4) of rows 0..15
//   [2048, 3072)  unit v (0..15): qh[4 v .. + 4) of rows 0..15
//   [3072, 3328)  unit k (0..3): scales[4 k .. + 4) of rows 0..15
//   [3328, 3360)  d of rows 0..15 (float16 bits)
// For half n (0, 1) and 4-byte step l (0..7), ql units 16 n + l and 16 n + 8 + l and qh unit
// 8 n + l give each row the 4 weights 128 n + 32 t + 4 l + 0..3 of each 32 t (0..3): the low
// and high nibbles of the two ql units and qh's 2-bit fields t, in sub-block 8 n + 2 t + l / 4.
//
// The math, per row and activation row, super-block by super-block (w = d sc (q - 32) per 16,
// x' = dx c the activations rounded per 256, S_j the codes' 16-sums):
//   isum = sum_j sc_j * (sum_16(q c) - 32 S_j)    (exact int32)
//   acc  = fma(d * dx, float(isum), acc),  y = acc
// in exactly that order in every variant, so generic C++, AVX2 and AVX-512 give the same bits.
//
// Shape legend: K inputs, N outputs (N % 16 == 0), M activation rows.
#pragma once

#include <stdint.h>

#include "q4k.h"

namespace qkv {
namespace blocks {
namespace q6k {

using q4k::GroupRows;
using q4k::MR;
using q4k::ROWS;
constexpr int64_t TILE = ROWS * sizeof(BlockQ6_K);                  // bytes of one super-block of a group
constexpr int64_t QL = 0, QH = 2048, SC = 3072, D = 3328;          // offsets in a tile

// The Q6_K_X16 row of the format table (no per-block decode: q6k_unrepack first).
const Traits *traits();

// rows (N, row_bytes) Q6_K -> the groups' layout, groups [g0, g1) (and back)
void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1);
void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1);

// One group against `count` (1 .. MR) activation rows xs[0 .. count): out[m * 16 + r]
// (GroupRows' p is unused: the 16-sums are the rows' own).
void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
#if defined(__x86_64__) || defined(_M_X64)
void avx2_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
void avx512_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
#endif

}  // namespace q6k
}  // namespace blocks

struct BlockPart;
enum Variant : int64_t;

namespace blocks {
namespace q6k {

// apply_blocks' share of a Q6_K_X16 part (as q4k::rows, ops.cpp).
void rows(const BlockPart &part, const XRow *xs, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1, int64_t first,
          const float *bias, float *y, Variant v);

}  // namespace q6k
}  // namespace blocks
}  // namespace qkv
