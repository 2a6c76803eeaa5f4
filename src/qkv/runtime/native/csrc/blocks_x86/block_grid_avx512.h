// The AVX-512 variant's prompt tile for the grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
// IQ1_S, IQ1_M) and Q2_K / Q3_K (small codes, a multiplier per 16 or 32): sixteen activation rows
// in the lanes of a zmm register, four codes of one weight row broadcast against them by
// vpdpbusd. A part of block_avx512.cpp in a file of its own, which it includes inside its target
// region, after its helpers and before its table of tiles by type (include block_avx512.cpp).
//
// Why: block_grid_x86.h's ymm tile spends two multiplies (vpmaddubsw, vpmaddwd) on each 32
// products of one (weight row, activation row) pair. Here one vpdpbusd takes 4 codes of a weight
// row against 16 activation rows (64 products), and the sub-block's multiplier is applied once
// per 16 rows with vpmulld, as ggml's tiled kernels do. The integer sums are dot_grid's exactly
// and each output then takes grid_term's float operations (Q2_K / Q3_K: dot_k2's) in a lane of
// its accumulator i % 4 for super-block i, as the one-row kernels: every output has the bits of
// its row alone, and the generic reference's.
//
// Shape legend: NR weight rows n a tile; G = 16 activation rows r a group (one zmm); g < 64 the
// groups of 4 codes of a super-block; s a sub-block (SUB = 32 or 16 codes: one multiplier).
#pragma once

