// Attention of one query per row over qkv's quantized KV cache (qkv.attention.caches.quantized_cache),
// read from its packed codes: no dequantized copy of the cache is ever written.
//
//   qkv::quantized_decode_attention(q (B, H, D) f32,
//       k_codes (B, H_kv, N, D * bits / 8) u8, k_scale, k_zero f32: (B, H_kv, N / G, D) with keys per
//       channel, else (B, H_kv, N, D / C_k); v_codes (B, H_kv, N, D_v * bits / 8) u8,
//       v_scale, v_zero (B, H_kv, N, D_v / C_v) f32; sink_k (B, H_kv, N_s, D), sink_v, tail_k (B, H_kv, P, D),
//       tail_v f32; held, quantized: () int64 (the cache's counters); rope_cos, rope_sin (>= held, D / 2) f32?;
//       bits, group_size, keys_per_channel, scale, variant) -> (B, H, D_v) f32
//
// What is visible is what the cache holds, in position order: the first min(N_s, held) sinks
// (positions 0 ..), the first quantized - N_s group slots, then held - quantized tail rows; key
// s sits at position s, so RoPE (when the cache rotates keys as it reads them) takes row s of
// the tables. Codes are packed 8 / bits to a byte, code i of a byte at bit i * bits (as
// qkv.attention.caches.quantize.pack writes them); a number is code * scale + zero.
//
// Per (row, KV head) the keys are read once for all the query heads that share them: each key is
// dequantized in registers, rotated, and dotted with every query of the group; a softmax in
// float32; the values likewise. The keys are split into spans of SPAN positions (one task each,
// merged in order as a log-sum-exp), which depend on the length alone: rows, KV heads and spans
// are independent tasks with the same math whatever the batch size or the thread count, so a
// row's answer does not depend on the rows beside it.
//
// Three variants of the same math: `attend_generic` (plain C++, the reference, and what runs
// where the sizes do not fit the vectors), AVX2 and AVX-512 (attention_simd.h, one
// body for both). variant: -1 = the active one (kernels.h's detection under qkv::set_variant's
// cap), else kernels.h's numbering: 0 = generic, 1 = AVX2, 2 = AVX-512 (refused where the CPU
// lacks it); the tests compare them all.
//
// Shape legend: B batch, H query heads, H_kv KV heads, D head size of keys, D_v of values,
// N group slots, G tokens per key group, C_k / C_v channels per statistic, N_s sinks, P tail rows.
#include "../kernels.h"

#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

using torch::stable::Tensor;

namespace {

void require(bool ok, const char *message) {
    STD_TORCH_CHECK(ok, message);
}

struct KeyRow {
    const float *exact = nullptr;    // a sink or tail row, in full precision
    const uint8_t *codes = nullptr;  // else the packed codes and their statistics
    const float *scale = nullptr, *zero = nullptr;
};
using ValueRow = KeyRow;

// Pointers into the cache's tensors and their sizes; one per call.
struct View {
    const float *q;
    const uint8_t *k_codes, *v_codes;
    const float *k_scale, *k_zero, *v_scale, *v_zero, *sink_k, *sink_v, *tail_k, *tail_v, *cos, *sin;
    int64_t H, Hkv, D, Dv, N, Ns, P, bits, G, group, key_channels, value_channels;
    int64_t n_sink, n_slot, n_tail;
    bool keys_per_channel;
    float scale;

    int64_t visible() const { return n_sink + n_slot + n_tail; }

    // Key s (position s) of KV head bk (= b * H_kv + kv).
    KeyRow key_row(int64_t bk, int64_t s) const {
        KeyRow r;
        if (s < n_sink) { r.exact = sink_k + (bk * Ns + s) * D; return r; }
        s -= n_sink;
        if (s >= n_slot) { r.exact = tail_k + (bk * P + s - n_slot) * D; return r; }
        r.codes = k_codes + (bk * N + s) * (D * bits / 8);
        const int64_t stat = keys_per_channel ? (bk * (N / G) + s / G) * D : (bk * N + s) * (D / key_channels);
        r.scale = k_scale + stat;
        r.zero = k_zero + stat;
        return r;
    }

