// The x86 dot products of the block types on rounded activations (block_format.h says what
// they compute), written once over an instruction set S and compiled twice: for AVX2 in
// block_avx2.cpp and for AVX-512 (VNNI) in block_avx512.cpp, each inside its own `#pragma GCC
// target` region. Every integer sum is exact (no int16 saturation: weight codes are below 64,
// or the signed codes are multiplied through |w| and sign(x) w), so both compute the same
// integers as the generic C++; only the float combination's order differs from it.
//
// S provides dot4(u, s): 32 unsigned bytes times 32 signed bytes, each 4 adjacent products
// summed into an int32 lane (AVX2: vpmaddubsw then vpmaddwd; AVX-512 VNNI: vpdpbusd).
#pragma once
#include <immintrin.h>
#include <string.h>

#include <type_traits>

#include "../block_format.h"

namespace qkv {
namespace blocks {
namespace {  // each variant's file has its own copies, compiled for its own instruction set

inline float half(uint16_t h) { return _cvtsh_ss(h); }

inline __m256i load(const void *p) { return _mm256_loadu_si256(static_cast<const __m256i *>(p)); }

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256i nibbles(const uint8_t *qs) {  // 16 bytes -> 32 codes: the low nibbles, then the high ones
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
}

inline __m256i bit_bytes(const uint8_t *p) {  // 32 bits -> 32 bytes, 0xFF where bit j is set
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// A 32-block's weight codes in weight order: signed (w / d) for the types without a minimum,
// unsigned (0..31) for Q4_1 / Q5_1.
template <int64_t T>
inline __m256i codes32(const uint8_t *b) {
    if constexpr (T == Q4_0) {
        return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
    } else if constexpr (T == Q4_1) {
        return nibbles(b + 4);
    } else if constexpr (T == Q5_0) {  // where the fifth bit is clear, q - 16 = the nibble | 0xF0 as int8
        return _mm256_or_si256(nibbles(b + 6), _mm256_andnot_si256(bit_bytes(b + 2), _mm256_set1_epi8(static_cast<char>(0xF0))));
    } else if constexpr (T == Q5_1) {
        return _mm256_or_si256(nibbles(b + 8), _mm256_and_si256(bit_bytes(b + 4), _mm256_set1_epi8(16)));
    } else if constexpr (T == Q8_0) {
        return load(b + 2);
    } else {  // IQ4_NL: the code book looked up by nibble
        const __m128i book = _mm_loadu_si128(reinterpret_cast<const __m128i *>(IQ4_NL_VALUES));
        return _mm256_shuffle_epi8(_mm256_set_m128i(book, book), nibbles(b + 2));
    }
}

template <int64_t T>
struct Block32;  // the struct of a 32-block type
template <> struct Block32<Q4_0> { using B = BlockQ4_0; };
template <> struct Block32<Q4_1> { using B = BlockQ4_1; };
template <> struct Block32<Q5_0> { using B = BlockQ5_0; };
template <> struct Block32<Q5_1> { using B = BlockQ5_1; };
template <> struct Block32<Q8_0> { using B = BlockQ8_0; };
template <> struct Block32<IQ4_NL> { using B = BlockIQ4_NL; };

// One 32-block against its 32 activation codes: the block's 8 int32 partial sums as float,
// times d_w d_x, into acc.
template <class S, int64_t T>
inline __m256 block32(const uint8_t *b, const int8_t *c, float dx, __m256 acc) {
    const __m256i w = codes32<T>(b), x = load(c);
    uint16_t d;
    memcpy(&d, b, sizeof d);
    const __m256i dots = T == Q4_1 || T == Q5_1 ? S::dot4(w, x)
                                                : S::dot4(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));  // |w| sign(w) x
    return _mm256_fmadd_ps(_mm256_set1_ps(half(d) * dx), _mm256_cvtepi32_ps(dots), acc);
}

template <int64_t T>
inline float minimum_term(const uint8_t *b, const float *s) {  // Q4_1 / Q5_1: m s_x
    uint16_t m;
    memcpy(&m, b + 2, sizeof m);
    return half(m) * *s;
}

template <class S, int64_t T>
float dot32(const uint8_t *row, const XRow &x, int64_t K) {
    constexpr bool minimum = T == Q4_1 || T == Q5_1;
    constexpr int64_t Z = sizeof(typename Block32<T>::B);
    const int64_t G = K / 32;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float offset0 = 0.f, offset1 = 0.f;
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {  // two blocks a step, into two accumulators
        acc0 = block32<S, T>(row + g * Z, x.q + 32 * g, x.d[g], acc0);
        acc1 = block32<S, T>(row + (g + 1) * Z, x.q + 32 * (g + 1), x.d[g + 1], acc1);
        if constexpr (minimum) {
            offset0 += minimum_term<T>(row + g * Z, x.s + g);
            offset1 += minimum_term<T>(row + (g + 1) * Z, x.s + g + 1);
        }
    }
    if (g < G) {
        acc0 = block32<S, T>(row + g * Z, x.q + 32 * g, x.d[g], acc0);
        if constexpr (minimum) offset0 += minimum_term<T>(row + g * Z, x.s + g);
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + (offset0 + offset1);
}

// NR rows of 32-blocks (row_bytes apart) against one row of x, out[0 .. NR): each row runs the
// operations dot32 runs for it alone (the same two accumulators and the same order), the
// activations' codes and steps loaded once for all NR.
template <class S, int64_t T, int NR>
void rows32(const uint8_t *row, int64_t row_bytes, const XRow &x, int64_t K, float *out) {
    constexpr bool minimum = T == Q4_1 || T == Q5_1;
    constexpr int64_t Z = sizeof(typename Block32<T>::B);
    const int64_t G = K / 32;
    __m256 acc0[NR], acc1[NR];
    float offset0[NR], offset1[NR];
    for (int r = 0; r < NR; r++) {
        acc0[r] = acc1[r] = _mm256_setzero_ps();
        offset0[r] = offset1[r] = 0.f;
    }
    int64_t g = 0;
    for (; g + 2 <= G; g += 2)
        for (int r = 0; r < NR; r++) {
            const uint8_t *b = row + r * row_bytes + g * Z;
            acc0[r] = block32<S, T>(b, x.q + 32 * g, x.d[g], acc0[r]);
            acc1[r] = block32<S, T>(b + Z, x.q + 32 * (g + 1), x.d[g + 1], acc1[r]);
            if constexpr (minimum) {
                offset0[r] += minimum_term<T>(b, x.s + g);
                offset1[r] += minimum_term<T>(b + Z, x.s + g + 1);
            }
        }
    if (g < G)
        for (int r = 0; r < NR; r++) {
            const uint8_t *b = row + r * row_bytes + g * Z;
            acc0[r] = block32<S, T>(b, x.q + 32 * g, x.d[g], acc0[r]);
            if constexpr (minimum) offset0[r] += minimum_term<T>(b, x.s + g);
        }
    for (int r = 0; r < NR; r++) out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + (offset0[r] + offset1[r]);
}

// -- the activations' rounding (block_format.cpp's round_activations, the same codes) ------
inline __m256i codes8(const float *x, __m256 inverse) {  // to nearest, ties to even (MXCSR's default), as lrintf
    return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inverse));
}

inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

// The exact totals of four rows' 8 int32 lanes: (total a, total b, total c, total d).
inline __m128i totals4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));  // per 128-bit half: a b c d
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

