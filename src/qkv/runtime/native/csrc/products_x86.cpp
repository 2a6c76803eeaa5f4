// The vectorised variants of qkv's weight-only products (kernels.h): AVX2 + FMA + F16C for
// int8, float32 and int4 weights, and AVX-512 VNNI steps for the int4 product. Every
// function carries its instruction set as a target attribute, so the library builds for the
// baseline CPU and products.cpp calls these only where cpuid reports them.
//
// Batch invariance: each row of x goes through the same single-row loop whatever M is (no
// two-rows-at-once path with another summation order), so a row's output does not depend
// on the rows beside it. The weights of a four-row block stay in L1 while the rows of x
// pass over them, so a few rows cost little more than one.
//
// Shape legend: M rows of x, K inputs, N outputs, G = K / 32 blocks.
#include "kernels.h"

#if QKV_X86

namespace qkv {
namespace {

QKV_AVX2 inline __m256 int8x8(const int8_t *p) {  // 8 int8 -> 8 float
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
}

// One float32 weight row against one row of x, read as one sequential stream (a thread's rows
// lie back to back, so its whole share is one stream): four accumulators over 32 inputs a
// step, and the bytes STREAM_AHEAD further on prefetched with the non-temporal hint (on AMD's
// L3, a victim cache, that also keeps the streamed weights from being written into it).
constexpr int64_t STREAM_AHEAD = 4096;

QKV_AVX2 float stream_row(const float *x, const float *w, int64_t K) {
    const char *bytes = reinterpret_cast<const char *>(w);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch(bytes + 4 * k + STREAM_AHEAD, _MM_HINT_NTA);  // 32 floats: two lines a step
        _mm_prefetch(bytes + 4 * k + STREAM_AHEAD + 64, _MM_HINT_NTA);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float total = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; k++) total += x[k] * w[k];
    return total;
}

// One int8 weight row against one row of x: two accumulators (inputs k..k+7 and k+8..k+15
// of each 16), then the leftover inputs one by one.
QKV_AVX2 inline float int8_row(const float *xm, const int8_t *wr, int64_t K) {
    __m256 a = _mm256_setzero_ps(), b = a;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        a = _mm256_fmadd_ps(int8x8(wr + k), _mm256_loadu_ps(xm + k), a);
        b = _mm256_fmadd_ps(int8x8(wr + k + 8), _mm256_loadu_ps(xm + k + 8), b);
    }
    float out = hsum(_mm256_add_ps(a, b));
    for (; k < K; k++) out += xm[k] * wr[k];
    return out;
}

// Four int8 rows against one row of x, int8_row's operations for each (the same numbers),
// with the next row block prefetched a few lines per step when `ahead` is set: without it the
// hardware prefetcher left these matrix-vector products at 7-9 GB/s (Zen 3).
QKV_AVX2 void int8_four(const float *xm, const int8_t *w0, int64_t K, const char *ahead, float *out) {
    const int8_t *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        if (ahead) _mm_prefetch(ahead + ROWS * k, _MM_HINT_T0);  // 64 bytes of the next block a step
        __m256 xa = _mm256_loadu_ps(xm + k), xb = _mm256_loadu_ps(xm + k + 8);
        a0 = _mm256_fmadd_ps(int8x8(w0 + k), xa, a0); b0 = _mm256_fmadd_ps(int8x8(w0 + k + 8), xb, b0);
        a1 = _mm256_fmadd_ps(int8x8(w1 + k), xa, a1); b1 = _mm256_fmadd_ps(int8x8(w1 + k + 8), xb, b1);
        a2 = _mm256_fmadd_ps(int8x8(w2 + k), xa, a2); b2 = _mm256_fmadd_ps(int8x8(w2 + k + 8), xb, b2);
        a3 = _mm256_fmadd_ps(int8x8(w3 + k), xa, a3); b3 = _mm256_fmadd_ps(int8x8(w3 + k + 8), xb, b3);
    }
    out[0] = hsum(_mm256_add_ps(a0, b0)); out[1] = hsum(_mm256_add_ps(a1, b1));
    out[2] = hsum(_mm256_add_ps(a2, b2)); out[3] = hsum(_mm256_add_ps(a3, b3));
    for (; k < K; k++) {
        out[0] += xm[k] * w0[k]; out[1] += xm[k] * w1[k];
        out[2] += xm[k] * w2[k]; out[3] += xm[k] * w3[k];
    }
}

