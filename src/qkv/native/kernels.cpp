// qkv's weight-only matrix products for decoding on x86-64 CPUs with AVX2, FMA and F16C.
//
// A decode step multiplies a few rows of activations by every weight of the model once,
// so it is bound by how fast the weights stream from memory. These kernels read each
// weight once for all the rows of x, keep the arithmetic in registers, and split the
// output features between PyTorch's threads (torch_parallel_for).
//
// Built by qkv.native.build with the machine's C++ compiler against PyTorch's stable C
// ABI (headers only, so it compiles in about 2 seconds), loaded with torch.ops.load_library.
//
//   qkv::int8_linear(x (M, K) f32, w (N, K) i8, scales (N,) f32, bias (N,) f32?) -> (M, N) f32
//       y = (x @ w^T) * scales + bias, in float32 (the exact product of x and the int8 weights)
//   qkv::f32_linear(x (M, K) f32, w (N, K) f32, bias (N,) f32?) -> (M, N) f32
//       y = x @ w^T + bias, nn.Linear's product in another summation order
//   qkv::decode_attention(q (B, H, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v), visible (B, H, S) bool?,
//                         scale) -> (B, H, D_v): one query per head over a KV cache, grouped heads
//       sharing keys; softmax over the visible keys, zeros where none is visible
//   qkv::int4_linear(x (M, K) f32, q (N, K/2) u8, d (N, K/32) f16, m (N, K/32) f16, bias?) -> (M, N) f32
//       (d and m may also be their float16 bits held in int16 tensors)
//       weights in blocks of 32: w = q * d + m, q in 0..15; byte j of a block's 16 holds
//       element j in its low nibble and element j + 16 in its high one (GGUF's Q4_1 layout).
//       x is rounded to int8 per block of 32 (one float scale each, as llama.cpp does) and
//       the product is the exact one of those rounded activations and the 4-bit weights.
//   qkv::decoder_layer(x (B, C), attn_norm, qkv, o, mlp_norm, up, down, q_norm?, k_norm?, inv_freq?,
//                      k_cache!, v_cache!, lengths!, positions (B,), rows (B,)?, num_heads, activation, eps,
//                      scale) -> (B, C): one decode step of a pre-norm decoder layer (Llama/Qwen or GPT-2),
//       one new token per row, through the products above; the new keys and values are written at
//       `positions` of cache row rows[r] (or r) (qkv.runtime.native_layers describes the arguments)
//
// Shape legend: M rows of x (batch x tokens), K input features, N output features.
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <cmath>
#include <algorithm>
#include <type_traits>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

using torch::stable::Tensor;

namespace {

constexpr int64_t ROWS = 4;    // output features computed together (they share x's loads)
constexpr int64_t BLOCK = 32;  // int4 block and activation-rounding block

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256 int8x8(const int8_t *p) {  // 8 int8 -> 8 float
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
}

void check(bool ok, const char *message) {
    STD_TORCH_CHECK(ok, message);
}

int64_t grain(int64_t blocks) {  // row blocks per task: about 4 tasks per thread
    int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
    return std::max<int64_t>(1, blocks / (4 * threads));
}

// -- int8 or float32 weights, float32 activations --------------------------------------
inline __m256 load8(const int8_t *p) { return int8x8(p); }
inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }

// One float32 weight row against one row of x, read as one sequential stream (a thread's rows
// lie back to back, so its whole share is one stream): four accumulators over 32 inputs a
// step, and the bytes STREAM_AHEAD further on prefetched with the non-temporal hint (on AMD's
// L3, a victim cache, that also keeps the streamed weights from being written into it).
// GPT-2-124M's layers and head, one decode step, 2 threads, Zen 5: 10-12% faster than four
// interleaved rows with the next block prefetched into L1, and level with torch.sum's read of
// the same bytes. int8 weights keep the four-row path below: they load x once per weight
// here instead of once per four, and an A/B of GPT-2 int8 steps was not faster with it.
constexpr int64_t STREAM_AHEAD = 4096;

