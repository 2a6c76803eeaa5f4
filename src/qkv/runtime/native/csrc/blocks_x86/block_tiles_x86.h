// Tiled block products for a prefill's many rows (block_format.h says what a tile is), over an
// instruction set S, after block_x86.h (whose one-row kernels they mirror): AVX2's tiles
// (block_avx2.cpp), and the super-blocks' unpacking AVX-512's wide tiles share
// (block_avx512.cpp).
//
// A tile is a band of rows of rounded activations against NR rows of weights: each weight block
// is unpacked once for the band (its codes, scales and steps), each activation block loaded once
// for the NR rows. Every output keeps the accumulators of its one-row kernel and takes exactly
// that kernel's float operations in the same order; the integer sums are exact, so computing
// them in another grouping changes no bit (batch invariance: a row's outputs never depend on
// how many rows run together).
//
// Shape legend: K inputs; G = K / 32 blocks (32-blocks) or K / 256 super-blocks (K-quants);
// M <= BAND activation rows x NR weight rows a tile; out[m * ldo + n].
#pragma once

#include <algorithm>
#include <cstring>

#include "block_x86.h"

namespace qkv {
namespace blocks {
namespace {

// -- 32-blocks: dot32's two accumulators (even blocks, odd blocks) and offsets per output ----
// A chunk of CHUNK blocks of the NR rows is unpacked once, then every row of the band takes it
// with its accumulators in registers.
constexpr int64_t CHUNK = 8;

template <int64_t T, int NR>
struct Chunk32 {
    __m256i u[CHUNK][NR];  // the codes a dot product multiplies: unsigned (minimum types), or |w|
    __m256i w[CHUNK][NR];  // the signed codes (their signs)
    __m256 dw[CHUNK][NR];  // half(d) in every lane
    float mw[CHUNK][NR];   // half(m) (minimum types)
};

template <int64_t T, int NR>
inline void unpack32(const uint8_t *row, int64_t row_bytes, int64_t g0, int64_t count, Chunk32<T, NR> &c) {
    constexpr bool minimum = T == Q4_1 || T == Q5_1;
    constexpr int64_t Z = sizeof(typename Block32<T>::B);
    for (int64_t j = 0; j < count; j++)
        for (int n = 0; n < NR; n++) {
            const uint8_t *b = row + n * row_bytes + (g0 + j) * Z;
            const __m256i w = codes32<T>(b);
            if constexpr (minimum) c.u[j][n] = w;
            else {
                c.u[j][n] = _mm256_sign_epi8(w, w);
                c.w[j][n] = w;
            }
            uint16_t d;
            memcpy(&d, b, sizeof d);
            c.dw[j][n] = _mm256_set1_ps(half(d));
            if constexpr (minimum) {
                uint16_t m;
                memcpy(&m, b + 2, sizeof m);
                c.mw[j][n] = half(m);
            }
        }
}

// Block g0 + j of the chunk into one accumulator set of row x: block32's operations (the int32
// lanes sum(w x) by whichever instructions, the same integers).
template <class S, int64_t T, int NR>
inline __attribute__((always_inline)) void take32(const Chunk32<T, NR> &c, int64_t j, const XRow &x, int64_t g,
                                                 __m256 *acc, float *offset) {
    constexpr bool minimum = T == Q4_1 || T == Q5_1;
    const __m256i codes = load(x.q + 32 * g);
    const __m256 dx = _mm256_set1_ps(x.d[g]);
    for (int n = 0; n < NR; n++) {
        __m256i dots;
        if constexpr (minimum) dots = S::dot4(c.u[j][n], codes);
        else dots = S::dot4(c.u[j][n], _mm256_sign_epi8(codes, c.w[j][n]));
        // half(d) * dx in every lane: the scalar product block32 broadcasts
        acc[n] = _mm256_fmadd_ps(_mm256_mul_ps(c.dw[j][n], dx), _mm256_cvtepi32_ps(dots), acc[n]);
        if constexpr (minimum) offset[n] += c.mw[j][n] * x.s[g];
    }
}

template <class S, int64_t T, int NR>
void tile32(const uint8_t *row, int64_t row_bytes, const XRow *xs, int64_t M, int64_t K, const void *, float *out, int64_t ldo) {
    const int64_t G = K / 32;
    __m256 acc[BAND][2][NR];
    float offset[BAND][2][NR];
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < NR; n++) {
            acc[m][0][n] = acc[m][1][n] = _mm256_setzero_ps();
            offset[m][0][n] = offset[m][1][n] = 0.f;
        }
    Chunk32<T, NR> c;
    for (int64_t g0 = 0; g0 < G; g0 += CHUNK) {  // g0 even: block g into accumulator g % 2, as dot32
        const int64_t count = std::min(CHUNK, G - g0);
        unpack32<T, NR>(row, row_bytes, g0, count, c);
        for (int64_t m = 0; m < M; m++) {
            __m256 even[NR], odd[NR];
            float even_offset[NR], odd_offset[NR];
            for (int n = 0; n < NR; n++) {
                even[n] = acc[m][0][n], odd[n] = acc[m][1][n];
                even_offset[n] = offset[m][0][n], odd_offset[n] = offset[m][1][n];
            }
            int64_t j = 0;
            if (count == CHUNK) {
#pragma GCC unroll 4
                for (; j < CHUNK; j += 2) {
                    take32<S, T, NR>(c, j, xs[m], g0 + j, even, even_offset);
                    take32<S, T, NR>(c, j + 1, xs[m], g0 + j + 1, odd, odd_offset);
                }
            } else {
                for (; j + 2 <= count; j += 2) {
                    take32<S, T, NR>(c, j, xs[m], g0 + j, even, even_offset);
                    take32<S, T, NR>(c, j + 1, xs[m], g0 + j + 1, odd, odd_offset);
                }
                if (j < count) take32<S, T, NR>(c, j, xs[m], g0 + j, even, even_offset);
            }
            for (int n = 0; n < NR; n++) {
                acc[m][0][n] = even[n], acc[m][1][n] = odd[n];
                offset[m][0][n] = even_offset[n], offset[m][1][n] = odd_offset[n];
            }
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < NR; n++)
            out[m * ldo + n] = hsum(_mm256_add_ps(acc[m][0][n], acc[m][1][n])) + (offset[m][0][n] + offset[m][1][n]);
}

// -- K-quant super-blocks: the 256 codes as 8 vectors of 32 (vector t meets the activations'
// codes 32 t .. 32 t + 31) and each vector's int16 scales, unpacked once a tile ------------
struct Unpacked256 {
    __m256i q[8], scales[8];
    __m256i extra;  // Q6_K / Q3_K: the 16 signed scales (the offsets' weights); Q2_K: the 16 minimums; Q5_K: 8 minimums
                    // (IQ4_XS: q holds the signed code book values, scales[t] sub-block t's scale less 32)
    float d, dmin;
};

template <int64_t T>
constexpr int64_t block_bytes256() {  // the tiles' super-block types
    return T == Q6_K ? sizeof(BlockQ6_K) : T == Q5_K ? sizeof(BlockQ5_K) : T == Q3_K ? sizeof(BlockQ3_K)
         : T == IQ4_XS ? sizeof(BlockIQ4_XS) : sizeof(BlockQ2_K);
}

template <int64_t T>
inline void unpack256(const uint8_t *p, Unpacked256 &u) {
    if constexpr (T == Q6_K) {
        const BlockQ6_K &b = *reinterpret_cast<const BlockQ6_K *>(p);
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b.scales));
        for (int h = 0; h < 2; h++) {  // as dot_q6_k
            q6_k_codes(b.ql + 64 * h, b.qh + 32 * h, u.q + 4 * h);
            q6_k_scales(sc8, h, u.scales + 4 * h);
        }
        u.extra = _mm256_cvtepi8_epi16(sc8);
        u.d = half(b.d);
    } else if constexpr (T == IQ4_XS) {
        const BlockIQ4_XS &b = *reinterpret_cast<const BlockIQ4_XS *>(p);
        for (int t = 0; t < 8; t++) {  // as dot_iq4_xs
            u.q[t] = iq4_xs_values(b.qs + 16 * t);
            u.scales[t] = _mm256_set1_epi16(static_cast<short>(iq4_xs_scale(b, t) - 32));
        }
        u.extra = _mm256_setzero_si256();
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
            sc8 = q3_scales(b.scales);
            hm = load(b.hmask);
            u.extra = _mm256_cvtepi8_epi16(sc8);
        }
        const Scales16 scales = scales16(sc8, T == Q3_K);
        for (int h = 0; h < 2; h++) {
            const __m256i bits = load(b.qs + 32 * h);
            for (int t = 0; t < 4; t++) {
                __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * t), three);
                if constexpr (T == Q3_K) q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + t), one), 2));
                u.q[4 * h + t] = q;
                u.scales[4 * h + t] = pair_scales(scales, 8 * h + 2 * t);
            }
        }
        u.d = half(b.d);
    }
}

