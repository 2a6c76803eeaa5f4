// Block products on rounded activations: a GGUF matrix times x with integer dot products.
//
//   qkv::block_linear_q8(x (M, K) f32, blocks (N, bytes) u8, int block_type, bias (N,)?, int isa) -> (M, N)
//
// The float products (block_products.cpp) decode every weight to float32 and multiply it by
// x: about a dozen vector operations for 16 weights, so on two cores a decode step's small
// matrices run at a third of the memory's speed. Here x is first rounded as qkv's int4
// layers and llama.cpp round it (per 32 inputs: step d = max|x| / 127, codes round(x / d)),
// every weight of a row becomes an unsigned code q (0..255) with, per 16 weights, an affine
// a, b (w = a q + b, the file's own decode: Q4_K's a = d * scale, b = -dmin * min; Q8_0's
// q = stored + 128, b = -128 d), and each 16 weights contribute
//     a * d_x * sum(q * x_code) + b * d_x * sum(x_code)
// where the sums are exact integers (AVX-512 VNNI's vpdpbusd: 64 products an instruction).
// The result is the dequantized weights times the rounded activations, up to float32
// summation order; each output is computed by the same operations whatever M is (batch
// invariance), and the generic C++ variant is the reference for the AVX-512 one. qkv's layers
// (the whole-layer kernel and the modules, through qkv::block_layer_linear) run it wherever the
// active variant is AVX-512 VNNI; elsewhere they run the float products.
//
// Shape legend: M rows of x, K inputs, N outputs, S = K / 16 groups of 16 weights.
#include "kernels.h"
#include "block_kernels.h"

#include <math.h>

#include <cstring>

// GCC 12's own AVX-512 headers pass _mm512_undefined_* into masked builtins, which -Wextra
// reports as uninitialized (block_avx512.cpp says the same)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace qkv {
namespace {

enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
                      Q6_K = 14, IQ4_NL = 20 };
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

float f16(const uint8_t *p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

uint32_t u32(const uint8_t *p) {
    return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

int64_t weights_of(int64_t type) {
    return type >= Q2_K && type <= Q6_K ? 256 : 32;
}

// Q4_K / Q5_K: 8 six-bit scales and minimums from 12 bytes (gguf's get_scale_min).
void scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[4 + j] & 63;
        sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
}

// One block's affine per 16 weights: w = a[g] q + b[g] for weights 16 g .. 16 g + 15, with the
// float32 operations of the file's decode (a Q4_K block's a = d * scale as gguf computes it).
void block_affine(int64_t type, const uint8_t *blk, float *a, float *b) {
    switch (type) {
        case Q4_0: case Q5_0: case Q8_0: case IQ4_NL: {
            const float d = f16(blk), offset = type == Q4_0 ? -8.f : type == Q5_0 ? -16.f : -128.f;
            a[0] = a[1] = d;
            b[0] = b[1] = d * offset;
            return;
        }
        case Q4_1: case Q5_1:
            a[0] = a[1] = f16(blk);
            b[0] = b[1] = f16(blk + 2);
            return;
        case Q2_K: {
            const float d = f16(blk + 80), dmin = f16(blk + 82);
            for (int s = 0; s < 16; s++) {
                a[s] = d * static_cast<float>(blk[s] & 15);
                b[s] = -(dmin * static_cast<float>(blk[s] >> 4));
            }
            return;
        }
        case Q3_K: {
            const uint8_t *sc = blk + 96;
            const float d = f16(blk + 108);
            for (int s = 0; s < 16; s++) {
                const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
                a[s] = d * static_cast<float>((low | (high << 4)) - 32);
                b[s] = -4.f * a[s];
            }
            return;
        }
        case Q4_K: case Q5_K: {
            uint8_t sc[8], mn[8];
            scale_min_k4(blk + 4, sc, mn);
            const float d = f16(blk), dmin = f16(blk + 2);
            for (int j = 0; j < 8; j++) {
                a[2 * j] = a[2 * j + 1] = d * static_cast<float>(sc[j]);
                b[2 * j] = b[2 * j + 1] = -(dmin * static_cast<float>(mn[j]));
            }
            return;
        }
        case Q6_K: {
            const int8_t *sc = reinterpret_cast<const int8_t *>(blk + 192);
            const float d = f16(blk + 208);
            for (int s = 0; s < 16; s++) {
                a[s] = d * static_cast<float>(sc[s]);
                b[s] = -32.f * a[s];
            }
            return;
        }
        default: return;
    }
}

// One block's codes in weight order, in plain C++ (the reference; AVX-512 below for the common types).
void block_codes(int64_t type, const uint8_t *blk, uint8_t *q) {
    switch (type) {
        case Q4_0: case Q4_1: case IQ4_NL: {
            const uint8_t *qs = blk + (type == Q4_1 ? 4 : 2);
            for (int j = 0; j < 16; j++) {
                const int lo = qs[j] & 15, hi = qs[j] >> 4;
                q[j] = static_cast<uint8_t>(type == IQ4_NL ? IQ4_VALUES[lo] + 128 : lo);
                q[j + 16] = static_cast<uint8_t>(type == IQ4_NL ? IQ4_VALUES[hi] + 128 : hi);
            }
            return;
        }
        case Q5_0: case Q5_1: {
            const uint8_t *qh = blk + (type == Q5_1 ? 4 : 2), *qs = qh + 4;
            const uint32_t high = u32(qh);
            for (int j = 0; j < 16; j++) {
                q[j] = static_cast<uint8_t>((qs[j] & 15) | (((high >> j) & 1) << 4));
                q[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4));
            }
            return;
        }
        case Q8_0:
            for (int j = 0; j < 32; j++) q[j] = static_cast<uint8_t>(blk[2 + j] ^ 0x80);  // stored + 128
            return;
        case Q2_K: case Q3_K: {
            const uint8_t *qs = blk + (type == Q2_K ? 16 : 32);
            for (int w = 0; w < 256; w++) {  // w = 128 h + 32 t + r
                const int h = w / 128, t = (w / 32) % 4, r = w % 32;
                int code = (qs[32 * h + r] >> (2 * t)) & 3;
                if (type == Q3_K) code += 4 * ((blk[r] >> (w / 32)) & 1);  // q + 4 = low + 4 * hbit
                q[w] = static_cast<uint8_t>(code);
            }
            return;
        }
        case Q4_K: case Q5_K: {
            const bool five = type == Q5_K;
            const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
            for (int j = 0; j < 8; j++)
                for (int i = 0; i < 32; i++) {
                    int v = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
                    if (five) v |= ((qh[i] >> j) & 1) << 4;
                    q[32 * j + i] = static_cast<uint8_t>(v);
                }
            return;
        }
        case Q6_K: {
            const uint8_t *ql = blk, *qh = blk + 128;
            for (int w = 0; w < 256; w++) {
                const int h = w / 128, t = (w / 32) % 4, r = w % 32;
                const int low = (ql[64 * h + 32 * (t % 2) + r] >> (4 * (t / 2))) & 15;
                q[w] = static_cast<uint8_t>(low | (((qh[32 * h + r] >> (2 * t)) & 3) << 4));
            }
            return;
        }
        default: return;
    }
}

