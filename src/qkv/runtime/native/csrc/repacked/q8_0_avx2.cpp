// Q8_0_X16's product on AVX2 (q8_0.h): a ymm lane is a row of one half (8 rows) of the group;
// vpmaddubsw multiplies the 4 weights' magnitudes |q| by the activation codes carrying q's
// sign (|q| sign(q) c = q c, pairs of at most 2 * 128 * 127 = 32512: exact in int16), vpmaddwd
// sums the pairs into int32: the integers the AVX-512 kernel sums, the same floats after.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c"
#include "target_begin.h"

#include "q8_0.h"

namespace qkv {
namespace blocks {
namespace q8_0 {
namespace {

inline __m256i code4(const int8_t *c) {  // 4 activation codes in every lane
    int32_t v;
    memcpy(&v, c, 4);
    return _mm256_set1_epi32(v);
}

// Halves [h0, h0 + H) of the group (rows 8 h .. 8 h + 7) against N activation rows.
template <int N, int H>
void halves(const uint8_t *g, int64_t K, const XRow *xs, float *out, int h0) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t B = K / 32;
    const uint8_t *qs = g + 32 * B;
    __m256 acc[N][H];
    for (int m = 0; m < N; m++)
        for (int h = 0; h < H; h++) acc[m][h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < B; i++) {
        if constexpr (N == 1) read_ahead(g, i);
        const uint8_t *t = qs + UNITS * i;
        __m256i isum[N][H];
        for (int m = 0; m < N; m++)
            for (int h = 0; h < H; h++) isum[m][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++)
            for (int h = 0; h < H; h++) {
                const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(t + 64 * u + 32 * (h0 + h)));
                const __m256i magnitude = _mm256_sign_epi8(w, w);  // |q| (-128 as 128 unsigned)
                for (int m = 0; m < N; m++) {
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(code4(xs[m].q + 32 * i + 4 * u), w));
                    isum[m][h] = _mm256_add_epi32(isum[m][h], _mm256_madd_epi16(pairs, ones));
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

template <int N>
void by_halves(const uint8_t *g, int64_t K, const XRow *xs, float *out) {
    halves<N, 1>(g, K, xs, out, 0);
    halves<N, 1>(g, K, xs, out, 1);
}

}  // namespace

void avx2_group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *, int count, float *out) {
    switch (count) {  // one row: both halves in one pass over the weights; more: a half at a time (16 registers)
        case 1: return halves<1, 2>(g, K, xs, out, 0);
        case 2: return by_halves<2>(g, K, xs, out);
        case 3: return by_halves<3>(g, K, xs, out);
        default: return by_halves<MR>(g, K, xs, out);
    }
}

}  // namespace q8_0
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
