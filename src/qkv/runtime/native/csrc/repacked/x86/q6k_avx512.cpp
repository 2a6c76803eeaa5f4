// Q6_K_X16's product on AVX-512 VNNI (q6k.h): a zmm lane is a row of the group; a 64-byte load of
// ql and one of qh give 8 weights of the 16 rows as two vectors of unsigned 6-bit codes (the
// nibbles with their 2 top bits set in by vpternlogd), multiplied by vpdpbusd against 4
// activation codes broadcast, each 16-weight sub-block's sum started at -32 s_j (so that it ends
// at sum((q - 32) c) exactly), then times the sub-block's scale of each row. A decode step
// (one activation row) reads each tile front to back, a chunk at a time, four sub-blocks' sums
// at once; a prompt's tile of activation rows goes sub-block by sub-block, which keeps its sums
// in registers.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#define QKV_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"
#include "target_begin.h"

#include "../q6k.h"

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

// a | (b & 0x30 a byte): a nibble and its top 2 bits (vpternlogd: A | (B & C))
inline __m512i with_top(__m512i nibble, __m512i top, __m512i mask) { return _mm512_ternarylogic_epi32(nibble, top, mask, 0xF8); }

inline __m512i scale_of(const uint8_t *t, int j) {  // sub-block j's scales of the 16 rows, int32
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(t + SC + 16 * j)));
}

// Sub-block j = 8 h + 2 k + q of the tile (quarter k of half h, offsets 16 q .. 16 q + 15): the
// low (k < 2) or high nibbles of ql units 16 h + 8 (k % 2) + 4 q + s, their top bits at bits
// 2 k of qh units 8 h + 4 q + s, summed against N activation rows from -32 s_j, then times the
// 16 rows' scales of j into isum. One sub-block at a time keeps N accumulators live, not 2 N:
// a prompt tile of 8 rows fits the 32 registers.
template <int N>
inline void sub_block(const uint8_t *t, const XRow *xs, const int32_t *p, int64_t words, int64_t i, int h, int q, int k,
                      __m512i *isum) {
    const __m512i low4 = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30);
    const int j = 8 * h + 2 * k + q;
    __m512i sum[N];
    for (int m = 0; m < N; m++) sum[m] = _mm512_set1_epi32(p[m * words + 16 * i + j]);
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        const __m512i l = load(t + ql_at(16 * h + 8 * (k % 2) + 4 * q + s)), qh = load(t + qh_at(8 * h + 4 * q + s));
        const __m512i nibble = k < 2 ? _mm512_and_si512(l, low4) : _mm512_and_si512(_mm512_srli_epi16(l, 4), low4);
        // the top bits of quarter k sit at bits 2 k of each byte: moved to bits 4-5
        const __m512i top = k == 0 ? _mm512_slli_epi16(qh, 4) : k == 1 ? _mm512_slli_epi16(qh, 2) : k == 2 ? qh : _mm512_srli_epi16(qh, 2);
        const __m512i w = with_top(nibble, top, top2);
        const int off = 128 * h + 32 * k + 16 * q + 4 * s;
        for (int m = 0; m < N; m++) sum[m] = _mm512_dpbusd_epi32(sum[m], w, code4(xs[m].q + 256 * i + off));
    }
    const __m512i sc = scale_of(t, j);
    for (int m = 0; m < N; m++) isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(sum[m], sc));
}

template <int N>
void group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, float *out) {
    const int64_t words = K / 16;
    __m512 acc[N];
    for (int m = 0; m < N; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t *t = g + i * TILE;
        __m512i isum[N];
        for (int m = 0; m < N; m++) isum[m] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++)
            for (int q = 0; q < 2; q++)
                for (int k = 0; k < 4; k++) sub_block<N>(t, xs, p, words, i, h, q, k, isum);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(t + D)));
        for (int m = 0; m < N; m++)
            acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(xs[m].d[i])), _mm512_cvtepi32_ps(isum[m])));
    }
    for (int m = 0; m < N; m++) _mm512_storeu_ps(out + ROWS * m, acc[m]);
}

// One activation row: chunk c = 8 h + 4 q + s of each tile holds 4 weights of the sub-blocks
// j = 8 h + 2 k + q for the four quarters k, so the tile is read in order, 192 bytes at a time.
// The same integer sums as group<N>'s (exact) and the same float steps.
void group_one(const uint8_t *g, int64_t K, const XRow &x, const int32_t *p, float *out) {
    const __m512i low4 = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const uint8_t *t = g + i * TILE;
        const int8_t *c = x.q + 256 * i;
        __m512i isum = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++)
            for (int q = 0; q < 2; q++) {
                __m512i sum[4];
                for (int k = 0; k < 4; k++) sum[k] = _mm512_set1_epi32(p[16 * i + 8 * h + 2 * k + q]);
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++) {
                    // chunk 8 h + 4 q + s, in order: the ql units of quarters 0/2 and 1/3, then their qh unit
                    const __m512i a = load(t + ql_at(16 * h + 4 * q + s)), b = load(t + ql_at(16 * h + 8 + 4 * q + s)),
                                  qh = load(t + qh_at(8 * h + 4 * q + s));
                    const int off = 128 * h + 16 * q + 4 * s;  // + 32 k: the quarter's weights
                    const __m512i w0 = with_top(_mm512_and_si512(a, low4), _mm512_slli_epi16(qh, 4), top2);
                    const __m512i w1 = with_top(_mm512_and_si512(b, low4), _mm512_slli_epi16(qh, 2), top2);
                    const __m512i w2 = with_top(_mm512_and_si512(_mm512_srli_epi16(a, 4), low4), qh, top2);
                    const __m512i w3 = with_top(_mm512_and_si512(_mm512_srli_epi16(b, 4), low4), _mm512_srli_epi16(qh, 2), top2);
                    sum[0] = _mm512_dpbusd_epi32(sum[0], w0, code4(c + off));
                    sum[1] = _mm512_dpbusd_epi32(sum[1], w1, code4(c + off + 32));
                    sum[2] = _mm512_dpbusd_epi32(sum[2], w2, code4(c + off + 64));
                    sum[3] = _mm512_dpbusd_epi32(sum[3], w3, code4(c + off + 96));
                }
                for (int k = 0; k < 4; k++) isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(sum[k], scale_of(t, 8 * h + 2 * k + q)));
            }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(t + D)));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.d[i])), _mm512_cvtepi32_ps(isum)));
    }
    _mm512_storeu_ps(out, acc);
}

}  // namespace

void avx512_group(const uint8_t *g, int64_t K, const XRow *xs, const int32_t *p, int count, float *out) {
    switch (count) {  // 5 to 7 rows: 4, then the rest (each row's sums are its own)
        case 1: return group_one(g, K, xs[0], p, out);
        case 2: return group<2>(g, K, xs, p, out);
        case 3: return group<3>(g, K, xs, p, out);
        case 4: return group<4>(g, K, xs, p, out);
        case AVX512_MR: return group<AVX512_MR>(g, K, xs, p, out);
        default:
            group<4>(g, K, xs, p, out);
            return avx512_group(g, K, xs + 4, p + 4 * (K / 16), count - 4, out + 4 * ROWS);
    }
}

}  // namespace q6k
}  // namespace blocks
}  // namespace qkv

#include "target_end.h"
#endif  // x86