// x's rounding, once a call: codes (M, K), the step per 16 inputs (M, S) and the codes' sums (M, S).
struct Rounded {
    std::vector<int8_t> q;
    std::vector<float> step, sum;  // per 16 inputs
    std::vector<float> step32, scaled_sum32;  // per 32: the step, and step * sum(codes)
    std::vector<int32_t> sum4;  // per 4 inputs: the codes' sum (what a constant code offset subtracts)
};

Rounded round_x(const float *x, int64_t M, int64_t K, bool simd) {
    const int64_t G = K / BLOCK, S = K / 16;
    Rounded r;
    r.q.resize(static_cast<size_t>(M * K));
    r.step.resize(static_cast<size_t>(M * S));
    r.sum.resize(static_cast<size_t>(M * S));
    std::vector<float> d(static_cast<size_t>(M * G)), dsum(static_cast<size_t>(M * G));
#if QKV_X86
    if (simd) avx2_round_activations(x, r.q.data(), d.data(), dsum.data(), M * G);
    else
#endif
        generic_round_activations(x, r.q.data(), d.data(), dsum.data(), M * G);
    (void)simd;
    for (int64_t i = 0; i < M * S; i++) {
        int32_t total = 0;
        for (int64_t j = 0; j < 16; j++) total += r.q[i * 16 + j];
        r.step[i] = d[i / 2];
        r.sum[i] = static_cast<float>(total);
    }
    r.step32 = d;
    r.scaled_sum32 = dsum;
    r.sum4.resize(static_cast<size_t>(M * K / 4));
    for (int64_t i = 0; i < M * K / 4; i++)
        r.sum4[i] = r.q[4 * i] + r.q[4 * i + 1] + r.q[4 * i + 2] + r.q[4 * i + 3];
    return r;
}

// One output: sum over groups g of a[g] step[g] dot(q, xq)_g + b[g] step[g] sum(xq)_g.
float dot_generic(const uint8_t *codes, const float *a, const float *b, const int8_t *xq, const float *step,
                  const float *sum, int64_t K) {
    float main = 0.f, offset = 0.f;
    for (int64_t g = 0; g < K / 16; g++) {
        int32_t dot = 0;  // exact: |dot| <= 16 * 255 * 127
        for (int64_t j = 0; j < 16; j++) dot += codes[16 * g + j] * xq[16 * g + j];
        main += (a[g] * step[g]) * static_cast<float>(dot);
        offset += (b[g] * step[g]) * sum[g];
    }
    return main + offset;
}

