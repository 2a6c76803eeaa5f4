"""Perplexity of SmolLM2-135M-Instruct (float32 weights) read through each KV cache kind.

    .venv/bin/python benchmarks/kv_cache.py TOKENS KIND[:option=value...] ...
    e.g. benchmarks/kv_cache.py 512 full int4 int2 int2:key_axis=token sink:sinks=4:window=252

The first TOKENS tokens of ../shared/data/the-verdict.txt, fed 32 at a time (see
qkv.generation.cache_kinds.cached_perplexity). Not a test: numbers go to RESULTS.md.
"""
import sys, time, torch
from qkv.perf.prepare import load_for_generation
from qkv.generation.cache_kinds import cache_kind, cached_perplexity
torch.set_num_threads(2)
model, tok, _ = load_for_generation("smollm2", precision="float32", compile=False)
ids = torch.tensor(tok.encode(open(__import__("pathlib").Path(__file__).resolve().parents[2] / "shared" / "data" / "the-verdict.txt").read()).ids)[: int(sys.argv[1])]
print("tokens", ids.numel(), "context", model.context_length, flush=True)
for spec in sys.argv[2:]:
    name, *opts = spec.split(":")
    kw = dict(o.split("=") for o in opts)
    kw = {k: (v if k == "key_axis" else int(v)) for k, v in kw.items()}
    t = time.time()
    r = cached_perplexity(model, ids, cache_kind(name, **kw), capacity=ids.numel())
    print(f"{spec:40s} ppl {r.perplexity:.3f} nll {r.nll:.4f} bytes {r.cache_nbytes} slices {[round(x,2) for x in r.window_nll]} {time.time()-t:.0f}s", flush=True)