// One super-block i of the NR rows (unpacked) against row x: sumi per row as the one-row kernel's,
// then its float operations.
template <int64_t T, int NR>
inline __attribute__((always_inline)) void take256(const Unpacked256 *u, const XRow &x, int64_t i, __m256 *acc,
                                                  __m128 *mins4) {
    const int8_t *c = x.q + 256 * i;
    const __m256i sums = load(x.sums + 16 * i);
    const float dx = x.d[i];
    __m256i sumi[NR];
    for (int n = 0; n < NR; n++) sumi[n] = _mm256_setzero_si256();
    for (int t = 0; t < 8; t++) {
        const __m256i codes = load(c + 32 * t);
        for (int n = 0; n < NR; n++) {
            const __m256i p16 = T == IQ4_XS ? signed_products(u[n].q[t], codes) : _mm256_maddubs_epi16(u[n].q[t], codes);
            sumi[n] = _mm256_add_epi32(sumi[n], _mm256_madd_epi16(p16, u[n].scales[t]));
        }
    }
    for (int n = 0; n < NR; n++) {
        // Q6_K: the codes' offset 32 times sum(scale * the 16-sums), taken off (extra holds -32 times the scales)
        if constexpr (T == Q6_K) sumi[n] = _mm256_add_epi32(sumi[n], _mm256_madd_epi16(sums, u[n].extra));
        if constexpr (T == Q5_K) {
            const __m128i sums32 = _mm_hadd_epi16(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
            const __m128i msum = _mm_madd_epi16(_mm256_extracti128_si256(u[n].extra, 1), sums32);
            mins4[n] = _mm_fmadd_ps(_mm_set1_ps(u[n].dmin * dx), _mm_cvtepi32_ps(msum), mins4[n]);
        }
        acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(u[n].d * dx), _mm256_cvtepi32_ps(sumi[n]), acc[n]);
    }
}

