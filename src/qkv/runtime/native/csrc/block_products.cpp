// Matrix products straight from GGUF's stored blocks (block_format.h's table: Q4_0 .. Q8_0,
// Q2_K .. Q6_K, IQ4_NL), on activations rounded as the weight type multiplies them.
//
//   qkv::block_linear(x (M, K) f32, blocks (N, K / W * Z) u8, int block_type, Tensor? bias (N,) f32)
//       -> (M, N) f32: y = x' @ w^T + bias, w the (N, K) weights the blocks stand for and x' the
//       activations rounded per 32 (32-blocks) or per 256 (K-quants), block_format.h; in the
//       active variant (qkv::set_variant caps it), as qkv's whole-layer kernel runs a block layer
//   qkv::block_decode(blocks (N, K / W * Z) u8, int block_type, int K) -> (N, K) f32: the table's
//       generic decode (the gguf library's float32 values)
//   qkv::block_table(Tensor like) -> (types, 4) i64: the table itself (type id, W, Z, activation
//       step), which the tests hold against the gguf package's GGML_QUANT_SIZES
//
// The product is the dequantized weights times the rounded activations: every block's integer
// sum is exact, and the generic C++ (the reference), AVX2 and AVX-512 differ only in the order
// of the float32 sums of those (AVX2 and AVX-512 not at all: the same kernels, block_x86.h).
// Each output is computed by the same operations whatever M is (batch invariance).
//
// Shape legend: M rows of x, K inputs, N outputs.
#include "block_format.h"
#include "kernels.h"
#include "q4k/q4k.h"