namespace qkv {
namespace blocks {
namespace {  // block_avx512.cpp's own, compiled for AVX-512

constexpr int64_t GRID_GROUP = 16;  // activation rows a zmm register holds
constexpr int64_t GRID_CODES = 256 * GRID_GROUP, GRID_STEPS = 4 * GRID_GROUP, GRID_SUMS = 4 * 8 * GRID_GROUP;
constexpr int64_t GRID_BAND_MAX = 1024;  // rows of a band (acc: 4 x NR x 1024 floats on the stack, 64 KiB)
constexpr int GRID_WIDE_ROWS = 4;

template <class B>
constexpr bool takes_sums() {  // Q2_K's minimums and Q3_K's codes' offset meet the activations' 16-sums
    return std::is_same_v<B, BlockQ2_K> || std::is_same_v<B, BlockQ3_K>;
}

template <class B>
constexpr int64_t group_bytes() {  // a super-block of a group of 16 rows in the prepared layout
    return GRID_CODES + GRID_STEPS + (takes_sums<B>() ? GRID_SUMS : 0);
}

// The prepared activations: per group of 16 rows (group-major, so a band is any whole number of
// groups from where it starts) and super-block i, the codes as unsigned bytes x + 128 with group
// g of 4 codes of row r at 64 g + 4 r, then the 16 rows' steps d_x (float32), then (Q2_K, Q3_K)
// the 16-sums as int16 pairs, pair p of row r at 64 p + 4 r. Rows past M: code 0 (byte 128),
// step 0, sums 0.
template <class B>
int64_t prepared_grid_bytes(int64_t M, int64_t K) { return (M + GRID_GROUP - 1) / GRID_GROUP * (K / 256) * group_bytes<B>(); }

template <class B>
void prepare_grid(const XRow *xs, int64_t M, int64_t K, void *prepared) {
    uint8_t *P = static_cast<uint8_t *>(prepared);
    const int64_t blocks = K / 256;
    for (int64_t m0 = 0; m0 < M; m0 += GRID_GROUP) {
        for (int64_t i = 0; i < blocks; i++) {
            uint8_t *at = P + (m0 / GRID_GROUP * blocks + i) * group_bytes<B>();
            float *steps = reinterpret_cast<float *>(at + GRID_CODES);
            uint8_t *sums = at + GRID_CODES + GRID_STEPS;
            for (int64_t r = 0; r < GRID_GROUP; r++) {
                if (m0 + r >= M) {
                    for (int g = 0; g < 64; g++) memset(at + 64 * g + 4 * r, 0x80, 4);
                    steps[r] = 0.f;
                    if constexpr (takes_sums<B>())
                        for (int p = 0; p < 8; p++) memset(sums + 64 * p + 4 * r, 0, 4);
                    continue;
                }
                const int8_t *c = xs[m0 + r].q + 256 * i;
                for (int g = 0; g < 64; g++) {
                    uint32_t four;
                    memcpy(&four, c + 4 * g, sizeof four);
                    four ^= 0x80808080u;  // x + 128 as unsigned bytes
                    memcpy(at + 64 * g + 4 * r, &four, sizeof four);
                }
                steps[r] = xs[m0 + r].d[i];
                if constexpr (takes_sums<B>())
                    for (int p = 0; p < 8; p++) memcpy(sums + 64 * p + 4 * r, xs[m0 + r].sums + 16 * i + 2 * p, 4);
            }
        }
    }
}

// Rows of x a band holds: every band unpacks each weight super-block once more, so as many as
// apply_blocks' row group gives (its rows' prepared bytes, about K a row, stay in L3): at K = 2048 a
// 512-row prompt in one band took 16.5 ms a 2048-row product on one thread, in bands of 240 rows 18.0.
int64_t grid_band_rows(int64_t) { return GRID_BAND_MAX; }

template <class B>
constexpr int grid_sub() {  // codes one multiplier covers
    return std::is_same_v<B, BlockIQ2_XS> || std::is_same_v<B, BlockIQ2_S> || std::is_same_v<B, BlockIQ1_M> || takes_sums<B>() ? 16 : 32;
}

// A weight row's super-block as the pass reads it: 256 signed codes, a multiplier per sub-block
// of 16 codes, 128 times the sum of multiplier times code (the x + 128's excess), d_w; Q2_K /
// Q3_K: the 16-sums' int16 weights in pairs (Q2_K: its minimums, with dmin; Q3_K: -4 times its
// scales, the codes' offset of 4).
struct GridRow {
    alignas(64) int8_t code[256];
    int32_t mult[16];
    int32_t offset;
    float d;
    int32_t extra[8];
    float dmin;
};

template <class B>
inline void unpack_grid(const B &b, GridRow &out) {
    const __m256i shift = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i offset = _mm256_setzero_si256();
    const GridHead head = grid_head(b);
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        const GridPart part = grid_part(b, head, s);
        const __m256i w = _mm256_sign_epi8(part.w, part.signs);
        _mm256_store_si256(reinterpret_cast<__m256i *>(out.code + 32 * s), w);
        out.mult[2 * s] = static_cast<int16_t>(_mm256_extract_epi16(part.mult, 0));  // the first 16 codes'
        out.mult[2 * s + 1] = static_cast<int16_t>(_mm256_extract_epi16(part.mult, 8));
        offset = _mm256_add_epi32(offset, _mm256_madd_epi16(_mm256_maddubs_epi16(shift, w), part.mult));
    }
    out.offset = hsum_i32(offset);
    out.d = half(iq_d(b));
}

// Q2_K / Q3_K's super-block: the codes of dot_k2 (Q3_K's 0 .. 7, its high bit at 4), their scales.
template <class B>
inline void unpack_k2(const B &b, GridRow &out) {
    constexpr bool q3 = std::is_same_v<B, BlockQ3_K>;
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), shift = _mm256_set1_epi8(static_cast<char>(0x80));
    __m128i sc8;
    __m256i extra;
    [[maybe_unused]] __m256i hm;
    if constexpr (q3) {
        sc8 = q3_scales(b.scales);
        hm = load(b.hmask);
        extra = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(sc8), _mm256_set1_epi16(-4));
        out.dmin = 0.f;
    } else {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b.scales));
        sc8 = _mm_and_si128(packed, _mm_set1_epi8(15));
        extra = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15)));
        out.dmin = half(b.dmin);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out.extra), extra);  // int16 pairs
    _mm512_storeu_si512(out.mult, q3 ? _mm512_cvtepi8_epi32(sc8) : _mm512_cvtepu8_epi32(sc8));
    const Scales16 scales = scales16(sc8, q3);
    __m256i offset = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i bits = load(b.qs + 32 * h);
        for (int t = 0; t < 4; t++) {  // codes 128 h + 32 t ..: sub-blocks 8 h + 2 t and 8 h + 2 t + 1
            __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * t), three);
            if constexpr (q3) q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + t), one), 2));
            _mm256_store_si256(reinterpret_cast<__m256i *>(out.code + 128 * h + 32 * t), q);
            offset = _mm256_add_epi32(offset, _mm256_madd_epi16(_mm256_maddubs_epi16(shift, q), pair_scales(scales, 8 * h + 2 * t)));
        }
    }
    out.offset = hsum_i32(offset);
    out.d = half(b.d);
}

