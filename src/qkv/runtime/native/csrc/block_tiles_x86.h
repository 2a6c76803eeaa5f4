// Tiled block products for a prefill's many rows (block_tiles.h says what a tile is), written
// once over an instruction set S and compiled twice, inside block_avx2.cpp's and
// block_avx512.cpp's target regions, after block_x86.h (whose one-row kernels they mirror).
//
// A tile is MR rows of rounded activations against NR rows of weights. Each weight block is
// unpacked once for the MR rows (its codes, scales and steps), each activation block loaded
// once for the NR rows. Every output keeps the accumulators of its one-row kernel and takes
// exactly that kernel's float operations in the same order; the integer sums are exact, so
// computing them once per (row, block) in another grouping changes no bit (batch invariance:
// a row's outputs never depend on how many rows run together).
//
// Shape legend: K inputs; G = K / 32 blocks (32-blocks) or K / 256 super-blocks (K-quants);
// MR activation rows x NR weight rows a tile; out[m * ldo + n].
#pragma once

#include "block_tiles.h"
#include "block_x86.h"

namespace qkv {
namespace blocks {
namespace {

// -- 32-blocks: dot32's two accumulators (even blocks, odd blocks) and offsets per output ----
template <int MR, int NR>
struct Acc32 {
    __m256 acc[MR][NR];
    float offset[MR][NR];
};

// The signed codes' int32 lanes sum(w x) as block32 computes them (|w| times sign(w) x): the
// same integers, whatever instructions give them.
template <class S, int64_t T>
inline __m256i signed_dots(__m256i w, __m256i magnitude, __m256i x) {
    return S::dot4(magnitude, _mm256_sign_epi8(x, w));
}

// One 32-block g of NR weight rows into one accumulator set, for MR rows of x.
template <class S, int64_t T, int MR, int NR>
inline __attribute__((always_inline)) void step32(const uint8_t *row, int64_t row_bytes, const XRow *xs, int64_t g,
                                                 Acc32<MR, NR> &a) {
    constexpr bool minimum = T == Q4_1 || T == Q5_1;
    constexpr int64_t Z = sizeof(typename Block32<T>::B);
    __m256i w[NR], magnitude[NR];
    __m256 dw[NR];
    float mw[NR];
    for (int n = 0; n < NR; n++) {
        const uint8_t *b = row + n * row_bytes + g * Z;
        w[n] = codes32<T>(b);
        if constexpr (!minimum) magnitude[n] = _mm256_sign_epi8(w[n], w[n]);
        uint16_t d;
        memcpy(&d, b, sizeof d);
        dw[n] = _mm256_set1_ps(half(d));
        if constexpr (minimum) {
            uint16_t m;
            memcpy(&m, b + 2, sizeof m);
            mw[n] = half(m);
        }
    }
    for (int m = 0; m < MR; m++) {
        const __m256i x = load(xs[m].q + 32 * g);
        const __m256 dx = _mm256_set1_ps(xs[m].d[g]);
        for (int n = 0; n < NR; n++) {
            const __m256i dots = minimum ? S::dot4(w[n], x) : signed_dots<S, T>(w[n], magnitude[n], x);
            // half(d) * dx in every lane: the scalar product block32 broadcasts
            a.acc[m][n] = _mm256_fmadd_ps(_mm256_mul_ps(dw[n], dx), _mm256_cvtepi32_ps(dots), a.acc[m][n]);
            if constexpr (minimum) a.offset[m][n] += mw[n] * xs[m].s[g];
        }
    }
}

template <class S, int64_t T, int MR, int NR>
void tile32(const uint8_t *row, int64_t row_bytes, const XRow *xs, int64_t K, float *out, int64_t ldo) {
    const int64_t G = K / 32;
    Acc32<MR, NR> even, odd;
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) {
            even.acc[m][n] = odd.acc[m][n] = _mm256_setzero_ps();
            even.offset[m][n] = odd.offset[m][n] = 0.f;
        }
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
        step32<S, T, MR, NR>(row, row_bytes, xs, g, even);
        step32<S, T, MR, NR>(row, row_bytes, xs, g + 1, odd);
    }
    if (g < G) step32<S, T, MR, NR>(row, row_bytes, xs, g, even);
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++)
            out[m * ldo + n] = hsum(_mm256_add_ps(even.acc[m][n], odd.acc[m][n])) + (even.offset[m][n] + odd.offset[m][n]);
}

