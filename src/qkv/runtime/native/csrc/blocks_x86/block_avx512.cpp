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
#include "block_tiles_x86.h"

namespace qkv {
namespace blocks {
namespace {

constexpr int WIDE_ROWS_256 = 4, WIDE_ROWS_32 = 8;  // weight rows a wide tile: K-quants, 32-blocks

// -- AVX-512's wide tiles (block_format.h's Tile): sixteen rows of activations in the 16 lanes
// of a zmm register, the weights broadcast. Super-blocks (Q5_K, IQ4_XS; Q6_K has a tile of its
// own, two activation rows a zmm register, further down; Q2_K / Q3_K and the grid types
// block_grid_avx512.h's):
//
// The one-row kernels (block_x86.h) give each (row, super-block) 8 int32 lanes, lane j summing
// scale * code * x over bytes 4j .. 4j + 3 of each of the eight 32-code vectors t, and one float
// fmadd a lane. Here the same 8 integers come from vpdpwssd on int16 pairs: each weight code
// times its scale (int16: at most 63 * 128), against the activation codes widened to int16;
// pair p = 16 t + 2 j + e (e = 0, 1) lands in lane j. Each output's lane j then takes the same
// fmadd (half(d) * dx, in float32 as the one-row kernel broadcasts it) in lane m of zmm j, and
// the final sum of the 8 lanes is hsum's tree: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
//
// The band's activations are prepared once a task (prepare256): per group of 16 rows and
// super-block, X[p] the 128 int16 pairs, S32[i] Q5_K's 32-sums' 4 pairs, D the 16 steps.
//
// Shape legend: a group of 16 rows m (lanes); NR weight rows n a tile; j < 8 the one-row
// kernel's int32 lanes; p < 128 int16 pairs of a super-block.
constexpr int64_t LANES = 16;

struct Prepared256 {  // one group of 16 rows, one super-block
    __m512i X[128], S32[4];
    __m512 D;
};

int64_t prepared256_bytes(int64_t M, int64_t K) {
    return (M + LANES - 1) / LANES * (K / 256) * static_cast<int64_t>(sizeof(Prepared256));
}

void prepare256(const XRow *xs, int64_t M, int64_t K, void *prepared) {
    const int64_t SB = K / 256, groups = (M + LANES - 1) / LANES;
    Prepared256 *P = static_cast<Prepared256 *>(prepared);
    for (int64_t q = 0; q < groups; q++)
        for (int64_t i = 0; i < SB; i++) {
            Prepared256 &p = P[q * SB + i];
            alignas(64) int32_t x[128][LANES], s32[4][LANES];
            alignas(64) float d[LANES];
            for (int64_t l = 0; l < LANES; l++) {
                const int64_t m = q * LANES + l;
                if (m >= M) {  // a ragged group's missing rows: zeros, their outputs never stored
                    for (int k = 0; k < 128; k++) x[k][l] = 0;
                    for (int k = 0; k < 4; k++) s32[k][l] = 0;
                    d[l] = 0.f;
                    continue;
                }
                alignas(64) int16_t wide[256];
                for (int t = 0; t < 8; t++)
                    _mm512_store_si512(wide + 32 * t, _mm512_cvtepi8_epi16(load(xs[m].q + 256 * i + 32 * t)));
                const int16_t *sums = xs[m].sums + 16 * i;
                int16_t sums32[8];
                for (int k = 0; k < 8; k++) sums32[k] = static_cast<int16_t>(sums[2 * k] + sums[2 * k + 1]);  // as vphaddw
                for (int k = 0; k < 128; k++) memcpy(&x[k][l], wide + 2 * k, 4);
                for (int k = 0; k < 4; k++) memcpy(&s32[k][l], sums32 + 2 * k, 4);
                d[l] = xs[m].d[i];
            }
            for (int k = 0; k < 128; k++) p.X[k] = _mm512_load_si512(x[k]);
            for (int k = 0; k < 4; k++) p.S32[k] = _mm512_load_si512(s32[k]);
            p.D = _mm512_load_ps(d);
        }
}

struct Weights256 {  // one weight row's super-block as the wide tile broadcasts it
    alignas(64) int32_t W[128];  // int16 pairs: code * scale
    int32_t E[8];                // Q5_K: the 8 minimums (int16 pairs E[4 .. 8))
    float d, dmin;
};

template <int64_t T>
inline void weights256(const uint8_t *block, Weights256 &w) {
    Unpacked256 u;
    unpack256<T>(block, u);
    const __m512i twice = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4,
                                           3, 3, 2, 2, 1, 1, 0, 0);  // int16 b takes scale lane b / 2
    for (int t = 0; t < 8; t++) {
        const __m512i scale = _mm512_permutexvar_epi16(twice, _mm512_castsi256_si512(u.scales[t]));
        const __m512i codes = T == IQ4_XS ? _mm512_cvtepi8_epi16(u.q[t]) : _mm512_cvtepu8_epi16(u.q[t]);  // IQ4_XS's are signed
        _mm512_store_si512(w.W + 16 * t, _mm512_mullo_epi16(codes, scale));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(w.E), u.extra);
    w.d = u.d;
    w.dmin = T == Q5_K ? u.dmin : 0.f;
}

inline __m512 tree8(const __m512 *a) {  // hsum's order over 8 lanes, lane by lane
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                         _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
}

template <int64_t T, int NR>
void wide256(const uint8_t *row, int64_t row_bytes, const XRow *, int64_t M, int64_t K, const void *prepared, float *out,
             int64_t ldo) {
    constexpr int64_t Z = block_bytes256<T>();
    constexpr int64_t GROUPS = BAND / LANES;
    const int64_t SB = K / 256, groups = (M + LANES - 1) / LANES;
    const Prepared256 *P = static_cast<const Prepared256 *>(prepared);
    static_assert(T == Q5_K || T == IQ4_XS, "Q2_K / Q3_K: block_grid_avx512.h's tile");
    __m512 acc[GROUPS][NR][8], mins4[T == Q5_K ? GROUPS : 1][NR][4];
    for (int64_t q = 0; q < groups; q++)
        for (int n = 0; n < NR; n++) {
            for (int j = 0; j < 8; j++) acc[q][n][j] = _mm512_setzero_ps();
            if constexpr (T == Q5_K) for (int j = 0; j < 4; j++) mins4[q][n][j] = _mm512_setzero_ps();
        }
    Weights256 w[NR];
    for (int64_t i = 0; i < SB; i++) {
        for (int n = 0; n < NR; n++) weights256<T>(row + n * row_bytes + i * Z, w[n]);
        for (int64_t q = 0; q < groups; q++) {
            const Prepared256 &p = P[q * SB + i];
            __m512 dd[NR];
            for (int n = 0; n < NR; n++) dd[n] = _mm512_mul_ps(_mm512_set1_ps(w[n].d), p.D);
            for (int j = 0; j < 8; j++) {
                __m512i s[NR];
                for (int n = 0; n < NR; n++) s[n] = _mm512_setzero_si512();
                for (int t = 0; t < 8; t++)
                    for (int e = 0; e < 2; e++) {
                        const int k = 16 * t + 2 * j + e;
                        const __m512i x = p.X[k];
                        for (int n = 0; n < NR; n++) s[n] = _mm512_dpwssd_epi32(s[n], x, _mm512_set1_epi32(w[n].W[k]));
                    }
                for (int n = 0; n < NR; n++) acc[q][n][j] = _mm512_fmadd_ps(dd[n], _mm512_cvtepi32_ps(s[n]), acc[q][n][j]);
            }
            if constexpr (T == Q5_K)
                for (int n = 0; n < NR; n++) {
                    const __m512 ddmin = _mm512_mul_ps(_mm512_set1_ps(w[n].dmin), p.D);
                    for (int k = 0; k < 4; k++) {
                        const __m512i msum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), p.S32[k], _mm512_set1_epi32(w[n].E[4 + k]));
                        mins4[q][n][k] = _mm512_fmadd_ps(ddmin, _mm512_cvtepi32_ps(msum), mins4[q][n][k]);
                    }
                }
        }
    }
    for (int64_t q = 0; q < groups; q++)
        for (int n = 0; n < NR; n++) {
            __m512 v = tree8(acc[q][n]);
            if constexpr (T == Q5_K)  // dot_k4's (m0 + m2) + (m1 + m3)
                v = _mm512_sub_ps(v, _mm512_add_ps(_mm512_add_ps(mins4[q][n][0], mins4[q][n][2]), _mm512_add_ps(mins4[q][n][1], mins4[q][n][3])));
            alignas(64) float lanes[LANES];
            _mm512_store_ps(lanes, v);
            for (int64_t l = 0; l < LANES && q * LANES + l < M; l++) out[(q * LANES + l) * ldo + n] = lanes[l];
        }
}

