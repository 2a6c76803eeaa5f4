// Q4_K_X16's and Q5_K_X16's product on AVX2 (q4k.h): a ymm lane is a row of one half (8 rows)
// of the group; vpmaddubsw multiplies 8 weights of each row by 4 activation codes broadcast into
// int16 pairs, summed in int16 over the STEPS 4-byte steps of a sub-block that keep it exact
// (Q4_K: all 8, at most 8 * 2 * 15 * 127 = 30480; Q5_K: 4 at a time, 4 * 2 * 31 * 127 = 31496),
// then vpmaddwd by the rows' scales into int32: the integers the AVX-512 kernel sums, the same floats.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c"
#include "target_begin.h"

#include "../q4k.h"

namespace qkv {
namespace blocks {
namespace q4k {
namespace {

inline __m256i load(const uint8_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }

inline __m256i code4(const int8_t *c) {  // 4 activation codes in every lane
    int32_t v;
    memcpy(&v, c, 4);
    return _mm256_set1_epi32(v);
}

inline __m256i fifth(__m256i h, int bit) {  // bit `bit` of every byte of h, as 16 (a weight's bit 4)
    const __m256i v = bit <= 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - bit)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(bit - 4));
    return _mm256_and_si256(v, _mm256_set1_epi8(16));  // (16-bit shifts by at most 4: no bit crosses into bit 4 of a byte)
}

inline __m256i scale_pair(__m256i v, int k) {  // byte k of every lane in both int16 halves of the lane
    const __m256i s = _mm256_and_si256(_mm256_srli_epi32(v, 8 * k), _mm256_set1_epi32(0xFF));
    return _mm256_or_si256(s, _mm256_slli_epi32(s, 16));
}

// Halves [h0, h0 + H) of the group (rows 8 h .. 8 h + 7) against N activation rows.
template <Type T, int N, int H>
void halves(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, float *out, int h0) {
    const __m256i low4 = _mm256_set1_epi8(15), six = _mm256_set1_epi8(63), top = _mm256_set1_epi8(0x30),
                  pair = _mm256_set1_epi32(0x00FF00FF);
    constexpr int STEPS = T == Q5_K ? 4 : 8;
    const int64_t words = K / 64;
    __m256 acc[N][H], macc[N][H];
    for (int m = 0; m < N; m++)
        for (int h = 0; h < H; h++) acc[m][h] = macc[m][h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t *t = g + i * tile_bytes(T);
        __m256i sc03[H], sc47[H], isum[N][H];
        for (int h = 0; h < H; h++) {
            const int o = 32 * (h0 + h);
            const __m256i a = load(t + SA + o), c = load(t + SC + o);
            sc03[h] = _mm256_and_si256(a, six);
            sc47[h] = _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_srli_epi32(a, 2), top));
            for (int m = 0; m < N; m++) isum[m][h] = _mm256_setzero_si256();
        }
#pragma GCC unroll 4  // j a constant in each copy: fifth()'s shifts are immediates, no branches
        for (int j = 0; j < 4; j++) {
            __m256i sl[H], sh[H];
            for (int h = 0; h < H; h++) {
                const __m256i scales = j < 2 ? sc03[h] : sc47[h];
                sl[h] = scale_pair(scales, (2 * j) % 4), sh[h] = scale_pair(scales, (2 * j + 1) % 4);
            }
            for (int s0 = 0; s0 < 8; s0 += STEPS) {
                __m256i lo_sum[N][H], hi_sum[N][H];
                for (int m = 0; m < N; m++)
                    for (int h = 0; h < H; h++) lo_sum[m][h] = hi_sum[m][h] = _mm256_setzero_si256();
#pragma GCC unroll 8  // and the steps: qs and qh offsets constants
                for (int s = s0; s < s0 + STEPS; s++) {
                    if constexpr (N == 1) read_ahead<T>(t, 8 * j + s);
                    for (int h = 0; h < H; h++) {
                        const __m256i w = load(t + QS + 64 * (8 * j + s) + 32 * (h0 + h));
                        __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
                        if constexpr (T == Q5_K) {  // bit 4 of the low nibbles' weights: qh bit 2 j; of the high ones': 2 j + 1
                            const __m256i qh = load(t + QH + 64 * s + 32 * (h0 + h));
                            lo = _mm256_or_si256(lo, fifth(qh, 2 * j));
                            hi = _mm256_or_si256(hi, fifth(qh, 2 * j + 1));
                        }
                        for (int m = 0; m < N; m++) {
                            const int8_t *q = xs[m].q + 256 * i + 64 * j + 4 * s;
                            lo_sum[m][h] = _mm256_add_epi16(lo_sum[m][h], _mm256_maddubs_epi16(lo, code4(q)));
                            hi_sum[m][h] = _mm256_add_epi16(hi_sum[m][h], _mm256_maddubs_epi16(hi, code4(q + 32)));
                        }
                    }
                }
                for (int h = 0; h < H; h++)
                    for (int m = 0; m < N; m++)
                        isum[m][h] = _mm256_add_epi32(isum[m][h], _mm256_add_epi32(_mm256_madd_epi16(lo_sum[m][h], sl[h]),
                                                                                   _mm256_madd_epi16(hi_sum[m][h], sh[h])));
            }
        }
        for (int h = 0; h < H; h++) {
            const int o = 32 * (h0 + h);
            const __m256i b = load(t + SB + o), c = load(t + SC + o);
            const __m256i mn03 = _mm256_and_si256(b, six);
            const __m256i mn47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(c, 4), low4),
                                                 _mm256_and_si256(_mm256_srli_epi32(b, 2), top));
            const __m256i even03 = _mm256_and_si256(mn03, pair), odd03 = _mm256_and_si256(_mm256_srli_epi32(mn03, 8), pair);
            const __m256i even47 = _mm256_and_si256(mn47, pair), odd47 = _mm256_and_si256(_mm256_srli_epi32(mn47, 8), pair);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(t + D + 16 * (h0 + h))));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(t + DMIN + 16 * (h0 + h))));
            for (int m = 0; m < N; m++) {
                const int32_t *pm = p + m * words + 4 * i;
                __m256i msum = _mm256_madd_epi16(even03, _mm256_set1_epi32(pm[0]));
                msum = _mm256_add_epi32(msum, _mm256_madd_epi16(odd03, _mm256_set1_epi32(pm[1])));
                msum = _mm256_add_epi32(msum, _mm256_madd_epi16(even47, _mm256_set1_epi32(pm[2])));
                msum = _mm256_add_epi32(msum, _mm256_madd_epi16(odd47, _mm256_set1_epi32(pm[3])));
                const __m256 dx = _mm256_set1_ps(xs[m].d[i]);
                acc[m][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum[m][h]), acc[m][h]);
                macc[m][h] = _mm256_fmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(msum), macc[m][h]);
            }
        }
    }
    for (int m = 0; m < N; m++)
        for (int h = 0; h < H; h++) _mm256_storeu_ps(out + ROWS * m + 8 * (h0 + h), _mm256_sub_ps(acc[m][h], macc[m][h]));
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

template void avx2_group<Q4_K>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);
template void avx2_group<Q5_K>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);

}  // namespace q4k
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
