// The x86 dot products of the grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) on
// activations rounded per 256: a part of block_x86.h in a file of its own, which block_x86.h
// includes after its helpers and before its table of kernels by type (include block_x86.h).
#pragma once

namespace qkv {
namespace blocks {
namespace {  // each variant's file has its own copies, compiled for its own instruction set

// The grid types (block_format.h's iq_codes says the math): per 32 weights, the four grid rows
// of 8 magnitudes (IQ2, IQ3: two rows of 4 a group) in one register, the 32 signs as +-1
// bytes (sign bits spread, or 7-bit sign indices' rows of a table) put on the activations
// (|w| times sign(w) x: magnitudes are below 64, no int16 saturation), the sub-block's
// multiplier (per 32, or per 16: one a 128-bit lane) applied in vpmaddwd; IQ1's signed codes
// 8 g +- 1 the same way, as |w| and sign(w). The integer sums are iq_codes' exactly.
// A sub-block's grid rows by scalar loads (a gather measured 1.1-1.6x slower for all but IQ3_S
// on a Zen 4): four rows of 8 (uint64, IQ2 and IQ1_S) or eight rows of 4 (uint32, IQ3) in one register.
inline __m256i rows8(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return _mm256_setr_epi64x(static_cast<long long>(a), static_cast<long long>(b), static_cast<long long>(c), static_cast<long long>(d));
}

inline __m256i rows4x8(const uint32_t *grid, const uint8_t *index) {  // rows index[0 .. 8) of a grid of 4
    return _mm256_setr_epi32(static_cast<int>(grid[index[0]]), static_cast<int>(grid[index[1]]), static_cast<int>(grid[index[2]]),
                             static_cast<int>(grid[index[3]]), static_cast<int>(grid[index[4]]), static_cast<int>(grid[index[5]]),
                             static_cast<int>(grid[index[6]]), static_cast<int>(grid[index[7]]));
}

// The 8 sign bytes (+1 or -1) of each 7-bit sign index with its parity bit (seven_signs),
// computed by the compiler: four indices' 32 bytes by four loads, ready for vpsignb.
struct SignBytes { uint64_t row[128]; };
constexpr SignBytes sign_bytes_table() {
    SignBytes t{};
    for (int k = 0; k < 128; k++)
        for (int j = 0; j < 8; j++) t.row[k] |= static_cast<uint64_t>((SEVEN_SIGNS.byte[k] >> j) & 1 ? 0xFF : 0x01) << (8 * j);
    return t;
}
alignas(64) inline constexpr SignBytes SIGN_BYTES = sign_bytes_table();

inline __m256i seven_sign_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    return rows8(SIGN_BYTES.row[a & 127], SIGN_BYTES.row[b & 127], SIGN_BYTES.row[c & 127], SIGN_BYTES.row[d & 127]);
}

inline __m256i sign_bits(const uint8_t *p) {  // 4 bytes of sign bits -> 32 bytes: -1 where set, +1 where clear
    return _mm256_or_si256(bit_bytes(p), _mm256_set1_epi8(1));
}

// The multipliers of a per-16 type's super-block (IQ2_XS, IQ2_S, IQ1_M), computed once for its
// 8 sub-blocks: register c holds sub-blocks 4 c .. 4 c + 3, int32 lane 2 t + e the multiplier of
// half e (the first or last 16 codes) of sub-block 4 c + t, in both 16-bit halves; a sub-block's
// multipliers are then one permute (instead of scalar shifts and two broadcasts a sub-block).
struct GridHead {
    __m256i part[2];
};

inline __m256i odd_pairs(__m256i m) {  // int32 lanes m -> 2 m + 1 in both 16-bit halves
    const __m256i odd = _mm256_add_epi32(_mm256_slli_epi32(m, 1), _mm256_set1_epi32(1));
    return _mm256_or_si256(odd, _mm256_slli_epi32(odd, 16));
}

template <class B>
inline GridHead grid_head(const B &b) {
    GridHead head{};
    if constexpr (std::is_same_v<B, BlockIQ2_XS> || std::is_same_v<B, BlockIQ2_S>) {  // nibble e of scales[s]
        for (int c = 0; c < 2; c++) {
            uint32_t four;
            memcpy(&four, b.scales + 4 * c, sizeof four);
            const __m256i bytes = _mm256_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(four)));
            const __m256i spread = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
            head.part[c] = odd_pairs(_mm256_and_si256(_mm256_srlv_epi32(spread, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
                                                      _mm256_set1_epi32(15)));
        }
    } else if constexpr (std::is_same_v<B, BlockIQ1_M>) {  // 3-bit field j at 3 (j % 4) of scales[j / 4]
        const __m256i words = _mm256_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(b.scales)));
        for (int c = 0; c < 2; c++) {
            const __m256i spread = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1,
                                                                                         2 * c + 1, 2 * c + 1, 2 * c + 1));
            head.part[c] = odd_pairs(_mm256_and_si256(_mm256_srlv_epi32(spread, _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9)),
                                                      _mm256_set1_epi32(7)));
        }
    }
    (void)b;
    return head;
}

