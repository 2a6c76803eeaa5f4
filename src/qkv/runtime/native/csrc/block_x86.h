// The x86 dot products of the block types on rounded activations (block_format.h says what
// they compute), written once over an instruction set S and compiled twice: for AVX2 in
// block_avx2.cpp and for AVX-512 (VNNI) in block_avx512.cpp, each inside its own `#pragma GCC
// target` region. Every integer sum is exact (no int16 saturation: weight codes are below 64,
// or the signed codes are multiplied through |w| and sign(x) w), so both compute the same
// integers as the generic C++; only the float combination's order differs from it.
//
// S provides dot4(u, s): 32 unsigned bytes times 32 signed bytes, each 4 adjacent products
// summed into an int32 lane (AVX2: vpmaddubsw then vpmaddwd; AVX-512 VNNI: vpdpbusd).
#pragma once
#include <immintrin.h>
#include <string.h>

#include <type_traits>

#include "block_format.h"

namespace qkv {
namespace blocks {
namespace {  // each variant's file has its own copies, compiled for its own instruction set

inline float half(uint16_t h) { return _cvtsh_ss(h); }

inline __m256i load(const void *p) { return _mm256_loadu_si256(static_cast<const __m256i *>(p)); }

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256i nibbles(const uint8_t *qs) {  // 16 bytes -> 32 codes: the low nibbles, then the high ones
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
}

inline __m256i bit_bytes(const uint8_t *p) {  // 32 bits -> 32 bytes, 0xFF where bit j is set
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// A 32-block's weight codes in weight order: signed (w / d) for the types without a minimum,
// unsigned (0..31) for Q4_1 / Q5_1.
template <int64_t T>
inline __m256i codes32(const uint8_t *b) {
    if constexpr (T == Q4_0) {
        return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
    } else if constexpr (T == Q4_1) {
        return nibbles(b + 4);
    } else if constexpr (T == Q5_0) {  // where the fifth bit is clear, q - 16 = the nibble | 0xF0 as int8
        return _mm256_or_si256(nibbles(b + 6), _mm256_andnot_si256(bit_bytes(b + 2), _mm256_set1_epi8(static_cast<char>(0xF0))));
    } else if constexpr (T == Q5_1) {
        return _mm256_or_si256(nibbles(b + 8), _mm256_and_si256(bit_bytes(b + 4), _mm256_set1_epi8(16)));
    } else if constexpr (T == Q8_0) {
        return load(b + 2);
    } else {  // IQ4_NL: the code book looked up by nibble
        const __m128i book = _mm_loadu_si128(reinterpret_cast<const __m128i *>(IQ4_NL_VALUES));
        return _mm256_shuffle_epi8(_mm256_set_m128i(book, book), nibbles(b + 2));
    }
}

template <class S, int64_t T>
float dot32(const uint8_t *row, const XRow &x, int64_t K) {
    constexpr bool minimum = T == Q4_1 || T == Q5_1;
    const Traits &t = *traits_of(T);
    const int64_t Z = t.bytes, G = K / 32;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    float offset = 0.f;
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = row + g * Z;
        const __m256i w = codes32<T>(b), c = load(x.q + 32 * g);
        uint16_t d;
        memcpy(&d, b, sizeof d);
        __m256i dots;
        if constexpr (minimum) {
            dots = S::dot4(w, c);
            uint16_t m;
            memcpy(&m, b + 2, sizeof m);
            offset += half(m) * x.s[g];
        } else {
            dots = S::dot4(_mm256_sign_epi8(w, w), _mm256_sign_epi8(c, w));  // |w| sign(w) c
        }
        acc[g & 1] = _mm256_fmadd_ps(_mm256_set1_ps(half(d) * x.d[g]), _mm256_cvtepi32_ps(dots), acc[g & 1]);
    }
    return hsum(_mm256_add_ps(acc[0], acc[1])) + offset;
}

inline __m256i scale16(int a) { return _mm256_set1_epi16(static_cast<short>(a)); }

// Q4_K / Q5_K: per 64 weights, sub-block 2c from the low nibbles and 2c + 1 from the high ones.
template <class S, int64_t T>
float dot_k4(const uint8_t *row, const XRow &x, int64_t K) {
    using B = std::conditional_t<T == Q5_K, BlockQ5_K, BlockQ4_K>;
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.f;
    for (int64_t i = 0; i < K / 256; i++) {
        const B &b = *reinterpret_cast<const B *>(row + i * static_cast<int64_t>(sizeof(B)));
        const int8_t *c = x.q + 256 * i;
        const int16_t *sums = x.sums + 16 * i;
        uint8_t sc[8], mn[8];
        scale_min_k4(b.scales, sc, mn);
        int32_t msum = 0;
        for (int j = 0; j < 8; j++) msum += mn[j] * (sums[2 * j] + sums[2 * j + 1]);
        __m256i sumi = _mm256_setzero_si256();
        [[maybe_unused]] __m256i high;
        if constexpr (T == Q5_K) high = load(b.qh);
        for (int j = 0; j < 4; j++) {
            const __m256i q = load(b.qs + 32 * j);
            __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            if constexpr (T == Q5_K) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(high, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 1), one), 4));
                high = _mm256_srli_epi16(high, 2);
            }
            const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(c + 64 * j)), scale16(sc[2 * j]));
            const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(c + 64 * j + 32)), scale16(sc[2 * j + 1]));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(plo, phi));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half(b.d) * x.d[i]), _mm256_cvtepi32_ps(sumi), acc);
        mins += (half(b.dmin) * x.d[i]) * static_cast<float>(msum);
    }
    return hsum(acc) - mins;
}

