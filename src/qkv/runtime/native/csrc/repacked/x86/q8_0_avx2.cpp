// Q8_0_X16's and Q5_0_X16's product on AVX2 (q8_0.h): a ymm lane is a row of one half (8 rows)
// of the group; vpmaddubsw multiplies Q8_0's 4 weights' magnitudes |q| by the activation codes
// carrying q's sign (|q| sign(q) c = q c, pairs of at most 2 * 128 * 127 = 32512: exact in
// int16), or Q5_0's unsigned codes by the activation codes, and vpmaddwd sums the pairs into
// int32: the integers the AVX-512 kernel sums, the same floats after.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c"
#include "target_begin.h"

#include "../q8_0.h"

namespace qkv {
namespace blocks {
namespace q8_0 {
namespace {

inline __m256i code4(const int8_t *c) {  // 4 activation codes in every lane
    int32_t v;
    memcpy(&v, c, 4);
    return _mm256_set1_epi32(v);
}

// Step s (0..3) of a block, half h: two weight vectors of 8 rows x 4 codes and where their
// activation codes start (Q8_0: units 2 s and 2 s + 1, signed; Q5_0: unit s's low and high
// nibbles with their fifth bits, unsigned codes 0..31: the offset of 16 is taken off after).
template <Type T>
inline void step(const uint8_t *body, int s, int h, __m256i &w0, int &c0, __m256i &w1, int &c1) {
    if constexpr (T == Q8_0) {
        w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(body + 128 * s + 32 * h));
        w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(body + 128 * s + 64 + 32 * h));
        c0 = 8 * s, c1 = 8 * s + 4;
    } else {
        const __m256i low4 = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(body + 32 * h));
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(body + QH5 + 64 * s + 32 * h));
        const __m256i lanes = _mm256_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0);
        const __m256i bit = _mm256_set1_epi32(static_cast<int32_t>(0x08040201u << (4 * (s % 2))));
        auto fifth = [&](int byte) {  // 16 where the weight's fifth bit (in qh's byte `byte`) is set
            const __m256i spread = _mm256_shuffle_epi8(qh, _mm256_add_epi32(lanes, _mm256_set1_epi32(byte * 0x01010101)));
            return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), sixteen);
        };
        w0 = _mm256_or_si256(_mm256_and_si256(w, low4), fifth(s / 2));
        w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), low4), fifth(2 + s / 2));
        c0 = 4 * s, c1 = 16 + 4 * s;
    }
}

// Q8_0: |q| against the codes carrying q's sign; Q5_0: the unsigned codes as they are.
template <Type T>
inline __m256i products(__m256i w, __m256i c) {
    if constexpr (T == Q8_0) return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(c, w));
    else return _mm256_maddubs_epi16(w, c);  // pairs of at most 2 * 31 * 128: exact in int16
}

// Halves [h0, h0 + H) of the group (rows 8 h .. 8 h + 7) against N activation rows.
template <Type T, int N, int H>
void halves(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, float *out, int h0) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t B = K / 32;
    const uint8_t *bodies = g + 32 * B;
    __m256 acc[N][H];
    for (int m = 0; m < N; m++)
        for (int h = 0; h < H; h++) acc[m][h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < B; i++) {
        if constexpr (N == 1) read_ahead<T>(g, i);
        const uint8_t *body = bodies + body_bytes(T) * i;
        __m256i isum[N][H];
        for (int m = 0; m < N; m++)
            for (int h = 0; h < H; h++)  // Q5_0's codes are q + 16: the sum starts at -16 sum(c)
                isum[m][h] = T == Q5_0 ? _mm256_set1_epi32(-code_offset(T) * p[m * B + i]) : _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++)
            for (int h = 0; h < H; h++) {
                __m256i w0, w1;
                int c0, c1;
                step<T>(body, s, h0 + h, w0, c0, w1, c1);
                for (int m = 0; m < N; m++) {
                    const int8_t *c = xs[m].q + 32 * i;
                    isum[m][h] = _mm256_add_epi32(isum[m][h], _mm256_madd_epi16(products<T>(w0, code4(c + c0)), ones));
                    isum[m][h] = _mm256_add_epi32(isum[m][h], _mm256_madd_epi16(products<T>(w1, code4(c + c1)), ones));
                }
            }
        for (int h = 0; h < H; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(g + 32 * i + 16 * (h0 + h))));
            for (int m = 0; m < N; m++)
                acc[m][h] = _mm256_add_ps(acc[m][h], _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[m].d[i])), _mm256_cvtepi32_ps(isum[m][h])));
        }
    }
    for (int m = 0; m < N; m++)
        for (int h = 0; h < H; h++) _mm256_storeu_ps(out + ROWS * m + 8 * (h0 + h), acc[m][h]);
}

template <Type T, int N>
void by_halves(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, float *out) {
    halves<T, N, 1>(g, K, xs, p, out, 0);
    halves<T, N, 1>(g, K, xs, p, out, 1);
}

}  // namespace

template <Type T>
void avx2_group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, int count, float *out) {
    switch (count) {  // one row: both halves in one pass over the weights; more: a half at a time (16 registers)
        case 1: return halves<T, 1, 2>(g, K, xs, p, out, 0);
        case 2: return by_halves<T, 2>(g, K, xs, p, out);
        case 3: return by_halves<T, 3>(g, K, xs, p, out);
        default: return by_halves<T, MR>(g, K, xs, p, out);
    }
}

template void avx2_group<Q8_0>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);
template void avx2_group<Q5_0>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);

}  // namespace q8_0
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