// int8_four for two rows of x at once, each weight converted once for both: every
// accumulator takes exactly int8_four's operations in int8_four's order, so each row's
// numbers are the ones it gets alone (16 accumulators: AVX-512's 32 vector registers).
QKV_AVX512 void int8_four_two(const float *xa, const float *xb, const int8_t *w0, int64_t K, const char *ahead,
                              float *outa, float *outb) {
    const int8_t *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0, d0 = a0, d1 = a0, d2 = a0, d3 = a0;  // row b's a and b
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        if (ahead) _mm_prefetch(ahead + ROWS * k, _MM_HINT_T0);
        const __m256 xa0 = _mm256_loadu_ps(xa + k), xa1 = _mm256_loadu_ps(xa + k + 8);
        const __m256 xb0 = _mm256_loadu_ps(xb + k), xb1 = _mm256_loadu_ps(xb + k + 8);
        __m256 v = int8x8(w0 + k), u = int8x8(w0 + k + 8);
        a0 = _mm256_fmadd_ps(v, xa0, a0); b0 = _mm256_fmadd_ps(u, xa1, b0);
        c0 = _mm256_fmadd_ps(v, xb0, c0); d0 = _mm256_fmadd_ps(u, xb1, d0);
        v = int8x8(w1 + k); u = int8x8(w1 + k + 8);
        a1 = _mm256_fmadd_ps(v, xa0, a1); b1 = _mm256_fmadd_ps(u, xa1, b1);
        c1 = _mm256_fmadd_ps(v, xb0, c1); d1 = _mm256_fmadd_ps(u, xb1, d1);
        v = int8x8(w2 + k); u = int8x8(w2 + k + 8);
        a2 = _mm256_fmadd_ps(v, xa0, a2); b2 = _mm256_fmadd_ps(u, xa1, b2);
        c2 = _mm256_fmadd_ps(v, xb0, c2); d2 = _mm256_fmadd_ps(u, xb1, d2);
        v = int8x8(w3 + k); u = int8x8(w3 + k + 8);
        a3 = _mm256_fmadd_ps(v, xa0, a3); b3 = _mm256_fmadd_ps(u, xa1, b3);
        c3 = _mm256_fmadd_ps(v, xb0, c3); d3 = _mm256_fmadd_ps(u, xb1, d3);
    }
    outa[0] = hsum(_mm256_add_ps(a0, b0)); outa[1] = hsum(_mm256_add_ps(a1, b1));
    outa[2] = hsum(_mm256_add_ps(a2, b2)); outa[3] = hsum(_mm256_add_ps(a3, b3));
    outb[0] = hsum(_mm256_add_ps(c0, d0)); outb[1] = hsum(_mm256_add_ps(c1, d1));
    outb[2] = hsum(_mm256_add_ps(c2, d2)); outb[3] = hsum(_mm256_add_ps(c3, d3));
    for (; k < K; k++) {
        outa[0] += xa[k] * w0[k]; outa[1] += xa[k] * w1[k]; outa[2] += xa[k] * w2[k]; outa[3] += xa[k] * w3[k];
        outb[0] += xb[k] * w0[k]; outb[1] += xb[k] * w1[k]; outb[2] += xb[k] * w2[k]; outb[3] += xb[k] * w3[k];
    }
}

}  // namespace