// Q2_K / Q3_K: dot_k2's exact sums (its int32 lanes by other means: each row's total is the same)
// of four weight rows side by side, then its float operations in one register: the generic bits.
template <int64_t T, int NR>
void tile_k2(const uint8_t *row, int64_t row_bytes, const XRow *xs, int64_t M, int64_t K, const void *, float *out, int64_t ldo) {
    static_assert(NR == 4, "the four rows' totals share one register");
    constexpr int64_t Z = block_bytes256<T>();
    __m128 acc[BAND][4];  // the four rows' lanes; dot_k2's accumulator i % 4 of super-block i
    for (int64_t m = 0; m < M; m++)
        for (int a = 0; a < 4; a++) acc[m][a] = _mm_setzero_ps();
    Unpacked256 u[NR];
    for (int64_t i = 0; i < K / 256; i++) {
        for (int n = 0; n < NR; n++) {
            unpack256<T>(row + n * row_bytes + i * Z, u[n]);
            if constexpr (T == Q3_K) u[n].extra = _mm256_mullo_epi16(u[n].extra, _mm256_set1_epi16(-4));
        }
        const __m128 d_w = _mm_setr_ps(u[0].d, u[1].d, u[2].d, u[3].d);
        [[maybe_unused]] const __m128 dmin_w = _mm_setr_ps(u[0].dmin, u[1].dmin, u[2].dmin, u[3].dmin);
        for (int64_t m = 0; m < M; m++) {
            const int8_t *c = xs[m].q + 256 * i;
            const __m256i sums = load(xs[m].sums + 16 * i);
            __m256i sumi[NR];
            for (int n = 0; n < NR; n++) sumi[n] = T == Q3_K ? _mm256_madd_epi16(sums, u[n].extra) : _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i codes = load(c + 32 * t);
                for (int n = 0; n < NR; n++)
                    sumi[n] = _mm256_add_epi32(sumi[n], _mm256_madd_epi16(_mm256_maddubs_epi16(u[n].q[t], codes), u[n].scales[t]));
            }
            const __m128 dx = _mm_set1_ps(xs[m].d[i]);
            __m128 &a = acc[m][i % 4];
            a = _mm_add_ps(a, _mm_mul_ps(_mm_mul_ps(d_w, dx), _mm_cvtepi32_ps(totals4(sumi[0], sumi[1], sumi[2], sumi[3]))));
            if constexpr (T == Q2_K) {
                __m256i msum[NR];
                for (int n = 0; n < NR; n++) msum[n] = _mm256_madd_epi16(u[n].extra, sums);
                a = _mm_sub_ps(a, _mm_mul_ps(_mm_mul_ps(dmin_w, dx), _mm_cvtepi32_ps(totals4(msum[0], msum[1], msum[2], msum[3]))));
            }
        }
    }
    for (int64_t m = 0; m < M; m++)
        _mm_storeu_ps(out + m * ldo, four_accumulators(acc[m]));
}