    ValueRow value_row(int64_t bk, int64_t s) const {
        ValueRow r;
        if (s < n_sink) { r.exact = sink_v + (bk * Ns + s) * Dv; return r; }
        s -= n_sink;
        if (s >= n_slot) { r.exact = tail_v + (bk * P + s - n_slot) * Dv; return r; }
        r.codes = v_codes + (bk * N + s) * (Dv * bits / 8);
        const int64_t stat = (bk * N + s) * (Dv / value_channels);
        r.scale = v_scale + stat;
        r.zero = v_zero + stat;
        return r;
    }
};

// What one span of keys gives a block of query heads: the unnormalised context (rows of D_v),
// the maximum score and the sum of exponentials of the scores less it, per head.
struct Part {
    float *out, *top, *total;
    Part at(int64_t h, int64_t Dv) const { return {out + h * Dv, top + h, total + h}; }
};

// Keys are attended in spans of SPAN positions, each span one task, so that a few KV heads
// still fill every thread; the spans depend on the length only, never on the batch.
constexpr int64_t SPAN = 256;

inline float code_of(const uint8_t *row, int64_t c, int64_t bits) {
    const int64_t per = 8 / bits;
    return static_cast<float>((row[c / per] >> ((c % per) * bits)) & ((1 << bits) - 1));
}

// -- the generic reference -----------------------------------------------------------------
void key_values(const View &w, const KeyRow &r, int64_t D, int64_t channels, bool per_channel, float *out) {
    for (int64_t c = 0; c < D; c++) {
        if (r.exact) { out[c] = r.exact[c]; continue; }
        const int64_t g = per_channel ? c : c / channels;
        out[c] = std::fma(code_of(r.codes, c, w.bits), r.scale[g], r.zero[g]);
    }
}

void attend_generic(const View &w, int64_t bk, int64_t s0, int64_t s1, const float *q, Part part, float *scores) {
    const int64_t n = s1 - s0, D = w.D, Dv = w.Dv, half = D / 2;
    std::vector<float> k(static_cast<size_t>(D)), rotated(static_cast<size_t>(D)), v(static_cast<size_t>(Dv));
    for (int64_t s = s0; s < s1; s++) {
        key_values(w, w.key_row(bk, s), D, w.key_channels, w.keys_per_channel, k.data());
        const float *key = k.data();
        if (w.cos) {
            for (int64_t i = 0; i < half; i++) {
                const float c = w.cos[s * half + i], si = w.sin[s * half + i];
                rotated[i] = std::fma(-k[i + half], si, k[i] * c);
                rotated[i + half] = std::fma(k[i], si, k[i + half] * c);
            }
            key = rotated.data();
        }
        for (int64_t h = 0; h < w.group; h++) {
            float dot = 0.f;
            for (int64_t c = 0; c < D; c++) dot = std::fma(q[h * D + c], key[c], dot);
            scores[h * n + s - s0] = dot * w.scale;
        }
    }
    for (int64_t h = 0; h < w.group; h++) {
        float *x = scores + h * n, top = -INFINITY, total = 0.f;
        for (int64_t s = 0; s < n; s++) top = std::max(top, x[s]);
        for (int64_t s = 0; s < n; s++) {
            x[s] = std::exp(x[s] - top);
            total += x[s];
        }
        part.top[h] = top, part.total[h] = total;
    }
    for (int64_t j = 0; j < w.group * Dv; j++) part.out[j] = 0.f;
    for (int64_t s = s0; s < s1; s++) {
        key_values(w, w.value_row(bk, s), Dv, w.value_channels, false, v.data());
        for (int64_t h = 0; h < w.group; h++)
            for (int64_t j = 0; j < Dv; j++)
                part.out[h * Dv + j] = std::fma(scores[h * n + s - s0], v[j], part.out[h * Dv + j]);
    }
}

// The spans of one query head, in order: out = sum_c e^(top_c - M) out_c / sum_c e^(top_c - M) total_c.
void merge_spans(const float *outs, const float *tops, const float *totals, int64_t spans, int64_t stride,
                 int64_t Dv, float *out) {
    float top = -INFINITY, total = 0.f;
    for (int64_t c = 0; c < spans; c++) top = std::max(top, tops[c * stride]);
    for (int64_t j = 0; j < Dv; j++) out[j] = 0.f;
    for (int64_t c = 0; c < spans; c++) {
        const float f = std::exp(tops[c * stride] - top);
        total = std::fma(f, totals[c * stride], total);
        for (int64_t j = 0; j < Dv; j++) out[j] = std::fma(f, outs[c * stride * Dv + j], out[j]);
    }
    const float inv = 1.f / total;
    for (int64_t j = 0; j < Dv; j++) out[j] *= inv;
}

// -- AVX2 ------------------------------------------------------------------------------------
// The library is built for the baseline CPU (qkv.runtime.native.build): each vectorised body is
// compiled under its own target and run only where the CPU has it.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct Lanes {
    using V = __m256;
    static constexpr int64_t W = 8;
    static constexpr int VALUE_VECTORS = 2;  // 16 registers: 4 heads x 2 sums, and the rest
    static V load(const float *p) { return _mm256_loadu_ps(p); }
    static void store(float *p, V v) { _mm256_storeu_ps(p, v); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V zero() { return _mm256_setzero_ps(); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
    static V min(V a, V b) { return _mm256_min_ps(a, b); }
    static V max(V a, V b) { return _mm256_max_ps(a, b); }
    static V floor(V a) { return _mm256_floor_ps(a); }
    static V pow2(V n) {
        const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
    }
    static float sum(V v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
    }
    // The sums of up to four vectors at once: two rounds of pairwise adds, then the halves.
    template <int NH>
    static void sums(const V *acc, float *out) {
        const V a1 = NH > 1 ? acc[1] : zero(), a2 = NH > 2 ? acc[2] : zero(), a3 = NH > 3 ? acc[3] : zero();
        const V h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], a1), _mm256_hadd_ps(a2, a3));
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
    static V bytes(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
    static V codes8(const uint8_t *p) { return bytes(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))); }
    static V codes4(const uint8_t *p) {  // 4 bytes -> 8 codes: low nibble first
        int32_t word;
        __builtin_memcpy(&word, p, 4);
        const __m128i x = _mm_cvtsi32_si128(word), m = _mm_set1_epi8(0x0F);
        return bytes(_mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m)));
    }
    static V codes2(const uint8_t *p) {  // 2 bytes -> 8 codes: bits 0-1 first
        int16_t half;
        __builtin_memcpy(&half, p, 2);
        const __m128i x = _mm_cvtsi32_si128(static_cast<uint16_t>(half)), m = _mm_set1_epi8(0x03);
        const __m128i c0 = _mm_and_si128(x, m), c1 = _mm_and_si128(_mm_srli_epi16(x, 2), m);
        const __m128i c2 = _mm_and_si128(_mm_srli_epi16(x, 4), m), c3 = _mm_and_si128(_mm_srli_epi16(x, 6), m);
        return bytes(_mm_unpacklo_epi16(_mm_unpacklo_epi8(c0, c1), _mm_unpacklo_epi8(c2, c3)));
    }
};
// GCC 12's own AVX headers warn (maybe-uninitialized) where they are inlined (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "attention_simd.h"
#pragma GCC diagnostic pop
}  // namespace avx2
#pragma GCC pop_options

