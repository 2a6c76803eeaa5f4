// Q8_0_X16's and Q5_0_X16's product on AVX-512 VNNI (q8_0.h): a zmm lane is a row of the
// group; the weights are made unsigned for vpdpbusd against 4 activation codes broadcast (Q8_0:
// one 64-byte load is 4 weights of the 16 rows, q + 128 with the sign bit flipped; Q5_0: one
// load is twice 4, the nibbles, their fifth bits set from qh under a byte mask), the sum started
// at the block's -offset * sum(c) so that it ends at sum(q c) exactly, for every activation
// row of the tile.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"
#include "target_begin.h"

#include "../q8_0.h"

namespace qkv {
namespace blocks {
namespace q8_0 {
namespace {

inline __m512i code4(const int8_t *c) {  // 4 activation codes in every lane
    int32_t v;
    memcpy(&v, c, 4);
    return _mm512_set1_epi32(v);
}

inline __m512i bytes4(uint32_t v) { return _mm512_set1_epi32(static_cast<int32_t>(v)); }

// Step s (0..3) of a block: two unsigned weight vectors and where their 4 activation codes
// start in the block (Q8_0: units 2 s and 2 s + 1; Q5_0: unit s's low and high nibbles).
template <Type T>
struct Steps;

template <>
struct Steps<Q8_0> {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const uint8_t *t;
    explicit Steps(const uint8_t *body) : t(body) {}
    void operator()(int s, __m512i &w0, int &c0, __m512i &w1, int &c1) const {
        w0 = _mm512_xor_si512(_mm512_loadu_si512(t + 128 * s), flip);
        w1 = _mm512_xor_si512(_mm512_loadu_si512(t + 128 * s + 64), flip);
        c0 = 8 * s, c1 = 8 * s + 4;
    }
};

template <>
struct Steps<Q5_0> {
    // qh's byte holding the fifth bits of a unit's weights, copied to the lane's 4 bytes (byte
    // s / 2 for the low nibbles, 2 + s / 2 for the high ones), then bit 4 (s % 2) + k of byte k
    const __m512i low4 = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
    const uint8_t *t;
    __m512i qh;
    explicit Steps(const uint8_t *body) : t(body), qh(_mm512_loadu_si512(body)) {}
    static __m512i spread(int byte) {  // vpshufb's control: byte `byte` of each dword into its 4 bytes
        const uint32_t b = static_cast<uint32_t>(byte) * 0x01010101u;
        return _mm512_add_epi32(bytes4(b), _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0));
    }
    void operator()(int s, __m512i &w0, int &c0, __m512i &w1, int &c1) const {
        const __m512i w = _mm512_loadu_si512(t + QH5 + 64 * s);
        const __m512i bit = bytes4((0x08040201u) << (4 * (s % 2)));
        const __mmask64 lo_high = _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, spread(s / 2)), bit);
        const __mmask64 hi_high = _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, spread(2 + s / 2)), bit);
        const __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
        w0 = _mm512_mask_add_epi8(lo, lo_high, lo, sixteen);
        w1 = _mm512_mask_add_epi8(hi, hi_high, hi, sixteen);
        c0 = 4 * s, c1 = 16 + 4 * s;
    }
};

template <Type T, int N>
void group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, float *out) {
    const int64_t B = K / 32;
    const uint8_t *bodies = g + 32 * B;
    __m512 acc[N];
    for (int m = 0; m < N; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < B; i++) {
        if constexpr (N == 1) read_ahead<T>(g, i);
        const Steps<T> steps(bodies + body_bytes(T) * i);
        __m512i even[N], odd[N];  // two chains of the exact sum, added at the end
        for (int m = 0; m < N; m++) even[m] = _mm512_set1_epi32(-code_offset(T) * p[m * B + i]), odd[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            __m512i w0, w1;
            int c0, c1;
            steps(s, w0, c0, w1, c1);
            for (int m = 0; m < N; m++) {
                const int8_t *c = xs[m].q + 32 * i;
                even[m] = _mm512_dpbusd_epi32(even[m], w0, code4(c + c0));
                odd[m] = _mm512_dpbusd_epi32(odd[m], w1, code4(c + c1));
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

template <Type T>
void avx512_group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, int count, float *out) {
    switch (count) {
        case 1: return group<T, 1>(g, K, xs, p, out);
        case 2: return group<T, 2>(g, K, xs, p, out);
        case 3: return group<T, 3>(g, K, xs, p, out);
        default: return group<T, MR>(g, K, xs, p, out);
    }
}

template void avx512_group<Q8_0>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);
template void avx512_group<Q5_0>(const uint8_t *, int64_t, const XRow *, const int32_t *, int, float *);

}  // namespace q8_0
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
