// One decoder layer's decode step in one call, executing a layer description.
//
// A layer is a dozen small operations around four weight products; called one by one from
// Python each costs more in dispatch than in arithmetic (about 0.8 ms a layer against 0.2 ms
// of products on SmolLM2). Here the whole layer is one call: the same products and attention
// as the ops, with the norms, RoPE, the cache write and the activation in between.
//
//   qkv::decoder_layer(x (B, C), spec (FIELDS,) f64, vectors, qkv, o, up, down, k_cache!, v_cache!,
//                      lengths!, positions (B,), rows (B,)?, key_positions! (rows, W + 1)?) -> (B, C)
//
// `spec` is the layer's description (qkv.models.configs.layer_spec.LayerSpec, packed by
// qkv.runtime.native_layer_spec in the order of `Field` below):
//     x = x + post_norm_a(o(attention(rope(q, k), v)))   with q, k, v = qkv(norm_a(x))
//     x = x + post_norm_m(down(act(gate) * up | act(up)))  with [gate | up] = up(norm_m(x))
// Each norm is absent, RMSNorm, LayerNorm, or LayerNorm with a bias (a weight offset such as
// Gemma's 1 + w is folded into the weight before the call); q/k norms are per head, or over
// all heads at once (OLMo 2: every query channel, then every key channel); RoPE turns
// the first rotary_dim channels of each head (rotate-half pairs i, i + rotary_dim / 2) or none
// (NoPE); scores are scale * q.k, soft-capped where softcap > 0, over the last `window` keys
// where window > 0, with a learned sink logit per head joining the softmax where sinks is
// set. `vectors` holds, in order, each present norm's weight (and bias) for norm_a,
// post_norm_a, norm_m, post_norm_m, then the q and k norms' weights, then RoPE's inverse
// frequencies (rotary_dim / 2), then the sinks (H). The linear layers are lists [w, (scales | d, m)?, bias?]
// (kernels.h's Linear). The new keys and values are written at `positions` of cache row
// rows[r] (or r); lengths[row] becomes at least position + 1. With `key_positions` (rows,
// W + 1) int64 the caches are a sliding-window ring (qkv.attention.caches.window_cache, W slots and
// a scratch slot): what a row held at its position and beyond is forgotten (a rewind),
// position p is written at slot p mod W, lengths[row] becomes p + 1, and the query sees the
// slots whose key position kp satisfies p - window < kp <= p. A row's tokens that reach W or
// beyond in one call (a prompt piece past the window) would overwrite slots their earlier
// queries still read: those queries read a copy taken before the writes (RingCopy).
//
// Every row is computed by the same operations whatever B is (batch invariance).
//
// Shape legend: B batch (rows), C hidden size, H query heads, H_kv key/value heads, D head
// size, S cache slots, F feed-forward size.
#include "kernels.h"

#include <math.h>

#include <memory>