// Four accumulators by super-block (acc i % 4 of super-block i: block_format.cpp's dot256 for
// Q2_K / Q3_K, dot_iq), combined in the generic reference's order: (a0 + a2) + (a1 + a3).
inline __m128 four_accumulators(const __m128 *a) { return _mm_add_ps(_mm_add_ps(a[0], a[2]), _mm_add_ps(a[1], a[3])); }
inline float four_accumulators(const float *a) { return (a[0] + a[2]) + (a[1] + a[3]); }

// `groups` groups of `step` (32 or 256) inputs: codes q, step d, and s (PER32) or the 16-sums (PER256).
inline void round_groups(const float *x, int64_t groups, int64_t step, int8_t *q, float *d, float *s, int16_t *sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < groups; g++, x += step, q += step) {
        __m256 amax = _mm256_setzero_ps();
        for (int64_t j = 0; j < step; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float dg = _mm_cvtss_f32(m4) / 127.f, inv = dg > 0.f ? 1.f / dg : 0.f;
        const __m256 inverse = _mm256_set1_ps(inv);
        int32_t total = 0;
        for (int64_t j = 0; j < step; j += 32) {
            const __m256i n0 = codes8(x + j, inverse), n1 = codes8(x + j + 8, inverse), n2 = codes8(x + j + 16, inverse),
                          n3 = codes8(x + j + 24, inverse);
            // int32 -> int16 -> int8 (|code| <= 127); packs work per 128-bit lane, the permute restores the order
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(n0, n1), _mm256_packs_epi32(n2, n3)), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(q + j), bytes);
            const int32_t first = hsum_i32(_mm256_add_epi32(n0, n1)), second = hsum_i32(_mm256_add_epi32(n2, n3));
            total += first + second;
            if (sums != nullptr) {
                sums[g * 16 + j / 16] = static_cast<int16_t>(first);
                sums[g * 16 + j / 16 + 1] = static_cast<int16_t>(second);
            }
        }
        d[g] = dg;
        if (s != nullptr) s[g] = dg * static_cast<float>(total);
    }
}

