// Q4_K_X16 (q4k.h) in the library: its products inside a BLOCKS Linear (block_products.cpp's
// apply_blocks hands a Q4_K_X16 part here), and the ops that repack a Q4_K matrix at load:
//
//   qkv::q4k_repack(blocks (N, K / 256 * 144) u8 Q4_K, N % 16 == 0) -> the same shape, Q4_K_X16
//   qkv::q4k_unrepack(packed (N, K / 256 * 144) u8 Q4_K_X16) -> the file's Q4_K bytes
//
// A product over M activation rows takes them MR at a time per group of 16 weight rows, and up
// to PASS rows per pass over the task's weights: a prompt reads each weight once per MR rows
// from cache, not once a row from memory, and each output is the same float operations
// whatever M (q4k.h).
//
// Shape legend: M activation rows, K inputs, N outputs.
#include <vector>

#include "../kernels.h"
#include "q4k.h"

namespace qkv {
namespace blocks {
namespace q4k {

constexpr int64_t PASS = 64;  // activation rows per pass over a task's weights (their codes stay in L2)

void rows(const BlockPart &part, const XRow *xs, int64_t M, int64_t K, int64_t ldy, int64_t n0, int64_t n1, int64_t first,
          const float *bias, float *y, Variant v) {
#if QKV_X86
    const GroupRows kernel = v >= AVX512 ? avx512_group : v >= AVX2 ? avx2_group : generic_group;
#else
    const GroupRows kernel = generic_group;
    (void)v;
#endif
    const int64_t words = K / 64;
    std::vector<int32_t> p(static_cast<size_t>(M * words));
    for (int64_t m = 0; m < M; m++) minimum_sums(xs[m].sums, K, p.data() + m * words);
    float out[MR * ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += PASS) {
        const int64_t m1 = std::min(M, m0 + PASS);
        for (int64_t g = n0 / ROWS; g * ROWS < n1; g++) {
            const uint8_t *group = part.blocks + g * ROWS * part.row_bytes;
            const int64_t r0 = std::max(n0, g * ROWS), r1 = std::min(n1, (g + 1) * ROWS);
            for (int64_t m = m0; m < m1; m += MR) {
                const int count = static_cast<int>(std::min<int64_t>(MR, m1 - m));
                kernel(group, K, xs + m, p.data() + m * words, count, out);
                for (int c = 0; c < count; c++)
                    for (int64_t n = r0; n < r1; n++) {
                        const float s = out[c * ROWS + n - g * ROWS];
                        y[(m + c) * ldy + first + n] = bias ? s + bias[n] : s;
                    }
            }
        }
    }
}

}  // namespace q4k
}  // namespace blocks

namespace {

using torch::headeronly::ScalarType;

Tensor permuted(const Tensor &from, bool to_groups, const char *message) {
    check(from.dim() == 2 && from.scalar_type() == ScalarType::Byte && from.is_contiguous() &&
              from.size(0) % blocks::q4k::ROWS == 0 && from.size(0) > 0 && from.size(1) > 0 &&
              from.size(1) % static_cast<int64_t>(sizeof(blocks::BlockQ4_K)) == 0,
          message);
    Tensor to = torch::stable::new_empty(from, {from.size(0), from.size(1)});
    const uint8_t *src = static_cast<const uint8_t *>(from.data_ptr());
    uint8_t *dst = static_cast<uint8_t *>(to.data_ptr());
    const int64_t row_bytes = from.size(1), groups = from.size(0) / blocks::q4k::ROWS;
    torch::stable::parallel_for(0, groups, std::max<int64_t>(1, groups / 64), [&](int64_t g0, int64_t g1) {
        if (to_groups) blocks::q4k::repack(src, dst, row_bytes, g0, g1);
        else blocks::q4k::unrepack(src, dst, row_bytes, g0, g1);
    });
    return to;
}

Tensor q4k_repack(Tensor blocks) {
    return permuted(blocks, true, "qkv::q4k_repack: blocks must be contiguous uint8 Q4_K rows (N, K / 256 * 144), N a multiple of 16");
}

Tensor q4k_unrepack(Tensor packed) {
    return permuted(packed, false, "qkv::q4k_unrepack: packed must be contiguous uint8 (N, K / 256 * 144), N a multiple of 16");
}

}  // namespace
}  // namespace qkv

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("q4k_repack(Tensor blocks) -> Tensor");
    m.def("q4k_unrepack(Tensor packed) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("q4k_repack", TORCH_BOX(&qkv::q4k_repack));
    m.impl("q4k_unrepack", TORCH_BOX(&qkv::q4k_unrepack));
}
