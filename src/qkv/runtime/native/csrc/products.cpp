// qkv's weight-only matrix products for decoding: the generic variants (plain C++, the
// reference and the fallback), the choice of variant at run time, and the ops.
//
// A decode step multiplies a few rows of activations by every weight of the model once, so
// it is bound by how fast the weights stream from memory. The products read each weight once
// for all the rows of x and split the output features between PyTorch's threads.
//
//   qkv::int8_linear(x (M, K) f32, w (N, K) i8, scales (N,) f32, bias (N,) f32?) -> (M, N) f32
//       y = (x @ w^T) * scales + bias, in float32 (the exact product of x and the int8 weights)
//   qkv::f32_linear(x (M, K) f32, w (N, K) f32, bias (N,) f32?) -> (M, N) f32
//       y = x @ w^T + bias, nn.Linear's product in another summation order
//   qkv::int4_linear(x (M, K) f32, q (N, K/2) u8, d (N, K/32) f16, m (N, K/32) f16, bias?) -> (M, N) f32
//       (d and m may also be their float16 bits held in int16 tensors)
//       weights in blocks of 32: w = q * d + m, q in 0..15; byte j of a block's 16 holds
//       element j in its low nibble and element j + 16 in its high one (GGUF's Q4_1 layout).
//       x is rounded to int8 per block of 32 (one float step each, as llama.cpp does) and the
//       product is, per block, the exact integer dot of those codes and the 4-bit weights,
//       times d * step, plus m times the block's sum of rounded activations.
//   qkv::variants() -> str: the variants this CPU runs ("generic,avx2,avx512")
//   qkv::set_variant(str) -> str: cap the variant the ops run (returns the previous cap)
//   qkv::active_variant() -> str: the one they run now
//
// Shape legend: M rows of x (batch x tokens), K input features, N output features.
#include "kernels.h"
#include "block_format.h"

#include <math.h>

#include <atomic>
#include <cstring>

#if QKV_X86
#include <cpuid.h>
#endif

namespace qkv {

// -- which variant runs ------------------------------------------------------------------
namespace {

std::atomic<int64_t> variant_cap{AVX512};

Variant detect() {
#if QKV_X86
    __builtin_cpu_init();
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c)) return GENERIC;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return AVX512;
    return AVX2;
#else
    return GENERIC;
#endif
}

Variant variant_named(const std::string &name) {
    for (int64_t v = GENERIC; v <= AVX512; v++)
        if (name == variant_name(static_cast<Variant>(v))) return static_cast<Variant>(v);
    check(false, "qkv::set_variant takes generic, avx2 or avx512");
    return GENERIC;
}

}  // namespace

Variant best_variant() {
    static const Variant best = detect();
    return best;
}

Variant active_variant() {
    return static_cast<Variant>(std::min<int64_t>(best_variant(), variant_cap.load(std::memory_order_relaxed)));
}

const char *variant_name(Variant v) {
    return v == AVX512 ? "avx512" : v == AVX2 ? "avx2" : "generic";
}

// -- the generic variants --------------------------------------------------------------
void generic_int8_rows(const float *x, const int8_t *w, const float *scales, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            const int8_t *wr = w + n * K;
            float total = 0.f;
            for (int64_t k = 0; k < K; k++) total += xm[k] * static_cast<float>(wr[k]);
            y[m * N + n] = total * scales[n] + (bias ? bias[n] : 0.f);
        }
}

void generic_f32_rows(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K, *wr = w + n * K;
            float total = 0.f;
            for (int64_t k = 0; k < K; k++) total += xm[k] * wr[k];
            y[m * N + n] = total + (bias ? bias[n] : 0.f);
        }
}

void generic_round_activations(const float *x, int8_t *xq, float *xd, float *xsum, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        const float *b = x + i * BLOCK;
        float amax = 0.f;
        for (int64_t j = 0; j < BLOCK; j++) amax = std::max(amax, fabsf(b[j]));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int32_t total = 0;
        for (int64_t j = 0; j < BLOCK; j++) {
            const int32_t code = static_cast<int32_t>(lrintf(b[j] * inv));  // to nearest, ties to even
            xq[i * BLOCK + j] = static_cast<int8_t>(code);
            total += code;
        }
        xd[i] = d;
        xsum[i] = d * static_cast<float>(total);
    }
}

