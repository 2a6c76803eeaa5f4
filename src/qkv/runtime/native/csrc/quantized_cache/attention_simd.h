// The vectorised body of qkv::quantized_decode_attention (quantized_cache/attention.cpp), written
// once over a vector type `I` (I::W float lanes) and included twice by that file: once for
// AVX2 and once inside an AVX-512 target region, each time in its own namespace, so each copy
// is compiled for its own instruction set. No include guard on purpose; it includes nothing
// itself (attention.cpp includes the intrinsics and defines `View` first).
//
// The math is the generic reference's (attention.cpp, `attend_generic`): per key,
// dequantize its codes in registers (code * scale + zero), rotate it at its position when the
// cache rotates keys, and take its dot product with every query head of the group (read once
// for all of them); exponentials of the scores less their maximum; then the values, dequantized
// likewise, weighted and summed in float32, for one span of keys. Only the order of the float32
// sums differs.
//
// Shape legend: n keys of a span, D head size of keys, D_v of values, NH query heads of a block.

// Eight (AVX2) or sixteen (AVX-512) codes of `bits` bits starting at code `c` of a packed row.
template <class I>
inline typename I::V codes_at(const uint8_t *row, int64_t c, int64_t bits) {
    if (bits == 4) return I::codes4(row + c / 2);
    if (bits == 2) return I::codes2(row + c / 4);
    return I::codes8(row + c);
}

// exp of I::W floats: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2], p a degree-6
// polynomial (Taylor coefficients, relative error below 2e-7 on that interval).
template <class I>
inline typename I::V exp_v(typename I::V x) {
    using V = typename I::V;
    x = I::max(I::min(x, I::set1(88.3f)), I::set1(-87.3f));
    const V n = I::floor(I::fma(x, I::set1(1.44269504088896341f), I::set1(0.5f)));
    V r = I::fma(n, I::set1(-0.693359375f), x);
    r = I::fma(n, I::set1(2.12194440e-4f), r);
    V p = I::set1(1.f / 720.f);
    p = I::fma(p, r, I::set1(1.f / 120.f));
    p = I::fma(p, r, I::set1(1.f / 24.f));
    p = I::fma(p, r, I::set1(1.f / 6.f));
    p = I::fma(p, r, I::set1(0.5f));
    p = I::fma(p, r, I::set1(1.f));
    p = I::fma(p, r, I::set1(1.f));
    return I::mul(p, I::pow2(n));
}

// I::W channels of one key from channel c on: its stored row (sink or tail) or its codes
// dequantized with its group's per-channel statistics (or its own per-token ones).
template <class I>
inline typename I::V key_chunk(const View &w, const KeyRow &row, int64_t c) {
    if (row.exact) return I::load(row.exact + c);
    const typename I::V codes = codes_at<I>(row.codes, c, w.bits);
    if (w.keys_per_channel) return I::fma(codes, I::load(row.scale + c), I::load(row.zero + c));
    const int64_t g = c / w.key_channels;
    return I::fma(codes, I::set1(row.scale[g]), I::set1(row.zero[g]));
}

// The same for values, whose statistics are per token: g is the channel group of channel c.
template <class I>
inline typename I::V value_chunk(const View &w, const ValueRow &row, int64_t c, int64_t g) {
    if (row.exact) return I::load(row.exact + c);
    return I::fma(codes_at<I>(row.codes, c, w.bits), I::set1(row.scale[g]), I::set1(row.zero[g]));
}

// Calls f(s, row) for the keys (KEYS) or values s0 .. s1 - 1 in order: the rows View::key_row
// and View::value_row give, found with one division per group of slots rather than per key.
template <bool KEYS, class F>
inline void for_rows(const View &w, int64_t bk, int64_t s0, int64_t s1, F &&f) {
    const int64_t dim = KEYS ? w.D : w.Dv, bytes = dim * w.bits / 8;
    const float *sinks = (KEYS ? w.sink_k : w.sink_v) + bk * w.Ns * dim;
    const float *tail = (KEYS ? w.tail_k : w.tail_v) + bk * w.P * dim;
    const uint8_t *codes = (KEYS ? w.k_codes : w.v_codes) + bk * w.N * bytes;
    const float *scale = KEYS ? w.k_scale : w.v_scale, *zero = KEYS ? w.k_zero : w.v_zero;
    const bool grouped = KEYS && w.keys_per_channel;
    const int64_t per_row = grouped ? 0 : dim / (KEYS ? w.key_channels : w.value_channels);
    KeyRow r;
    int64_t s = s0;
    for (; s < std::min(s1, w.n_sink); s++) {
        r.exact = sinks + s * dim;
        f(s, r);
    }
    r.exact = nullptr;
    const int64_t slots_end = std::min(s1, w.n_sink + w.n_slot);
    while (s < slots_end) {
        int64_t end = slots_end;
        if (grouped) {
            const int64_t g = (s - w.n_sink) / w.G;
            end = std::min(slots_end, w.n_sink + (g + 1) * w.G);
            r.scale = scale + (bk * (w.N / w.G) + g) * dim;
            r.zero = zero + (bk * (w.N / w.G) + g) * dim;
        }
        for (; s < end; s++) {
            const int64_t i = s - w.n_sink;
            r.codes = codes + i * bytes;
            if (!grouped) r.scale = scale + (bk * w.N + i) * per_row, r.zero = zero + (bk * w.N + i) * per_row;
            f(s, r);
        }
    }
    for (; s < s1; s++) {
        r.exact = tail + (s - w.n_sink - w.n_slot) * dim;
        f(s, r);
    }
}