// -- Q6_K in zmm registers, two activation rows a register: take256's integer lanes (the
// one-row kernel's 8 int32 lanes of a row) in each 256-bit half of a zmm, the low half one
// activation row and the high half the next, the weights' codes and scales broadcast to both
// halves. Per 32 codes t the int16 pair sums of vpmaddubsw (as dot_q6_k) meet the scales in
// vpdpwssd, which adds them into lane j as vpmaddwd then vpaddd would: the same integers, so
// the same bits as the one-row kernel. A register block is PAIR_BLOCK pairs by the tile's NR
// weight rows; SB_CHUNK super-blocks of those rows are unpacked once for the whole band.
// Measured about 1.5x the ymm tile it replaces (one row a ymm register) at 512 rows, one
// thread (2048 x 2048, benchmarks/kernels/block_types.py --rows 512). IQ4_XS measured no
// faster in ymm registers (signed codes as int16 pairs, or a vpsignb a product) and keeps wide256.
//
// The band's activations are prepared once a product (prepare_pairs): per pair of rows and
// super-block, X[t] the two rows' 32 codes t side by side, S their 16-sums, D their steps
// (8 lanes each). A ragged band's odd last row pairs with zeros, its output never stored.
//
// Shape legend: a pair p of activation rows 2p, 2p + 1 (zmm halves); NR weight rows n a tile;
// t < 8 the 32-code vectors of a super-block.
constexpr int PAIR_BLOCK = 4;    // pairs of activation rows a register block (PAIR_BLOCK x NR zmm accumulators)
constexpr int64_t SB_CHUNK = 8;  // super-blocks of the weight rows unpacked at once (17 KiB for 4 rows: in L1)