inline float stream_row(const float *x, const float *w, int64_t K) {
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

// Rows [n0, n1) of y = (x @ w^T) * scales + bias, four weight rows at a time; `scales` may be
// null (float32 weights). While a block of rows is computed, the next one is prefetched:
// without it the hardware prefetcher left these matrix-vector products at 7-9 GB/s (Zen 3).
// One row of x against float32 weights goes through stream_row instead.
template <typename W>
void weight_rows(const float *x, const W *w, const float *scales, const float *bias, float *y,
                 int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    constexpr int64_t LINES = (ROWS * 16 * sizeof(W) + 63) / 64;  // cache lines of the next block per step
    for (int64_t n = n0; n < n1; n += ROWS) {
        int64_t rows = std::min(ROWS, n1 - n);
        int64_t m = 0;
        // Two rows of x at a time: each weight is loaded (and converted) once for both.
        for (; rows == ROWS && m + 2 <= M && K % 8 == 0; m += 2) {
            const float *xa = x + m * K, *xb = xa + K;
            const W *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
            const char *ahead = reinterpret_cast<const char *>(w0 + ROWS * K);
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                for (int64_t line = 0; line < (LINES + 1) / 2; line++)
                    _mm_prefetch(ahead + (ROWS * sizeof(W)) * k + 64 * line, _MM_HINT_T0);
                __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
                __m256 v0 = load8(w0 + k), v1 = load8(w1 + k), v2 = load8(w2 + k), v3 = load8(w3 + k);
                a0 = _mm256_fmadd_ps(v0, va, a0); b0 = _mm256_fmadd_ps(v0, vb, b0);
                a1 = _mm256_fmadd_ps(v1, va, a1); b1 = _mm256_fmadd_ps(v1, vb, b1);
                a2 = _mm256_fmadd_ps(v2, va, a2); b2 = _mm256_fmadd_ps(v2, vb, b2);
                a3 = _mm256_fmadd_ps(v3, va, a3); b3 = _mm256_fmadd_ps(v3, vb, b3);
            }
            const __m256 ra[ROWS] = {a0, a1, a2, a3}, rb[ROWS] = {b0, b1, b2, b3};
            for (int64_t r = 0; r < ROWS; r++) {
                const float scale = scales ? scales[n + r] : 1.f, extra = bias ? bias[n + r] : 0.f;
                y[m * N + n + r] = hsum(ra[r]) * scale + extra;
                y[(m + 1) * N + n + r] = hsum(rb[r]) * scale + extra;
            }
        }
        for (; m < M; m++) {  // one row of x (a decode step, or the last of an odd count)
            const float *xm = x + m * K;
            if constexpr (std::is_same_v<W, float>) {  // float32: one stream per thread (stream_row)
                for (int64_t r = 0; r < rows; r++)
                    y[m * N + n + r] = stream_row(xm, w + (n + r) * K, K) + (bias ? bias[n + r] : 0.f);
                continue;
            }
            float out[ROWS] = {0.f, 0.f, 0.f, 0.f};
            if (rows == ROWS) {
                const W *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                const char *ahead = reinterpret_cast<const char *>(w0 + ROWS * K);  // the next row block
                int64_t k = 0;
                for (; k + 16 <= K; k += 16) {
                    for (int64_t line = 0; line < LINES; line++)
                        _mm_prefetch(ahead + (ROWS * sizeof(W)) * k + 64 * line, _MM_HINT_T0);
                    __m256 xa = _mm256_loadu_ps(xm + k), xb = _mm256_loadu_ps(xm + k + 8);
                    a0 = _mm256_fmadd_ps(load8(w0 + k), xa, a0); b0 = _mm256_fmadd_ps(load8(w0 + k + 8), xb, b0);
                    a1 = _mm256_fmadd_ps(load8(w1 + k), xa, a1); b1 = _mm256_fmadd_ps(load8(w1 + k + 8), xb, b1);
                    a2 = _mm256_fmadd_ps(load8(w2 + k), xa, a2); b2 = _mm256_fmadd_ps(load8(w2 + k + 8), xb, b2);
                    a3 = _mm256_fmadd_ps(load8(w3 + k), xa, a3); b3 = _mm256_fmadd_ps(load8(w3 + k + 8), xb, b3);
                }
                out[0] = hsum(_mm256_add_ps(a0, b0)); out[1] = hsum(_mm256_add_ps(a1, b1));
                out[2] = hsum(_mm256_add_ps(a2, b2)); out[3] = hsum(_mm256_add_ps(a3, b3));
                for (; k < K; k++) {
                    out[0] += xm[k] * w0[k]; out[1] += xm[k] * w1[k];
                    out[2] += xm[k] * w2[k]; out[3] += xm[k] * w3[k];
                }
            } else {
                for (int64_t r = 0; r < rows; r++) {
                    const W *wr = w + (n + r) * K;
                    __m256 a = _mm256_setzero_ps();
                    int64_t k = 0;
                    for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(load8(wr + k), _mm256_loadu_ps(xm + k), a);
                    out[r] = hsum(a);
                    for (; k < K; k++) out[r] += xm[k] * wr[k];
                }
            }
            for (int64_t r = 0; r < rows; r++)
                y[m * N + n + r] = out[r] * (scales ? scales[n + r] : 1.f) + (bias ? bias[n + r] : 0.f);
        }
    }
}

// -- int4 weights, activations rounded to int8 per block ------------------------------
// xq (M, K) int8 with one scale xd per block of 32 and the block's sum xsum (of xq * xd).
void round_activations(const float *x, int8_t *xq, float *xd, float *xsum, int64_t count) {
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
        __m256i n[4];  // rounded to nearest, ties to even (the default rounding mode), as lrintf
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
        xsum[i] = d * static_cast<float>(_mm_cvtsi128_si32(t4));  // the sum of the rounded activations
    }
}

inline __m256i nibbles(const uint8_t *block) {  // 16 bytes -> 32 values 0..15: low nibbles, then high
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(block));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Two consecutive blocks of a row (32 bytes) against x arranged as [x_g 0..15 | x_g+1 0..15]
// (xlo) and [x_g 16..31 | x_g+1 16..31] (xhi): lanes 0-3 sum block g, lanes 4-7 block g + 1.
inline __m256 dot_pair(const uint8_t *blocks, __m256i xlo, __m256i xhi) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blocks));
    __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    // each int16 is at most 2 * 15 * 127 in size, so two of them add without overflow
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline __m256 pair_scale(const float *scale) {  // [scale[0] x4 | scale[1] x4]
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(scale)), _mm_broadcast_ss(scale + 1), 1);
}

