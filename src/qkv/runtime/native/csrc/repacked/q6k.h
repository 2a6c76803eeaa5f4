// Q6_K repacked at load into groups of 16 interleaved rows (block_format.h's Q6_K_X16), and the
// products that read it, in the shape of Q4_K_X16's (q4k.h: a SIMD lane is a row of the group,
// one activation row for a decode step or tiles of up to MR for a prefill; each output the same
// float operations whatever the tile and whatever the variant).
//
// Layout: rows 16 g .. 16 g + 15 of the (N, K / 256 * 210) matrix hold group g, its super-blocks
// i one after another as tiles of 16 * 210 = 3360 bytes, a byte permutation of the 16 rows'
// blocks i (lossless: q6k_unrepack gives the file's bytes back):
//   [0, 32)        d of rows 0..15 (float16 bits)
//   [32, 288)      for the 16-weight sub-block j (0..15), 16 bytes: scales[j] of rows 0..15
//   [288, 3360)    chunk c (0..15) of 192 bytes, c = 8 h + 4 q + s for the half h (0, 1), the
//                  16-weight offset q (0, 1) and the 4-weight step s (0..3): three units of
//                  64 bytes (4 bytes of rows 0..15 each), ql unit 16 h + 4 q + s, ql unit
//                  16 h + 8 + 4 q + s, qh unit c (ql_at, qh_at)
// so a 64-byte load of ql (and one of qh) is 16 rows x 8 weights: for the offset l (0..31, a
// multiple of 4), ql unit 16 h + l / 4 holds the low 4 bits of weights 128 h + l + 0..3 (its low
// nibbles) and 128 h + 64 + l + 0..3 (its high ones), ql unit 16 h + 8 + l / 4 those of
// 128 h + 32 + l and 128 h + 96 + l, and qh unit 8 h + l / 4 the top 2 bits of all four (bits
// 0-1, 2-3, 4-5, 6-7: ggml's order). A chunk holds every bit of 16 weights a row (4 of each
// quarter of its half), so a decode step reads the tile front to back, one chunk at a time:
// in the file's order (ql, then qh) it jumped 2 KB back and forth, which the hardware's
// prefetchers did not follow (11-14 GB/s without software prefetches, 24 with them, against the
// stored rows' 30 on a 2-core Zen 4).
//
// The math, per row and activation row, super-block by super-block (w = d sc_j (q - 32), q
// 0..63, x' = dx c the activations rounded per 256, s_j the codes' 16-sums):
//   isum = sum_j sc_j * (sum_16(q c) - 32 s_j)            (exact int32)
//   acc  = acc + (d * dx) * float(isum)                   (two products rounded, then the sum)
// in exactly that order in every variant: the generic Q6_K product's own (block_format.cpp's
// dot256), so the repacked results are the generic C++ Q6_K product's bits on every CPU.
//
// Shape legend: K inputs (K % 256 == 0), N outputs (N % 16 == 0), M activation rows.
#pragma once

#include <stdint.h>

#include <vector>

#include "q4k.h"

namespace qkv {
namespace blocks {
namespace q6k {

using q4k::MR;
using q4k::ROWS;
constexpr int64_t D = 0, SC = 32, CHUNKS = 288;   // offsets in a tile
constexpr int64_t CHUNK = 192;                      // bytes a chunk: two ql units and a qh unit
constexpr int64_t TILE = ROWS * sizeof(BlockQ6_K);  // 3360 bytes a super-block of a group
// Where the file's ql unit u (0..31: its bytes 4 u .. 4 u + 3 of each row) and qh unit v (0..15) sit in a tile.
constexpr int64_t ql_at(int64_t u) { return CHUNKS + CHUNK * (8 * (u / 16) + u % 8) + 64 * ((u / 8) % 2); }
constexpr int64_t qh_at(int64_t v) { return CHUNKS + CHUNK * v + 128; }
// Activation rows a prompt tile of the AVX-512 kernel takes (MR elsewhere): its 6-bit codes
// cost 3-4 instructions a 64-byte load to unpack, shared by 8 rows instead of 4.
constexpr int AVX512_MR = 8;

// The Q6_K_X16 row of the format table (no per-block decode: unrepack first).
const Traits *traits();

// rows (N, row_bytes) Q6_K -> the groups' layout, groups [g0, g1) (and back)
void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1);
void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1);

// The rows' offsets as the kernels read them: for each 16-weight sub-block of a row, the int32
// -32 s_j (K / 16 words a row, p[m * K / 16]): made once a product, before its outputs are split.
std::vector<int32_t> row_words(const XRow *xs, int64_t M, int64_t K);

// One group against `count` (1 .. MR; 1 .. AVX512_MR for avx512_group) activation rows xs[0 .. count) (their row_words at
// p[m * K / 16]): out[m * 16 + r], row r of the group.
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
void rows(const BlockPart &part, const XRow *xs, const int32_t *p, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1,
          int64_t first, const float *bias, float *y, Variant v);

}  // namespace q6k
}  // namespace blocks
}  // namespace qkv
