// Q4_K_X16's and Q5_K_X16's product on AVX-512 VNNI (q4k.h): a zmm lane is a row of the group;
// one 64-byte load is 8 weights of each of the 16 rows (Q5_K: their fifth bits added where
// qh's bits are set, a mask a nibble), multiplied by vpdpbusd against 4 activation codes
// broadcast, for every activation row of the tile. A Q5_K prompt instead unpacks each tile once a
// pass into q4k.h's panel of bytes and runs 8 rows at a time against it (avx512_panel_step).
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"
#include "target_begin.h"

#include "../q4k.h"

namespace qkv {
namespace blocks {
namespace q4k {
namespace {

inline __m512i load(const uint8_t *p) { return _mm512_loadu_si512(p); }

inline __m512i code4(const int8_t *c) {  // 4 activation codes in every lane
    int32_t v;
    memcpy(&v, c, 4);
    return _mm512_set1_epi32(v);
}

inline __m512i byte_of(__m512i v, int k) {  // byte k of every lane, as int32
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(0xFF));
}

// The 16 rows' 6-bit sub-block scales of a tile: bytes k of sc03 are scales k (0..3), of sc47 scales 4 + k.
inline void scales_of(const uint8_t *t, __m512i &sc03, __m512i &sc47) {
    const __m512i a = load(t + SA), c = load(t + SC);
    sc03 = _mm512_and_si512(a, _mm512_set1_epi8(63));
    sc47 = _mm512_or_si512(_mm512_and_si512(c, _mm512_set1_epi8(15)), _mm512_and_si512(_mm512_srli_epi32(a, 2), _mm512_set1_epi8(0x30)));
}

// The 16 rows' 6-bit minimums as int16 pairs for vpdpwssd against minimum_sums' words:
// pairs[0..3] = even03, odd03, even47, odd47 (minimums (0, 2), (1, 3), (4, 6), (5, 7)).
inline void minimum_pairs(const uint8_t *t, __m512i pairs[4]) {
    const __m512i b = load(t + SB), c = load(t + SC), pair = _mm512_set1_epi32(0x00FF00FF), low4 = _mm512_set1_epi8(15);
    const __m512i mn03 = _mm512_and_si512(b, _mm512_set1_epi8(63));
    const __m512i mn47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), low4),
                                         _mm512_and_si512(_mm512_srli_epi32(b, 2), _mm512_set1_epi8(0x30)));
    pairs[0] = _mm512_and_si512(mn03, pair), pairs[1] = _mm512_and_si512(_mm512_srli_epi32(mn03, 8), pair);
    pairs[2] = _mm512_and_si512(mn47, pair), pairs[3] = _mm512_and_si512(_mm512_srli_epi32(mn47, 8), pair);
}

// sum over the super-block's sub-blocks of minimum * the activations' 32-sum: pm, the row's 4 words of it.
inline __m512i minimum_sum(const __m512i pairs[4], const int32_t *pm) {
    __m512i msum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), pairs[0], _mm512_set1_epi32(pm[0]));
    for (int k = 1; k < 4; k++) msum = _mm512_dpwssd_epi32(msum, pairs[k], _mm512_set1_epi32(pm[k]));
    return msum;
}

// The codes of 64-byte unit 8 j + s of a tile: lo (sub-block 2 j) and hi (2 j + 1), 0..15, or
// 0..31 for Q5_K (bit 4 of the low nibbles' weights: qh bit 2 j; of the high ones': 2 j + 1).
template <Type T>
inline void codes_of(const uint8_t *t, int j, int s, __m512i &lo, __m512i &hi) {
    const __m512i low4 = _mm512_set1_epi8(15), w = load(t + QS + 64 * (8 * j + s));
    lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
    if constexpr (T == Q5_K) {
        const __m512i h = load(t + QH + 64 * s), sixteen = _mm512_set1_epi8(16);
        lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(1 << (2 * j)))), lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(2 << (2 * j)))), hi, sixteen);
    }
}

inline __m512 halves(const uint8_t *p) {  // 16 float16 -> float32
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
}

template <Type T, int N>
void group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, float *out) {
    const int64_t words = K / 64;  // minimum_sums a row
    __m512 acc[N], macc[N];
    for (int m = 0; m < N; m++) acc[m] = macc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t *t = g + i * tile_bytes(T);
        __m512i sc03, sc47;
        scales_of(t, sc03, sc47);
        __m512i isum[N];
        for (int m = 0; m < N; m++) isum[m] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            __m512i lo_sum[N], hi_sum[N];
            for (int m = 0; m < N; m++) lo_sum[m] = hi_sum[m] = _mm512_setzero_si512();
#pragma GCC unroll 8  // as Q4_K's loop unrolls by itself: accumulators stay in their registers
            for (int s = 0; s < 8; s++) {
                if constexpr (N == 1) read_ahead<T>(t, 8 * j + s);
                __m512i lo, hi;
                codes_of<T>(t, j, s, lo, hi);
                for (int m = 0; m < N; m++) {
                    const int8_t *q = xs[m].q + 256 * i + 64 * j + 4 * s;
                    lo_sum[m] = _mm512_dpbusd_epi32(lo_sum[m], lo, code4(q));
                    hi_sum[m] = _mm512_dpbusd_epi32(hi_sum[m], hi, code4(q + 32));
                }
            }
            const __m512i scales = j < 2 ? sc03 : sc47;
            const __m512i sl = byte_of(scales, (2 * j) % 4), sh = byte_of(scales, (2 * j + 1) % 4);
            for (int m = 0; m < N; m++)
                isum[m] = _mm512_add_epi32(isum[m], _mm512_add_epi32(_mm512_mullo_epi32(lo_sum[m], sl), _mm512_mullo_epi32(hi_sum[m], sh)));
        }
        __m512i pairs[4];
        minimum_pairs(t, pairs);
        const __m512 d = halves(t + D), dmin = halves(t + DMIN);
        for (int m = 0; m < N; m++) {
            const __m512i msum = minimum_sum(pairs, p + m * words + 4 * i);
            const __m512 dx = _mm512_set1_ps(xs[m].d[i]);
            acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[m]), acc[m]);
            macc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum), macc[m]);
        }
    }
    for (int m = 0; m < N; m++) _mm512_storeu_ps(out + ROWS * m, _mm512_sub_ps(acc[m], macc[m]));
}

