// The AVX-512 variant of the block products (block_kernels.h over 16-lane zmm vectors).
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#endif

// GCC 12's own AVX headers warn (maybe-uninitialized) where they are inlined (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "block_kernels.h"

namespace {

struct V512 {
    using I = __m512i;
    using F = __m512;
    static I u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
    static I i8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
    static I srl(I a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
    static I sll(I a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
    static I band(I a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
    static I bor(I a, I b) { return _mm512_or_si512(a, b); }
    static I bxor1(I a) { return _mm512_xor_si512(a, _mm512_set1_epi32(1)); }
    static I subc(I a, int c) { return _mm512_sub_epi32(a, _mm512_set1_epi32(c)); }
    static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
    static I bits(uint32_t mask, int v) { return _mm512_maskz_set1_epi32(static_cast<__mmask16>(mask & 0xFFFF), v); }
    static I sub_where_clear(I a, uint32_t mask, int c) {
        return _mm512_mask_sub_epi32(a, static_cast<__mmask16>(~mask & 0xFFFF), a, _mm512_set1_epi32(c));
    }
    static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
    static F set(float f) { return _mm512_set1_ps(f); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    static F load(const float *p) { return _mm512_loadu_ps(p); }
    static void store(float *p, F a) { _mm512_storeu_ps(p, a); }
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static float half(const uint8_t *p) { return _cvtsh_ss(static_cast<unsigned short>(p[0] | (p[1] << 8))); }
    using B = __m256i;
    static B b_load(const uint8_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }
    static B b_srl(B a, int n) { return _mm256_srl_epi16(a, _mm_cvtsi32_si128(n)); }
    static B b_sll(B a, int n) { return _mm256_sll_epi16(a, _mm_cvtsi32_si128(n)); }
    static B b_and(B a, int m) { return _mm256_and_si256(a, _mm256_set1_epi8(static_cast<char>(m))); }
    static B b_or(B a, B b) { return _mm256_or_si256(a, b); }
    static B b_sub(B a, int c) { return _mm256_sub_epi8(a, _mm256_set1_epi8(static_cast<char>(c))); }
    static I b_lanes(B a, int i) {
        return _mm512_cvtepi8_epi32(i ? _mm256_extracti128_si256(a, 1) : _mm256_castsi256_si128(a));
    }
    static F zero() { return _mm512_setzero_ps(); }
    static float reduce(F (&a)[4]) {  // 64 -> 32 -> 16 through registers, 16 -> 8 -> .. -> 1 as the generic tree
        alignas(64) float v[16];
        _mm512_store_ps(v, _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3])));
        __m256 e = _mm256_add_ps(_mm256_load_ps(v), _mm256_load_ps(v + 8));
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
};

}  // namespace

namespace block_kernels {

float row_dot_avx512(int64_t type, const uint8_t *row, const float *x, int64_t K, int64_t bytes) {
    return row_dot<V512>(type, row, x, K, bytes);
}
float dot_avx512(const float *w, const float *x, int64_t K) { return dot<V512>(w, x, K); }
void decode_avx512(int64_t type, const uint8_t *row, int64_t K, int64_t bytes, float *w) {
    decode<V512>(type, row, K, bytes, w);
}

}  // namespace block_kernels

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