// Q4_K / Q5_K's 12 scale bytes as 8 scales (low 8 bytes) and 8 minimums (high 8), six bits each,
// cut out of three 32-bit words at once (the same bits as scale_min_k4).
inline __m128i scales_mins_k4(const uint8_t *s) {
    uint32_t u[3];
    memcpy(u, s, sizeof u);
    const uint32_t six = 0x3F3F3F3Fu, four = 0x0F0F0F0Fu, top = 0x30303030u;
    return _mm_setr_epi32(static_cast<int>(u[0] & six), static_cast<int>((u[2] & four) | ((u[0] >> 2) & top)),
                          static_cast<int>(u[1] & six), static_cast<int>(((u[2] >> 4) & four) | ((u[1] >> 2) & top)));
}

// Q4_K / Q5_K: per 64 weights, sub-block 2j from the low nibbles and 2j + 1 from the high ones.
template <class S, int64_t T>
float dot_k4(const uint8_t *row, const XRow &x, int64_t K) {
    using B = std::conditional_t<T == Q5_K, BlockQ5_K, BlockQ4_K>;
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    __m128 mins = _mm_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const B &b = *reinterpret_cast<const B *>(row + i * static_cast<int64_t>(sizeof(B)));
        const int8_t *c = x.q + 256 * i;
        const __m256i both = _mm256_cvtepu8_epi16(scales_mins_k4(b.scales));  // 8 scales, 8 minimums as int16
        // the minimums times the activations' sums per 32 (pairs of the 16-sums)
        const __m256i sums = load(x.sums + 16 * i);
        const __m128i sums32 = _mm_hadd_epi16(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
        const __m128i msum = _mm_madd_epi16(_mm256_extracti128_si256(both, 1), sums32);
        const float dx = x.d[i];
        mins = _mm_fmadd_ps(_mm_set1_ps(half(b.dmin) * dx), _mm_cvtepi32_ps(msum), mins);
        const __m256i scales = _mm256_permute2x128_si256(both, both, 0x00);  // the 8 scales in both halves
        __m256i sumi = _mm256_setzero_si256();
        [[maybe_unused]] __m256i high;
        if constexpr (T == Q5_K) high = load(b.qh);
        for (int j = 0; j < 4; j++) {
            const __m256i q = load(b.qs + 32 * j);
            __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            if constexpr (T == Q5_K) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(high, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 1), one), 4));
                high = _mm256_srli_epi16(high, 2);
            }
            // scale 2j and 2j + 1 in every int16 lane (bytes 4j, 4j + 1 and 4j + 2, 4j + 3)
            const __m256i sl = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>((4 * j) | ((4 * j + 1) << 8))));
            const __m256i sh = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>((4 * j + 2) | ((4 * j + 3) << 8))));
            const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(c + 64 * j)), sl);
            const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(c + 64 * j + 32)), sh);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(plo, phi));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half(b.d) * dx), _mm256_cvtepi32_ps(sumi), acc);
    }
    __m128 m = _mm_add_ps(mins, _mm_movehl_ps(mins, mins));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return hsum(acc) - _mm_cvtss_f32(m);
}

