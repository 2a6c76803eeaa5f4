// IQ4_XS_X16's product on AVX2 (iq4xs.h): a ymm lane is a row of one half (8 rows) of the group;
// the nibbles' code book values (signed, vpshufb) meet the activation codes as Q8_0_X16's AVX2
// kernel meets its weights: vpmaddubsw of the magnitudes |v| by the codes carrying v's sign
// (pairs of at most 2 * 127 * 128: exact in int16), vpmaddwd into int32: the integers the
// AVX-512 kernel sums, the same floats after.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c"
#include "target_begin.h"

#include "../iq4xs.h"

namespace qkv {
namespace blocks {
namespace iq4xs {
namespace {

inline __m256i code4(const int8_t *c) {  // 4 activation codes in every lane
    int32_t v;
    memcpy(&v, c, 4);
    return _mm256_set1_epi32(v);
}

inline __m256i products(__m256i v, __m256i c, __m256i ones) {  // sum of 4 v c a lane, exact
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(c, v)), ones);
}

// Halves [h0, h0 + H) of the group (rows 8 h .. 8 h + 7) against N activation rows.
template <int N, int H>
void halves(const uint8_t *g, int64_t K, const XRow *xs, float *out, int h0) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(IQ4_NL_VALUES)));
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), four = _mm256_set1_epi32(15),
                  two = _mm256_set1_epi32(3), thirty_two = _mm256_set1_epi32(32);
    __m256 acc[N][H];
    for (int m = 0; m < N; m++)
        for (int h = 0; h < H; h++) acc[m][h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t *t = g + i * TILE;
        if constexpr (N == 1)
            for (int64_t a = 0; a < TILE; a += 64) _mm_prefetch(reinterpret_cast<const char *>(t + 2 * TILE + a), _MM_HINT_T0);
        __m256i isum[N][H], sh[H], sl[H];
        for (int h = 0; h < H; h++) {
            sh[h] = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(t + SH + 16 * (h0 + h))));
            sl[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(t + SL + 32 * (h0 + h)));
            for (int m = 0; m < N; m++) isum[m][h] = _mm256_setzero_si256();
        }
        for (int b = 0; b < 8; b++)
            for (int h = 0; h < H; h++) {
                const __m256i ls = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(sl[h], 4 * b), four),
                                                   _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(sh[h], 2 * b), two), 4));
                __m256i dot[N];
                for (int m = 0; m < N; m++) dot[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++) {
                    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(t + QS + 64 * (4 * b + s) + 32 * (h0 + h)));
                    const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(w, low4));
                    const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(w, 4), low4));
                    for (int m = 0; m < N; m++) {
                        const int8_t *c = xs[m].q + 256 * i + 32 * b + 4 * s;
                        dot[m] = _mm256_add_epi32(dot[m], products(lo, code4(c), ones));
                        dot[m] = _mm256_add_epi32(dot[m], products(hi, code4(c + 16), ones));
                    }
                }
                const __m256i scale = _mm256_sub_epi32(ls, thirty_two);
                for (int m = 0; m < N; m++) isum[m][h] = _mm256_add_epi32(isum[m][h], _mm256_mullo_epi32(dot[m], scale));
            }
        for (int h = 0; h < H; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(t + D + 16 * (h0 + h))));
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
    switch (count) {  // one row: both halves in one pass over the weights; more: a half at a time
        case 1: return halves<1, 2>(g, K, xs, out, 0);
        case 2: return by_halves<2>(g, K, xs, out);
        case 3: return by_halves<3>(g, K, xs, out);
        default: return by_halves<MR>(g, K, xs, out);
    }
}

}  // namespace iq4xs
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