#if QKV_X86
// Codes of one row for the common types with AVX-512BW; others block by block in plain C++.
QKV_AVX512 void row_codes_avx512(int64_t type, const uint8_t *row, int64_t K, int64_t bytes, uint8_t *q) {
    const int64_t W = weights_of(type), blocks = K / W;
    const __m128i low4 = _mm_set1_epi8(15);
    const __m256i low4y = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *blk = row + i * bytes;
        uint8_t *out = q + i * W;
        switch (type) {
            case Q4_0: case Q4_1: case IQ4_NL: case Q5_0: case Q5_1: {
                const bool five = type == Q5_0 || type == Q5_1;
                const uint8_t *qs = blk + (type == Q4_1 ? 4 : type == Q5_0 ? 6 : type == Q5_1 ? 8 : 2);
                const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
                __m128i lo = _mm_and_si128(packed, low4), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
                if (type == IQ4_NL) {
                    alignas(16) uint8_t table[16];
                    for (int j = 0; j < 16; j++) table[j] = static_cast<uint8_t>(IQ4_VALUES[j] + 128);
                    const __m128i t = _mm_load_si128(reinterpret_cast<const __m128i *>(table));
                    lo = _mm_shuffle_epi8(t, lo);
                    hi = _mm_shuffle_epi8(t, hi);
                } else if (five) {  // the fifth bit of weight j is bit j of qh
                    const uint32_t high = u32(blk + (type == Q5_1 ? 4 : 2));
                    lo = _mm_or_si128(lo, _mm_maskz_mov_epi8(static_cast<__mmask16>(high & 0xFFFF), _mm_set1_epi8(16)));
                    hi = _mm_or_si128(hi, _mm_maskz_mov_epi8(static_cast<__mmask16>(high >> 16), _mm_set1_epi8(16)));
                }
                _mm_storeu_si128(reinterpret_cast<__m128i *>(out), lo);
                _mm_storeu_si128(reinterpret_cast<__m128i *>(out + 16), hi);
                break;
            }
            case Q8_0: {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 2));
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), _mm256_xor_si256(v, _mm256_set1_epi8(-128)));
                break;
            }
            case Q4_K: case Q5_K: {
                const bool five = type == Q5_K;
                const uint8_t *qs = blk + (five ? 48 : 16);
                const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16));
                for (int c = 0; c < 4; c++) {  // 64 weights: sub 2c from the low nibbles, 2c + 1 from the high
                    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * c));
                    __m256i lo = _mm256_and_si256(v, low4y), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4y);
                    if (five) {
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c + 1)), one), 4));
                    }
                    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 64 * c), lo);
                    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 64 * c + 32), hi);
                }
                break;
            }
            case Q6_K: {  // weights 128 h + 32 t + r; t = 2u from ql[64 h + r], t = 2u + 1 from ql[64 h + 32 + r]
                for (int h = 0; h < 2; h++) {
                    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * h));
                    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * h + 32));
                    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 128 + 32 * h));
                    for (int u = 0; u < 2; u++) {
                        const __m128i nib = _mm_cvtsi32_si128(4 * u), two = _mm_cvtsi32_si128(4 * u + 2);
                        const __m256i a = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi16(l0, nib), low4y),
                                                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, nib), three), 4));
                        const __m256i b = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi16(l1, nib), low4y),
                                                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, two), three), 4));
                        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 128 * h + 64 * u), a);
                        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 128 * h + 64 * u + 32), b);
                    }
                }
                break;
            }
            default: block_codes(type, blk, out); break;
        }
    }
}

// The same sum as dot_generic, 64 weights a step: vpdpbusd's lane l holds weights 4l .. 4l + 3,
// so lanes 4g' .. 4g' + 3 are group g' of the step, scaled by a[g] step[g] in float32.
QKV_AVX512 float dot_avx512(const uint8_t *codes, const float *scale, const float *offset, const int8_t *xq,
                            const float *sum, int64_t K) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const __m512i w = _mm512_loadu_si512(codes + k), x = _mm512_loadu_si512(xq + k);
        const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
        const __m512 s = _mm512_permutexvar_ps(spread, _mm512_zextps128_ps512(_mm_loadu_ps(scale + k / 16)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), s, acc);
    }
    if (k < K) {  // 32 weights left: two groups
        const __mmask64 half = 0xFFFFFFFFull;
        const __m512i w = _mm512_maskz_loadu_epi8(half, codes + k), x = _mm512_maskz_loadu_epi8(half, xq + k);
        const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
        const __m512 s = _mm512_permutexvar_ps(spread, _mm512_zextps128_ps512(
                                                           _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double *>(scale + k / 16)))));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), s, acc);
    }
    float tail = 0.f;
    for (int64_t g = 0; g < K / 16; g++) tail += offset[g] * sum[g];
    return _mm512_reduce_add_ps(acc) + tail;
}
#endif