// Q6_K: per half h of 128 weights, the four 32s t from ql's nibbles and qh's 2-bit fields
// (each field moved to bits 4..5 of its byte by one 16-bit shift and a mask: no bit crosses a
// byte there); the codes' offset of 32 is taken off as 32 sum(scale * the activations' 16-sums).
inline void q6_k_codes(const uint8_t *ql, const uint8_t *qh, __m256i q[4]) {
    const __m256i low4 = _mm256_set1_epi8(15), field = _mm256_set1_epi8(0x30);
    const __m256i l0 = load(ql), l1 = load(ql + 32), h = load(qh);
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), field));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), field));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(h, field));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(h, 2), field));
}

// Q6_K's int16 scales of the 32s 4 h + t (t = 0..3): lanes 0..7 scale 8 h + 2 t, 8..15 scale
// 8 h + 2 t + 1, one in-lane byte shuffle each of the half's 8 scales widened to int16 in both lanes.
inline void q6_k_scales(__m128i sc8, int h, __m256i scales[4]) {
    const __m128i half8 = _mm_cvtepi8_epi16(h == 0 ? sc8 : _mm_srli_si128(sc8, 8));  // scales 8 h .. 8 h + 7 as int16
    const __m256i both = _mm256_set_m128i(half8, half8);
    for (int t = 0; t < 4; t++) {
        const long long lo = 0x0100010001000100ll + 0x0404040404040404ll * t, hi = lo + 0x0202020202020202ll;
        const __m256i pick = _mm256_set_epi64x(hi, hi, lo, lo);  // bytes of int16 scale 2 t (low lane), 2 t + 1 (high lane)
        scales[t] = _mm256_shuffle_epi8(both, pick);
    }
}

// The read-ahead of a row's super-blocks: Q6_K_AHEAD bytes further on (past a row's end, the next
// row's first: a part's rows lie one after another), four lines a super-block of 210 bytes.
constexpr int64_t Q6_K_AHEAD = 1024;

template <class S>
float dot_q6_k(const uint8_t *row, const XRow &x, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t *p = row + i * static_cast<int64_t>(sizeof(BlockQ6_K));
        const BlockQ6_K &b = *reinterpret_cast<const BlockQ6_K *>(p);
        for (int l = 0; l < 4; l++) _mm_prefetch(reinterpret_cast<const char *>(p + Q6_K_AHEAD + 64 * l), _MM_HINT_T0);
        const int8_t *c = x.q + 256 * i;
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b.scales));
        const __m256i offset = _mm256_madd_epi16(load(x.sums + 16 * i), _mm256_cvtepi8_epi16(sc8));
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i q[4], scales[4];
            q6_k_codes(b.ql + 64 * h, b.qh + 32 * h, q);
            q6_k_scales(sc8, h, scales);
            for (int t = 0; t < 4; t++)
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q[t], load(c + 128 * h + 32 * t)), scales[t]));
        }
        sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half(b.d) * x.d[i]), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc);
}

// IQ4_XS: per sub-block s of 32, the code book's values (signed) by nibble, |w| times sign(w) x
// summed by vpmaddubsw (|w| <= 127, |x| <= 127: no int16 saturation) and weighted by the six-bit
// scale less 32 in vpmaddwd. block_tiles_x86.h's tiles run exactly these integer lanes.
inline __m256i iq4_xs_values(const uint8_t *qs) {  // 16 bytes -> the 32 weights' code book values
    const __m128i book = _mm_loadu_si128(reinterpret_cast<const __m128i *>(IQ4_NL_VALUES));
    return _mm256_shuffle_epi8(_mm256_set_m128i(book, book), nibbles(qs));
}