inline __m256 dot_u4_i8(__m256i q, __m256i x) {  // 32 (0..15) x 32 int8 -> 8 float partial sums
    __m256i pairs = _mm256_maddubs_epi16(q, x);  // |sum| <= 2 * 15 * 127: no saturation
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Per-block factors of rows [n, n + rows) for activation row m: scale[r * G + g] = d * xd and
// off[r] = sum over blocks of m_block * xsum (the minimum's share), 8 blocks at a time.
void block_factors(const uint16_t *d, const uint16_t *mn, const float *dm, const float *sm, int64_t G,
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QKV_VNNI 1
// The int4 single-row product on AVX-512 VNNI (built where the CPU has it, qkv.native.build):
// four blocks of a row in one 64-byte load, their low and high nibbles multiplied with the
// rounded activations by two vpdpbusd (unsigned 4-bit weights times signed int8, four products
// summed into each int32 lane: exact, as the AVX2 path's maddubs/madd), each 128-bit lane one
// block, scaled by its block's d * xd. About half the instructions of the AVX2 loop per weight;
// the AVX2 loops below finish the last blocks. Rows q0, q0 + G*16, ... (four), factors sa.
inline int64_t vnni_blocks(const int8_t *xm, const uint8_t *q0, int64_t G, const float *sa, const uint8_t *ahead,
                           __m256 &a0, __m256 &a1, __m256 &a2, __m256 &a3) {
    constexpr int64_t S = BLOCK / 2;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // scale of each lane's block
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
    auto fold = [](__m512 v) {  // 16 lanes -> 8
        return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    };
    a0 = _mm256_add_ps(a0, fold(c[0]));
    a1 = _mm256_add_ps(a1, fold(c[1]));
    a2 = _mm256_add_ps(a2, fold(c[2]));
    a3 = _mm256_add_ps(a3, fold(c[3]));
    return g;
}
#else
#define QKV_VNNI 0
#endif

void int4_rows(const int8_t *xq, const float *xd, const float *xsum, const uint8_t *q, const uint16_t *d,
               const uint16_t *mn, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
               int64_t n0, int64_t n1) {
    const int64_t G = K / BLOCK, S = BLOCK / 2;
    std::vector<float> scale(static_cast<size_t>(2 * ROWS * G + 8));  // d * xd per row and block, two rows of x
    float *sa = scale.data(), *sb = sa + ROWS * G;
    for (int64_t n = n0; n < n1; n += ROWS) {
        const int64_t rows = std::min(ROWS, n1 - n);
        const uint8_t *q0 = q + n * G * S, *q1 = q0 + G * S, *q2 = q1 + G * S, *q3 = q2 + G * S;
        const uint8_t *ahead = q0 + ROWS * G * S;  // the next row block, read early
        int64_t m = 0;
        // Two rows of x at a time: each block of weights is unpacked once for both.
        for (; rows == ROWS && m + 2 <= M; m += 2) {
            float offa[ROWS], offb[ROWS];
            block_factors(d, mn, xd + m * G, xsum + m * G, G, n, rows, sa, offa);
            block_factors(d, mn, xd + (m + 1) * G, xsum + (m + 1) * G, G, n, rows, sb, offb);
            const int8_t *xa = xq + m * K, *xb = xa + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t g = 0; g < G; g++) {
                const int64_t at = g * S;
                _mm_prefetch(reinterpret_cast<const char *>(ahead + 4 * at), _MM_HINT_T0);
                __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xa + g * BLOCK));
                __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xb + g * BLOCK));
                __m256i w0 = nibbles(q0 + at), w1 = nibbles(q1 + at), w2 = nibbles(q2 + at), w3 = nibbles(q3 + at);
                a0 = _mm256_fmadd_ps(dot_u4_i8(w0, va), _mm256_broadcast_ss(sa + g), a0);
                a1 = _mm256_fmadd_ps(dot_u4_i8(w1, va), _mm256_broadcast_ss(sa + G + g), a1);
                a2 = _mm256_fmadd_ps(dot_u4_i8(w2, va), _mm256_broadcast_ss(sa + 2 * G + g), a2);
                a3 = _mm256_fmadd_ps(dot_u4_i8(w3, va), _mm256_broadcast_ss(sa + 3 * G + g), a3);
                b0 = _mm256_fmadd_ps(dot_u4_i8(w0, vb), _mm256_broadcast_ss(sb + g), b0);
                b1 = _mm256_fmadd_ps(dot_u4_i8(w1, vb), _mm256_broadcast_ss(sb + G + g), b1);
                b2 = _mm256_fmadd_ps(dot_u4_i8(w2, vb), _mm256_broadcast_ss(sb + 2 * G + g), b2);
                b3 = _mm256_fmadd_ps(dot_u4_i8(w3, vb), _mm256_broadcast_ss(sb + 3 * G + g), b3);
            }
            const __m256 ra[ROWS] = {a0, a1, a2, a3}, rb[ROWS] = {b0, b1, b2, b3};
            for (int64_t r = 0; r < ROWS; r++) {
                const float extra = bias ? bias[n + r] : 0.f;
                y[m * N + n + r] = hsum(ra[r]) + offa[r] + extra;
                y[(m + 1) * N + n + r] = hsum(rb[r]) + offb[r] + extra;
            }
        }
        for (; m < M; m++) {  // one row of x (a decode step, or the last of an odd count)
            const int8_t *xm = xq + m * K;
            float off[ROWS] = {0.f, 0.f, 0.f, 0.f};
            block_factors(d, mn, xd + m * G, xsum + m * G, G, n, rows, sa, off);
            __m256 acc[ROWS] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            if (rows == ROWS) {  // four named accumulators: the compiler keeps them in registers
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                int64_t g = 0;
#if QKV_VNNI
                g = vnni_blocks(xm, q0, G, sa, ahead, a0, a1, a2, a3);  // blocks [0, g): four a step
#endif
                // Two blocks per step: one 32-byte load holds blocks g and g + 1 of a row, whose
                // low nibbles are elements 0..15 of each (lanes 0 and 1) and high nibbles
                // elements 16..31; x is arranged the same way once for the four rows.
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
            } else {
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
            for (int64_t r = 0; r < rows; r++)
                y[m * N + n + r] = hsum(acc[r]) + off[r] + (bias ? bias[n + r] : 0.f);
        }
    }
}

