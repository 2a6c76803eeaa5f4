// Q4_K and Q5_K repacked at load into groups of 16 interleaved rows (block_format.h's Q4_K_X16
// and Q5_K_X16), and the products that read them: one activation row (a decode step) and tiles
// of up to MR rows (a prompt's prefill), each output the same float operations whatever the
// tile (batch invariance) and whatever the variant (generic C++, AVX2, AVX-512 compute it bit
// for bit alike). Q5_K is Q4_K with a fifth bit a weight (its qh[32]): one layout with qh
// after Q4_K's bytes, and one set of kernels templated on the file's type T (Q4_K or Q5_K).
//
// Layout: rows 16 g .. 16 g + 15 of the (N, K / 256 * Z) matrix hold group g, its super-blocks
// i one after another as tiles of 16 * Z bytes (Q4_K: 2304, Q5_K: 2816), a byte permutation of
// the 16 rows' blocks i (lossless: q4k_unrepack / q5k_unrepack give the file's bytes back):
//   [0, 32)      d of rows 0..15 (float16 bits)        [32, 64)   dmin of rows 0..15
//   [64, 128)    scales[0..3] of rows 0..15 (4 bytes a row, in row order)
//   [128, 192)   scales[4..7]                          [192, 256) scales[8..11]
//   [256, 2304)  for the 32-byte chunk j (0..3) of qs and its 4-byte step s (0..7), unit 8 j + s
//                of 64 bytes: qs[32 j + 4 s .. + 4) of rows 0..15
//   Q5_K only:
//   [2304, 2816) for the step s (0..7), unit s of 64 bytes: qh[4 s .. + 4) of rows 0..15
// so one 64-byte load is 16 rows x 8 weights (a lane a row: the low nibbles are weights
// 64 j + 4 s + 0..3, the high ones 64 j + 32 + 4 s + 0..3) against 4 activation codes broadcast,
// Q5_K's fifth bits of those weights are bits 2 j (low) and 2 j + 1 (high) of qh unit s, and
// the scales unpack for 16 rows with a few whole-register operations.
//
// The math, per row and activation row, super-block by super-block (w = d sc q - dmin mn per
// 32, q 0..15 or 0..31, x' = dx c the activations rounded per 256):
//   isum = sum_s sc_s * sum_32(q c),  msum = sum_s mn_s * sum_32(c)    (exact int32)
//   acc  = fma(d * dx, float(isum), acc),  macc = fma(dmin * dx, float(msum), macc)
//   y    = acc - macc
// in exactly that order in every variant (a SIMD lane is a row; the integer sums are exact), so
// the generic C++, AVX2 and AVX-512 results are the same bits.
//
// Shape legend: K inputs, N outputs (N % 16 == 0), M activation rows.
#pragma once

#include <stdint.h>

#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "../block_format.h"

