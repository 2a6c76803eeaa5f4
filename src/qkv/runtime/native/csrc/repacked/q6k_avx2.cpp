// Q6_K_X16's product on AVX2 (q6k.h): a ymm lane is a row of one half (8 rows) of the group;
// vpmaddubsw multiplies 4 six-bit codes of each row by 4 activation codes broadcast into int16
// pairs, two steps summed in int16 (at most 4 * 63 * 127 = 32004: exact), then vpmaddwd by the
// rows' scales into int32; 32 sc S_j comes off in int32: the integers the AVX-512 kernel sums.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c"
#include "target_begin.h"

#include "q6k.h"

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

inline __m256i scale_pair(__m256i v, int k) {  // signed byte k of every lane in both int16 halves of the lane
    const __m256i s = _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * k), 24);
    return _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(s, 16));
}

// Halves [h0, h0 + H) of the group (rows 8 h .. 8 h + 7) against N activation rows.
template <int N, int H>
void halves(const uint8_t *g, int64_t K, const XRow *xs, float *out, int h0) {
    const __m256i low4 = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    __m256 acc[N][H];
    for (int m = 0; m < N; m++)
        for (int h = 0; h < H; h++) acc[m][h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t *t = g + i * TILE;
        __m256i isum[N][H];
        for (int m = 0; m < N; m++)
            for (int h = 0; h < H; h++) isum[m][h] = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++)
            for (int l0 = 0; l0 < 8; l0 += 2) {  // steps l0, l0 + 1: sub-blocks 8 n + 2 t + l0 / 4
                for (int h = 0; h < H; h++) {
                    const int o = 32 * (h0 + h);
                    __m256i part[N][4];
                    for (int l = l0; l < l0 + 2; l++) {
                        const __m256i a = load(t + QL + 64 * (16 * n + l) + o), b = load(t + QL + 64 * (16 * n + 8 + l) + o);
                        const __m256i hb = load(t + QH + 64 * (8 * n + l) + o);
                        const __m256i q[4] = {
                            _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_slli_epi16(_mm256_and_si256(hb, three), 4)),
                            _mm256_or_si256(_mm256_and_si256(b, low4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), three), 4)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), three), 4)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), three), 4)),
                        };
                        for (int m = 0; m < N; m++) {
                            const int8_t *c = xs[m].q + 256 * i + 128 * n + 4 * l;
                            for (int tt = 0; tt < 4; tt++) {
                                const __m256i p = _mm256_maddubs_epi16(q[tt], code4(c + 32 * tt));
                                part[m][tt] = l == l0 ? p : _mm256_add_epi16(part[m][tt], p);
                            }
                        }
                    }
                    for (int tt = 0; tt < 4; tt++) {
                        const int j = 8 * n + 2 * tt + l0 / 4;
                        const __m256i sc = scale_pair(load(t + SC + 64 * (j / 4) + o), j % 4);
                        for (int m = 0; m < N; m++) {
                            __m256i v = _mm256_madd_epi16(part[m][tt], sc);
                            if (l0 % 4 == 0)  // once per sub-block: 32 sc_j S_j
                                v = _mm256_sub_epi32(v, _mm256_slli_epi32(_mm256_madd_epi16(sc, _mm256_set1_epi32(static_cast<uint16_t>(
                                                                                                      xs[m].sums[16 * i + j]))),
                                                                          5));
                            isum[m][h] = _mm256_add_epi32(isum[m][h], v);
                        }
                    }
                }
            }
        for (int h = 0; h < H; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(t + D + 16 * (h0 + h))));
            for (int m = 0; m < N; m++)
                acc[m][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[m].d[i])), _mm256_cvtepi32_ps(isum[m][h]), acc[m][h]);
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
    switch (count) {
        case 1: return halves<1, 2>(g, K, xs, out, 0);
        case 2: return by_halves<2>(g, K, xs, out);
        case 3: return by_halves<3>(g, K, xs, out);
        default: return by_halves<MR>(g, K, xs, out);
    }
}

}  // namespace q6k
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