// -- K-quant super-blocks: the 256 codes as 8 vectors of 32 (vector t meets the activations'
// codes 32 t .. 32 t + 31) and each vector's int16 scales, unpacked once a tile ------------
struct Unpacked256 {
    __m256i q[8], scales[8];
    __m256i extra;  // Q6_K / Q3_K: the 16 signed scales (the offsets' weights); Q2_K: the 16 minimums; Q5_K: 8 minimums
    float d, dmin;
};

template <int64_t T>
inline void unpack256(const uint8_t *p, Unpacked256 &u) {
    if constexpr (T == Q6_K) {
        const BlockQ6_K &b = *reinterpret_cast<const BlockQ6_K *>(p);
        const __m256i low4 = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b.scales));
        for (int h = 0; h < 2; h++) {  // as dot_q6_k
            const __m256i l0 = load(b.ql + 64 * h), l1 = load(b.ql + 64 * h + 32), qh = load(b.qh + 32 * h);
            u.q[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
            u.q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
            u.q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
            u.q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
            for (int t = 0; t < 4; t++) u.scales[4 * h + t] = two_scales16(sc8, 8 * h + 2 * t, true);
        }
        u.extra = _mm256_cvtepi8_epi16(sc8);
        u.d = half(b.d);
    } else if constexpr (T == Q5_K) {
        const BlockQ5_K &b = *reinterpret_cast<const BlockQ5_K *>(p);
        const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
        const __m256i both = _mm256_cvtepu8_epi16(scales_mins_k4(b.scales));
        const __m256i scales = _mm256_permute2x128_si256(both, both, 0x00);
        __m256i high = load(b.qh);
        for (int j = 0; j < 4; j++) {  // as dot_k4
            const __m256i q = load(b.qs + 32 * j);
            u.q[2 * j] = _mm256_or_si256(_mm256_and_si256(q, low4), _mm256_slli_epi16(_mm256_and_si256(high, one), 4));
            u.q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), low4),
                                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 1), one), 4));
            high = _mm256_srli_epi16(high, 2);
            u.scales[2 * j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>((4 * j) | ((4 * j + 1) << 8))));
            u.scales[2 * j + 1] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>((4 * j + 2) | ((4 * j + 3) << 8))));
        }
        u.extra = both;
        u.d = half(b.d);
        u.dmin = half(b.dmin);
    } else {  // Q2_K, Q3_K: as dot_k2
        using B = std::conditional_t<T == Q3_K, BlockQ3_K, BlockQ2_K>;
        const B &b = *reinterpret_cast<const B *>(p);
        const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
        __m128i sc8;
        [[maybe_unused]] __m256i hm;
        if constexpr (T == Q2_K) {
            const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b.scales));
            sc8 = _mm_and_si128(packed, _mm_set1_epi8(15));
            u.extra = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15)));
            u.dmin = half(b.dmin);
        } else {
            int8_t sc[16];
            for (int s = 0; s < 16; s++) sc[s] = static_cast<int8_t>(q3_scale(b.scales, s) - 32);
            sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(sc));
            hm = load(b.hmask);
            u.extra = _mm256_cvtepi8_epi16(sc8);
        }
        for (int h = 0; h < 2; h++) {
            const __m256i bits = load(b.qs + 32 * h);
            for (int t = 0; t < 4; t++) {
                __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * t), three);
                if constexpr (T == Q3_K) q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + t), one), 2));
                u.q[4 * h + t] = q;
                u.scales[4 * h + t] = two_scales16(sc8, 8 * h + 2 * t, T == Q3_K);
            }
        }
        u.d = half(b.d);
    }
}

template <int MR, int NR>
struct Acc256 {
    __m256 acc[MR][NR], mins[MR][NR];  // Q2_K's minimums (Q3_K: zero, as dot_k2 keeps them)
    __m128 mins4[MR][NR];              // Q5_K's minimums, as dot_k4's
};

