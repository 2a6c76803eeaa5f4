// Q8_0 and Q5_0 repacked at load into groups of 16 interleaved rows (block_format.h's Q8_0_X16
// and Q5_0_X16: the 32-blocks' layouts), and the products that read them, in the shape of
// Q4_K_X16's (q4k.h: a SIMD lane is a row of the group, one activation row for a decode step or
// tiles of up to MR for a prefill; each output the same float operations whatever the tile and
// whatever the variant). One set of kernels, templated on the file's type T (Q8_0 or Q5_0).
//
// Layout: rows 16 g .. 16 g + 15 of the (N, K / 32 * Z) matrix hold group g, 16 * Z * B bytes
// (B = K / 32 blocks a row), a byte permutation of the 16 rows' blocks (lossless: unrepack
// gives the file's bytes back):
//   [0, 32 B)                 block i's d of rows 0..15 (float16 bits) at 32 i
//   Q8_0 (Z = 34):  [32 B, 544 B)  block i's unit u (0..7) of 64 bytes at 32 B + 512 i + 64 u:
//                                  qs[4 u .. + 4) of rows 0..15 (weights 4 u .. 4 u + 3)
//   Q5_0 (Z = 22):  [32 B, 352 B)  block i's 320 bytes at 32 B + 320 i: first qh (4 bytes a row,
//                                  rows 0..15), then unit u (0..3) of 64 bytes: qs[4 u .. + 4)
//                                  of rows 0..15 (low nibbles: weights 4 u + 0..3, high ones:
//                                  16 + 4 u + 0..3; their fifth bits: bits 4 u + k and 16 + 4 u + k of qh)
// so one 64-byte load is 4 weights of each of the 16 rows (Q5_0: twice 4, its nibbles) against
// 4 activation codes broadcast, and the scales of a block are one 32-byte load.
//
// The math, per row and activation row, block by block (w = d q with q = qs (Q8_0) or
// q = code - 16 (Q5_0), x' = dx c the activations rounded per 32 as Q8_0 and Q5_0 meet them):
//   isum = sum_32(q c)                                    (exact int32)
//   acc  = acc + (d * dx) * float(isum)                   (two products rounded, then the sum)
// in exactly that order in every variant: the generic 32-block product's own (block_format.cpp's
// dot32), so the repacked results are the generic C++ product's bits on every CPU.
//
// Shape legend: K inputs (K % 32 == 0), B = K / 32 blocks a row, N outputs (N % 16 == 0), M activation rows.
#pragma once

#include <stdint.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "q4k.h"

namespace qkv {
namespace blocks {
namespace q8_0 {

using q4k::GroupRows;
using q4k::MR;
using q4k::ROWS;
constexpr int64_t Z = sizeof(BlockQ8_0);     // 34 bytes a block
constexpr int64_t UNITS = 512;               // bytes of one block's qs in a group (16 rows x 32)
constexpr int64_t BLOCK = ROWS * Z;          // bytes of one block of a group, its d's and qs (544)
constexpr int64_t Z5 = sizeof(BlockQ5_0);    // Q5_0: 22 bytes a block
constexpr int64_t QH5 = 64;                  // Q5_0: bytes of one block's qh in a group, before its 4 units

// Bytes of a block of one row of the file's type T (Q8_0 or Q5_0), and what one block's
// weights (qh and qs, no d) take in a group.
constexpr int64_t block_bytes(Type T) { return T == Q5_0 ? Z5 : Z; }
constexpr int64_t body_bytes(Type T) { return ROWS * (block_bytes(T) - 2); }
// What the AVX-512 kernel's unsigned weights need taken off again, times the block's sum of
// activation codes: Q8_0's q + 128 (its sign bit flipped), Q5_0's code = q + 16.
constexpr int32_t code_offset(Type T) { return T == Q5_0 ? 16 : 128; }

#if defined(__x86_64__) || defined(_M_X64)
// A decode step's read-ahead: block i of a group brings its 544 bytes' share of the group,
// AHEAD bytes on, towards the core (the groups of a part lie one after another, so the sweep
// runs on into the next group's scales and weights). Into L2, not L1: on a Zen 4 out of cache
// (Gemma 3's 262144 x 640 head) L1 at 4096 bytes read 13-16 GB/s on one thread, L2 at 8192
// 16-18.6 GB/s; 16384 was no better (benchmarks/HISTORY.md, stop 47).
constexpr int64_t AHEAD = 8192;
template <Type T>
static inline void read_ahead(const uint8_t *group, int64_t i) {
    constexpr int64_t share = ROWS * block_bytes(T);
    const char *base = reinterpret_cast<const char *>(group) + AHEAD;
    for (int64_t a = (share * i + 63) / 64 * 64; a < share * (i + 1); a += 64) _mm_prefetch(base + a, _MM_HINT_T1);
}
#endif

// The Q8_0_X16 and Q5_0_X16 rows of the format table (no per-block decode: unrepack first).
const Traits *traits(Type T);

// rows (N, row_bytes) of T -> the groups' layout, groups [g0, g1) (and back); T = Q8_0, Q5_0
template <Type T>
void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1);
template <Type T>
void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1);

// Each block i's sum of an activation row's codes, p[i] = sum_32(c) (exact int32): what the
// unsigned weights' offset is taken off with (code_offset).
void code_sums(const int8_t *codes, int64_t K, int32_t *p);

// One group of T against `count` (1 .. MR) activation rows xs[0 .. count) (their code sums at
// p[m * K / 32]): out[m * 16 + r], row r of the group.
template <Type T>
void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
#if defined(__x86_64__) || defined(_M_X64)
template <Type T>
void avx2_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
template <Type T>
void avx512_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
#endif

}  // namespace q8_0
}  // namespace blocks

struct BlockPart;
enum Variant : int64_t;

namespace blocks {
namespace q8_0 {

// The rows' code sums, K / 32 words a row, made once a product (as q4k::row_words, ops.cpp).
std::vector<int32_t> row_words(const XRow *xs, int64_t M, int64_t K);

// apply_blocks' share of a Q8_0_X16 or Q5_0_X16 part, p the rows' row_words (as q4k::rows, ops.cpp).
void rows(const BlockPart &part, const XRow *xs, const int32_t *p, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1,
          int64_t first, const float *bias, float *y, Variant v);

}  // namespace q8_0
}  // namespace blocks
}  // namespace qkv
