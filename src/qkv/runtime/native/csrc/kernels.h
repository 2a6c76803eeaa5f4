// What every source of qkv's native kernels shares: the variants an op can run as and the
// one that runs now, the target attributes of the vectorised variants, small helpers, and
// `Linear` (a linear layer's weights as the products read them), and a layer's checked decode call.
//
// Each op has a generic variant in plain C++ (the reference, and the fallback on any CPU)
// and vectorised ones computing the same math (AVX2 + FMA + F16C; AVX-512 with VNNI). The
// whole library is compiled for the baseline x86-64 (or any other) target; a vectorised
// function carries its instruction set as a target attribute (QKV_AVX2, QKV_AVX512), and
// the variant that runs is picked at run time from what the CPU reports (cpuid, through
// __builtin_cpu_supports), capped by `qkv::set_variant` (tests, the load-time self-test).
//
// Shape legend: M rows of x (batch x tokens), K input features, N output features,
// G = K / 32 blocks.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#if defined(__x86_64__) || defined(_M_X64)
#define QKV_X86 1
#include <immintrin.h>
#define QKV_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QKV_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#else
#define QKV_X86 0
#endif

namespace qkv {

using torch::stable::Tensor;

constexpr int64_t ROWS = 4;    // output features computed together (they share x's loads)
constexpr int64_t BLOCK = 32;  // int4 block and activation-rounding block

// The variants, slowest first: a variant runs where the CPU has it and the cap allows it. The one
// CPU detection of the library (products.cpp's best_variant) and the one numbering every op uses:
// AVX2 means AVX2 + FMA + F16C, AVX512 means AVX-512 F, BW, DQ, VL and VNNI.
enum Variant : int64_t { GENERIC = 0, AVX2 = 1, AVX512 = 2 };

Variant best_variant();    // the fastest this CPU runs (cpuid), fixed for the process
Variant active_variant();  // min(best_variant(), the cap set by qkv::set_variant)
const char *variant_name(Variant v);

inline void check(bool ok, const char *message) {
    STD_TORCH_CHECK(ok, message);
}

inline int64_t grain(int64_t blocks) {  // row blocks per task: about 4 tasks per thread
    int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
    return std::max<int64_t>(1, blocks / (4 * threads));
}

// IEEE half -> float in plain C++ (what F16C's vcvtph2ps computes, exactly).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);  // inf, nan
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;  // +-0
    } else {  // subnormal half: normalise
        int e = -1;
        uint32_t m = mantissa;
        do { e++; m <<= 1; } while ((m & 0x400u) == 0);
        bits = sign | ((112 - e) << 23) | ((m & 0x3FFu) << 13);
    }
    float out;
    __builtin_memcpy(&out, &bits, sizeof out);
    return out;
}

#if QKV_X86
QKV_AVX2 inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// exp of 8 floats (Cephes' polynomial on [-ln2/2, ln2/2], relative error about 1e-7).
QKV_AVX2 inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// A linear layer's weights as the products read them: float32 w (N, K), int8 w (N, K) with
// scales (N,), 4-bit blocks q (N, K/2) with d and m (N, K/32) float16 bits, or a GGUF file's
// own blocks (BLOCKS: up to MAX_PARTS matrices stacked by rows, each in its own block type,
// as a Q4_K_M file's q, k and v are Q5_0, Q5_0 and Q8_0); bias optional.
struct BlockPart {
    int64_t type = 0, rows = 0, row_bytes = 0;  // GGUF block type; rows of the stacked output; bytes a row
    const uint8_t *blocks = nullptr;
};
constexpr int64_t MAX_PARTS = 4;

struct Linear {
    enum Kind { F32, INT8, INT4, BLOCKS } kind;
    const void *w = nullptr;
    const float *scales = nullptr, *bias = nullptr;
    const uint16_t *d = nullptr, *m = nullptr;
    int64_t N = 0, K = 0;
    BlockPart parts[MAX_PARTS] = {};
    int64_t part_count = 0;
};

// A BLOCKS Linear's outputs split over PyTorch's threads (about four tasks a thread, at least
// 64 Ki weights a task, a multiple of 16 rows), each task's range cut at the stacked matrices' boundaries:
// rows(part, n0, n1, first) computes outputs first + [n0, n1) from rows [n0, n1) of `part`.
template <class Rows>
void for_each_part(const Linear &L, Rows &&rows) {
    const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
    const int64_t chunk = (std::max<int64_t>({1, L.N / (4 * threads), (int64_t{1} << 16) / L.K}) + 15) / 16 * 16;  // whole groups of a repacked layout (repacked/q4k.h)
    torch::stable::parallel_for(0, L.N, chunk, [&](int64_t n0, int64_t n1) {
        int64_t first = 0;  // the stacked output where part p begins
        for (int64_t p = 0; p < L.part_count; p++) {
            const BlockPart &part = L.parts[p];
            const int64_t a = std::max(n0, first), b = std::min(n1, first + part.rows);
            if (a < b) rows(part, a - first, b - first, first);
            first += part.rows;
        }
    });
}