struct Pair256 {  // one pair of activation rows, one super-block
    __m512i X[8], S;
    __m512 D;
};

int64_t pair_bytes(int64_t M, int64_t K) { return (M + 1) / 2 * (K / 256) * static_cast<int64_t>(sizeof(Pair256)); }

inline __m512i halves(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }

void prepare_pairs(const XRow *xs, int64_t M, int64_t K, void *prepared) {
    const int64_t SB = K / 256, pairs = (M + 1) / 2;
    Pair256 *P = static_cast<Pair256 *>(prepared);
    for (int64_t p = 0; p < pairs; p++) {
        const XRow &a = xs[2 * p];
        const XRow *b = 2 * p + 1 < M ? &xs[2 * p + 1] : nullptr;
        for (int64_t i = 0; i < SB; i++) {
            Pair256 &o = P[p * SB + i];
            for (int t = 0; t < 8; t++)
                o.X[t] = halves(load(a.q + 256 * i + 32 * t), b ? load(b->q + 256 * i + 32 * t) : _mm256_setzero_si256());
            o.S = halves(load(a.sums + 16 * i), b ? load(b->sums + 16 * i) : _mm256_setzero_si256());
            o.D = _mm512_insertf32x8(_mm512_set1_ps(a.d[i]), _mm256_set1_ps(b ? b->d[i] : 0.f), 1);
        }
    }
}