// -- AVX-512 ---------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
namespace avx512 {
struct Lanes {
    using V = __m512;
    static constexpr int64_t W = 16;
    static constexpr int VALUE_VECTORS = 4;  // 32 registers: 4 heads x 4 sums, and the rest
    static V load(const float *p) { return _mm512_loadu_ps(p); }
    static void store(float *p, V v) { _mm512_storeu_ps(p, v); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V zero() { return _mm512_setzero_ps(); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
    static V min(V a, V b) { return _mm512_min_ps(a, b); }
    static V max(V a, V b) { return _mm512_max_ps(a, b); }
    static V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
    static V pow2(V n) {
        const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
        return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
    }
    static float sum(V v) { return _mm512_reduce_add_ps(v); }
    template <int NH>
    static void sums(const V *acc, float *out) {  // halve each to 8 lanes, then as AVX2 does
        __m256 half[4];
        for (int h = 0; h < 4; h++)
            half[h] = h < NH ? _mm256_add_ps(_mm512_castps512_ps256(acc[h]), _mm512_extractf32x8_ps(acc[h], 1))
                             : _mm256_setzero_ps();
        const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
    }
    static V bytes(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
    static V codes8(const uint8_t *p) { return bytes(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
    static V codes4(const uint8_t *p) {  // 8 bytes -> 16 codes
        const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)), m = _mm_set1_epi8(0x0F);
        return bytes(_mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m)));
    }
    static V codes2(const uint8_t *p) {  // 4 bytes -> 16 codes
        int32_t word;
        __builtin_memcpy(&word, p, 4);
        const __m128i x = _mm_cvtsi32_si128(word), m = _mm_set1_epi8(0x03);
        const __m128i c0 = _mm_and_si128(x, m), c1 = _mm_and_si128(_mm_srli_epi16(x, 2), m);
        const __m128i c2 = _mm_and_si128(_mm_srli_epi16(x, 4), m), c3 = _mm_and_si128(_mm_srli_epi16(x, 6), m);
        return bytes(_mm_unpacklo_epi16(_mm_unpacklo_epi8(c0, c1), _mm_unpacklo_epi8(c2, c3)));
    }
};
// GCC 12's own AVX headers warn (maybe-uninitialized) where they are inlined (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "attention_simd.h"
#pragma GCC diagnostic pop
}  // namespace avx512
#pragma GCC pop_options

// Whether the sizes fit vectors of `lanes` floats (else the generic reference runs).
bool fits(const View &w, int64_t lanes) {
    const bool keys = w.cos ? (w.D / 2) % lanes == 0 : w.D % lanes == 0;
    return keys && w.Dv % lanes == 0 && (w.keys_per_channel || w.key_channels % lanes == 0) &&
           w.value_channels % lanes == 0;
}

const float *floats(const Tensor &t, const char *message) {
    require(t.scalar_type() == torch::headeronly::ScalarType::Float && t.is_contiguous(), message);
    return static_cast<const float *>(t.data_ptr());
}

int64_t counter(const Tensor &t) {
    require(t.scalar_type() == torch::headeronly::ScalarType::Long && t.numel() == 1,
            "qkv::quantized_decode_attention: held and quantized are one int64 each");
    return *static_cast<const int64_t *>(t.data_ptr());
}

Tensor quantized_decode_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_zero, Tensor v_codes,
                                  Tensor v_scale, Tensor v_zero, Tensor sink_k, Tensor sink_v, Tensor tail_k,
                                  Tensor tail_v, Tensor held, Tensor quantized, std::optional<Tensor> rope_cos,
                                  std::optional<Tensor> rope_sin, int64_t bits, int64_t group_size,
                                  bool keys_per_channel, double scale, int64_t variant) {
    using torch::headeronly::ScalarType;
    const char *shapes = "qkv::quantized_decode_attention: the cache's tensors disagree on their sizes";
    require(q.dim() == 3 && k_codes.dim() == 4 && v_codes.dim() == 4 && k_scale.dim() == 4 && v_scale.dim() == 4 &&
                sink_k.dim() == 4 && tail_k.dim() == 4, shapes);
    require(bits == 2 || bits == 4 || bits == 8, "qkv::quantized_decode_attention: bits must be 2, 4 or 8");
    View w{};
    const int64_t B = q.size(0);
    w.H = q.size(1), w.D = q.size(2), w.Hkv = k_codes.size(1), w.N = k_codes.size(2), w.Dv = tail_v.size(3);
    w.Ns = sink_k.size(2), w.P = tail_k.size(2), w.bits = bits, w.G = group_size;
    w.keys_per_channel = keys_per_channel;
    require(w.Hkv > 0 && w.H % w.Hkv == 0 && group_size > 0 && w.N % group_size == 0, shapes);
    w.group = w.H / w.Hkv;
    require(k_codes.size(0) == B && k_codes.size(3) * 8 == w.D * bits && v_codes.size(3) * 8 == w.Dv * bits &&
                v_codes.size(2) == w.N && v_scale.size(2) == w.N && v_scale.size(3) > 0 && w.Dv % v_scale.size(3) == 0,
            shapes);
    w.value_channels = w.Dv / v_scale.size(3);
    if (keys_per_channel) {
        require(k_scale.size(2) == w.N / group_size && k_scale.size(3) == w.D, shapes);
        w.key_channels = 1;
    } else {
        require(k_scale.size(2) == w.N && k_scale.size(3) > 0 && w.D % k_scale.size(3) == 0, shapes);
        w.key_channels = w.D / k_scale.size(3);
    }
    require(k_codes.scalar_type() == ScalarType::Byte && v_codes.scalar_type() == ScalarType::Byte &&
                k_codes.is_contiguous() && v_codes.is_contiguous(),
            "qkv::quantized_decode_attention: codes must be contiguous uint8");
    const char *dtypes = "qkv::quantized_decode_attention: q, statistics and rows must be contiguous float32";
    w.q = floats(q, dtypes), w.k_scale = floats(k_scale, dtypes), w.k_zero = floats(k_zero, dtypes);
    w.v_scale = floats(v_scale, dtypes), w.v_zero = floats(v_zero, dtypes);
    w.sink_k = floats(sink_k, dtypes), w.sink_v = floats(sink_v, dtypes);
    w.tail_k = floats(tail_k, dtypes), w.tail_v = floats(tail_v, dtypes);
    w.k_codes = static_cast<const uint8_t *>(k_codes.data_ptr()), w.v_codes = static_cast<const uint8_t *>(v_codes.data_ptr());
    require(k_zero.numel() == k_scale.numel() && v_zero.numel() == v_scale.numel() &&
                sink_k.numel() == B * w.Hkv * w.Ns * w.D && sink_v.numel() == B * w.Hkv * w.Ns * w.Dv &&
                tail_k.numel() == B * w.Hkv * w.P * w.D && tail_v.numel() == B * w.Hkv * w.P * w.Dv,
            shapes);
    const int64_t n_held = counter(held), n_quantized = counter(quantized);
    w.n_sink = std::clamp<int64_t>(n_held, 0, w.Ns);
    w.n_slot = std::clamp<int64_t>(n_quantized - w.Ns, 0, w.N);
    w.n_tail = std::clamp<int64_t>(n_held - n_quantized, 0, w.P);
    w.cos = w.sin = nullptr;
    if (rope_cos.has_value() || rope_sin.has_value()) {
        require(rope_cos.has_value() && rope_sin.has_value() && rope_cos->dim() == 2 && w.D % 2 == 0 &&
                    rope_cos->size(1) * 2 == w.D && rope_sin->numel() == rope_cos->numel() &&
                    rope_cos->size(0) >= w.visible(),
                "qkv::quantized_decode_attention: RoPE tables are (positions held or more, D / 2)");
        w.cos = floats(*rope_cos, dtypes), w.sin = floats(*rope_sin, dtypes);
    }
    w.scale = static_cast<float>(scale);
    // variant: -1 the active one (kernels.h: the CPU's best under qkv::set_variant's cap, narrower where
    // the head sizes do not fit its vectors), else kernels.h's Variant (0 generic, 1 AVX2, 2 AVX-512)
    require(variant >= -1 && variant <= qkv::AVX512,
            "qkv::quantized_decode_attention: variant is -1 (active), 0 (generic), 1 (avx2) or 2 (avx512)");
    require(variant <= qkv::best_variant(), "qkv::quantized_decode_attention: this CPU does not run that variant");
    if (variant == -1) {
        variant = qkv::active_variant();
        if (variant == qkv::AVX512 && !fits(w, 16)) variant = qkv::AVX2;
        if (variant == qkv::AVX2 && !fits(w, 8)) variant = qkv::GENERIC;
    }
    require(variant == qkv::GENERIC || fits(w, variant == qkv::AVX512 ? 16 : 8),
            "qkv::quantized_decode_attention: these head sizes do not fit that variant's vectors");

    Tensor out = torch::stable::new_empty(q, {B, w.H, w.Dv});
    float *op = static_cast<float *>(out.data_ptr());
    const int64_t S = w.visible();
    if (S == 0) {
        for (int64_t j = 0; j < B * w.H * w.Dv; j++) op[j] = 0.f;
        return out;
    }
    // Span c of KV head bk: heads' parts at [(bk * spans + c) * group + h] (rows of D_v for outs).
    const int64_t spans = (S + SPAN - 1) / SPAN, heads = B * w.Hkv * spans * w.group;
    std::vector<float> outs(static_cast<size_t>(heads * w.Dv)), tops(static_cast<size_t>(heads)),
        totals(static_cast<size_t>(heads));
    torch::stable::parallel_for(0, B * w.Hkv * spans, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> scores(static_cast<size_t>(w.group * SPAN));
        for (int64_t t = t0; t < t1; t++) {
            const int64_t bk = t / spans, s0 = (t % spans) * SPAN, s1 = std::min(S, s0 + SPAN);
            const float *qh = w.q + bk * w.group * w.D;
            const Part part{outs.data() + t * w.group * w.Dv, tops.data() + t * w.group, totals.data() + t * w.group};
            if (variant == qkv::AVX512) avx512::attend_heads(w, bk, s0, s1, qh, part, scores.data());
            else if (variant == qkv::AVX2) avx2::attend_heads(w, bk, s0, s1, qh, part, scores.data());
            else attend_generic(w, bk, s0, s1, qh, part, scores.data());
        }
    });
    torch::stable::parallel_for(0, B * w.H, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
            const int64_t bk = i / w.group, h = i % w.group, first = bk * spans * w.group + h;
            merge_spans(outs.data() + first * w.Dv, tops.data() + first, totals.data() + first, spans, w.group, w.Dv,
                        op + i * w.Dv);
        }
    });
    return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("quantized_decode_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_zero, Tensor v_codes, "
          "Tensor v_scale, Tensor v_zero, Tensor sink_k, Tensor sink_v, Tensor tail_k, Tensor tail_v, Tensor held, "
          "Tensor quantized, Tensor? rope_cos, Tensor? rope_sin, int bits, int group_size, bool keys_per_channel, "
          "float scale, int variant) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("quantized_decode_attention", TORCH_BOX(&quantized_decode_attention));
}