// block_products.cpp: a BLOCKS Linear's products on activations rounded as each part's block
// type multiplies them (block_format.h), in the active variant.
void apply_blocks(const Linear &L, const float *x, float *y, int64_t M);

// y (M, N) = x (M, K) through L, on PyTorch's threads, in the active variant. Each row of y
// is computed by the same operations whatever M is (batch invariance).
void apply(const Linear &L, const float *x, float *y, int64_t M);

// [w, (scales | d, m)?, bias?], or [blocks, type, blocks, type, ..., bias?] (uint8 (N_i, bytes)
// and an int64 (1,) GGUF block type per stacked matrix), as a Linear of K inputs
// (qkv::decoder_layer's lists).
Linear linear_of(const std::vector<Tensor> &parts, int64_t K, const char *message);

// -- the products' variants (products.cpp: generic; products_x86.cpp: AVX2, AVX-512) ------
// Rows [n0, n1) of y = (x @ w^T) * scales + bias; scales may be null (float32 weights).
void generic_int8_rows(const float *x, const int8_t *w, const float *scales, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1);
void generic_f32_rows(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int64_t n0, int64_t n1);
// x (count blocks of 32) -> int8 codes xq, per-block step xd and xd * sum(codes) xsum.
void generic_round_activations(const float *x, int8_t *xq, float *xd, float *xsum, int64_t count);
// Rows [n0, n1) of the int4 product of rounded activations; scratch holds ROWS * G floats.
void generic_int4_rows(const int8_t *xq, const float *xd, const float *xsum, const uint8_t *q, const uint16_t *d,
                       const uint16_t *mn, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                       int64_t n0, int64_t n1, float *scratch);
#if QKV_X86
// pairs: two rows of x a pass with AVX-512's registers (the same numbers as one at a time)
void avx2_int8_rows(const float *x, const int8_t *w, const float *scales, const float *bias, float *y, int64_t M,
                    int64_t N, int64_t K, int64_t n0, int64_t n1, bool pairs);
void avx2_f32_rows(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                   int64_t n0, int64_t n1);
void avx2_round_activations(const float *x, int8_t *xq, float *xd, float *xsum, int64_t count);
// vnni: the four-block AVX-512 VNNI steps first (the AVX2 ones finish the row)
void x86_int4_rows(const int8_t *xq, const float *xd, const float *xsum, const uint8_t *q, const uint16_t *d,
                   const uint16_t *mn, const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t n0,
                   int64_t n1, float *scratch, bool vnni);
#endif

// -- attention (attention.cpp) ------------------------------------------------------------
// One query against keys [begin, end) of one head: softmax of scale * q.k (soft-capped:
// cap * tanh(s / cap) where softcap > 0) over the visible ones, then the weighted sum of
// the values into out (D_v); zeros where no key is visible. sink: a learned logit that joins
// the softmax, taking weight but giving no value (gpt-oss), or null. w: scratch of `end` floats.
void attend_one(const float *q, const float *k, const float *v, const bool *visible, float *out, int64_t begin,
                int64_t end, int64_t D, int64_t Dv, float scale, float softcap, const float *sink, float *w);
// n queries sharing that head and visible (a prompt row's grouped query heads), each as attend_one
// computes it alone: query j is q + j * ldq, writes out + j * ldo, has sink sinks[j] (or
// none) and scratch w + j * end (w: n * end floats).
void attend_group(const float *q, int64_t ldq, int64_t n, const float *k, const float *v, const bool *visible,
                  float *out, int64_t ldo, int64_t begin, int64_t end, int64_t D, int64_t Dv, float scale,
                  float softcap, const float *sinks, float *w);
// How many query heads of a key/value head one attention task takes over `rows` rows: the whole
// group (each key and value loaded once for it) where that leaves >= 4 tasks a thread, else one
// (a decode step of few key/value heads would leave threads idle).
int64_t heads_per_task(int64_t rows, int64_t kv_heads, int64_t group);