// Super-block i (unpacked: u[n]) into the accumulators of P pairs (x[p * SB]: pair p's super-block i).
template <int NR, int P>
inline __attribute__((always_inline)) void pairs_q6_k(const Unpacked256 *u, const Pair256 *x, int64_t SB, __m512 (*acc)[NR]) {
    __m512i sumi[P][NR];
    for (int p = 0; p < P; p++)
        for (int n = 0; n < NR; n++) sumi[p][n] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) {
        __m512i X[P];
        for (int p = 0; p < P; p++) X[p] = x[p * SB].X[t];
        for (int n = 0; n < NR; n++) {
            const __m512i q = _mm512_broadcast_i64x4(u[n].q[t]), scales = _mm512_broadcast_i64x4(u[n].scales[t]);
            for (int p = 0; p < P; p++) sumi[p][n] = _mm512_dpwssd_epi32(sumi[p][n], _mm512_maddubs_epi16(q, X[p]), scales);
        }
    }
    for (int p = 0; p < P; p++)
        for (int n = 0; n < NR; n++) {
            // the codes' offset of 32 (extra holds -32 times the 16 scales), as take256; half(d) * dx as the one-row kernel's product
            sumi[p][n] = _mm512_dpwssd_epi32(sumi[p][n], x[p * SB].S, _mm512_broadcast_i64x4(u[n].extra));
            const __m512 dd = _mm512_mul_ps(_mm512_set1_ps(u[n].d), x[p * SB].D);
            acc[p][n] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(sumi[p][n]), acc[p][n]);
        }
}

template <int NR>
void zmm_q6_k(const uint8_t *row, int64_t row_bytes, const XRow *, int64_t M, int64_t K, const void *prepared, float *out,
              int64_t ldo) {
    constexpr int64_t Z = sizeof(BlockQ6_K);
    const int64_t SB = K / 256, pairs = (M + 1) / 2;
    const Pair256 *X = static_cast<const Pair256 *>(prepared);
    __m512 acc[BAND / 2][NR];
    for (int64_t p = 0; p < pairs; p++)
        for (int n = 0; n < NR; n++) acc[p][n] = _mm512_setzero_ps();
    Unpacked256 u[SB_CHUNK][NR];
    for (int64_t i0 = 0; i0 < SB; i0 += SB_CHUNK) {
        const int64_t count = std::min(SB_CHUNK, SB - i0);
        for (int64_t c = 0; c < count; c++)
            for (int n = 0; n < NR; n++) {
                unpack256<Q6_K>(row + n * row_bytes + (i0 + c) * Z, u[c][n]);
                u[c][n].extra = _mm256_mullo_epi16(u[c][n].extra, _mm256_set1_epi16(-32));
            }
        int64_t p = 0;
        for (; p + PAIR_BLOCK <= pairs; p += PAIR_BLOCK)
            for (int64_t c = 0; c < count; c++) pairs_q6_k<NR, PAIR_BLOCK>(u[c], X + p * SB + i0 + c, SB, acc + p);
        for (int64_t c = 0; c < count; c++)
            switch (pairs - p) {  // a ragged band's last pairs
                case 1: pairs_q6_k<NR, 1>(u[c], X + p * SB + i0 + c, SB, acc + p); break;
                case 2: pairs_q6_k<NR, 2>(u[c], X + p * SB + i0 + c, SB, acc + p); break;
                case 3: pairs_q6_k<NR, 3>(u[c], X + p * SB + i0 + c, SB, acc + p); break;
                default: break;
            }
    }
    for (int64_t p = 0; p < pairs; p++)
        for (int n = 0; n < NR; n++) {
            out[2 * p * ldo + n] = hsum(_mm512_castps512_ps256(acc[p][n]));
            if (2 * p + 1 < M) out[(2 * p + 1) * ldo + n] = hsum(_mm512_extractf32x8_ps(acc[p][n], 1));
        }
}

// -- 32-blocks: one-row lane j is sum(w x) over bytes 4j .. 4j + 3 of the block (vpdpbusd on
// u = w + c, the activations' c sum4(x) taken off by starting from -c sum4(x): the same integer),
// the block's fmadd into accumulator g % 2, the minimum types' m * s into offset g % 2 -----------
template <int64_t T>
constexpr int wide_offset() { return T == Q4_1 || T == Q5_1 ? 0 : T == Q4_0 ? 8 : T == Q5_0 ? 16 : 128; }

