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

inline __m256i rows4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return _mm256_setr_epi64x(static_cast<long long>(a), static_cast<long long>(b), static_cast<long long>(c), static_cast<long long>(d));
}

inline uint64_t pair4(const uint32_t *grid, int i0, int i1) { return grid[i0] | (static_cast<uint64_t>(grid[i1]) << 32); }

inline __m256i multipliers(int lo, int hi) {  // int16 lanes 0..7 (the first 16 weights) lo, 8..15 hi
    return _mm256_set_m128i(_mm_set1_epi16(static_cast<short>(hi)), _mm_set1_epi16(static_cast<short>(lo)));
}

inline __m256i magnitude_products(__m256i w, uint32_t signs, const int8_t *c, __m256i mult) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_sign_epi8(load(c), sign_bytes(signs))), mult);
}

template <class B>
inline __m256i grid_sub_block(const B &b, int s, const int8_t *c) {  // sub-block s (weights 32 s ..): 8 int32 partial sums
    if constexpr (std::is_same_v<B, BlockIQ2_XXS> || std::is_same_v<B, BlockIQ3_XXS>) {
        uint32_t aux;
        const uint8_t *p;
        __m256i w;
        if constexpr (std::is_same_v<B, BlockIQ2_XXS>) {
            p = b.qs + 8 * s;
            memcpy(&aux, p + 4, sizeof aux);
            w = rows4(IQ2_XXS_GRID[p[0]], IQ2_XXS_GRID[p[1]], IQ2_XXS_GRID[p[2]], IQ2_XXS_GRID[p[3]]);
        } else {
            p = b.qs + 8 * s;
            memcpy(&aux, b.scales_signs + 4 * s, sizeof aux);
            w = rows4(pair4(IQ3_XXS_GRID, p[0], p[1]), pair4(IQ3_XXS_GRID, p[2], p[3]), pair4(IQ3_XXS_GRID, p[4], p[5]),
                      pair4(IQ3_XXS_GRID, p[6], p[7]));
        }
        const uint32_t signs = seven_signs(aux & 127) | (seven_signs((aux >> 7) & 127) << 8) | (seven_signs((aux >> 14) & 127) << 16) |
                               (static_cast<uint32_t>(seven_signs((aux >> 21) & 127)) << 24);
        const int m = static_cast<int>(2 * (aux >> 28) + 1);
        return magnitude_products(w, signs, c, _mm256_set1_epi16(static_cast<short>(m)));
    } else if constexpr (std::is_same_v<B, BlockIQ2_XS>) {
        const uint16_t *q = b.qs + 4 * s;
        const __m256i w = rows4(IQ2_XS_GRID[q[0] & 511], IQ2_XS_GRID[q[1] & 511], IQ2_XS_GRID[q[2] & 511], IQ2_XS_GRID[q[3] & 511]);
        const uint32_t signs = seven_signs(q[0] >> 9) | (seven_signs(q[1] >> 9) << 8) | (seven_signs(q[2] >> 9) << 16) |
                               (static_cast<uint32_t>(seven_signs(q[3] >> 9)) << 24);
        return magnitude_products(w, signs, c, multipliers(2 * (b.scales[s] & 15) + 1, 2 * (b.scales[s] >> 4) + 1));
    } else if constexpr (std::is_same_v<B, BlockIQ2_S>) {
        const uint8_t *q = b.qs + 4 * s;
        const int h = b.qh[s];
        const __m256i w = rows4(IQ2_S_GRID[q[0] | ((h & 3) << 8)], IQ2_S_GRID[q[1] | ((h & 12) << 6)],
                                IQ2_S_GRID[q[2] | ((h & 48) << 4)], IQ2_S_GRID[q[3] | ((h & 192) << 2)]);
        uint32_t signs;
        memcpy(&signs, b.signs + 4 * s, sizeof signs);
        return magnitude_products(w, signs, c, multipliers(2 * (b.scales[s] & 15) + 1, 2 * (b.scales[s] >> 4) + 1));
    } else if constexpr (std::is_same_v<B, BlockIQ3_S>) {
        const uint8_t *q = b.qs + 8 * s;
        const int h = b.qh[s];
        const auto at = [&](int k) { return q[k] | (((h >> k) & 1) << 8); };
        const __m256i w = rows4(pair4(IQ3_S_GRID, at(0), at(1)), pair4(IQ3_S_GRID, at(2), at(3)), pair4(IQ3_S_GRID, at(4), at(5)),
                                pair4(IQ3_S_GRID, at(6), at(7)));
        uint32_t signs;
        memcpy(&signs, b.signs + 4 * s, sizeof signs);
        const int m = 2 * ((b.scales[s / 2] >> (4 * (s % 2))) & 15) + 1;
        return magnitude_products(w, signs, c, _mm256_set1_epi16(static_cast<short>(m)));
    } else {  // IQ1_S
        const int h = b.qh[s];
        const uint8_t *q = b.qs + 4 * s;
        const __m256i g = rows4(IQ1_S_GRID[q[0] | ((h & 7) << 8)], IQ1_S_GRID[q[1] | (((h >> 3) & 7) << 8)],
                                IQ1_S_GRID[q[2] | (((h >> 6) & 7) << 8)], IQ1_S_GRID[q[3] | (((h >> 9) & 7) << 8)]);
        const __m256i w = _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), _mm256_set1_epi8(h & 0x8000 ? -1 : 1));  // 8 g +- 1
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