inline __m256i head_multipliers(const GridHead &head, int s) {  // multipliers(first 16's, last 16's) of sub-block s
    const int t = 2 * (s % 4);
    return _mm256_permutevar8x32_epi32(head.part[s / 4], _mm256_setr_epi32(t, t, t, t, t + 1, t + 1, t + 1, t + 1));
}

// A sub-block's weights as the products take them: magnitudes w (unsigned bytes), the signs
// put on the activations (bytes whose sign is the weight's, never 0), the int16 multipliers.
struct GridPart {
    __m256i w, signs, mult;
};

template <class B>
inline GridPart grid_part(const B &b, const GridHead &head, int s) {  // sub-block s: weights 32 s .. 32 s + 31
    if constexpr (std::is_same_v<B, BlockIQ2_XXS>) {
        const uint8_t *p = b.qs + 8 * s;
        uint32_t aux;
        memcpy(&aux, p + 4, sizeof aux);
        const __m256i w = rows8(IQ2_XXS_GRID[p[0]], IQ2_XXS_GRID[p[1]], IQ2_XXS_GRID[p[2]], IQ2_XXS_GRID[p[3]]);
        return {w, seven_sign_bytes(aux, aux >> 7, aux >> 14, aux >> 21),
                _mm256_set1_epi16(static_cast<short>(2 * (aux >> 28) + 1))};
    } else if constexpr (std::is_same_v<B, BlockIQ3_XXS>) {
        const uint8_t *p = b.qs + 8 * s;
        uint32_t aux;
        memcpy(&aux, b.scales_signs + 4 * s, sizeof aux);
        const __m256i w = rows4x8(IQ3_XXS_GRID, p);
        return {w, seven_sign_bytes(aux, aux >> 7, aux >> 14, aux >> 21),
                _mm256_set1_epi16(static_cast<short>(2 * (aux >> 28) + 1))};
    } else if constexpr (std::is_same_v<B, BlockIQ2_XS>) {
        const uint16_t *q = b.qs + 4 * s;
        const __m256i w = rows8(IQ2_XS_GRID[q[0] & 511], IQ2_XS_GRID[q[1] & 511], IQ2_XS_GRID[q[2] & 511], IQ2_XS_GRID[q[3] & 511]);
        return {w, seven_sign_bytes(q[0] >> 9, q[1] >> 9, q[2] >> 9, q[3] >> 9), head_multipliers(head, s)};
    } else if constexpr (std::is_same_v<B, BlockIQ2_S>) {  // index l: qs byte | bits 2l .. 2l + 1 of qh[s] << 8
        const uint8_t *q = b.qs + 4 * s;
        const int h = b.qh[s];
        const __m256i w = rows8(IQ2_S_GRID[q[0] | ((h << 8) & 0x300)], IQ2_S_GRID[q[1] | ((h << 6) & 0x300)],
                                IQ2_S_GRID[q[2] | ((h << 4) & 0x300)], IQ2_S_GRID[q[3] | ((h << 2) & 0x300)]);
        return {w, sign_bits(b.signs + 4 * s), head_multipliers(head, s)};
    } else if constexpr (std::is_same_v<B, BlockIQ3_S>) {  // index k: qs byte | bit k of qh[s] << 8, eight at once
        const __m256i high = _mm256_srlv_epi32(_mm256_set1_epi32(b.qh[s]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(b.qs + 8 * s)));
        const __m256i index = _mm256_or_si256(bytes, _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), 8));
        const __m256i w = _mm256_i32gather_epi32(reinterpret_cast<const int *>(IQ3_S_GRID), index, 4);  // here a gather measured faster
        const int m = 2 * ((b.scales[s / 2] >> (4 * (s % 2))) & 15) + 1;
        return {w, sign_bits(b.signs + 4 * s), _mm256_set1_epi16(static_cast<short>(m))};
    } else if constexpr (std::is_same_v<B, BlockIQ1_M>) {  // group 4 s + l: nibble l of qh's 16 bits, 3 index bits and the delta sign
        const uint8_t *q = b.qs + 4 * s;
        const int h = b.qh[2 * s] | (b.qh[2 * s + 1] << 8);  // iq1_m_field of groups 4 s .. 4 s + 3
        const __m256i g = rows8(IQ1_S_GRID[q[0] | ((h << 8) & 0x700)], IQ1_S_GRID[q[1] | ((h << 4) & 0x700)],
                                IQ1_S_GRID[q[2] | (h & 0x700)], IQ1_S_GRID[q[3] | ((h >> 4) & 0x700)]);
        // bit 4 l + 3 of h to byte 0 of 64-bit lane l, spread over its 8 bytes: 1 - 2 bit, +1 or -1
        const __m256i bit = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(h), _mm256_setr_epi64x(3, 7, 11, 15)),
                                             _mm256_set1_epi64x(1));
        const __m256i bits = _mm256_shuffle_epi8(bit, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0,
                                                                       0, 0, 8, 8, 8, 8, 8, 8, 8, 8));
        const __m256i delta = _mm256_sub_epi8(_mm256_set1_epi8(1), _mm256_add_epi8(bits, bits));
        const __m256i w = _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), delta);  // 8 g +- 1
        return {_mm256_sign_epi8(w, w), w, head_multipliers(head, s)};
    } else {  // IQ1_S: index l: qs byte | bits 3l .. 3l + 2 of qh[s] << 8; codes 8 g +- 1
        const uint8_t *q = b.qs + 4 * s;
        const int h = b.qh[s];
        const __m256i g = rows8(IQ1_S_GRID[q[0] | ((h << 8) & 0x700)], IQ1_S_GRID[q[1] | ((h << 5) & 0x700)],
                                IQ1_S_GRID[q[2] | ((h << 2) & 0x700)], IQ1_S_GRID[q[3] | ((h >> 1) & 0x700)]);
        const __m256i w = _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g),
                                          _mm256_set1_epi8(static_cast<char>(1 - 2 * ((h >> 15) & 1))));  // 8 g +- 1, no branch
        return {_mm256_sign_epi8(w, w), w, _mm256_set1_epi16(static_cast<short>(2 * ((h >> 12) & 7) + 1))};  // |w|, sign(w): odd, never 0
    }
}