struct Prepared32 {  // one group of 16 rows, one block
    __m512i X[8], B[8];  // the codes' dword j; -c times its 4 codes' sum
    __m512 D, S;         // the steps; d * sum(codes) (the minimum types' s)
};

int64_t prepared32_bytes(int64_t M, int64_t K) {
    return (M + LANES - 1) / LANES * (K / 32) * static_cast<int64_t>(sizeof(Prepared32));
}

template <int64_t T>
void prepare32(const XRow *xs, int64_t M, int64_t K, void *prepared) {
    const int64_t G = K / 32, groups = (M + LANES - 1) / LANES;
    Prepared32 *P = static_cast<Prepared32 *>(prepared);
    for (int64_t q = 0; q < groups; q++)
        for (int64_t g = 0; g < G; g++) {
            alignas(64) int32_t x[8][LANES], b[8][LANES];
            alignas(64) float d[LANES], s[LANES];
            for (int64_t l = 0; l < LANES; l++) {
                const int64_t m = q * LANES + l;
                for (int j = 0; j < 8; j++) {
                    if (m >= M) {  // a ragged group's missing rows: zeros, their outputs never stored
                        x[j][l] = b[j][l] = 0;
                        continue;
                    }
                    const int8_t *c = xs[m].q + 32 * g + 4 * j;
                    memcpy(&x[j][l], c, 4);
                    b[j][l] = -wide_offset<T>() * (c[0] + c[1] + c[2] + c[3]);
                }
                d[l] = m < M ? xs[m].d[g] : 0.f;
                s[l] = m < M && (T == Q4_1 || T == Q5_1) ? xs[m].s[g] : 0.f;
            }
            Prepared32 &p = P[q * G + g];
            for (int j = 0; j < 8; j++) p.X[j] = _mm512_load_si512(x[j]), p.B[j] = _mm512_load_si512(b[j]);
            p.D = _mm512_load_ps(d);
            p.S = _mm512_load_ps(s);
        }
}

template <int64_t T, int NR>
void wide32(const uint8_t *row, int64_t row_bytes, const XRow *, int64_t M, int64_t K, const void *prepared, float *out,
            int64_t ldo) {
    constexpr bool minimum = T == Q4_1 || T == Q5_1;
    constexpr int64_t Z = sizeof(typename Block32<T>::B), GROUPS = BAND / LANES;
    const int64_t G = K / 32, groups = (M + LANES - 1) / LANES;
    const Prepared32 *P = static_cast<const Prepared32 *>(prepared);
    __m512 acc[GROUPS][NR][2][8], offset[minimum ? GROUPS : 1][NR][2];
    for (int64_t q = 0; q < groups; q++)
        for (int n = 0; n < NR; n++)
            for (int e = 0; e < 2; e++) {
                for (int j = 0; j < 8; j++) acc[q][n][e][j] = _mm512_setzero_ps();
                if constexpr (minimum) offset[q][n][e] = _mm512_setzero_ps();
            }
    for (int64_t g = 0; g < G; g++) {
        const int e = static_cast<int>(g % 2);
        alignas(32) int32_t u[NR][8];
        float dw[NR], mw[NR];
        for (int n = 0; n < NR; n++) {
            const uint8_t *b = row + n * row_bytes + g * Z;
            __m256i codes = codes32<T>(b);
            if constexpr (!minimum) codes = _mm256_add_epi8(codes, _mm256_set1_epi8(static_cast<char>(wide_offset<T>())));
            _mm256_store_si256(reinterpret_cast<__m256i *>(u[n]), codes);
            uint16_t h;
            memcpy(&h, b, sizeof h);
            dw[n] = half(h);
            if constexpr (minimum) {
                memcpy(&h, b + 2, sizeof h);
                mw[n] = half(h);
            }
        }
        for (int64_t q = 0; q < groups; q++) {
            const Prepared32 &p = P[q * G + g];
            for (int n = 0; n < NR; n++) {
                const __m512 dd = _mm512_mul_ps(_mm512_set1_ps(dw[n]), p.D);
                for (int j = 0; j < 8; j++) {
                    const __m512i dots = _mm512_dpbusd_epi32(minimum ? _mm512_setzero_si512() : p.B[j], _mm512_set1_epi32(u[n][j]), p.X[j]);
                    acc[q][n][e][j] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dots), acc[q][n][e][j]);
                }
                if constexpr (minimum) offset[q][n][e] = _mm512_add_ps(offset[q][n][e], _mm512_mul_ps(_mm512_set1_ps(mw[n]), p.S));
            }
        }
    }
    for (int64_t q = 0; q < groups; q++)
        for (int n = 0; n < NR; n++) {
            __m512 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm512_add_ps(acc[q][n][0][j], acc[q][n][1][j]);
            __m512 v = tree8(a);
            if constexpr (minimum) v = _mm512_add_ps(v, _mm512_add_ps(offset[q][n][0], offset[q][n][1]));
            alignas(64) float lanes[LANES];
            _mm512_store_ps(lanes, v);
            for (int64_t l = 0; l < LANES && q * LANES + l < M; l++) out[(q * LANES + l) * ldo + n] = lanes[l];
        }
}

}  // namespace
}  // namespace blocks
}  // namespace qkv