// Q6_K: per half h of 128 weights, the four 32s t from ql's nibbles and qh's 2-bit fields;
// the codes' offset of 32 is taken off as 32 sum(scale * the activations' 16-sums).
template <class S>
float dot_q6_k(const uint8_t *row, const XRow &x, int64_t K) {
    const __m256i low4 = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / 256; i++) {
        const BlockQ6_K &b = *reinterpret_cast<const BlockQ6_K *>(row + i * static_cast<int64_t>(sizeof(BlockQ6_K)));
        const int8_t *c = x.q + 256 * i;
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b.scales));
        const __m256i offset = _mm256_madd_epi16(load(x.sums + 16 * i), _mm256_cvtepi8_epi16(sc8));
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = load(b.ql + 64 * h), l1 = load(b.ql + 64 * h + 32), qh = load(b.qh + 32 * h);
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4)),
                _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4)),
            };
            for (int t = 0; t < 4; t++) {
                const int s = 8 * h + 2 * t;  // the 32's two sub-blocks of 16: s and s + 1
                const __m256i scales = _mm256_cvtepi8_epi16(
                    _mm_unpacklo_epi64(_mm_set1_epi8(b.scales[s]), _mm_set1_epi8(b.scales[s + 1])));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q[t], load(c + 128 * h + 32 * t)), scales));
            }
        }
        sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half(b.d) * x.d[i]), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum(acc);
}

template <class S>
RowDot dot_for(int64_t type) {
    switch (type) {
        case Q4_0: return dot32<S, Q4_0>;
        case Q4_1: return dot32<S, Q4_1>;
        case Q5_0: return dot32<S, Q5_0>;
        case Q5_1: return dot32<S, Q5_1>;
        case Q8_0: return dot32<S, Q8_0>;
        case IQ4_NL: return dot32<S, IQ4_NL>;
        case Q4_K: return dot_k4<S, Q4_K>;
        case Q5_K: return dot_k4<S, Q5_K>;
        case Q6_K: return dot_q6_k<S>;
        default: return generic_dot(type);  // Q2_K, Q3_K: the generic C++ (the same integers, the same order)
    }
}

}  // namespace
}  // namespace blocks
}  // namespace qkv