void generic_int4_rows(const int8_t *xq, const float *xd, const float *xsum, const uint8_t *q, const uint16_t *d,
                       const uint16_t *mn, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                       int64_t n0, int64_t n1, float *) {
    const int64_t G = K / BLOCK, S = BLOCK / 2;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float total = 0.f, off = 0.f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *block = q + (n * G + g) * S;
                const int8_t *xb = xq + m * K + g * BLOCK;
                int32_t dot = 0;  // exact: |dot| <= 32 * 15 * 127
                for (int64_t j = 0; j < S; j++) dot += (block[j] & 0x0F) * xb[j] + (block[j] >> 4) * xb[j + S];
                total += static_cast<float>(dot) * (half_to_float(d[n * G + g]) * xd[m * G + g]);
                off += half_to_float(mn[n * G + g]) * xsum[m * G + g];
            }
            y[m * N + n] = total + off + (bias ? bias[n] : 0.f);
        }
}

// -- the dispatch ----------------------------------------------------------------------
void apply(const Linear &L, const float *x, float *y, int64_t M) {
    if (L.kind == Linear::BLOCKS) return apply_blocks(L, x, y, M);
    const int64_t N = L.N, K = L.K, blocks = (N + ROWS - 1) / ROWS;
    const Variant variant = active_variant();
    if (L.kind == Linear::INT4) {
        const int64_t G = K / BLOCK;
        std::vector<int8_t> xq(static_cast<size_t>(M * K));
        std::vector<float> xd(static_cast<size_t>(M * G)), xsum(static_cast<size_t>(M * G));
#if QKV_X86
        if (variant >= AVX2) avx2_round_activations(x, xq.data(), xd.data(), xsum.data(), M * G);
        else
#endif
            generic_round_activations(x, xq.data(), xd.data(), xsum.data(), M * G);
        torch::stable::parallel_for(0, blocks, grain(blocks), [&](int64_t b0, int64_t b1) {
            std::vector<float> scratch(static_cast<size_t>(ROWS * G + 8));
            const int64_t n0 = b0 * ROWS, n1 = std::min(N, b1 * ROWS);
            const uint8_t *q = static_cast<const uint8_t *>(L.w);
#if QKV_X86
            if (variant >= AVX2) {
                x86_int4_rows(xq.data(), xd.data(), xsum.data(), q, L.d, L.m, L.bias, y, M, N, K, n0, n1,
                              scratch.data(), variant >= AVX512);
                return;
            }
#endif
            generic_int4_rows(xq.data(), xd.data(), xsum.data(), q, L.d, L.m, L.bias, y, M, N, K, n0, n1,
                              scratch.data());
        });
    } else {
        torch::stable::parallel_for(0, blocks, grain(blocks), [&](int64_t b0, int64_t b1) {
            const int64_t n0 = b0 * ROWS, n1 = std::min(N, b1 * ROWS);
            if (L.kind == Linear::INT8) {
                const int8_t *w = static_cast<const int8_t *>(L.w);
#if QKV_X86
                if (variant >= AVX2) return avx2_int8_rows(x, w, L.scales, L.bias, y, M, N, K, n0, n1, variant >= AVX512);
#endif
                generic_int8_rows(x, w, L.scales, L.bias, y, M, N, K, n0, n1);
            } else {
                const float *w = static_cast<const float *>(L.w);
#if QKV_X86
                if (variant >= AVX2) return avx2_f32_rows(x, w, L.bias, y, M, N, K, n0, n1);
#endif
                generic_f32_rows(x, w, L.bias, y, M, N, K, n0, n1);
            }
        });
    }
}

