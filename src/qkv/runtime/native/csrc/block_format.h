// GGUF's block types, defined once: one struct per block type (its bytes, field by field), one
// traits table (weights and bytes a block, the activation rounding it multiplies with, its
// generic decode), and the activations rounded as the block types multiply them.
//
// The activation rounding belongs to the weight type, so a product is the same math on every
// CPU (the generic C++ is the reference; block_x86.h's AVX2 and AVX-512 kernels compute the
// same integer sums):
//   - blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) meet activations rounded per 32
//     (Q8_0-style, PER32): step d = max|x| / 127, codes round(x / d) ties to even, and the
//     block's d * sum(codes) (what a minimum, Q4_1 / Q5_1's m, multiplies);
//   - super-blocks of 256 (Q2_K .. Q6_K, IQ4_XS, the IQ1/IQ2/IQ3 types) meet activations rounded per 256 (Q8_K-style, PER256):
//     one step a 256, the same codes, and the codes' sums per 16 (what the minimums multiply);
//   - the plain 16-bit floats (F16, BF16; a "block" here is 32 weights, 64 bytes) meet the
//     activations as they come (FLOAT): float32, not rounded, and the product is the float32
//     sum of w x, w widened exactly from its 16 bits. (ggml multiplies F16 weights against
//     activations it rounds to float16; qkv keeps them float32: no rounding of x at all.)
// Each quantized block's integer dot product of weight codes and activation codes is exact; the
// block's float scales multiply it once (a K-quant super-block: once per 256 weights). A FLOAT
// product's sums are float32 ones: the variants agree with the generic C++ up to its order.
//
// Shape legend: K inputs; a row of K weights is K / W blocks of Z bytes.
#pragma once

#include <stdint.h>

#include <vector>

#include "iq_grids.h"

namespace qkv {
namespace blocks {

enum Type : int64_t {  // GGML's type ids
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
    IQ4_NL = 20, IQ4_XS = 23, F16 = 1, BF16 = 30,
    IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ3_S = 21, IQ2_S = 22, IQ1_M = 29,
    Q4_K_X16 = 1012,  // qkv's own: Q4_K rows repacked at load, 16 interleaved (repacked/q4k.h)
    Q5_K_X16 = 1013,  // Q5_K's, the same layout with qh after it (repacked/q4k.h)
    Q8_0_X16 = 1008,  // and Q8_0's (repacked/q8_0.h)
    Q5_0_X16 = 1006,  // and Q5_0's, in Q8_0_X16's shape (repacked/q8_0.h)
    IQ4_XS_X16 = 1023,  // and IQ4_XS's, in Q4_K_X16's shape (repacked/iq4xs.h)
    Q6_K_X16 = 1014,  // and Q6_K's, in Q4_K_X16's shape (repacked/q6k.h)
};
enum Activation : int64_t { PER32 = 0, PER256 = 1, FLOAT = 2 };  // how the activations a type multiplies are rounded (FLOAT: not)
constexpr int ACTIVATIONS = 3;

// -- the blocks, as stored (float16 fields as their bits) ----------------------------------
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };                           // w = d (q - 8)
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };                        // w = d q + m
struct BlockQ5_0 { uint16_t d; uint8_t qh[4], qs[16]; };                    // w = d (q - 16), bit 4 in qh
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4], qs[16]; };                 // w = d q + m
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };                            // w = d q
struct BlockIQ4_NL { uint16_t d; uint8_t qs[16]; };                         // w = d IQ4_NL_VALUES[q]
struct BlockQ2_K { uint8_t scales[16], qs[64]; uint16_t d, dmin; };         // w = d sc q - dmin m, per 16
struct BlockQ3_K { uint8_t hmask[32], qs[64], scales[12]; uint16_t d; };   // w = d (sc - 32) (q - 4 (1 - h))
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12], qs[128]; };        // w = d sc q - dmin m, per 32
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12], qh[32], qs[128]; };
struct BlockQ6_K { uint8_t ql[128], qh[64]; int8_t scales[16]; uint16_t d; };  // w = d sc (q - 32), per 16
struct BlockIQ4_XS { uint16_t d, scales_h; uint8_t scales_l[4], qs[128]; };  // w = d (sc - 32) IQ4_NL_VALUES[q], per 32
// The grid types (iq_grids.h's tables; every scale's weight is d times an odd integer over a power of 2):
struct BlockIQ2_XXS { uint16_t d; uint8_t qs[64]; };                        // per 32: 4 grid bytes, then u32 signs | scale << 28
struct BlockIQ2_XS { uint16_t d; uint16_t qs[32]; uint8_t scales[8]; };     // per 8: 9-bit grid index | 7-bit sign index << 9
struct BlockIQ2_S { uint16_t d; uint8_t qs[32], signs[32], qh[8], scales[8]; };  // 10-bit grid index, 8 sign bits, per 8
struct BlockIQ3_XXS { uint16_t d; uint8_t qs[64], scales_signs[32]; };     // per 4: grid byte; per 32: u32 signs | scale << 28
struct BlockIQ3_S { uint16_t d; uint8_t qs[64], qh[8], signs[32], scales[4]; };  // per 4: 9-bit grid index; sign bits
struct BlockIQ1_S { uint16_t d; uint8_t qs[32]; uint16_t qh[8]; };         // per 8: 11-bit grid index; per 32: scale, delta sign
struct BlockIQ1_M { uint8_t qs[32], qh[16]; uint16_t scales[4]; };          // per 8: 11-bit index, delta sign; per 16: scale; d in the top nibbles
constexpr int64_t FLOAT_BLOCK = 32;                                         // weights a "block" of F16 / BF16
struct BlockF16 { uint16_t w[FLOAT_BLOCK]; };                               // w = the float16 itself
struct BlockBF16 { uint16_t w[FLOAT_BLOCK]; };                              // w = float32 of bits w << 16

