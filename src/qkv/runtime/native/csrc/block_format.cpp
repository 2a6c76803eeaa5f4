// The block-format table (block_format.h): each type's generic decode (the gguf library's
// float32 operations, no fused multiply-add: the file turns contraction off), the activations'
// rounding, and the generic C++ reference of each type's dot product on rounded activations.
#include "block_format.h"
#include "kernels.h"
#include "repacked/iq4xs.h"
#include "repacked/q4k.h"
#include "repacked/q6k.h"
#include "repacked/q8_0.h"

#include <math.h>
#include <string.h>

#include <type_traits>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace qkv {
namespace blocks {
namespace {

inline float f16(uint16_t h) { return half_to_float(h); }

template <class B>
inline const B &at(const uint8_t *p) { return *reinterpret_cast<const B *>(p); }

// -- the generic decode: out[0 .. W) --------------------------------------------------------
void decode_q4_0(const uint8_t *p, float *out) {
    const BlockQ4_0 &b = at<BlockQ4_0>(p);
    const float d = f16(b.d);
    for (int j = 0; j < 16; j++) {
        out[j] = d * static_cast<float>((b.qs[j] & 15) - 8);
        out[j + 16] = d * static_cast<float>((b.qs[j] >> 4) - 8);
    }
}

void decode_q4_1(const uint8_t *p, float *out) {
    const BlockQ4_1 &b = at<BlockQ4_1>(p);
    const float d = f16(b.d), m = f16(b.m);
    for (int j = 0; j < 16; j++) {
        out[j] = d * static_cast<float>(b.qs[j] & 15) + m;
        out[j + 16] = d * static_cast<float>(b.qs[j] >> 4) + m;
    }
}

template <class B>
void q5_codes(const B &b, int *q) {  // 0..31 in weight order
    const uint32_t high = le32(b.qh);
    for (int j = 0; j < 16; j++) {
        q[j] = (b.qs[j] & 15) | (((high >> j) & 1) << 4);
        q[j + 16] = (b.qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
    }
}

void decode_q5_0(const uint8_t *p, float *out) {
    const BlockQ5_0 &b = at<BlockQ5_0>(p);
    int q[32];
    q5_codes(b, q);
    const float d = f16(b.d);
    for (int j = 0; j < 32; j++) out[j] = d * static_cast<float>(q[j] - 16);
}

void decode_q5_1(const uint8_t *p, float *out) {
    const BlockQ5_1 &b = at<BlockQ5_1>(p);
    int q[32];
    q5_codes(b, q);
    const float d = f16(b.d), m = f16(b.m);
    for (int j = 0; j < 32; j++) out[j] = d * static_cast<float>(q[j]) + m;
}

void decode_q8_0(const uint8_t *p, float *out) {
    const BlockQ8_0 &b = at<BlockQ8_0>(p);
    const float d = f16(b.d);
    for (int j = 0; j < 32; j++) out[j] = static_cast<float>(b.qs[j]) * d;
}

void decode_iq4_nl(const uint8_t *p, float *out) {
    const BlockIQ4_NL &b = at<BlockIQ4_NL>(p);
    const float d = f16(b.d);
    for (int j = 0; j < 16; j++) {
        out[j] = d * static_cast<float>(IQ4_NL_VALUES[b.qs[j] & 15]);
        out[j + 16] = d * static_cast<float>(IQ4_NL_VALUES[b.qs[j] >> 4]);
    }
}

// Q2_K / Q3_K / Q6_K weight w = 16 s + i = 128 h + 32 t + r: its 2-bit field is bits 2t of byte 32 h + r.
inline int two_bits(const uint8_t *qs, int w) { return (qs[32 * (w / 128) + w % 32] >> (2 * ((w / 32) % 4))) & 3; }

void decode_q2_k(const uint8_t *p, float *out) {
    const BlockQ2_K &b = at<BlockQ2_K>(p);
    const float d = f16(b.d), dmin = f16(b.dmin);
    for (int s = 0; s < 16; s++) {
        const float dl = d * static_cast<float>(b.scales[s] & 15), ml = dmin * static_cast<float>(b.scales[s] >> 4);
        for (int i = 0; i < 16; i++) out[16 * s + i] = dl * static_cast<float>(two_bits(b.qs, 16 * s + i)) - ml;
    }
}

inline int q3_code(const BlockQ3_K &b, int w) {  // -4 .. 3
    return two_bits(b.qs, w) - 4 * (((b.hmask[w % 32] >> (w / 32)) & 1) ^ 1);
}

void decode_q3_k(const uint8_t *p, float *out) {
    const BlockQ3_K &b = at<BlockQ3_K>(p);
    const float d = f16(b.d);
    for (int s = 0; s < 16; s++) {
        const float dl = d * static_cast<float>(q3_scale(b.scales, s) - 32);
        for (int i = 0; i < 16; i++) out[16 * s + i] = dl * static_cast<float>(q3_code(b, 16 * s + i));
    }
}

template <class B>
int k4_code(const B &b, int w) {  // Q4_K / Q5_K weight w = 32 j + i: 0..15 (0..31)
    int v = (b.qs[32 * (w / 64) + w % 32] >> (4 * ((w / 32) % 2))) & 15;
    if constexpr (sizeof(B) == sizeof(BlockQ5_K)) v |= ((b.qh[w % 32] >> (w / 32)) & 1) << 4;
    return v;
}

template <class B>
void decode_k4(const uint8_t *p, float *out) {
    const B &b = at<B>(p);
    uint8_t sc[8], mn[8];
    scale_min_k4(b.scales, sc, mn);
    const float d = f16(b.d), dmin = f16(b.dmin);
    for (int j = 0; j < 8; j++) {
        const float dl = d * static_cast<float>(sc[j]), ml = dmin * static_cast<float>(mn[j]);
        for (int i = 0; i < 32; i++) out[32 * j + i] = dl * static_cast<float>(k4_code(b, 32 * j + i)) - ml;
    }
}

inline int q6_code(const BlockQ6_K &b, int w) {  // 0..63, less 32 in the weight
    const int h = w / 128, t = (w / 32) % 4, r = w % 32;
    return ((b.ql[64 * h + 32 * (t % 2) + r] >> (4 * (t / 2))) & 15) | (two_bits(b.qh, w) << 4);
}

void decode_q6_k(const uint8_t *p, float *out) {
    const BlockQ6_K &b = at<BlockQ6_K>(p);
    const float d = f16(b.d);
    for (int s = 0; s < 16; s++) {
        const float dl = d * static_cast<float>(b.scales[s]);
        for (int i = 0; i < 16; i++) out[16 * s + i] = dl * static_cast<float>(q6_code(b, 16 * s + i) - 32);
    }
}

void decode_iq4_xs(const uint8_t *p, float *out) {
    const BlockIQ4_XS &b = at<BlockIQ4_XS>(p);
    const float d = f16(b.d);
    for (int s = 0; s < 8; s++) {
        const float dl = d * static_cast<float>(iq4_xs_scale(b, s) - 32);
        for (int j = 0; j < 16; j++) {
            out[32 * s + j] = dl * static_cast<float>(IQ4_NL_VALUES[b.qs[16 * s + j] & 15]);
            out[32 * s + j + 16] = dl * static_cast<float>(IQ4_NL_VALUES[b.qs[16 * s + j] >> 4]);
        }
    }
}

// The grid types: d times each weight's multiplier and code over the divisor (block_format.h), exact.
template <class B>
void decode_iq(const uint8_t *p, float *out) {
    const B &b = at<B>(p);
    int8_t q[256];
    int16_t mult[16];
    iq_codes(b, q, mult);
    const float d = f16(iq_d(b)) / static_cast<float>(IqDivisor<B>::value);
    for (int s = 0; s < 16; s++) {
        const float dl = d * static_cast<float>(mult[s]);
        for (int i = 0; i < 16; i++) out[16 * s + i] = dl * static_cast<float>(q[16 * s + i]);
    }
}

inline float bf16(uint16_t h) {  // bfloat16 is float32's upper half: exact
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

void decode_f16(const uint8_t *p, float *out) {
    const BlockF16 &b = at<BlockF16>(p);
    for (int j = 0; j < FLOAT_BLOCK; j++) out[j] = f16(b.w[j]);
}

void decode_bf16(const uint8_t *p, float *out) {
    const BlockBF16 &b = at<BlockBF16>(p);
    for (int j = 0; j < FLOAT_BLOCK; j++) out[j] = bf16(b.w[j]);
}

static_assert(sizeof(BlockF16) == 2 * FLOAT_BLOCK && sizeof(BlockBF16) == 2 * FLOAT_BLOCK, "16 bits a weight");
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24 &&
                  sizeof(BlockQ8_0) == 34 && sizeof(BlockIQ4_NL) == 18 && sizeof(BlockQ2_K) == 84 &&
                  sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 &&
                  sizeof(BlockQ6_K) == 210 && sizeof(BlockIQ4_XS) == 136 && sizeof(BlockIQ2_XXS) == 66 &&
                  sizeof(BlockIQ2_XS) == 74 && sizeof(BlockIQ2_S) == 82 && sizeof(BlockIQ3_XXS) == 98 &&
                  sizeof(BlockIQ3_S) == 110 && sizeof(BlockIQ1_S) == 50 && sizeof(BlockIQ1_M) == 56,
              "the block structs are GGUF's sizes");

constexpr Traits TABLE[] = {
    {Q4_0, "Q4_0", 32, sizeof(BlockQ4_0), PER32, decode_q4_0},
    {Q4_1, "Q4_1", 32, sizeof(BlockQ4_1), PER32, decode_q4_1},
    {Q5_0, "Q5_0", 32, sizeof(BlockQ5_0), PER32, decode_q5_0},
    {Q5_1, "Q5_1", 32, sizeof(BlockQ5_1), PER32, decode_q5_1},
    {Q8_0, "Q8_0", 32, sizeof(BlockQ8_0), PER32, decode_q8_0},
    {Q2_K, "Q2_K", 256, sizeof(BlockQ2_K), PER256, decode_q2_k},
    {Q3_K, "Q3_K", 256, sizeof(BlockQ3_K), PER256, decode_q3_k},
    {Q4_K, "Q4_K", 256, sizeof(BlockQ4_K), PER256, decode_k4<BlockQ4_K>},
    {Q5_K, "Q5_K", 256, sizeof(BlockQ5_K), PER256, decode_k4<BlockQ5_K>},
    {Q6_K, "Q6_K", 256, sizeof(BlockQ6_K), PER256, decode_q6_k},
    {IQ4_NL, "IQ4_NL", 32, sizeof(BlockIQ4_NL), PER32, decode_iq4_nl},
    {IQ4_XS, "IQ4_XS", 256, sizeof(BlockIQ4_XS), PER256, decode_iq4_xs},
    {IQ2_XXS, "IQ2_XXS", 256, sizeof(BlockIQ2_XXS), PER256, decode_iq<BlockIQ2_XXS>},
    {IQ2_XS, "IQ2_XS", 256, sizeof(BlockIQ2_XS), PER256, decode_iq<BlockIQ2_XS>},
    {IQ2_S, "IQ2_S", 256, sizeof(BlockIQ2_S), PER256, decode_iq<BlockIQ2_S>},
    {IQ3_XXS, "IQ3_XXS", 256, sizeof(BlockIQ3_XXS), PER256, decode_iq<BlockIQ3_XXS>},
    {IQ3_S, "IQ3_S", 256, sizeof(BlockIQ3_S), PER256, decode_iq<BlockIQ3_S>},
    {IQ1_S, "IQ1_S", 256, sizeof(BlockIQ1_S), PER256, decode_iq<BlockIQ1_S>},
    {IQ1_M, "IQ1_M", 256, sizeof(BlockIQ1_M), PER256, decode_iq<BlockIQ1_M>},
    {F16, "F16", FLOAT_BLOCK, sizeof(BlockF16), FLOAT, decode_f16},
    {BF16, "BF16", FLOAT_BLOCK, sizeof(BlockBF16), FLOAT, decode_bf16},
};

// -- the generic dot products: one exact integer sum a block, its scales applied once --------
// A 32-block: acc += (d_w d_x) isum (+ m s_x where the block has a minimum).
template <class B, int64_t T>
float dot32(const uint8_t *row, const XRow &x, int64_t K) {
    float acc = 0.f;
    for (int64_t g = 0; g < K / 32; g++) {
        const B &b = at<B>(row + g * static_cast<int64_t>(sizeof(B)));
        const int8_t *c = x.q + 32 * g;
        int code[32];
        if constexpr (T == Q4_0 || T == Q4_1 || T == IQ4_NL) {
            for (int j = 0; j < 16; j++) {
                code[j] = b.qs[j] & 15;
                code[j + 16] = b.qs[j] >> 4;
            }
        }
        if constexpr (T == Q5_0 || T == Q5_1) q5_codes(b, code);
        int32_t isum = 0;
        for (int j = 0; j < 32; j++) {
            int w;
            if constexpr (T == Q4_0) w = code[j] - 8;
            else if constexpr (T == Q5_0) w = code[j] - 16;
            else if constexpr (T == Q8_0) w = b.qs[j];
            else if constexpr (T == IQ4_NL) w = IQ4_NL_VALUES[code[j]];
            else w = code[j];
            isum += w * c[j];
        }
        acc += (f16(b.d) * x.d[g]) * static_cast<float>(isum);
        if constexpr (T == Q4_1 || T == Q5_1) acc += f16(b.m) * x.s[g];
    }
    return acc;
}

// A super-block's 256 weight codes as int8, in weight order (Q6_K less its 32, Q3_K less its 4,
// IQ4_XS its code book's values),
// cut out with loops a compiler vectorises: weight 128 h + 32 t + r.
template <class B, int64_t T>
void codes256(const B &b, int8_t *q) {
    if constexpr (T == Q4_K || T == Q5_K) {
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < 32; r++) {
                int lo = b.qs[32 * j + r] & 15, hi = b.qs[32 * j + r] >> 4;
                if constexpr (T == Q5_K) {
                    lo |= ((b.qh[r] >> (2 * j)) & 1) << 4;
                    hi |= ((b.qh[r] >> (2 * j + 1)) & 1) << 4;
                }
                q[64 * j + r] = static_cast<int8_t>(lo);
                q[64 * j + 32 + r] = static_cast<int8_t>(hi);
            }
    } else if constexpr (T == Q6_K) {
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 32; r++) {
                const int l0 = b.ql[64 * h + r], l1 = b.ql[64 * h + 32 + r], high = b.qh[32 * h + r];
                q[128 * h + r] = static_cast<int8_t>(((l0 & 15) | ((high & 3) << 4)) - 32);
                q[128 * h + 32 + r] = static_cast<int8_t>(((l1 & 15) | (((high >> 2) & 3) << 4)) - 32);
                q[128 * h + 64 + r] = static_cast<int8_t>(((l0 >> 4) | (((high >> 4) & 3) << 4)) - 32);
                q[128 * h + 96 + r] = static_cast<int8_t>(((l1 >> 4) | (((high >> 6) & 3) << 4)) - 32);
            }
    } else if constexpr (T == IQ4_XS) {
        for (int s = 0; s < 8; s++)
            for (int j = 0; j < 16; j++) {
                q[32 * s + j] = IQ4_NL_VALUES[b.qs[16 * s + j] & 15];
                q[32 * s + j + 16] = IQ4_NL_VALUES[b.qs[16 * s + j] >> 4];
            }
    } else {  // Q2_K, Q3_K: 2-bit fields (Q3_K: less 4 where hmask's bit is clear)
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int r = 0; r < 32; r++) {
                    int v = (b.qs[32 * h + r] >> (2 * t)) & 3;
                    if constexpr (T == Q3_K) v -= 4 * (((b.hmask[r] >> (4 * h + t)) & 1) ^ 1);
                    q[128 * h + 32 * t + r] = static_cast<int8_t>(v);
                }
    }
}