// Four weight rows per block, each row of x against them in turn (the first row's pass
// prefetches the next block; the others find this one in L1); with `pairs` (AVX-512), two
// rows of x at a time through int8_four_two, whose numbers are int8_four's.
QKV_AVX2 void avx2_int8_rows(const float *x, const int8_t *w, const float *scales, const float *bias, float *y,
                             int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1, bool pairs) {
    for (int64_t n = n0; n < n1; n += ROWS) {
        const int64_t rows = std::min(ROWS, n1 - n);
        const char *ahead = n + ROWS < n1 ? reinterpret_cast<const char *>(w + (n + ROWS) * K) : nullptr;
        for (int64_t m = 0; m < M;) {
            float out[2 * ROWS] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            const int64_t take = pairs && rows == ROWS && m + 2 <= M ? 2 : 1;
            if (take == 2) {
                int8_four_two(x + m * K, x + (m + 1) * K, w + n * K, K, m == 0 ? ahead : nullptr, out, out + ROWS);
            } else if (rows == ROWS) {
                int8_four(x + m * K, w + n * K, K, m == 0 ? ahead : nullptr, out);
            } else {
                for (int64_t r = 0; r < rows; r++) out[r] = int8_row(x + m * K, w + (n + r) * K, K);
            }
            for (int64_t i = 0; i < take; i++, m++)
                for (int64_t r = 0; r < rows; r++)
                    y[m * N + n + r] = out[i * ROWS + r] * scales[n + r] + (bias ? bias[n + r] : 0.f);
        }
    }
}

QKV_AVX2 void avx2_f32_rows(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += ROWS) {
        const int64_t rows = std::min(ROWS, n1 - n);
        for (int64_t m = 0; m < M; m++)
            for (int64_t r = 0; r < rows; r++)
                y[m * N + n + r] = stream_row(x + m * K, w + (n + r) * K, K) + (bias ? bias[n + r] : 0.f);
    }
}

// xq (count * 32) int8 with one step xd per block of 32 and the block's sum xsum (of xq * xd),
// rounded to nearest, ties to even (the default rounding mode), as the generic lrintf.
QKV_AVX2 void avx2_round_activations(const float *x, int8_t *xq, float *xd, float *xsum, int64_t count) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < count; i++) {
        const float *b = x + i * BLOCK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(b + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm_cvtss_f32(m4) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        const __m256 scale = _mm256_set1_ps(inv);
        __m256i n[4];
        for (int j = 0; j < 4; j++) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], scale));
        __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
        // int32 -> int16 -> int8 with saturation (values are within -127..127); packs work per
        // 128-bit lane, so the permute puts the 32 bytes back in order
        __m256i w01 = _mm256_packs_epi32(n[0], n[1]), w23 = _mm256_packs_epi32(n[2], n[3]);
        __m256i bytes = _mm256_packs_epi16(w01, w23);
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(xq + i * BLOCK), bytes);
        xd[i] = d;
        xsum[i] = d * static_cast<float>(_mm_cvtsi128_si32(t4));
    }
}

namespace {

QKV_AVX2 inline __m256i nibbles(const uint8_t *block) {  // 16 bytes -> 32 values 0..15: low, then high
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(block));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Two consecutive blocks of a row (32 bytes) against x arranged as [x_g 0..15 | x_g+1 0..15]
// (xlo) and [x_g 16..31 | x_g+1 16..31] (xhi): lanes 0-3 sum block g, lanes 4-7 block g + 1.
QKV_AVX2 inline __m256 dot_pair(const uint8_t *blocks, __m256i xlo, __m256i xhi) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blocks));
    __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    // each int16 is at most 2 * 15 * 127 in size, so two of them add without overflow
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

QKV_AVX2 inline __m256 pair_scale(const float *scale) {  // [scale[0] x4 | scale[1] x4]
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(scale)), _mm_broadcast_ss(scale + 1), 1);
}