#if QKV_X86
// One output of the common types with the codes made in registers, the affine folded in: a
// block's offset (-c d for a constant code offset c: Q4_0 8, Q5_0 16, Q8_0 and IQ4_NL 128; or
// a minimum: Q4_1, Q5_1, Q4_K, Q5_K) is added as offset * step * sum(codes) per 32, and Q6_K's
// c = 32 is subtracted from the integer sums as c times the activations' 4-sums.
QKV_AVX512 inline float half_avx(const uint8_t *p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

QKV_AVX512 inline __m512 two_scales(float lo, float hi) {  // lanes 0-7 lo, 8-15 hi
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(lo)), _mm256_castps_pd(_mm256_set1_ps(hi)), 1));
}

template <int64_t T>
QKV_AVX512 __m128i codes32_avx512(const uint8_t *blk, __m128i &hi) {  // a 32-weight block's codes: [lo | hi]
    const __m128i low4 = _mm_set1_epi8(15);
    const uint8_t *qs = blk + (T == Q4_1 ? 4 : T == Q5_0 ? 6 : T == Q5_1 ? 8 : 2);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
    __m128i lo = _mm_and_si128(packed, low4);
    hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
    if constexpr (T == IQ4_NL) {
        const __m128i table = _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75, -59, -39, -15);
        lo = _mm_shuffle_epi8(table, lo);  // IQ4_VALUES + 128 as bytes
        hi = _mm_shuffle_epi8(table, hi);
    } else if constexpr (T == Q5_0 || T == Q5_1) {
        const uint32_t high = u32(blk + (T == Q5_1 ? 4 : 2));
        lo = _mm_or_si128(lo, _mm_maskz_mov_epi8(static_cast<__mmask16>(high & 0xFFFF), _mm_set1_epi8(16)));
        hi = _mm_or_si128(hi, _mm_maskz_mov_epi8(static_cast<__mmask16>(high >> 16), _mm_set1_epi8(16)));
    }
    return lo;
}

