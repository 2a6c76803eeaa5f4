// Q6_K_X16's product on AVX2 (q6k.h): a ymm lane is a row of one half (8 rows) of the group;
// 32-byte loads of ql and qh give 4 weights of 8 rows as unsigned 6-bit codes, vpmaddubsw by 4
// activation codes broadcast (pairs of at most 2 * 63 * 128: exact in int16), vpmaddwd into
// int32 from -32 s_j, then times the sub-block's scale of each row: the integers the AVX-512
// kernel sums, the same floats after.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c"
#include "target_begin.h"

#include "../q6k.h"

namespace qkv {
namespace blocks {
namespace q6k {
namespace {

inline __m256i load(const uint8_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }

inline __m256i code4(const int8_t *c) {  // 4 activation codes in every lane
    int32_t v;
    memcpy(&v, c, 4);
    return _mm256_set1_epi32(v);
}

// The 2 top bits of quarter k (bits 2 k .. 2 k + 1 of every qh byte) moved to bits 4-5 (16-bit
// shifts: what crosses a byte lands outside bits 4-5, masked off).
template <int k>
inline __m256i top_bits(__m256i qh) {
    const __m256i v = k == 0 ? _mm256_slli_epi16(qh, 4) : k == 1 ? _mm256_slli_epi16(qh, 2) : k == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x30));
}

// Sub-block j = 8 h + 2 k + q of rows 8 half .. 8 half + 7 against N activation rows: isum += sc_j * dot_j.
template <int N, int k>
inline void sub_block(const uint8_t *t, const XRow *xs, const int32_t *p, int64_t words, int64_t i, int h, int q,
                      int half, __m256i *isum) {
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const int j = 8 * h + 2 * k + q;
    __m256i dot[N];
    for (int m = 0; m < N; m++) dot[m] = _mm256_set1_epi32(p[m * words + 16 * i + j]);
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        const __m256i l = load(t + ql_at(16 * h + 8 * (k % 2) + 4 * q + s) + 32 * half);
        const __m256i qh = load(t + qh_at(8 * h + 4 * q + s) + 32 * half);
        const __m256i nibble = k < 2 ? _mm256_and_si256(l, low4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), low4);
        const __m256i w = _mm256_or_si256(nibble, top_bits<k>(qh));
        const int off = 128 * h + 32 * k + 16 * q + 4 * s;
        for (int m = 0; m < N; m++)
            dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(w, code4(xs[m].q + 256 * i + off)), ones));
    }
    int64_t scales;
    memcpy(&scales, t + SC + 16 * j + 8 * half, 8);
    const __m256i sc = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(scales));
    for (int m = 0; m < N; m++) isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(dot[m], sc));
}

template <int N>
void group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, float *out) {
    const int64_t words = K / 16;
    for (int m = 0; m < N; m++) _mm256_storeu_ps(out + ROWS * m, _mm256_setzero_ps()), _mm256_storeu_ps(out + ROWS * m + 8, _mm256_setzero_ps());
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t *t = g + i * TILE;
        if constexpr (N == 1)
            for (int64_t a = 0; a < TILE; a += 64) _mm_prefetch(reinterpret_cast<const char *>(t + 2 * TILE + a), _MM_HINT_T0);
        for (int half = 0; half < 2; half++) {
            __m256i isum[N];
            for (int m = 0; m < N; m++) isum[m] = _mm256_setzero_si256();
            for (int h = 0; h < 2; h++)
                for (int q = 0; q < 2; q++) {
                    sub_block<N, 0>(t, xs, p, words, i, h, q, half, isum);
                    sub_block<N, 1>(t, xs, p, words, i, h, q, half, isum);
                    sub_block<N, 2>(t, xs, p, words, i, h, q, half, isum);
                    sub_block<N, 3>(t, xs, p, words, i, h, q, half, isum);
                }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(t + D + 16 * half)));
            for (int m = 0; m < N; m++) {
                float *o = out + ROWS * m + 8 * half;
                const __m256 term = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[m].d[i])), _mm256_cvtepi32_ps(isum[m]));
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), term));
            }
        }
    }
}

}  // namespace

void avx2_group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, int count, float *out) {
    switch (count) {
        case 1: return group<1>(g, K, xs, p, out);
        case 2: return group<2>(g, K, xs, p, out);
        case 3: return group<3>(g, K, xs, p, out);
        default: return group<MR>(g, K, xs, p, out);
    }
}

}  // namespace q6k
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