namespace qkv {
namespace {

constexpr int64_t LAYOUT = 3;  // the version of the field order below
enum Field : int64_t {
    VERSION, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
    ATTN_NORM, ATTN_NORM_EPS, ATTN_POST_NORM, ATTN_POST_NORM_EPS,
    MLP_NORM, MLP_NORM_EPS, MLP_POST_NORM, MLP_POST_NORM_EPS,
    QK_NORM, QK_NORM_EPS, ROTARY_DIM, ACTIVATION, GATED, SCALE, SOFTCAP, WINDOW, SINKS, QK_NORM_OVER_ALL,
    FIELDS
};
enum ActivationKind : int64_t { SILU = 0, GELU_TANH = 1, GELU = 2 };

const float *vector_at(const std::vector<Tensor> &vectors, size_t &next, int64_t size, const char *message) {
    using torch::headeronly::ScalarType;
    check(next < vectors.size(), message);
    const Tensor &t = vectors[next++];
    check(t.dim() == 1 && t.size(0) == size && t.is_contiguous() && t.scalar_type() == ScalarType::Float, message);
    return static_cast<const float *>(t.data_ptr());
}

Norm norm_at(const double *spec, Field kind, const std::vector<Tensor> &vectors, size_t &next, int64_t size) {
    const int64_t code = static_cast<int64_t>(spec[kind]);
    check(static_cast<double>(code) == spec[kind], "qkv::decoder_layer: a norm kind must be a whole number");
    return norm_of(code, spec[kind + 1], vectors, next, size);
}

LayerDesc describe(const Tensor &spec_tensor, const std::vector<Tensor> &vectors, int64_t C) {
    using torch::headeronly::ScalarType;
    check(spec_tensor.dim() == 1 && spec_tensor.size(0) == FIELDS && spec_tensor.scalar_type() == ScalarType::Double &&
              spec_tensor.is_contiguous(),
          "qkv::decoder_layer: spec must be the packed layer description (float64, qkv.runtime.native_layer_spec)");
    const double *spec = static_cast<const double *>(spec_tensor.data_ptr());
    check(spec[VERSION] == static_cast<double>(LAYOUT), "qkv::decoder_layer: the layer description's layout "
          "is another version than this library's (rebuild the kernels)");
    LayerDesc L;
    L.heads = static_cast<int64_t>(spec[NUM_HEADS]);
    L.kv_heads = static_cast<int64_t>(spec[NUM_KV_HEADS]);
    L.head_dim = static_cast<int64_t>(spec[HEAD_DIM]);
    L.rotary_dim = static_cast<int64_t>(spec[ROTARY_DIM]);
    L.activation = static_cast<int64_t>(spec[ACTIVATION]);
    L.gated = spec[GATED] != 0.0;
    L.scale = static_cast<float>(spec[SCALE]);
    L.softcap = static_cast<float>(spec[SOFTCAP]);
    L.window = static_cast<int64_t>(spec[WINDOW]);
    check(L.heads > 0 && L.kv_heads > 0 && L.heads % L.kv_heads == 0 && L.head_dim > 0,
          "qkv::decoder_layer: the heads must be a positive multiple of the key/value heads");
    check(L.rotary_dim >= 0 && L.rotary_dim % 2 == 0 && L.rotary_dim <= L.head_dim,
          "qkv::decoder_layer: rotary_dim must be even and at most the head size (0: no RoPE)");
    check(L.activation >= SILU && L.activation <= GELU, "qkv::decoder_layer: the activation must be 0 (silu), "
          "1 (gelu_tanh) or 2 (gelu)");
    check(L.softcap >= 0.f && L.window >= 0, "qkv::decoder_layer: softcap and window must be >= 0 (0: none)");
    size_t next = 0;
    L.attn_norm = norm_at(spec, ATTN_NORM, vectors, next, C);
    L.attn_post_norm = norm_at(spec, ATTN_POST_NORM, vectors, next, C);
    L.mlp_norm = norm_at(spec, MLP_NORM, vectors, next, C);
    L.mlp_post_norm = norm_at(spec, MLP_POST_NORM, vectors, next, C);
    const int64_t qk = static_cast<int64_t>(spec[QK_NORM]);
    check(qk == NO_NORM || qk == RMS, "qkv::decoder_layer: q/k norms are RMS norms, or none");
    L.qk_over_all = spec[QK_NORM_OVER_ALL] != 0.0;
    if (qk == RMS) {  // per head: (D) weights; over all heads (OLMo 2): (H * D) and (H_kv * D)
        L.q_norm = norm_at(spec, QK_NORM, vectors, next, L.qk_over_all ? L.heads * L.head_dim : L.head_dim);
        L.k_norm = norm_at(spec, QK_NORM, vectors, next, L.qk_over_all ? L.kv_heads * L.head_dim : L.head_dim);
    }
    if (L.rotary_dim > 0)
        L.inv_freq = vector_at(vectors, next, L.rotary_dim / 2, "qkv::decoder_layer: inv_freq must be float32 (rotary_dim/2,)");
    if (spec[SINKS] != 0.0)
        L.sinks = vector_at(vectors, next, L.heads, "qkv::decoder_layer: sinks must be float32 (H,)");
    check(next == vectors.size(), "qkv::decoder_layer: more vectors than the description names");
    return L;
}

}  // namespace

Norm norm_of(int64_t kind, double eps, const std::vector<Tensor> &vectors, size_t &next, int64_t size) {
    Norm n;
    n.kind = kind;
    check(kind >= NO_NORM && kind <= LAYER_WITH_BIAS,
          "qkv::decoder_layer: a norm kind must be 0 (none), 1 (RMS), 2 (Layer) or 3 (Layer with bias)");
    n.size = size;
    n.eps = static_cast<float>(eps);
    if (n.kind == NO_NORM) return n;
    check(eps > 0.0, "qkv::decoder_layer: a norm's eps must be positive");
    n.weight = vector_at(vectors, next, size, "qkv::decoder_layer: a norm's weight (and bias) must be float32 vectors");
    if (n.kind == LAYER_WITH_BIAS)
        n.bias = vector_at(vectors, next, size, "qkv::decoder_layer: a norm's weight (and bias) must be float32 vectors");
    return n;
}

// out = norm(x) for one vector of n.size: RMSNorm x / sqrt(mean(x^2) + eps) * weight, or
// LayerNorm (x - mean) / sqrt(var + eps) * weight (+ bias); sums in double. In place is fine.
void normalize(const Norm &n, const float *x, float *out) {
    const int64_t C = n.size;
    double mean = 0.0;
    if (n.kind != RMS) {
        for (int64_t i = 0; i < C; i++) mean += x[i];
        mean /= static_cast<double>(C);
    }
    double squares = 0.0;
    for (int64_t i = 0; i < C; i++) {
        const double centred = x[i] - mean;
        squares += centred * centred;
    }
    const float inv = static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(C) + n.eps));
    const float shift = static_cast<float>(mean);
    for (int64_t i = 0; i < C; i++) {
        const float v = (x[i] - shift) * inv * n.weight[i];
        out[i] = n.bias ? v + n.bias[i] : v;
    }
}

