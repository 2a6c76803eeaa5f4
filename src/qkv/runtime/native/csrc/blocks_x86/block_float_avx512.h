// The AVX-512 variant's F16 / BF16 products: block_x86.h's rows_float in zmm, and the prompt
// tile over a band of float32 activation rows laid out chunk by chunk once a product. A part of
// block_avx512.cpp in a file of its own, which it includes inside its target region, after its
// helpers and before its table of tiles by type (include block_avx512.cpp).
//
// Shape legend: NR weight rows n a tile; MR activation rows m a pass; a chunk of FLOAT_CHUNK
// inputs k; h < 2 the half of each 32 inputs a zmm sum takes.
#pragma once

namespace qkv {
namespace blocks {
namespace {  // block_avx512.cpp's own, compiled for AVX-512

// -- F16 / BF16 (block_x86.h's rows_float in zmm: A = a0 | a1, B = a2 | a3, the same lanes'
// operations, so the same bits) -------------------------------------------------------------
template <int64_t T>
inline __m512 widen16(const uint16_t *w) {  // 16 weights as float32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w));
    if constexpr (T == F16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline float wide_float_total(const __m512 *a) {  // float_total's (a0 + a1) + (a2 + a3)
    const __m256 a01 = _mm256_add_ps(_mm512_castps512_ps256(a[0]), _mm512_extractf32x8_ps(a[0], 1));
    const __m256 a23 = _mm256_add_ps(_mm512_castps512_ps256(a[1]), _mm512_extractf32x8_ps(a[1], 1));
    return hsum(_mm256_add_ps(a01, a23));
}

template <int64_t T, int NR>
void wide_rows_float(const uint8_t *row, int64_t row_bytes, const XRow &x, int64_t K, float *out) {
    __m512 a[NR][2];
    for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32)
        for (int h = 0; h < 2; h++) {
            const __m512 xv = _mm512_loadu_ps(x.x + k + 16 * h);
            for (int r = 0; r < NR; r++) {
                const uint16_t *w = reinterpret_cast<const uint16_t *>(row + r * row_bytes);
                a[r][h] = _mm512_fmadd_ps(widen16<T>(w + k + 16 * h), xv, a[r][h]);
            }
        }
    for (int r = 0; r < NR; r++) out[r] = wide_float_total(a[r]);
}

template <int64_t T>
float wide_dot_float(const uint8_t *row, const XRow &x, int64_t K) {
    float out;
    wide_rows_float<T, 1>(row, 0, x, K, &out);
    return out;
}

constexpr int WIDE_ROWS_FLOAT = 4;  // weight rows a tile of F16 / BF16
// Activation rows a pass: MR x NR = 16 sums in registers, MR + NR loads a 16 fused multiply-adds
// (one activation row at a time took 2 + NR loads for NR: load-bound, 0.6x ggml's at 512 rows).
constexpr int WIDE_FLOAT_MR = 4;

// One half h of every 32 inputs (16 + 16 h ..) of a chunk, for MR activation rows (x, count
// floats apart) x NR weight rows: each sum acc[m][n][h] still takes its inputs in order, so
// wide_rows_float's bits.
template <int MR, int NR>
inline void wide_float_pass(const float (*w)[FLOAT_CHUNK], const float *x, int64_t count, int h, __m512 (*acc)[NR][2]) {
    __m512 a[MR][NR];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) a[m][n] = acc[m][n][h];
    for (int64_t k = 16 * h; k < count; k += 32) {
        __m512 xv[MR];
        for (int m = 0; m < MR; m++) xv[m] = _mm512_loadu_ps(x + m * count + k);
        for (int n = 0; n < NR; n++) {
            const __m512 wv = _mm512_load_ps(w[n] + k);
            for (int m = 0; m < MR; m++) a[m][n] = _mm512_fmadd_ps(wv, xv[m], a[m][n]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) acc[m][n][h] = a[m][n];
}

template <int64_t T, int NR>
void wide_tile_float(const uint8_t *row, int64_t row_bytes, const XRow *, int64_t M, int64_t K, const void *prepared,
                     float *out, int64_t ldo) {
    const float *band = static_cast<const float *>(prepared);
    alignas(64) float w[NR][FLOAT_CHUNK];
    __m512 acc[BAND][NR][2];
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < NR; n++) acc[m][n][0] = acc[m][n][1] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += FLOAT_CHUNK) {
        const int64_t count = std::min(FLOAT_CHUNK, K - k0);  // whole blocks of 32
        for (int n = 0; n < NR; n++)
            for (int64_t k = 0; k < count; k += 16)
                _mm512_store_ps(w[n] + k, widen16<T>(reinterpret_cast<const uint16_t *>(row + n * row_bytes) + k0 + k));
        const float *chunk = band + k0 * M;  // (M, count)
        for (int64_t m = 0; m < M; m += WIDE_FLOAT_MR)
            for (int h = 0; h < 2; h++) {
                const float *x = chunk + m * count;
                switch (std::min<int64_t>(WIDE_FLOAT_MR, M - m)) {
                    case 1: wide_float_pass<1, NR>(w, x, count, h, acc + m); break;
                    case 2: wide_float_pass<2, NR>(w, x, count, h, acc + m); break;
                    case 3: wide_float_pass<3, NR>(w, x, count, h, acc + m); break;
                    default: wide_float_pass<WIDE_FLOAT_MR, NR>(w, x, count, h, acc + m); break;
                }
            }
    }
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < NR; n++) out[m * ldo + n] = wide_float_total(acc[m][n]);
}

}  // namespace
}  // namespace blocks
}  // namespace qkv