// NR rows of blocks (row, row + row_bytes, ...) against R rows of x (m0 .. m0 + R - 1): out[q R + r].
// The codes of a row of blocks are made once for its R rows of x, and each output runs the same
// operations whatever NR and R are (batch invariance); NR > 1 interleaves independent rows for
// the core's parallelism.
template <int64_t T, int NR, int R>
QKV_AVX512 void fused32(const uint8_t *row, int64_t row_bytes, int64_t bytes, const Rounded &x, int64_t m0, int64_t K,
                        float *out) {
    // w = d q + b per block: b = -c d for a constant code offset c, the stored minimum for Q4_1/Q5_1;
    // b * step * sum(codes) is added per block in float32
    constexpr float c = T == Q4_0 ? 8.f : T == Q5_0 ? 16.f : (T == Q8_0 || T == IQ4_NL) ? 128.f : 0.f;
    constexpr bool minimum = T == Q4_1 || T == Q5_1;
    const int64_t G = K / 32;
    const int8_t *xq[R];
    const float *step32[R], *scaled_sum32[R];
    __m512 acc[NR][R], off16[NR][R];
    float off0[NR][R], off1[NR][R];
    for (int r = 0; r < R; r++) {
        xq[r] = x.q.data() + (m0 + r) * K;
        step32[r] = x.step32.data() + (m0 + r) * G;
        scaled_sum32[r] = x.scaled_sum32.data() + (m0 + r) * G;
        for (int q = 0; q < NR; q++) {
            acc[q][r] = off16[q][r] = _mm512_setzero_ps();
            off0[q][r] = off1[q][r] = 0.f;
        }
    }
    // 16 blocks at a time: their scales (and minimums) gathered and converted at once, the offsets
    // summed in a vector; each pair's two scales spread from those 16
    const __m512i starts = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int>(bytes)));
    const __m512i pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    int64_t g = 0;
    for (; g + 16 <= G; g += 16) {
        __m512 scale[NR][R];
        for (int q = 0; q < NR; q++) {
            const __m512i head = _mm512_i32gather_epi32(starts, row + q * row_bytes + g * bytes, 1);  // d (and m)
            const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
            const __m512 b = minimum ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)))
                                     : _mm512_mul_ps(d, _mm512_set1_ps(-c));
            for (int r = 0; r < R; r++) {
                scale[q][r] = _mm512_mul_ps(d, _mm512_loadu_ps(step32[r] + g));
                off16[q][r] = _mm512_fmadd_ps(b, _mm512_loadu_ps(scaled_sum32[r] + g), off16[q][r]);
            }
        }
        for (int p = 0; p < 8; p++) {
            const __m512i lanes = _mm512_add_epi32(pair_lanes, _mm512_set1_epi32(2 * p));
            for (int q = 0; q < NR; q++) {
                const uint8_t *b0 = row + q * row_bytes + (g + 2 * p) * bytes, *b1 = b0 + bytes;
                __m512i w;
                if constexpr (T == Q8_0) {
                    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b0 + 2));
                    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b1 + 2));
                    w = _mm512_xor_si512(_mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1), _mm512_set1_epi8(-128));
                } else {
                    __m128i h0, h1;
                    const __m128i l0 = codes32_avx512<T>(b0, h0), l1 = codes32_avx512<T>(b1, h1);
                    w = _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_set_m128i(h0, l0)), _mm256_set_m128i(h1, l1), 1);
                }
                for (int r = 0; r < R; r++) {
                    const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                                             _mm512_loadu_si512(xq[r] + 32 * (g + 2 * p)));
                    acc[q][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_permutexvar_ps(lanes, scale[q][r]), acc[q][r]);
                }
            }
        }
    }
    for (; g < G; g += 2) {
        const bool pair = g + 1 < G;
        const __mmask64 take = pair ? ~0ull : 0xFFFFFFFFull;
        for (int q = 0; q < NR; q++) {
            const uint8_t *b0 = row + q * row_bytes + g * bytes, *b1 = pair ? b0 + bytes : b0;
            __m512i w;
            if constexpr (T == Q8_0) {
                const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b0 + 2));
                const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b1 + 2));
                w = _mm512_xor_si512(_mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1), _mm512_set1_epi8(-128));
            } else {
                __m128i h0, h1;
                const __m128i l0 = codes32_avx512<T>(b0, h0), l1 = codes32_avx512<T>(b1, h1);
                w = _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_set_m128i(h0, l0)), _mm256_set_m128i(h1, l1), 1);
            }
            const float d0 = half_avx(b0), d1 = pair ? half_avx(b1) : 0.f;
            float m0v, m1v;
            if constexpr (minimum) {
                m0v = half_avx(b0 + 2);
                m1v = pair ? half_avx(b1 + 2) : 0.f;
            } else {
                m0v = -c * d0;  // exact: c is a power of two
                m1v = -c * d1;
            }
            for (int r = 0; r < R; r++) {
                const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_maskz_loadu_epi8(take, xq[r] + 32 * g));
                acc[q][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots),
                                            two_scales(d0 * step32[r][g], pair ? d1 * step32[r][g + 1] : 0.f), acc[q][r]);
                off0[q][r] += m0v * scaled_sum32[r][g];
                if (pair) off1[q][r] += m1v * scaled_sum32[r][g + 1];
            }
        }
    }
    for (int q = 0; q < NR; q++)
        for (int r = 0; r < R; r++)
            out[q * R + r] = _mm512_reduce_add_ps(acc[q][r]) + (_mm512_reduce_add_ps(off16[q][r]) + (off0[q][r] + off1[q][r]));
}

