// The block products' vectorised body, written once over a 16-lane vector type V and compiled
// once per instruction set (block_avx2.cpp, block_avx512.cpp include it inside their own
// `#pragma GCC target` region). It computes exactly what block_products.cpp's generic C++
// computes: each weight decoded with the gguf library's float32 operations, and the products
// summed in the 64-lane order described there (weight k into lane k % 64, i.e. into lane
// group (k % 64) / 16 of four accumulators). The group is a template argument everywhere, so
// the four accumulators stay in registers.
//
// V provides, on 16 lanes of int32 (V::I) and float32 (V::F):
//   u8(p) / i8(p): 16 bytes zero- / sign-extended; srl, sll, band (with a constant), bor, bxor1,
//   subc (minus a constant), sub; bits(mask, v): v in lane l where bit l of mask is set, else 0;
//   sub_where_clear(a, mask, c): a - c in the lanes whose bit of mask is clear, a elsewhere;
//   cvt; set; mul, add, sub; load(p), store(p, f), fma(a, b, c) = a * b + c rounded once;
//   zero(); reduce(a[4]) (the generic tree); half(p): the float16 at p as float32, exactly;
// and on 32 bytes (V::B): b_load, b_srl / b_sll (by n bits, within each byte only for the
// masks used here), b_and, b_or, b_sub (minus a constant), b_lanes(b, i): bytes 16 i .. 16 i + 15
// as int32 (sign-extended). Bit fields are cut out of 32 bytes at once, then widened.
#pragma once
#include <stdint.h>

namespace block_kernels {

void decode_block(int64_t type, const uint8_t *b, float *out);  // the generic decoder (block_products.cpp)

// Q4_K / Q5_K: 8 six-bit scales and minimums from 12 bytes (gguf's get_scale_min).
inline void scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[4 + j] & 63;
        sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
}

// Bytes of one row of K weights in `type`, or 0 when the type is not one these kernels read or K
// is not whole blocks of it.
int64_t row_bytes_of(int64_t type, int64_t K);

// The block variant (block_rows' `isa`) that computes with the instruction set of qkv's main
// variant `variant` (kernels.h's Variant: 0 generic, 1 AVX2, 2 AVX-512).
int64_t isa_of_variant(int64_t variant);

// Outputs n0..n1 of y (M, N) = x (M, K) @ w^T + bias from rows of blocks: the whole product for a
// layer kernel's own parallel loop (block_products.cpp says more).
void block_rows(int64_t type, const uint8_t *blocks, int64_t row_bytes, const float *x, int64_t M, int64_t K,
                int64_t N, int64_t n0, int64_t n1, const float *bias, int64_t isa, float *y);

template <class V>
struct Accumulate {  // a product's sink: w times x into lane group G
    const float *x;
    typename V::F a[4];
    template <int G>
    inline void at(int64_t k, typename V::F w) { a[G] = V::fma(w, V::load(x + k), a[G]); }
};

template <class V>
struct Store {  // a decode's sink: the weights into a row buffer
    float *w;
    template <int G>
    inline void at(int64_t k, typename V::F v) { V::store(w + k, v); }
};

// -- blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; others through the generic decoder) -------
template <class V, int T>
inline void block32(const uint8_t *b, typename V::F &lo, typename V::F &hi) {
    using I = typename V::I;
    using F = typename V::F;
    if constexpr (T == 2) {  // Q4_0: d * (q - 8)
        const F d = V::set(V::half(b));
        const I q = V::u8(b + 2);
        lo = V::mul(d, V::cvt(V::subc(V::band(q, 15), 8)));
        hi = V::mul(d, V::cvt(V::subc(V::srl(q, 4), 8)));
    } else if constexpr (T == 3) {  // Q4_1: d * q + m
        const F d = V::set(V::half(b)), m = V::set(V::half(b + 2));
        const I q = V::u8(b + 4);
        lo = V::add(V::mul(d, V::cvt(V::band(q, 15))), m);
        hi = V::add(V::mul(d, V::cvt(V::srl(q, 4))), m);
    } else if constexpr (T == 6 || T == 7) {  // Q5_0: d * (q - 16); Q5_1: d * q + m; fifth bits in a u32
        constexpr bool min = T == 7;
        const F d = V::set(V::half(b));
        const uint8_t *qh = b + (min ? 4 : 2);
        const uint32_t high = qh[0] | (qh[1] << 8) | (qh[2] << 16) | (static_cast<uint32_t>(qh[3]) << 24);
        const I q = V::u8(qh + 4);
        if constexpr (min) {
            const I l = V::bor(V::band(q, 15), V::bits(high & 0xFFFF, 16)), h = V::bor(V::srl(q, 4), V::bits(high >> 16, 16));
            const F m = V::set(V::half(b + 2));
            lo = V::add(V::mul(d, V::cvt(l)), m);
            hi = V::add(V::mul(d, V::cvt(h)), m);
        } else {  // q - 16 = the low four bits, less 16 where the fifth bit is clear
            lo = V::mul(d, V::cvt(V::sub_where_clear(V::band(q, 15), high & 0xFFFF, 16)));
            hi = V::mul(d, V::cvt(V::sub_where_clear(V::srl(q, 4), high >> 16, 16)));
        }
    } else if constexpr (T == 8) {  // Q8_0: q * d
        const F d = V::set(V::half(b));
        lo = V::mul(V::cvt(V::i8(b + 2)), d);
        hi = V::mul(V::cvt(V::i8(b + 18)), d);
    } else {
        float w[32];
        decode_block(T, b, w);
        lo = V::load(w);
        hi = V::load(w + 16);
    }
}