// -- the ops ---------------------------------------------------------------------------
namespace {

using torch::headeronly::ScalarType;

const float *optional_bias(const Tensor *bias, int64_t N) {
    if (bias == nullptr) return nullptr;
    check(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == ScalarType::Float,
          "qkv native kernels: bias must be a contiguous float32 vector of the output size");
    return static_cast<const float *>(bias->data_ptr());
}

bool half_bits(const Tensor &t) {  // float16, or its bits in int16 (what qkv's layers keep)
    return t.scalar_type() == ScalarType::Half || t.scalar_type() == ScalarType::Short;
}

Tensor run(const Linear &L, const Tensor &x) {
    const int64_t M = x.size(0);
    Tensor y = torch::stable::new_empty(x, {M, L.N});
    apply(L, static_cast<const float *>(x.data_ptr()), static_cast<float *>(y.data_ptr()), M);
    return y;
}

Tensor int8_linear(Tensor x, Tensor w, Tensor scales, std::optional<Tensor> bias) {
    check(x.dim() == 2 && w.dim() == 2 && scales.dim() == 1, "qkv::int8_linear takes x (M, K), w (N, K), scales (N,)");
    const int64_t K = x.size(1), N = w.size(0);
    check(w.size(1) == K && scales.size(0) == N, "qkv::int8_linear: x, w and scales disagree on K or N");
    check(x.scalar_type() == ScalarType::Float && w.scalar_type() == ScalarType::Char &&
              scales.scalar_type() == ScalarType::Float,
          "qkv::int8_linear takes float32 x and scales and int8 w");
    check(x.is_contiguous() && w.is_contiguous() && scales.is_contiguous(), "qkv::int8_linear takes contiguous tensors");
    const Linear L{Linear::INT8, w.data_ptr(), static_cast<const float *>(scales.data_ptr()),
                   optional_bias(bias ? &*bias : nullptr, N), nullptr, nullptr, N, K};
    return run(L, x);
}

Tensor f32_linear(Tensor x, Tensor w, std::optional<Tensor> bias) {
    check(x.dim() == 2 && w.dim() == 2, "qkv::f32_linear takes x (M, K) and w (N, K)");
    const int64_t K = x.size(1), N = w.size(0);
    check(w.size(1) == K, "qkv::f32_linear: x and w disagree on K");
    check(x.scalar_type() == ScalarType::Float && w.scalar_type() == ScalarType::Float,
          "qkv::f32_linear takes float32 x and w");
    check(x.is_contiguous() && w.is_contiguous(), "qkv::f32_linear takes contiguous tensors");
    const Linear L{Linear::F32, w.data_ptr(), nullptr, optional_bias(bias ? &*bias : nullptr, N), nullptr, nullptr,
                   N, K};
    return run(L, x);
}

Tensor int4_linear(Tensor x, Tensor q, Tensor d, Tensor mn, std::optional<Tensor> bias) {
    check(x.dim() == 2 && q.dim() == 2 && d.dim() == 2 && mn.dim() == 2,
          "qkv::int4_linear takes x (M, K), q (N, K/2), d and m (N, K/32)");
    const int64_t K = x.size(1), N = q.size(0);
    check(K % BLOCK == 0 && q.size(1) == K / 2 && d.size(0) == N && d.size(1) == K / BLOCK && mn.size(0) == N &&
              mn.size(1) == K / BLOCK,
          "qkv::int4_linear: K must be a multiple of 32 and q, d, m must be (N, K/2), (N, K/32), (N, K/32)");
    check(x.scalar_type() == ScalarType::Float && q.scalar_type() == ScalarType::Byte && half_bits(d) && half_bits(mn),
          "qkv::int4_linear takes float32 x, uint8 q and float16 d and m (or their bits as int16)");
    check(x.is_contiguous() && q.is_contiguous() && d.is_contiguous() && mn.is_contiguous(),
          "qkv::int4_linear takes contiguous tensors");
    const Linear L{Linear::INT4, q.data_ptr(), nullptr, optional_bias(bias ? &*bias : nullptr, N),
                   static_cast<const uint16_t *>(d.data_ptr()), static_cast<const uint16_t *>(mn.data_ptr()), N, K};
    return run(L, x);
}

std::string variants() {
    std::string names;
    for (int64_t v = GENERIC; v <= best_variant(); v++) names += std::string(v ? "," : "") + variant_name(static_cast<Variant>(v));
    return names;
}

std::string set_variant(std::string name) {
    const Variant cap = variant_named(name);
    return variant_name(static_cast<Variant>(variant_cap.exchange(cap)));
}

std::string active_variant_name() {
    return variant_name(active_variant());
}

}  // namespace

