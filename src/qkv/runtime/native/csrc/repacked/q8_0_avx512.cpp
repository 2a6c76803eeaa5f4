// Q8_0_X16's product on AVX-512 VNNI (q8_0.h): a zmm lane is a row of the group; one 64-byte
// load is 4 weights of each of the 16 rows, made unsigned (q + 128: the sign bit flipped) for
// vpdpbusd against 4 activation codes broadcast, the sum started at the block's offset
// -128 sum(c) so that it ends at sum(q c) exactly, for every activation row of the tile.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"
#include "target_begin.h"

#include "q8_0.h"

namespace qkv {
namespace blocks {
namespace q8_0 {
namespace {

inline __m512i code4(const int8_t *c) {  // 4 activation codes in every lane
    int32_t v;
    memcpy(&v, c, 4);
    return _mm512_set1_epi32(v);
}

template <int N>
void group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, float *out) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int64_t B = K / 32;
    const uint8_t *qs = g + 32 * B;
    __m512 acc[N];
    for (int m = 0; m < N; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < B; i++) {
        if constexpr (N == 1) read_ahead(g, i);
        const uint8_t *t = qs + UNITS * i;
        __m512i even[N], odd[N];  // two chains of the exact sum (units 0, 2, .. and 1, 3, ..), added at the end
        for (int m = 0; m < N; m++) even[m] = _mm512_set1_epi32(p[m * B + i]), odd[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int u = 0; u < 8; u += 2) {
            const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(t + 64 * u), flip);
            const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(t + 64 * (u + 1)), flip);
            for (int m = 0; m < N; m++) {
                const int8_t *c = xs[m].q + 32 * i + 4 * u;
                even[m] = _mm512_dpbusd_epi32(even[m], w0, code4(c));
                odd[m] = _mm512_dpbusd_epi32(odd[m], w1, code4(c + 4));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(g + 32 * i)));
        for (int m = 0; m < N; m++) {
            const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(even[m], odd[m]));
            acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(xs[m].d[i])), isum));
        }
    }
    for (int m = 0; m < N; m++) _mm512_storeu_ps(out + ROWS * m, acc[m]);
}

}  // namespace

void avx512_group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, int count, float *out) {
    switch (count) {
        case 1: return group<1>(g, K, xs, p, out);
        case 2: return group<2>(g, K, xs, p, out);
        case 3: return group<3>(g, K, xs, p, out);
        default: return group<MR>(g, K, xs, p, out);
    }
}

}  // namespace q8_0
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
