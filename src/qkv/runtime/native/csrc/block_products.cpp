// Matrix products straight from GGUF's stored blocks (block_format.h's table: Q4_0 .. Q8_0,
// Q2_K .. Q6_K, IQ4_NL, F16, BF16), on activations rounded as the weight type multiplies them
// (F16 / BF16: not rounded).
//
//   qkv::block_linear(x (M, K) f32, blocks (N, K / W * Z) u8, int block_type, Tensor? bias (N,) f32)
//       -> (M, N) f32: y = x' @ w^T + bias, w the (N, K) weights the blocks stand for and x' the
//       activations rounded per 32 (32-blocks) or per 256 (K-quants) or as they are (F16, BF16),
//       block_format.h; in the
//       active variant (qkv::set_variant caps it), as qkv's whole-layer kernel runs a block layer
//   qkv::block_decode(blocks (N, K / W * Z) u8, int block_type, int K) -> (N, K) f32: the table's
//       generic decode (the gguf library's float32 values)
//   qkv::block_table(Tensor like) -> (types, 4) i64: the table itself (type id, W, Z, activation
//       step: 0 for activations not rounded), which the tests hold against the gguf package's
//       GGML_QUANT_SIZES
//
// The product is the dequantized weights times the rounded activations: every block's integer
// sum is exact, and the generic C++ (the reference), AVX2 and AVX-512 differ only in the order
// of the float32 sums of those (AVX2 and AVX-512 not at all: the same kernels, block_x86.h; the
// grid types not at all: every variant adds their super-blocks' sums in the generic order);
// F16 / BF16 are float32 sums of w x throughout, the variants' order the generic one's but for
// its lanes.
// Each output is computed by the same operations whatever M is (batch invariance): four or more
// rows run in tiles (block_format.h's Tile), whose outputs are the one-row kernels' bits.
// A tile's prepared activations (AVX-512's) are about 1 to 2.1 bytes an input, less than x itself.
//
// Shape legend: M rows of x, K inputs, N outputs.
#include "block_format.h"
#include "kernels.h"
#include "repacked/iq4xs.h"
#include "repacked/q4k.h"
#include "repacked/q6k.h"
#include "repacked/q8_0.h"

#include <atomic>
#include <vector>

namespace qkv {
namespace blocks {

#if QKV_X86
RowDot avx2_dot(int64_t type);    // block_avx2.cpp
RowDot avx512_dot(int64_t type);  // block_avx512.cpp
RowsDot avx2_rows(int64_t type);
RowsDot avx512_rows(int64_t type);
Tile avx2_tile(int64_t type);    // block_avx2.cpp
Tile avx512_tile(int64_t type);  // block_avx512.cpp
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

constexpr int64_t PIECE = 32;  // outputs a thread claims at a time in a prompt's product (whole tiles)

Tile tile_of(int64_t type, Variant v) {
#if QKV_X86
    if (v >= AVX512) return avx512_tile(type);
    if (v >= AVX2) return avx2_tile(type);
#endif
    (void)type, (void)v;
    return {};
}

// Each part's activations as its tile reads them (at[p] null where the tile reads xs as they
// are), made before a product's outputs are split over the threads.
struct PreparedParts {
    std::vector<uint8_t> bytes[MAX_PARTS];
    const void *at[MAX_PARTS] = {};
};

// rows[kind]: each row of x as the activations of that kind (block_format.h's Activation) hold it.
void prepare_parts(const Linear &L, const std::vector<XRow> *rows, int64_t M, Variant v, PreparedParts &out) {
    for (int64_t p = 0; p < L.part_count; p++) {
        const Tile tile = tile_of(L.parts[p].type, v);
        if (tile.prepare == nullptr || M < TILE_ROWS) continue;
        std::vector<uint8_t> &bytes = out.bytes[p];
        bytes.resize(static_cast<size_t>(tile.prepared_bytes(M, L.K) + 64));
        uint8_t *at = bytes.data() + (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64;
        tile.prepare(rows[traits_of(L.parts[p].type)->activation].data(), M, L.K, at);
        out.at[p] = at;
    }
}

// Outputs [n0, n1) of rows [0, M) of y (ldo apart; bias[n] added where not null) from rows
// [n0, n1) of `blocks`, in whole tiles (n1 - n0 a multiple of tile.nr), a band of rows at a time.
void run_tiles(const Tile &tile, const uint8_t *blocks, int64_t row_bytes, int64_t n0, int64_t n1, const XRow *xs,
               int64_t M, int64_t K, const void *prepared, const float *bias, float *y, int64_t ldo) {
    const int64_t rows = tile.band_rows ? tile.band_rows(K) : BAND;
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const void *band = prepared ? static_cast<const uint8_t *>(prepared) + tile.prepared_bytes(m0, K) : nullptr;
        for (int64_t n = n0; n < n1; n += tile.nr)
            tile.run(blocks + n * row_bytes, row_bytes, xs + m0, std::min(rows, M - m0), K, band, y + m0 * ldo + n, ldo);
    }
    if (bias != nullptr)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) y[m * ldo + n] += bias[n];
}

bool is_repacked(int64_t type) {
    return type == Q4_K_X16 || type == Q5_K_X16 || type == Q6_K_X16 || type == IQ4_XS_X16 || type == Q8_0_X16 ||
           type == Q5_0_X16;
}

// The activations of a long prompt go through a product in groups of rows, each group's bytes
// (float32 rows and their chunked copy: 8 bytes an input; rounded rows and Prepared256's pairs:
// about 3) within ROW_GROUP_BYTES, so that they stay in L3 while every piece of weights reads
// them: all 512 rows at once, 16 MiB at K = 8192 in float32, came from memory for every piece of
// PIECE outputs. A whole number of BANDs, so the tiles' prepared layouts start where a band does.
constexpr int64_t ROW_GROUP_BYTES = 4 * 1024 * 1024;

int64_t row_group_rows(const Linear &L) {
    int64_t per_input = 3;
    for (int64_t p = 0; p < L.part_count; p++)
        if (traits_of(L.parts[p].type)->activation == FLOAT) per_input = 8;
    const int64_t rows = ROW_GROUP_BYTES / (L.K * per_input) / BAND * BAND;
    return std::max(BAND, rows);
}

}  // namespace blocks