#include "block_float_avx512.h"  // F16 / BF16: wide_rows_float, wide_tile_float
#include "block_grid_avx512.h"   // the grid types, Q2_K, Q3_K: wide_tile_grid

namespace qkv {
namespace blocks {
namespace {

// The wide tile of a type (Q6_K's of row pairs; Q4_K: none here), or {}.
template <int NR256, int NR32>
Tile wide_tile_for(int64_t type) {
    switch (type) {
        case Q5_K: return {wide256<Q5_K, NR256>, NR256, prepared256_bytes, prepare256};
        case Q6_K: return {zmm_q6_k<NR256>, NR256, pair_bytes, prepare_pairs};
        case IQ4_XS: return {wide256<IQ4_XS, NR256>, NR256, prepared256_bytes, prepare256};
        case Q4_0: return {wide32<Q4_0, NR32>, NR32, prepared32_bytes, prepare32<Q4_0>};
        case Q4_1: return {wide32<Q4_1, NR32>, NR32, prepared32_bytes, prepare32<Q4_1>};
        case Q5_0: return {wide32<Q5_0, NR32>, NR32, prepared32_bytes, prepare32<Q5_0>};
        case Q5_1: return {wide32<Q5_1, NR32>, NR32, prepared32_bytes, prepare32<Q5_1>};
        case Q8_0: return {wide32<Q8_0, NR32>, NR32, prepared32_bytes, prepare32<Q8_0>};
        case IQ4_NL: return {wide32<IQ4_NL, NR32>, NR32, prepared32_bytes, prepare32<IQ4_NL>};
        case F16: return {wide_tile_float<F16, WIDE_ROWS_FLOAT>, WIDE_ROWS_FLOAT, prepared_float_bytes, prepare_float, float_band_rows};
        case BF16: return {wide_tile_float<BF16, WIDE_ROWS_FLOAT>, WIDE_ROWS_FLOAT, prepared_float_bytes, prepare_float, float_band_rows};
        default: return wide_grid_tile_for(type);  // the grid types, Q2_K, Q3_K
    }
}


struct Avx512 {
    static __m256i dot4(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
};

}  // namespace

RowDot avx512_dot(int64_t type) {
    if (type == F16) return wide_dot_float<F16>;
    if (type == BF16) return wide_dot_float<BF16>;
    return dot_for<Avx512>(type);
}
RowsDot avx512_rows(int64_t type) {
    if (type == F16) return float_rows_by_k<wide_rows_float<F16, FOUR>, wide_dot_float<F16>>;
    if (type == BF16) return float_rows_by_k<wide_rows_float<BF16, FOUR>, wide_dot_float<BF16>>;
    return rows_for<Avx512>(type);
}
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
