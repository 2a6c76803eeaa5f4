// The AVX2 variant of the block products (block_kernels.h over pairs of 8-lane ymm vectors).
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#endif

// GCC 12's own AVX headers warn (maybe-uninitialized) where they are inlined (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "block_kernels.h"

namespace {

struct I2 {
    __m256i lo, hi;  // lanes 0..7, 8..15
};
struct F2 {
    __m256 lo, hi;
};

struct V256 {
    using I = I2;
    using F = F2;
    static __m128i at(const uint8_t *p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)); }
    static I u8(const uint8_t *p) { return {_mm256_cvtepu8_epi32(at(p)), _mm256_cvtepu8_epi32(at(p + 8))}; }
    static I i8(const uint8_t *p) { return {_mm256_cvtepi8_epi32(at(p)), _mm256_cvtepi8_epi32(at(p + 8))}; }
    static I srl(I a, int n) { const __m128i c = _mm_cvtsi32_si128(n); return {_mm256_srl_epi32(a.lo, c), _mm256_srl_epi32(a.hi, c)}; }
    static I sll(I a, int n) { const __m128i c = _mm_cvtsi32_si128(n); return {_mm256_sll_epi32(a.lo, c), _mm256_sll_epi32(a.hi, c)}; }
    static I band(I a, int m) { const __m256i c = _mm256_set1_epi32(m); return {_mm256_and_si256(a.lo, c), _mm256_and_si256(a.hi, c)}; }
    static I bor(I a, I b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
    static I bxor1(I a) { const __m256i c = _mm256_set1_epi32(1); return {_mm256_xor_si256(a.lo, c), _mm256_xor_si256(a.hi, c)}; }
    static I subc(I a, int c) { const __m256i v = _mm256_set1_epi32(c); return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)}; }
    static I sub(I a, I b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
    static __m256i bit_lanes(uint32_t m, int v) {  // v in lane l where bit l of m is set
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
        const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(m)), iota), one);
        return _mm256_and_si256(_mm256_cmpeq_epi32(bit, one), _mm256_set1_epi32(v));
    }
    static I bits(uint32_t mask, int v) { return {bit_lanes(mask & 0xFF, v), bit_lanes((mask >> 8) & 0xFF, v)}; }
    static I sub_where_clear(I a, uint32_t mask, int c) {
        const I set = bits(mask, c);  // c where the bit is set
        const __m256i v = _mm256_set1_epi32(c);
        return {_mm256_sub_epi32(a.lo, _mm256_andnot_si256(set.lo, v)), _mm256_sub_epi32(a.hi, _mm256_andnot_si256(set.hi, v))};
    }
    static F cvt(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
    static F set(float f) { const __m256 v = _mm256_set1_ps(f); return {v, v}; }
    static F mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
    static F add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
    static F sub(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
    static F load(const float *p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
    static void store(float *p, F a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
    static F fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
    static float half(const uint8_t *p) { return _cvtsh_ss(static_cast<unsigned short>(p[0] | (p[1] << 8))); }
    using B = __m256i;
    static B b_load(const uint8_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }
    static B b_srl(B a, int n) { return _mm256_srl_epi16(a, _mm_cvtsi32_si128(n)); }
    static B b_sll(B a, int n) { return _mm256_sll_epi16(a, _mm_cvtsi32_si128(n)); }
    static B b_and(B a, int m) { return _mm256_and_si256(a, _mm256_set1_epi8(static_cast<char>(m))); }
    static B b_or(B a, B b) { return _mm256_or_si256(a, b); }
    static B b_sub(B a, int c) { return _mm256_sub_epi8(a, _mm256_set1_epi8(static_cast<char>(c))); }
    static I b_lanes(B a, int i) {
        const __m128i h = i ? _mm256_extracti128_si256(a, 1) : _mm256_castsi256_si128(a);
        return {_mm256_cvtepi8_epi32(h), _mm256_cvtepi8_epi32(_mm_srli_si128(h, 8))};
    }
    static F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static float reduce(F (&a)[4]) {  // the generic tree: 64 -> 32 -> 16 -> 8 -> 4 -> 2 -> 1
        const F v = add(add(a[0], a[2]), add(a[1], a[3]));
        const __m256 e = _mm256_add_ps(v.lo, v.hi);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
};

}  // namespace

namespace block_kernels {

float row_dot_avx2(int64_t type, const uint8_t *row, const float *x, int64_t K, int64_t bytes) {
    return row_dot<V256>(type, row, x, K, bytes);
}
float dot_avx2(const float *w, const float *x, int64_t K) { return dot<V256>(w, x, K); }
void decode_avx2(int64_t type, const uint8_t *row, int64_t K, int64_t bytes, float *w) {
    decode<V256>(type, row, K, bytes, w);
}

}  // namespace block_kernels

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
