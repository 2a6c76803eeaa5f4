// The x86 products of the plain 16-bit floats (F16, BF16) against float32 activations: a part
// of block_x86.h in a file of its own, which block_x86.h includes after its helpers (include
// block_x86.h). AVX-512's own are in block_float_avx512.h.
#pragma once

namespace qkv {
namespace blocks {
namespace {  // each variant's file has its own copies, compiled for its own instruction set

// -- the plain 16-bit floats (F16, BF16) against float32 activations -----------------------
// Each row keeps four accumulators: a_j += w x over inputs 32 g + 8 j .. 32 g + 8 j + 7 (one
// fused multiply-add a lane, w widened exactly), then hsum((a0 + a1) + (a2 + a3)). AVX-512's
// kernels (block_avx512.cpp) hold a0 | a1 and a2 | a3 in two zmm registers: the same lanes
// take the same operations, so they give these bits.
template <int64_t T>
inline __m256 widen8(const uint16_t *w) {  // 8 weights as float32
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(w));
    if constexpr (T == F16) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bfloat16: the upper half
}

inline float float_total(const __m256 *a) { return hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))); }

// NR rows of F16 / BF16 (row_bytes apart) against one row of x, out[0 .. NR); x loaded once for the NR.
template <int64_t T, int NR>
void rows_float(const uint8_t *row, int64_t row_bytes, const XRow &x, int64_t K, float *out) {
    __m256 a[NR][4];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 xv = _mm256_loadu_ps(x.x + k + 8 * j);
            for (int r = 0; r < NR; r++) {
                const uint16_t *w = reinterpret_cast<const uint16_t *>(row + r * row_bytes);
                a[r][j] = _mm256_fmadd_ps(widen8<T>(w + k + 8 * j), xv, a[r][j]);
            }
        }
    for (int r = 0; r < NR; r++) out[r] = float_total(a[r]);
}

template <int64_t T>
float dot_float(const uint8_t *row, const XRow &x, int64_t K) {
    float out;
    rows_float<T, 1>(row, 0, x, K, &out);
    return out;
}

// FOUR rows of F16 / BF16 against one x (float32, 4 K bytes). While x stays in L1 beside the
// streamed weights, one row at a time: four 4 KiB rows streamed together took 1.5-1.8x one row's
// time out of cache (8192 x 2048, a Zen 4). Past X_IN_L1_BYTES (a 1B model's down projection,
// K = 8192: x is 32 KiB) x came from L2 for every row, twice the weights' bytes, and the product
// read 9-24 GB/s against 22-45 for the other matrices: there the four rows share each load of x.
// Either way a row takes its own operations, so its bits.
constexpr int64_t X_IN_L1_BYTES = 16 * 1024;

template <RowsDot together, RowDot alone>
void float_rows_by_k(const uint8_t *row, int64_t row_bytes, const XRow &x, int64_t K, float *out) {
    if (K * static_cast<int64_t>(sizeof(float)) <= X_IN_L1_BYTES) {
        for (int r = 0; r < FOUR; r++) out[r] = alone(row + r * row_bytes, x, K);
    } else {
        together(row, row_bytes, x, K, out);
    }
}

}  // namespace
}  // namespace blocks
}  // namespace qkv