QKV_AVX2 inline __m256 dot_u4_i8(__m256i q, __m256i x) {  // 32 (0..15) x 32 int8 -> 8 float partial sums
    __m256i pairs = _mm256_maddubs_epi16(q, x);  // |sum| <= 2 * 15 * 127: no saturation
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Per-block factors of rows [n, n + rows) for activation row m: scale[r * G + g] = d * xd and
// off[r] = sum over blocks of m_block * xsum (the minimum's share), 8 blocks at a time.
QKV_AVX2 void block_factors(const uint16_t *d, const uint16_t *mn, const float *dm, const float *sm, int64_t G,
                            int64_t n, int64_t rows, float *scale, float *off) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *dr = d + (n + r) * G, *mr = mn + (n + r) * G;
        float *sr = scale + r * G;
        __m256 o = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= G; g += 8) {
            __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(dr + g)));
            __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(mr + g)));
            _mm256_storeu_ps(sr + g, _mm256_mul_ps(dv, _mm256_loadu_ps(dm + g)));
            o = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sm + g), o);
        }
        off[r] = hsum(o);
        for (; g < G; g++) {
            sr[g] = _cvtsh_ss(dr[g]) * dm[g];
            off[r] += _cvtsh_ss(mr[g]) * sm[g];
        }
    }
}

// GCC 12's AVX-512 intrinsics start from a self-initialised "undefined" vector, which
// -Wuninitialized / -Wmaybe-uninitialized report where they are inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
QKV_AVX512 inline __m256 fold16(__m512 v) {  // 16 lanes -> 8
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The int4 single-row steps on AVX-512 VNNI: four blocks of a row in one 64-byte load, their
// low and high nibbles multiplied with the rounded activations by two vpdpbusd (unsigned 4-bit
// weights times signed int8, four products summed into each int32 lane: exact, as AVX2's
// maddubs/madd), each 128-bit lane one block, scaled by its block's d * xd. About half the
// instructions of the AVX2 loop per weight. acc: four rows' accumulators; returns the blocks done.
QKV_AVX512 __attribute__((noinline)) int64_t vnni_blocks(const int8_t *xm, const uint8_t *q0, int64_t G,
                                                         const float *sa, const uint8_t *ahead, __m256 *acc) {
    constexpr int64_t S = BLOCK / 2;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // each lane's block
    __m512 c[ROWS] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {
        const int64_t at = g * S;
        for (int64_t line = 0; line < 4; line++)  // the next row block: four rows of 64 bytes a step
            _mm_prefetch(reinterpret_cast<const char *>(ahead + 4 * at + 64 * line), _MM_HINT_T0);
        // x of blocks g..g+3 as [g 0..15 | g+1 0..15 | g+2 0..15 | g+3 0..15] and the same of 16..31
        const __m512i xa = _mm512_loadu_si512(xm + g * BLOCK), xb = _mm512_loadu_si512(xm + (g + 2) * BLOCK);
        const __m512i xlo = _mm512_shuffle_i64x2(xa, xb, _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i xhi = _mm512_shuffle_i64x2(xa, xb, _MM_SHUFFLE(3, 1, 3, 1));
        for (int64_t r = 0; r < ROWS; r++) {
            const __m512i bytes = _mm512_loadu_si512(q0 + r * G * S + at);
            __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(bytes, low), xlo);
            sums = _mm512_dpbusd_epi32(sums, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low), xhi);
            const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(sa + r * G + g)));
            c[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, c[r]);
        }
    }
    for (int64_t r = 0; r < ROWS; r++) acc[r] = _mm256_add_ps(acc[r], fold16(c[r]));
    return g;
}
#pragma GCC diagnostic pop