namespace qkv {
namespace blocks {

#if QKV_X86
RowDot avx2_dot(int64_t type);    // block_avx2.cpp
RowDot avx512_dot(int64_t type);  // block_avx512.cpp
RowsDot avx2_rows(int64_t type);
RowsDot avx512_rows(int64_t type);
#endif

RowsDot rows_of(int64_t type, Variant v) {  // nullptr where the variant has no FOUR-row kernel for the type
#if QKV_X86
    if (v >= AVX512) return avx512_rows(type);
    if (v >= AVX2) return avx2_rows(type);
#endif
    (void)type, (void)v;
    return nullptr;
}

RowDot dot_of(int64_t type, Variant v) {
#if QKV_X86
    if (v >= AVX512) return avx512_dot(type);
    if (v >= AVX2) return avx2_dot(type);
#endif
    (void)v;
    return generic_dot(type);
}

}  // namespace blocks

void apply_blocks(const Linear &L, const float *x, float *y, int64_t M) {
    using namespace blocks;
    bool per32 = false, per256 = false;
    for (int64_t p = 0; p < L.part_count; p++) (traits_of(L.parts[p].type)->activation == PER32 ? per32 : per256) = true;
    const Variant variant = active_variant();
    const Rounded r32 = per32 ? round_activations(x, M, L.K, PER32, variant >= AVX2) : Rounded{};
    const Rounded r256 = per256 ? round_activations(x, M, L.K, PER256, variant >= AVX2) : Rounded{};
    std::vector<XRow> rows32(per32 ? M : 0), rows256(per256 ? M : 0);  // each row of x's pointers, made once
    for (int64_t m = 0; m < M; m++) {
        if (per32) rows32[m] = row_of(r32, m);
        if (per256) rows256[m] = row_of(r256, m);
    }
    for_each_part(L, [&](const BlockPart &part, int64_t n0, int64_t n1, int64_t first) {
        if (part.type == Q4_K_X16)
            return q4k::rows(part, rows256.data(), M, L.K, L.N, n0, n1, first, L.bias ? L.bias + first : nullptr, y, variant);
        const RowDot dot = dot_of(part.type, variant);
        const RowsDot several = rows_of(part.type, variant);
        const XRow *xs = traits_of(part.type)->activation == PER32 ? rows32.data() : rows256.data();
        const float *bias = L.bias ? L.bias + first : nullptr;
        int64_t n = n0;
        if (several != nullptr)
            for (; n + FOUR <= n1; n += FOUR) {
                const uint8_t *row = part.blocks + n * part.row_bytes;
                for (int64_t m = 0; m < M; m++) {
                    float s[FOUR];
                    several(row, part.row_bytes, xs[m], L.K, s);
                    for (int r = 0; r < FOUR; r++) y[m * L.N + first + n + r] = bias ? s[r] + bias[n + r] : s[r];
                }
            }
        for (; n < n1; n++) {
            const uint8_t *row = part.blocks + n * part.row_bytes;
            for (int64_t m = 0; m < M; m++) {
                const float s = dot(row, xs[m], L.K);
                y[m * L.N + first + n] = bias ? s + bias[n] : s;
            }
        }
    });
}

namespace {

using torch::headeronly::ScalarType;

Tensor block_linear(Tensor x, Tensor blocks, int64_t block_type, std::optional<Tensor> bias) {
    check(blocks::traits_of(block_type) != nullptr, "qkv::block_linear: block_type is not a GGUF block type this kernel reads");
    check(x.dim() == 2 && x.scalar_type() == ScalarType::Float && x.is_contiguous(),
          "qkv::block_linear: x must be a contiguous float32 matrix (M, K)");
    const int64_t K = x.size(1), row_bytes = blocks::row_bytes_of(block_type, K);
    check(row_bytes > 0, "qkv::block_linear: K must be whole blocks of the block type");
    check(blocks.dim() == 2 && blocks.scalar_type() == ScalarType::Byte && blocks.is_contiguous() && blocks.size(1) == row_bytes,
          "qkv::block_linear: blocks must be contiguous uint8 (N, K / W * Z) for x's K");
    Linear L{Linear::BLOCKS};
    L.K = K;
    L.N = blocks.size(0);
    L.part_count = 1;
    L.parts[0] = BlockPart{block_type, L.N, row_bytes, static_cast<const uint8_t *>(blocks.data_ptr())};
    if (bias.has_value()) {
        check(bias->dim() == 1 && bias->size(0) == L.N && bias->is_contiguous() && bias->scalar_type() == ScalarType::Float,
              "qkv::block_linear: bias must be a contiguous float32 vector (N,)");
        L.bias = static_cast<const float *>(bias->data_ptr());
    }
    Tensor out = torch::stable::new_empty(x, {x.size(0), L.N});
    apply(L, static_cast<const float *>(x.data_ptr()), static_cast<float *>(out.data_ptr()), x.size(0));
    return out;
}

Tensor block_decode(Tensor blocks, int64_t block_type, int64_t K) {
    const blocks::Traits *t = blocks::traits_of(block_type);
    check(t != nullptr && t->decode != nullptr, "qkv::block_decode: block_type is not a GGUF block type this kernel reads");
    check(K > 0 && K % t->weights == 0 && blocks.dim() == 2 && blocks.scalar_type() == ScalarType::Byte &&
              blocks.is_contiguous() && blocks.size(1) == K / t->weights * t->bytes,
          "qkv::block_decode: blocks must be contiguous uint8 (N, K / W * Z)");
    const int64_t N = blocks.size(0), G = K / t->weights;
    Tensor out = torch::stable::new_empty(blocks, {N, K}, ScalarType::Float);
    const uint8_t *b = static_cast<const uint8_t *>(blocks.data_ptr());
    float *o = static_cast<float *>(out.data_ptr());
    for (int64_t g = 0; g < N * G; g++) t->decode(b + g * t->bytes, o + g * t->weights);
    return out;
}

Tensor block_table(Tensor like) {  // (types, 4) int64: type id, weights, bytes, activation step
    int64_t count = 0;
    const blocks::Traits *table = blocks::all_traits(count);
    Tensor out = torch::stable::new_empty(like, {count, 4}, ScalarType::Long);
    int64_t *o = static_cast<int64_t *>(out.data_ptr());
    for (int64_t i = 0; i < count; i++) {
        const blocks::Traits &t = table[i];
        o[4 * i] = t.type, o[4 * i + 1] = t.weights, o[4 * i + 2] = t.bytes, o[4 * i + 3] = t.activation == blocks::PER32 ? 32 : 256;
    }
    return out;
}

}  // namespace
}  // namespace qkv

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("block_linear(Tensor x, Tensor blocks, int block_type, Tensor? bias) -> Tensor");
    m.def("block_decode(Tensor blocks, int block_type, int K) -> Tensor");
    m.def("block_table(Tensor like) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("block_linear", TORCH_BOX(&qkv::block_linear));
    m.impl("block_decode", TORCH_BOX(&qkv::block_decode));
    m.impl("block_table", TORCH_BOX(&qkv::block_table));
}
