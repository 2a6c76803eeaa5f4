// One-query attention over a KV cache (a decode step): the generic variant in plain C++, the
// AVX2 one (same math; the exponential is a polynomial there, std::exp here) and the AVX-512
// one (the AVX2 variant's operations lane for lane, so its very bits), and the op. A prompt's
// queries of one key/value head attend together (attend_group): on AVX-512 each key and
// value is loaded once for the group's queries, each query's numbers unchanged.
//
//   qkv::decode_attention(q (B, H, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v), visible (B, H, S) bool?,
//                         scale) -> (B, H, D_v): grouped heads sharing keys; softmax over the
//       visible keys, zeros where none is visible
//
// Each (row, head) is computed alone (batch invariance): its numbers do not depend on B.
//
// Shape legend: B batch, H query heads, H_kv key/value heads, S key slots, D head size,
// D_v value head size.
#include "kernels.h"

#include <math.h>

namespace qkv {
namespace {

// scale * q.k, soft-capped where softcap > 0 (Gemma 2: cap * tanh(s / cap))
inline float capped(float score, float softcap) {
    return softcap > 0.f ? softcap * tanhf(score / softcap) : score;
}

void generic_attend(const float *q, const float *k, const float *v, const bool *visible, float *out, int64_t begin,
                    int64_t end, int64_t D, int64_t Dv, float scale, float softcap, const float *sink, float *w) {
    float top = -INFINITY;
    for (int64_t s = begin; s < end; s++) {
        if (visible && !visible[s]) { w[s] = -INFINITY; continue; }
        float dot = 0.f;
        for (int64_t i = 0; i < D; i++) dot += q[i] * k[s * D + i];
        w[s] = capped(dot * scale, softcap);
        top = std::max(top, w[s]);
    }
    for (int64_t j = 0; j < Dv; j++) out[j] = 0.f;
    if (top == -INFINITY) return;
    if (sink) top = std::max(top, *sink);
    float total = sink ? expf(*sink - top) : 0.f;  // the sink takes weight, gives no value
    for (int64_t s = begin; s < end; s++) {
        w[s] = w[s] == -INFINITY ? 0.f : expf(w[s] - top);
        total += w[s];
    }
    const float inv = 1.f / total;
    for (int64_t s = begin; s < end; s++) {
        if (w[s] == 0.f) continue;
        const float weight = w[s] * inv;
        for (int64_t j = 0; j < Dv; j++) out[j] += weight * v[s * Dv + j];
    }
}

#if QKV_X86
QKV_AVX2 inline float dot(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float total = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

// w[s, end) = exp(w - top) where visible (0 where -inf), 8 lanes at a time then one by one;
// returns their sum added to `sums`' lanes, with the sink's share (it takes weight, gives no value).
QKV_AVX2 inline float ymm_weights(float *w, int64_t s, int64_t end, float top, const float *sink, __m256 sums) {
    const __m256 shift = _mm256_set1_ps(top), hidden = _mm256_set1_ps(-INFINITY);
    for (; s + 8 <= end; s += 8) {
        const __m256 x = _mm256_loadu_ps(w + s);
        const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, hidden, _CMP_EQ_OQ), exp8(_mm256_sub_ps(x, shift)));
        _mm256_storeu_ps(w + s, e);
        sums = _mm256_add_ps(sums, e);
    }
    float total = hsum(sums) + (sink ? expf(*sink - top) : 0.f);
    for (; s < end; s++) {
        w[s] = w[s] == -INFINITY ? 0.f : expf(w[s] - top);
        total += w[s];
    }
    return total;
}

QKV_AVX2 void avx2_attend(const float *q, const float *k, const float *v, const bool *visible, float *out,
                          int64_t begin, int64_t end, int64_t D, int64_t Dv, float scale, float softcap,
                          const float *sink, float *w) {
    float top = -INFINITY;
    for (int64_t s = begin; s < end; s++) {
        if (visible && !visible[s]) { w[s] = -INFINITY; continue; }
        w[s] = capped(dot(q, k + s * D, D) * scale, softcap);
        top = std::max(top, w[s]);
    }
    for (int64_t j = 0; j < Dv; j++) out[j] = 0.f;
    if (top == -INFINITY) return;
    if (sink) top = std::max(top, *sink);
    const float inv = 1.f / ymm_weights(w, begin, end, top, sink, _mm256_setzero_ps());
    for (int64_t s = begin; s < end; s++) {
        if (w[s] == 0.f) continue;
        const __m256 ws = _mm256_set1_ps(w[s] * inv);
        const float *vs = v + s * Dv;
        int64_t j = 0;
        for (; j + 8 <= Dv; j += 8)
            _mm256_storeu_ps(out + j, _mm256_fmadd_ps(ws, _mm256_loadu_ps(vs + j), _mm256_loadu_ps(out + j)));
        for (; j < Dv; j++) out[j] += w[s] * inv * vs[j];
    }
}

// GCC 12's own AVX-512 headers warn (maybe-uninitialized) where they are inlined (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// exp of 16 floats: exp8's operations lane for lane (the same bits in each lane)
QKV_AVX512 inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// hsum(lo + hi) of four accumulators at once, by the same additions (so the same bits): lanes
// 0, 4, 8 and 12 hold a's, b's, c's and d's. Half the shuffles of four hsums.
QKV_AVX512 inline __m512 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    constexpr int LOW = _MM_SHUFFLE(1, 0, 1, 0), HIGH = _MM_SHUFFLE(3, 2, 3, 2);
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, LOW), _mm512_shuffle_f32x4(a, b, HIGH)),  // lo + hi
        cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, LOW), _mm512_shuffle_f32x4(c, d, HIGH));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),  // 4 lanes + 4 lanes
                                   _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));  // (0 + 2, 1 + 3)
    return _mm512_add_ps(u, _mm512_movehdup_ps(u));                                    // 0 + 1
}