template <int64_t T, int NR, int R>
QKV_AVX512 void fused256(const uint8_t *row, int64_t row_bytes, int64_t bytes, const Rounded &x, int64_t m0, int64_t K,
                         float *out) {
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int64_t G = K / 32;
    const int8_t *xq[R];
    const float *step32[R], *scaled_sum32[R];
    const int32_t *sum4[R];
    __m512 acc[NR][R];
    __m256 off[NR][R];
    for (int r = 0; r < R; r++) {
        xq[r] = x.q.data() + (m0 + r) * K;
        step32[r] = x.step32.data() + (m0 + r) * G;
        scaled_sum32[r] = x.scaled_sum32.data() + (m0 + r) * G;
        sum4[r] = x.sum4.data() + (m0 + r) * (K / 4);
        for (int q = 0; q < NR; q++) {
            acc[q][r] = _mm512_setzero_ps();
            off[q][r] = _mm256_setzero_ps();
        }
    }
    for (int64_t i = 0; i < K / 256; i++) {
        for (int q = 0; q < NR; q++) {
            const uint8_t *blk = row + q * row_bytes + i * bytes;
            if constexpr (T == Q4_K || T == Q5_K) {
                uint8_t sc[8], mn[8];
                scale_min_k4(blk + 4, sc, mn);
                const float d = half_avx(blk), dmin = half_avx(blk + 2);
                const uint8_t *qs = blk + (T == Q5_K ? 48 : 16);
                const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16));
                for (int c = 0; c < 4; c++) {
                    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * c));
                    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    if constexpr (T == Q5_K) {
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c + 1)), one), 4));
                    }
                    const __m512i w = _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
                    const float a0 = d * static_cast<float>(sc[2 * c]), a1 = d * static_cast<float>(sc[2 * c + 1]);
                    for (int r = 0; r < R; r++) {
                        const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xq[r] + 256 * i + 64 * c));
                        const float *st = step32[r] + 8 * i;
                        acc[q][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), two_scales(a0 * st[2 * c], a1 * st[2 * c + 1]), acc[q][r]);
                    }
                }
                uint64_t mins;
                std::memcpy(&mins, mn, sizeof mins);
                const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(mins))));
                for (int r = 0; r < R; r++)
                    off[q][r] = _mm256_fmadd_ps(_mm256_mul_ps(m, _mm256_loadu_ps(scaled_sum32[r] + 8 * i)), _mm256_set1_ps(-dmin), off[q][r]);
            } else {  // Q6_K: codes 0..63, c = 32, a scale per 16 weights
                const float d = half_avx(blk + 208);
                const uint8_t *sc = blk + 192;
                for (int h = 0; h < 2; h++) {
                    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * h));
                    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * h + 32));
                    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 128 + 32 * h));
                    for (int u = 0; u < 2; u++) {
                        const __m128i nib = _mm_cvtsi32_si128(4 * u), two = _mm_cvtsi32_si128(4 * u + 2);
                        const __m256i a = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi16(l0, nib), low4),
                                                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, nib), three), 4));
                        const __m256i b = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi16(l1, nib), low4),
                                                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, two), three), 4));
                        const int at = 128 * h + 64 * u, g0 = at / 16;  // the 64 weights' first; groups g0 .. g0 + 3 of 16
                        const __m512i w = _mm512_inserti64x4(_mm512_zextsi256_si512(a), b, 1);
                        const __m128 s4 = _mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(_mm_cvtepi8_epi32(
                                                                         _mm_cvtsi32_si128(static_cast<int>(u32(sc + g0))))));
                        for (int r = 0; r < R; r++) {
                            __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xq[r] + 256 * i + at));
                            dots = _mm512_sub_epi32(dots, _mm512_slli_epi32(_mm512_loadu_si512(sum4[r] + (256 * i + at) / 4), 5));
                            const float *st = step32[r] + 8 * i;
                            const __m128 scale = _mm_mul_ps(s4, _mm_setr_ps(st[g0 / 2], st[g0 / 2], st[g0 / 2 + 1], st[g0 / 2 + 1]));
                            acc[q][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots),
                                                        _mm512_permutexvar_ps(spread, _mm512_zextps128_ps512(scale)), acc[q][r]);
                        }
                    }
                }
            }
        }
    }
    (void)scaled_sum32;
    for (int q = 0; q < NR; q++)
        for (int r = 0; r < R; r++) out[q * R + r] = _mm512_reduce_add_ps(acc[q][r]) + hsum(off[q][r]);
}

using Fused = void (*)(const uint8_t *, int64_t, int64_t, const Rounded &, int64_t, int64_t, float *);
constexpr int TILE = 4;  // rows of x a row of blocks is decoded for at once
constexpr int WEIGHT_ROWS = 4;  // rows of blocks interleaved for one row of x (a decode step)

template <int64_t T, int NR>
Fused fused_rows(int rows) {
    constexpr bool big = T == Q4_K || T == Q5_K || T == Q6_K;
    switch (rows) {
        case 1: return big ? fused256<T, NR, 1> : fused32<T, NR, 1>;
        case 2: return big ? fused256<T, 1, 2> : fused32<T, 1, 2>;
        case 3: return big ? fused256<T, 1, 3> : fused32<T, 1, 3>;
        default: return big ? fused256<T, 1, 4> : fused32<T, 1, 4>;
    }
}

// The kernel for `rows` rows of x (1..TILE) and `weight_rows` rows of blocks (1, or
// WEIGHT_ROWS with one row of x); nullptr for a type without one.
Fused fused_for(int64_t type, int rows, bool weight_rows = false) {
    // measured: interleaving rows of K-quant super-blocks gains (Q6_K 1.05x); rows of 32-blocks,
    // whose scales are gathered, lose on a streamed matrix (a 262,144-row Q8_0 head: 2.4x slower)
    const bool many = weight_rows && rows == 1 && (type == Q4_K || type == Q5_K || type == Q6_K);
    switch (type) {
        case Q4_0: return many ? fused_rows<Q4_0, WEIGHT_ROWS>(1) : fused_rows<Q4_0, 1>(rows);
        case Q4_1: return many ? fused_rows<Q4_1, WEIGHT_ROWS>(1) : fused_rows<Q4_1, 1>(rows);
        case Q5_0: return many ? fused_rows<Q5_0, WEIGHT_ROWS>(1) : fused_rows<Q5_0, 1>(rows);
        case Q5_1: return many ? fused_rows<Q5_1, WEIGHT_ROWS>(1) : fused_rows<Q5_1, 1>(rows);
        case Q8_0: return many ? fused_rows<Q8_0, WEIGHT_ROWS>(1) : fused_rows<Q8_0, 1>(rows);
        case IQ4_NL: return many ? fused_rows<IQ4_NL, WEIGHT_ROWS>(1) : fused_rows<IQ4_NL, 1>(rows);
        case Q4_K: return many ? fused_rows<Q4_K, WEIGHT_ROWS>(1) : fused_rows<Q4_K, 1>(rows);
        case Q5_K: return many ? fused_rows<Q5_K, WEIGHT_ROWS>(1) : fused_rows<Q5_K, 1>(rows);
        case Q6_K: return many ? fused_rows<Q6_K, WEIGHT_ROWS>(1) : fused_rows<Q6_K, 1>(rows);
        default: return nullptr;
    }
}
#endif