// acc + vpdpbusd(x, 4 codes broadcast from memory): GCC 12 loads the broadcast into a register
// of its own (a vpbroadcastd a vpdpbusd, on the same pipes); the instruction's own {1to16}
// operand costs only the load.
inline __m512i dot4_broadcast(__m512i acc, __m512i x, const int8_t *four) {
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*reinterpret_cast<const int32_t *>(four)));
    return acc;
#else
    int32_t codes;
    memcpy(&codes, four, sizeof codes);
    return _mm512_dpbusd_epi32(acc, x, _mm512_set1_epi32(codes));
#endif
}

// One super-block of NR weight rows against T groups of activation rows (at[t]), its terms added
// to acc[n][16 t ..] (16 floats a group).
template <class B, int NR, int T>
__attribute__((noinline)) void grid_pass(const GridRow *w, const uint8_t *const *at, float *const *acc) {
    constexpr int SUB = grid_sub<B>();
    __m512i total[NR][T];
    for (int n = 0; n < NR; n++)
        for (int t = 0; t < T; t++) total[n][t] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int s = 0; s < 256 / SUB; s++) {
        __m512i part[NR][T];
        for (int n = 0; n < NR; n++)
            for (int t = 0; t < T; t++) part[n][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = s * SUB / 4; g < (s + 1) * SUB / 4; g++) {
            __m512i x[T];
            for (int t = 0; t < T; t++) x[t] = _mm512_load_si512(at[t] + 64 * g);
            for (int n = 0; n < NR; n++)
                for (int t = 0; t < T; t++) part[n][t] = dot4_broadcast(part[n][t], x[t], w[n].code + 4 * g);
        }
        for (int n = 0; n < NR; n++) {
            const __m512i m = _mm512_set1_epi32(SUB == 32 ? w[n].mult[2 * s] : w[n].mult[s]);
            for (int t = 0; t < T; t++) total[n][t] = _mm512_add_epi32(total[n][t], _mm512_mullo_epi32(part[n][t], m));
        }
    }
    for (int t = 0; t < T; t++) {
        const float *steps = reinterpret_cast<const float *>(at[t] + GRID_CODES);
        const __m512 d_x = _mm512_load_ps(steps);
        for (int n = 0; n < NR; n++) {
            __m512i isum = _mm512_sub_epi32(total[n][t], _mm512_set1_epi32(w[n].offset));
            float *a = acc[n] + GRID_GROUP * t;
            if constexpr (takes_sums<B>()) {  // dot_k2's: + (d_w d_x) isum, Q2_K: - (dmin_w d_x) msum
                const uint8_t *sums = at[t] + GRID_CODES + GRID_STEPS;
                __m512i extra = _mm512_setzero_si512();
                for (int p = 0; p < 8; p++)
                    extra = _mm512_dpwssd_epi32(extra, _mm512_load_si512(sums + 64 * p), _mm512_set1_epi32(w[n].extra[p]));
                if constexpr (std::is_same_v<B, BlockQ3_K>) isum = _mm512_add_epi32(isum, extra);
                __m512 v = _mm512_add_ps(_mm512_load_ps(a), _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(w[n].d), d_x), _mm512_cvtepi32_ps(isum)));
                if constexpr (std::is_same_v<B, BlockQ2_K>)
                    v = _mm512_sub_ps(v, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(w[n].dmin), d_x), _mm512_cvtepi32_ps(extra)));
                _mm512_store_ps(a, v);
            } else {
                const __m512 inverse = _mm512_set1_ps(1.f / static_cast<float>(IqDivisor<B>::value));
                const __m512 term = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(w[n].d), d_x),
                                                  _mm512_mul_ps(_mm512_cvtepi32_ps(isum), inverse));  // grid_term's
                _mm512_store_ps(a, _mm512_add_ps(_mm512_load_ps(a), term));
            }
        }
    }
}

