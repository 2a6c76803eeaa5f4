// Matrix products straight from GGUF's stored blocks (Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL).
//
//   qkv::block_linear(x (M, K) f32, blocks (N, K / W * Z) u8, int block_type, Tensor? bias (N,) f32,
//                     int isa) -> (M, N) f32
//       y = x @ w^T + bias, w the (N, K) weights the blocks stand for; block_type is GGML's type id
//       (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 10 Q2_K, 11 Q3_K, 12 Q4_K, 13 Q5_K, 14 Q6_K,
//       20 IQ4_NL); isa 0 picks the CPU's best, 1 the generic C++, 2 AVX2, 3 AVX-512
//   qkv::block_linear_best_isa(Tensor like) -> int: what isa 0 picks on this CPU (`like`, any CPU
//       tensor, only routes the call)
//
// The activations stay float32: each weight row is decoded into float32 values that equal the
// gguf library's dequantized ones bit for bit (same operations, no fused multiply-add: the
// file turns contraction off), then multiplied by every row of x. So the product is the
// dequantized product up to float32 summation order, and nothing else.
//
// One summation order for every variant and batch size: output (m, n) is the sum over k of
// w[n, k] * x[m, k] in 64 float32 lanes (lane l takes k = 64 i + l; a last chunk of 32 fills
// lanes 0..31), each lane a chain of fused multiply-adds, then the lanes added as a fixed
// tree (64 -> 32 -> 16 -> 8 -> 4 -> 2 -> 1, lane l + lane l + half). The generic C++, AVX2 (eight
// registers of 8) and AVX-512 (four of 16) variants compute exactly that, so their results are
// bit-identical, and a row of x gets the same numbers whatever else is in the batch.
//
// This file holds the op, the generic C++ (the reference: decode_block, dot_generic) and the
// choice of variant (__builtin_cpu_supports); block_kernels.h is the vectorised body, compiled
// for AVX2 in block_avx2.cpp and for AVX-512 in block_avx512.cpp (each under its own target
// pragma, so the build's flags need not enable them). A decode step (fewer than four rows of x)
// decodes the weights in registers, a larger batch decodes each weight row once into a buffer.
//
// Shape legend: M rows of x, K inputs, N outputs, W weights a block, Z bytes a block.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <cmath>
#include <algorithm>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "block_kernels.h"

using torch::stable::Tensor;

