// The AVX-512 VNNI kernels of the products on rounded activations (block_q8.cpp says what they
// compute): vpdpbusd multiplies 64 unsigned weight codes by 64 signed activation codes an
// instruction, into 16 lanes of 4 products each.
#include "block_q8.h"

#if QKV_X86
// GCC 12's own AVX-512 headers pass _mm512_undefined_* into masked builtins, which -Wextra
// reports as uninitialized (block_avx512.cpp says the same)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace qkv {
namespace q8 {

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

// Two 32-weight blocks' 64 codes in weight order (Q8_0: stored + 128).
template <int64_t T>
QKV_AVX512 inline __m512i pair_codes(const uint8_t *b0, const uint8_t *b1) {
    if constexpr (T == Q8_0) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b0 + 2));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b1 + 2));
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1), _mm512_set1_epi8(-128));
    } else {
        __m128i h0, h1;
        const __m128i l0 = codes32_avx512<T>(b0, h0), l1 = codes32_avx512<T>(b1, h1);
        return _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_set_m128i(h0, l0)), _mm256_set_m128i(h1, l1), 1);
    }
}

// NR rows of blocks (row, row + row_bytes, ...) against R rows of x (m0 .. m0 + R - 1): out[q R + r].
// The codes of a row of blocks are made once for its R rows of x, and each output runs the same
// operations whatever NR and R are (batch invariance); NR > 1 interleaves independent rows for
// the core's parallelism.
template <int64_t T, int NR, int R>
QKV_AVX512 void in_registers32(const uint8_t *row, int64_t row_bytes, int64_t bytes, const Rounded &x, int64_t m0, int64_t K,
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
                const __m512i w = pair_codes<T>(b0, b1);
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
            const __m512i w = pair_codes<T>(b0, b1);
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
QKV_AVX512 void in_registers256(const uint8_t *row, int64_t row_bytes, int64_t bytes, const Rounded &x, int64_t m0, int64_t K,
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

template <int64_t T>
InRegisters in_registers_rows(int rows) {
    constexpr bool big = T == Q4_K || T == Q5_K || T == Q6_K;
    switch (rows) {
        case 1: return big ? in_registers256<T, 1, 1> : in_registers32<T, 1, 1>;
        case 2: return big ? in_registers256<T, 1, 2> : in_registers32<T, 1, 2>;
        case 3: return big ? in_registers256<T, 1, 3> : in_registers32<T, 1, 3>;
        default: return big ? in_registers256<T, 1, 4> : in_registers32<T, 1, 4>;
    }
}

InRegisters in_registers_for(int64_t type, int rows) {
    switch (type) {
        case Q4_0: return in_registers_rows<Q4_0>(rows);
        case Q4_1: return in_registers_rows<Q4_1>(rows);
        case Q5_0: return in_registers_rows<Q5_0>(rows);
        case Q5_1: return in_registers_rows<Q5_1>(rows);
        case Q8_0: return in_registers_rows<Q8_0>(rows);
        case IQ4_NL: return in_registers_rows<IQ4_NL>(rows);
        case Q4_K: return in_registers_rows<Q4_K>(rows);
        case Q5_K: return in_registers_rows<Q5_K>(rows);
        case Q6_K: return in_registers_rows<Q6_K>(rows);
        default: return nullptr;
    }
}

InRegisters interleaved_for(int64_t type) {
    // measured: interleaving rows of K-quant super-blocks gains (Q6_K 1.05x); rows of 32-blocks,
    // whose scales are gathered, lose on a streamed matrix (a 262,144-row Q8_0 head: 2.4x slower)
    switch (type) {
        case Q4_K: return in_registers256<Q4_K, WEIGHT_ROWS, 1>;
        case Q5_K: return in_registers256<Q5_K, WEIGHT_ROWS, 1>;
        case Q6_K: return in_registers256<Q6_K, WEIGHT_ROWS, 1>;
        default: return nullptr;
    }
}

}  // namespace q8
}  // namespace qkv
#endif