Tensor new_output(const Tensor &x, int64_t M, int64_t N) {
    return torch::stable::new_empty(x, {M, N});
}

const float *optional_bias(const std::optional<Tensor> &bias, int64_t N) {
    if (!bias.has_value()) return nullptr;
    check(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
              bias->scalar_type() == torch::headeronly::ScalarType::Float,
          "qkv native kernels: bias must be a contiguous float32 vector of the output size");
    return static_cast<const float *>(bias->data_ptr());
}

// A linear layer's weights as the kernels read them: float32 w (N, K), int8 w (N, K) with
// scales (N,), or 4-bit blocks q (N, K/2) with d and m (N, K/32); bias optional. The ops
// below fill one from their arguments, qkv::decoder_layer from a list (`linear_of`).
struct Linear {
    enum Kind { F32, INT8, INT4 } kind;
    const void *w = nullptr;
    const float *scales = nullptr, *bias = nullptr;
    const uint16_t *d = nullptr, *m = nullptr;
    int64_t N = 0, K = 0;
};

// y (M, N) = x (M, K) through L, on PyTorch's threads.
void apply(const Linear &L, const float *x, float *y, int64_t M) {
    const int64_t N = L.N, K = L.K, blocks = (N + ROWS - 1) / ROWS;
    if (L.kind == Linear::INT4) {
        const int64_t G = K / BLOCK;
        std::vector<int8_t> xq(static_cast<size_t>(M * K));
        std::vector<float> xd(static_cast<size_t>(M * G)), xsum(static_cast<size_t>(M * G));
        round_activations(x, xq.data(), xd.data(), xsum.data(), M * G);
        torch::stable::parallel_for(0, blocks, grain(blocks), [&](int64_t b0, int64_t b1) {
            int4_rows(xq.data(), xd.data(), xsum.data(), static_cast<const uint8_t *>(L.w), L.d, L.m, L.bias, y, M,
                      N, K, b0 * ROWS, std::min(N, b1 * ROWS));
        });
    } else if (L.kind == Linear::INT8) {
        torch::stable::parallel_for(0, blocks, grain(blocks), [&](int64_t b0, int64_t b1) {
            weight_rows(x, static_cast<const int8_t *>(L.w), L.scales, L.bias, y, M, N, K, b0 * ROWS,
                        std::min(N, b1 * ROWS));
        });
    } else {
        torch::stable::parallel_for(0, blocks, grain(blocks), [&](int64_t b0, int64_t b1) {
            weight_rows(x, static_cast<const float *>(L.w), static_cast<const float *>(nullptr), L.bias, y, M, N, K,
                        b0 * ROWS, std::min(N, b1 * ROWS));
        });
    }
}

Tensor int8_linear(Tensor x, Tensor w, Tensor scales, std::optional<Tensor> bias) {
    using torch::headeronly::ScalarType;
    check(x.dim() == 2 && w.dim() == 2 && scales.dim() == 1, "qkv::int8_linear takes x (M, K), w (N, K), scales (N,)");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    check(w.size(1) == K && scales.size(0) == N, "qkv::int8_linear: x, w and scales disagree on K or N");
    check(x.scalar_type() == ScalarType::Float && w.scalar_type() == ScalarType::Char &&
              scales.scalar_type() == ScalarType::Float,
          "qkv::int8_linear takes float32 x and scales and int8 w");
    check(x.is_contiguous() && w.is_contiguous() && scales.is_contiguous(), "qkv::int8_linear takes contiguous tensors");
    const Linear L{Linear::INT8, w.data_ptr(), static_cast<const float *>(scales.data_ptr()), optional_bias(bias, N),
                   nullptr, nullptr, N, K};
    Tensor y = new_output(x, M, N);
    apply(L, static_cast<const float *>(x.data_ptr()), static_cast<float *>(y.data_ptr()), M);
    return y;
}

Tensor f32_linear(Tensor x, Tensor w, std::optional<Tensor> bias) {
    using torch::headeronly::ScalarType;
    check(x.dim() == 2 && w.dim() == 2, "qkv::f32_linear takes x (M, K) and w (N, K)");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    check(w.size(1) == K, "qkv::f32_linear: x and w disagree on K");
    check(x.scalar_type() == ScalarType::Float && w.scalar_type() == ScalarType::Float,
          "qkv::f32_linear takes float32 x and w");
    check(x.is_contiguous() && w.is_contiguous(), "qkv::f32_linear takes contiguous tensors");
    const Linear L{Linear::F32, w.data_ptr(), nullptr, optional_bias(bias, N), nullptr, nullptr, N, K};
    Tensor y = new_output(x, M, N);
    apply(L, static_cast<const float *>(x.data_ptr()), static_cast<float *>(y.data_ptr()), M);
    return y;
}