inline int32_t int_dot(const int8_t *a, const int8_t *b, int n) {
    int32_t total = 0;
    for (int k = 0; k < n; k++) total += a[k] * b[k];
    return total;
}

// A super-block: acc += (d_w d_x) isum - (dmin_w d_x) msum, isum the scaled codes' dot products
// and msum the minimums times the activations' sums (per 16 or per 32). Q2_K and Q3_K (as the grid
// types, dot_iq) keep four accumulators by super-block, which their x86 kernels hold in one
// register; the others one, whose order the repacked kernels (repacked/) follow.
template <class B, int64_t T>
float dot256(const uint8_t *row, const XRow &x, int64_t K) {
    constexpr bool four = T == Q2_K || T == Q3_K;  // super-block i's terms in acc[i % 4], in order; then (a0 + a2) + (a1 + a3)
    float acc[4] = {};
    int8_t q[256];
    for (int64_t i = 0; i < K / 256; i++) {
        const B &b = at<B>(row + i * static_cast<int64_t>(sizeof(B)));
        const int8_t *c = x.q + 256 * i;
        const int16_t *sums = x.sums + 16 * i;
        codes256<B, T>(b, q);
        int32_t isum = 0, msum = 0;
        if constexpr (T == IQ4_XS) {
            for (int s = 0; s < 8; s++) isum += (iq4_xs_scale(b, s) - 32) * int_dot(q + 32 * s, c + 32 * s, 32);
        } else if constexpr (T == Q4_K || T == Q5_K) {
            uint8_t sc[8], mn[8];
            scale_min_k4(b.scales, sc, mn);
            for (int j = 0; j < 8; j++) {
                isum += sc[j] * int_dot(q + 32 * j, c + 32 * j, 32);
                msum += mn[j] * (sums[2 * j] + sums[2 * j + 1]);
            }
        } else {
            for (int s = 0; s < 16; s++) {
                const int32_t dot = int_dot(q + 16 * s, c + 16 * s, 16);
                if constexpr (T == Q2_K) {
                    isum += (b.scales[s] & 15) * dot;
                    msum += (b.scales[s] >> 4) * sums[s];
                } else if constexpr (T == Q3_K) {
                    isum += (q3_scale(b.scales, s) - 32) * dot;
                } else {
                    isum += b.scales[s] * dot;
                }
            }
        }
        float &a = acc[four ? i % 4 : 0];
        a += (f16(b.d) * x.d[i]) * static_cast<float>(isum);
        if constexpr (T == Q2_K || T == Q4_K || T == Q5_K) a -= (f16(b.dmin) * x.d[i]) * static_cast<float>(msum);
    }
    return four ? (acc[0] + acc[2]) + (acc[1] + acc[3]) : acc[0];
}

