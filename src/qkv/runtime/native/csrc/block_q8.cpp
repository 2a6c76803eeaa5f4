// Block products on rounded activations: a GGUF matrix times x with integer dot products.
//
//   qkv::block_linear_q8(x (M, K) f32, blocks (N, bytes) u8, int block_type, bias (N,)?, int isa) -> (M, N)
//
// The float products (block_products.cpp) decode every weight to float32 and multiply it by
// x: about a dozen vector operations for 16 weights, so on two cores a decode step's small
// matrices run at a third of the memory's speed. Here x is first rounded as qkv's int4
// layers and llama.cpp round it (per 32 inputs: step d = max|x| / 127, codes round(x / d)),
// every weight of a row becomes an unsigned code q (0..255) with, per 16 weights, an affine
// a, b (w = a q + b, the file's own decode: Q4_K's a = d * scale, b = -dmin * min; Q8_0's
// q = stored + 128, b = -128 d), and each 16 weights contribute
//     a * d_x * sum(q * x_code) + b * d_x * sum(x_code)
// where the sums are exact integers (AVX-512 VNNI's vpdpbusd: 64 products an instruction).
// The result is the dequantized weights times the rounded activations, up to float32
// summation order; each output is computed by the same operations whatever M is (batch
// invariance), and the generic C++ variant is the reference for the AVX-512 one. qkv's layers
// (the whole-layer kernel and the modules, through qkv::block_layer_linear) run it wherever the
// active variant is AVX-512 VNNI; elsewhere they run the float products.
//
// Shape legend: M rows of x, K inputs, N outputs, S = K / 16 groups of 16 weights.
#include "block_q8.h"
#include "block_kernels.h"

#include <math.h>

