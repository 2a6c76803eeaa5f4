// Q6_K_X16's product on AVX-512 VNNI (q6k.h): a zmm lane is a row of the group; each 64-byte
// ql / qh load is 4 weights of each of the 16 rows for 2 (ql) or 4 (qh) of the 32s, the 6-bit
// codes multiplied by vpdpbusd against 4 activation codes broadcast, for every activation row.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"
#include "target_begin.h"

#include "q6k.h"

namespace qkv {
namespace blocks {
namespace q6k {
namespace {

inline __m512i load(const uint8_t *p) { return _mm512_loadu_si512(p); }

inline __m512i code4(const int8_t *c) {  // 4 activation codes in every lane
    int32_t v;
    memcpy(&v, c, 4);
    return _mm512_set1_epi32(v);
}

inline __m512i signed_byte(__m512i v, int k) {  // byte k of every lane, sign-extended to int32
    return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * k), 24);
}

template <int N>
void group(const uint8_t *g, int64_t K, const XRow *xs, float *out) {
    const __m512i low4 = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    __m512 acc[N];
    for (int m = 0; m < N; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t *t = g + i * TILE;
        __m512i isum[N];
        for (int m = 0; m < N; m++) isum[m] = _mm512_setzero_si512();
        for (int n = 0; n < 2; n++)
            for (int half = 0; half < 2; half++) {  // steps l of sub-blocks 8 n + 2 t + half
                __m512i sub[N][4];
                for (int m = 0; m < N; m++)
                    for (int tt = 0; tt < 4; tt++) sub[m][tt] = _mm512_setzero_si512();
                for (int l = 4 * half; l < 4 * half + 4; l++) {
                    const __m512i a = load(t + QL + 64 * (16 * n + l)), b = load(t + QL + 64 * (16 * n + 8 + l));
                    const __m512i h = load(t + QH + 64 * (8 * n + l));
                    const __m512i q[4] = {
                        _mm512_or_si512(_mm512_and_si512(a, low4), _mm512_slli_epi16(_mm512_and_si512(h, three), 4)),
                        _mm512_or_si512(_mm512_and_si512(b, low4), _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2), three), 4)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), low4),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 4), three), 4)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), low4),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 6), three), 4)),
                    };
                    for (int m = 0; m < N; m++) {
                        const int8_t *c = xs[m].q + 256 * i + 128 * n + 4 * l;
                        for (int tt = 0; tt < 4; tt++) sub[m][tt] = _mm512_dpbusd_epi32(sub[m][tt], q[tt], code4(c + 32 * tt));
                    }
                }
                for (int tt = 0; tt < 4; tt++) {
                    const int j = 8 * n + 2 * tt + half;
                    const __m512i sc = signed_byte(load(t + SC + 64 * (j / 4)), j % 4);
                    for (int m = 0; m < N; m++) {
                        const __m512i offset = _mm512_set1_epi32(32 * xs[m].sums[16 * i + j]);
                        isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(_mm512_sub_epi32(sub[m][tt], offset), sc));
                    }
                }
            }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(t + D)));
        for (int m = 0; m < N; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xs[m].d[i])), _mm512_cvtepi32_ps(isum[m]), acc[m]);
    }
    for (int m = 0; m < N; m++) _mm512_storeu_ps(out + ROWS * m, acc[m]);
}

}  // namespace

void avx512_group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *, int count, float *out) {
    switch (count) {
        case 1: return group<1>(g, K, xs, out);
        case 2: return group<2>(g, K, xs, out);
        case 3: return group<3>(g, K, xs, out);
        default: return group<MR>(g, K, xs, out);
    }
}

}  // namespace q6k
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
