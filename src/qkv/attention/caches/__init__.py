"""KV caches behind one small interface that attention layers call: the full static cache,
the quantized one (KIVI-style), the sink cache (StreamingLLM) and the sliding-window ring."""