namespace {

// f(r0, r1) over the rows [0, M): a prompt's rows split over the threads, ROW_GRAIN and more a
// share (each row's numbers are its own, whichever thread makes them); a decode step's on the
// calling thread.
constexpr int64_t ROW_GRAIN = 16;
template <typename F>
void for_rows(int64_t M, const F &f) {
    torch::stable::parallel_for(0, M, ROW_GRAIN, f);
}

// h (M, C) = norm(y) row by row (y itself where the layer has no such norm)
void norm_rows(const Norm &n, const float *y, float *h, int64_t M, int64_t C) {
    for_rows(M, [&](int64_t r0, int64_t r1) {
        if (n.kind == NO_NORM) std::copy(y + r0 * C, y + r1 * C, h + r0 * C);
        else
            for (int64_t r = r0; r < r1; r++) normalize(n, y + r * C, h + r * C);
    });
}

// x = x + (post_norm(part) or part), row by row
void add_shortcut(const Norm &post, float *x, float *part, int64_t M, int64_t C) {
    for_rows(M, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
            float *p = part + r * C;
            if (post.kind != NO_NORM) normalize(post, p, p);
            for (int64_t i = 0; i < C; i++) x[r * C + i] += p[i];
        }
    });
}

// RoPE in the rotate-half layout over the first 2 * half channels: pair (x[i], x[i + half]).
void rotate(float *x, const float *cos_, const float *sin_, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos_[i] - b * sin_[i];
        x[i + half] = b * cos_[i] + a * sin_[i];
    }
}

constexpr float SQRT_2_OVER_PI = 0.7978845608028654f, GELU_CUBIC = 0.044715f;

inline float activate_one(int64_t kind, float x) {
    if (kind == SILU) return x / (1.f + expf(-x));
    if (kind == GELU_TANH) return 0.5f * x * (1.f + tanhf(SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)));
    return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
}

// out (F) = act(gate) * up (gated: g = [gate | up] of 2F) or act(g) (F).
void generic_activate(int64_t kind, bool gated, const float *g, float *out, int64_t F) {
    for (int64_t i = 0; i < F; i++) out[i] = activate_one(kind, g[i]) * (gated ? g[F + i] : 1.f);
}