// IQ4_NL's non-linear code book (GGML's kvalues_iq4nl).
constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

struct Traits {
    Type type;
    const char *name;
    int64_t weights, bytes;  // W, Z
    Activation activation;
    void (*decode)(const uint8_t *block, float *out);  // the gguf library's float32 values, out[0 .. W)
};

// The type's traits, or nullptr for a type qkv's block products do not read.
const Traits *traits_of(int64_t type);
const Traits *all_traits(int64_t &count);

// Bytes of one row of K weights in `type`, or 0 when the type is not in the table or K is not
// whole blocks of it (nor of the 32 inputs an activation step spans).
int64_t row_bytes_of(int64_t type, int64_t K);

// (The inline helpers here are static: the x86 variants compile this header under their own
// target pragmas, and one copy must never stand in for another.)
// Q4_K / Q5_K: 8 six-bit scales and minimums from 12 bytes (gguf's get_scale_min_k4).
static inline void scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[4 + j] & 63;
        sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
}

// Q3_K: the 16 six-bit scales (before the -32) from 12 bytes.
static inline int q3_scale(const uint8_t *sc, int s) {
    const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
    return low | (high << 4);
}

// IQ4_XS: sub-block s's six-bit scale (before the -32): low 4 bits nibble s % 2 of scales_l[s / 2],
// high 2 bits 2s of scales_h. Its 16 bytes qs[16 s ..) hold the 32 codes as IQ4_NL's block does.
static inline int iq4_xs_scale(const BlockIQ4_XS &b, int s) {
    return ((b.scales_l[s / 2] >> (4 * (s % 2))) & 15) | (((b.scales_h >> (2 * s)) & 3) << 4);
}