// One super-block of a prompt tile of N rows against its unpacked panel (q4k.h's PANEL layout):
// per 32-weight sub-block b, 8 loads of 16 rows x 4 codes each feed N vpdpbusd and nothing is
// unpacked, then the sums times the 16 rows' scales of b into isum; then group()'s float steps
// for super-block i, in its order, on the rows' acc and macc (16 floats each, in memory).
template <int N>
void panel_step(const uint8_t *t, int64_t i, const XRow *xs, const int32_t *p, int64_t words, float *acc, float *macc) {
    __m512i isum[N];
    for (int m = 0; m < N; m++) isum[m] = _mm512_setzero_si512();
    for (int b = 0; b < 8; b++) {
        __m512i sum[N];
        for (int m = 0; m < N; m++) sum[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const __m512i w = load(t + PANEL_CODES + 64 * (8 * b + s));
            for (int m = 0; m < N; m++) sum[m] = _mm512_dpbusd_epi32(sum[m], w, code4(xs[m].q + 256 * i + 32 * b + 4 * s));
        }
        const __m512i sc = load(t + PANEL_SCALES + 64 * b);
        for (int m = 0; m < N; m++) isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(sum[m], sc));
    }
    const __m512i pairs[4] = {load(t + PANEL_MINS), load(t + PANEL_MINS + 64), load(t + PANEL_MINS + 128), load(t + PANEL_MINS + 192)};
    const __m512 d = _mm512_load_ps(reinterpret_cast<const float *>(t + PANEL_D));
    const __m512 dmin = _mm512_load_ps(reinterpret_cast<const float *>(t + PANEL_DMIN));
    for (int m = 0; m < N; m++) {
        const __m512i msum = minimum_sum(pairs, p + m * words + 4 * i);
        const __m512 dx = _mm512_set1_ps(xs[m].d[i]);
        float *a = acc + ROWS * m, *n = macc + ROWS * m;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[m]), _mm512_loadu_ps(a)));
        _mm512_storeu_ps(n, _mm512_fmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum), _mm512_loadu_ps(n)));
    }
}

}  // namespace

template <Type T>
void avx512_unpack(const uint8_t *t, uint8_t *u) {
    for (int j = 0; j < 4; j++)
        for (int s = 0; s < 8; s++) {  // as group(): the low nibbles are sub-block 2 j, the high ones 2 j + 1
            __m512i lo, hi;
            codes_of<T>(t, j, s, lo, hi);
            _mm512_store_si512(u + PANEL_CODES + 64 * (8 * (2 * j) + s), lo);
            _mm512_store_si512(u + PANEL_CODES + 64 * (8 * (2 * j + 1) + s), hi);
        }
    __m512i sc03, sc47, pairs[4];
    scales_of(t, sc03, sc47);
    for (int k = 0; k < 8; k++) _mm512_store_si512(u + PANEL_SCALES + 64 * k, byte_of(k < 4 ? sc03 : sc47, k % 4));
    minimum_pairs(t, pairs);
    for (int k = 0; k < 4; k++) _mm512_store_si512(u + PANEL_MINS + 64 * k, pairs[k]);
    _mm512_store_ps(reinterpret_cast<float *>(u + PANEL_D), halves(t + D));
    _mm512_store_ps(reinterpret_cast<float *>(u + PANEL_DMIN), halves(t + DMIN));
}

void avx512_panel_step(const uint8_t *panel, int64_t i, const XRow *xs, const int32_t *p, int64_t words, int count, float *acc,
                       float *macc) {
    for (int done = 0; done < count;) {  // 8, then 4, 2 and 1: each row's result is the same whichever tile it is in
        const int left = count - done, n = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const XRow *x = xs + done;
        const int32_t *q = p + done * words;
        float *a = acc + ROWS * done, *m = macc + ROWS * done;
        if (n == 8) panel_step<8>(panel, i, x, q, words, a, m);
        else if (n == 4) panel_step<4>(panel, i, x, q, words, a, m);
        else if (n == 2) panel_step<2>(panel, i, x, q, words, a, m);
        else panel_step<1>(panel, i, x, q, words, a, m);
        done += n;
    }
}

template void avx512_unpack<Q5_K>(const uint8_t *, uint8_t *);

template <Type T>
void avx512_group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, int count, float *out) {
    switch (count) {
        case 1: return group<T, 1>(g, K, xs, p, out);
        case 2: return group<T, 2>(g, K, xs, p, out);
        case 3: return group<T, 3>(g, K, xs, p, out);
        default: return group<T, MR>(g, K, xs, p, out);
    }
}

template void avx512_group<Q4_K>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);
template void avx512_group<Q5_K>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);

}  // namespace q4k
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