#if QKV_X86
QKV_AVX2 void avx2_activate(int64_t kind, bool gated, const float *g, float *out, int64_t F) {
    const __m256 one = _mm256_set1_ps(1.f), half = _mm256_set1_ps(0.5f), two = _mm256_set1_ps(2.f);
    const __m256 c0 = _mm256_set1_ps(SQRT_2_OVER_PI), c1 = _mm256_set1_ps(GELU_CUBIC);
    int64_t i = 0;
    for (; kind != GELU && i + 8 <= F; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        __m256 y;
        if (kind == SILU) {
            y = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        } else {  // tanh(z) = 1 - 2 / (exp(2z) + 1)
            const __m256 z = _mm256_mul_ps(c0, _mm256_fmadd_ps(_mm256_mul_ps(c1, x), _mm256_mul_ps(x, x), x));
            const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(_mm256_mul_ps(two, z)), one)));
            y = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t));
        }
        _mm256_storeu_ps(out + i, gated ? _mm256_mul_ps(y, _mm256_loadu_ps(g + F + i)) : y);
    }
    for (; i < F; i++) out[i] = activate_one(kind, g[i]) * (gated ? g[F + i] : 1.f);
}
#endif

void activate(int64_t kind, bool gated, const float *g, float *out, int64_t F) {
#if QKV_X86
    if (active_variant() >= AVX2) return avx2_activate(kind, gated, g, out, F);
#endif
    generic_activate(kind, gated, g, out, F);
}

}  // namespace

LayerCall layer_call(int64_t C, const Tensor &spec, const std::vector<Tensor> &vectors, const std::vector<Tensor> &qkv,
                     const std::vector<Tensor> &o, const std::vector<Tensor> &up, const std::vector<Tensor> &down,
                     const Tensor &k_cache, const Tensor &v_cache, const Tensor &lengths,
                     const std::optional<Tensor> &key_positions) {
    using torch::headeronly::ScalarType;
    LayerCall call;
    call.C = C;
    call.L = describe(spec, vectors, C);
    const LayerDesc &L = call.L;
    check(k_cache.dim() == 4 && v_cache.dim() == 4 && v_cache.size(0) == k_cache.size(0) &&
              v_cache.size(1) == k_cache.size(1) && v_cache.size(2) == k_cache.size(2) &&
              k_cache.scalar_type() == ScalarType::Float && v_cache.scalar_type() == ScalarType::Float &&
              k_cache.is_contiguous() && v_cache.is_contiguous(),
          "qkv::decoder_layer: the caches must be contiguous float32 (B, H_kv, S, D)");
    call.slots = k_cache.size(0);  // cache rows
    const int64_t H = L.heads, Hkv = L.kv_heads, D = L.head_dim, S = k_cache.size(2);
    call.S = S;
    check(k_cache.size(1) == Hkv && k_cache.size(3) == D && v_cache.size(3) == D,
          "qkv::decoder_layer: the caches' heads and head size disagree with the description");
    check(lengths.dim() == 1 && lengths.size(0) == call.slots && lengths.scalar_type() == ScalarType::Long &&
              lengths.is_contiguous(),
          "qkv::decoder_layer: lengths (one per cache row) must be contiguous int64");
    const int64_t Q = H * D, KV = Hkv * D, P = Q + 2 * KV;
    call.qkv = linear_of(qkv, C, "qkv::decoder_layer: qkv is not a linear layer of C inputs");
    call.o = linear_of(o, Q, "qkv::decoder_layer: o is not a linear layer of H*D inputs");
    call.up = linear_of(up, C, "qkv::decoder_layer: up is not a linear layer of C inputs");
    call.F = L.gated ? call.up.N / 2 : call.up.N;
    call.down = linear_of(down, call.F, "qkv::decoder_layer: down is not a linear layer of the feed-forward's size");
    check(call.qkv.N == P && call.o.N == C && call.down.N == C && (!L.gated || call.up.N % 2 == 0),
          "qkv::decoder_layer: the layers' sizes disagree with C, the heads and the head size");
    // A ring (a sliding-window cache): W = S - 1 slots and a scratch slot; key_positions (rows, S)
    // says which position each slot holds (-1: none). Position p lives at slot p mod W.
    if (key_positions.has_value()) {
        check(key_positions->dim() == 2 && key_positions->size(0) == call.slots && key_positions->size(1) == S &&
                  key_positions->scalar_type() == ScalarType::Long && key_positions->is_contiguous() && S - 1 >= 1 &&
                  L.window > 0 && S - 1 <= L.window,
              "qkv::decoder_layer: a ring's key_positions must be contiguous int64 (cache rows, W + 1), W at most "
              "the layer's window");
        call.ring = static_cast<int64_t *>(key_positions->data_ptr());
    }
    call.k_cache = static_cast<float *>(k_cache.data_ptr());
    call.v_cache = static_cast<float *>(v_cache.data_ptr());
    call.lengths = static_cast<int64_t *>(lengths.data_ptr());
    return call;
}

