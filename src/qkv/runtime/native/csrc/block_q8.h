// What block_q8.cpp (the reference and the entry points) and block_q8_avx512.cpp (the AVX-512
// VNNI kernels) share: the block types' small decoders, x's rounding, and the kernels' signatures.
// block_q8.cpp's comment says what the products compute.
#pragma once
#include "kernels.h"
#include "block_kernels.h"

#include <cstring>

namespace qkv {
namespace q8 {

enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
                      Q6_K = 14, IQ4_NL = 20 };
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float f16(const uint8_t *p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

inline uint32_t u32(const uint8_t *p) {
    return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

inline int64_t weights_of(int64_t type) {
    return type >= Q2_K && type <= Q6_K ? 256 : 32;
}

using block_kernels::scale_min_k4;

// x's rounding, once a call: codes (M, K), the step per 16 inputs (M, S) and the codes' sums (M, S).
struct Rounded {
    std::vector<int8_t> q;
    std::vector<float> step, sum;  // per 16 inputs
    std::vector<float> step32, scaled_sum32;  // per 32: the step, and step * sum(codes)
    std::vector<int32_t> sum4;  // per 4 inputs: the codes' sum (what a constant code offset subtracts)
};

using InRegisters = void (*)(const uint8_t *, int64_t, int64_t, const Rounded &, int64_t, int64_t, float *);
constexpr int TILE = 4;  // rows of x a row of blocks is decoded for at once
constexpr int WEIGHT_ROWS = 4;  // rows of blocks interleaved for one row of x (a decode step)

#if QKV_X86
// block_q8_avx512.cpp: the sum of dot_generic over a row of codes (scale = a * step, offset = b * step
// per 16), and the kernels that make the common types' codes in registers (nullptr for the others).
float dot_avx512(const uint8_t *codes, const float *scale, const float *offset, const int8_t *xq, const float *sum,
                 int64_t K);
InRegisters in_registers_for(int64_t type, int rows);  // rows (1..TILE) rows of x against one row of blocks
InRegisters interleaved_for(int64_t type);      // WEIGHT_ROWS rows of blocks against one row of x, or nullptr
#endif

}  // namespace q8
}  // namespace qkv
