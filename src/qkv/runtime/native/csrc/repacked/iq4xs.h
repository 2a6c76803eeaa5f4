// IQ4_XS repacked at load into groups of 16 interleaved rows (block_format.h's IQ4_XS_X16), and
// the products that read it, in the shape of Q4_K_X16's (q4k.h: a SIMD lane is a row of the
// group, one activation row for a decode step or tiles of up to MR for a prefill; each output
// the same float operations whatever the tile and whatever the variant).
//
// Layout: rows 16 g .. 16 g + 15 of the (N, K / 256 * 136) matrix hold group g, its super-blocks
// i one after another as tiles of 16 * 136 = 2176 bytes, a byte permutation of the 16 rows'
// blocks i (lossless: iq4xs_unrepack gives the file's bytes back):
//   [0, 32)       d of rows 0..15 (float16 bits)     [32, 64)   scales_h of rows 0..15
//   [64, 128)     scales_l of rows 0..15 (4 bytes a row)
//   [128, 2176)   for the 32-weight group b (0..7) and its 4-byte step s (0..3), unit 4 b + s of
//                 64 bytes: qs[16 b + 4 s .. + 4) of rows 0..15
// so one 64-byte load is 16 rows x 8 weights (a lane a row: the low nibbles are weights
// 32 b + 4 s + 0..3, the high ones 32 b + 16 + 4 s + 0..3), their code book values looked up
// 16 at a time (vpshufb), against 4 activation codes broadcast.
//
// The math, per row and activation row, super-block by super-block (w = d (ls_b - 32) v, v the
// IQ4_NL value of the nibble, ls_b the group's 6 bits of scales_l and scales_h, x' = dx c the
// activations rounded per 256):
//   isum = sum_b (ls_b - 32) * sum_32(v c)                (exact int32)
//   acc  = acc + (d * dx) * float(isum)                   (two products rounded, then the sum)
// in exactly that order in every variant: the generic IQ4_XS product's own (block_format.cpp's
// dot256), so the repacked results are the generic C++ IQ4_XS product's bits on every CPU.
//
// Shape legend: K inputs (K % 256 == 0), N outputs (N % 16 == 0), M activation rows.
#pragma once

#include <stdint.h>

#include "q4k.h"

namespace qkv {
namespace blocks {
namespace iq4xs {

using q4k::MR;
using q4k::ROWS;
constexpr int64_t D = 0, SH = 32, SL = 64, QS = 128;     // offsets in a tile
constexpr int64_t TILE = ROWS * sizeof(BlockIQ4_XS);     // 2176 bytes a super-block of a group

// The IQ4_XS_X16 row of the format table (no per-block decode: unrepack first).
const Traits *traits();

// rows (N, row_bytes) IQ4_XS -> the groups' layout, groups [g0, g1) (and back)
void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1);
void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1);

// One group against `count` (1 .. MR) activation rows xs[0 .. count): out[m * 16 + r], row r of
// the group (p unused: the groups' code sums are read from xs' sums).
void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
#if defined(__x86_64__) || defined(_M_X64)
void avx2_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
void avx512_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
#endif

}  // namespace iq4xs
}  // namespace blocks

struct BlockPart;
enum Variant : int64_t;

namespace blocks {
namespace iq4xs {

// apply_blocks' share of an IQ4_XS_X16 part (as q4k::rows, ops.cpp).
void rows(const BlockPart &part, const XRow *xs, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1, int64_t first,
          const float *bias, float *y, Variant v);

}  // namespace iq4xs
}  // namespace blocks
}  // namespace qkv