void check_step(const LayerCall &call, int64_t M, const int64_t *pos, const int64_t *row_of) {
    if (row_of) {
        for (int64_t r = 0; r < M; r++)
            check(row_of[r] >= 0 && row_of[r] < call.slots, "qkv::decoder_layer: a row lies outside the KV cache");
    } else {
        check(call.slots == M, "qkv::decoder_layer: without rows, x has one row per cache row");
    }
    const int64_t W = call.S - 1;
    for (int64_t r = 0; r < M; r++)  // a ring shorter than the window holds only positions below W
        check(pos[r] >= 0 && (call.ring ? (W == call.L.window || pos[r] < W) : pos[r] < call.S),
              "qkv::decoder_layer: a position lies outside the KV cache");
}

namespace {

// The buffers a layer call works in, each reused by the next call on this thread: grown when a
// call needs more, never zeroed (every element is written before it is read) and kept. Fresh
// zeroed vectors cost a prompt's prefill a page fault and a page clearing per 4 KiB, 66 MB a
// layer at 512 rows of a 1B model: about 7% of the prefill. A thread keeps its largest call's.
enum Buffer { NORMED, PROJECTED, CONTEXT, HIDDEN, ACTIVATED, RESIDUAL, BUFFERS };

float *workspace(Buffer b, int64_t n) {
    thread_local std::unique_ptr<float[]> held[BUFFERS];
    thread_local int64_t size[BUFFERS] = {};
    if (size[b] < n) {
        held[b].reset();
        held[b].reset(new float[static_cast<size_t>(n)]);
        size[b] = n;
    }
    return held[b].get();
}

// res (M, C) = o_proj(attention(norm(y))); the cache rows take the new keys and values.
void attention_part(const LayerCall &call, const float *y, float *res, int64_t M, const int64_t *pos,
                    const int64_t *row_of) {
    const LayerDesc &L = call.L;
    const int64_t C = call.C, H = L.heads, Hkv = L.kv_heads, D = L.head_dim, S = call.S;
    const int64_t Q = H * D, KV = Hkv * D, P = Q + 2 * KV, W = S - 1;
    int64_t *ring = call.ring;
    float *h = workspace(NORMED, M * C), *proj = workspace(PROJECTED, M * P), *context = workspace(CONTEXT, M * Q);
    norm_rows(L.attn_norm, y, h, M, C);
    apply(call.qkv, h, proj, M);
    float *kc = call.k_cache, *vc = call.v_cache;
    int64_t *held = call.lengths;
    // A ring row whose tokens in this call reach position W or beyond, more than one of them
    // (a prompt piece past the window): its later tokens' slots hold keys its earlier queries
    // still read, so its queries read a copy taken before the writes (RingCopy).
    std::vector<RingCopy> copies;
    std::vector<int64_t> copy_of;
    if (ring) copies = ring_copies(call, M, pos, row_of, copy_of);
    const int64_t half = L.rotary_dim / 2;
    std::vector<float> cos_(static_cast<size_t>(half)), sin_(static_cast<size_t>(half));
    for (int64_t r = 0; r < M; r++) {
        float *row = proj + r * P, *keys = row + Q, *values = keys + KV;
        for (int64_t i = 0; i < half; i++) {
            const float angle = static_cast<float>(pos[r]) * L.inv_freq[i];
            cos_[i] = cosf(angle);
            sin_[i] = sinf(angle);
        }
        if (L.qk_over_all && L.q_norm.kind != NO_NORM) {  // every query head at once, then every key head
            normalize(L.q_norm, row, row);
            normalize(L.k_norm, keys, keys);
        }
        for (int64_t hd = 0; hd < H + Hkv; hd++) {  // query heads, then key heads
            float *vec = hd < H ? row + hd * D : keys + (hd - H) * D;
            const Norm &qk = hd < H ? L.q_norm : L.k_norm;
            if (qk.kind != NO_NORM && !L.qk_over_all) normalize(qk, vec, vec);
            if (half > 0) rotate(vec, cos_.data(), sin_.data(), half);
        }
        const int64_t c = row_of ? row_of[r] : r;
        int64_t at = pos[r];
        if (ring) {  // as WindowKVCache.update: forget what position p and beyond held, then write p
            int64_t *kp = ring + c * S;
            for (int64_t s = 0; s < W; s++) kp[s] = kp[s] >= pos[r] ? -1 : kp[s];
            at = pos[r] % W;
            kp[at] = pos[r];
            kp[W] = -1;
            if (copy_of[c] >= 0) copies[copy_of[c]].take(pos[r], keys, values, Hkv, D);
        }
        for (int64_t g = 0; g < Hkv; g++) {
            const int64_t slot = ((c * Hkv + g) * S + at) * D;
            std::copy(keys + g * D, keys + (g + 1) * D, kc + slot);
            std::copy(values + g * D, values + (g + 1) * D, vc + slot);
        }
        held[c] = ring ? pos[r] + 1 : std::max(held[c], pos[r] + 1);
    }
    // a ring's query at p sees the slots holding positions p - window < kp <= p
    std::unique_ptr<bool[]> visible(ring ? new bool[static_cast<size_t>(M * S)] : nullptr);
    for (int64_t r = 0; ring && r < M; r++) {
        const int64_t *kp = ring + (row_of ? row_of[r] : r) * S;
        for (int64_t s = 0; s < S; s++)
            visible[r * S + s] = s < W && kp[s] >= 0 && kp[s] <= pos[r] && kp[s] > pos[r] - L.window;
    }
    int64_t widest = S;  // the most keys a query's range spans
    for (const RingCopy &copy : copies) widest = std::max(widest, copy.n);
    const int64_t group = H / Hkv;
    const int64_t per = heads_per_task(M, Hkv, group), tasks = H / per;  // a task: `per` query heads of a row
    torch::stable::parallel_for(0, M * tasks, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> w(static_cast<size_t>(per * widest));
        for (int64_t i = i0; i < i1; i++) {
            // rows from both ends in turn: a causal prompt's later rows read more keys, and each
            // thread takes one contiguous range of tasks, so both get as many keys to read
            const int64_t turn = i / tasks, r = turn % 2 == 0 ? turn / 2 : M - 1 - turn / 2;
            const int64_t hq = i % tasks * per, c = row_of ? row_of[r] : r;
            const float *q = proj + r * P + hq * D;
            float *out = context + r * Q + hq * D;
            const float *sinks = L.sinks ? L.sinks + hq : nullptr;
            if (ring && copy_of[c] >= 0) {  // the copy: positions base.. in order, the last `window` up to p
                const RingCopy &copy = copies[copy_of[c]];
                const int64_t end = pos[r] - copy.base + 1, begin = std::max<int64_t>(0, end - L.window);
                const int64_t head = (hq / group) * copy.n * D;
                attend_group(q, D, per, copy.k.data() + head, copy.v.data() + head, copy.held.get(), out, D, begin, end,
                             D, D, L.scale, L.softcap, sinks, w.data());
                continue;
            }
            const int64_t kv = c * Hkv + hq / group;
            // the keys this row's queries may see: the slots up to its own position (the last
            // `window`), or a ring's visible slots: below W, slot s holds position s, so those up to p
            const int64_t end = ring ? std::min(W, pos[r] + 1) : pos[r] + 1,
                          begin = !ring && L.window > 0 ? std::max<int64_t>(0, end - L.window) : 0;
            attend_group(q, D, per, kc + kv * S * D, vc + kv * S * D, ring ? visible.get() + r * S : nullptr, out, D,
                         begin, end, D, D, L.scale, L.softcap, sinks, w.data());
        }
    });
    apply(call.o, context, res, M);
}

