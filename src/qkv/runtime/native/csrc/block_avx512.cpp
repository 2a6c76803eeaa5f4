// The AVX-512 variant of the block products (block_x86.h with VNNI's vpdpbusd, on the
// instruction set kernels.h's AVX512 variant means: F, BW, DQ, VL and VNNI).
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
#endif

// GCC 12's own AVX headers warn (maybe-uninitialized) where they are inlined (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "block_x86.h"
#include "block_tiles_avx512.h"

namespace qkv {
namespace blocks {
namespace {

constexpr int WIDE_ROWS_256 = 4, WIDE_ROWS_32 = 8;  // weight rows a wide tile (block_tiles_avx512.h): K-quants, 32-blocks

struct Avx512 {
    static __m256i dot4(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
};

}  // namespace

RowDot avx512_dot(int64_t type) { return dot_for<Avx512>(type); }
RowsDot avx512_rows(int64_t type) { return rows_for<Avx512>(type); }
Tile avx512_tile(int64_t type) {
    return wide_tile_for<WIDE_ROWS_256, WIDE_ROWS_32>(type);
}

}  // namespace blocks
}  // namespace qkv

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // x86