namespace qkv {
namespace q8 {
namespace {

// One block's affine per 16 weights: w = a[g] q + b[g] for weights 16 g .. 16 g + 15, with the
// float32 operations of the file's decode (a Q4_K block's a = d * scale as gguf computes it).
void block_affine(int64_t type, const uint8_t *blk, float *a, float *b) {
    switch (type) {
        case Q4_0: case Q5_0: case Q8_0: case IQ4_NL: {
            const float d = f16(blk), offset = type == Q4_0 ? -8.f : type == Q5_0 ? -16.f : -128.f;
            a[0] = a[1] = d;
            b[0] = b[1] = d * offset;
            return;
        }
        case Q4_1: case Q5_1:
            a[0] = a[1] = f16(blk);
            b[0] = b[1] = f16(blk + 2);
            return;
        case Q2_K: {
            const float d = f16(blk + 80), dmin = f16(blk + 82);
            for (int s = 0; s < 16; s++) {
                a[s] = d * static_cast<float>(blk[s] & 15);
                b[s] = -(dmin * static_cast<float>(blk[s] >> 4));
            }
            return;
        }
        case Q3_K: {
            const uint8_t *sc = blk + 96;
            const float d = f16(blk + 108);
            for (int s = 0; s < 16; s++) {
                const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
                a[s] = d * static_cast<float>((low | (high << 4)) - 32);
                b[s] = -4.f * a[s];
            }
            return;
        }
        case Q4_K: case Q5_K: {
            uint8_t sc[8], mn[8];
            scale_min_k4(blk + 4, sc, mn);
            const float d = f16(blk), dmin = f16(blk + 2);
            for (int j = 0; j < 8; j++) {
                a[2 * j] = a[2 * j + 1] = d * static_cast<float>(sc[j]);
                b[2 * j] = b[2 * j + 1] = -(dmin * static_cast<float>(mn[j]));
            }
            return;
        }
        case Q6_K: {
            const int8_t *sc = reinterpret_cast<const int8_t *>(blk + 192);
            const float d = f16(blk + 208);
            for (int s = 0; s < 16; s++) {
                a[s] = d * static_cast<float>(sc[s]);
                b[s] = -32.f * a[s];
            }
            return;
        }
        default: return;
    }
}

// One block's codes in weight order, in plain C++ (the reference; AVX-512 below for the common types).
void block_codes(int64_t type, const uint8_t *blk, uint8_t *q) {
    switch (type) {
        case Q4_0: case Q4_1: case IQ4_NL: {
            const uint8_t *qs = blk + (type == Q4_1 ? 4 : 2);
            for (int j = 0; j < 16; j++) {
                const int lo = qs[j] & 15, hi = qs[j] >> 4;
                q[j] = static_cast<uint8_t>(type == IQ4_NL ? IQ4_VALUES[lo] + 128 : lo);
                q[j + 16] = static_cast<uint8_t>(type == IQ4_NL ? IQ4_VALUES[hi] + 128 : hi);
            }
            return;
        }
        case Q5_0: case Q5_1: {
            const uint8_t *qh = blk + (type == Q5_1 ? 4 : 2), *qs = qh + 4;
            const uint32_t high = u32(qh);
            for (int j = 0; j < 16; j++) {
                q[j] = static_cast<uint8_t>((qs[j] & 15) | (((high >> j) & 1) << 4));
                q[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4));
            }
            return;
        }
        case Q8_0:
            for (int j = 0; j < 32; j++) q[j] = static_cast<uint8_t>(blk[2 + j] ^ 0x80);  // stored + 128
            return;
        case Q2_K: case Q3_K: {
            const uint8_t *qs = blk + (type == Q2_K ? 16 : 32);
            for (int w = 0; w < 256; w++) {  // w = 128 h + 32 t + r
                const int h = w / 128, t = (w / 32) % 4, r = w % 32;
                int code = (qs[32 * h + r] >> (2 * t)) & 3;
                if (type == Q3_K) code += 4 * ((blk[r] >> (w / 32)) & 1);  // q + 4 = low + 4 * hbit
                q[w] = static_cast<uint8_t>(code);
            }
            return;
        }
        case Q4_K: case Q5_K: {
            const bool five = type == Q5_K;
            const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
            for (int j = 0; j < 8; j++)
                for (int i = 0; i < 32; i++) {
                    int v = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
                    if (five) v |= ((qh[i] >> j) & 1) << 4;
                    q[32 * j + i] = static_cast<uint8_t>(v);
                }
            return;
        }
        case Q6_K: {
            const uint8_t *ql = blk, *qh = blk + 128;
            for (int w = 0; w < 256; w++) {
                const int h = w / 128, t = (w / 32) % 4, r = w % 32;
                const int low = (ql[64 * h + 32 * (t % 2) + r] >> (4 * (t / 2))) & 15;
                q[w] = static_cast<uint8_t>(low | (((qh[32 * h + r] >> (2 * t)) & 3) << 4));
            }
            return;
        }
        default: return;
    }
}

}  // namespace

Rounded round_x(const float *x, int64_t M, int64_t K, bool simd) {
    const int64_t G = K / BLOCK, S = K / 16;
    Rounded r;
    r.q.resize(static_cast<size_t>(M * K));
    r.step.resize(static_cast<size_t>(M * S));
    r.sum.resize(static_cast<size_t>(M * S));
    std::vector<float> d(static_cast<size_t>(M * G)), dsum(static_cast<size_t>(M * G));
#if QKV_X86
    if (simd) avx2_round_activations(x, r.q.data(), d.data(), dsum.data(), M * G);
    else
#endif
        generic_round_activations(x, r.q.data(), d.data(), dsum.data(), M * G);
    (void)simd;
    for (int64_t i = 0; i < M * S; i++) {
        int32_t total = 0;
        for (int64_t j = 0; j < 16; j++) total += r.q[i * 16 + j];
        r.step[i] = d[i / 2];
        r.sum[i] = static_cast<float>(total);
    }
    r.step32 = d;
    r.scaled_sum32 = dsum;
    r.sum4.resize(static_cast<size_t>(M * K / 4));
    for (int64_t i = 0; i < M * K / 4; i++)
        r.sum4[i] = r.q[4 * i] + r.q[4 * i + 1] + r.q[4 * i + 2] + r.q[4 * i + 3];
    return r;
}

namespace {

// One output: sum over groups g of a[g] step[g] dot(q, xq)_g + b[g] step[g] sum(xq)_g.
float dot_generic(const uint8_t *codes, const float *a, const float *b, const int8_t *xq, const float *step,
                  const float *sum, int64_t K) {
    float main = 0.f, offset = 0.f;
    for (int64_t g = 0; g < K / 16; g++) {
        int32_t dot = 0;  // exact: |dot| <= 16 * 255 * 127
        for (int64_t j = 0; j < 16; j++) dot += codes[16 * g + j] * xq[16 * g + j];
        main += (a[g] * step[g]) * static_cast<float>(dot);
        offset += (b[g] * step[g]) * sum[g];
    }
    return main + offset;
}

// Outputs [n0, n1) of y (leading dimension ldy) from one matrix's rows of blocks.
void q8_rows(int64_t type, const uint8_t *blocks, int64_t row_bytes, const Rounded &x, int64_t M, int64_t K,
             int64_t ldy, int64_t n0, int64_t n1, const float *bias, bool simd, float *y) {
    const int64_t W = weights_of(type), per = W / 16, S = K / 16, bytes = row_bytes / (K / W);
#if QKV_X86
    if (simd && in_registers_for(type, 1) != nullptr) {  // the common types: codes in registers (file comment)
        static_assert(TILE == 4, "by_rows lists the kernels for 1..TILE rows");
        const InRegisters by_rows[TILE + 1] = {nullptr, in_registers_for(type, 1), in_registers_for(type, 2), in_registers_for(type, 3),
                                         in_registers_for(type, 4)};
        float out[WEIGHT_ROWS * TILE];
        int64_t n = n0;
        if (const InRegisters many = M == 1 ? interleaved_for(type) : nullptr)  // a decode step: WEIGHT_ROWS rows at a time
            for (; n + WEIGHT_ROWS <= n1; n += WEIGHT_ROWS) {
                many(blocks + n * row_bytes, row_bytes, bytes, x, 0, K, out);
                for (int q = 0; q < WEIGHT_ROWS; q++) y[n + q] = bias ? out[q] + bias[n + q] : out[q];
            }
        for (; n < n1; n++)
            for (int64_t m = 0; m < M; m += TILE) {
                const int rows = static_cast<int>(std::min<int64_t>(TILE, M - m));
                by_rows[rows](blocks + n * row_bytes, row_bytes, bytes, x, m, K, out);
                for (int r = 0; r < rows; r++) y[(m + r) * ldy + n] = bias ? out[r] + bias[n] : out[r];
            }
        return;
    }
#endif
    std::vector<uint8_t> codes(static_cast<size_t>(K));
    std::vector<float> a(static_cast<size_t>(S)), b(static_cast<size_t>(S)), scale(static_cast<size_t>(S + 4)),
        offset(static_cast<size_t>(S));
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = blocks + n * row_bytes;
        for (int64_t i = 0; i < K / W; i++) block_affine(type, row + i * bytes, a.data() + i * per, b.data() + i * per);
        for (int64_t i = 0; i < K / W; i++) block_codes(type, row + i * bytes, codes.data() + i * W);
        for (int64_t m = 0; m < M; m++) {
            const float *step = x.step.data() + m * S, *sum = x.sum.data() + m * S;
            const int8_t *xq = x.q.data() + m * K;
            float total;
#if QKV_X86
            if (simd) {
                for (int64_t g = 0; g < S; g++) {
                    scale[g] = a[g] * step[g];
                    offset[g] = b[g] * step[g];
                }
                total = dot_avx512(codes.data(), scale.data(), offset.data(), xq, sum, K);
            } else
#endif
                total = dot_generic(codes.data(), a.data(), b.data(), xq, step, sum, K);
            y[m * ldy + n] = bias ? total + bias[n] : total;
        }
    }
}

}  // namespace
}  // namespace q8