// Outputs [n0, n1) of y (leading dimension ldy) from one matrix's rows of blocks.
void q8_rows(int64_t type, const uint8_t *blocks, int64_t row_bytes, const Rounded &x, int64_t M, int64_t K,
             int64_t ldy, int64_t n0, int64_t n1, const float *bias, bool simd, float *y) {
    const int64_t W = weights_of(type), per = W / 16, S = K / 16, bytes = row_bytes / (K / W);
    std::vector<uint8_t> codes(static_cast<size_t>(K));
    std::vector<float> a(static_cast<size_t>(S)), b(static_cast<size_t>(S)), scale(static_cast<size_t>(S + 4)),
        offset(static_cast<size_t>(S));
#if QKV_X86
    if (simd && fused_for(type, 1) != nullptr) {  // the common types: codes in registers (file comment)
        float out[WEIGHT_ROWS * TILE];
        int64_t n = n0;
        const Fused many = fused_for(type, 1, true);
        if (M == 1 && many != fused_for(type, 1))  // a decode step: WEIGHT_ROWS rows of blocks at a time
            for (; n + WEIGHT_ROWS <= n1; n += WEIGHT_ROWS) {
                many(blocks + n * row_bytes, row_bytes, bytes, x, 0, K, out);
                for (int q = 0; q < WEIGHT_ROWS; q++) y[n + q] = bias ? out[q] + bias[n + q] : out[q];
            }
        for (; n < n1; n++)
            for (int64_t m = 0; m < M; m += TILE) {
                const int rows = static_cast<int>(std::min<int64_t>(TILE, M - m));
                fused_for(type, rows)(blocks + n * row_bytes, row_bytes, bytes, x, m, K, out);
                for (int r = 0; r < rows; r++) y[(m + r) * ldy + n] = bias ? out[r] + bias[n] : out[r];
            }
        return;
    }
#endif
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = blocks + n * row_bytes;
        for (int64_t i = 0; i < K / W; i++) block_affine(type, row + i * bytes, a.data() + i * per, b.data() + i * per);
#if QKV_X86
        if (simd) row_codes_avx512(type, row, K, bytes, codes.data());
        else
#endif
            for (int64_t i = 0; i < K / W; i++) block_codes(type, row + i * bytes, codes.data() + i * W);
        for (int64_t m = 0; m < M; m++) {
            const float *step = x.step.data() + m * S, *sum = x.sum.data() + m * S;
            const int8_t *xq = x.q.data() + m * K;
            float total;
#if QKV_X86
            if (simd) {
                for (int64_t g = 0; g < S; g++) {
                    scale[g] = a[g] * step[g];
                    offset[g] = b[g] * step[g];
                }
                total = dot_avx512(codes.data(), scale.data(), offset.data(), xq, sum, K);
            } else
#endif
                total = dot_generic(codes.data(), a.data(), b.data(), xq, step, sum, K);
            y[m * ldy + n] = bias ? total + bias[n] : total;
        }
    }
}

}  // namespace

bool q8_products_run(const Linear &L) {
    if (active_variant() < AVX512 || L.K % 32) return false;
    for (int64_t p = 0; p < L.part_count; p++)
        if (L.K % weights_of(L.parts[p].type)) return false;
    return true;
}

void apply_blocks_q8(const Linear &L, const float *x, float *y, int64_t M, bool simd) {
    const Rounded rounded = round_x(x, M, L.K, simd);
    const int64_t N = L.N, threads = std::max<int64_t>(1, torch::stable::get_num_threads());
    const int64_t chunk = std::max<int64_t>({1, N / (4 * threads), (int64_t{1} << 16) / L.K});
    torch::stable::parallel_for(0, N, chunk, [&](int64_t n0, int64_t n1) {
        int64_t first = 0;  // the stacked output where part p begins
        for (int64_t p = 0; p < L.part_count; p++) {
            const BlockPart &part = L.parts[p];
            const int64_t a = std::max(n0, first), b = std::min(n1, first + part.rows);
            if (a < b)
                q8_rows(part.type, part.blocks, part.row_bytes, rounded, M, L.K, N, a - first, b - first,
                        L.bias ? L.bias + first : nullptr, simd, y + first);
            first += part.rows;
        }
    });
}