// N queries (q + j * ldq) against each key of [begin, end): w[j * ldw + s] = their scores, as
// avx2_attend's: one zmm accumulator is dot's two ymm ones (lanes 0-7 and 8-15), added, hsum.
template <int N>
QKV_AVX512 void zmm_scores(const float *q, int64_t ldq, const float *k, const bool *visible, int64_t begin,
                           int64_t end, int64_t D, float scale, float softcap, float *w, int64_t ldw, float *top) {
    for (int64_t s = begin; s < end; s++) {
        if (visible && !visible[s]) {
            for (int j = 0; j < N; j++) w[j * ldw + s] = -INFINITY;
            continue;
        }
        const float *ks = k + s * D;
        __m512 acc[N];
        for (int j = 0; j < N; j++) acc[j] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= D; i += 16) {
            const __m512 key = _mm512_loadu_ps(ks + i);
            for (int j = 0; j < N; j++) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * ldq + i), key, acc[j]);
        }
        alignas(64) float sums[16];
        if constexpr (N == 4) _mm512_store_ps(sums, hsum4(acc[0], acc[1], acc[2], acc[3]));
        for (int j = 0; j < N; j++) {
            const float *qj = q + j * ldq;
            float total = N == 4 ? sums[4 * j]
                                 : hsum(_mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(acc[j], 1)));
            for (int64_t t = i; t < D; t++) total += qj[t] * ks[t];
            const float score = capped(total * scale, softcap);
            w[j * ldw + s] = score;
            top[j] = std::max(top[j], score);
        }
    }
}

// w[begin, end) = exp(w - top) where visible (0 where -inf); returns their sum with the sink's
// share, in avx2_attend's order: 16 lanes at a time as two 8-lane sums, then ymm_weights.
QKV_AVX512 float zmm_weights(float *w, int64_t begin, int64_t end, float top, const float *sink) {
    const __m512 shift = _mm512_set1_ps(top), hidden = _mm512_set1_ps(-INFINITY);
    __m256 sums = _mm256_setzero_ps();
    int64_t s = begin;
    for (; s + 16 <= end; s += 16) {
        const __m512 x = _mm512_loadu_ps(w + s);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, hidden, _CMP_NEQ_UQ), exp16(_mm512_sub_ps(x, shift)));
        _mm512_storeu_ps(w + s, e);
        sums = _mm256_add_ps(sums, _mm512_castps512_ps256(e));
        sums = _mm256_add_ps(sums, _mm512_extractf32x8_ps(e, 1));
    }
    return ymm_weights(w, s, end, top, sink, sums);  // the rest as avx2_attend takes it
}