inline __m256i signed_products(__m256i w, __m256i x) {  // int16 lanes: pairs of w x, exact
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

template <class S>
float dot_iq4_xs(const uint8_t *row, const XRow &x, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const BlockIQ4_XS &b = *reinterpret_cast<const BlockIQ4_XS *>(row + i * static_cast<int64_t>(sizeof(BlockIQ4_XS)));
        const int8_t *c = x.q + 256 * i;
        __m256i sumi = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            const __m256i scale = _mm256_set1_epi16(static_cast<short>(iq4_xs_scale(b, s) - 32));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(signed_products(iq4_xs_values(b.qs + 16 * s), load(c + 32 * s)), scale));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half(b.d) * x.d[i]), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc);
}

}  // namespace
}  // namespace blocks
}  // namespace qkv

#include "block_float_x86.h"  // F16 / BF16: rows_float, dot_float, float_rows_by_k
#include "block_k2_x86.h"     // Q2_K / Q3_K: q3_scales, pair_scales, k2_sums, dot_k2
#include "block_grid_x86.h"   // the grid types: grid_part, dot_grid, tile_grid

namespace qkv {
namespace blocks {
namespace {

// FOUR rows of blocks at once where that measured faster (the nibble types: 8-20% on a 2048 x 2048
// and an 8192 x 2048 decode product, benchmarks/kernels/block_types.py); Q8_0 and Q5_1 measured
// slower that way, and the K-quants' two-row version too (registers run out): nullptr. F16 and
// BF16: four at once only where x outgrows L1 (float_rows_by_k).
template <class S>
RowsDot rows_for(int64_t type) {
    switch (type) {
        case Q4_0: return rows32<S, Q4_0, FOUR>;
        case Q4_1: return rows32<S, Q4_1, FOUR>;
        case Q5_0: return rows32<S, Q5_0, FOUR>;
        case IQ4_NL: return rows32<S, IQ4_NL, FOUR>;
        case F16: return float_rows_by_k<rows_float<F16, FOUR>, dot_float<F16>>;
        case BF16: return float_rows_by_k<rows_float<BF16, FOUR>, dot_float<BF16>>;
        default: return nullptr;
    }
}

template <class S>
RowDot dot_for(int64_t type) {
    switch (type) {
        case Q4_0: return dot32<S, Q4_0>;
        case Q4_1: return dot32<S, Q4_1>;
        case Q5_0: return dot32<S, Q5_0>;
        case Q5_1: return dot32<S, Q5_1>;
        case Q8_0: return dot32<S, Q8_0>;
        case IQ4_NL: return dot32<S, IQ4_NL>;
        case Q4_K: return dot_k4<S, Q4_K>;
        case Q5_K: return dot_k4<S, Q5_K>;
        case Q6_K: return dot_q6_k<S>;
        case Q2_K: return dot_k2<S, Q2_K>;
        case Q3_K: return dot_k2<S, Q3_K>;
        case IQ4_XS: return dot_iq4_xs<S>;
        case IQ2_XXS: return dot_grid<BlockIQ2_XXS>;
        case IQ2_XS: return dot_grid<BlockIQ2_XS>;
        case IQ2_S: return dot_grid<BlockIQ2_S>;
        case IQ3_XXS: return dot_grid<BlockIQ3_XXS>;
        case IQ3_S: return dot_grid<BlockIQ3_S>;
        case IQ1_S: return dot_grid<BlockIQ1_S>;
        case IQ1_M: return dot_grid<BlockIQ1_M>;
        case F16: return dot_float<F16>;
        case BF16: return dot_float<BF16>;
        default: return nullptr;
    }
}

}  // namespace
}  // namespace blocks
}  // namespace qkv