// -- the grid types' codes: a super-block as 256 int8 codes and 16 integer multipliers --------
// weight 16 s + i = d * multiplier[s] * code[16 s + i] / IqDivisor<B>, every factor exact:
//   IQ2_*:   d (0.5 + l) / 4 * grid * sign    = d (2l + 1) / 8 * (grid * sign), l four bits a 32 (IQ2_XXS) or 16
//   IQ3_XXS: d (0.5 + l) / 2 * grid * sign    = d (2l + 1) / 4 * (grid * sign)
//   IQ3_S:   d (1 + 2l) * grid * sign
//   IQ1_S:   d (2l + 1) (grid +- 1/8)         = d (2l + 1) / 8 * (8 grid +- 1), l three bits a 32
//   IQ1_M:   the same, l three bits a 16, the delta's sign a group of 8, d in four nibbles
// (the gguf library's float32 operations give exactly these values: no product here rounds).
// Sign index k of IQ2_XXS, IQ2_XS and IQ3_XXS: 7 bits, the eighth their parity (an even count of minuses).
struct SignTable { uint8_t byte[128]; };
constexpr SignTable sign_table() {  // computed by the compiler: no popcount instruction needed at run time
    SignTable t{};
    for (int k = 0; k < 128; k++) {
        int parity = 0;
        for (int j = 0; j < 7; j++) parity ^= (k >> j) & 1;
        t.byte[k] = static_cast<uint8_t>(k | (parity << 7));
    }
    return t;
}
inline constexpr SignTable SEVEN_SIGNS = sign_table();
static inline uint8_t seven_signs(uint32_t k) { return SEVEN_SIGNS.byte[k & 127]; }

static inline int8_t signed_byte(uint64_t packed, int j, uint8_t signs) {  // byte j of a grid row, negated where sign bit j is set
    const int v = static_cast<int8_t>(packed >> (8 * j));
    return static_cast<int8_t>((signs >> j) & 1 ? -v : v);
}