// [blocks, type, blocks, type, ..., bias?]: a GGUF file's matrices stacked by rows (linear_of).
static Linear blocks_of(const std::vector<Tensor> &parts, int64_t K, const char *message) {
    Linear L{Linear::BLOCKS};
    L.K = K;
    size_t i = 0;
    for (; i + 1 < parts.size() && parts[i + 1].scalar_type() == ScalarType::Long; i += 2) {
        const Tensor &blocks = parts[i], &type = parts[i + 1];
        check(L.part_count < MAX_PARTS && type.dim() == 1 && type.size(0) == 1 && type.is_contiguous(), message);
        BlockPart &part = L.parts[L.part_count++];
        part.type = *static_cast<const int64_t *>(type.data_ptr());
        part.row_bytes = blocks::row_bytes_of(part.type, K);
        check(part.row_bytes > 0 && blocks.scalar_type() == ScalarType::Byte && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) == part.row_bytes && blocks.size(0) > 0,
              message);
        part.rows = blocks.size(0);
        part.blocks = static_cast<const uint8_t *>(blocks.data_ptr());
        L.N += part.rows;
    }
    check(L.part_count > 0 && (i == parts.size() || i + 1 == parts.size()), message);
    if (i + 1 == parts.size()) L.bias = optional_bias(&parts[i], L.N);
    return L;
}

Linear linear_of(const std::vector<Tensor> &parts, int64_t K, const char *message) {
    check(!parts.empty(), message);
    const Tensor &w = parts[0];
    if (parts.size() >= 2 && parts[1].scalar_type() == ScalarType::Long) return blocks_of(parts, K, message);
    Linear L;
    size_t base = 1;
    if (w.scalar_type() == ScalarType::Float) {
        L.kind = Linear::F32;
    } else if (w.scalar_type() == ScalarType::Char) {
        L.kind = Linear::INT8;
        base = 2;
    } else {
        check(w.scalar_type() == ScalarType::Byte, message);
        L.kind = Linear::INT4;
        base = 3;
    }
    check(w.dim() == 2 && w.is_contiguous() && (parts.size() == base || parts.size() == base + 1), message);
    L.N = w.size(0);
    L.K = K;
    L.w = w.data_ptr();
    if (L.kind == Linear::INT4) {
        const Tensor &d = parts[1], &m = parts[2];
        check(K % BLOCK == 0 && w.size(1) == K / 2 && d.dim() == 2 && m.dim() == 2 && d.size(0) == L.N &&
                  d.size(1) == K / BLOCK && m.size(0) == L.N && m.size(1) == K / BLOCK && half_bits(d) &&
                  half_bits(m) && d.is_contiguous() && m.is_contiguous(),
              message);
        L.d = static_cast<const uint16_t *>(d.data_ptr());
        L.m = static_cast<const uint16_t *>(m.data_ptr());
    } else {
        check(w.size(1) == K, message);
    }
    if (L.kind == Linear::INT8) {
        const Tensor &s = parts[1];
        check(s.dim() == 1 && s.size(0) == L.N && s.is_contiguous() && s.scalar_type() == ScalarType::Float, message);
        L.scales = static_cast<const float *>(s.data_ptr());
    }
    if (parts.size() == base + 1) L.bias = optional_bias(&parts[base], L.N);
    return L;
}

}  // namespace qkv

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("int8_linear(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
    m.def("int4_linear(Tensor x, Tensor q, Tensor d, Tensor m, Tensor? bias) -> Tensor");
    m.def("f32_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
    m.def("variants() -> str");
    m.def("set_variant(str name) -> str");
    m.def("active_variant() -> str");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("int8_linear", TORCH_BOX(&qkv::int8_linear));
    m.impl("int4_linear", TORCH_BOX(&qkv::int4_linear));
    m.impl("f32_linear", TORCH_BOX(&qkv::f32_linear));
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CompositeExplicitAutograd, m) {
    m.impl("variants", TORCH_BOX(&qkv::variants));
    m.impl("set_variant", TORCH_BOX(&qkv::set_variant));
    m.impl("active_variant", TORCH_BOX(&qkv::active_variant_name));
}