// A grid type's super-block: its 256 codes meet the activations' in 16 exact dot products, each
// times its integer multiplier; (d_w d_x) times that sum over the type's divisor (a power of 2).
template <class B>
float dot_iq(const uint8_t *row, const XRow &x, int64_t K) {
    float acc[4] = {};  // as dot256's
    int8_t q[256];
    int16_t mult[16];
    for (int64_t i = 0; i < K / 256; i++) {
        const B &b = at<B>(row + i * static_cast<int64_t>(sizeof(B)));
        iq_codes(b, q, mult);
        const int8_t *c = x.q + 256 * i;
        int32_t isum = 0;
        for (int s = 0; s < 16; s++) isum += mult[s] * int_dot(q + 16 * s, c + 16 * s, 16);
        acc[i % 4] += (f16(iq_d(b)) * x.d[i]) * (static_cast<float>(isum) * (1.f / static_cast<float>(IqDivisor<B>::value)));
    }
    return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

// A row of plain 16-bit floats against float32 activations: one float32 sum of w x, in order
// (the contraction is off: each product rounded, then added).
template <class B>
float dot_float(const uint8_t *row, const XRow &x, int64_t K) {
    const uint16_t *w = reinterpret_cast<const uint16_t *>(row);
    float acc = 0.f;
    for (int64_t k = 0; k < K; k++) acc += (std::is_same_v<B, BlockF16> ? f16(w[k]) : bf16(w[k])) * x.x[k];
    return acc;
}

}  // namespace