template <class S, int64_t T, int MR, int NR>
void tile256(const uint8_t *row, int64_t row_bytes, const XRow *xs, int64_t K, float *out, int64_t ldo) {
    constexpr int64_t Z = T == Q6_K ? sizeof(BlockQ6_K) : T == Q5_K ? sizeof(BlockQ5_K) : T == Q3_K ? sizeof(BlockQ3_K) : sizeof(BlockQ2_K);
    Acc256<MR, NR> a;
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) {
            a.acc[m][n] = a.mins[m][n] = _mm256_setzero_ps();
            a.mins4[m][n] = _mm_setzero_ps();
        }
    Unpacked256 u[NR];
    for (int64_t i = 0; i < K / 256; i++) {
        for (int n = 0; n < NR; n++) unpack256<T>(row + n * row_bytes + i * Z, u[n]);
        for (int m = 0; m < MR; m++) {
            const int8_t *c = xs[m].q + 256 * i;
            const __m256i sums = load(xs[m].sums + 16 * i);
            const float dx = xs[m].d[i];
            __m256i sumi[NR];
            for (int n = 0; n < NR; n++) sumi[n] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i x = load(c + 32 * t);
                for (int n = 0; n < NR; n++)
                    sumi[n] = _mm256_add_epi32(sumi[n], _mm256_madd_epi16(_mm256_maddubs_epi16(u[n].q[t], x), u[n].scales[t]));
            }
            for (int n = 0; n < NR; n++) {
                if constexpr (T == Q6_K) sumi[n] = _mm256_sub_epi32(sumi[n], _mm256_slli_epi32(_mm256_madd_epi16(sums, u[n].extra), 5));
                if constexpr (T == Q3_K) sumi[n] = _mm256_sub_epi32(sumi[n], _mm256_slli_epi32(_mm256_madd_epi16(sums, u[n].extra), 2));
                if constexpr (T == Q2_K)
                    a.mins[m][n] = _mm256_fmadd_ps(_mm256_set1_ps(u[n].dmin * dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(u[n].extra, sums)),
                                                   a.mins[m][n]);
                if constexpr (T == Q5_K) {
                    const __m128i sums32 = _mm_hadd_epi16(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
                    const __m128i msum = _mm_madd_epi16(_mm256_extracti128_si256(u[n].extra, 1), sums32);
                    a.mins4[m][n] = _mm_fmadd_ps(_mm_set1_ps(u[n].dmin * dx), _mm_cvtepi32_ps(msum), a.mins4[m][n]);
                }
                a.acc[m][n] = _mm256_fmadd_ps(_mm256_set1_ps(u[n].d * dx), _mm256_cvtepi32_ps(sumi[n]), a.acc[m][n]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) {
            float v;
            if constexpr (T == Q6_K) {
                v = hsum(a.acc[m][n]);
            } else if constexpr (T == Q5_K) {
                __m128 s = _mm_add_ps(a.mins4[m][n], _mm_movehl_ps(a.mins4[m][n], a.mins4[m][n]));
                s = _mm_add_ss(s, _mm_movehdup_ps(s));
                v = hsum(a.acc[m][n]) - _mm_cvtss_f32(s);
            } else {
                v = hsum(a.acc[m][n]) - hsum(a.mins[m][n]);
            }
            out[m * ldo + n] = v;
        }
}

// The tile each type runs (Q4_K: none here, its interleaved kernels are its own), or {}.
template <class S, int MR, int NR>
Tile tile_for(int64_t type) {
    switch (type) {
        case Q4_0: return {tile32<S, Q4_0, MR, NR>, MR, NR};
        case Q4_1: return {tile32<S, Q4_1, MR, NR>, MR, NR};
        case Q5_0: return {tile32<S, Q5_0, MR, NR>, MR, NR};
        case Q5_1: return {tile32<S, Q5_1, MR, NR>, MR, NR};
        case Q8_0: return {tile32<S, Q8_0, MR, NR>, MR, NR};
        case IQ4_NL: return {tile32<S, IQ4_NL, MR, NR>, MR, NR};
        case Q2_K: return {tile256<S, Q2_K, MR, NR>, MR, NR};
        case Q3_K: return {tile256<S, Q3_K, MR, NR>, MR, NR};
        case Q5_K: return {tile256<S, Q5_K, MR, NR>, MR, NR};
        case Q6_K: return {tile256<S, Q6_K, MR, NR>, MR, NR};
        default: return {};
    }
}

}  // namespace
}  // namespace blocks
}  // namespace qkv