// Scores of the NH query heads `q` (NH rows of D) against keys s0 .. s1 - 1, scaled:
// scores[h * n + s - s0], n = s1 - s0.
template <class I, int NH>
void key_pass(const View &w, int64_t bk, int64_t s0, int64_t s1, const float *q, float *scores) {
    using V = typename I::V;
    const int64_t n = s1 - s0, D = w.D, half = D / 2;
    for_rows<true>(w, bk, s0, s1, [&](int64_t s, const KeyRow &row) {
        V acc[NH];
        for (int h = 0; h < NH; h++) acc[h] = I::zero();
        if (w.cos) {
            const float *cs = w.cos + s * half, *sn = w.sin + s * half;
            for (int64_t i = 0; i < half; i += I::W) {
                const V a = key_chunk<I>(w, row, i), b = key_chunk<I>(w, row, i + half);
                const V c = I::load(cs + i), si = I::load(sn + i);
                const V lo = I::fnma(b, si, I::mul(a, c)), hi = I::fma(a, si, I::mul(b, c));  // RoPE, rotate-half
                for (int h = 0; h < NH; h++)
                    acc[h] = I::fma(I::load(q + h * D + i + half), hi, I::fma(I::load(q + h * D + i), lo, acc[h]));
            }
        } else {
            for (int64_t i = 0; i < D; i += I::W) {
                const V k = key_chunk<I>(w, row, i);
                for (int h = 0; h < NH; h++) acc[h] = I::fma(I::load(q + h * D + i), k, acc[h]);
            }
        }
        float dots[4];
        I::template sums<NH>(acc, dots);
        for (int h = 0; h < NH; h++) scores[h * n + s - s0] = dots[h] * w.scale;
    });
}

// exp(x - top) of one head's n scores in place, top their maximum; returns their sum (>= 1).
template <class I>
float exponentials(float *x, int64_t n, float *top_out) {
    using V = typename I::V;
    float top = -INFINITY;
    for (int64_t s = 0; s < n; s++) top = std::max(top, x[s]);
    *top_out = top;
    const V shift = I::set1(top);
    V sums = I::zero();
    int64_t s = 0;
    for (; s + I::W <= n; s += I::W) {
        const V e = exp_v<I>(I::sub(I::load(x + s), shift));
        I::store(x + s, e);
        sums = I::add(sums, e);
    }
    float total = I::sum(sums);
    for (; s < n; s++) {
        x[s] = std::exp(x[s] - top);
        total += x[s];
    }
    return total;
}

// out[h * D_v + j] = sum over s0 <= s < s1 of weights[h * n + s - s0] * value_s[j], I::VALUE_VECTORS
// vectors of channels a pass (all of SmolLM2's 64 with AVX-512) so that the NH x VALUE_VECTORS
// sums stay in registers and each value row is read once a pass.
template <class I, int NH>
void value_pass(const View &w, int64_t bk, int64_t s0, int64_t s1, const float *weights, float *out) {
    using V = typename I::V;
    constexpr int VV = I::VALUE_VECTORS;
    const int64_t n = s1 - s0, Dv = w.Dv;
    for (int64_t c = 0; c < Dv; c += VV * I::W) {
        const int count = static_cast<int>(std::min<int64_t>(VV, (Dv - c) / I::W));
        int64_t g[VV];
        for (int u = 0; u < VV; u++) g[u] = (c + u * I::W) / w.value_channels;
        V acc[NH][VV];
        for (int h = 0; h < NH; h++)
            for (int u = 0; u < VV; u++) acc[h][u] = I::zero();
        for_rows<false>(w, bk, s0, s1, [&](int64_t s, const ValueRow &row) {
            V v[VV];
            for (int u = 0; u < VV; u++) v[u] = u < count ? value_chunk<I>(w, row, c + u * I::W, g[u]) : I::zero();
            for (int h = 0; h < NH; h++) {
                const V p = I::set1(weights[h * n + s - s0]);
                for (int u = 0; u < VV; u++) acc[h][u] = I::fma(p, v[u], acc[h][u]);
            }
        });
        for (int h = 0; h < NH; h++)
            for (int u = 0; u < count; u++) I::store(out + h * Dv + c + u * I::W, acc[h][u]);
    }
}

// NH query heads (q: NH rows of D) of KV head bk over keys s0 .. s1 - 1 (s1 > s0): their
// unnormalised context (NH rows of D_v), score maximum and sum of exponentials.
template <class I, int NH>
void attend_block(const View &w, int64_t bk, int64_t s0, int64_t s1, const float *q, Part part, float *scores) {
    const int64_t n = s1 - s0;
    key_pass<I, NH>(w, bk, s0, s1, q, scores);
    for (int h = 0; h < NH; h++) part.total[h] = exponentials<I>(scores + h * n, n, part.top + h);
    value_pass<I, NH>(w, bk, s0, s1, scores, part.out);
}

// Every query head of KV head bk, in blocks of up to four heads (their sums in registers).
inline void attend_heads(const View &w, int64_t bk, int64_t s0, int64_t s1, const float *q, Part part,
                         float *scores) {
    for (int64_t h0 = 0; h0 < w.group; h0 += 4) {
        const Part p = part.at(h0, w.Dv);
        const float *qh = q + h0 * w.D;
        switch (std::min<int64_t>(4, w.group - h0)) {
            case 1: attend_block<Lanes, 1>(w, bk, s0, s1, qh, p, scores); break;
            case 2: attend_block<Lanes, 2>(w, bk, s0, s1, qh, p, scores); break;
            case 3: attend_block<Lanes, 3>(w, bk, s0, s1, qh, p, scores); break;
            default: attend_block<Lanes, 4>(w, bk, s0, s1, qh, p, scores); break;
        }
    }
}