// res (M, C) = down_proj(activation(up(norm(y)))).
void mlp_part(const LayerCall &call, const float *y, float *res, int64_t M) {
    const LayerDesc &L = call.L;
    const int64_t C = call.C, F = call.F;
    float *h = workspace(NORMED, M * C);
    norm_rows(L.mlp_norm, y, h, M, C);
    float *hidden = workspace(HIDDEN, M * call.up.N), *act = workspace(ACTIVATED, M * F);
    apply(call.up, h, hidden, M);
    for_rows(M, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) activate(L.activation, L.gated, hidden + r * call.up.N, act + r * F, F);
    });
    apply(call.down, act, res, M);
}

}  // namespace

void run_layer(const LayerCall &call, float *y, int64_t M, const int64_t *pos, const int64_t *row_of, int64_t part) {
    const int64_t C = call.C;
    float *res = workspace(RESIDUAL, M * C);
    if (part != MLP_PART) {
        attention_part(call, y, res, M, pos, row_of);
        if (part == ATTENTION_PART) {
            std::copy(res, res + M * C, y);
            return;
        }
        add_shortcut(call.L.attn_post_norm, y, res, M, C);
    }
    mlp_part(call, y, res, M);
    if (part == MLP_PART) {
        std::copy(res, res + M * C, y);
        return;
    }
    add_shortcut(call.L.mlp_post_norm, y, res, M, C);
}

