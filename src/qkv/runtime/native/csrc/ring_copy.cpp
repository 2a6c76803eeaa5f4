// A ring's prompt piece past its window: the copy its queries read (kernels.h's RingCopy).
//
// Position p lives at ring slot p mod W, so a piece of a row's tokens that reaches W or beyond
// writes slots whose keys its own earlier queries still need (the query at q reads positions
// q - window < kp <= q; the token at p > q, p >= W, overwrites p - W, inside that range). A
// decode step writes one token, evicting p - W, outside its own window, and a piece below W
// writes empty slots; only pieces past the window need the copy, taken before the writes, as
// WindowKVCache.update answers a prompt with the slots as they were followed by its own keys.
//
// Shape legend: H_kv key/value heads, D head size, n positions a copy holds, W ring slots.
#include "kernels.h"

#include <algorithm>
#include <cstdint>

namespace qkv {

void RingCopy::take(int64_t position, const float *keys, const float *values, int64_t Hkv, int64_t D) {
    const int64_t i = position - base;
    held[i] = true;
    for (int64_t g = 0; g < Hkv; g++) {
        std::copy(keys + g * D, keys + (g + 1) * D, k.data() + (g * n + i) * D);
        std::copy(values + g * D, values + (g + 1) * D, v.data() + (g * n + i) * D);
    }
}

std::vector<RingCopy> ring_copies(const LayerCall &call, int64_t M, const int64_t *pos, const int64_t *row_of,
                                  std::vector<int64_t> &copy_of) {
    const int64_t S = call.S, W = S - 1, Hkv = call.L.kv_heads, D = call.L.head_dim;
    std::vector<int64_t> first(static_cast<size_t>(call.slots), INT64_MAX), last(static_cast<size_t>(call.slots), -1),
        count(static_cast<size_t>(call.slots), 0);
    for (int64_t r = 0; r < M; r++) {
        const int64_t c = row_of ? row_of[r] : r;
        first[c] = std::min(first[c], pos[r]);
        last[c] = std::max(last[c], pos[r]);
        count[c]++;
    }
    copy_of.assign(static_cast<size_t>(call.slots), -1);
    std::vector<RingCopy> copies;
    for (int64_t c = 0; c < call.slots; c++) {
        if (count[c] < 2 || last[c] < W) continue;
        check(last[c] - first[c] + 1 == count[c], "qkv::decoder_layer: a ring row's tokens in one call must lie at "
              "consecutive positions, one token each");
        RingCopy copy;
        copy.base = std::max<int64_t>(0, first[c] - call.L.window + 1);
        copy.n = last[c] - copy.base + 1;
        copy.k.resize(static_cast<size_t>(Hkv * copy.n * D));
        copy.v.resize(static_cast<size_t>(Hkv * copy.n * D));
        copy.held.reset(new bool[static_cast<size_t>(copy.n)]());
        const int64_t *kp = call.ring + c * S;
        for (int64_t x = copy.base; x < first[c]; x++) {  // what the ring holds of the positions before the call's
            const int64_t slot = x % W, i = x - copy.base;
            if (kp[slot] != x) continue;
            copy.held[i] = true;
            for (int64_t g = 0; g < Hkv; g++) {
                const int64_t from = ((c * Hkv + g) * S + slot) * D;
                std::copy(call.k_cache + from, call.k_cache + from + D, copy.k.data() + (g * copy.n + i) * D);
                std::copy(call.v_cache + from, call.v_cache + from + D, copy.v.data() + (g * copy.n + i) * D);
            }
        }
        copy_of[c] = static_cast<int64_t>(copies.size());
        copies.push_back(std::move(copy));
    }
    return copies;
}

}  // namespace qkv