// The tile (block_format.h's Tile): NR weight rows against the band's M rows as prepare_grid laid
// them out; each super-block of the weight rows unpacked once for the band.
template <class B, int NR>
void wide_tile_grid(const uint8_t *row, int64_t row_bytes, const XRow *, int64_t M, int64_t K, const void *prepared, float *out,
                    int64_t ldo) {
    const int64_t blocks = K / 256, groups = (M + GRID_GROUP - 1) / GRID_GROUP;
    const uint8_t *P = static_cast<const uint8_t *>(prepared);
    alignas(64) float acc[4][NR][GRID_BAND_MAX];  // the one-row kernels' accumulator i % 4 of super-block i
    for (int a = 0; a < 4; a++)
        for (int n = 0; n < NR; n++) memset(acc[a][n], 0, static_cast<size_t>(groups * GRID_GROUP) * sizeof(float));
    GridRow w[NR];
    for (int64_t i = 0; i < blocks; i++) {
        for (int n = 0; n < NR; n++) {
            const B &b = *reinterpret_cast<const B *>(row + n * row_bytes + i * static_cast<int64_t>(sizeof(B)));
            if constexpr (takes_sums<B>()) unpack_k2(b, w[n]);
            else unpack_grid(b, w[n]);
        }
        int64_t t = 0;
        for (; t + 2 <= groups; t += 2) {
            const uint8_t *at[2] = {P + (t * blocks + i) * group_bytes<B>(), P + ((t + 1) * blocks + i) * group_bytes<B>()};
            float *sums[NR];
            for (int n = 0; n < NR; n++) sums[n] = acc[i % 4][n] + GRID_GROUP * t;
            grid_pass<B, NR, 2>(w, at, sums);
        }
        if (t < groups) {
            const uint8_t *at[1] = {P + (t * blocks + i) * group_bytes<B>()};
            float *sums[NR];
            for (int n = 0; n < NR; n++) sums[n] = acc[i % 4][n] + GRID_GROUP * t;
            grid_pass<B, NR, 1>(w, at, sums);
        }
    }
    for (int n = 0; n < NR; n++)  // (a0 + a2) + (a1 + a3), sixteen rows at a time
        for (int64_t m = 0; m < groups * GRID_GROUP; m += GRID_GROUP)
            _mm512_store_ps(acc[0][n] + m, _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(acc[0][n] + m), _mm512_load_ps(acc[2][n] + m)),
                                                         _mm512_add_ps(_mm512_load_ps(acc[1][n] + m), _mm512_load_ps(acc[3][n] + m))));
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < NR; n++) out[m * ldo + n] = acc[0][n][m];
}

template <class B>
Tile wide_grid_tile() {
    constexpr int NR = GRID_WIDE_ROWS;
    return {wide_tile_grid<B, NR>, NR, prepared_grid_bytes<B>, prepare_grid<B>, grid_band_rows};
}

inline Tile wide_grid_tile_for(int64_t type) {
    switch (type) {
        case IQ2_XXS: return wide_grid_tile<BlockIQ2_XXS>();
        case IQ2_XS: return wide_grid_tile<BlockIQ2_XS>();
        case IQ2_S: return wide_grid_tile<BlockIQ2_S>();
        case IQ3_XXS: return wide_grid_tile<BlockIQ3_XXS>();
        case IQ3_S: return wide_grid_tile<BlockIQ3_S>();
        case IQ1_S: return wide_grid_tile<BlockIQ1_S>();
        case IQ1_M: return wide_grid_tile<BlockIQ1_M>();
        case Q2_K: return wide_grid_tile<BlockQ2_K>();
        case Q3_K: return wide_grid_tile<BlockQ3_K>();
        default: return {};
    }
}

}  // namespace
}  // namespace blocks
}  // namespace qkv