inline __m256i grid_products(const GridPart &part, __m256i x) {  // 8 int32 partial sums of a sub-block
    return _mm256_madd_epi16(_mm256_maddubs_epi16(part.w, _mm256_sign_epi8(x, part.signs)), part.mult);
}

// A super-block's share of an output as the generic reference (block_format.cpp's dot_iq) adds
// it: (d_w d_x) times (the exact integer sum over the type's divisor, a power of 2). Every
// variant, one row or a tile, takes these float operations in this order: the same bits.
template <class B>
inline float grid_term(const B &b, float dx, int32_t isum) {
    return (half(iq_d(b)) * dx) * (static_cast<float>(isum) * (1.f / static_cast<float>(IqDivisor<B>::value)));
}

template <class B>
inline __m256i grid_sums(const B &b, const int8_t *c) {  // a super-block's 8 int32 lanes against codes c
    const GridHead head = grid_head(b);
    __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) sumi = _mm256_add_epi32(sumi, grid_products(grid_part(b, head, s), load(c + 32 * s)));
    return sumi;
}

// Four super-blocks at a time: their totals reduced together and their grid_terms computed side
// by side, each added to its own lane (block_format.cpp's dot_iq: acc[i % 4], then (a0 + a2) +
// (a1 + a3)), so every variant, one row or a prompt's tile, gives the generic bits.
template <class B>
float dot_grid(const uint8_t *row, const XRow &x, int64_t K) {
    const B *b = reinterpret_cast<const B *>(row);
    const int64_t blocks = K / 256;
    const __m128 inverse = _mm_set1_ps(1.f / static_cast<float>(IqDivisor<B>::value));
    __m128 acc = _mm_setzero_ps();
    int64_t i0 = 0;
    for (; i0 + 4 <= blocks; i0 += 4) {
        __m256i sums[4];
#pragma GCC unroll 1
        for (int j = 0; j < 4; j++) sums[j] = grid_sums(b[i0 + j], x.q + 256 * (i0 + j));  // one at a time: fewer registers live
        const __m128i total = totals4(sums[0], sums[1], sums[2], sums[3]);
        const __m128 d_w = _mm_setr_ps(half(iq_d(b[i0])), half(iq_d(b[i0 + 1])), half(iq_d(b[i0 + 2])), half(iq_d(b[i0 + 3])));
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(d_w, _mm_loadu_ps(x.d + i0)), _mm_mul_ps(_mm_cvtepi32_ps(total), inverse)));
    }
    alignas(16) float a[4];
    _mm_store_ps(a, acc);
    for (int64_t i = i0; i < blocks; i++) a[i % 4] += grid_term(b[i], x.d[i], hsum_i32(grid_sums(b[i], x.q + 256 * i)));
    return four_accumulators(a);
}