static inline uint32_t le32(const uint8_t *p) {
    return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// 8 codes of a grid row of 8 (IQ2) or two rows of 4 (IQ3), signed, into q[0 .. 8)
static inline void signed_eight(uint64_t row, uint8_t signs, int8_t *q) {
    for (int j = 0; j < 8; j++) q[j] = signed_byte(row, j, signs);
}

// 8 codes 8 g + delta of an IQ1 grid row (g: -1, 0, 1 as int8 bytes) into q[0 .. 8)
static inline void iq1_eight(uint64_t row, int delta, int8_t *q) {
    for (int j = 0; j < 8; j++) q[j] = static_cast<int8_t>(8 * static_cast<int8_t>(row >> (8 * j)) + delta);
}

template <class B> struct IqDivisor;
template <> struct IqDivisor<BlockIQ2_XXS> { static constexpr int value = 8; };
template <> struct IqDivisor<BlockIQ2_XS> { static constexpr int value = 8; };
template <> struct IqDivisor<BlockIQ2_S> { static constexpr int value = 8; };
template <> struct IqDivisor<BlockIQ3_XXS> { static constexpr int value = 4; };
template <> struct IqDivisor<BlockIQ3_S> { static constexpr int value = 1; };
template <> struct IqDivisor<BlockIQ1_S> { static constexpr int value = 8; };
template <> struct IqDivisor<BlockIQ1_M> { static constexpr int value = 8; };

// A grid type's float16 d: a field of its own, or IQ1_M's, split over its four scale words' top nibbles.
template <class B>
static inline uint16_t iq_d(const B &b) { return b.d; }
static inline uint16_t iq_d(const BlockIQ1_M &b) {
    return static_cast<uint16_t>((b.scales[0] >> 12) | ((b.scales[1] >> 8) & 0x00F0) | ((b.scales[2] >> 4) & 0x0F00) |
                                 (b.scales[3] & 0xF000));
}

// IQ1_M's group g of 8 weights: its 4-bit field of qh (3 high index bits, then the delta's sign).
static inline int iq1_m_field(const BlockIQ1_M &b, int g) { return (b.qh[g / 2] >> (4 * (g % 2))) & 15; }

static inline void iq_codes(const BlockIQ2_XXS &b, int8_t *q, int16_t *mult) {
    for (int s = 0; s < 8; s++) {
        const uint8_t *p = b.qs + 8 * s;
        const uint32_t aux = le32(p + 4);
        for (int l = 0; l < 4; l++) signed_eight(IQ2_XXS_GRID[p[l]], seven_signs((aux >> (7 * l)) & 127), q + 32 * s + 8 * l);
        mult[2 * s] = mult[2 * s + 1] = static_cast<int16_t>(2 * (aux >> 28) + 1);
    }
}

static inline void iq_codes(const BlockIQ2_XS &b, int8_t *q, int16_t *mult) {
    for (int g = 0; g < 32; g++) signed_eight(IQ2_XS_GRID[b.qs[g] & 511], seven_signs(b.qs[g] >> 9), q + 8 * g);
    for (int s = 0; s < 16; s++) mult[s] = static_cast<int16_t>(2 * ((b.scales[s / 2] >> (4 * (s % 2))) & 15) + 1);
}

static inline void iq_codes(const BlockIQ2_S &b, int8_t *q, int16_t *mult) {
    for (int g = 0; g < 32; g++) {
        const int index = b.qs[g] | (((b.qh[g / 4] >> (2 * (g % 4))) & 3) << 8);
        signed_eight(IQ2_S_GRID[index], b.signs[g], q + 8 * g);
    }
    for (int s = 0; s < 16; s++) mult[s] = static_cast<int16_t>(2 * ((b.scales[s / 2] >> (4 * (s % 2))) & 15) + 1);
}

static inline void iq_codes(const BlockIQ3_XXS &b, int8_t *q, int16_t *mult) {
    for (int s = 0; s < 8; s++) {
        const uint32_t aux = le32(b.scales_signs + 4 * s);
        for (int l = 0; l < 4; l++) {
            const uint64_t row = IQ3_XXS_GRID[b.qs[8 * s + 2 * l]] | (static_cast<uint64_t>(IQ3_XXS_GRID[b.qs[8 * s + 2 * l + 1]]) << 32);
            signed_eight(row, seven_signs((aux >> (7 * l)) & 127), q + 32 * s + 8 * l);
        }
        mult[2 * s] = mult[2 * s + 1] = static_cast<int16_t>(2 * (aux >> 28) + 1);
    }
}

static inline void iq_codes(const BlockIQ3_S &b, int8_t *q, int16_t *mult) {
    for (int g = 0; g < 32; g++) {
        const int i0 = b.qs[2 * g] | (((b.qh[g / 4] >> (2 * (g % 4))) & 1) << 8);
        const int i1 = b.qs[2 * g + 1] | (((b.qh[g / 4] >> (2 * (g % 4) + 1)) & 1) << 8);
        signed_eight(IQ3_S_GRID[i0] | (static_cast<uint64_t>(IQ3_S_GRID[i1]) << 32), b.signs[g], q + 8 * g);
    }
    for (int s = 0; s < 16; s++) mult[s] = static_cast<int16_t>(2 * ((b.scales[s / 4] >> (4 * ((s / 2) % 2))) & 15) + 1);
}

static inline void iq_codes(const BlockIQ1_S &b, int8_t *q, int16_t *mult) {
    for (int s = 0; s < 8; s++) {
        const int high = b.qh[s], delta = high & 0x8000 ? -1 : 1;
        for (int l = 0; l < 4; l++) {
            iq1_eight(IQ1_S_GRID[b.qs[4 * s + l] | (((high >> (3 * l)) & 7) << 8)], delta, q + 32 * s + 8 * l);
        }
        mult[2 * s] = mult[2 * s + 1] = static_cast<int16_t>(2 * ((high >> 12) & 7) + 1);
    }
}

static inline void iq_codes(const BlockIQ1_M &b, int8_t *q, int16_t *mult) {
    for (int g = 0; g < 32; g++) {
        const int field = iq1_m_field(b, g), delta = field & 8 ? -1 : 1;
        iq1_eight(IQ1_S_GRID[b.qs[g] | ((field & 7) << 8)], delta, q + 8 * g);
    }
    for (int s = 0; s < 16; s++) mult[s] = static_cast<int16_t>(2 * ((b.scales[s / 4] >> (3 * (s % 4))) & 7) + 1);
}

// -- the activations, rounded as the block types multiply them -----------------------------
// M rows of K inputs: codes q (M, K); PER32: step d (M, K / 32), d * sum(codes) s (M, K / 32);
// PER256: step d (M, K / 256), the codes' sums per 16 (M, K / 16); FLOAT: x itself (M, K),
// not copied (the caller's, for as long as the product runs).
struct Rounded {
    Activation kind = PER32;
    int64_t K = 0;
    std::vector<int8_t> q;
    std::vector<float> d, s;
    std::vector<int16_t> sums;
    const float *x = nullptr;
};

struct XRow {  // one row of a Rounded
    const int8_t *q;
    const float *d, *s;
    const int16_t *sums;
    const float *x;  // FLOAT: the row's K inputs
};

static inline XRow row_of(const Rounded &r, int64_t m) {
    if (r.kind == FLOAT) return {nullptr, nullptr, nullptr, nullptr, r.x + m * r.K};
    const int64_t step = r.kind == PER32 ? 32 : 256;
    return {r.q.data() + m * r.K, r.d.data() + m * (r.K / step), r.kind == PER32 ? r.s.data() + m * (r.K / 32) : nullptr,
            r.kind == PER256 ? r.sums.data() + m * (r.K / 16) : nullptr, nullptr};
}

// `simd`: the x86 variants' rounding (block_x86.h: the same codes, steps and sums, faster).
Rounded round_activations(const float *x, int64_t M, int64_t K, Activation kind, bool simd);
void avx2_round_groups(const float *x, int64_t groups, int64_t step, int8_t *q, float *d, float *s, int16_t *sums);

// One row of weights (K / W blocks of `type`) against one row of rounded activations.
using RowDot = float (*)(const uint8_t *row, const XRow &x, int64_t K);

RowDot generic_dot(int64_t type);  // the reference (block_format.cpp)

// FOUR rows of weights (row, row + row_bytes, ...) against one row of x, out[0 .. 4): each computed
// by exactly the operations the type's RowDot runs for it alone.
constexpr int FOUR = 4;
using RowsDot = void (*)(const uint8_t *row, int64_t row_bytes, const XRow &x, int64_t K, float *out);

// Tiles of a product for many rows at once (a prefill's): a band of up to BAND rows of x against
// NR rows of weights, each weight block unpacked once for the band, each activation block
// loaded once for the NR rows (block_tiles_x86.h: AVX2; block_avx512.cpp: AVX-512's wide
// tiles). Every output takes exactly the float operations of its type's RowDot, so a row's
// outputs are the same bits alone or in a tile. Outputs out[m * ldo + n], m < M <= BAND, n < NR.
constexpr int64_t TILE_ROWS = 4;  // fewer rows (a decode step) run the one-row kernels alone
constexpr int64_t BAND = 64;  // rows of x a tile takes (64 x K int8: 128 KiB at K = 2048, in cache)

// NR rows of weights (row, row + row_bytes, ...) against the M <= BAND rows xs[0 .. M), or
// `prepared`: those rows as the tile's prepare laid them out.
using TileDot = void (*)(const uint8_t *row, int64_t row_bytes, const XRow *xs, int64_t M, int64_t K, const void *prepared,
                         float *out, int64_t ldo);

struct Tile {
    TileDot run = nullptr;  // nullptr: the variant has no tile for the type
    int64_t nr = 0;
    // a tile reading the activations in a layout of its own: the bytes of M rows (M a multiple of
    // the band's rows: where the next band begins) and the layout's making, once a product for all its rows
    int64_t (*prepared_bytes)(int64_t M, int64_t K) = nullptr;
    void (*prepare)(const XRow *xs, int64_t M, int64_t K, void *prepared) = nullptr;
    // rows of x a band holds at this K (nullptr: BAND): a float tile's band is cut to stay in L2
    int64_t (*band_rows)(int64_t K) = nullptr;
};

}  // namespace blocks
}  // namespace qkv