// out_j += (w_j[s] * inv_j) * v_s over the keys, avx2_attend's fused multiply-adds lane for lane,
// the N outputs of C zmm each (D_v = 16 C) held in registers; inv_j = 0: query j sees nothing.
template <int N, int C>
QKV_AVX512 void zmm_values(const float *v, const float *w, int64_t ldw, const float *inv, float *out, int64_t ldo,
                           int64_t begin, int64_t end) {
    __m512 acc[N][C];
    for (int j = 0; j < N; j++)
        for (int c = 0; c < C; c++) acc[j][c] = _mm512_loadu_ps(out + j * ldo + 16 * c);
    for (int64_t s = begin; s < end; s++) {
        __m512 vs[C];
        for (int c = 0; c < C; c++) vs[c] = _mm512_loadu_ps(v + s * 16 * C + 16 * c);
        for (int j = 0; j < N; j++) {
            const float ws = w[j * ldw + s];
            if (inv[j] == 0.f || ws == 0.f) continue;
            const __m512 wide = _mm512_set1_ps(ws * inv[j]);
            for (int c = 0; c < C; c++) acc[j][c] = _mm512_fmadd_ps(wide, vs[c], acc[j][c]);
        }
    }
    for (int j = 0; j < N; j++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(out + j * ldo + 16 * c, acc[j][c]);
}

// N queries sharing one key/value head, each as avx2_attend computes it alone: query j reads
// q + j * ldq and sinks[j], writes out + j * ldo, and takes w + j * end as scratch.
template <int N>
QKV_AVX512 void zmm_attend(const float *q, int64_t ldq, const float *k, const float *v, const bool *visible,
                           float *out, int64_t ldo, int64_t begin, int64_t end, int64_t D, int64_t Dv, float scale,
                           float softcap, const float *sinks, float *w) {
    float top[N], inv[N];
    for (int j = 0; j < N; j++) top[j] = -INFINITY;
    zmm_scores<N>(q, ldq, k, visible, begin, end, D, scale, softcap, w, end, top);
    for (int j = 0; j < N; j++) {
        for (int64_t c = 0; c < Dv; c++) out[j * ldo + c] = 0.f;
        inv[j] = 0.f;  // a query that sees no key keeps its zeros
        if (top[j] == -INFINITY) continue;
        const float *sink = sinks ? sinks + j : nullptr;
        if (sink) top[j] = std::max(top[j], *sink);
        inv[j] = 1.f / zmm_weights(w + j * end, begin, end, top[j], sink);
    }
    switch (Dv) {  // the common head sizes: outputs in registers
        case 16: return zmm_values<N, 1>(v, w, end, inv, out, ldo, begin, end);
        case 32: return zmm_values<N, 2>(v, w, end, inv, out, ldo, begin, end);
        case 64: return zmm_values<N, 4>(v, w, end, inv, out, ldo, begin, end);
        default: break;
    }
    for (int64_t s = begin; s < end; s++) {
        const float *vs = v + s * Dv;
        for (int j = 0; j < N; j++) {
            const float ws = w[j * end + s];
            if (inv[j] == 0.f || ws == 0.f) continue;
            float *o = out + j * ldo;
            const __m512 wide = _mm512_set1_ps(ws * inv[j]);
            int64_t c = 0;
            for (; c + 16 <= Dv; c += 16)
                _mm512_storeu_ps(o + c, _mm512_fmadd_ps(wide, _mm512_loadu_ps(vs + c), _mm512_loadu_ps(o + c)));
            for (; c + 8 <= Dv; c += 8)
                _mm256_storeu_ps(o + c, _mm256_fmadd_ps(_mm512_castps512_ps256(wide), _mm256_loadu_ps(vs + c),
                                                        _mm256_loadu_ps(o + c)));
            for (; c < Dv; c++) o[c] += ws * inv[j] * vs[c];
        }
    }
}

QKV_AVX512 void avx512_attend_group(const float *q, int64_t ldq, int64_t n, const float *k, const float *v,
                                    const bool *visible, float *out, int64_t ldo, int64_t begin, int64_t end,
                                    int64_t D, int64_t Dv, float scale, float softcap, const float *sinks, float *w) {
    for (int64_t j = 0; j < n; j += 4) {  // up to four queries at a time: their accumulators stay in registers
        const float *qj = q + j * ldq, *sj = sinks ? sinks + j : nullptr;
        float *oj = out + j * ldo;
        switch (std::min<int64_t>(4, n - j)) {
            case 1: zmm_attend<1>(qj, ldq, k, v, visible, oj, ldo, begin, end, D, Dv, scale, softcap, sj, w); break;
            case 2: zmm_attend<2>(qj, ldq, k, v, visible, oj, ldo, begin, end, D, Dv, scale, softcap, sj, w); break;
            case 3: zmm_attend<3>(qj, ldq, k, v, visible, oj, ldo, begin, end, D, Dv, scale, softcap, sj, w); break;
            default: zmm_attend<4>(qj, ldq, k, v, visible, oj, ldo, begin, end, D, Dv, scale, softcap, sj, w); break;
        }
    }
}
#pragma GCC diagnostic pop
#endif

}  // namespace