Tensor int4_linear(Tensor x, Tensor q, Tensor d, Tensor mn, std::optional<Tensor> bias) {
    using torch::headeronly::ScalarType;
    check(x.dim() == 2 && q.dim() == 2 && d.dim() == 2 && mn.dim() == 2,
          "qkv::int4_linear takes x (M, K), q (N, K/2), d and m (N, K/32)");
    const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
    check(K % BLOCK == 0 && q.size(1) == K / 2 && d.size(0) == N && d.size(1) == K / BLOCK &&
              mn.size(0) == N && mn.size(1) == K / BLOCK,
          "qkv::int4_linear: K must be a multiple of 32 and q, d, m must be (N, K/2), (N, K/32), (N, K/32)");
    auto half_bits = [](const Tensor &t) {  // float16, or its bits in int16 (what qkv's layers keep)
        return t.scalar_type() == ScalarType::Half || t.scalar_type() == ScalarType::Short;
    };
    check(x.scalar_type() == ScalarType::Float && q.scalar_type() == ScalarType::Byte && half_bits(d) && half_bits(mn),
          "qkv::int4_linear takes float32 x, uint8 q and float16 d and m (or their bits as int16)");
    check(x.is_contiguous() && q.is_contiguous() && d.is_contiguous() && mn.is_contiguous(),
          "qkv::int4_linear takes contiguous tensors");
    const Linear L{Linear::INT4, q.data_ptr(), nullptr, optional_bias(bias, N),
                   static_cast<const uint16_t *>(d.data_ptr()), static_cast<const uint16_t *>(mn.data_ptr()), N, K};
    Tensor y = new_output(x, M, N);
    apply(L, static_cast<const float *>(x.data_ptr()), static_cast<float *>(y.data_ptr()), M);
    return y;
}

// -- one-query attention over a KV cache ------------------------------------------------
// exp of 8 floats (Cephes' polynomial on [-ln2/2, ln2/2], relative error about 1e-7).
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float dot(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float total = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

// One (row, head): softmax over the visible keys of scale * q.k, then the weighted sum of
// the values; a query that sees no key gets zeros.
void attend_one(const float *q, const float *k, const float *v, const bool *visible, float *out,
                int64_t S, int64_t D, int64_t Dv, float scale, float *w) {
    float top = -INFINITY;
    for (int64_t s = 0; s < S; s++) {
        if (visible && !visible[s]) { w[s] = -INFINITY; continue; }
        w[s] = dot(q, k + s * D, D) * scale;
        top = std::max(top, w[s]);
    }
    for (int64_t j = 0; j < Dv; j++) out[j] = 0.f;
    if (top == -INFINITY) return;
    const __m256 shift = _mm256_set1_ps(top), hidden = _mm256_set1_ps(-INFINITY);
    __m256 sums = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 8 <= S; s += 8) {
        __m256 x = _mm256_loadu_ps(w + s);
        __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, hidden, _CMP_EQ_OQ), exp8(_mm256_sub_ps(x, shift)));
        _mm256_storeu_ps(w + s, e);
        sums = _mm256_add_ps(sums, e);
    }
    float total = hsum(sums);
    for (; s < S; s++) {
        w[s] = w[s] == -INFINITY ? 0.f : expf(w[s] - top);
        total += w[s];
    }
    const float inv = 1.f / total;
    for (s = 0; s < S; s++) {
        if (w[s] == 0.f) continue;
        const __m256 ws = _mm256_set1_ps(w[s] * inv);
        const float *vs = v + s * Dv;
        int64_t j = 0;
        for (; j + 8 <= Dv; j += 8)
            _mm256_storeu_ps(out + j, _mm256_fmadd_ps(ws, _mm256_loadu_ps(vs + j), _mm256_loadu_ps(out + j)));
        for (; j < Dv; j++) out[j] += w[s] * inv * vs[j];
    }
}

Tensor decode_attention(Tensor q, Tensor k, Tensor v, std::optional<Tensor> visible, double scale) {
    using torch::headeronly::ScalarType;
    check(q.dim() == 3 && k.dim() == 4 && v.dim() == 4,
          "qkv::decode_attention takes q (B, H, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v)");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), S = k.size(2), Dv = v.size(3);
    check(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == D && Hkv > 0 &&
              H % Hkv == 0,
          "qkv::decode_attention: q, k and v disagree on B, S, D or the head groups");
    check(q.scalar_type() == ScalarType::Float && k.scalar_type() == ScalarType::Float &&
              v.scalar_type() == ScalarType::Float,
          "qkv::decode_attention takes float32 q, k and v");
    check(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "qkv::decode_attention takes contiguous tensors");
    const bool *vis = nullptr;
    if (visible.has_value()) {
        check(visible->dim() == 3 && visible->size(0) == B && visible->size(1) == H && visible->size(2) == S &&
                  visible->scalar_type() == ScalarType::Bool && visible->is_contiguous(),
              "qkv::decode_attention: visible must be a contiguous bool (B, H, S)");
        vis = static_cast<const bool *>(visible->data_ptr());
    }
    Tensor out = torch::stable::new_empty(q, {B, H, Dv});
    const float *qp = static_cast<const float *>(q.data_ptr()), *kp = static_cast<const float *>(k.data_ptr()),
                *vp = static_cast<const float *>(v.data_ptr());
    float *op = static_cast<float *>(out.data_ptr());
    const int64_t group = H / Hkv;
    torch::stable::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> w(static_cast<size_t>(S));
        for (int64_t i = i0; i < i1; i++) {
            const int64_t b = i / H, h = i % H, kv = b * Hkv + h / group;
            attend_one(qp + i * D, kp + kv * S * D, vp + kv * S * Dv, vis ? vis + i * S : nullptr, op + i * Dv, S, D,
                       Dv, static_cast<float>(scale), w.data());
        }
    });
    return out;
}