template <class V, int T, class Sink>
void run32(const uint8_t *row, int64_t K, int64_t bytes, Sink &s) {
    typename V::F lo, hi;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64, row += 2 * bytes) {  // two blocks fill the four lane groups
        block32<V, T>(row, lo, hi);
        s.template at<0>(k, lo);
        s.template at<1>(k + 16, hi);
        block32<V, T>(row + bytes, lo, hi);
        s.template at<2>(k + 32, lo);
        s.template at<3>(k + 48, hi);
    }
    if (k < K) {
        block32<V, T>(row, lo, hi);
        s.template at<0>(k, lo);
        s.template at<1>(k + 16, hi);
    }
}

// -- super-blocks of 256 ------------------------------------------------------------------
// Q2_K / Q3_K sub s of 16 (0..15): w = 16 s + i = 128 h + 32 t + r
template <class V, int T>
inline typename V::F sub16(const uint8_t *b, int s) {
    using I = typename V::I;
    const int h = s / 8, t = (s / 2) % 4, r = 16 * (s % 2);
    if constexpr (T == 10) {  // Q2_K: (d * sc) * q - dmin * m
        const typename V::F dl = V::set(V::half(b + 80) * static_cast<float>(b[s] & 15));
        const typename V::F ml = V::set(V::half(b + 82) * static_cast<float>(b[s] >> 4));
        const I q = V::band(V::srl(V::u8(b + 16 + 32 * h + r), 2 * t), 3);
        return V::sub(V::mul(dl, V::cvt(q)), ml);
    } else if constexpr (T == 11) {  // Q3_K: (d * sc) * (q_low - 4 * (1 - hbit))
        const uint8_t *sc = b + 96;
        const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        const typename V::F dl = V::set(V::half(b + 108) * static_cast<float>((low | (high << 4)) - 32));
        const I ql = V::band(V::srl(V::u8(b + 32 + 32 * h + r), 2 * t), 3);
        const I hb = V::band(V::srl(V::u8(b + r), s / 2), 1);  // bit w / 32 of hmask[w % 32]
        return V::mul(dl, V::cvt(V::sub(ql, V::sll(V::bxor1(hb), 2))));
    }
}