bool q8_products_run(const Linear &L) {
    using q8::weights_of;
    if (active_variant() < AVX512 || L.K % 32) return false;
    for (int64_t p = 0; p < L.part_count; p++)
        if (L.K % weights_of(L.parts[p].type)) return false;
    return true;
}

void apply_blocks_q8(const Linear &L, const float *x, float *y, int64_t M, bool simd) {
    const q8::Rounded rounded = q8::round_x(x, M, L.K, simd);
    for_each_part(L, [&](const BlockPart &part, int64_t n0, int64_t n1, int64_t first) {
        q8::q8_rows(part.type, part.blocks, part.row_bytes, rounded, M, L.K, L.N, n0, n1,
                    L.bias ? L.bias + first : nullptr, simd, y + first);
    });
}

namespace {

using torch::headeronly::ScalarType;

// One matrix of blocks as a BLOCKS Linear for x (M, K), checked; `op` names the op in errors.
Linear one_matrix(const Tensor &x, const Tensor &blocks, int64_t block_type, const std::optional<Tensor> &bias,
                  const std::string &op) {
    check(x.dim() == 2 && x.scalar_type() == ScalarType::Float && x.is_contiguous(),
          (op + ": x must be a contiguous float32 matrix (M, K)").c_str());
    const int64_t K = x.size(1), row_bytes = block_kernels::row_bytes_of(block_type, K);
    check(row_bytes > 0 && K % 32 == 0, (op + ": K must be whole blocks of a block type this kernel reads").c_str());
    check(blocks.dim() == 2 && blocks.scalar_type() == ScalarType::Byte && blocks.is_contiguous() &&
              blocks.size(1) == row_bytes,
          (op + ": blocks must be contiguous uint8 (N, K / W * Z) for x's K").c_str());
    Linear L{Linear::BLOCKS};
    L.K = K;
    L.N = blocks.size(0);
    L.part_count = 1;
    L.parts[0] = BlockPart{block_type, L.N, row_bytes, static_cast<const uint8_t *>(blocks.data_ptr())};
    if (bias.has_value()) {
        check(bias->dim() == 1 && bias->size(0) == L.N && bias->is_contiguous() && bias->scalar_type() == ScalarType::Float,
              (op + ": bias must be a contiguous float32 vector (N,)").c_str());
        L.bias = static_cast<const float *>(bias->data_ptr());
    }
    return L;
}

// The op, for tests and the self-test: isa 1 generic, 3 AVX-512 (VNNI), 0 the best of those.
Tensor block_linear_q8(Tensor x, Tensor blocks, int64_t block_type, std::optional<Tensor> bias, int64_t isa) {
    check(isa == 0 || isa == 1 || (isa == 3 && best_variant() >= AVX512),
          "qkv::block_linear_q8: isa must be 0 (best), 1 (generic) or 3 (AVX-512 VNNI, where the CPU has it)");
    const Linear L = one_matrix(x, blocks, block_type, bias, "qkv::block_linear_q8");
    Tensor out = torch::stable::new_empty(x, {x.size(0), L.N});
    const bool simd = isa == 0 ? best_variant() >= AVX512 : isa == 3;
    apply_blocks_q8(L, static_cast<const float *>(x.data_ptr()), static_cast<float *>(out.data_ptr()), x.size(0), simd);
    return out;
}

// What a block layer of qkv's whole-layer kernel computes (products.cpp's `apply` on a BLOCKS
// Linear): the rounded-activation product where the active variant is AVX-512 VNNI, else the
// float product. The modules call this, so a layer gives the same numbers either way.
Tensor block_layer_linear(Tensor x, Tensor blocks, int64_t block_type, std::optional<Tensor> bias) {
    const Linear L = one_matrix(x, blocks, block_type, bias, "qkv::block_layer_linear");
    Tensor out = torch::stable::new_empty(x, {x.size(0), L.N});
    apply(L, static_cast<const float *>(x.data_ptr()), static_cast<float *>(out.data_ptr()), x.size(0));
    return out;
}

}  // namespace
}  // namespace qkv

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("block_linear_q8(Tensor x, Tensor blocks, int block_type, Tensor? bias, int isa) -> Tensor");
    m.def("block_layer_linear(Tensor x, Tensor blocks, int block_type, Tensor? bias) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("block_linear_q8", TORCH_BOX(&qkv::block_linear_q8));
    m.impl("block_layer_linear", TORCH_BOX(&qkv::block_layer_linear));
}