// -- one decoder layer's decode step, checked once and run many times (layer.cpp) -----------
// `qkv::decoder_layer` checks and runs a LayerCall per call; stack.cpp keeps a model's
// LayerCalls (and its head) for a whole session and runs them all in one call a step.
enum NormKind : int64_t { NO_NORM = 0, RMS = 1, LAYER = 2, LAYER_WITH_BIAS = 3 };

struct Norm {
    int64_t kind = NO_NORM;
    const float *weight = nullptr, *bias = nullptr;
    int64_t size = 0;
    float eps = 0.f;
};

// A norm of `kind` over `size` channels whose weight (and bias) are vectors[next...]; next
// moves past them. Refuses (with `message`) what is not float32 (size,) vectors.
Norm norm_of(int64_t kind, double eps, const std::vector<Tensor> &vectors, size_t &next, int64_t size);

// out = norm(x) for one vector of n.size (in place is fine).
void normalize(const Norm &n, const float *x, float *out);

// The layer description as the C++ reads it (what the packed spec holds, checked).
struct LayerDesc {
    int64_t heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0, activation = 0, window = 0;
    bool gated = true, qk_over_all = false;  // q/k norms over each head, or over all heads at once
    float scale = 1.f, softcap = 0.f;
    Norm attn_norm, attn_post_norm, mlp_norm, mlp_post_norm, q_norm, k_norm;
    const float *inv_freq = nullptr, *sinks = nullptr;  // sinks: one learned logit per query head
};

// A layer bound to one cache: its description, its four linear layers and the cache's
// buffers, every size checked against the others. It points into the tensors it was made
// from: whoever keeps a LayerCall past that call keeps those tensors too (stack.cpp).
struct LayerCall {
    LayerDesc L;
    Linear qkv, o, up, down;
    int64_t C = 0, F = 0, slots = 0, S = 0;
    float *k_cache = nullptr, *v_cache = nullptr;
    int64_t *lengths = nullptr, *ring = nullptr;  // ring: a sliding-window cache's key positions (slots, S)
};

LayerCall layer_call(int64_t C, const Tensor &spec, const std::vector<Tensor> &vectors, const std::vector<Tensor> &qkv,
                     const std::vector<Tensor> &o, const std::vector<Tensor> &up, const std::vector<Tensor> &down,
                     const Tensor &k_cache, const Tensor &v_cache, const Tensor &lengths,
                     const std::optional<Tensor> &key_positions);

// What a ring row's queries read when its tokens in one call reach position W or beyond (a
// prompt piece past the window, whose later slots would overwrite keys its earlier queries
// still read): the ring's keys and values at positions [base, first) as they were before the
// call's writes (those it holds: `held`), then the call's own at [first, last] (`take`), in
// position order, (H_kv, n, D) each (ring_copy.cpp). The query at p attends the copy's last
// `window` entries up to p, as it would the ring in a decode step at p, in another order of the
// same keys (the ring's is slot order).
struct RingCopy {
    int64_t base = 0, n = 0;
    std::vector<float> k, v;
    std::unique_ptr<bool[]> held;
    void take(int64_t position, const float *keys, const float *values, int64_t kv_heads, int64_t head_dim);
};

// The copies a ring call of M rows needs, one per cache row whose tokens (more than one, at
// consecutive positions) reach W or beyond; copy_of[cache row] becomes its index in them, or -1
// (that row's queries read the ring itself after the writes: a decode step evicts only the key
// at p - W, outside its window; a piece below W overwrites nothing). Taken before any write.
std::vector<RingCopy> ring_copies(const LayerCall &call, int64_t M, const int64_t *positions, const int64_t *rows,
                                  std::vector<int64_t> &copy_of);

// The rows (cache rows, or null: row r is cache row r) and positions of a step of M rows,
// checked against the call's cache.
void check_step(const LayerCall &call, int64_t M, const int64_t *positions, const int64_t *rows);

// y (M, C) through the layer, in place; the cache rows take the new keys and values.
// part (tensor parallelism, qkv.runtime.tensor_parallel): WHOLE_LAYER, or ATTENTION_PART (y
// becomes the attention's o_proj product, no shortcut: a rank's partial sum) or MLP_PART (the
// feed-forward's down_proj product of y, no shortcut); the caller all-reduces and adds them.
enum LayerPart : int64_t { WHOLE_LAYER = 0, ATTENTION_PART = 1, MLP_PART = 2 };
void run_layer(const LayerCall &call, float *y, int64_t M, const int64_t *positions, const int64_t *rows,
               int64_t part = WHOLE_LAYER);

}  // namespace qkv