// -- one decoder layer's decode step ------------------------------------------------------
// A layer is a dozen small operations around four weight products; called one by one from
// Python each costs more in dispatch than in arithmetic (about 0.8 ms a layer against 0.2 ms
// of products on SmolLM2). Here the whole layer is one call: the same products, the same
// attention, with the norms, RoPE, the cache write and the activation in between.

Linear linear_of(const std::vector<Tensor> &parts, int64_t K, const char *message) {
    using torch::headeronly::ScalarType;
    check(!parts.empty(), message);
    const Tensor &w = parts[0];
    Linear L;
    size_t base = 1;
    if (w.scalar_type() == ScalarType::Float) {
        L.kind = Linear::F32;
    } else if (w.scalar_type() == ScalarType::Char) {
        L.kind = Linear::INT8;
        base = 2;
    } else {
        check(w.scalar_type() == ScalarType::Byte, message);
        L.kind = Linear::INT4;
        base = 3;
    }
    check(w.dim() == 2 && w.is_contiguous() && (parts.size() == base || parts.size() == base + 1), message);
    L.N = w.size(0);
    L.K = K;
    L.w = w.data_ptr();
    if (L.kind == Linear::INT4) {
        const Tensor &d = parts[1], &m = parts[2];
        auto half_bits = [](const Tensor &t) {
            return t.scalar_type() == ScalarType::Half || t.scalar_type() == ScalarType::Short;
        };
        check(K % BLOCK == 0 && w.size(1) == K / 2 && d.dim() == 2 && m.dim() == 2 && d.size(0) == L.N &&
                  d.size(1) == K / BLOCK && m.size(0) == L.N && m.size(1) == K / BLOCK && half_bits(d) &&
                  half_bits(m) && d.is_contiguous() && m.is_contiguous(),
              message);
        L.d = static_cast<const uint16_t *>(d.data_ptr());
        L.m = static_cast<const uint16_t *>(m.data_ptr());
    } else {
        check(w.size(1) == K, message);
    }
    if (L.kind == Linear::INT8) {
        const Tensor &s = parts[1];
        check(s.dim() == 1 && s.size(0) == L.N && s.is_contiguous() && s.scalar_type() == ScalarType::Float, message);
        L.scales = static_cast<const float *>(s.data_ptr());
    }
    if (parts.size() == base + 1) L.bias = optional_bias(parts[base], L.N);
    return L;
}

// A norm as the layer holds it: [weight] is RMSNorm (Llama), [weight, bias] LayerNorm (GPT-2).
struct Norm {
    const float *weight = nullptr, *bias = nullptr;
    int64_t size = 0;
};

Norm norm_of(const std::vector<Tensor> &parts, int64_t size, const char *message) {
    using torch::headeronly::ScalarType;
    check(parts.size() == 1 || parts.size() == 2, message);
    Norm n;
    n.size = size;
    for (size_t i = 0; i < parts.size(); i++) {
        const Tensor &t = parts[i];
        check(t.dim() == 1 && t.size(0) == size && t.is_contiguous() && t.scalar_type() == ScalarType::Float, message);
        (i == 0 ? n.weight : n.bias) = static_cast<const float *>(t.data_ptr());
    }
    return n;
}

// out = norm(x) for one vector of n.size: RMSNorm x / sqrt(mean(x^2) + eps) * weight, or
// LayerNorm (x - mean) / sqrt(var + eps) * weight + bias; sums in double.
void normalize(const Norm &n, const float *x, float *out, float eps) {
    const int64_t C = n.size;
    double mean = 0.0;
    if (n.bias) {
        for (int64_t i = 0; i < C; i++) mean += x[i];
        mean /= static_cast<double>(C);
    }
    double squares = 0.0;
    for (int64_t i = 0; i < C; i++) {
        const double centred = x[i] - mean;
        squares += centred * centred;
    }
    const float inv = static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(C) + eps));
    const float shift = static_cast<float>(mean);
    for (int64_t i = 0; i < C; i++) {
        const float v = (x[i] - shift) * inv * n.weight[i];
        out[i] = n.bias ? v + n.bias[i] : v;
    }
}

// RoPE in the rotate-half layout: pair (x[i], x[i + D/2]) turned by position * inv_freq[i].
void rotate(float *x, const float *cos_, const float *sin_, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos_[i] - b * sin_[i];
        x[i + half] = b * cos_[i] + a * sin_[i];
    }
}

enum Activation : int64_t { SILU_GATED = 0, GELU_TANH = 1 };

