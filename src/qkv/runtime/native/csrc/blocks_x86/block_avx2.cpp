// The AVX2 variant of the block products (block_x86.h with vpmaddubsw + vpmaddwd).
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

// GCC 12's own AVX headers warn (maybe-uninitialized) where they are inlined (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "block_x86.h"
#include "block_tiles_x86.h"

namespace qkv {
namespace blocks {
namespace {

struct Avx2 {
    static __m256i dot4(__m256i u, __m256i s) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
    }
};

}  // namespace

RowDot avx2_dot(int64_t type) { return dot_for<Avx2>(type); }
RowsDot avx2_rows(int64_t type) { return rows_for<Avx2>(type); }
Tile avx2_tile(int64_t type) { return tile_for<Avx2, 4, 2>(type); }

void avx2_round_groups(const float *x, int64_t groups, int64_t step, int8_t *q, float *d, float *s, int16_t *sums) {
    round_groups(x, groups, step, q, d, s, sums);
}

}  // namespace blocks
}  // namespace qkv

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // x86
