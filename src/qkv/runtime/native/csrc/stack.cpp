// A whole model's decode step in one call: every layer, then the final norm and the head.
//
// A session binds its caches once; the layers' descriptions and linear lists are checked then
// (layer.cpp's LayerCall) and kept here under a handle, so a step is one call that parses
// nothing: for SmolLM2 one call instead of thirty `qkv::decoder_layer` calls, each of which
// re-read its description, and the head's norm and product in Python.
//
//   h = qkv::stack_open()                                          -> a handle (int)
//   qkv::stack_add_layer(h, C, spec, vectors, qkv, o, up, down, k_cache!, v_cache!, lengths!, key_positions!?)
//   qkv::stack_set_head(h, norm_kind, eps, norm [weight, bias?], head [linear], softcap)   (optional)
//   qkv::stack_step(h, x (B, C), positions (B,), rows (B,)?, head_rows (R,)?)
//                                                                  -> logits (B or R, V), or (B, C) without a head
//   qkv::stack_close(h)
//
// The math is layer.cpp's run_layer per layer, in order, then norm(x) and the head's product
// (then cap * tanh(logits / cap) where softcap > 0): what the layers as separate calls and the
// model's own head compute. The kept tensors (weights, caches) live until stack_close.
//
// Rows of x may share a cache row at consecutive positions: a prompt's tokens, whose keys and
// values every layer writes before any of its queries attends (run_layer), so query p sees the
// prompt's keys up to p as a prefill does (on a sliding-window ring, a piece past the window
// reads a copy of the ring taken before its writes: layer.cpp). `head_rows` names the rows of x whose
// logits are wanted (a prompt's last token): the head, most of a short prompt's work on a large
// vocabulary, runs on those rows only.
//
// Shape legend: B rows, C hidden size, V vocabulary (the head's outputs).
#include "kernels.h"

#include <math.h>

#include <memory>
#include <mutex>
#include <unordered_map>