template <class V, int T, class Sink>
void run256(const uint8_t *b, int64_t K, int64_t bytes, Sink &s) {
    using F = typename V::F;
    for (int64_t k = 0; k < K; k += 256, b += bytes) {
        if constexpr (T == 12 || T == 13) {
            uint8_t sc[8], mn[8];
            const uint8_t *p = b + 4;
            for (int j = 0; j < 4; j++) {
                sc[j] = p[j] & 63;
                mn[j] = p[4 + j] & 63;
                sc[4 + j] = (p[8 + j] & 0x0F) | ((p[j] >> 2) & 0x30);
                mn[4 + j] = (p[8 + j] >> 4) | ((p[4 + j] >> 2) & 0x30);
            }
            const float d = V::half(b), dmin = V::half(b + 2);
            typename V::B qh{};
            if constexpr (T == 13) qh = V::b_load(b + 16);
            for (int c = 0; c < 4; c++) {  // 64 weights: sub 2c in groups 0, 1, sub 2c + 1 in groups 2, 3
                const int j = 2 * c;
                const typename V::B q = V::b_load(b + (T == 13 ? 48 : 16) + 32 * c);
                typename V::B lo = V::b_and(q, 15), hi = V::b_and(V::b_srl(q, 4), 15);
                if constexpr (T == 13) {
                    lo = V::b_or(lo, V::b_sll(V::b_and(V::b_srl(qh, j), 1), 4));
                    hi = V::b_or(hi, V::b_sll(V::b_and(V::b_srl(qh, j + 1), 1), 4));
                }
                F dl = V::set(d * static_cast<float>(sc[j])), ml = V::set(dmin * static_cast<float>(mn[j]));
                s.template at<0>(k + 64 * c, V::sub(V::mul(dl, V::cvt(V::b_lanes(lo, 0))), ml));
                s.template at<1>(k + 64 * c + 16, V::sub(V::mul(dl, V::cvt(V::b_lanes(lo, 1))), ml));
                dl = V::set(d * static_cast<float>(sc[j + 1]));
                ml = V::set(dmin * static_cast<float>(mn[j + 1]));
                s.template at<2>(k + 64 * c + 32, V::sub(V::mul(dl, V::cvt(V::b_lanes(hi, 0))), ml));
                s.template at<3>(k + 64 * c + 48, V::sub(V::mul(dl, V::cvt(V::b_lanes(hi, 1))), ml));
            }
        } else if constexpr (T == 14) {
            // Q6_K: weights 128 h + 32 t + r: low nibbles from ql[64 h + 32 (t % 2) + r] (high half
            // for t >= 2), two high bits from qh[32 h + r] at 2 t; (d * sc) * (q - 32), subs of 16
            const float d = V::half(b + 208);
            const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
            for (int h = 0; h < 2; h++) {
                const typename V::B l0 = V::b_load(b + 64 * h), l1 = V::b_load(b + 64 * h + 32);
                const typename V::B qh = V::b_load(b + 128 + 32 * h);
                for (int t = 0; t < 4; t++) {
                    const typename V::B low = V::b_and(V::b_srl(t % 2 ? l1 : l0, 4 * (t / 2)), 15);
                    const typename V::B high = V::b_sll(V::b_and(V::b_srl(qh, 2 * t), 3), 4);
                    const typename V::B q = V::b_sub(V::b_or(low, high), 32);  // -32 .. 31 as int8
                    const int sub = 8 * h + 2 * t;
                    const F d0 = V::set(d * static_cast<float>(sc[sub])), d1 = V::set(d * static_cast<float>(sc[sub + 1]));
                    const int64_t at = k + 128 * h + 32 * t;  // t even: groups 0, 1; odd: 2, 3
                    if (t % 2 == 0) {
                        s.template at<0>(at, V::mul(d0, V::cvt(V::b_lanes(q, 0))));
                        s.template at<1>(at + 16, V::mul(d1, V::cvt(V::b_lanes(q, 1))));
                    } else {
                        s.template at<2>(at, V::mul(d0, V::cvt(V::b_lanes(q, 0))));
                        s.template at<3>(at + 16, V::mul(d1, V::cvt(V::b_lanes(q, 1))));
                    }
                }
            }
        } else {
            for (int c = 0; c < 4; c++) {
                s.template at<0>(k + 64 * c, sub16<V, T>(b, 4 * c));
                s.template at<1>(k + 64 * c + 16, sub16<V, T>(b, 4 * c + 1));
                s.template at<2>(k + 64 * c + 32, sub16<V, T>(b, 4 * c + 2));
                s.template at<3>(k + 64 * c + 48, sub16<V, T>(b, 4 * c + 3));
            }
        }
    }
}

// Every weight of one row of blocks handed to `sink`, 16 at a time, in the lane groups of the order.
template <class V, class Sink>
void decode_row(int64_t type, const uint8_t *row, int64_t K, int64_t bytes, Sink &s) {
    switch (type) {
        case 2: run32<V, 2>(row, K, bytes, s); break;
        case 3: run32<V, 3>(row, K, bytes, s); break;
        case 6: run32<V, 6>(row, K, bytes, s); break;
        case 7: run32<V, 7>(row, K, bytes, s); break;
        case 8: run32<V, 8>(row, K, bytes, s); break;
        case 10: run256<V, 10>(row, K, bytes, s); break;
        case 11: run256<V, 11>(row, K, bytes, s); break;
        case 12: run256<V, 12>(row, K, bytes, s); break;
        case 13: run256<V, 13>(row, K, bytes, s); break;
        case 14: run256<V, 14>(row, K, bytes, s); break;
        default: run32<V, 20>(row, K, bytes, s); break;  // IQ4_NL, through the generic decoder
    }
}

template <class V>
float row_dot(int64_t type, const uint8_t *row, const float *x, int64_t K, int64_t bytes) {
    Accumulate<V> acc{x, {V::zero(), V::zero(), V::zero(), V::zero()}};
    decode_row<V>(type, row, K, bytes, acc);
    return V::reduce(acc.a);
}

template <class V>
float dot(const float *w, const float *x, int64_t K) {  // a decoded row, in the same order
    Accumulate<V> acc{x, {V::zero(), V::zero(), V::zero(), V::zero()}};
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        acc.template at<0>(k, V::load(w + k));
        acc.template at<1>(k + 16, V::load(w + k + 16));
        acc.template at<2>(k + 32, V::load(w + k + 32));
        acc.template at<3>(k + 48, V::load(w + k + 48));
    }
    if (k < K) {
        acc.template at<0>(k, V::load(w + k));
        acc.template at<1>(k + 16, V::load(w + k + 16));
    }
    return V::reduce(acc.a);
}

template <class V>
void decode(int64_t type, const uint8_t *row, int64_t K, int64_t bytes, float *w) {
    Store<V> s{w};
    decode_row<V>(type, row, K, bytes, s);
}

}  // namespace block_kernels
