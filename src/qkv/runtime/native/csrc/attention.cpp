// One-query attention over a KV cache (a decode step): the generic variant in plain C++ and
// the AVX2 one (same math; the exponential is a polynomial there, std::exp here), and the op.
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
    const __m256 shift = _mm256_set1_ps(top), hidden = _mm256_set1_ps(-INFINITY);
    __m256 sums = _mm256_setzero_ps();
    int64_t s = begin;
    for (; s + 8 <= end; s += 8) {
        __m256 x = _mm256_loadu_ps(w + s);
        __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, hidden, _CMP_EQ_OQ), exp8(_mm256_sub_ps(x, shift)));
        _mm256_storeu_ps(w + s, e);
        sums = _mm256_add_ps(sums, e);
    }
    float total = hsum(sums) + (sink ? expf(*sink - top) : 0.f);  // the sink takes weight, gives no value
    for (; s < end; s++) {
        w[s] = w[s] == -INFINITY ? 0.f : expf(w[s] - top);
        total += w[s];
    }
    const float inv = 1.f / total;
    for (s = begin; s < end; s++) {
        if (w[s] == 0.f) continue;
        const __m256 ws = _mm256_set1_ps(w[s] * inv);
        const float *vs = v + s * Dv;
        int64_t j = 0;
        for (; j + 8 <= Dv; j += 8)
            _mm256_storeu_ps(out + j, _mm256_fmadd_ps(ws, _mm256_loadu_ps(vs + j), _mm256_loadu_ps(out + j)));
        for (; j < Dv; j++) out[j] += w[s] * inv * vs[j];
    }
}
#endif

}  // namespace

void attend_one(const float *q, const float *k, const float *v, const bool *visible, float *out, int64_t begin,
                int64_t end, int64_t D, int64_t Dv, float scale, float softcap, const float *sink, float *w) {
#if QKV_X86
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
    torch::stable::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> w(static_cast<size_t>(S));
        for (int64_t i = i0; i < i1; i++) {
            const int64_t b = i / H, h = i % H, kv = b * Hkv + h / group;
            attend_one(qp + i * D, kp + kv * S * D, vp + kv * S * Dv, vis ? vis + i * S : nullptr, op + i * Dv, 0, S,
                       D, Dv, static_cast<float>(scale), 0.f, nullptr, w.data());
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