template <int64_t T, int NR>
void tile256(const uint8_t *row, int64_t row_bytes, const XRow *xs, int64_t M, int64_t K, const void *, float *out, int64_t ldo) {
    constexpr int64_t Z = block_bytes256<T>();
    static_assert(T != Q2_K && T != Q3_K, "Q2_K / Q3_K: tile_k2");
    __m256 acc[BAND][NR];
    __m128 mins4[T == Q5_K ? BAND : 1][NR];
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < NR; n++) {
            acc[m][n] = _mm256_setzero_ps();
            if constexpr (T == Q5_K) mins4[m][n] = _mm_setzero_ps();
        }
    Unpacked256 u[NR];
    for (int64_t i = 0; i < K / 256; i++) {
        for (int n = 0; n < NR; n++) {
            unpack256<T>(row + n * row_bytes + i * Z, u[n]);
            if constexpr (T == Q6_K) u[n].extra = _mm256_mullo_epi16(u[n].extra, _mm256_set1_epi16(-32));
        }
        for (int64_t m = 0; m < M; m++) take256<T, NR>(u, xs[m], i, acc[m], T == Q5_K ? mins4[m] : mins4[0]);
    }
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < NR; n++) {
            float v = hsum(acc[m][n]);
            if constexpr (T == Q5_K) {
                __m128 s = _mm_add_ps(mins4[m][n], _mm_movehl_ps(mins4[m][n], mins4[m][n]));
                s = _mm_add_ss(s, _mm_movehdup_ps(s));
                v -= _mm_cvtss_f32(s);
            }
            out[m * ldo + n] = v;
        }
}

// -- F16 / BF16: rows_float's four accumulators per output, a chunk of FLOAT_CHUNK inputs of
// the NR weight rows widened once into float32 for the band ------------------------------
// The accumulators a_j of an output are independent sums (inputs 32 g + 8 j .., g in order),
// so a chunk runs one j at a time, and for that j a block of MR activation rows x NR weight
// rows keeps its MR * NR sums in registers: per 32 inputs, MR + NR loads feed MR * NR fused
// multiply-adds (rows_float's order per sum, so its bits), not the 12 loads per 8 of an
// output's four sums held together. FLOAT_MR = 3 rows x 4 weight rows: 12 sums, 7 registers
// of loads; chunks of 512 inputs (4 rows: 8 KiB widened) amortize the passes' loads and stores.
constexpr int64_t FLOAT_CHUNK = 512;
constexpr int FLOAT_MR = 3;

// A band of float32 rows is cut to FLOAT_BAND_BYTES, to stay in a core's L2 while the piece's
// tiles each read all of it (64 rows at K = 8192 are 2 MiB: from L3 for every NR weight rows).
// Both variants' F16 / BF16 tiles read the band in this layout (AVX-512's: block_float_avx512.h).
constexpr int64_t FLOAT_BAND_BYTES = 512 * 1024;

int64_t float_band_rows(int64_t K) {  // BAND, BAND / 2 or BAND / 4: a band divides apply_blocks' row groups
    int64_t rows = BAND;
    while (rows > BAND / 4 && rows * K * static_cast<int64_t>(sizeof(float)) > FLOAT_BAND_BYTES) rows /= 2;
    return rows;
}

// The band's rows laid out chunk by chunk (prepare_float, once a product): chunk k0 of a band of
// R rows holds row m's inputs k0 .. k0 + count at band + k0 * R + m * count, so a pass's MR rows
// are count floats apart, not K (at K = 8192, 32 KiB apart, they share cache sets).
int64_t prepared_float_bytes(int64_t M, int64_t K) { return M * K * static_cast<int64_t>(sizeof(float)); }

void prepare_float(const XRow *xs, int64_t M, int64_t K, void *prepared) {
    float *P = static_cast<float *>(prepared);
    const int64_t rows = float_band_rows(K);
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t R = std::min(rows, M - m0);
        float *band = P + m0 * K;
        for (int64_t k0 = 0; k0 < K; k0 += FLOAT_CHUNK) {
            const int64_t count = std::min(FLOAT_CHUNK, K - k0);
            for (int64_t m = 0; m < R; m++)
                std::memcpy(band + k0 * R + m * count, xs[m0 + m].x + k0, static_cast<size_t>(count) * sizeof(float));
        }
    }
}