namespace qkv {
namespace blocks {
namespace q4k {

constexpr int64_t ROWS = 16;                                // rows in a group
constexpr int64_t D = 0, DMIN = 32, SA = 64, SB = 128, SC = 192, QS = 256, QH = 2304;  // offsets in a tile
constexpr int MR = 4;                                       // activation rows a tile of the products takes

// Bytes of one super-block of a group: T = Q4_K or Q5_K, the file's type.
constexpr int64_t tile_bytes(Type T) { return ROWS * static_cast<int64_t>(T == Q5_K ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K)); }

#if defined(__x86_64__) || defined(_M_X64)
// A decode step's read-ahead: step k (0..31) of tile i brings its 32nd of tile i + AHEAD's lines
// towards the core (the groups of a part lie one after another, so past a group's last tile is
// the next group's first). The hardware's prefetcher alone left the one-row products at half
// the speed they reach with it out of cache: a step takes a few nanoseconds, memory about a hundred.
constexpr int64_t AHEAD = 2;
template <Type T>
static inline void read_ahead(const uint8_t *t, int k) {
    constexpr int64_t lines = tile_bytes(T) / 64;
    const char *ahead = reinterpret_cast<const char *>(t + AHEAD * tile_bytes(T));
    for (int64_t l = k * lines / 32; l < (k + 1) * lines / 32; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
}
#endif

// The Q4_K_X16 and Q5_K_X16 rows of the format table (no per-block decode: unrepack first).
const Traits *traits(Type T);

// rows (N, row_bytes) of T -> the groups' layout, groups [g0, g1) (and back); T = Q4_K, Q5_K
template <Type T>
void repack(const uint8_t *rows, uint8_t *packed, int64_t row_bytes, int64_t g0, int64_t g1);
template <Type T>
void unrepack(const uint8_t *packed, uint8_t *rows, int64_t row_bytes, int64_t g0, int64_t g1);

// The minimums' activation sums, as the kernels read them: for each super-block i of a row,
// four int32 words p[4 i + k] = the 32-sums (s_a | s_b << 16) with (a, b) = (0, 2), (1, 3), (4, 6), (5, 7).
void minimum_sums(const int16_t *sums16, int64_t K, int32_t *p);

// One group (its first tile at `group`) against `count` (1 .. MR) activation rows xs[0 .. count)
// (their minimum_sums at p[m * K / 64]): out[m * 16 + r], row r of the group.
using GroupRows = void (*)(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);

template <Type T>
void generic_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
#if defined(__x86_64__) || defined(_M_X64)
// A Q5_K prompt's products on AVX-512 with each tile (super-block) of a group unpacked once a pass of
// activation rows (ops.cpp) into a panel of PANEL_TILE bytes, 64-byte aligned, that stays in L1:
//   [0, 4096)      codes: unit 8 b + s (b the 32-weight sub-block, s 0..7) of 64 bytes holds
//                  weights 32 b + 4 s .. + 3 of rows 0..15 as bytes 0..31
//   [4096, 4608)   scales: sub-block b's 16 rows as int32, 64 bytes a b
//   [4608, 4864)   the minimums' pairs as group() makes them (even03, odd03, even47, odd47)
//   [4864, 4928)   d as float32     [4928, 4992) dmin as float32
// then every row of the pass against it, AVX512_MR at a time (avx512_panel_step: super-block i's
// part of group()'s acc and macc, count rows of 16 floats each; y = acc - macc once every tile
// is done). Q5_K's codes cost seven instructions a 64-byte load to unpack, paid once a pass
// instead of once a tile of 4 rows: 1.13-1.20x the tiles at 512 rows (1 and 2 threads, Zen 4).
// Q4_K's cost three, and a panel was 0.88-1.09x its tiles, so Q4_K keeps them. The integer
// sums are exact and the float steps group()'s, so the results are its bits.
constexpr int64_t PANEL_CODES = 0, PANEL_SCALES = 4096, PANEL_MINS = 4608, PANEL_D = 4864, PANEL_DMIN = 4928,
                  PANEL_TILE = 4992;
constexpr int AVX512_MR = 8;
template <Type T>
void avx512_unpack(const uint8_t *tile, uint8_t *panel);
void avx512_panel_step(const uint8_t *panel, int64_t i, const XRow *xs, const int32_t *p, int64_t words, int count, float *acc,
                       float *macc);
template <Type T>
void avx2_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
template <Type T>
void avx512_group(const uint8_t *group, int64_t K, const XRow *xs, const int32_t *p, int count, float *out);
#endif

}  // namespace q4k
}  // namespace blocks

struct BlockPart;       // kernels.h
enum Variant : int64_t;

namespace blocks {
namespace q4k {

// The rows' minimum_sums, K / 64 words a row (p[m * K / 64]): made once a product, before its
// outputs are split over the threads (ops.cpp).
std::vector<int32_t> row_words(const XRow *xs, int64_t M, int64_t K);

// apply_blocks' share of a Q4_K_X16 or Q5_K_X16 part: outputs first + [n0, n1) of y (M, ldy),
// rows [n0, n1) of the part, from the rounded activation rows xs[0 .. M) and their row_words p,
// in variant v (ops.cpp).
void rows(const BlockPart &part, const XRow *xs, const int32_t *p, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1,
          int64_t first, const float *bias, float *y, Variant v);

}  // namespace q4k
}  // namespace blocks
}  // namespace qkv