// The feed-forward's activation: silu(gate) * up with up (M, 2F) = [gate | up] per row, or
// GPT-2's tanh GELU of up (M, F). out (M, F).
void activate(int64_t kind, const float *up, float *out, int64_t M, int64_t F) {
    const __m256 one = _mm256_set1_ps(1.f), half = _mm256_set1_ps(0.5f), two = _mm256_set1_ps(2.f);
    const __m256 c0 = _mm256_set1_ps(0.7978845608028654f), c1 = _mm256_set1_ps(0.044715f);
    for (int64_t r = 0; r < M; r++) {
        const float *g = up + r * (kind == SILU_GATED ? 2 * F : F), *u = g + F;
        float *o = out + r * F;
        int64_t i = 0;
        for (; i + 8 <= F; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            if (kind == SILU_GATED) {
                const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
            } else {  // tanh(z) = 1 - 2 / (exp(2z) + 1)
                const __m256 z = _mm256_mul_ps(c0, _mm256_fmadd_ps(_mm256_mul_ps(c1, x), _mm256_mul_ps(x, x), x));
                const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(_mm256_mul_ps(two, z)), one)));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t)));
            }
        }
        for (; i < F; i++) {
            const float x = g[i];
            o[i] = kind == SILU_GATED ? x / (1.f + expf(-x)) * u[i]
                                      : 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
        }
    }
}