int64_t heads_per_task(int64_t rows, int64_t kv_heads, int64_t group) {
    return rows * kv_heads >= 4 * torch::stable::get_num_threads() ? group : 1;
}

void attend_group(const float *q, int64_t ldq, int64_t n, const float *k, const float *v, const bool *visible,
                  float *out, int64_t ldo, int64_t begin, int64_t end, int64_t D, int64_t Dv, float scale,
                  float softcap, const float *sinks, float *w) {
#if QKV_X86
    if (active_variant() >= AVX512)
        return avx512_attend_group(q, ldq, n, k, v, visible, out, ldo, begin, end, D, Dv, scale, softcap, sinks, w);
#endif
    for (int64_t j = 0; j < n; j++)
        attend_one(q + j * ldq, k, v, visible, out + j * ldo, begin, end, D, Dv, scale, softcap,
                   sinks ? sinks + j : nullptr, w + j * end);
}

void attend_one(const float *q, const float *k, const float *v, const bool *visible, float *out, int64_t begin,
                int64_t end, int64_t D, int64_t Dv, float scale, float softcap, const float *sink, float *w) {
#if QKV_X86
    if (active_variant() >= AVX512) return avx512_attend_group(q, D, 1, k, v, visible, out, Dv, begin, end, D, Dv, scale,
                                                               softcap, sink, w);
    if (active_variant() >= AVX2) return avx2_attend(q, k, v, visible, out, begin, end, D, Dv, scale, softcap, sink, w);
#endif
    generic_attend(q, k, v, visible, out, begin, end, D, Dv, scale, softcap, sink, w);
}

namespace {

Tensor decode_attention(Tensor q, Tensor k, Tensor v, std::optional<Tensor> visible, double scale) {
    using torch::headeronly::ScalarType;
    check(q.dim() == 3 && k.dim() == 4 && v.dim() == 4,
          "qkv::decode_attention takes q (B, H, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v)");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), S = k.size(2), Dv = v.size(3);
    check(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == D && Hkv > 0 &&
              H % Hkv == 0,
          "qkv::decode_attention: q, k and v disagree on B, S, D or the head groups");
    check(q.scalar_type() == ScalarType::Float && k.scalar_type() == ScalarType::Float &&
              v.scalar_type() == ScalarType::Float,
          "qkv::decode_attention takes float32 q, k and v");
    check(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "qkv::decode_attention takes contiguous tensors");
    const bool *vis = nullptr;
    if (visible.has_value()) {
        check(visible->dim() == 3 && visible->size(0) == B && visible->size(1) == H && visible->size(2) == S &&
                  visible->scalar_type() == ScalarType::Bool && visible->is_contiguous(),
              "qkv::decode_attention: visible must be a contiguous bool (B, H, S)");
        vis = static_cast<const bool *>(visible->data_ptr());
    }
    Tensor out = torch::stable::new_empty(q, {B, H, Dv});
    const float *qp = static_cast<const float *>(q.data_ptr()), *kp = static_cast<const float *>(k.data_ptr()),
                *vp = static_cast<const float *>(v.data_ptr());
    float *op = static_cast<float *>(out.data_ptr());
    const int64_t group = H / Hkv;
    // A mask is per query head: one at a time; without one a task takes heads_per_task of a row.
    const int64_t per = vis ? 1 : heads_per_task(B, Hkv, group), tasks = B * H / per;
    torch::stable::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> w(static_cast<size_t>(per * S));
        for (int64_t t = t0; t < t1; t++) {
            const int64_t i = t * per, b = i / H, h = i % H, kv = b * Hkv + h / group;  // i: the first query (b, h)
            attend_group(qp + i * D, D, per, kp + kv * S * D, vp + kv * S * Dv, vis ? vis + i * S : nullptr,
                         op + i * Dv, Dv, 0, S, D, Dv, static_cast<float>(scale), 0.f, nullptr, w.data());
        }
    });
    return out;
}

}  // namespace
}  // namespace qkv

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? visible, float scale) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("decode_attention", TORCH_BOX(&qkv::decode_attention));
}