const Traits *traits_of(int64_t type) {
    for (const Traits &t : TABLE)
        if (t.type == type) return &t;
    return type == Q4_K_X16   ? q4k::traits(Q4_K)
           : type == Q5_K_X16 ? q4k::traits(Q5_K)
           : type == Q8_0_X16 ? q8_0::traits(Q8_0)
           : type == Q5_0_X16 ? q8_0::traits(Q5_0)
           : type == IQ4_XS_X16 ? iq4xs::traits()
           : type == Q6_K_X16 ? q6k::traits()
                              : nullptr;
}

const Traits *all_traits(int64_t &count) {
    count = static_cast<int64_t>(sizeof TABLE / sizeof TABLE[0]);
    return TABLE;
}

int64_t row_bytes_of(int64_t type, int64_t K) {
    const Traits *t = traits_of(type);
    if (t == nullptr || K <= 0 || K % t->weights || K % 32) return 0;
    return K / t->weights * t->bytes;
}

Rounded round_activations(const float *x, int64_t M, int64_t K, Activation kind, bool simd) {
    if (kind == FLOAT) {  // as they come
        Rounded r;
        r.kind = FLOAT, r.K = K, r.x = x;
        return r;
    }
    const int64_t step = kind == PER32 ? 32 : 256, groups = M * K / step;
    Rounded r;
    r.kind = kind;
    r.K = K;
    r.q.resize(static_cast<size_t>(M * K));
    r.d.resize(static_cast<size_t>(groups));
    if (kind == PER32) r.s.resize(static_cast<size_t>(groups));
    else r.sums.resize(static_cast<size_t>(M * K / 16));
    // a prompt's groups split over the threads, 16 rows and more a share (each group is rounded
    // alone: the same codes whichever thread rounds it); a decode step's on the calling thread
    const int64_t grain = std::max<int64_t>(1, 16 * K / step);
    torch::stable::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
#if QKV_X86
        if (simd) {
            avx2_round_groups(x + g0 * step, g1 - g0, step, r.q.data() + g0 * step, r.d.data() + g0,
                              kind == PER32 ? r.s.data() + g0 : nullptr, kind == PER256 ? r.sums.data() + g0 * (step / 16) : nullptr);
            return;
        }
#endif
        for (int64_t g = g0; g < g1; g++) {
            const float *b = x + g * step;
            float amax = 0.f;
            for (int64_t j = 0; j < step; j++) amax = std::max(amax, fabsf(b[j]));
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            int32_t total = 0, part = 0;
            for (int64_t j = 0; j < step; j++) {
                const int32_t code = static_cast<int32_t>(lrintf(b[j] * inv));  // to nearest, ties to even
                r.q[static_cast<size_t>(g * step + j)] = static_cast<int8_t>(code);
                total += code;
                part += code;
                if (kind == PER256 && j % 16 == 15) {
                    r.sums[static_cast<size_t>(g * 16 + j / 16)] = static_cast<int16_t>(part);
                    part = 0;
                }
            }
            r.d[static_cast<size_t>(g)] = d;
            if (kind == PER32) r.s[static_cast<size_t>(g)] = d * static_cast<float>(total);
        }
    });
    (void)simd;
    return r;
}

