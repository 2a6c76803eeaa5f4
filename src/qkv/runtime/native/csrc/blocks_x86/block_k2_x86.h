// The x86 products of Q2_K and Q3_K (2 bits a code, Q3_K's third in hmask; a scale per 16): a
// part of block_x86.h in a file of its own, which block_x86.h includes after its helpers (include
// block_x86.h); block_tiles_x86.h's AVX2 tile and block_grid_avx512.h's AVX-512 tile take the
// same exact sums.
#pragma once

namespace qkv {
namespace blocks {
namespace {  // each variant's file has its own copies, compiled for its own instruction set

// Q3_K's 16 six-bit scales less 32, as int8 (q3_scale's bits): the low nibbles and the 2-bit high
// parts of four scales cut out of the 12 bytes' 32-bit words at once, not one scale at a time.
inline __m128i q3_scales(const uint8_t *scales) {
    uint32_t a[3];
    memcpy(a, scales, sizeof a);
    const uint32_t low = 0x0F0F0F0Fu, two = 0x03030303u;
    const __m128i six = _mm_setr_epi32(static_cast<int>((a[0] & low) | ((a[2] & two) << 4)),
                                       static_cast<int>((a[1] & low) | (((a[2] >> 2) & two) << 4)),
                                       static_cast<int>(((a[0] >> 4) & low) | (((a[2] >> 4) & two) << 4)),
                                       static_cast<int>(((a[1] >> 4) & low) | (((a[2] >> 6) & two) << 4)));
    return _mm_sub_epi8(six, _mm_set1_epi8(32));
}

// Q2_K / Q3_K's 16 scales as int16, each half (scales 8 h .. 8 h + 7) in both 128-bit lanes, so
// that a pair of them is one in-lane shuffle (pair_scales) instead of a shuffle and a widening.
struct Scales16 {
    __m256i half[2];
};

inline Scales16 scales16(__m128i sc8, bool is_signed) {
    const __m256i all = is_signed ? _mm256_cvtepi8_epi16(sc8) : _mm256_cvtepu8_epi16(sc8);
    return {{_mm256_permute2x128_si256(all, all, 0x00), _mm256_permute2x128_si256(all, all, 0x11)}};
}

inline __m256i pair_scales(const Scales16 &scales, int s) {  // s even: int16 lanes 0..7 scale s, 8..15 scale s + 1
    const char j = static_cast<char>(2 * (s % 8));
    const char k = static_cast<char>(j + 2);
    return _mm256_shuffle_epi8(scales.half[s / 8], _mm256_setr_epi8(j, j + 1, j, j + 1, j, j + 1, j, j + 1, j, j + 1, j, j + 1, j, j + 1, j, j + 1,
                                                                     k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1));
}

// Q2_K / Q3_K: weight 128 h + 32 t + r from bits 2t of qs[32 h + r]; Q3_K adds 4 where bit 4h + t of
// hmask[r] is set and takes the 4 off as 4 sum(scale * the activations' 16-sums), as Q6_K its 32.
// A super-block's int32 lanes: `isum` the scaled codes' products (Q3_K: less 4 sum(scale * the
// 16-sums)), `msum` (Q2_K) the minimums times the activations' 16-sums.
template <int64_t T, class B>
inline __attribute__((always_inline)) void k2_sums(const B &b, const int8_t *c, const int16_t *x_sums, __m256i &isum, __m256i &msum) {
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i sums = load(x_sums);
    __m128i sc8;
    [[maybe_unused]] __m256i hm;
    if constexpr (T == Q2_K) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b.scales));
        sc8 = _mm_and_si128(packed, _mm_set1_epi8(15));
        msum = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15))), sums);
    } else {
        sc8 = q3_scales(b.scales);
        hm = load(b.hmask);
    }
    const Scales16 scales = scales16(sc8, T == Q3_K);
    __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i bits = load(b.qs + 32 * h);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * t), three);
            if constexpr (T == Q3_K) q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + t), one), 2));
            const __m256i p16 = _mm256_maddubs_epi16(q, load(c + 128 * h + 32 * t));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p16, pair_scales(scales, 8 * h + 2 * t)));
        }
    }
    if constexpr (T == Q3_K) sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(sums, _mm256_cvtepi8_epi16(sc8)), 2));
    isum = sumi;
}

// Each super-block's exact sums then take the generic reference's float operations in its order
// (block_format.cpp's dot256: acc[i % 4] += (d_w d_x) isum, Q2_K: -= (dmin_w d_x) msum, then
// (a0 + a2) + (a1 + a3)), four super-blocks' side by side in one register: every variant, one
// row or a prompt's tile, gives the generic bits.
template <class S, int64_t T>
float dot_k2(const uint8_t *row, const XRow &x, int64_t K) {
    using B = std::conditional_t<T == Q3_K, BlockQ3_K, BlockQ2_K>;
    const B *b = reinterpret_cast<const B *>(row);
    const int64_t blocks = K / 256;
    __m128 acc = _mm_setzero_ps();
    int64_t i0 = 0;
    for (; i0 + 4 <= blocks; i0 += 4) {
        __m256i isum[4], msum[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) k2_sums<T>(b[i0 + j], x.q + 256 * (i0 + j), x.sums + 16 * (i0 + j), isum[j], msum[j]);
        const __m128 dx = _mm_loadu_ps(x.d + i0);
        const __m128 d_w = _mm_setr_ps(half(b[i0].d), half(b[i0 + 1].d), half(b[i0 + 2].d), half(b[i0 + 3].d));
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(d_w, dx), _mm_cvtepi32_ps(totals4(isum[0], isum[1], isum[2], isum[3]))));
        if constexpr (T == Q2_K) {
            const __m128 dmin_w = _mm_setr_ps(half(b[i0].dmin), half(b[i0 + 1].dmin), half(b[i0 + 2].dmin), half(b[i0 + 3].dmin));
            acc = _mm_sub_ps(acc, _mm_mul_ps(_mm_mul_ps(dmin_w, dx), _mm_cvtepi32_ps(totals4(msum[0], msum[1], msum[2], msum[3]))));
        }
    }
    alignas(16) float a[4];
    _mm_store_ps(a, acc);
    for (int64_t i = i0; i < blocks; i++) {  // the last super-blocks, each in its lane
        __m256i isum, msum;
        k2_sums<T>(b[i], x.q + 256 * i, x.sums + 16 * i, isum, msum);
        a[i % 4] += (half(b[i].d) * x.d[i]) * static_cast<float>(hsum_i32(isum));
        if constexpr (T == Q2_K) a[i % 4] -= (half(b[i].dmin) * x.d[i]) * static_cast<float>(hsum_i32(msum));
    }
    return four_accumulators(a);
}

}  // namespace
}  // namespace blocks
}  // namespace qkv