namespace {

using torch::headeronly::ScalarType;

// The op, for tests and the self-test: isa 1 generic, 3 AVX-512 (VNNI), 0 the best of those.
Tensor block_linear_q8(Tensor x, Tensor blocks, int64_t block_type, std::optional<Tensor> bias, int64_t isa) {
    check(x.dim() == 2 && x.scalar_type() == ScalarType::Float && x.is_contiguous(),
          "qkv::block_linear_q8: x must be a contiguous float32 matrix (M, K)");
    const int64_t M = x.size(0), K = x.size(1);
    const bool simd = isa == 0 ? best_variant() >= AVX512 : isa == 3;
    check(isa == 0 || isa == 1 || (isa == 3 && best_variant() >= AVX512),
          "qkv::block_linear_q8: isa must be 0 (best), 1 (generic) or 3 (AVX-512 VNNI, where the CPU has it)");
    const int64_t row_bytes = block_kernels::row_bytes_of(block_type, K);
    check(row_bytes > 0 && K % 32 == 0, "qkv::block_linear_q8: K must be whole blocks of a block type this kernel reads");
    check(blocks.dim() == 2 && blocks.scalar_type() == ScalarType::Byte && blocks.is_contiguous() &&
              blocks.size(1) == row_bytes,
          "qkv::block_linear_q8: blocks must be contiguous uint8 (N, K / W * Z) for x's K");
    Linear L{Linear::BLOCKS};
    L.K = K;
    L.N = blocks.size(0);
    L.part_count = 1;
    L.parts[0] = BlockPart{block_type, L.N, row_bytes, static_cast<const uint8_t *>(blocks.data_ptr())};
    if (bias.has_value()) {
        check(bias->dim() == 1 && bias->size(0) == L.N && bias->is_contiguous() && bias->scalar_type() == ScalarType::Float,
              "qkv::block_linear_q8: bias must be a contiguous float32 vector (N,)");
        L.bias = static_cast<const float *>(bias->data_ptr());
    }
    Tensor out = torch::stable::new_empty(x, {M, L.N});
    apply_blocks_q8(L, static_cast<const float *>(x.data_ptr()), static_cast<float *>(out.data_ptr()), M, simd);
    return out;
}

// What a block layer of qkv's whole-layer kernel computes (products.cpp's `apply` on a BLOCKS
// Linear): the rounded-activation product where the active variant is AVX-512 VNNI, else the
// float product. The modules call this, so a layer gives the same numbers either way.
Tensor block_layer_linear(Tensor x, Tensor blocks, int64_t block_type, std::optional<Tensor> bias) {
    check(x.dim() == 2 && x.scalar_type() == ScalarType::Float && x.is_contiguous(),
          "qkv::block_layer_linear: x must be a contiguous float32 matrix (M, K)");
    const int64_t M = x.size(0), K = x.size(1), row_bytes = block_kernels::row_bytes_of(block_type, K);
    check(row_bytes > 0 && blocks.dim() == 2 && blocks.scalar_type() == ScalarType::Byte && blocks.is_contiguous() &&
              blocks.size(1) == row_bytes,
          "qkv::block_layer_linear: blocks must be contiguous uint8 (N, K / W * Z) of a block type for x's K");
    Linear L{Linear::BLOCKS};
    L.K = K;
    L.N = blocks.size(0);
    L.part_count = 1;
    L.parts[0] = BlockPart{block_type, L.N, row_bytes, static_cast<const uint8_t *>(blocks.data_ptr())};
    if (bias.has_value()) {
        check(bias->dim() == 1 && bias->size(0) == L.N && bias->is_contiguous() && bias->scalar_type() == ScalarType::Float,
              "qkv::block_layer_linear: bias must be a contiguous float32 vector (N,)");
        L.bias = static_cast<const float *>(bias->data_ptr());
    }
    Tensor out = torch::stable::new_empty(x, {M, L.N});
    apply(L, static_cast<const float *>(x.data_ptr()), static_cast<float *>(out.data_ptr()), M);
    return out;
}

}  // namespace
}  // namespace qkv

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("block_linear_q8(Tensor x, Tensor blocks, int block_type, Tensor? bias, int isa) -> Tensor");
    m.def("block_layer_linear(Tensor x, Tensor blocks, int block_type, Tensor? bias) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("block_linear_q8", TORCH_BOX(&qkv::block_linear_q8));
    m.impl("block_layer_linear", TORCH_BOX(&qkv::block_layer_linear));
}