namespace {

Tensor decoder_layer(Tensor x, Tensor spec, std::vector<Tensor> vectors, std::vector<Tensor> qkv,
                     std::vector<Tensor> o, std::vector<Tensor> up, std::vector<Tensor> down, Tensor k_cache,
                     Tensor v_cache, Tensor lengths, Tensor positions, std::optional<Tensor> rows,
                     std::optional<Tensor> key_positions, int64_t part) {
    using torch::headeronly::ScalarType;
    check(x.dim() == 2 && x.scalar_type() == ScalarType::Float && x.is_contiguous(),
          "qkv::decoder_layer takes x (B, C) contiguous float32");
    check(part >= WHOLE_LAYER && part <= MLP_PART, "qkv::decoder_layer: part is 0 (whole), 1 (attention) or 2 (MLP)");
    const int64_t M = x.size(0), C = x.size(1);
    const LayerCall call = layer_call(C, spec, vectors, qkv, o, up, down, k_cache, v_cache, lengths, key_positions);
    const int64_t *row_of = nullptr;  // row r of x is cache row rows[r] (or r)
    if (rows.has_value()) {
        check(rows->dim() == 1 && rows->size(0) == M && rows->scalar_type() == ScalarType::Long && rows->is_contiguous(),
              "qkv::decoder_layer: rows must be contiguous int64 (B,)");
        row_of = static_cast<const int64_t *>(rows->data_ptr());
    }
    check(positions.dim() == 1 && positions.size(0) == M && positions.scalar_type() == ScalarType::Long &&
              positions.is_contiguous(),
          "qkv::decoder_layer: positions (B,) must be contiguous int64");
    const int64_t *pos = static_cast<const int64_t *>(positions.data_ptr());
    check_step(call, M, pos, row_of);
    Tensor out = torch::stable::new_empty(x, {M, C});
    float *y = static_cast<float *>(out.data_ptr());
    std::copy(static_cast<const float *>(x.data_ptr()), static_cast<const float *>(x.data_ptr()) + M * C, y);
    run_layer(call, y, M, pos, row_of, part);
    return out;
}

}  // namespace
}  // namespace qkv

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("decoder_layer(Tensor x, Tensor spec, Tensor[] vectors, Tensor[] qkv, Tensor[] o, Tensor[] up, "
          "Tensor[] down, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) lengths, Tensor positions, "
          "Tensor? rows, Tensor(d!)? key_positions=None, int part=0) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("decoder_layer", TORCH_BOX(&qkv::decoder_layer));
}