// A prompt's tile (block_format.h's Tile): each super-block of the NR = 4 weight rows unpacked
// once for the band of M activation rows, as signed codes w (sign(w) |w|) and multipliers. A row's
// codes are shifted to unsigned bytes once for the weight rows, x + 128, and multiplied by
// the signed codes: vpmaddubsw((x + 128), w) = x w + 128 w per pair (below 255 * 62 * 2: no
// saturation), so each lane is dot_grid's lane plus 128 m sum(w), which the unpacking sums
// once per weight row (`offset`) and each output takes off. The four rows' exact totals then
// take grid_term's float operations side by side in one register: each output's bits are its
// row's alone.
template <class B, int NR>
void tile_grid(const uint8_t *row, int64_t row_bytes, const XRow *xs, int64_t M, int64_t K, const void *, float *out, int64_t ldo) {
    static_assert(NR == 4, "the four rows' totals share one register");
    __m128 acc[BAND][4];  // the four rows' lanes; dot_grid's accumulator i % 4 of super-block i
    for (int64_t m = 0; m < M; m++)
        for (int a = 0; a < 4; a++) acc[m][a] = _mm_setzero_ps();
    __m256i w[NR][8], mult[NR][8], offset[NR];
    const __m256i shift = _mm256_set1_epi8(static_cast<char>(0x80));
    const __m128 inverse = _mm_set1_ps(1.f / static_cast<float>(IqDivisor<B>::value));
    for (int64_t i = 0; i < K / 256; i++) {
        float dw[NR];
        for (int n = 0; n < NR; n++) {
            const B &b = *reinterpret_cast<const B *>(row + n * row_bytes + i * static_cast<int64_t>(sizeof(B)));
            dw[n] = half(iq_d(b));
            offset[n] = _mm256_setzero_si256();
            const GridHead head = grid_head(b);
#pragma GCC unroll 8
            for (int s = 0; s < 8; s++) {
                const GridPart part = grid_part(b, head, s);
                w[n][s] = _mm256_sign_epi8(part.w, part.signs);
                mult[n][s] = part.mult;
                offset[n] = _mm256_add_epi32(offset[n], _mm256_madd_epi16(_mm256_maddubs_epi16(shift, w[n][s]), part.mult));
            }
        }
        const __m128 d_w = _mm_loadu_ps(dw);
        for (int64_t m = 0; m < M; m++) {
            const int8_t *c = xs[m].q + 256 * i;
            __m256i sumi[NR];
            for (int n = 0; n < NR; n++) sumi[n] = _mm256_sub_epi32(_mm256_setzero_si256(), offset[n]);
            for (int s = 0; s < 8; s++) {
                const __m256i x = _mm256_xor_si256(load(c + 32 * s), shift);  // x + 128 as unsigned bytes
                for (int n = 0; n < NR; n++)
                    sumi[n] = _mm256_add_epi32(sumi[n], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w[n][s]), mult[n][s]));
            }
            const __m128 total = _mm_cvtepi32_ps(totals4(sumi[0], sumi[1], sumi[2], sumi[3]));
            const __m128 term = _mm_mul_ps(_mm_mul_ps(d_w, _mm_set1_ps(xs[m].d[i])), _mm_mul_ps(total, inverse));  // grid_term's
            acc[m][i % 4] = _mm_add_ps(acc[m][i % 4], term);
        }
    }
    for (int64_t m = 0; m < M; m++)
        _mm_storeu_ps(out + m * ldo, four_accumulators(acc[m]));
}

constexpr int GRID_TILE_ROWS = 4;

inline Tile grid_tile_for(int64_t type) {
    switch (type) {
        case IQ2_XXS: return {tile_grid<BlockIQ2_XXS, GRID_TILE_ROWS>, GRID_TILE_ROWS};
        case IQ2_XS: return {tile_grid<BlockIQ2_XS, GRID_TILE_ROWS>, GRID_TILE_ROWS};
        case IQ2_S: return {tile_grid<BlockIQ2_S, GRID_TILE_ROWS>, GRID_TILE_ROWS};
        case IQ3_XXS: return {tile_grid<BlockIQ3_XXS, GRID_TILE_ROWS>, GRID_TILE_ROWS};
        case IQ3_S: return {tile_grid<BlockIQ3_S, GRID_TILE_ROWS>, GRID_TILE_ROWS};
        case IQ1_S: return {tile_grid<BlockIQ1_S, GRID_TILE_ROWS>, GRID_TILE_ROWS};
        case IQ1_M: return {tile_grid<BlockIQ1_M, GRID_TILE_ROWS>, GRID_TILE_ROWS};
        default: return {};
    }
}

}  // namespace
}  // namespace blocks
}  // namespace qkv
