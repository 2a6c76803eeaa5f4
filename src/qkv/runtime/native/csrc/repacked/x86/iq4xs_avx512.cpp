// IQ4_XS_X16's product on AVX-512 VNNI (iq4xs.h): a zmm lane is a row of the group; one 64-byte
// load is 8 weights of the 16 rows, their nibbles looked up in the code book made unsigned
// (value + 128, vpshufb), multiplied by vpdpbusd against 4 activation codes broadcast, each
// group's sum started at -128 sum_32(c) so that it ends at sum(v c) exactly, then times the
// group's scale of each row, for every activation row of the tile.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"
#include "target_begin.h"

#include "../iq4xs.h"

namespace qkv {
namespace blocks {
namespace iq4xs {
namespace {

inline __m512i code4(const int8_t *c) {  // 4 activation codes in every lane
    int32_t v;
    memcpy(&v, c, 4);
    return _mm512_set1_epi32(v);
}

// IQ4_NL_VALUES + 128: the code book made unsigned for vpdpbusd
alignas(16) constexpr uint8_t UNSIGNED_BOOK[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
constexpr bool book_matches() {
    for (int k = 0; k < 16; k++)
        if (UNSIGNED_BOOK[k] != IQ4_NL_VALUES[k] + 128) return false;
    return true;
}
static_assert(book_matches(), "UNSIGNED_BOOK must be IQ4_NL_VALUES + 128");

inline __m512i book() {  // UNSIGNED_BOOK in each 128-bit lane
    return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i *>(UNSIGNED_BOOK)));
}

template <int N>
void group(const uint8_t *g, int64_t K, const XRow *xs, float *out) {
    const __m512i table = book(), low4 = _mm512_set1_epi8(15), four = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3),
                  thirty_two = _mm512_set1_epi32(32);
    __m512 acc[N];
    for (int m = 0; m < N; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t *t = g + i * TILE;
        if constexpr (N == 1)
            for (int64_t a = 0; a < TILE; a += 64) _mm_prefetch(reinterpret_cast<const char *>(t + 2 * TILE + a), _MM_HINT_T0);
        const __m512i sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(t + SH)));
        const __m512i sl = _mm512_loadu_si512(t + SL);
        __m512i isum[N];
        for (int m = 0; m < N; m++) isum[m] = _mm512_setzero_si512();
        for (int b = 0; b < 8; b++) {
            const __m512i ls = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(sl, 4 * b), four),
                                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(sh, 2 * b), two), 4));
            const __m512i scale = _mm512_sub_epi32(ls, thirty_two);
            __m512i even[N], odd[N];  // the low and the high nibbles' chains of the exact sum
            for (int m = 0; m < N; m++) {
                const int16_t *sums = xs[m].sums + 16 * i + 2 * b;
                even[m] = _mm512_set1_epi32(-128 * (sums[0] + sums[1])), odd[m] = _mm512_setzero_si512();
            }
#pragma GCC unroll 4
            for (int s = 0; s < 4; s++) {
                const __m512i w = _mm512_loadu_si512(t + QS + 64 * (4 * b + s));
                const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(w, low4));
                const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(w, 4), low4));
                for (int m = 0; m < N; m++) {
                    const int8_t *c = xs[m].q + 256 * i + 32 * b + 4 * s;
                    even[m] = _mm512_dpbusd_epi32(even[m], lo, code4(c));
                    odd[m] = _mm512_dpbusd_epi32(odd[m], hi, code4(c + 16));
                }
            }
            for (int m = 0; m < N; m++) isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(_mm512_add_epi32(even[m], odd[m]), scale));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(t + D)));
        for (int m = 0; m < N; m++)
            acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(xs[m].d[i])), _mm512_cvtepi32_ps(isum[m])));
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

}  // namespace iq4xs
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
