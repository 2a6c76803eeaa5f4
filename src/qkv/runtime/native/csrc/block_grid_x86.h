// The x86 dot products of the grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S) on
// activations rounded per 256: a part of block_x86.h in a file of its own, which block_x86.h
// includes after its helpers and before its table of kernels by type (include block_x86.h).
#pragma once

namespace qkv {
namespace blocks {
namespace {  // each variant's file has its own copies, compiled for its own instruction set

// The grid types (block_format.h's iq_codes says the math): per 32 weights, the four grid rows
// of 8 magnitudes (IQ2, IQ3: two rows of 4 a group) in one register, the 32 sign bits
// spread to bytes and put on the activations (|w| times sign(w) x: magnitudes are below 64,
// no int16 saturation), the sub-block's multiplier (per 32, or per 16: one a 128-bit lane)
// applied in vpmaddwd; IQ1_S's signed codes 8 g +- 1 through signed_products. The integer
// sums are iq_codes' exactly.
inline __m256i sign_bytes(uint32_t bits) {  // bit j -> byte j: -1 where set, +1 where clear
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(1));
}

// The grid rows of a sub-block, fetched by one gather: four rows of 8 (uint64, IQ2 and IQ1_S)
// from four indices, or eight rows of 4 (uint32, IQ3) from eight.
inline __m256i rows_of8(const uint64_t *grid, __m128i index4) {
    return _mm256_i32gather_epi64(reinterpret_cast<const long long *>(grid), index4, 8);
}

inline __m256i rows_of4(const uint32_t *grid, __m256i index8) {
    return _mm256_i32gather_epi32(reinterpret_cast<const int *>(grid), index8, 4);
}

inline __m128i bytes4(const uint8_t *p) {  // 4 bytes -> 4 int32 lanes
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm_cvtepu8_epi32(_mm_cvtsi32_si128(v));
}

inline __m256i bytes8(const uint8_t *p) {  // 8 bytes -> 8 int32 lanes
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
}

inline uint32_t four_seven_signs(uint32_t aux) {  // four 7-bit sign indices -> 32 sign bits
    return seven_signs(aux) | (seven_signs(aux >> 7) << 8) | (seven_signs(aux >> 14) << 16) |
           (static_cast<uint32_t>(seven_signs(aux >> 21)) << 24);
}

inline __m256i multipliers(int lo, int hi) {  // int16 lanes 0..7 (the first 16 weights) lo, 8..15 hi
    return _mm256_set_m128i(_mm_set1_epi16(static_cast<short>(hi)), _mm_set1_epi16(static_cast<short>(lo)));
}

inline __m256i magnitude_products(__m256i w, uint32_t signs, const int8_t *c, __m256i mult) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_sign_epi8(load(c), sign_bytes(signs))), mult);
}

template <class B>
inline __m256i grid_sub_block(const B &b, int s, const int8_t *c) {  // sub-block s (weights 32 s ..): 8 int32 partial sums
    if constexpr (std::is_same_v<B, BlockIQ2_XXS>) {
        const uint8_t *p = b.qs + 8 * s;
        uint32_t aux;
        memcpy(&aux, p + 4, sizeof aux);
        const __m256i w = rows_of8(IQ2_XXS_GRID, bytes4(p));
        return magnitude_products(w, four_seven_signs(aux), c, _mm256_set1_epi16(static_cast<short>(2 * (aux >> 28) + 1)));
    } else if constexpr (std::is_same_v<B, BlockIQ3_XXS>) {
        uint32_t aux;
        memcpy(&aux, b.scales_signs + 4 * s, sizeof aux);
        const __m256i w = rows_of4(IQ3_XXS_GRID, bytes8(b.qs + 8 * s));
        return magnitude_products(w, four_seven_signs(aux), c, _mm256_set1_epi16(static_cast<short>(2 * (aux >> 28) + 1)));
    } else if constexpr (std::is_same_v<B, BlockIQ2_XS>) {
        const uint16_t *q = b.qs + 4 * s;
        const __m128i words = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(q)));
        const __m256i w = rows_of8(IQ2_XS_GRID, _mm_and_si128(words, _mm_set1_epi32(511)));
        const uint32_t signs = seven_signs(q[0] >> 9) | (seven_signs(q[1] >> 9) << 8) | (seven_signs(q[2] >> 9) << 16) |
                               (static_cast<uint32_t>(seven_signs(q[3] >> 9)) << 24);
        return magnitude_products(w, signs, c, multipliers(2 * (b.scales[s] & 15) + 1, 2 * (b.scales[s] >> 4) + 1));
    } else if constexpr (std::is_same_v<B, BlockIQ2_S>) {  // index l: qs byte | bits 2l .. 2l + 1 of qh[s] << 8
        const __m128i high = _mm_srlv_epi32(_mm_set1_epi32(b.qh[s]), _mm_setr_epi32(0, 2, 4, 6));
        const __m128i index = _mm_or_si128(bytes4(b.qs + 4 * s), _mm_slli_epi32(_mm_and_si128(high, _mm_set1_epi32(3)), 8));
        uint32_t signs;
        memcpy(&signs, b.signs + 4 * s, sizeof signs);
        return magnitude_products(rows_of8(IQ2_S_GRID, index), signs, c,
                                  multipliers(2 * (b.scales[s] & 15) + 1, 2 * (b.scales[s] >> 4) + 1));
    } else if constexpr (std::is_same_v<B, BlockIQ3_S>) {  // index k: qs byte | bit k of qh[s] << 8
        const __m256i high = _mm256_srlv_epi32(_mm256_set1_epi32(b.qh[s]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256i index = _mm256_or_si256(bytes8(b.qs + 8 * s), _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), 8));
        uint32_t signs;
        memcpy(&signs, b.signs + 4 * s, sizeof signs);
        const int m = 2 * ((b.scales[s / 2] >> (4 * (s % 2))) & 15) + 1;
        return magnitude_products(rows_of4(IQ3_S_GRID, index), signs, c, _mm256_set1_epi16(static_cast<short>(m)));
    } else {  // IQ1_S: index l: qs byte | bits 3l .. 3l + 2 of qh[s] << 8; codes 8 g +- 1
        const int h = b.qh[s];
        const __m128i high = _mm_srlv_epi32(_mm_set1_epi32(h), _mm_setr_epi32(0, 3, 6, 9));
        const __m128i index = _mm_or_si128(bytes4(b.qs + 4 * s), _mm_slli_epi32(_mm_and_si128(high, _mm_set1_epi32(7)), 8));
        const __m256i g = rows_of8(IQ1_S_GRID, index);
        const __m256i w = _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), _mm256_set1_epi8(h & 0x8000 ? -1 : 1));
        return _mm256_madd_epi16(signed_products(w, load(c)), _mm256_set1_epi16(static_cast<short>(2 * ((h >> 12) & 7) + 1)));
    }
}

template <class B>
float dot_grid(const uint8_t *row, const XRow &x, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const B &b = *reinterpret_cast<const B *>(row + i * static_cast<int64_t>(sizeof(B)));
        const int8_t *c = x.q + 256 * i;
        __m256i sumi = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) sumi = _mm256_add_epi32(sumi, grid_sub_block(b, s, c + 32 * s));
        const float scale = half(b.d) * x.d[i] * (1.f / static_cast<float>(IqDivisor<B>::value));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc);
}

}  // namespace
}  // namespace blocks
}  // namespace qkv