RowDot generic_dot(int64_t type) {
    switch (type) {
        case Q4_0: return dot32<BlockQ4_0, Q4_0>;
        case Q4_1: return dot32<BlockQ4_1, Q4_1>;
        case Q5_0: return dot32<BlockQ5_0, Q5_0>;
        case Q5_1: return dot32<BlockQ5_1, Q5_1>;
        case Q8_0: return dot32<BlockQ8_0, Q8_0>;
        case IQ4_NL: return dot32<BlockIQ4_NL, IQ4_NL>;
        case Q2_K: return dot256<BlockQ2_K, Q2_K>;
        case Q3_K: return dot256<BlockQ3_K, Q3_K>;
        case Q4_K: return dot256<BlockQ4_K, Q4_K>;
        case Q5_K: return dot256<BlockQ5_K, Q5_K>;
        case Q6_K: return dot256<BlockQ6_K, Q6_K>;
        case IQ4_XS: return dot256<BlockIQ4_XS, IQ4_XS>;
        case IQ2_XXS: return dot_iq<BlockIQ2_XXS>;
        case IQ2_XS: return dot_iq<BlockIQ2_XS>;
        case IQ2_S: return dot_iq<BlockIQ2_S>;
        case IQ3_XXS: return dot_iq<BlockIQ3_XXS>;
        case IQ3_S: return dot_iq<BlockIQ3_S>;
        case IQ1_S: return dot_iq<BlockIQ1_S>;
        case IQ1_M: return dot_iq<BlockIQ1_M>;
        case F16: return dot_float<BlockF16>;
        case BF16: return dot_float<BlockBF16>;
        default: return nullptr;
    }
}

}  // namespace blocks
}  // namespace qkv