// Four rows of weights against one row of rounded activations xm (factors sa, offsets off).
QKV_AVX2 void four_rows(const int8_t *xm, const uint8_t *q0, int64_t G, const float *sa, const uint8_t *ahead,
                        bool vnni, __m256 *acc) {
    constexpr int64_t S = BLOCK / 2;
    const uint8_t *q1 = q0 + G * S, *q2 = q1 + G * S, *q3 = q2 + G * S;
    __m256 a[ROWS] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t g = vnni ? vnni_blocks(xm, q0, G, sa, ahead, a) : 0;  // blocks [0, g): four a step
    __m256 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];  // named: the compiler keeps them in registers
    // Two blocks per step: one 32-byte load holds blocks g and g + 1 of a row, whose low
    // nibbles are elements 0..15 of each (lanes 0 and 1) and high nibbles elements 16..31;
    // x is arranged the same way once for the four rows.
    for (; g + 2 <= G; g += 2) {
        const int64_t at = g * S;
        _mm_prefetch(reinterpret_cast<const char *>(ahead + 4 * at), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(ahead + 4 * at + 64), _MM_HINT_T0);
        __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xm + g * BLOCK));
        __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xm + (g + 1) * BLOCK));
        __m256i xlo = _mm256_permute2x128_si256(x0, x1, 0x20), xhi = _mm256_permute2x128_si256(x0, x1, 0x31);
        a0 = _mm256_fmadd_ps(dot_pair(q0 + at, xlo, xhi), pair_scale(sa + g), a0);
        a1 = _mm256_fmadd_ps(dot_pair(q1 + at, xlo, xhi), pair_scale(sa + G + g), a1);
        a2 = _mm256_fmadd_ps(dot_pair(q2 + at, xlo, xhi), pair_scale(sa + 2 * G + g), a2);
        a3 = _mm256_fmadd_ps(dot_pair(q3 + at, xlo, xhi), pair_scale(sa + 3 * G + g), a3);
    }
    for (; g < G; g++) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xm + g * BLOCK));
        const int64_t at = g * S;
        _mm_prefetch(reinterpret_cast<const char *>(ahead + 4 * at), _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(dot_u4_i8(nibbles(q0 + at), xv), _mm256_broadcast_ss(sa + g), a0);
        a1 = _mm256_fmadd_ps(dot_u4_i8(nibbles(q1 + at), xv), _mm256_broadcast_ss(sa + G + g), a1);
        a2 = _mm256_fmadd_ps(dot_u4_i8(nibbles(q2 + at), xv), _mm256_broadcast_ss(sa + 2 * G + g), a2);
        a3 = _mm256_fmadd_ps(dot_u4_i8(nibbles(q3 + at), xv), _mm256_broadcast_ss(sa + 3 * G + g), a3);
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
}

}  // namespace

QKV_AVX2 void x86_int4_rows(const int8_t *xq, const float *xd, const float *xsum, const uint8_t *q,
                            const uint16_t *d, const uint16_t *mn, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int64_t n0, int64_t n1, float *scratch, bool vnni) {
    const int64_t G = K / BLOCK, S = BLOCK / 2;
    float *sa = scratch;  // d * xd per row and block
    for (int64_t n = n0; n < n1; n += ROWS) {
        const int64_t rows = std::min(ROWS, n1 - n);
        const uint8_t *q0 = q + n * G * S, *ahead = q0 + ROWS * G * S;  // the next row block, read early
        for (int64_t m = 0; m < M; m++) {  // each row of x alone: the same steps whatever M is
            const int8_t *xm = xq + m * K;
            float off[ROWS] = {0.f, 0.f, 0.f, 0.f};
            block_factors(d, mn, xd + m * G, xsum + m * G, G, n, rows, sa, off);
            __m256 acc[ROWS] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            if (rows == ROWS) {
                four_rows(xm, q0, G, sa, ahead, vnni, acc);
            } else {  // the last rows of N, one at a time, one block a step
                for (int64_t r = 0; r < rows; r++) {
                    const uint8_t *qr = q + (n + r) * G * S;
                    __m256 a = _mm256_setzero_ps();
                    for (int64_t g = 0; g < G; g++) {
                        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xm + g * BLOCK));
                        a = _mm256_fmadd_ps(dot_u4_i8(nibbles(qr + g * S), xv), _mm256_broadcast_ss(sa + r * G + g), a);
                    }
                    acc[r] = a;
                }
            }
            for (int64_t r = 0; r < rows; r++) y[m * N + n + r] = hsum(acc[r]) + off[r] + (bias ? bias[n + r] : 0.f);
        }
    }
}

}  // namespace qkv

#endif  // QKV_X86