namespace qkv {
namespace {

struct Stack {
    std::vector<LayerCall> layers;
    bool has_head = false;
    Norm norm;
    Linear head;
    float softcap = 0.f;
    std::vector<Tensor> kept;  // every tensor the layers and the head point into
};

std::mutex registry_lock;
std::unordered_map<int64_t, std::shared_ptr<Stack>> stacks;
int64_t next_handle = 1;

std::shared_ptr<Stack> stack_at(int64_t handle) {
    std::lock_guard<std::mutex> guard(registry_lock);
    const auto found = stacks.find(handle);
    check(found != stacks.end(), "qkv::stack: no open stack under this handle (closed, or never opened)");
    return found->second;
}

int64_t stack_open() {
    std::lock_guard<std::mutex> guard(registry_lock);
    const int64_t handle = next_handle++;
    stacks.emplace(handle, std::make_shared<Stack>());
    return handle;
}

int64_t stack_add_layer(int64_t handle, int64_t hidden, Tensor spec, std::vector<Tensor> vectors,
                        std::vector<Tensor> qkv, std::vector<Tensor> o, std::vector<Tensor> up, std::vector<Tensor> down,
                        Tensor k_cache, Tensor v_cache, Tensor lengths, std::optional<Tensor> key_positions) {
    const std::shared_ptr<Stack> stack = stack_at(handle);
    check(!stack->has_head, "qkv::stack_add_layer: the head is already set (add every layer first)");
    check(hidden > 0 && (stack->layers.empty() || stack->layers.front().C == hidden),
          "qkv::stack_add_layer: every layer takes the same positive hidden size");
    stack->layers.push_back(layer_call(hidden, spec, vectors, qkv, o, up, down, k_cache, v_cache, lengths, key_positions));
    for (const auto *list : {&vectors, &qkv, &o, &up, &down}) stack->kept.insert(stack->kept.end(), list->begin(), list->end());
    stack->kept.insert(stack->kept.end(), {spec, k_cache, v_cache, lengths});
    if (key_positions.has_value()) stack->kept.push_back(*key_positions);
    return static_cast<int64_t>(stack->layers.size());
}

int64_t stack_set_head(int64_t handle, int64_t norm_kind, double eps, std::vector<Tensor> norm, std::vector<Tensor> head,
                       double softcap) {
    const std::shared_ptr<Stack> stack = stack_at(handle);
    check(!stack->layers.empty(), "qkv::stack_set_head: add the layers first");
    check(softcap >= 0.0, "qkv::stack_set_head: softcap must be >= 0 (0: none)");
    const int64_t C = stack->layers.front().C;
    size_t next = 0;
    stack->norm = norm_of(norm_kind, eps, norm, next, C);
    check(next == norm.size(), "qkv::stack_set_head: more norm vectors than the norm kind takes");
    stack->head = linear_of(head, C, "qkv::stack_set_head: head is not a linear layer of C inputs");
    stack->softcap = static_cast<float>(softcap);
    stack->kept.insert(stack->kept.end(), norm.begin(), norm.end());
    stack->kept.insert(stack->kept.end(), head.begin(), head.end());
    stack->has_head = true;
    return stack->head.N;
}

Tensor stack_step(int64_t handle, Tensor x, Tensor positions, std::optional<Tensor> rows,
                  std::optional<Tensor> head_rows) {
    using torch::headeronly::ScalarType;
    const std::shared_ptr<Stack> stack = stack_at(handle);
    check(!stack->layers.empty(), "qkv::stack_step: the stack has no layers");
    const int64_t C = stack->layers.front().C;
    check(x.dim() == 2 && x.size(1) == C && x.scalar_type() == ScalarType::Float && x.is_contiguous(),
          "qkv::stack_step takes x (B, C) contiguous float32 of the layers' hidden size");
    const int64_t M = x.size(0);
    check(positions.dim() == 1 && positions.size(0) == M && positions.scalar_type() == ScalarType::Long &&
              positions.is_contiguous(),
          "qkv::stack_step: positions (B,) must be contiguous int64");
    const int64_t *row_of = nullptr;
    if (rows.has_value()) {
        check(rows->dim() == 1 && rows->size(0) == M && rows->scalar_type() == ScalarType::Long && rows->is_contiguous(),
              "qkv::stack_step: rows must be contiguous int64 (B,)");
        row_of = static_cast<const int64_t *>(rows->data_ptr());
    }
    const int64_t *pos = static_cast<const int64_t *>(positions.data_ptr());
    for (const LayerCall &call : stack->layers) check_step(call, M, pos, row_of);
    std::vector<float> y(static_cast<const float *>(x.data_ptr()), static_cast<const float *>(x.data_ptr()) + M * C);
    for (const LayerCall &call : stack->layers) run_layer(call, y.data(), M, pos, row_of);
    if (!stack->has_head) {
        Tensor out = torch::stable::new_empty(x, {M, C});
        std::copy(y.begin(), y.end(), static_cast<float *>(out.data_ptr()));
        return out;
    }
    int64_t R = M;  // the rows the head runs on: every row, or `head_rows` gathered to the front of y
    if (head_rows.has_value()) {
        check(head_rows->dim() == 1 && head_rows->scalar_type() == ScalarType::Long && head_rows->is_contiguous(),
              "qkv::stack_step: head_rows must be contiguous int64 (R,)");
        R = head_rows->size(0);
        const int64_t *wanted = static_cast<const int64_t *>(head_rows->data_ptr());
        std::vector<float> picked(static_cast<size_t>(R * C));
        for (int64_t r = 0; r < R; r++) {
            check(wanted[r] >= 0 && wanted[r] < M, "qkv::stack_step: a head row lies outside x");
            std::copy(y.begin() + wanted[r] * C, y.begin() + (wanted[r] + 1) * C, picked.begin() + r * C);
        }
        y.swap(picked);
    }
    if (stack->norm.kind != NO_NORM)
        for (int64_t r = 0; r < R; r++) normalize(stack->norm, y.data() + r * C, y.data() + r * C);
    const int64_t V = stack->head.N;
    Tensor logits = torch::stable::new_empty(x, {R, V});
    float *out = static_cast<float *>(logits.data_ptr());
    apply(stack->head, y.data(), out, R);
    const float cap = stack->softcap;
    if (cap > 0.f)
        for (int64_t i = 0; i < R * V; i++) out[i] = cap * tanhf(out[i] / cap);
    return logits;
}

int64_t stack_close(int64_t handle) {
    std::lock_guard<std::mutex> guard(registry_lock);
    return static_cast<int64_t>(stacks.erase(handle));
}

}  // namespace
}  // namespace qkv

STABLE_TORCH_LIBRARY_FRAGMENT(qkv, m) {
    m.def("stack_open() -> int");
    m.def("stack_add_layer(int handle, int hidden, Tensor spec, Tensor[] vectors, Tensor[] qkv, Tensor[] o, Tensor[] up, "
          "Tensor[] down, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) lengths, Tensor(d!)? key_positions) -> int");
    m.def("stack_set_head(int handle, int norm_kind, float eps, Tensor[] norm, Tensor[] head, float softcap) -> int");
    m.def("stack_step(int handle, Tensor x, Tensor positions, Tensor? rows, Tensor? head_rows=None) -> Tensor");
    m.def("stack_close(int handle) -> int");
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CPU, m) {
    m.impl("stack_add_layer", TORCH_BOX(&qkv::stack_add_layer));
    m.impl("stack_set_head", TORCH_BOX(&qkv::stack_set_head));
    m.impl("stack_step", TORCH_BOX(&qkv::stack_step));
}

STABLE_TORCH_LIBRARY_IMPL(qkv, CompositeExplicitAutograd, m) {
    m.impl("stack_open", TORCH_BOX(&qkv::stack_open));
    m.impl("stack_close", TORCH_BOX(&qkv::stack_close));
}