Tensor decoder_layer(Tensor x, std::vector<Tensor> attn_norm, std::vector<Tensor> qkv, std::vector<Tensor> o,
                     std::vector<Tensor> mlp_norm, std::vector<Tensor> up, std::vector<Tensor> down,
                     std::optional<Tensor> q_norm, std::optional<Tensor> k_norm, std::optional<Tensor> inv_freq,
                     Tensor k_cache, Tensor v_cache, Tensor lengths, Tensor positions, std::optional<Tensor> rows,
                     int64_t num_heads, int64_t activation, double eps, double scale) {
    using torch::headeronly::ScalarType;
    check(x.dim() == 2 && x.scalar_type() == ScalarType::Float && x.is_contiguous(),
          "qkv::decoder_layer takes x (B, C) contiguous float32");
    const int64_t M = x.size(0), C = x.size(1);
    check(k_cache.dim() == 4 && v_cache.dim() == 4 && v_cache.size(0) == k_cache.size(0) &&
              v_cache.size(1) == k_cache.size(1) && v_cache.size(2) == k_cache.size(2) &&
              k_cache.scalar_type() == ScalarType::Float && v_cache.scalar_type() == ScalarType::Float &&
              k_cache.is_contiguous() && v_cache.is_contiguous(),
          "qkv::decoder_layer: the caches must be contiguous float32 (B, H_kv, S, D)");
    const int64_t slots = k_cache.size(0);  // cache rows; row r of x is cache row rows[r] (or r)
    const int64_t *row_of = nullptr;
    if (rows.has_value()) {
        check(rows->dim() == 1 && rows->size(0) == M && rows->scalar_type() == ScalarType::Long &&
                  rows->is_contiguous(),
              "qkv::decoder_layer: rows must be contiguous int64 (B,)");
        row_of = static_cast<const int64_t *>(rows->data_ptr());
        for (int64_t r = 0; r < M; r++)
            check(row_of[r] >= 0 && row_of[r] < slots, "qkv::decoder_layer: a row lies outside the KV cache");
    } else {
        check(slots == M, "qkv::decoder_layer: without rows, x has one row per cache row");
    }
    const int64_t Hkv = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3), Dv = v_cache.size(3);
    const int64_t H = num_heads;
    check(Hkv > 0 && H % Hkv == 0 && D == Dv, "qkv::decoder_layer: num_heads must be a multiple of the cache's heads");
    check(positions.dim() == 1 && positions.size(0) == M && positions.scalar_type() == ScalarType::Long &&
              positions.is_contiguous() && lengths.dim() == 1 && lengths.size(0) == slots &&
              lengths.scalar_type() == ScalarType::Long && lengths.is_contiguous(),
          "qkv::decoder_layer: positions (B,) and lengths (one per cache row) must be contiguous int64");
    check(activation == SILU_GATED || activation == GELU_TANH, "qkv::decoder_layer: unknown activation");
    const int64_t Q = H * D, KV = Hkv * D;
    const Norm n1 = norm_of(attn_norm, C, "qkv::decoder_layer: attn_norm must be [weight] or [weight, bias] (C,)");
    const Norm n2 = norm_of(mlp_norm, C, "qkv::decoder_layer: mlp_norm must be [weight] or [weight, bias] (C,)");
    const Linear Lqkv = linear_of(qkv, C, "qkv::decoder_layer: qkv is not a linear layer of C inputs");
    const Linear Lo = linear_of(o, Q, "qkv::decoder_layer: o is not a linear layer of H*D inputs");
    const Linear Lup = linear_of(up, C, "qkv::decoder_layer: up is not a linear layer of C inputs");
    const int64_t F = activation == SILU_GATED ? Lup.N / 2 : Lup.N;
    const Linear Ldown = linear_of(down, F, "qkv::decoder_layer: down is not a linear layer of the feed-forward's size");
    check(Lqkv.N == Q + 2 * KV && Lo.N == C && Ldown.N == C && (activation != SILU_GATED || Lup.N % 2 == 0),
          "qkv::decoder_layer: the layers' sizes disagree with C, the heads and the head size");
    const float *qn = nullptr, *kn = nullptr, *freq = nullptr;
    auto vector_of = [&](const std::optional<Tensor> &t, int64_t size, const char *message) -> const float * {
        if (!t.has_value()) return nullptr;
        check(t->dim() == 1 && t->size(0) == size && t->is_contiguous() && t->scalar_type() == ScalarType::Float,
              message);
        return static_cast<const float *>(t->data_ptr());
    };
    qn = vector_of(q_norm, D, "qkv::decoder_layer: q_norm must be float32 (D,)");
    kn = vector_of(k_norm, D, "qkv::decoder_layer: k_norm must be float32 (D,)");
    freq = vector_of(inv_freq, D / 2, "qkv::decoder_layer: inv_freq must be float32 (D/2,)");
    const int64_t *pos = static_cast<const int64_t *>(positions.data_ptr());
    for (int64_t r = 0; r < M; r++)
        check(pos[r] >= 0 && pos[r] < S, "qkv::decoder_layer: a position lies outside the KV cache");

    const float *xp = static_cast<const float *>(x.data_ptr());
    std::vector<float> h(static_cast<size_t>(M * C)), proj(static_cast<size_t>(M * (Q + 2 * KV))),
        context(static_cast<size_t>(M * Q)), res(static_cast<size_t>(M * C));
    // attention
    for (int64_t r = 0; r < M; r++) normalize(n1, xp + r * C, h.data() + r * C, static_cast<float>(eps));
    apply(Lqkv, h.data(), proj.data(), M);
    float *kc = static_cast<float *>(k_cache.data_ptr()), *vc = static_cast<float *>(v_cache.data_ptr());
    int64_t *held = static_cast<int64_t *>(lengths.data_ptr());
    const Norm qnorm{qn, nullptr, D}, knorm{kn, nullptr, D};
    std::vector<float> cos_(static_cast<size_t>(D / 2)), sin_(static_cast<size_t>(D / 2)), head(static_cast<size_t>(D));
    for (int64_t r = 0; r < M; r++) {
        float *row = proj.data() + r * (Q + 2 * KV), *keys = row + Q, *values = keys + KV;
        if (freq) {
            for (int64_t i = 0; i < D / 2; i++) {
                const float angle = static_cast<float>(pos[r]) * freq[i];
                cos_[i] = cosf(angle);
                sin_[i] = sinf(angle);
            }
        }
        for (int64_t hd = 0; hd < H + Hkv; hd++) {  // query heads, then key heads
            float *vec = hd < H ? row + hd * D : keys + (hd - H) * D;
            const float *weight = hd < H ? qn : kn;
            if (weight) {
                normalize(hd < H ? qnorm : knorm, vec, head.data(), static_cast<float>(eps));
                std::copy(head.begin(), head.end(), vec);
            }
            if (freq) rotate(vec, cos_.data(), sin_.data(), D);
        }
        const int64_t c = row_of ? row_of[r] : r;
        for (int64_t g = 0; g < Hkv; g++) {
            const int64_t slot = ((c * Hkv + g) * S + pos[r]) * D;
            std::copy(keys + g * D, keys + (g + 1) * D, kc + slot);
            std::copy(values + g * D, values + (g + 1) * D, vc + slot);
        }
        held[c] = std::max(held[c], pos[r] + 1);
    }
    const int64_t group = H / Hkv;
    torch::stable::parallel_for(0, M * H, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> w(static_cast<size_t>(S));
        for (int64_t i = i0; i < i1; i++) {
            const int64_t r = i / H, hq = i % H, kv = (row_of ? row_of[r] : r) * Hkv + hq / group;
            // the keys this query may see are the slots up to its own position
            attend_one(proj.data() + r * (Q + 2 * KV) + hq * D, kc + kv * S * D, vc + kv * S * D, nullptr,
                       context.data() + r * Q + hq * D, pos[r] + 1, D, D, static_cast<float>(scale), w.data());
        }
    });
    apply(Lo, context.data(), res.data(), M);
    Tensor out = torch::stable::new_empty(x, {M, C});
    float *y = static_cast<float *>(out.data_ptr());
    for (int64_t i = 0; i < M * C; i++) y[i] = xp[i] + res[i];
    // feed-forward
    for (int64_t r = 0; r < M; r++) normalize(n2, y + r * C, h.data() + r * C, static_cast<float>(eps));
    std::vector<float> hidden(static_cast<size_t>(M * Lup.N)), act(static_cast<size_t>(M * F));
    apply(Lup, h.data(), hidden.data(), M);
    activate(activation, hidden.data(), act.data(), M, F);
    apply(Ldown, act.data(), res.data(), M);
    for (int64_t i = 0; i < M * C; i++) y[i] += res[i];
    return out;
}

}  // namespace

STABLE_TORCH_LIBRARY(qkv, m) {
    m.def("int8_linear(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
    m.def("int4_linear(Tensor x, Tensor q, Tensor d, Tensor m, Tensor? bias) -> Tensor");
    m.def("f32_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? visible, float scale) -> Tensor");
    m.def("decoder_layer(Tensor x, Tensor[] attn_norm, Tensor[] qkv, Tensor[] o, Tensor[] mlp_norm, Tensor[] up, "
          "Tensor[] down, Tensor? q_norm, Tensor? k_norm, Tensor? inv_freq, Tensor(a!) k_cache, Tensor(b!) v_cache, "
          "Tensor(c!) lengths, Tensor positions, Tensor? rows, int num_heads, int activation, float eps, float scale) "
          "-> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("int8_linear", TORCH_BOX(&int8_linear));
    m.impl("int4_linear", TORCH_BOX(&int4_linear));
    m.impl("f32_linear", TORCH_BOX(&f32_linear));
    m.impl("decode_attention", TORCH_BOX(&decode_attention));
    m.impl("decoder_layer", TORCH_BOX(&decoder_layer));
}