namespace block_kernels {

// the variants (block_avx2.cpp, block_avx512.cpp)
float row_dot_avx2(int64_t type, const uint8_t *row, const float *x, int64_t K, int64_t bytes);
float dot_avx2(const float *w, const float *x, int64_t K);
void decode_avx2(int64_t type, const uint8_t *row, int64_t K, int64_t bytes, float *w);
float row_dot_avx512(int64_t type, const uint8_t *row, const float *x, int64_t K, int64_t bytes);
float dot_avx512(const float *w, const float *x, int64_t K);
void decode_avx512(int64_t type, const uint8_t *row, int64_t K, int64_t bytes, float *w);

enum BlockType : int64_t {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
    IQ4_NL = 20,
};
enum Isa : int64_t { AUTO = 0, GENERIC = 1, AVX2 = 2, AVX512 = 3 };
constexpr int64_t LANES = 64;

struct Format {
    int64_t weights, bytes;
};

bool format_of(int64_t type, Format &f) {
    switch (type) {
        case Q4_0: f = {32, 18}; return true;
        case Q4_1: f = {32, 20}; return true;
        case Q5_0: f = {32, 22}; return true;
        case Q5_1: f = {32, 24}; return true;
        case Q8_0: f = {32, 34}; return true;
        case Q2_K: f = {256, 84}; return true;
        case Q3_K: f = {256, 110}; return true;
        case Q4_K: f = {256, 144}; return true;
        case Q5_K: f = {256, 176}; return true;
        case Q6_K: f = {256, 210}; return true;
        case IQ4_NL: f = {32, 18}; return true;
        default: return false;
    }
}

// float16 bits -> float32, exactly (subnormals, infinities and NaN payloads included).
float half(const uint8_t *p) {
    const uint32_t h = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do { mantissa <<= 1; e++; } while ((mantissa & 0x400u) == 0);
        bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mantissa & 0x3FFu) << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// One block's weights as float32, in the gguf library's operation order (qkv.models.gguf.kquants
// lists the layouts): out[0 .. W).
void decode_block(int64_t type, const uint8_t *b, float *out) {
    switch (type) {
        case Q4_0: {
            const float d = half(b);
            for (int j = 0; j < 16; j++) {
                out[j] = d * static_cast<float>((b[2 + j] & 15) - 8);
                out[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
            }
            return;
        }
        case Q4_1: {
            const float d = half(b), m = half(b + 2);
            for (int j = 0; j < 16; j++) {
                out[j] = d * static_cast<float>(b[4 + j] & 15) + m;
                out[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
            }
            return;
        }
        case Q5_0:
        case Q5_1: {
            const bool min = type == Q5_1;
            const float d = half(b), m = min ? half(b + 2) : 0.f;
            const uint8_t *qh = b + (min ? 4 : 2), *qs = qh + 4;
            const uint32_t high = qh[0] | (qh[1] << 8) | (qh[2] << 16) | (static_cast<uint32_t>(qh[3]) << 24);
            for (int j = 0; j < 16; j++) {
                const int lo = (qs[j] & 15) | (((high >> j) & 1) << 4), hi = (qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
                if (min) {
                    out[j] = d * static_cast<float>(lo) + m;
                    out[j + 16] = d * static_cast<float>(hi) + m;
                } else {
                    out[j] = d * static_cast<float>(lo - 16);
                    out[j + 16] = d * static_cast<float>(hi - 16);
                }
            }
            return;
        }
        case Q8_0: {
            const float d = half(b);
            for (int j = 0; j < 32; j++) out[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
            return;
        }
        case IQ4_NL: {
            const float d = half(b);
            for (int j = 0; j < 16; j++) {
                out[j] = d * static_cast<float>(IQ4_VALUES[b[2 + j] & 15]);
                out[j + 16] = d * static_cast<float>(IQ4_VALUES[b[2 + j] >> 4]);
            }
            return;
        }
        case Q2_K: {
            const uint8_t *sc = b, *qs = b + 16;
            const float d = half(b + 80), dmin = half(b + 82);
            for (int s = 0; s < 16; s++) {
                const float dl = d * static_cast<float>(sc[s] & 15), ml = dmin * static_cast<float>(sc[s] >> 4);
                for (int i = 0; i < 16; i++) {  // weight w = 16 s + i = 128 h + 32 t + r
                    const int w = 16 * s + i, h = w / 128, t = (w / 32) % 4, r = w % 32;
                    out[w] = dl * static_cast<float>((qs[32 * h + r] >> (2 * t)) & 3) - ml;
                }
            }
            return;
        }
        case Q3_K: {
            const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
            const float d = half(b + 108);
            for (int s = 0; s < 16; s++) {
                const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
                const float dl = d * static_cast<float>((low | (high << 4)) - 32);
                for (int i = 0; i < 16; i++) {
                    const int w = 16 * s + i, h = w / 128, t = (w / 32) % 4, r = w % 32;
                    const int q = ((qs[32 * h + r] >> (2 * t)) & 3) - 4 * (((hmask[r] >> (w / 32)) & 1) ^ 1);
                    out[w] = dl * static_cast<float>(q);
                }
            }
            return;
        }
        case Q4_K:
        case Q5_K: {
            uint8_t sc[8], mn[8];
            scale_min_k4(b + 4, sc, mn);
            const float d = half(b), dmin = half(b + 2);
            const bool five = type == Q5_K;
            const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                const float dl = d * static_cast<float>(sc[j]), ml = dmin * static_cast<float>(mn[j]);
                const uint8_t *q = qs + 32 * (j / 2);
                const int shift = 4 * (j % 2);
                for (int i = 0; i < 32; i++) {
                    int v = (q[i] >> shift) & 15;
                    if (five) v |= ((qh[i] >> j) & 1) << 4;
                    out[32 * j + i] = dl * static_cast<float>(v) - ml;
                }
            }
            return;
        }
        case Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
            const float d = half(b + 208);
            for (int s = 0; s < 16; s++) {
                const float dl = d * static_cast<float>(sc[s]);
                for (int i = 0; i < 16; i++) {
                    const int w = 16 * s + i, h = w / 128, t = (w / 32) % 4, r = w % 32;
                    const int low = (ql[64 * h + 32 * (t % 2) + r] >> (4 * (t / 2))) & 15;
                    const int high = (qh[32 * h + r] >> (2 * t)) & 3;
                    out[w] = dl * static_cast<float>((low | (high << 4)) - 32);
                }
            }
            return;
        }
        default: return;
    }
}

}  // namespace block_kernels

namespace {

using namespace block_kernels;

void decode_row(int64_t type, const Format &f, const uint8_t *row, int64_t K, float *w) {
    for (int64_t b = 0; b < K / f.weights; b++) decode_block(type, row + b * f.bytes, w + b * f.weights);
}

// -- the dot product, in the one summation order (file comment) ------------------------

float dot_generic(const float *w, const float *x, int64_t K) {
    float acc[LANES] = {};
    for (int64_t k = 0; k < K; k += LANES) {
        const int64_t lanes = std::min<int64_t>(LANES, K - k);
        for (int64_t l = 0; l < lanes; l++) acc[l] = std::fma(w[k + l], x[k + l], acc[l]);
    }
    for (int64_t half_ = LANES / 2; half_ >= 1; half_ /= 2)
        for (int64_t l = 0; l < half_; l++) acc[l] = acc[l] + acc[l + half_];
    return acc[0];
}

float row_dot_generic(int64_t type, const uint8_t *row, const float *x, int64_t K, int64_t /*bytes*/) {
    std::vector<float> w(static_cast<size_t>(K));
    Format f{};
    format_of(type, f);
    decode_row(type, f, row, K, w.data());
    return dot_generic(w.data(), x, K);
}

void decode_generic(int64_t type, const uint8_t *row, int64_t K, int64_t /*bytes*/, float *w) {
    Format f{};
    format_of(type, f);
    decode_row(type, f, row, K, w);
}

struct Variant {  // one instruction set's three entry points (all with the same math)
    float (*row_dot)(int64_t, const uint8_t *, const float *, int64_t, int64_t);
    float (*dot)(const float *, const float *, int64_t);
    void (*decode)(int64_t, const uint8_t *, int64_t, int64_t, float *);
};

bool cpu_has(Isa isa) {
    switch (isa) {
        case GENERIC: return true;
        case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        case AVX512: return __builtin_cpu_supports("avx512f") && cpu_has(AVX2);
        default: return false;
    }
}

int64_t best_isa() {
    return cpu_has(AVX512) ? AVX512 : cpu_has(AVX2) ? AVX2 : GENERIC;
}

Variant variant_for(int64_t isa) {

    if (isa == AVX512) return {row_dot_avx512, dot_avx512, decode_avx512};
    if (isa == AVX2) return {row_dot_avx2, dot_avx2, decode_avx2};
    return {row_dot_generic, dot_generic, decode_generic};
}

// Up to this many rows of x, each row decodes the weights again in registers (a decode step);
// from it on, a weight row is decoded once into a buffer and read back for every row of x.
// Both give the same numbers (the decoded values and the summation order are the same).
constexpr int64_t DECODE_ONCE_ROWS = 4;

void check(bool ok, const char *message) {
    STD_TORCH_CHECK(ok, message);
}

}  // namespace

namespace block_kernels {

int64_t row_bytes_of(int64_t type, int64_t K) {
    Format f{};
    if (!format_of(type, f) || K <= 0 || K % f.weights) return 0;
    return K / f.weights * f.bytes;
}

int64_t isa_of_variant(int64_t variant) {
    const int64_t isa = variant >= 2 ? AVX512 : variant == 1 ? AVX2 : GENERIC;
    return cpu_has(static_cast<Isa>(isa)) ? isa : GENERIC;
}

// Outputs n0..n1 of y (M, N) = x (M, K) @ w^T + bias, w the rows of blocks (row_bytes apart) of
// `type`, with variant `isa` (0 the CPU's best, 1 generic, 2 AVX2, 3 AVX-512; the caller checks
// that the CPU has the one it names). The entry point for a layer kernel that runs these products inside its own parallel
// loop (qkv::block_linear is this over PyTorch's threads); the type must be one format_of knows.
void block_rows(int64_t type, const uint8_t *blocks, int64_t row_bytes, const float *x, int64_t M, int64_t K,
                int64_t N, int64_t n0, int64_t n1, const float *bias, int64_t isa, float *y) {
    Format f{};
    format_of(type, f);
    const Variant v = variant_for(isa == AUTO ? best_isa() : isa);
    std::vector<float> w(M >= DECODE_ONCE_ROWS ? static_cast<size_t>(K) : 0);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = blocks + n * row_bytes;
        if (M >= DECODE_ONCE_ROWS) v.decode(type, row, K, f.bytes, w.data());
        for (int64_t m = 0; m < M; m++) {
            const float s = M >= DECODE_ONCE_ROWS ? v.dot(w.data(), x + m * K, K) : v.row_dot(type, row, x + m * K, K, f.bytes);
            y[m * N + n] = bias ? s + bias[n] : s;
        }
    }
}

}  // namespace block_kernels

namespace {

Tensor block_linear(Tensor x, Tensor blocks, int64_t block_type, std::optional<Tensor> bias, int64_t isa) {
    using torch::headeronly::ScalarType;
    Format f{};
    check(format_of(block_type, f), "qkv::block_linear: block_type is not a GGUF block type this kernel reads");
    check(x.dim() == 2 && x.scalar_type() == ScalarType::Float && x.is_contiguous(),
          "qkv::block_linear: x must be a contiguous float32 matrix (M, K)");
    const int64_t M = x.size(0), K = x.size(1);
    check(K > 0 && K % f.weights == 0, "qkv::block_linear: K must be whole blocks of the block type");
    check(blocks.dim() == 2 && blocks.scalar_type() == ScalarType::Byte && blocks.is_contiguous() &&
              blocks.size(1) == K / f.weights * f.bytes,
          "qkv::block_linear: blocks must be contiguous uint8 (N, K / W * Z) for x's K");
    const int64_t N = blocks.size(0);
    const float *b = nullptr;
    if (bias.has_value()) {
        check(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == ScalarType::Float,
              "qkv::block_linear: bias must be a contiguous float32 vector (N,)");
        b = static_cast<const float *>(bias->data_ptr());
    }
    if (isa == AUTO) isa = best_isa();
    check(isa >= GENERIC && isa <= AVX512 && cpu_has(static_cast<Isa>(isa)),
          "qkv::block_linear: isa must be 0 (best), 1 (generic) or an instruction set this CPU has (2 AVX2, 3 AVX-512)");
    Tensor out = torch::stable::new_empty(x, {M, N});
    const float *xp = static_cast<const float *>(x.data_ptr());
    const uint8_t *wp = static_cast<const uint8_t *>(blocks.data_ptr());
    float *y = static_cast<float *>(out.data_ptr());
    const int64_t row_bytes = blocks.size(1);
    const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
    // about four tasks a thread, but none under ~64K weights (a few microseconds): a small
    // matrix runs on the calling thread rather than waiting for a second one
    const int64_t grain = std::max<int64_t>({1, N / (4 * threads), (int64_t{1} << 16) / K});
    torch::stable::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        block_kernels::block_rows(block_type, wp, row_bytes, xp, M, K, N, n0, n1, b, isa, y);
    });
    return out;
}

int64_t block_linear_best_isa(Tensor) {
    return best_isa();
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("block_linear(Tensor x, Tensor blocks, int block_type, Tensor? bias, int isa) -> Tensor");
    m.def("block_linear_best_isa(Tensor like) -> int");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("block_linear", TORCH_BOX(&block_linear));
    m.impl("block_linear_best_isa", TORCH_BOX(&block_linear_best_isa));
}