void apply_blocks(const Linear &L, const float *x, float *y, int64_t M) {
    using namespace blocks;
    bool used[ACTIVATIONS] = {};
    for (int64_t p = 0; p < L.part_count; p++) used[traits_of(L.parts[p].type)->activation] = true;
    const Variant variant = active_variant();
    Rounded rounded[ACTIVATIONS];   // x as each kind of activations the parts multiply
    std::vector<XRow> rows[ACTIVATIONS];  // each row of those's pointers, made once
    for (int kind = 0; kind < ACTIVATIONS; kind++) {
        if (!used[kind]) continue;
        rounded[kind] = round_activations(x, M, L.K, static_cast<Activation>(kind), variant >= AVX2);
        rows[kind].resize(static_cast<size_t>(M));
        for (int64_t m = 0; m < M; m++) rows[kind][m] = row_of(rounded[kind], m);
    }
    const XRow *rows256 = rows[PER256].data();
    PreparedParts prepared;
    prepare_parts(L, rows, M, variant, prepared);
    std::vector<int32_t> sums256, code_sums32, offsets16;  // the rows' words the repacked kernels read (minimum sums, code sums, Q6_K's offsets), made once a product
    for (int64_t p = 0; p < L.part_count; p++) {
        const int64_t type = L.parts[p].type;
        if ((type == Q4_K_X16 || type == Q5_K_X16) && sums256.empty()) sums256 = q4k::row_words(rows256, M, L.K);
        if ((type == Q8_0_X16 || type == Q5_0_X16) && code_sums32.empty()) code_sums32 = q8_0::row_words(rows[PER32].data(), M, L.K);
        if (type == Q6_K_X16 && offsets16.empty()) offsets16 = q6k::row_words(rows256, M, L.K);
    }
    // Outputs [n0, n1) of `part` (its rows `first` + n0 .. in y) for rows [m0, m1) of x; the
    // repacked kinds take every row at once (m0 = 0, m1 = M: row_group_rows never cuts them).
    auto outputs_of_rows = [&](const BlockPart &part, int64_t n0, int64_t n1, int64_t first, int64_t m0, int64_t m1) {
        if (part.type == Q4_K_X16 || part.type == Q5_K_X16)  // whole groups of 16 rows (for_each_part's chunks and PIECE keep them whole)
            return q4k::rows(part, rows256, sums256.data(), M, L.K, L.N, n0, n1, first, L.bias ? L.bias + first : nullptr, y,
                             variant);
        if (part.type == Q6_K_X16)
            return q6k::rows(part, rows256, offsets16.data(), M, L.K, L.N, n0, n1, first, L.bias ? L.bias + first : nullptr, y,
                             variant);
        if (part.type == IQ4_XS_X16)
            return iq4xs::rows(part, rows256, M, L.K, L.N, n0, n1, first, L.bias ? L.bias + first : nullptr, y, variant);
        if (part.type == Q8_0_X16 || part.type == Q5_0_X16)
            return q8_0::rows(part, rows[PER32].data(), code_sums32.data(), M, L.K, L.N, n0, n1, first,
                              L.bias ? L.bias + first : nullptr, y, variant);
        const RowDot dot = dot_of(part.type, variant);
        const RowsDot several = rows_of(part.type, variant);
        const XRow *xs = rows[traits_of(part.type)->activation].data() + m0;
        const int64_t count = m1 - m0;  // rows of x here
        float *out = y + m0 * L.N + first;
        const float *bias = L.bias ? L.bias + first : nullptr;
        // whole tiles where the variant has them (block_format.h's Tile: the same bits), the one-row kernels past them
        const Tile tile = tile_of(part.type, variant);
        int64_t n = tile.run && count >= TILE_ROWS ? n0 + (n1 - n0) / tile.nr * tile.nr : n0;
        if (n > n0) {
            const uint8_t *at = static_cast<const uint8_t *>(prepared.at[&part - L.parts]);
            run_tiles(tile, part.blocks, part.row_bytes, n0, n, xs, count, L.K, at ? at + tile.prepared_bytes(m0, L.K) : nullptr,
                      bias, out, L.N);
        }
        if (several != nullptr)
            for (; n + FOUR <= n1; n += FOUR) {
                const uint8_t *row = part.blocks + n * part.row_bytes;
                for (int64_t m = 0; m < count; m++) {
                    float s[FOUR];
                    several(row, part.row_bytes, xs[m], L.K, s);
                    for (int r = 0; r < FOUR; r++) out[m * L.N + n + r] = bias ? s[r] + bias[n + r] : s[r];
                }
            }
        for (; n < n1; n++) {
            const uint8_t *row = part.blocks + n * part.row_bytes;
            for (int64_t m = 0; m < count; m++) {
                const float s = dot(row, xs[m], L.K);
                out[m * L.N + n] = bias ? s + bias[n] : s;
            }
        }
    };
    auto outputs = [&](const BlockPart &part, int64_t n0, int64_t n1, int64_t first) {
        outputs_of_rows(part, n0, n1, first, 0, M);
    };
    if (M < TILE_ROWS) return for_each_part(L, outputs);
    // A prompt: pieces of PIECE outputs claimed one at a time by whichever thread is free, so a
    // core another process holds slows only the pieces it takes (which thread computes an output
    // changes none of its operations). A long prompt's rows go in groups (row_group_rows), all
    // pieces of a group before the next, so the threads share the group's activations in cache.
    struct Piece { const BlockPart *part; int64_t n0, n1, first, m0, m1; };
    std::vector<Piece> pieces;
    const int64_t group = row_group_rows(L);
    for (int64_t m0 = 0; m0 < M; m0 += group)
        for (int64_t p = 0, first = 0; p < L.part_count; first += L.parts[p].rows, p++) {
            const bool whole = is_repacked(L.parts[p].type);
            if (whole && m0 > 0) continue;  // the repacked kinds: every row in the first group's pieces
            for (int64_t n = 0; n < L.parts[p].rows; n += PIECE)
                pieces.push_back({&L.parts[p], n, std::min(L.parts[p].rows, n + PIECE), first, whole ? 0 : m0,
                                  whole ? M : std::min(M, m0 + group)});
        }
    std::atomic<size_t> next{0};
    const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
    torch::stable::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        for (size_t i = next++; i < pieces.size(); i = next++) {
            const Piece &c = pieces[i];
            outputs_of_rows(*c.part, c.n0, c.n1, c.first, c.m0, c.m1);
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

Tensor block_table(Tensor like) {  // (types, 4) int64: type id, weights, bytes, activation step (0: not rounded)
    int64_t count = 0;
    const blocks::Traits *table = blocks::all_traits(count);
    Tensor out = torch::stable::new_empty(like, {count, 4}, ScalarType::Long);
    int64_t *o = static_cast<int64_t *>(out.data_ptr());
    for (int64_t i = 0; i < count; i++) {
        const blocks::Traits &t = table[i];
        o[4 * i] = t.type, o[4 * i + 1] = t.weights, o[4 * i + 2] = t.bytes, o[4 * i + 3] = t.activation == blocks::PER32 ? 32 : t.activation == blocks::PER256 ? 256 : 0;
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