template <int MR, int NR>
inline void float_pass(const float (*w)[FLOAT_CHUNK], const float *x, int64_t count, int j, __m256 (*acc)[NR][4]) {
    __m256 a[MR][NR];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) a[m][n] = acc[m][n][j];
    for (int64_t k = 8 * j; k < count; k += 32) {
        __m256 xv[MR];
        for (int m = 0; m < MR; m++) xv[m] = _mm256_loadu_ps(x + m * count + k);  // prepare_float's rows, count apart
        for (int n = 0; n < NR; n++) {
            const __m256 wv = _mm256_load_ps(w[n] + k);
            for (int m = 0; m < MR; m++) a[m][n] = _mm256_fmadd_ps(wv, xv[m], a[m][n]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) acc[m][n][j] = a[m][n];
}

template <int64_t T, int NR>
void tile_float(const uint8_t *row, int64_t row_bytes, const XRow *, int64_t M, int64_t K, const void *prepared, float *out,
                int64_t ldo) {
    const float *band = static_cast<const float *>(prepared);
    alignas(32) float w[NR][FLOAT_CHUNK];
    __m256 acc[BAND][NR][4];
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < NR; n++)
            for (int j = 0; j < 4; j++) acc[m][n][j] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += FLOAT_CHUNK) {
        const int64_t count = std::min(FLOAT_CHUNK, K - k0);  // whole blocks of 32
        for (int n = 0; n < NR; n++)
            for (int64_t k = 0; k < count; k += 8)
                _mm256_store_ps(w[n] + k, widen8<T>(reinterpret_cast<const uint16_t *>(row + n * row_bytes) + k0 + k));
        const float *chunk = band + k0 * M;  // (M, count)
        for (int64_t m = 0; m < M; m += FLOAT_MR)
            for (int j = 0; j < 4; j++) {
                const float *x = chunk + m * count;
                switch (std::min<int64_t>(FLOAT_MR, M - m)) {
                    case 1: float_pass<1, NR>(w, x, count, j, acc + m); break;
                    case 2: float_pass<2, NR>(w, x, count, j, acc + m); break;
                    default: float_pass<FLOAT_MR, NR>(w, x, count, j, acc + m); break;
                }
            }
    }
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < NR; n++) out[m * ldo + n] = float_total(acc[m][n]);
}

// Q6_K's weight rows a tile (the other super-blocks: NR256): four measured 1.13-1.26x two on
// AVX2 at 512 rows, one thread (2048 x 2048, the same bits).
constexpr int Q6_K_TILE_ROWS = 4;

// The tile each type runs (Q4_K: none here, its interleaved kernels are its own), or {}.
// NR32 / NR256: weight rows a tile of 32-blocks / super-blocks (AVX2's tiles; AVX-512 has wide
// ones of its own, block_tiles_avx512.h); Q4_K: none here, its interleaved kernels are its own.
template <class S, int NR32, int NR256>
Tile tile_for(int64_t type) {
    switch (type) {
        case Q4_0: return {tile32<S, Q4_0, NR32>, NR32};
        case Q4_1: return {tile32<S, Q4_1, NR32>, NR32};
        case Q5_0: return {tile32<S, Q5_0, NR32>, NR32};
        case Q5_1: return {tile32<S, Q5_1, NR32>, NR32};
        case Q8_0: return {tile32<S, Q8_0, NR32>, NR32};
        case IQ4_NL: return {tile32<S, IQ4_NL, NR32>, NR32};
        case Q2_K: return {tile_k2<Q2_K, 4>, 4};
        case Q3_K: return {tile_k2<Q3_K, 4>, 4};
        case Q5_K: return {tile256<Q5_K, NR256>, NR256};
        case Q6_K: return {tile256<Q6_K, Q6_K_TILE_ROWS>, Q6_K_TILE_ROWS};
        case IQ4_XS: return {tile256<IQ4_XS, NR256>, NR256};
        case F16: return {tile_float<F16, 4>, 4, prepared_float_bytes, prepare_float, float_band_rows};
        case BF16: return {tile_float<BF16, 4>, 4, prepared_float_bytes, prepare_float, float_band_rows};
        default: return grid_tile_for(type);
    }
}

}  // namespace
}  // namespace blocks
}  // namespace qkv
